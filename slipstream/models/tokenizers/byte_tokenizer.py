"""A byte-level tokenizer for the tiny random test model: ids 3..258 are bytes 0..255.

Ids 0, 1, 2 are <pad>, <bos>, <eos>; ids past 258 decode to nothing. It gives the tiny model real
text in and out, so engine tests exercise detokenisation and stop strings without the 98 MB model.
"""
from __future__ import annotations

OFFSET = 3


class ByteTokenizer:
    chat_template = None
    decodes_by_bytes = True  # decode(ids) is the UTF-8 decoding of token_bytes joined (byte_stream.py)

    def __init__(self, vocab_size: int = 512):
        self.vocab_size = vocab_size
        self.bos_token_id = 1
        self.eos_token_ids = (2,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:  # (it adds none)
        return [b + OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i - OFFSET for i in ids if OFFSET <= i < OFFSET + 256)
        return data.decode("utf-8", errors="replace")

    def token_bytes(self, i: int) -> bytes:
        """The byte an id stands for (b"" for specials): lets streaming drop a cut character."""
        return bytes([i - OFFSET]) if OFFSET <= i < OFFSET + 256 else b""

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")
