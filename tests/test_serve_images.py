"""`slipstream serve` with OpenAI image_url parts: data: URLs, http(s) URLs fetched from a local
server on 127.0.0.1 (timeout, size cap, allow-list, redirects), and every bad image a 400 in
OpenAI's error shape naming the part. The engine side of images is not here: a backend flagged
as taking images records what the server hands it."""
import http.server
import threading
import time

import pytest
from image_util import data_url, encoded, png_header_only
from serve_util import ThreadServer, httpx
from worker_util import engine_config

from slipstream.errors import InvalidRequestError
from slipstream.images import ImageInput, ImageLimits
from slipstream.serve import EngineBackend
from slipstream.serve.images import ImageServing, request_images

OK_PNG = encoded(10, 7)
BIG = b"\x89PNG" + b"\0" * 60_000  # over the 50,000-byte cap below: refused before it is decoded
LIMITS = ImageLimits(max_bytes=50_000, max_images=2)


class ImageHandler(http.server.BaseHTTPRequestHandler):
    requested: list[str] = []  # every path asked for, in order

    def do_GET(self):
        self.requested.append(self.path)
        if self.path == "/slow.png":
            time.sleep(3)
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_port}/ok.png")
            self.end_headers()
            return
        if self.path == "/missing.png":
            self.send_error(404)
            return
        body, ctype = {"/text": (b"<html>hi</html>", "text/html"), "/big.png": (BIG, "image/png"),
                       "/nolength.png": (BIG, "image/png")}.get(self.path, (OK_PNG, "image/png"))
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        if self.path != "/nolength.png":
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
            deadline = time.monotonic() + 3
            while self.path == "/nolength.png" and time.monotonic() < deadline:  # endless: the cap must stop it
                self.wfile.write(b"\0" * 65536)
        except OSError:  # the fetcher stopped reading at its cap
            pass

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def images_host():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ImageHandler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()


class VisionBackend(EngineBackend):
    """tiny-random flagged as taking images; answers the text and records the images it was handed."""

    accepts_images = True

    def __init__(self, config):
        super().__init__(config)
        self.calls = []

    async def complete(self, prompt, params, request_id, images=()):
        self.calls.append((prompt, list(images)))
        return await self.engine.complete(prompt, params, request_id=request_id)


@pytest.fixture(scope="module")
def vision():
    backend = VisionBackend(engine_config())
    serving = ImageServing(LIMITS, frozenset({"127.0.0.1"}), fetch_timeout_s=1.0)
    with ThreadServer(backend, images=serving) as s:
        yield s, backend



def chat(server, *urls, text="What is this?"):
    parts = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                      json={"messages": [{"role": "user", "content": parts}], "max_tokens": 3, "temperature": 0})


FIELD = "messages[0].content[{}].image_url.url"


def assert_400(r, index: int, *words: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == FIELD.format(index), err
    assert err["message"].startswith(FIELD.format(index) + ": ")
    for w in words:
        assert w in err["message"], err["message"]
    return err["message"]


def test_images_reach_the_backend_in_order_with_markers(vision, images_host):
    server, backend = vision
    backend.calls.clear()
    r = chat(server, data_url(OK_PNG), f"{images_host}/ok.png")
    assert r.status_code == 200, r.text
    (prompt, images), = backend.calls
    assert isinstance(prompt, str) and prompt.count("<image>") == 2
    assert [type(i) for i in images] == [ImageInput, ImageInput]
    assert [i.field for i in images] == [FIELD.format(1), FIELD.format(2)]
    assert images[0].digest == images[1].digest and images[0].image.size == (10, 7)


def test_text_requests_pass_token_ids_as_before(vision):
    server, backend = vision
    backend.calls.clear()
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 2})
    assert r.status_code == 200 and backend.calls[0][1] == [] and isinstance(backend.calls[0][0], list)


