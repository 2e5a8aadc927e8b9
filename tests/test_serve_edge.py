"""The HTTP edge against what an outside probe sent (issue 27, defects 7-9): size limits before any
decode or tokenizing, bodies msgspec cannot read, unknown routes, and the error counter — every
answer a 4xx in OpenAI's shape. A scripted backend: no model."""
import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from serve_util import ThreadServer  # noqa: E402

from slipstream.models.tokenizers.byte_tokenizer import ByteTokenizer  # noqa: E402
from slipstream.outputs import CompletionOutput, RequestMetrics, StreamDelta  # noqa: E402

MAX_BODY, MAX_CHARS = 64 * 1024, 1000


class CountingTokenizer(ByteTokenizer):
    encodes = 0
    decode_threads: list = []

    def encode(self, text, add_special_tokens=True):
        CountingTokenizer.encodes += 1
        return super().encode(text, add_special_tokens)

    def decode(self, ids, skip_special_tokens=True):
        import threading

        CountingTokenizer.decode_threads.append((len(ids), threading.current_thread().name))
        return super().decode(ids, skip_special_tokens)


class Backend:
    model_name, vocab_size, max_model_len, max_prompt_chars = "edge-model", 512, 2048, MAX_CHARS

    def __init__(self):
        self.tokenizer = CountingTokenizer(512)

    async def start(self):
        pass

    async def close(self):
        pass

    async def stream(self, ids, params, request_id):
        yield StreamDelta(request_id, "a", [100], "length")

    async def complete(self, ids, params, request_id):
        return CompletionOutput(request_id, "a", [100], "length", list(ids), RequestMetrics(0.0))

    async def stats(self):
        return {"kv_pages_free": 1, "kv_pages_total": 1, "running": 0}

    def metrics_text(self):
        return ""


@pytest.fixture(scope="module")
def server():
    with ThreadServer(Backend(), max_body_bytes=MAX_BODY) as s:
        yield s


def _openai_error(r, status, param="unset"):
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param != "unset":
        assert err["param"] == param, err
    return err


def test_a_body_over_the_limit_is_413_before_it_is_read(server):
    before = CountingTokenizer.encodes
    with httpx.Client(base_url=server.url) as http:
        big = b'{"prompt": "' + b"x" * (2 * MAX_BODY) + b'", "max_tokens": 2}'
        err = _openai_error(http.post("/v1/completions", content=big,
                                      headers={"content-type": "application/json"}), 413)
        assert err["code"] == "request_too_large"

        def chunks():  # no Content-Length: refused once the bytes received pass the limit
            yield big[:MAX_BODY // 2]
            yield big[MAX_BODY // 2:]

        _openai_error(http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}),
                      413)
        _openai_error(http.post("/tokenize", content=big), 413)
    assert CountingTokenizer.encodes == before


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "y" * (MAX_CHARS + 1), "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * (MAX_CHARS + 1)}]}, "messages"),
    ("/tokenize", {"prompt": "y" * (MAX_CHARS + 1)}, "prompt"),
])
def test_a_prompt_over_max_prompt_chars_is_400_before_it_is_tokenized(server, path, body, param):
    before = CountingTokenizer.encodes
    with httpx.Client(base_url=server.url) as http:
        err = _openai_error(http.post(path, json=body), 400, param)
    assert "characters" in err["message"] and CountingTokenizer.encodes == before


def test_detokenize_takes_at_most_max_model_len_ids_off_the_loop(server):
    """issue 37, item 8: 4.1 M ids held the loop 1.4 s; now at most the context's worth, decoded on
    a worker thread when long (the uvicorn thread runs the loop)."""
    CountingTokenizer.decode_threads.clear()
    with httpx.Client(base_url=server.url) as http:
        err = _openai_error(http.post("/detokenize", json={"tokens": [72] * (Backend.max_model_len + 1)}), 400,
                            "tokens")
        assert "2,048" in err["message"] and err["code"] == "too_many_tokens"
        assert CountingTokenizer.decode_threads == []
        r = http.post("/detokenize", json={"tokens": [72] * Backend.max_model_len})
        assert r.status_code == 200 and r.json()["prompt"] == "E" * Backend.max_model_len
        assert http.post("/detokenize", json={"tokens": [72, 73]}).json()["prompt"] == "EF"
    (n, thread), (_, short_thread) = CountingTokenizer.decode_threads
    assert n == Backend.max_model_len and thread != "uvicorn-test" and short_thread == "uvicorn-test"


