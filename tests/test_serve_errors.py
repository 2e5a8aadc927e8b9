"""Error paths of the HTTP layer with a scripted backend (no model): engine and worker errors map to
OpenAI-shaped 400/429/503, a failure after the stream started arrives as an SSE error event, and
request ids reach the response."""
import pytest
from serve_util import ThreadServer

from slipstream import errors
from slipstream.models.tokenizers.byte_tokenizer import ByteTokenizer
from slipstream.outputs import CompletionOutput, RequestMetrics, StreamDelta
from slipstream.serve.sse import parse

httpx = pytest.importorskip("httpx")


class ScriptedBackend:
    """Fails the way `self.fail` says: at submission ("submit") or after the first delta ("mid")."""

    model_name, vocab_size, max_model_len = "scripted", 512, 1024

    def __init__(self):
        self.tokenizer = ByteTokenizer(512)
        self.error: errors.SlipstreamError | None = None
        self.when = "submit"

    async def start(self):
        pass

    async def close(self):
        pass

    async def stream(self, ids, params, request_id):
        if self.error is not None and self.when == "submit":
            raise self.error
        yield StreamDelta(request_id, "a", [100])
        if self.error is not None:
            raise self.error
        yield StreamDelta(request_id, "b", [101], "length")

    async def complete(self, ids, params, request_id):
        if self.error is not None:
            raise self.error
        return CompletionOutput(request_id, "ab", [100, 101], "length", list(ids), RequestMetrics(0.0))

    async def stats(self):
        return {"kv_pages_free": 1, "kv_pages_total": 1, "running": 0}

    def metrics_text(self):
        return ""


@pytest.fixture(scope="module")
def server():
    with ThreadServer(ScriptedBackend()) as s:
        yield s


@pytest.mark.parametrize("error, status, type_", [
    (errors.InvalidRequestError("bad"), 400, "invalid_request_error"),
    (errors.GrammarCompileError("no grammar"), 400, "invalid_request_error"),
    (errors.OverloadedError("queue full"), 429, "rate_limit_error"),
    (errors.WorkerShuttingDownError("draining"), 503, "service_unavailable"),
    (errors.EngineClosedError("closed"), 503, "service_unavailable"),
    (errors.WorkerError("boom"), 500, "server_error"),
])
@pytest.mark.parametrize("stream", [False, True])
async def test_backend_errors_map_to_statuses(server, error, status, type_, stream):
    backend = server.state.backend
    backend.error, backend.when = error, "submit"
    async with httpx.AsyncClient(base_url=server.url) as http:
        r = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": stream})
    assert r.status_code == status
    body = r.json()["error"]
    assert body["type"] == type_ and body["code"] == type(error).__name__ and body["message"] == str(error)
    assert server.state.inflight == 0  # released on every path


async def test_failure_after_the_stream_started_is_an_sse_error_event(server):
    backend = server.state.backend
    backend.error, backend.when = errors.WorkerUnavailableError("lost the worker"), "mid"
    async with httpx.AsyncClient(base_url=server.url) as http:
        r = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                          "max_tokens": 2, "stream": True})
    events = parse(r.text)
    assert r.status_code == 200
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[1]["choices"][0]["delta"]["content"] == "a"
    assert events[2]["error"]["message"] == "lost the worker" and events[2]["error"]["type"] == "service_unavailable"
    assert events[3] == "[DONE]" and len(events) == 4
    assert server.state.inflight == 0


async def test_client_request_id_is_folded_into_the_id(server):
    server.state.backend.error = None
    async with httpx.AsyncClient(base_url=server.url) as http:
        r = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                            headers={"X-Request-Id": "trace-42"})
        weird = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                headers={"X-Request-Id": "no spaces allowed"})
    assert r.status_code == 200 and r.json()["id"].startswith("cmpl-trace-42-")
    assert r.headers["x-request-id"] == r.json()["id"]
    assert "no spaces" not in weird.json()["id"]


async def test_a_chat_template_that_refuses_the_messages_is_400(server):
    class Refusing(ByteTokenizer):
        def apply_chat_template(self, messages, add_generation_prompt=True):
            raise ValueError("Conversation roles must alternate user/assistant")

    backend = server.state.backend
    backend.error, kept, backend.tokenizer = None, backend.tokenizer, Refusing(512)
    try:
        async with httpx.AsyncClient(base_url=server.url) as http:
            r = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    finally:
        backend.tokenizer = kept
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "alternate" in r.json()["error"]["message"]
