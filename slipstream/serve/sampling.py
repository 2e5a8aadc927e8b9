"""OpenAI request fields → SamplingParams, remembering which field a later engine error is about."""
from __future__ import annotations

import json

from slipstream.errors import InvalidRequestError
from slipstream.grammar.base import GrammarSpec
from slipstream.params import SamplingParams
from slipstream.serve.api_errors import invalid
from slipstream.serve.openai_types import ChatCompletionRequest, CompletionRequest

DEFAULT_MAX_TOKENS = 256  # when the request names none and the context length is not known here


def max_tokens_of(req: CompletionRequest | ChatCompletionRequest, prompt_len: int,
                  max_model_len: int | None) -> int:
    """The request's limit (checked against the context when it is known), else the rest of the context."""
    value, field = req.max_tokens, "max_tokens"
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        if value is not None and value != req.max_completion_tokens:
            raise invalid("give max_tokens or max_completion_tokens, not two different values", "max_tokens")
        value, field = req.max_completion_tokens, "max_completion_tokens"
    if max_model_len is None:
        return value or DEFAULT_MAX_TOKENS
    room = max_model_len - prompt_len
    if value is not None and value > room:
        raise invalid(f"prompt ({prompt_len} tokens) + {field} ({value}) exceeds the model context of "
                      f"{max_model_len} tokens; lower {field} to at most {room}", field, "context_length_exceeded")
    return value or room


def grammar_fields(req: CompletionRequest | ChatCompletionRequest) -> tuple[dict, str | None]:
    """SamplingParams' constraint field and the request field it came from (at most one)."""
    given: list[tuple[str, dict]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        given.append(("response_format", {"json_schema": {"type": "object"}}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema is None:
            raise invalid("response_format json_schema needs json_schema.schema", "response_format.json_schema")
        try:
            schema = json.dumps(rf.json_schema.schema)
        except RecursionError:
            raise invalid("response_format json_schema.schema is nested too deeply",
                          "response_format.json_schema.schema") from None
        given.append(("response_format", {"json_schema": schema}))
    if req.regex is not None:
        given.append(("regex", {"regex": req.regex}))
    if req.choice is not None:
        given.append(("choice", {"choice": list(req.choice)}))
    if req.grammar is not None:
        g = req.grammar
        given.append(("grammar", {"grammar": GrammarSpec(g.kind, g.value, g.max_objects)}))
    if len(given) > 1:
        raise invalid(f"give at most one of response_format, regex, choice, grammar (got {[n for n, _ in given]})",
                      given[1][0])
    return (given[0][1], given[0][0]) if given else ({}, None)


def sampling_params(req: CompletionRequest | ChatCompletionRequest, logprobs: bool, prompt_len: int,
                    max_model_len: int | None) -> tuple[SamplingParams, str | None]:
    """Returns (params, grammar_param): the field to blame if the grammar later fails to compile."""
    max_tokens = max_tokens_of(req, prompt_len, max_model_len)
    grammar, grammar_param = grammar_fields(req)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        # chat: top_logprobs (with logprobs: true); completions' legacy `logprobs: k`: k alternatives
        top = (req.top_logprobs or 0) if isinstance(req, ChatCompletionRequest) else (req.logprobs or 0)
        if top and not logprobs:
            raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
        params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                seed=req.seed, stop=tuple(stop), stop_token_ids=tuple(req.stop_token_ids),
                                ignore_eos=req.ignore_eos, logprobs=logprobs, top_logprobs=top, n=req.n,
                                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                                repetition_penalty=req.repetition_penalty, min_p=req.min_p,
                                min_tokens=req.min_tokens, cache_salt=req.cache_salt, speculative=req.speculative,
                                **grammar)
    except (InvalidRequestError, TypeError) as e:  # the body's types and ranges were checked already
        raise invalid(str(e), getattr(e, "param", None)) from e
    return params, grammar_param
