"""User-facing configuration and request parameters, validated at the call."""
from __future__ import annotations

import json

import msgspec

from slipstream import validate as check
from slipstream.errors import InvalidRequestError
from slipstream.grammar.base import GrammarSpec
from slipstream.models import ACTIVATION_MODES, WEIGHT_MODES
from slipstream.runtime.batch import MAX_TOP_LOGPROBS  # (one constant: the runner sizes its buffers by it)
from slipstream.runtime.graphs.buckets import make_buckets
from slipstream.runtime.devices.event_waits import EVENT_WAITS
from slipstream.validate import CheckedStructMeta


MIN_TEMPERATURE = 1e-5  # below this, logits / temperature overflow float32 (0 means greedy)
MAX_SEED = 2**63 - 1
MAX_CACHE_SALT = 256  # characters of SamplingParams.cache_salt
MAX_N = 128  # completions per request (each is a request of its own in the batch)
DEFAULT_MAX_PROMPT_CHARS = 1_000_000  # EngineConfig.max_prompt_chars; also the HTTP server's without an engine


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True,
                     metaclass=CheckedStructMeta):
    """Names follow OpenAI/vLLM. temperature 0 is greedy. Every field is type-checked at construction
    (InvalidRequestError naming the field); None for stop / stop_token_ids / seed means "none".

    Frozen, and the sequences are normalised to tuples: a value checked here cannot change before
    the engine reads it (`p.max_tokens = 0` raises AttributeError). Change a field with
    `msgspec.structs.replace(p, ...)`, which checks again. The Engine re-runs `check()` at
    submission, for values forced in behind the Struct's back."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    stop: tuple[str, ...] | str | None = None  # normalised to a tuple of strings ("ab" is one stop string)
    stop_token_ids: tuple[int, ...] | None = None  # normalised to a tuple
    ignore_eos: bool = False
    logprobs: bool = False  # return the log-probability of each sampled token
    top_logprobs: int = 0  # also the k most likely tokens at each step, with their logprobs (> 0 implies logprobs)
    n: int = 1  # independent completions of the prompt (slipstream/api/fanout.py)
    # penalties and filters (vLLM semantics; docs/sampling.md). The neutral values change nothing.
    presence_penalty: float = 0.0  # [-2, 2]: subtracted once from each token already in the output
    frequency_penalty: float = 0.0  # [-2, 2]: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # > 0: tokens in the prompt or output: positive logits / it, negative * it
    min_p: float = 0.0  # [0, 1]: drop tokens whose probability (after temperature) < min_p * the top one's
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many output tokens
    # constrained decoding (at most one): see docs/grammars.md
    json_schema: dict | str | None = None  # a JSON schema (dict or JSON text)
    regex: str | None = None  # the whole output must match
    choice: tuple[str, ...] | None = None  # the output is exactly one of these strings
    grammar: GrammarSpec | None = None  # any registered kind: skills, plugins
    # prefix caching (docs/prefix-caching.md)
    cache_salt: str | None = None  # requests with different salts never share KV pages (tenant isolation)
    prefix_caching: bool = True  # False: this request neither reuses cached pages nor adds its own
    # speculative decoding (docs/speculative.md): False keeps this request's steps free of drafts
    # (where EngineConfig.speculative is on; the output is the same either way)
    speculative: bool = True
    # the LoRA adapter this request computes with (docs/lora.md): a name EngineConfig.lora_adapters or
    # Engine.load_lora gave; None: the base model
    lora: str | None = None

    def grammar_field(self) -> str | None:
        """The field the constraint came from (what a GrammarCompileError's `param` names)."""
        return next((n for n in ("json_schema", "regex", "choice", "grammar") if getattr(self, n) is not None), None)

    def grammar_spec(self) -> GrammarSpec | None:
        if self.json_schema is not None:
            try:
                value = self.json_schema if isinstance(self.json_schema, str) else json.dumps(self.json_schema)
            except (RecursionError, TypeError, ValueError) as e:  # nested too deeply, or not JSON
                raise InvalidRequestError(f"json_schema cannot be written as JSON: {type(e).__name__}: {e}",
                                          param="json_schema") from None
            return GrammarSpec("json_schema", value)
        if self.regex is not None:
            return GrammarSpec("regex", self.regex)
        if self.choice is not None:
            return GrammarSpec("choice", json.dumps(list(self.choice)))
        return self.grammar

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> "SamplingParams":
        """Every field's type and range (InvalidRequestError naming it); normalises in place, idempotent."""
        force = msgspec.structs.force_setattr
        check.integer("max_tokens", self.max_tokens, minimum=1)
        temperature = check.number("temperature", self.temperature)
        if temperature < 0 or 0 < temperature < MIN_TEMPERATURE:
            raise InvalidRequestError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got {temperature!r}",
                                      param="temperature")
        top_p = check.number("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {top_p!r}", param="top_p")
        check.integer("top_k", self.top_k, minimum=-1)
        check.integer("seed", self.seed, minimum=0, maximum=MAX_SEED, optional=True)
        force(self, "stop", tuple(check.string_list("stop", self.stop)))
        force(self, "stop_token_ids", tuple(check.int_list("stop_token_ids", self.stop_token_ids)))
        check.boolean("ignore_eos", self.ignore_eos)
        check.boolean("logprobs", self.logprobs)
        if check.integer("top_logprobs", self.top_logprobs, minimum=0, maximum=MAX_TOP_LOGPROBS):
            force(self, "logprobs", True)  # alternatives come with the sampled token's own logprob
        check.integer("n", self.n, minimum=1, maximum=MAX_N)
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= check.number(name, getattr(self, name)) <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}", param=name)
        if check.number("repetition_penalty", self.repetition_penalty) <= 0:
            raise InvalidRequestError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty!r}",
                                      param="repetition_penalty")
        if not 0.0 <= check.number("min_p", self.min_p) <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}", param="min_p")
        check.integer("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
                                      param="min_tokens")
        given = [n for n in ("json_schema", "regex", "choice", "grammar") if getattr(self, n) is not None]
        if len(given) > 1:
            raise InvalidRequestError(f"give at most one of json_schema, regex, choice, grammar (got {given})",
                                      param=given[1])
        if self.json_schema is not None and not isinstance(self.json_schema, (dict, str)):
            raise InvalidRequestError(f"json_schema must be a dict or JSON text, got {type(self.json_schema).__name__}",
                                      param="json_schema")
        if self.regex is not None:
            check.regex("regex", self.regex)
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise InvalidRequestError("choice must be a non-empty list of non-empty strings", param="choice")
            force(self, "choice", tuple(check.text(f"choice[{i}]", c) for i, c in enumerate(self.choice)))
        check.boolean("prefix_caching", self.prefix_caching)
        check.boolean("speculative", self.speculative)
        if self.lora is not None:
            check.text("lora", self.lora)
        if self.cache_salt is not None and len(check.text("cache_salt", self.cache_salt)) > MAX_CACHE_SALT:
            raise InvalidRequestError(f"cache_salt must be at most {MAX_CACHE_SALT} characters, got "
                                      f"{len(self.cache_salt)}", param="cache_salt")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise InvalidRequestError(f"grammar must be a GrammarSpec, got {type(self.grammar).__name__}",
                                      param="grammar")
        return self


