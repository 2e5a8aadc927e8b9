"""Each new family's chat template and a Hugging Face folder with that family's tokenizer layout, for
the chat tests (tests/test_family_chat.py, tests/test_family_oracles.py)."""
from __future__ import annotations

import json
from pathlib import Path

from model_families import CORPUS, hf_model


# Each family's chat template in its format, written for these tests (renders compared with the real
# checkpoints' templates on system / multi-turn / reasoning / parts / refused conversations): Qwen3's
# (ChatML; the reasoning of assistant turns before the last query dropped, enable_thinking), Mistral
# Instruct v0.1's (the system prompt in the first [INST]), Phi-3.5-mini's, Gemma 3's (assistant ->
# model, the system prompt folded into the first turn, text parts trimmed). Tools are not rendered:
# slipstream writes tool prompts itself (tool_calls/).
QWEN3_CHAT = (
    "{%- set ns = namespace(query=messages | length - 1, found=false) -%}"
    "{%- for i in range(messages | length - 1, -1, -1) -%}"
    "{%- set m = messages[i] -%}"
    "{%- if not ns.found and m.role == 'user'"
    " and not (m.content.startswith('<tool_response>') and m.content.endswith('</tool_response>')) -%}"
    "{%- set ns.query = i -%}{%- set ns.found = true -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role in ('system', 'user') -%}"
    "{{- '<|im_start|>' ~ m.role ~ '\\n' ~ m.content ~ '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set answer = m.content -%}{%- set thought = '' -%}"
    "{%- if m.reasoning_content is defined and m.reasoning_content is not none -%}"
    "{%- set thought = m.reasoning_content -%}"
    "{%- elif '</think>' in answer -%}"
    "{%- set thought = answer.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}"
    "{%- set answer = answer.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.query and (loop.last or thought) -%}"
    "{{- '<think>\\n' ~ thought.strip('\\n') ~ '\\n</think>\\n\\n' ~ answer.lstrip('\\n') -}}"
    "{%- else -%}{{- answer -}}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}")
MISTRAL_CHAT = (
    "{%- set ns = namespace(system=none, turns=messages) -%}"
    "{%- if messages and messages[0].role == 'system' -%}"
    "{%- set ns.system = messages[0].content -%}{%- set ns.turns = messages[1:] -%}"
    "{%- endif -%}"
    "{{- bos_token -}}"
    "{%- for m in ns.turns -%}"
    "{%- if (m.role == 'user') != (loop.index0 is even) -%}"
    "{{- raise_exception('after an optional system message, turns go user, assistant, user, ...') -}}"
    "{%- elif m.role == 'user' -%}"
    "{{- ' [INST] ' -}}{%- if loop.first and ns.system is not none -%}{{- ns.system ~ '\\n\\n' -}}{%- endif -%}"
    "{{- m.content ~ ' [/INST]' -}}"
    "{%- elif m.role == 'assistant' -%}{{- ' ' ~ m.content ~ eos_token -}}"
    "{%- else -%}{{- raise_exception('roles: an optional system message, then user and assistant') -}}"
    "{%- endif -%}"
    "{%- endfor -%}")
PHI3_CHAT = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}{%- if m.content -%}{{- '<|system|>\\n' ~ m.content ~ '<|end|>\\n' -}}{%- endif -%}"
    "{%- elif m.role in ('user', 'assistant') -%}{{- '<|' ~ m.role ~ '|>\\n' ~ m.content ~ '<|end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{{- '<|assistant|>\\n' if add_generation_prompt else eos_token -}}")
