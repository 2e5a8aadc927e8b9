"""Worker wire protocol: msgspec Structs encoded as msgpack (described in docs/worker-protocol.md).

A client (ZMQ DEALER) sends one frame per message, a map tagged by its `type` field with the
protocol version in `v`. The worker (ZMQ ROUTER) answers with frames holding a `Frame`: the version
and a list of messages, so outputs for one client produced together travel in one frame.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from slipstream import errors
from slipstream.outputs import CompletionOutput, RequestMetrics, ToolCallDelta, Usage

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 1 << 20  # default bound on one inbound frame; larger ones get a ProtocolError
# default bound on the image bytes of one Generate, allowed on top of MAX_MESSAGE_BYTES
MAX_IMAGE_BYTES = 32 << 20


# --- client -> worker ----------------------------------------------------------------------------


class _In(msgspec.Struct, tag_field="type", kw_only=True):
    v: int  # required: a frame without a version is refused rather than guessed


class Generate(_In, tag="generate"):
    request_id: str  # chosen by the client, unique among its unfinished requests
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None  # chat: the worker applies the chat template
    # chat with tools (Engine.chat's arguments, checked by the worker; docs/tools.md)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # Decoded separately, so a bad value is answered as InvalidRequestError for this request.
    params: msgspec.Raw = msgspec.Raw(b"\x80")  # an empty map: SamplingParams() defaults
    stream: bool = False  # True: Delta messages, the last one with finish_reason; False: one Result
    # encoded images (PNG, JPEG, ...), in the order of the prompt's `<image>` markers / image parts;
    # decoded and validated by the worker (slipstream/images.py), named `images[i]` in errors
    images: list[bytes] = []


class Abort(_In, tag="abort"):
    seq: int
    request_id: str


class StatsRequest(_In, tag="stats"):
    seq: int


class HealthRequest(_In, tag="health"):
    seq: int


class ChatPromptRequest(_In, tag="chat_prompt"):
    seq: int
    messages: list[dict[str, Any]]


class MetricsRequest(_In, tag="metrics"):
    seq: int


class LoadLoraRequest(_In, tag="load_lora"):
    """Engine.load_lora on the worker: the folder is a path on the worker's machine (docs/lora.md)."""

    seq: int
    lora_name: str
    lora_path: str


class UnloadLoraRequest(_In, tag="unload_lora"):
    seq: int
    lora_name: str


class Bye(_In, tag="bye"):
    """The client is closing: abort its requests now rather than at the next failed send."""


ClientMsg = (Generate | Abort | StatsRequest | HealthRequest | ChatPromptRequest | MetricsRequest | LoadLoraRequest
             | UnloadLoraRequest | Bye)


class Header(msgspec.Struct):
    """The fields an error reply needs, read leniently from a frame that failed full decoding."""

    v: int | None = None
    request_id: str | None = None
    seq: int | None = None
    images: msgspec.Raw = msgspec.Raw(b"\x90")  # (a view, not a copy) its size tells what made a frame too large
    prompt: msgspec.Raw = msgspec.Raw(b"\xc0")  # (the same, for a Generate's prompt: named as the Engine names it)


# --- worker -> client ----------------------------------------------------------------------------


class _Out(msgspec.Struct, tag_field="type", kw_only=True):
    pass


class Delta(_Out, tag="delta"):
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # set on the last delta of a stream, which ends it
    usage: Usage | None = None  # set on the last delta (cached_tokens included)
    content: str | None = None  # chat with tools: the answer's text in `text`
    tool_calls: list[ToolCallDelta] | None = None  # chat with tools: what `text` added to the calls


class Result(_Out, tag="result"):
    request_id: str
    output: CompletionOutput  # metrics are relative to the worker's arrival time (arrival = 0.0)


class Error(_Out, tag="error"):
    code: str  # the name of a SlipstreamError subclass (slipstream.errors), e.g. "OverloadedError"
    message: str
    request_id: str | None = None  # set when the error ends one request
    seq: int | None = None  # set when it answers an abort/stats/health call
    param: str | None = None  # the request field an InvalidRequestError / GrammarError names


class AbortReply(_Out, tag="abort_reply"):
    seq: int
    aborted: bool


class StatsReply(_Out, tag="stats_reply"):
    seq: int
    stats: dict[str, Any]


