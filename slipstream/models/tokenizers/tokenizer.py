"""Tokenizer built from a GGUF's embedded vocabulary or a Hugging Face tokenizer.json, plus streaming detokenisation.

The heavy lifting is done by the `tokenizers` library; this module only assembles the pipeline the
checkpoint describes (byte-level BPE in byte_bpe.py, SentencePiece BPE in spm_tokenizer.py, special
tokens, BOS) and renders chat templates.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as _HFTokenizer

from slipstream.errors import CorruptModelError, UnsupportedArchitectureError
from slipstream.models.json_file import read_json_object
from slipstream.models.tokenizers.byte_bpe import byte_alphabet, byte_level_backend  # noqa: F401 (re-exported for tests)
from slipstream.models.tokenizers.utf8_tail import drop_incomplete_char

TOKEN_TYPE_UNKNOWN = 2  # SentencePiece's <unk>
TOKEN_TYPE_CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL: <|im_start|> and friends
TOKEN_TYPE_USER_DEFINED = 4  # added tokens that are not special (e.g. <think>), matched whole


class _GenerationTag(jinja2.ext.Extension):
    """Accepts HF's `{% generation %}...{% endgeneration %}` marker and renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    """Sandboxed like HF's renderer (trim/lstrip blocks), so templates render byte-identically."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


_GIL_FREE_CHARS = 2048  # as api/encode.py's INLINE_CHARS: longer texts are tokenized off the loop


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the metadata generation needs (EOS ids, chat template)."""

    def __init__(self, backend: _HFTokenizer, *, bos_token_id: int | None, eos_token_ids: Sequence[int],
                 chat_template: str | None, template_tokens: dict[str, str] | None = None) -> None:
        self.backend = backend
        self._bos_token_id = bos_token_id
        self._eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self._chat_template = chat_template
        # the template's bos_token / eos_token where tokenizer_config.json names them (transformers'
        # values): generation_config's eos ids may list another first (Phi-3.5: <|end|>, its
        # tokenizer's eos_token <|endoftext|>)
        self.template_tokens = dict(template_tokens or {})
        self._compiled: jinja2.Template | None = None

    # --- construction ----------------------------------------------------------------------

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any], source: str = "<gguf>") -> Tokenizer:
        """Build from `tokenizer.*` metadata (values already decoded to Python objects): byte-level BPE
        (`gpt2`: SmolLM, Llama-3, Qwen2) or SentencePiece BPE (`llama`: Llama-2, TinyLlama, Mistral)."""
        model = fields.get("tokenizer.ggml.model")
        if model == "llama":
            from slipstream.models.tokenizers.spm_tokenizer import spm_backend

            backend, tokens, types = spm_backend(fields, source)
            spelled: set[str] | None = None
            add_bos_default = True  # llama.cpp adds BOS to SentencePiece vocabularies unless told not to
        elif model == "gpt2":
            backend, tokens, types = byte_level_backend(fields, source)
            spelled = set(byte_alphabet().values())
            add_bos_default = False
        else:
            raise UnsupportedArchitectureError(
                f"{source}: tokenizer model {model!r} is not supported (byte-level BPE 'gpt2' or SentencePiece 'llama')"
            )
        # Control tokens become special (skipped when decoding output); user-defined ones are added
        # whole but stay visible in text, as in transformers. Both always encode to their single id.
        special = [AddedToken(t, special=True, normalized=False)
                   for t, ty in zip(tokens, types)
                   if (ty == TOKEN_TYPE_CONTROL and (spelled is None or set(t) <= spelled))
                   or (ty == TOKEN_TYPE_UNKNOWN and spelled is None)]  # SentencePiece's <unk> is special too
        user = [AddedToken(t, special=False, normalized=False)
                for t, ty in zip(tokens, types) if ty == TOKEN_TYPE_USER_DEFINED]
        backend.add_special_tokens(special)
        if user:
            backend.add_tokens(user)
        bos = fields.get("tokenizer.ggml.bos_token_id")
        if fields.get("tokenizer.ggml.add_bos_token", add_bos_default) and bos is not None:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B:1", special_tokens=[(tokens[bos], bos)]
            )
        eos = [fields[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                   "tokenizer.ggml.eom_token_id") if fields.get(k) is not None]
        return cls(backend, bos_token_id=None if bos is None else int(bos), eos_token_ids=eos,
                   chat_template=fields.get("tokenizer.chat_template"))

    @classmethod
    def from_json(cls, backend_json: str, *, bos_token_id: int | None, eos_token_ids: Sequence[int],
                  chat_template: str | None) -> Tokenizer:
        """Rebuild from `backend.to_str()` plus the metadata (the weight cache stores tokenizers so)."""
        return cls(_HFTokenizer.from_str(backend_json), bos_token_id=bos_token_id, eos_token_ids=eos_token_ids,
                   chat_template=chat_template)

    @classmethod
    def from_file(cls, path: str | Path, tokenizer_config_json: str | Path | None = None) -> Tokenizer:
        """Load a HF tokenizer.json; chat template and EOS come from the sibling config files if present."""
        path = Path(path)
        try:
            backend = _HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
            raise CorruptModelError(f"{path}: not a valid tokenizer.json ({exc})") from exc
        folder = path.parent
        tcfg = read_json_object(Path(tokenizer_config_json) if tokenizer_config_json else folder / "tokenizer_config.json")
        gen = read_json_object(folder / "generation_config.json")
        cfg = read_json_object(folder / "config.json")

        def token_id(value: Any) -> int | None:
            if isinstance(value, dict):  # serialized AddedToken
                value = value.get("content")
            return backend.token_to_id(value) if isinstance(value, str) else None

        eos_raw = gen.get("eos_token_id", cfg.get("eos_token_id"))
        eos: list[int] = [eos_raw] if isinstance(eos_raw, int) else list(eos_raw or [])
        if not eos and (tid := token_id(tcfg.get("eos_token"))) is not None:
            eos = [tid]
        bos = gen.get("bos_token_id", cfg.get("bos_token_id"))
        if bos is None:
            bos = token_id(tcfg.get("bos_token"))
        named = {k: v.get("content") if isinstance(v, dict) else v for k in ("bos_token", "eos_token")
                 if (v := tcfg.get(k)) is not None}
        template_tokens = {k: v for k, v in named.items() if isinstance(v, str)}
        template = tcfg.get("chat_template")
        if isinstance(template, list):  # several named templates: use the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        return cls(backend, bos_token_id=bos, eos_token_ids=eos, chat_template=template,
                   template_tokens=template_tokens)

    # --- vocabulary --------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def id_to_token(self, i: int) -> str | None:
        return self.backend.id_to_token(i)

    def token_to_id(self, s: str) -> int | None:
        return self.backend.token_to_id(s)

    def get_vocab(self) -> dict[str, int]:
        """Token spelling (byte-alphabet form, e.g. 'Ġ1') -> id, added tokens included."""
        return self.backend.get_vocab(with_added_tokens=True)

    # --- text <-> ids ------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of `text`; a BOS is prepended only when the checkpoint's post-processor asks for one
        (never with `add_special_tokens=False`: a rendered chat template, which writes its own).
        A long text goes through encode_batch, which releases the GIL (encode holds it: 0.4 s for
        900 KB), so the event loop runs on while a worker thread tokenizes (api/encode.py)."""
        if len(text) > _GIL_FREE_CHARS:
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render the checkpoint's template the way transformers does (same env, same variables)."""
        if self._chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if self._compiled is None:
            self._compiled = _jinja_env().from_string(self._chat_template)
        if "developer" not in self._chat_template:
            # OpenAI's `developer` role stands for `system` where the template predates it (SmolLM2's would
            # print "<|im_start|>developer" and still add its own default system prompt)
            messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
        tok = self.id_to_token
        variables: dict[str, Any] = {
            "bos_token": tok(self._bos_token_id) if self._bos_token_id is not None else None,
            "eos_token": tok(self._eos_token_ids[0]) if self._eos_token_ids else None,
            **self.template_tokens,
        }
        variables.update(kwargs)
        return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)




