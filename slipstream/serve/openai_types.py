"""Typed OpenAI request bodies (msgspec Structs), decoded and type-checked in one pass.

Ranges are declared with `Meta` so a bad value fails here, where msgspec knows the field's path,
rather than later in SamplingParams. Fields OpenAI defines but slipstream cannot honour are
accepted when they ask for nothing (no logit_bias, no echo) and refused otherwise;
fields nobody defines are ignored, as the OpenAI server does. See docs/serving.md.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from slipstream.params import MAX_CACHE_SALT, MAX_N, MAX_TOP_LOGPROBS
from slipstream.tool_calls.spec import MAX_TOOLS
from slipstream.validate import ChatRole

PositiveInt = Annotated[int, Meta(ge=1)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Seed = Annotated[int, Meta(ge=0, le=2**63 - 1)]
StopList = Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(max_length=16)]
TokenId = Annotated[int, Meta(ge=0)]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class JsonSchemaFormat(msgspec.Struct):
    name: str = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class GrammarField(msgspec.Struct, forbid_unknown_fields=True):
    """slipstream extra: any registered grammar kind (point / detect / segment / plugins)."""

    kind: Annotated[str, Meta(min_length=1)]
    value: str = ""
    max_objects: Annotated[int, Meta(ge=1, le=4096)] = 16


class _Sampling(msgspec.Struct, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1  # choices, fanned out by the server (not streamed)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[str, Meta(min_length=1)] | StopList | None = None
    seed: Seed | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: Annotated[dict[str, float], Meta(max_length=0)] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # --- slipstream / vLLM extras (extra_body in the OpenAI SDK) ---
    top_k: Annotated[int, Meta(ge=-1)] = 0
    repetition_penalty: Annotated[float, Meta(gt=0.0)] = 1.0
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] = []
    regex: Annotated[str, Meta(min_length=1)] | None = None
    choice: Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(min_length=1)] | None = None
    grammar: GrammarField | None = None
    # vLLM's field: requests share cached prompt pages only with requests of the same salt
    cache_salt: Annotated[str, Meta(min_length=1, max_length=MAX_CACHE_SALT)] | None = None
    speculative: bool = True  # False: this request's steps feed no drafts (docs/speculative.md)


class CompletionRequest(_Sampling, kw_only=True):
    prompt: Annotated[str, Meta(min_length=1)] | Annotated[list[TokenId], Meta(min_length=1)]
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None  # the sampled token's logprob and k alternatives
    echo: Literal[False] = False
    suffix: None = None
    best_of: Annotated[int, Meta(ge=1, le=1)] | None = None


class TextPart(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ImageUrl(msgspec.Struct, forbid_unknown_fields=True):
    url: Annotated[str, Meta(min_length=1)]  # a data:image/...;base64 URL, or http(s) (--allowed-image-hosts)
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor decides the tiling


class ImageUrlPart(msgspec.Struct, tag_field="type", tag="image_url"):
    image_url: ImageUrl


IMAGE_MARKER = "<image>"  # where an image part stood, in the text the chat template renders


class CalledFunction(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as OpenAI returned it


class HistoryToolCall(msgspec.Struct, kw_only=True):
    """A call in an assistant message of the history (what an earlier answer returned)."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(msgspec.Struct, kw_only=True):
    role: ChatRole  # as the Engine: one the chat templates know
    content: str | list[TextPart | ImageUrlPart] | None = None
    name: str | None = None
    tool_calls: list[HistoryToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool: the call this message answers

    def text(self) -> str:
        """The content as text; each image part becomes IMAGE_MARKER (none in a text-only request)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text if isinstance(p, TextPart) else IMAGE_MARKER for p in self.content)

    def template_content(self) -> str | list[dict]:
        """What the chat template sees: the text, or, where the message has image parts, its parts
        with each image as {"type": "image"}, as `Engine.chat` hands them (a vision template such as
        SmolVLM's places the image marker itself and lays out image and text parts differently)."""
        if not isinstance(self.content, list) or not any(isinstance(p, ImageUrlPart) for p in self.content):
            return self.text()
        return [{"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"}
                for p in self.content]


def image_parts(messages: list[ChatMessage]) -> list[tuple[str, str]]:
    """(field, url) of every image part, in prompt order; field e.g. messages[0].content[1].image_url.url."""
    return [(f"messages[{i}].content[{j}].image_url.url", p.image_url.url)
            for i, m in enumerate(messages) if isinstance(m.content, list)
            for j, p in enumerate(m.content) if isinstance(p, ImageUrlPart)]


class FunctionDef(msgspec.Struct, kw_only=True):
    name: str  # checked by slipstream/tool_calls/spec.py, which names the field
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted: calls always follow the schema (docs/tools.md)


class ChatTool(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None  # needs logprobs: true
    tools: Annotated[list[ChatTool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    model: str | None = None
    add_generation_prompt: bool = True
    # with messages: the prompt a chat completion with these tools renders (they are in it)
    tools: Annotated[list[ChatTool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[TokenId]
    model: str | None = None
