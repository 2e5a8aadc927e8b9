"""User-facing configuration and request parameters, validated at the call."""
from __future__ import annotations

import json
import math

import msgspec

from slipstream.errors import InvalidRequestError
from slipstream.grammar.base import GrammarSpec


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Names follow OpenAI/vLLM. temperature 0 is greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: bool = False  # return the log-probability of each sampled token
    # constrained decoding (at most one): see docs/grammars.md
    json_schema: dict | str | None = None  # a JSON schema (dict or JSON text)
    regex: str | None = None  # the whole output must match
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: GrammarSpec | None = None  # any registered kind: skills, plugins

    def grammar_spec(self) -> GrammarSpec | None:
        if self.json_schema is not None:
            value = self.json_schema if isinstance(self.json_schema, str) else json.dumps(self.json_schema)
            return GrammarSpec("json_schema", value)
        if self.regex is not None:
            return GrammarSpec("regex", self.regex)
        if self.choice is not None:
            return GrammarSpec("choice", json.dumps(self.choice))
        return self.grammar

    def __post_init__(self) -> None:
        given = [n for n in ("json_schema", "regex", "choice", "grammar") if getattr(self, n) is not None]
        if len(given) > 1:
            raise InvalidRequestError(f"give at most one of json_schema, regex, choice, grammar (got {given})")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError("choice must be a non-empty list of non-empty strings")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature) or self.temperature < 0 \
                or math.isinf(self.temperature):
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if math.isnan(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be >= 0, got {self.stop_token_ids!r}")
        if self.seed is not None and self.seed < 0:
            raise InvalidRequestError(f"seed must be >= 0, got {self.seed!r}")


EVENT_WAITS = ("auto", "host_func", "thread", "poll")


class EngineConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str = "smollm2-135m"  # a known name, a .gguf path, a Hugging Face folder, or random weights:
    #                              "tiny-random", "random-smollm2-135m" (byte tokenizer)
    device: str = "cpu"  # "cpu" | "cuda"
    dtype: str = "float32"  # "float32" | "bfloat16" | "float16"
    pipeline_depth: int = 2  # 1: blocking baseline; 2: launch t+1 before committing t
    max_batch_size: int = 32  # sequences per step
    max_num_batched_tokens: int = 512  # tokens per step (decode tokens + prefill chunks)
    page_size: int = 16
    kv_cache_tokens: int | None = None  # KV pool in tokens (rounded up to pages); None: 32768 on
    #                                     the CPU, gpu_memory_utilization of free memory on CUDA
    max_model_len: int | None = None  # default: the model's context length
    batch_invariant: bool = True  # pad CPU matmuls so results do not depend on batch size
    seed: int = 0  # seeds requests that give none
    trace: bool = False  # keep per-step host timings and device spans (benchmarks, timelines)
    grammar_timeout_s: float = 10.0  # compile timeout of a constraint grammar
    # --- CUDA only (docs/cuda.md) ---
    gpu_memory_utilization: float = 0.9  # share of free memory (after weights + a profiling forward) for KV
    cuda_graphs: bool = True  # replay decode steps from graphs captured per slot and batch-size bucket
    graph_batch_sizes: tuple[int, int, int] | None = None  # (min, step, max) buckets; None: (1, 16, max_batch_size)
    warmup: bool = True  # capture every bucket at start; False: capture each on first use
    event_wait: str = "auto"  # how the loop awaits GPU events: auto | host_func | thread | poll

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise InvalidRequestError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise InvalidRequestError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.pipeline_depth not in (1, 2):
            raise InvalidRequestError(f"pipeline_depth must be 1 or 2, got {self.pipeline_depth!r}")
        for name in ("max_batch_size", "max_num_batched_tokens", "page_size", "kv_cache_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.max_num_batched_tokens < self.max_batch_size:
            raise InvalidRequestError("max_num_batched_tokens must be >= max_batch_size")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidRequestError(f"max_model_len must be >= 2, got {self.max_model_len!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidRequestError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.event_wait not in EVENT_WAITS:
            raise InvalidRequestError(f"event_wait must be one of {EVENT_WAITS}, got {self.event_wait!r}")
        if self.graph_batch_sizes is not None:
            from slipstream.runtime.buckets import make_buckets

            if make_buckets(*self.graph_batch_sizes)[-1] > self.max_batch_size:
                raise InvalidRequestError(f"graph_batch_sizes max ({self.graph_batch_sizes[2]}) exceeds "
                                          f"max_batch_size ({self.max_batch_size})")

    def buckets(self) -> tuple[int, int, int]:
        """(min, step, max) of the decode graph buckets."""
        return self.graph_batch_sizes or (1, min(16, self.max_batch_size), self.max_batch_size)
