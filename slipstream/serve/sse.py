"""Server-sent events: one `data: <json>` line per chunk, a blank line after each, `data: [DONE]` last."""
from __future__ import annotations

import msgspec

_encode = msgspec.json.Encoder().encode
DONE = b"data: [DONE]\n\n"


def event(obj) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


def parse(body: str) -> list:
    """The chunks of an SSE body ("[DONE]" as the string), for tests and tools."""
    out = []
    for block in body.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else msgspec.json.decode(data))
    return out