class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas, decoding only a short window each step.

    Output text skips special tokens (so <|im_end|> never shows). Text is held back while the
    window's decode ends in U+FFFD (an incomplete UTF-8 sequence split across tokens); `flush()`
    releases whatever is left, except the bytes of a character cut at the end. The concatenation of
    all deltas equals `tokenizer.decode(output_ids, skip_special_tokens=True)` less that cut character.
    """

    _CONTEXT = 5  # prompt tokens kept before the output, for decoders whose spacing depends on context

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None) -> None:
        self.tokenizer = tokenizer
        context = list(prompt_ids or [])[-self._CONTEXT:]
        if tokenizer.decode(context, skip_special_tokens=True).endswith("\ufffd"):
            context = []  # a prompt cut inside a character would corrupt the first delta
        self._ids: list[int] = context
        self._num_context = len(context)
        self.prefix_offset = 0
        self.read_offset = len(context)

    @property
    def output_ids(self) -> list[int]:
        return self._ids[self._num_context:]

    def _window(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self._ids[start:end], skip_special_tokens=True)

    def push(self, token_ids: Iterable[int]) -> str:
        """Append ids; return the newly complete text (may be empty)."""
        self._ids.extend(int(t) for t in token_ids)
        prefix_text = self._window(self.prefix_offset, self.read_offset)
        new_text = self._window(self.prefix_offset)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self._ids)
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """Release held-back text at the end of the sequence. A character the output stops inside
        of is dropped (utf8_tail.py); a U+FFFD the model spelled out in full is kept."""
        prefix_text = self._window(self.prefix_offset, self.read_offset)
        new_text = self._window(self.prefix_offset)
        tail = drop_incomplete_char(self.tokenizer, self._ids[self.read_offset:], new_text[len(prefix_text):])
        self.prefix_offset = self.read_offset = len(self._ids)
        return tail