OUTPUT_STAGES = ("loop", "thread")
SPEC_METHODS = ("ngram", "draft")
# The speculative options' upper bounds: a proposal costs about max_n x window comparisons per row
# and step, the draft model a prefill of draft_context tokens per row; unbounded, window=20_000_000
# turned 32 tokens on tiny-random from 0.06 s into 10 s and 1.16 GB (issue 48).
MAX_NUM_DRAFTS = 16
MAX_NGRAM = 8  # min_n, max_n
MAX_WINDOW = 4096
MAX_DRAFT_CONTEXT = 4096


class SpeculativeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True,
                        metaclass=CheckedStructMeta):
    """Speculative decoding (docs/speculative.md): a decode row feeds up to `num_drafts` drafted tokens
    after its last one and keeps those the model agrees with; the output is unchanged."""

    method: str = "ngram"  # "ngram": prompt lookup on the device (speculation/ngram_drafter.py); "draft": a
    #                        smaller model's greedy tokens (speculation/draft_model_drafter.py)
    num_drafts: int = 4  # the most drafts a row feeds in one step (k)
    min_n: int = 1  # n-gram lengths looked up, longest first
    max_n: int = 3
    window: int = 1024  # the newest tokens of a row searched for the n-gram
    adaptive: bool = True  # per row, as many drafts as its acceptance pays for (0 included); False: always k
    draft_model: str | None = None  # method "draft": the model (as EngineConfig.model), same tokenizer
    draft_context: int = 64  # method "draft": the newest tokens of a row the draft model reads per step

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise InvalidRequestError(f"speculative.method must be one of {SPEC_METHODS}, got {self.method!r}",
                                      param="speculative.method")
        check.integer("speculative.num_drafts", self.num_drafts, minimum=1, maximum=MAX_NUM_DRAFTS)
        check.integer("speculative.min_n", self.min_n, minimum=1, maximum=MAX_NGRAM)
        check.integer("speculative.max_n", self.max_n, minimum=self.min_n, maximum=MAX_NGRAM)
        check.integer("speculative.window", self.window, minimum=self.max_n + 1, maximum=MAX_WINDOW)
        check.boolean("speculative.adaptive", self.adaptive)
        if self.method == "draft" and self.draft_model is None:
            raise InvalidRequestError("speculative.method 'draft' needs speculative.draft_model: the smaller model "
                                      "that drafts (same tokenizer)", param="speculative.draft_model")
        if self.method != "draft" and self.draft_model is not None:
            raise InvalidRequestError(f"speculative.draft_model is read only with method 'draft', not "
                                      f"{self.method!r}", param="speculative.draft_model")
        if self.draft_model is not None and (not isinstance(self.draft_model, str) or not self.draft_model):
            raise InvalidRequestError("speculative.draft_model must be a model name or path",
                                      param="speculative.draft_model")
        check.integer("speculative.draft_context", self.draft_context, minimum=1, maximum=MAX_DRAFT_CONTEXT)


class EngineConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, metaclass=CheckedStructMeta):
    model: str = "smollm2-135m"  # a known name, a .gguf path, a Hugging Face folder, or random weights:
    #                              "tiny-random", "random-smollm2-135m", "random-llama-3.2-1b"/"-3b" (byte tokenizer)
    device: str = "cpu"  # "cpu" | "cuda"
    dtype: str = "float32"  # "float32" | "bfloat16" | "float16"
    pipeline_depth: int = 2  # 1: blocking baseline; 2: launch t+1 before committing t
    max_batch_size: int = 32  # sequences per step
    max_num_batched_tokens: int = 512  # tokens per step (decode tokens + prefill chunks)
    page_size: int = 16
    kv_cache_tokens: int | None = None  # KV pool in tokens (rounded up to pages); None: 32768 on
    #                                     the CPU, gpu_memory_utilization of free memory on CUDA
    max_model_len: int | None = None  # default: the model's context length
    batch_invariant: bool = False  # True: CPU results independent of batch composition (tests; slower)
    # "quantized": a GGUF's quantized matrices stay quantized in memory and are computed with as such
    # (docs/models.md, "Quantized weights"); "dequantized": expanded to `dtype` at load (other sources
    # always are)
    weights: str = "quantized"
    # quantized weights on the CPU's compiled kernels: "float": float32 multiply-adds (greedy output
    # equals transformers'); "int8" rounds each activation row to int8 per group and multiplies in
    # integers (llama.cpp's kind of arithmetic; ~4x fewer instructions per row, so a k + 1-position
    # verification costs far less, but outputs differ: docs/models.md, "Quantized weights"); "int16"
    # rounds to int16 (2 products per instruction, a rounding 258x finer than int8's; greedy output
    # still transformers' on the oracle prompts); "auto": int16 where the compiled kernels run, else
    # float (what nothing else rounds: CUDA, bfloat16, batch invariance)
    activations: str = "auto"
    seed: int = 0  # seeds requests that give none
    trace: bool = False  # keep per-step host timings and device spans (benchmarks, timelines)
    grammar_timeout_s: float = 10.0  # compile timeout of a constraint grammar
    freeze_gc: bool = True  # gc.freeze() what exists at start: collections skip the model and libraries
    # reuse the K/V of full pages of a shared prompt prefix (docs/prefix-caching.md). Off by default until
    # a soak mismatch after injected step failures is explained (docs/prefix-caching.md, "Known issue")
    prefix_caching: bool = True  # docs/prefix-caching.md; SamplingParams.prefix_caching opts one request out
    # images (docs/images.md, "In the pipeline"): encoder output rows kept by image digest for reuse
    # (rows in use are never evicted, so it may hold more while they are), and the encoder rows a
    # step may compute (a larger image still runs, alone in its step)
    encoder_cache_tokens: int = 16384
    max_encoder_tokens_per_step: int = 2048
    step_timeout_s: float = 300.0  # watchdog: a launched step not done by then fails the engine, with its state logged
    # --- CUDA only (docs/cuda.md) ---
    gpu_memory_utilization: float = 0.9  # share of free memory (after weights + a profiling forward) for KV
    cuda_graphs: bool = True  # replay decode steps from graphs captured per slot and batch-size bucket
    graph_batch_sizes: tuple[int, int, int] | None = None  # (min, step, max) buckets; None: (1, 16, max_batch_size)
    mixed_graphs: bool = True  # also replay steps with prefill chunks, per slot and token bucket
    graph_token_sizes: tuple[int, int] | None = None  # (min, max) token buckets of mixed graphs (powers of
    #                                                    two from min, then max); None: (16, max_num_batched_tokens)
    warmup: bool = True  # capture every bucket (both kinds) at start; False: capture each on first use
    event_wait: str = "auto"  # how the loop awaits GPU events: auto | host_func | thread | poll
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS  # a longer prompt (str) is refused before it is tokenized
    output_stage: str = "loop"  # where detokenising and stop strings run: "loop" (a task beside the
    #                             tick) | "thread" (a worker thread; delivery stays on the loop)
    # speculative decoding (docs/speculative.md); None: off. A dict (HTTP, Ray) is read as SpeculativeConfig
    speculative: SpeculativeConfig | None = None
    # LoRA adapters (docs/lora.md): name -> PEFT folder, loaded at start (Engine.load_lora adds more),
    # each of rank <= max_lora_rank; at most max_loras have weights in memory at once, the least
    # recently used idle one evicted for another (read again when a request names it). On CUDA, a dict
    # ({} for none yet) preallocates the device bank of max_loras slots at start (models/lora_bank.py);
    # None there: no adapter can be loaded
    lora_adapters: dict[str, str] | None = None
    max_loras: int = 8
    max_lora_rank: int = 64

    def __post_init__(self) -> None:
        check.text("model", self.model)
        self._check_lora()
        if self.device not in ("cpu", "cuda"):
            raise InvalidRequestError(f"device must be 'cpu' or 'cuda', got {self.device!r}", param="device")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise InvalidRequestError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}", param="dtype")
        if self.pipeline_depth not in (1, 2) or isinstance(self.pipeline_depth, bool):
            raise InvalidRequestError(f"pipeline_depth must be 1 or 2, got {self.pipeline_depth!r}",
                                      param="pipeline_depth")
        for name in ("max_batch_size", "max_num_batched_tokens", "page_size", "max_prompt_chars"):
            check.integer(name, getattr(self, name), minimum=1)
        check.integer("kv_cache_tokens", self.kv_cache_tokens, minimum=1, optional=True)
        check.integer("encoder_cache_tokens", self.encoder_cache_tokens, minimum=0)
        check.integer("max_encoder_tokens_per_step", self.max_encoder_tokens_per_step, minimum=1)
        check.integer("max_model_len", self.max_model_len, minimum=2, optional=True)
        check.integer("seed", self.seed, minimum=0)
        for name in ("batch_invariant", "trace", "cuda_graphs", "mixed_graphs", "warmup", "freeze_gc",
                     "prefix_caching"):
            check.boolean(name, getattr(self, name))
        for name in ("grammar_timeout_s", "step_timeout_s"):
            if check.number(name, getattr(self, name)) <= 0:
                raise InvalidRequestError(f"{name} must be > 0, got {getattr(self, name)!r}")
        check.number("gpu_memory_utilization", self.gpu_memory_utilization)
        if self.max_num_batched_tokens < self.max_batch_size:
            raise InvalidRequestError("max_num_batched_tokens must be >= max_batch_size",
                                      param="max_num_batched_tokens")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidRequestError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}",
                                      param="gpu_memory_utilization")
        if self.weights not in WEIGHT_MODES:
            raise InvalidRequestError(f"weights must be one of {WEIGHT_MODES}, got {self.weights!r}", param="weights")
        if self.activations not in ("auto",) + ACTIVATION_MODES:
            raise InvalidRequestError(f"activations must be one of {('auto',) + ACTIVATION_MODES}, got "
                                      f"{self.activations!r}", param="activations")
        if self.output_stage not in OUTPUT_STAGES:
            raise InvalidRequestError(f"output_stage must be one of {OUTPUT_STAGES}, got {self.output_stage!r}",
                                      param="output_stage")
        if isinstance(self.speculative, dict):
            self.speculative = SpeculativeConfig(**self.speculative)
        elif self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise InvalidRequestError(f"speculative must be a SpeculativeConfig, a dict or None, got "
                                      f"{type(self.speculative).__name__}", param="speculative")
        if self.event_wait not in EVENT_WAITS:
            raise InvalidRequestError(f"event_wait must be one of {EVENT_WAITS}, got {self.event_wait!r}",
                                      param="event_wait")
        if self.graph_batch_sizes is not None:
            if not isinstance(self.graph_batch_sizes, (tuple, list)) or len(self.graph_batch_sizes) != 3:
                raise InvalidRequestError(f"graph_batch_sizes must be (min, step, max), got {self.graph_batch_sizes!r}",
                                          param="graph_batch_sizes")
            lo_b, step_b, hi_b = (check.integer(f"graph_batch_sizes[{i}]", v, minimum=1)
                                  for i, v in enumerate(self.graph_batch_sizes))
            self.graph_batch_sizes = (lo_b, step_b, hi_b)
            if make_buckets(lo_b, step_b, hi_b)[-1] > self.max_batch_size:
                raise InvalidRequestError(f"graph_batch_sizes max ({hi_b}) exceeds "
                                          f"max_batch_size ({self.max_batch_size})")

        if self.graph_token_sizes is not None:
            if not isinstance(self.graph_token_sizes, (tuple, list)) or len(self.graph_token_sizes) != 2:
                raise InvalidRequestError(f"graph_token_sizes must be (min, max), got {self.graph_token_sizes!r}",
                                          param="graph_token_sizes")
            lo, hi = (check.integer(f"graph_token_sizes[{i}]", v, minimum=1)
                      for i, v in enumerate(self.graph_token_sizes))
            if lo > hi or hi > self.max_num_batched_tokens:
                raise InvalidRequestError(f"graph_token_sizes must satisfy min <= max <= max_num_batched_tokens "
                                          f"({self.max_num_batched_tokens}), got ({lo}, {hi})",
                                          param="graph_token_sizes")
            self.graph_token_sizes = (lo, hi)

    def _check_lora(self) -> None:
        check.integer("max_loras", self.max_loras, minimum=1, maximum=256)
        check.integer("max_lora_rank", self.max_lora_rank, minimum=1, maximum=1024)
        adapters = self.lora_adapters
        if adapters is None:
            return
        if not isinstance(adapters, dict):
            raise InvalidRequestError(f"lora_adapters must be a dict of name -> path, got {type(adapters).__name__}",
                                      param="lora_adapters")
        for name, path in adapters.items():
            check.text("lora_adapters", name)
            check.text(f"lora_adapters[{name!r}]", path)

    def token_bucket_range(self) -> tuple[int, int]:
        """(min, max) of the mixed-step graph buckets, in tokens."""
        return self.graph_token_sizes or (min(16, self.max_num_batched_tokens), self.max_num_batched_tokens)

    def buckets(self) -> tuple[int, int, int]:
        """(min, step, max) of the decode graph buckets."""
        return self.graph_batch_sizes or (1, min(16, self.max_batch_size), self.max_batch_size)