@pytest.mark.parametrize("url,words", [
    (data_url(b"hello, not a picture"), ["not an image"]),
    (data_url(encoded(64, 64, "JPEG")[:300]), []),  # truncated
    (data_url(png_header_only(0, 0)), []),
    (data_url(png_header_only(20_000, 20_000)), ["decompression bomb"]),
    (data_url(png_header_only(100_000, 100_000)), ["decompression bomb"]),
    (data_url(png_header_only(9000, 8)), ["longer side"]),
    (data_url(OK_PNG, "text/plain"), ["content type"]),
    (data_url(b"\0" * 60_000), ["at most 50,000"]),
    ("data:image/png;base64,%%%", ["base64"]),
    ("ftp://127.0.0.1/x.png", ["data: URL or an http(s) URL"]),
], ids=["not-image", "truncated", "0x0", "20000-square", "bomb", "side", "content-type", "bytes", "base64", "ftp"])
def test_each_bad_inline_image_is_a_400_naming_the_part(vision, url, words):
    assert_400(chat(vision[0], data_url(OK_PNG), url), 2, *words)


@pytest.mark.parametrize("path,words", [
    ("/text", ["content type 'text/html'"]),
    ("/big.png", ["60,004 bytes", "at most 50,000 bytes per image"]),
    ("/nolength.png", ["more than 50,000"]),
    ("/slow.png", ["longer than 1 s"]),
    ("/redirect", ["redirects to 'localhost'"]),
    ("/missing.png", ["HTTP 404"]),
])
def test_each_bad_remote_image_is_a_400_naming_the_part(vision, images_host, path, words):
    assert_400(chat(vision[0], f"{images_host}{path}"), 1, *words)


def test_hosts_outside_the_allow_list_are_not_fetched(vision, images_host):
    port = images_host.rsplit(":", 1)[1]
    assert_400(chat(vision[0], f"http://localhost:{port}/ok.png"), 1, "not in --allowed-image-hosts")


def test_too_many_images_names_the_first_extra(vision):
    assert_400(chat(vision[0], *[data_url(OK_PNG)] * 3), 3, "3 images", "at most 2")


def test_a_malformed_part_is_a_400_naming_its_path(vision):
    r = httpx.post(f"{vision[0].url}/v1/chat/completions", timeout=30, json={"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"detail": "low"}}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0].image_url.url", r.text


def test_a_text_model_refuses_images_before_fetching(images_host):
    with ThreadServer(EngineBackend(engine_config()),
                      images=ImageServing(LIMITS, frozenset({"127.0.0.1"}), 1.0)) as server:
        assert_400(chat(server, f"{images_host}/slow.png?text-model"), 1, "accepts no images")
        assert "/slow.png?text-model" not in ImageHandler.requested  # refused without fetching
        assert_400(chat(server, data_url(OK_PNG)), 1, "accepts no images")
        assert chat(server).status_code == 200  # and text still works


async def test_remote_fetch_is_off_by_default_and_says_how_to_enable(images_host):
    with pytest.raises(InvalidRequestError, match="--allowed-image-hosts") as info:
        await request_images([("f", f"{images_host}/ok.png")], ImageServing(), True, 10**6)
    assert info.value.param == "f"


async def test_fetched_bytes_count_against_the_body_budget(images_host):
    serving = ImageServing(ImageLimits(), frozenset({"127.0.0.1"}), 2.0)
    parts = [("a", f"{images_host}/ok.png"), ("b", f"{images_host}/ok.png")]
    assert len(await request_images(parts, serving, True, 2 * len(OK_PNG))) == 2
    with pytest.raises(InvalidRequestError, match="--max-body-bytes") as info:
        await request_images(parts, serving, True, 2 * len(OK_PNG) - 1)
    assert info.value.param == "b"


def test_pixel_budgets_refuse_a_request_400_and_a_full_server_429():
    """issue 37, item 9: a request's pictures are budgeted together (400 naming the one that passes
    it, from the headers) and the server's decoded pixels at once (429: retry later)."""
    limits = ImageLimits(max_request_pixels=100, max_inflight_pixels=50)  # OK_PNG is 10x7 = 70 pixels
    with ThreadServer(VisionBackend(engine_config()), images=ImageServing(limits)) as server:
        assert_400(chat(server, data_url(OK_PNG), data_url(OK_PNG)), 2, "140 pixels", "at most 100")
        r = chat(server, data_url(OK_PNG))
        assert r.status_code == 429 and "retry" in r.json()["error"]["message"], r.text