def test_a_detokenize_body_longer_than_its_ids_need_is_413_before_it_is_read(server):
    from slipstream.serve.app import detokenize_body_limit

    limit = detokenize_body_limit(Backend.max_model_len)
    assert limit < MAX_BODY  # (else the server-wide limit is the one tested)
    body = b'{"tokens": [' + b",".join([b"72"] * (limit // 3 + 1)) + b"]}"
    with httpx.Client(base_url=server.url) as http:
        err = _openai_error(http.post("/detokenize", content=body, headers={"content-type": "application/json"}),
                            413)
    assert err["code"] == "request_too_large" and f"{limit:,}" in err["message"]


@pytest.mark.parametrize("raw", [
    b'{"prompt": "ab\xff\xfecd", "max_tokens": 2}',  # invalid UTF-8 inside a JSON string
    b'{"prompt": "hi", "messages": [], "response_format": {"type": "json_schema", "json_schema": {"schema": '
    b'{"a": ' + b"[" * 3000 + b"]" * 3000 + b"}}}}",  # nested 3,000 deep where any JSON is welcome
    b'{"prompt": "hi", "messages": [], "tools": ' + b'[{"a":' * 3000 + b"1" + b"}]" * 3000 + b"}",
    b"\xff\xfe",
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_bodies_msgspec_cannot_read_are_400(server, path, raw):
    with httpx.Client(base_url=server.url) as http:
        _openai_error(http.post(path, content=raw, headers={"content-type": "application/json"}), 400)


def test_an_unknown_chat_role_is_400_naming_it(server):
    with httpx.Client(base_url=server.url) as http:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "alien", "content": "hi"}]})
    assert _openai_error(r, 400)["param"] == "messages[0].role"


def test_unknown_routes_and_methods_answer_in_openais_shape(server):
    with httpx.Client(base_url=server.url) as http:
        assert _openai_error(http.get("/v1/nothing"), 404)["code"] == "not_found"
        r = http.get("/v1/completions")
        _openai_error(r, 405)
        assert "POST" in r.headers.get("allow", "")
        assert http.get("/v1/models/edge-model").json() == {**http.get("/v1/models").json()["data"][0],
                                                            "created": http.get("/v1/models/edge-model")
                                                            .json()["created"]}
        assert _openai_error(http.get("/v1/models/gpt-4"), 404, "model")["code"] == "model_not_found"


def _count(text, endpoint, status):
    for line in text.splitlines():
        if line.startswith("slipstream_http_requests_total{") and f'endpoint="{endpoint}"' in line \
                and f'status="{status}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_refusals_are_counted_in_the_requests_counter(server):
    with httpx.Client(base_url=server.url) as http:
        before = http.get("/metrics").text
        http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0})
        http.post("/v1/chat/completions", content=b"\xff")
        http.get("/v1/nothing")
        after = http.get("/metrics").text
    assert _count(after, "completions", 400) == _count(before, "completions", 400) + 1
    assert _count(after, "chat", 400) == _count(before, "chat", 400) + 1
    assert _count(after, "other", 404) == _count(before, "other", 404) + 1


@pytest.mark.parametrize("logprobs", [0, 1, 5])
def test_streamed_completion_logprobs_are_refused_alike(server, logprobs):
    with httpx.Client(base_url=server.url) as http:
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True, "logprobs": logprobs})
    _openai_error(r, 400, "logprobs")


def test_legacy_top_logprobs_keep_byte_tokens_apart():
    from slipstream.serve.render import completion_logprobs

    tok = ByteTokenizer(512)
    out = CompletionOutput("r", "e", [104], "length", [5], RequestMetrics(0.0), logprobs=[-0.5],
                           top_logprobs=[{104: -0.5, 200: -1.0, 201: -2.0, 202: -3.0}])
    top = completion_logprobs(tok, out)["top_logprobs"][0]
    assert len(top) == 4 and top["e"] == -0.5
    assert {k for k in top if k != "e"} == {"bytes:\\xc5", "bytes:\\xc6", "bytes:\\xc7"}


def test_a_response_format_schema_nested_too_deeply_is_400(server):
    schema = b'{"type":"array","items":' * 1500 + b'{"type":"string"}' + b"}" * 1500  # msgspec reads it; json won't
    body = (b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", '
            b'"json_schema": {"schema": ' + schema + b"}}}")
    with httpx.Client(base_url=server.url) as http:
        r = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert _openai_error(r, 400)["param"] in (None, "response_format.json_schema.schema")


