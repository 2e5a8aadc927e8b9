"""The one API that `Engine` (in this process) and `Client` (a `slipstream worker`) both implement.

Every method here exists on both classes with the same parameters, defaults and async-ness, so
code written against one runs against the other unchanged; tests/test_interface.py checks it.
Each class may add things that only make sense for its transport (TRANSPORT_EXTRAS, and
attributes such as `Engine.metrics` / `Engine.tokenizer` or `Client.info` / `Client.connected`).

Streams (`stream`, `chat_stream`) are returned at once (not awaited) and are consumed with
`async for`; leaving one early (break, an exception) aborts its request at once. What a stream
yields (docs/api.md#streams):
  * every delta carries text, except possibly the last one, which carries the finish_reason;
  * tokens that produced no text yet (half of a multi-byte character, text held back while it may
    start a stop string) ride on the next delta: the `token_ids` of all deltas, concatenated, are
    the output's token ids;
  * the concatenated text equals `CompletionOutput.text`; output cut inside a multi-byte character
    (by max_tokens, an abort) ends without the incomplete bytes: never a trailing U+FFFD.
"""
from __future__ import annotations

from typing import Any, AsyncIterator, Protocol, Self, Sequence, runtime_checkable

from slipstream.api.protocol import HealthReply
from slipstream.images import ImageLike
from slipstream.outputs import CompletionOutput, StreamDelta
from slipstream.params import SamplingParams

Prompt = str | list[int]  # text, or token ids
Messages = list[dict]  # chat messages: [{"role": "user", "content": "..."}, ...]
Tools = Sequence[dict] | None  # OpenAI function tools: [{"type": "function", "function": {"name", ...}}, ...]
ToolChoice = str | dict | None  # "auto" | "none" | "required" | {"type": "function", "function": {"name"}}

# Public methods only one side has, because only its transport has the concept.
TRANSPORT_EXTRAS = {"Engine": frozenset({"stats_now", "loras"}), "Client": frozenset({"wait_connected"})}


class DeltaStream(Protocol):
    """What `stream` / `chat_stream` return: an async iterator of StreamDelta that can be closed."""

    def __aiter__(self) -> DeltaStream: ...

    async def __anext__(self) -> StreamDelta: ...

    async def aclose(self) -> None:
        """Stop early: aborts the request if it has not finished."""


@runtime_checkable
class EngineAPI(Protocol):
    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> Self:
        """Engine: load the model and start the loop. Client: connect and handshake."""

    async def close(self) -> None:
        """Abort what is unfinished and release everything; closing twice is a no-op."""

    async def __aenter__(self) -> Self: ...

    async def __aexit__(self, *exc) -> None: ...

    # --- requests -----------------------------------------------------------------------------

    async def complete(self, prompt: Prompt, params: SamplingParams | None = None,
                       request_id: str | None = None, *, images: Sequence[ImageLike] = ()
                       ) -> CompletionOutput | list[CompletionOutput]:
        """Generate from a prompt (text or token ids) until a stop, max_tokens, or an abort; with
        params.n > 1, a list of n completions (slipstream/api/fanout.py). `images` (PIL images,
        encoded bytes, file paths, data: URLs) go where the prompt's `<image>` markers are, in order
        (docs/images.md); a model without a vision tower refuses them (InvalidRequestError)."""

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               request_id: str | None = None, *, images: Sequence[ImageLike] = ()) -> DeltaStream:
        """As `complete`, delta by delta (see the module docstring for what is yielded)."""

    async def chat(self, messages: Messages, params: SamplingParams | None = None,
                   request_id: str | None = None, *, images: Sequence[ImageLike] = (), tools: Tools = None,
                   tool_choice: ToolChoice = None, parallel_tool_calls: bool = True
                   ) -> CompletionOutput | list[CompletionOutput]:
        """`complete` on the model's chat template applied to `messages` (with a generation prompt).
        With `tools` (OpenAI's function tools; `tool_choice` "auto" by default) the model may call
        them, each call valid against its function's schema, and the output's `content` and
        `tool_calls` hold the answer's text and the parsed calls (docs/tools.md)."""

    def chat_stream(self, messages: Messages, params: SamplingParams | None = None,
                    request_id: str | None = None, *, images: Sequence[ImageLike] = (), tools: Tools = None,
                    tool_choice: ToolChoice = None, parallel_tool_calls: bool = True) -> DeltaStream:
        """`stream` on the model's chat template applied to `messages`; with `tools` each delta also
        carries its `content` and `tool_calls` pieces."""

    async def chat_prompt(self, messages: Messages) -> str:
        """The prompt text `chat` would generate from (InvalidRequestError if the template refuses)."""

    async def abort(self, request_id: str) -> bool:
        """Abort a request; its waiter gets finish_reason "abort". False if unknown or finished."""

    # --- spatial skills (Moondream-compatible dicts; docs/grammars.md) ----------------------------

    async def point(self, prompt: str, object: str, max_objects: int = 16,
                    params: SamplingParams | None = None, *,
                    images: Sequence[ImageLike] = ()) -> dict[str, Any]:
        """{"points": [{"x", "y"}, ...]}, coordinates in [0, 1]."""

    async def detect(self, prompt: str, object: str, max_objects: int = 16,
                     params: SamplingParams | None = None, *,
                     images: Sequence[ImageLike] = ()) -> dict[str, Any]:
        """{"objects": [{"x_min", "y_min", "x_max", "y_max"}, ...]}."""

    async def segment(self, prompt: str, object: str, max_objects: int = 16,
                      params: SamplingParams | None = None, *,
                      images: Sequence[ImageLike] = ()) -> dict[str, Any]:
        """{"path": "M ...", "bbox": {...}}."""

    def stream_skill(self, kind: str, prompt: str, object: str, max_objects: int = 16,
                     params: SamplingParams | None = None, *,
                     images: Sequence[ImageLike] = ()) -> AsyncIterator[dict[str, Any]]:
        """point/detect: each object as its line completes; segment: the final dict."""

    # --- LoRA adapters (docs/lora.md) ------------------------------------------------------------

    async def load_lora(self, name: str, path: str) -> dict[str, Any]:
        """Read, check and register a PEFT LoRA folder under `name` (off the engine's loop): requests
        name it by SamplingParams.lora. {"name", "path", "rank", "targets"}; LoraAdapterError naming
        the field when it is refused (the engine unchanged). The path is on the engine's machine."""

    async def unload_lora(self, name: str) -> None:
        """New requests can no longer name it (LoraNotFoundError if none is so named); running ones finish."""

    # --- introspection ------------------------------------------------------------------------

    async def stats(self) -> dict[str, Any]:
        """kv_pages_free, kv_pages_total, running, waiting, steps, ... (a worker adds its own counters)."""

    async def health(self) -> HealthReply:
        """ready, draining, model, pid, chat_template, ... Engine: a local answer (never raises)."""

    async def metrics_text(self) -> str:
        """The Prometheus text exposition of the engine's metrics."""
