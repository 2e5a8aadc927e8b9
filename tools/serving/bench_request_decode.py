"""Per-request cost of decoding + type-checking a typical chat-completions body: msgspec vs pydantic.

The same field set and ranges both ways (slipstream/serve/openai_types.py is the msgspec one; the
pydantic model here mirrors it). Prints a table: median, mean and p90 of µs per decode over
repeated batches, after warm-up.

    python tools/serving/bench_request_decode.py [--repeats 30] [--batch 2000]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Annotated, Any, Literal

import msgspec
import pydantic
from pydantic import BaseModel, Field

from slipstream.serve.openai_types import ChatCompletionRequest

BODY = json.dumps({
    "model": "smollm2-135m",
    "messages": [{"role": "system", "content": "You are a helpful assistant."},
                 {"role": "user", "content": "Write a haiku about pipelined decoding on a GPU. " * 4}],
    "max_tokens": 128, "temperature": 0.7, "top_p": 0.95, "seed": 1234, "stream": True,
    "stream_options": {"include_usage": True}, "stop": ["\n\n", "</s>"],
    "response_format": {"type": "json_schema", "json_schema": {"name": "haiku", "schema": {
        "type": "object", "properties": {"lines": {"type": "array", "items": {"type": "string"}}},
        "required": ["lines"]}}},
}).encode()


class PStreamOptions(BaseModel):
    include_usage: bool = False


class PJsonSchema(BaseModel):
    name: str = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class PResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: PJsonSchema | None = None


class PTextPart(BaseModel):
    type: Literal["text"]
    text: str


class PMessage(BaseModel):
    role: Annotated[str, Field(min_length=1)]
    content: str | list[PTextPart] | None = None
    name: str | None = None


class PChatRequest(BaseModel):
    model: str | None = None
    messages: Annotated[list[PMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    n: Annotated[int, Field(ge=1, le=1)] = 1
    stream: bool = False
    stream_options: PStreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=0)] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: PResponseFormat | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    top_k: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = []
    regex: str | None = None
    choice: list[str] | None = None


def timed(fn, repeats: int, batch: int) -> list[float]:
    for _ in range(batch):  # warm-up
        fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(batch):
            fn()
        out.append((time.perf_counter() - t) / batch * 1e6)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--batch", type=int, default=2000)
    args = ap.parse_args()
    dec = msgspec.json.Decoder(ChatCompletionRequest)
    a, b = dec.decode(BODY), PChatRequest.model_validate_json(BODY)
    assert a.max_tokens == b.max_tokens and a.messages[1].text() == b.messages[1].content
    rows = {"msgspec Struct (json.Decoder)": timed(lambda: dec.decode(BODY), args.repeats, args.batch),
            "pydantic BaseModel (model_validate_json)": timed(lambda: PChatRequest.model_validate_json(BODY),
                                                              args.repeats, args.batch)}
    print(f"body: {len(BODY)} bytes; msgspec {msgspec.__version__}, pydantic {pydantic.VERSION}; "
          f"{args.repeats} repeats x {args.batch} decodes")
    print(f"{'decoder':44s} {'median µs':>10s} {'mean µs':>10s} {'p90 µs':>10s}")
    for name, v in rows.items():
        p90 = statistics.quantiles(v, n=10)[-1]
        print(f"{name:44s} {statistics.median(v):10.2f} {statistics.fmean(v):10.2f} {p90:10.2f}")
    ratio = statistics.median(rows["pydantic BaseModel (model_validate_json)"]) / statistics.median(
        rows["msgspec Struct (json.Decoder)"])
    print(f"pydantic / msgspec (median): {ratio:.1f}x")


if __name__ == "__main__":
    main()
