"""Images over the worker protocol: encoded bytes in the Generate frame, bounded by
--max-image-bytes on top of --max-message-bytes; an oversized frame is refused naming `images`
and the worker goes on serving; a text model refuses images naming the part."""
import msgspec
import pytest
from image_util import encoded
from PIL import Image
from test_worker_fuzz import Raw
from worker_util import free_tcp_address, start_worker

from slipstream import Client, InvalidRequestError, SamplingParams
from slipstream.api.protocol import PROTOCOL_VERSION, Generate
from slipstream.images import images_to_bytes

MAX_BYTES, MAX_IMAGE_BYTES = 4096, 20_000
enc = msgspec.msgpack.encode
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    w = start_worker(free_tcp_address(), tmp_path_factory.mktemp("wimg"), "--max-message-bytes", str(MAX_BYTES),
                     "--max-image-bytes", str(MAX_IMAGE_BYTES), "--log-level", "warning")
    yield w
    w.stop()


def generate(rid: str, images: list[bytes], prompt: str = "look") -> bytes:
    return enc(Generate(v=PROTOCOL_VERSION, request_id=rid, prompt=prompt, images=images,
                        params=msgspec.Raw(enc(PARAMS))))


async def test_frames_with_images_are_bounded_and_named(worker):
    raw = Raw(worker.address)
    try:
        # images past --max-image-bytes: refused, naming `images`, before anything is decoded
        (err,) = await raw.ask(generate("big", [b"\0" * 12_000, b"\0" * 12_000]))
        assert (err.code, err.param, err.request_id) == ("MessageTooLargeError", "images", "big")
        # text past --max-message-bytes does not hide behind images; the prompt is named, as the
        # Engine names a prompt over its limit (issue 37, item 11)
        (err,) = await raw.ask(generate("text", [b"\0" * 100], prompt="x" * (MAX_BYTES + 10)))
        assert (err.code, err.param, err.request_id) == ("InvalidRequestError", "prompt", "text")
        # a frame over max_message_bytes only because of its images is read: this model has no vision
        (err,) = await raw.ask(generate("ok", [encoded(), b"\0" * (MAX_BYTES + 10)]))
        assert (err.code, err.param) == ("InvalidRequestError", "images[0]"), err
        assert "accepts no images" in err.message
        (err,) = await raw.ask(enc({"type": "generate", "v": 1, "request_id": "t", "prompt": "p", "images": 5}))
        assert err.code == "ProtocolError" and err.request_id == "t"
    finally:
        raw.close()
    async with Client(worker.address, timeout=10) as client:  # still serving; old frames (no images) work
        assert client.info.max_image_bytes == MAX_IMAGE_BYTES and client.info.accepts_images is False
        out = await client.complete("after images", PARAMS)
        assert len(out.token_ids) == 4


async def test_client_encodes_and_the_worker_names_the_part(worker):
    async with Client(worker.address, timeout=10) as client:
        for call in (lambda **kw: client.complete("look", PARAMS, **kw),
                     lambda **kw: client.chat([{"role": "user", "content": "look"}], PARAMS, **kw)):
            with pytest.raises(InvalidRequestError, match=r"^images\[0\]: this model accepts no images") as info:
                await call(images=[Image.new("RGBA", (4, 4))])
            assert info.value.param == "images[0]"
        with pytest.raises(InvalidRequestError) as info:  # the worker's bound, checked before sending
            await client.complete("look", PARAMS, images=[b"\0" * (MAX_IMAGE_BYTES + 1)])
        assert info.value.param == "images" and "max_image_bytes" in str(info.value)
        with pytest.raises(InvalidRequestError) as info:
            async for _ in client.stream("look", PARAMS, images=["/nonexistent.png"]):
                pass
        assert info.value.param == "images[0]"
        with pytest.raises(InvalidRequestError) as info:
            await client.complete("look", PARAMS, images=Image.new("RGB", (2, 2)))  # not a list
        assert info.value.param == "images"
        assert len((await client.complete("fine", PARAMS)).token_ids) == 4


def test_images_to_bytes_keeps_encoded_input_and_pngs_pil_images(tmp_path):
    raw = encoded(4, 4, "JPEG")
    (tmp_path / "a.jpg").write_bytes(raw)
    got = images_to_bytes([raw, tmp_path / "a.jpg", Image.new("L", (3, 3))])
    assert got[0] == raw and got[1] == raw and got[2].startswith(b"\x89PNG")
    with pytest.raises(InvalidRequestError) as info:
        images_to_bytes([raw] * 9)
    assert info.value.param == "images[8]"
