"""A tiny random-weight Idefics3 (SmolVLM architecture) saved as a Hugging Face folder, built offline.

Vision: hidden 32, 2 layers, 64x64 tiles of 16x16 patches; text (Llama): hidden 64, 2 layers, 4 query /
2 KV heads; scale_factor 2, so a tile gives (64/16)^2 / 2^2 = 4 `<image>` tokens. The tokenizer is
character-level (printable ASCII and newline) plus the Idefics3 special tokens. The image processor
resizes to longest edge 128 and cuts 64x64 tiles, so a 100x150 image gives 2x2 tiles + the global view.

Weights are drawn from one seeded generator with a scale that keeps activations well-conditioned
(transformers' own init is std 0.02, which makes every logit nearly equal and greedy ties likely).
transformers is a test-only dependency: import this module only from tests.
"""
from __future__ import annotations

from pathlib import Path

import pytest

SEED = 1234
TILE = 64  # vision image_size == max_image_size.longest_edge
LONGEST_EDGE = 2 * TILE
IMAGE_SEQ_LEN = (TILE // 16) ** 2 // 2 ** 2

SPECIAL_TOKENS = ["<unk>", "<|im_start|>", "<|im_end|>", "<end_of_utterance>", "<fake_token_around_image>",
                  "<image>", "<global-img>"] + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]

# SmolVLM's layout: "User:<image>text<end_of_utterance>\nAssistant:" (image parts and text parts in order).
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}"
    "{% else %}{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def _char_tokenizer():
    """A `tokenizers` BPE with single characters and no merges: every character is one token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok, len(vocab)


def _reinit(model, seed: int) -> None:
    """Overwrite every parameter from a seeded generator: ~1/sqrt(fan_in) for matrices, 1 +- 0.1 for
    norm scales, small values for biases. Deterministic and independent of transformers' init order."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() == 1:
                base = 1.0 if "norm" in name and name.endswith("weight") else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) / fan_in ** 0.5)


def tiny_idefics3_folder(path: str | Path) -> Path:
    """Build the tiny Idefics3 and save_pretrained model, processor and tokenizer into `path`."""
    import torch
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil,
                              Idefics3Processor, PreTrainedTokenizerFast)

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    backend, vocab_size = _char_tokenizer()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>",
                                        eos_token="<end_of_utterance>", pad_token="<|im_end|>", unk_token="<unk>")
    image_token_id = backend.token_to_id("<image>")
    config = Idefics3Config(
        image_token_id=image_token_id,
        scale_factor=2,
        tie_word_embeddings=False,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=TILE, patch_size=16, num_channels=3),
        text_config=dict(model_type="llama", vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
                         tie_word_embeddings=False, bos_token_id=backend.token_to_id("<|im_start|>"),
                         eos_token_id=backend.token_to_id("<end_of_utterance>"),
                         pad_token_id=backend.token_to_id("<|im_end|>")),
    )
    torch.manual_seed(SEED)
    model = Idefics3ForConditionalGeneration(config).eval()
    _reinit(model, SEED)
    model.save_pretrained(folder)
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": LONGEST_EDGE},
                                                max_image_size={"longest_edge": TILE})
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                  image_seq_len=IMAGE_SEQ_LEN, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def idefics3_folder(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    return tiny_idefics3_folder(tmp_path_factory.mktemp("tiny-idefics3"))