class HealthReply(_Out, tag="health_reply"):
    seq: int
    ready: bool
    draining: bool
    model: str
    pid: int
    heartbeat_s: float  # the worker sends a Heartbeat at least this often while a client has work
    max_message_bytes: int
    chat_template: bool
    version: int = PROTOCOL_VERSION
    accepts_images: bool = False  # the model has a vision tower (Generate.images are used)
    max_image_bytes: int = 0  # the bound on one Generate's image bytes, beyond max_message_bytes
    region_skills: bool = False  # point/detect run on the model's region heads (Moondream; api/skills.py)
    max_model_len: int = 0  # the engine's context in tokens (0: a worker that does not say)
    loras: list[dict[str, Any]] = []  # the LoRA adapters loaded now: name, path, rank, targets (docs/lora.md)


class ChatPromptReply(_Out, tag="chat_prompt_reply"):
    seq: int
    prompt: str  # the messages rendered by the model's chat template (Engine.chat_prompt)


class MetricsReply(_Out, tag="metrics_reply"):
    seq: int
    text: str  # Prometheus text exposition of the worker's engine metrics


class LoraReply(_Out, tag="lora_reply"):
    seq: int
    adapter: dict[str, Any] | None = None  # load_lora: what Engine.load_lora returned; unload_lora: None


class Heartbeat(_Out, tag="heartbeat"):
    inflight: int  # this client's unfinished requests, as the worker sees them


class Shutdown(_Out, tag="shutdown"):
    """The worker stopped admitting; unfinished requests finish or fail within deadline_s."""

    deadline_s: float
    reason: str


ServerMsg = (Delta | Result | Error | AbortReply | StatsReply | HealthReply | ChatPromptReply | MetricsReply
             | LoraReply | Heartbeat | Shutdown)


class Frame(msgspec.Struct):
    v: int
    msgs: list[ServerMsg]


# --- codecs ----------------------------------------------------------------------------------------


class Encoder:
    """msgpack encoder writing into one reused buffer (no new bytes object per message).

    The returned buffer is overwritten by the next call: send it with a copying send, and keep
    no memoryview of it (an exported bytearray cannot be resized by the next encode).
    """

    def __init__(self, keep_bytes: int = 1 << 16):
        self._enc = msgspec.msgpack.Encoder()
        self._buf = bytearray(keep_bytes)
        self._keep = keep_bytes

    def encode(self, obj: Any) -> bytearray:
        if len(self._buf) > 4 * self._keep:  # one huge message must not pin its buffer forever
            self._buf = bytearray(self._keep)
        self._enc.encode_into(obj, self._buf)
        return self._buf


class ClientMsgDecoder:
    """Worker side: frame -> ClientMsg. Raises msgspec.DecodeError (incl. ValidationError)."""

    def __init__(self) -> None:
        self._msg = msgspec.msgpack.Decoder(ClientMsg)
        self._header = msgspec.msgpack.Decoder(Header)

    def decode(self, data) -> ClientMsg:
        return self._msg.decode(data)

    def header(self, data) -> Header | None:
        try:
            return self._header.decode(data)
        except msgspec.DecodeError:
            return None


def frame_decoder() -> msgspec.msgpack.Decoder:
    """Client side: frame -> Frame."""
    return msgspec.msgpack.Decoder(Frame)


# --- wire forms of errors and outputs ---------------------------------------------------------


def error_to_wire(e: errors.SlipstreamError, request_id: str | None = None, seq: int | None = None) -> Error:
    return Error(code=type(e).__name__, message=str(e), request_id=request_id, seq=seq,
                 param=getattr(e, "param", None))


def error_from_wire(msg: Error) -> errors.SlipstreamError:
    """The wire carries the error's type name; a name this side does not know becomes WorkerError."""
    cls = getattr(errors, msg.code, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.SlipstreamError)):
        return errors.WorkerError(f"{msg.code}: {msg.message}")
    error = cls(msg.message)
    if msg.param is not None and hasattr(error, "param"):
        error.param = msg.param
    return error


def output_to_wire(out: CompletionOutput, request_id: str) -> CompletionOutput:
    """Clocks differ between processes: metrics travel relative to the worker's arrival time."""
    return dataclasses.replace(out, request_id=request_id, metrics=_shift(out.metrics, -out.metrics.arrival))


def output_from_wire(out: CompletionOutput, sent_at: float) -> CompletionOutput:
    """Place the metrics on the client's clock, arrival = when the client sent the request."""
    return dataclasses.replace(out, metrics=_shift(out.metrics, sent_at))


def _shift(m: RequestMetrics, by: float) -> RequestMetrics:
    return RequestMetrics(m.arrival + by, None if m.first_token is None else m.first_token + by,
                          [t + by for t in m.token_times], None if m.finished is None else m.finished + by)