GEMMA3_CHAT = (
    "{{- bos_token -}}"
    "{%- set ns = namespace(prefix='', turns=messages) -%}"
    "{%- if messages[0].role == 'system' -%}"
    "{%- set first = messages[0].content -%}"
    "{%- set ns.prefix = (first if first is string else first[0].text) ~ '\\n\\n' -%}"
    "{%- set ns.turns = messages[1:] -%}"
    "{%- endif -%}"
    "{%- for m in ns.turns -%}"
    "{%- if (m.role == 'user') != (loop.index0 is even) -%}"
    "{{- raise_exception('after an optional system message, turns go user, assistant, user, ...') -}}"
    "{%- endif -%}"
    "{{- '<start_of_turn>' ~ ('model' if m.role == 'assistant' else m.role) ~ '\\n' -}}"
    "{%- if loop.first -%}{{- ns.prefix -}}{%- endif -%}"
    "{%- if m.content is string -%}{{- m.content | trim -}}"
    "{%- elif m.content is iterable -%}"
    "{%- for part in m.content -%}"
    "{%- if part.type == 'image' -%}{{- '<start_of_image>' -}}"
    "{%- elif part.type == 'text' -%}{{- part.text | trim -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}{{- raise_exception('content: text or a list of parts') -}}"
    "{%- endif -%}"
    "{{- '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}")
CHAT_TEMPLATES = {"qwen3": QWEN3_CHAT, "mistral-sw": MISTRAL_CHAT, "phi3": PHI3_CHAT, "gemma3": GEMMA3_CHAT}

# Each chat family's tokenizer: its control tokens (first, in this order: their ids), the BOS its
# tokenizer.json prepends (None: none), and tokenizer_config's bos / eos strings; generation_config's
# eos ids may list more (Phi-3's <|end|> first, as Phi-3.5's does)
CHAT_TOKENS = {
    "qwen3": dict(specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"], prepend=None,
                  bos=None, eos="<|im_end|>", gen_eos=["<|im_end|>", "<|endoftext|>"], byte_level=True),
    "mistral-sw": dict(specials=["<unk>", "<s>", "</s>"], prepend="<s>", bos="<s>", eos="</s>", gen_eos=["</s>"]),
    "phi3": dict(specials=["<unk>", "<s>", "</s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>",
                           "<|end|>"], prepend=None, bos="<s>", eos="<|endoftext|>",
                 gen_eos=["<|end|>", "<|endoftext|>"]),
    "gemma3": dict(specials=["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>",
                             "<start_of_image>"], prepend="<bos>", bos="<bos>", eos="<eos>",
                   gen_eos=["<eos>", "<end_of_turn>"]),
}


def write_chat_folder(folder: Path, family: str, template: str, in_config: bool, seed: int = 0) -> None:
    """A Hugging Face folder of `family` (hf_model's) with that family's tokenizer layout (CHAT_TOKENS,
    trained on CORPUS with `tokenizers`) and chat `template`: in tokenizer_config.json (`in_config`) or
    in chat_template.jinja."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    spec = CHAT_TOKENS[family]
    specials = spec["specials"]
    if spec.get("byte_level"):
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False, special_tokens=specials,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:  # SentencePiece-style pieces (Llama, Mistral, Phi-3 and Gemma ship such tokenizer.json files)
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False, special_tokens=specials)
    tok.train_from_iterator(CORPUS + ["[INST] [/INST] system user model assistant"], trainer)
    if spec["prepend"] is not None:
        bos_id = tok.token_to_id(spec["prepend"])
        tok.post_processor = processors.TemplateProcessing(single=f"{spec['prepend']} $A",
                                                           pair=f"{spec['prepend']} $A {spec['prepend']} $B",
                                                           special_tokens=[(spec["prepend"], bos_id)])
    kw = {"bos_token": spec["bos"]} if spec["bos"] else {}
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=spec["eos"], **kw)
    vocab = tok.get_vocab_size()
    ids = {s: tok.token_to_id(s) for s in specials}
    gen_eos = [ids[s] for s in spec["gen_eos"]]
    model = hf_model(family, vocab, seed=seed, bos=ids.get(spec["bos"] or "", 0) if spec["bos"] else 0,
                     eos=gen_eos[0])
    model.generation_config.eos_token_id = gen_eos
    model.save_pretrained(folder)
    hf_tok.save_pretrained(folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tcfg_path = folder / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text())
    tcfg.pop("chat_template", None)
    if in_config:
        tcfg["chat_template"] = template
    else:
        (folder / "chat_template.jinja").write_text(template)
    tcfg_path.write_text(json.dumps(tcfg, indent=2))