# --- idle and slow-dripping connections (raw sockets, 127.0.0.1 only, bounded) ---------------
READ_TIMEOUT = 0.5


@pytest.fixture(scope="module")
def timed_server():
    with ThreadServer(Backend(), read_timeout_s=READ_TIMEOUT) as s:
        yield s


def _closed_within(sock, seconds):
    """True if the server closes `sock` within `seconds` (what it sends first is ignored)."""
    import socket as _socket
    import time

    deadline = time.monotonic() + seconds
    sock.settimeout(0.1)
    while time.monotonic() < deadline:
        try:
            if sock.recv(4096) == b"":
                return True
        except _socket.timeout:
            continue
        except OSError:
            return True
    return False


def test_an_idle_connection_is_closed(timed_server):
    import socket

    with socket.create_connection(("127.0.0.1", timed_server.port), timeout=5) as s:
        assert _closed_within(s, READ_TIMEOUT * 20)  # a 'does not hang' bound: returns at the close


def test_a_slow_dripping_request_is_closed(timed_server):
    import socket

    with socket.create_connection(("127.0.0.1", timed_server.port), timeout=5) as s:
        closed, sent = False, 0
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b" " * 100
        for byte in head:  # a byte every 0.1 s: ~17 s for the whole request, 34x the deadline
            try:
                s.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            sent += 1
            s.settimeout(0.1)
            try:
                if s.recv(4096) == b"":
                    closed = True
                    break
            except socket.timeout:
                pass
        assert closed and sent < len(head)  # cut off mid-request (event order, not a wall-time bound)


def test_a_prompt_request_and_keep_alive_still_work(timed_server):
    import time

    with httpx.Client(base_url=timed_server.url) as http:
        for _ in range(2):  # the second request on the same connection, after a pause under the timeout
            r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200
            time.sleep(READ_TIMEOUT / 2)
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True})
        assert r.status_code == 200 and "[DONE]" in r.text


def _half_a_body(port: int) -> None:
    """Headers promising 1,000 bytes of body, 10 of them, then a close (or nothing more)."""
    import socket

    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 1000\r\n\r\n" + b'{"prompt":')
    return s


def _counts(url: str) -> tuple[float, float, float]:
    text = httpx.get(url + "/metrics").text
    return tuple(_count(text, "completions", status) for status in (499, 408, 500))


def _wait_for(url: str, want, seconds: float = 5.0) -> tuple:
    import time

    deadline = time.monotonic() + seconds
    while (got := _counts(url)) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def test_a_client_gone_mid_body_is_its_own_outcome_not_a_crash(server):
    """issue 37, item 12: it was logged as request_crashed with a traceback and counted as a 500."""
    closed, timed_out, crashed = _counts(server.url)
    _half_a_body(server.port).close()
    assert _wait_for(server.url, (closed + 1, timed_out, crashed)) == (closed + 1, timed_out, crashed)


def test_a_body_cut_by_the_read_timeout_is_a_408_not_a_crash(timed_server):
    closed, timed_out, crashed = _counts(timed_server.url)
    s = _half_a_body(timed_server.port)
    try:
        assert _wait_for(timed_server.url, (closed, timed_out + 1, crashed), READ_TIMEOUT + 5) == \
            (closed, timed_out + 1, crashed)
    finally:
        s.close()


# --- shutdown: a stream past the graceful timeout ends with an SSE error event ----------------
class EndlessBackend(Backend):
    async def stream(self, ids, params, request_id):
        import asyncio

        yield StreamDelta(request_id, "a", [100])
        await asyncio.sleep(3600)  # a stream that would outlive any shutdown timeout


def test_a_stream_past_the_shutdown_timeout_gets_an_error_event():
    import threading
    import time

    server = ThreadServer(EndlessBackend(), shutdown_timeout=1.0).__enter__()
    lines, done = [], threading.Event()

    def read():
        try:
            with httpx.Client(base_url=server.url, timeout=30) as http:
                with http.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True}) as r:
                    for line in r.iter_lines():
                        if line:
                            lines.append(line)
        finally:
            done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 10
    while not lines and time.monotonic() < deadline:
        time.sleep(0.01)
    server.__exit__(None, None, None)  # as SIGTERM: should_exit, then uvicorn's graceful shutdown
    assert done.wait(30)  # 'does not hang' (~1 s: the shutdown timeout); the stream alone would last an hour
    import json

    assert lines[-1] == "data: [DONE]", lines
    err = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert err["code"] == "shutting_down" and err["type"] == "service_unavailable"
