"""OpenAI response bodies (plain dicts, encoded by msgspec) for completions and chat completions."""
from __future__ import annotations

from typing import Any, cast

from slipstream.models.tokenizers.byte_stream import byte_table
from slipstream.outputs import CompletionOutput, Usage
from slipstream.serve.chat_tools import message as tool_message

FINISH = {"stop": "stop", "length": "length", "abort": "abort", "tool_calls": "tool_calls"}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """cached_tokens: prompt tokens served from the prefix cache (docs/prefix-caching.md)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def usage_of(outs: list[CompletionOutput]) -> dict:
    """One request's usage over its n completions: the prompt counted once (as OpenAI does), and
    its cached tokens those of choice 0 (each child of a fan-out prefills the prompt on its own)."""
    u = [cast(Usage, o.usage) for o in outs]  # (a finished output has its usage)
    return usage(u[0].prompt_tokens, sum(x.completion_tokens for x in u), u[0].cached_tokens)


def token_strings(tokenizer: Any, ids: list[int]) -> list[str]:
    return [tokenizer.decode([t]) for t in ids]


def completion_logprobs(tokenizer: Any, out: CompletionOutput) -> dict:
    toks = token_strings(tokenizer, out.token_ids)
    offsets, at = [], 0
    for t in toks:
        offsets.append(at)
        at += len(t)
    top = None
    if out.top_logprobs is not None:  # legacy shape: {token string: logprob} per position
        top = [{key: lp for key, lp in zip(alternative_keys(tokenizer, list(alts)), alts.values())}
               for alts in out.top_logprobs]
    return {"tokens": toks, "token_logprobs": list(out.logprobs or []), "top_logprobs": top, "text_offset": offsets}


def alternative_keys(tokenizer: Any, ids: list[int]) -> list[str]:
    """One distinct key per alternative token: its text, or, where that is not whole UTF-8 (byte
    tokens all decode to "\ufffd") or repeats another's, "bytes:" and its bytes escaped, as
    OpenAI writes such tokens (e.g. "bytes:\\xe2\\x80")."""
    table = byte_table(tokenizer)
    keys, seen = [], set()
    for t in ids:
        key = tokenizer.decode([t])
        if "\ufffd" in key or key in seen:
            raw = table[t] if table is not None else key.encode("utf-8", "replace")
            key = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            if key in seen:  # (no byte table and the same text): the id keeps it apart
                key = f"{key}#{t}"
        seen.add(key)
        keys.append(key)
    return keys


def _chat_entry(tokenizer: Any, token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(tokenizer: Any, out: CompletionOutput) -> dict:
    tops = out.top_logprobs or [{} for _ in out.token_ids]
    return {"content": [{**_chat_entry(tokenizer, t, lp),
                         "top_logprobs": [_chat_entry(tokenizer, tokenizer.decode([a]), alp)
                                          for a, alp in alts.items()]}
                        for t, lp, alts in zip(token_strings(tokenizer, out.token_ids), out.logprobs or [], tops)]}


def completion(rid: str, created: int, model: str, outs: list[CompletionOutput], logprobs: list[dict | None]) -> dict:
    """One choice per completion (SamplingParams.n), choice i from outs[i]."""
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": i, "text": out.text, "logprobs": lp, "finish_reason": FINISH[out.finish_reason]}
                        for i, (out, lp) in enumerate(zip(outs, logprobs))],
            "usage": usage_of(outs)}


def chat(rid: str, created: int, model: str, outs: list[CompletionOutput], logprobs: list[dict | None]) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": i, **_chat_message(out), "logprobs": lp}
                        for i, (out, lp) in enumerate(zip(outs, logprobs))],
            "usage": usage_of(outs)}


def _chat_message(out: CompletionOutput) -> dict:
    if out.tool_calls is None:
        return {"message": {"role": "assistant", "content": out.text}, "finish_reason": FINISH[out.finish_reason]}
    message, finish = tool_message(out)  # the request had tools: content and the parsed calls
    return {"message": message, "finish_reason": FINISH[finish]}


def completion_chunk(rid: str, created: int, model: str, text: str, finish: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": None if finish is None else FINISH[finish]}]}


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None,
                         "finish_reason": None if finish is None else FINISH[finish]}]}


def usage_chunk(rid: str, created: int, model: str, chat: bool, prompt_tokens: int, completion_tokens: int,
                cached_tokens: int = 0) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}
