"""OpenAI response bodies (plain dicts, encoded by msgspec) for completions and chat completions."""
from __future__ import annotations

from typing import Any

from slipstream.outputs import CompletionOutput

FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def token_strings(tokenizer: Any, ids: list[int]) -> list[str]:
    return [tokenizer.decode([t]) for t in ids]


def completion_logprobs(tokenizer: Any, out: CompletionOutput) -> dict:
    toks = token_strings(tokenizer, out.token_ids)
    offsets, at = [], 0
    for t in toks:
        offsets.append(at)
        at += len(t)
    return {"tokens": toks, "token_logprobs": list(out.logprobs or []), "top_logprobs": None, "text_offset": offsets}


def chat_logprobs(tokenizer: Any, out: CompletionOutput) -> dict:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
                        for t, lp in zip(token_strings(tokenizer, out.token_ids), out.logprobs or [])]}


def completion(rid: str, created: int, model: str, out: CompletionOutput, logprobs: dict | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": out.text, "logprobs": logprobs,
                         "finish_reason": FINISH[out.finish_reason]}],
            "usage": usage(len(out.prompt_token_ids), len(out.token_ids))}


def chat(rid: str, created: int, model: str, out: CompletionOutput, logprobs: dict | None) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                         "logprobs": logprobs, "finish_reason": FINISH[out.finish_reason]}],
            "usage": usage(len(out.prompt_token_ids), len(out.token_ids))}


def completion_chunk(rid: str, created: int, model: str, text: str, finish: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": None if finish is None else FINISH[finish]}]}


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None,
                         "finish_reason": None if finish is None else FINISH[finish]}]}


def usage_chunk(rid: str, created: int, model: str, chat: bool, prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}
