"""slipstream/images.py: every way an image can be bad is an InvalidRequestError naming the field,
checked before any pixel is decoded where the header already says no; good ones become RGB with a
digest of their pixels; decoding runs off the event loop."""
import asyncio
import io
import threading

import pytest
from image_util import data_url, encoded, png_header_only
from PIL import Image, ImageFile

from slipstream import images
from slipstream import SamplingParams
from slipstream.errors import InvalidRequestError
from slipstream.images import (ImageInput, ImageLimits, check_image_count, load_image, load_images,
                               require_vision)

FIELD = "messages[0].content[1].image_url.url"


def refused(obj, limits=ImageLimits(), field=FIELD) -> str:
    with pytest.raises(InvalidRequestError) as info:
        load_image(obj, field, limits)
    assert info.value.param == field
    assert str(info.value).startswith(field + ": ")
    return str(info.value)



# --- good input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["pil", "bytes", "path", "pathlike", "data_url"])
def test_every_kind_of_input_gives_the_same_rgb_picture_and_digest(kind, tmp_path):
    raw = encoded(8, 6)
    (tmp_path / "a.png").write_bytes(raw)
    obj = {"pil": Image.open(tmp_path / "a.png"), "bytes": raw, "path": str(tmp_path / "a.png"),
           "pathlike": tmp_path / "a.png", "data_url": data_url(raw)}[kind]
    got = load_image(obj, "images[0]")
    assert isinstance(got, ImageInput) and got.field == "images[0]"
    assert got.image.mode == "RGB" and got.image.size == (8, 6)
    assert got.image.getpixel((0, 0)) == (200, 30, 40)
    assert got.digest == load_image(raw, "x").digest


def test_digest_is_of_the_pixels_not_the_file():
    png, bmp = encoded(5, 5, "PNG"), encoded(5, 5, "BMP")
    assert png != bmp and load_image(png, "a").digest == load_image(bmp, "b").digest
    assert load_image(encoded(5, 5, color=(1, 2, 3)), "a").digest != load_image(png, "a").digest
    assert load_image(encoded(5, 4), "a").digest != load_image(encoded(4, 5), "a").digest  # same bytes count


@pytest.mark.parametrize("mode,want", [("RGBA", (255, 255, 255)), ("LA", (255, 255, 255)), ("L", (0, 0, 0)),
                                       ("P", (0, 0, 0)), ("CMYK", (255, 255, 255)), ("I;16", (0, 0, 0))])
def test_other_modes_become_rgb_over_white(mode, want):
    got = load_image(Image.new(mode, (3, 2)), "images[0]")  # transparent / zero pixels of each mode
    assert got.image.mode == "RGB" and got.image.getpixel((1, 1)) == want


def test_an_already_loaded_image_is_not_decoded_again():
    first = load_image(encoded(), "a")
    again = load_image(first, "messages[2].content[0]")
    assert again.image is first.image and again.digest == first.digest and again.field == "messages[2].content[0]"


# --- bad input: each refused naming the field ------------------------------------------------------


def test_not_an_image():
    assert "not an image" in refused(b"GIF89 this is text, not a picture")
    assert "empty" in refused(b"")


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_truncated(fmt):
    buf = io.BytesIO()
    Image.effect_noise((64, 64), 60).convert("RGB").save(buf, fmt)  # noise: most bytes are pixel data
    raw = buf.getvalue()
    assert "truncated" in refused(raw[: len(raw) * 3 // 4])


def test_zero_by_zero():
    assert "no pixels" in refused(Image.new("RGB", (0, 0)))
    refused(png_header_only(0, 0))  # Pillow refuses that header itself: still our error, our field


def test_twenty_thousand_square_is_refused_before_decoding(monkeypatch):
    loads = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: loads.append(self) or (_ for _ in ()).throw(
        AssertionError("decoded")))
    assert "decompression bomb" in refused(png_header_only(20_000, 20_000))  # Pillow's guard, at open
    # within Pillow's own bomb limit, so only our header check stands between it and decoding
    assert "longer side may be at most 8192" in refused(png_header_only(9000, 10))
    assert "49,000,000 pixels" in refused(png_header_only(7000, 7000))
    assert loads == []


def test_decompression_bomb_becomes_our_error():
    wide_open = ImageLimits(max_pixels=10**12, max_side=10**6)  # only Pillow's MAX_IMAGE_PIXELS guard is left
    assert "decompression bomb" in refused(png_header_only(100_000, 100_000), wide_open)


def test_limits_of_a_pil_image_too():
    assert "longer side" in refused(Image.new("L", (9000, 1)))


def test_bytes_over_max_bytes():
    raw = encoded(64, 64)
    assert f"{len(raw):,} bytes" in refused(raw, ImageLimits(max_bytes=len(raw) - 1))
    assert "bytes" in refused(data_url(raw), ImageLimits(max_bytes=len(raw) // 2))


def test_file_over_max_bytes_is_not_read(tmp_path, monkeypatch):
    p = tmp_path / "big.png"
    p.write_bytes(encoded(64, 64))
    monkeypatch.setattr(type(p), "read_bytes", lambda self: pytest.fail("read a file over the limit"))
    assert "bytes" in refused(p, ImageLimits(max_bytes=10))


@pytest.mark.parametrize("url,why", [
    ("data:text/plain;base64,aGVsbG8=", "content type is 'text/plain'"),
    ("data:;base64,aGVsbG8=", "content type is 'missing'"),
    ("data:image/png,rawtext", "base64"),
    ("data:image/png;base64,@@@@", "not valid base64"),
    ("data:image/png", "must look like"),
])
def test_bad_data_urls(url, why):
    assert why in refused(url)


def test_wrong_content_type_in_a_good_url_is_still_refused():
    assert "text/html" in refused(data_url(encoded(), "text/html"))


def test_paths_and_types():
    assert "No such file" in refused("/nonexistent/x.png")
    assert "fetched only by `slipstream serve`" in refused("https://example.com/a.png")
    assert "got int" in refused(3)


def test_unsupported_formats_are_refused(tmp_path):
    buf = tmp_path / "a.ico"
    Image.new("RGB", (16, 16)).save(buf, "ICO")
    assert "supported format" in refused(buf.read_bytes())


def test_too_many_images_and_no_vision():
    check_image_count(8, "images", ImageLimits())
    with pytest.raises(InvalidRequestError, match=r"^images\[2\]: 3 images") as info:
        check_image_count(3, "images[2]", ImageLimits(max_images=2))
    assert info.value.param == "images[2]"
    require_vision(True, "x")
    with pytest.raises(InvalidRequestError, match=r"^messages\[0\]\.content\[1\]: this model accepts no images"):
        require_vision(False, "messages[0].content[1]")


def test_limits_are_checked():
    with pytest.raises(InvalidRequestError, match="max_images"):
        ImageLimits(max_images=0)


# --- off the event loop ----------------------------------------------------------------------------


async def test_load_images_decodes_on_another_thread_while_the_loop_runs(monkeypatch):
    loop_thread = threading.get_ident()
    ticked = threading.Event()
    seen = []
    real = images.load_request_images

    def slow_load(objs, fields, limits):
        seen.append(threading.get_ident())
        # the loop must be free to tick while this decode runs; on the loop it would wait in vain
        seen.append(ticked.wait(timeout=5))
        return real(objs, fields, limits)

    monkeypatch.setattr(images, "load_request_images", slow_load)

    async def ticker():
        await asyncio.sleep(0)
        ticked.set()

    t = asyncio.ensure_future(ticker())
    got = await load_images([encoded(), encoded(2, 2)], ["images[0]", "images[1]"])
    await t
    assert [g.field for g in got] == ["images[0]", "images[1]"]
    assert seen[0] != loop_thread and seen[1] is True


async def test_load_images_counts_first_and_names_the_first_extra():
    with pytest.raises(InvalidRequestError) as info:
        await load_images([b"x"] * 3, ["a", "b", "c"], ImageLimits(max_images=2))
    assert info.value.param == "c"
    with pytest.raises(InvalidRequestError) as info:
        await load_images([encoded(), b"junk"], ["a", "b"])
    assert info.value.param == "b"
    assert await load_images([], []) == []


# --- slipstream.LLM and the CLI ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm():
    from worker_util import engine_config

    from slipstream import LLM

    with LLM(engine_config()) as llm:
        yield llm


def test_llm_refuses_images_for_a_text_model_naming_the_image(llm, tmp_path):
    with pytest.raises(InvalidRequestError, match=r"^images\[0\]: this model accepts no images") as info:
        llm.generate("look <image>", images=[encoded()])
    assert info.value.param == "images[0]"
    with pytest.raises(InvalidRequestError) as info:  # a batch: one list per prompt, named by both indexes
        llm.generate(["a", "b"], images=[[], [b"not an image"]])
    assert info.value.param == "images[1][0]"  # (refused as a text model before decoding)
    with pytest.raises(InvalidRequestError, match="2 lists of images for 3 prompts"):
        llm.generate(["a", "b", "c"], images=[[], []])
    with pytest.raises(InvalidRequestError) as info:
        llm.chat([{"role": "user", "content": [{"type": "text", "text": "hi"},
                                               {"type": "image", "image": encoded()}]}])
    assert info.value.param == "conversations[0][0].content[1]"
    out, = llm.generate("still text", SamplingParams(max_tokens=2), images=[[]][0])
    assert len(out.token_ids) == 2


def run_cli(*argv) -> tuple[int, str]:
    import contextlib

    from slipstream.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main(list(argv))
    return status, err.getvalue()


def test_cli_refuses_a_bad_image_before_loading_the_model(tmp_path, monkeypatch):
    import slipstream.api.engine as engine_module

    monkeypatch.setattr(engine_module.Engine, "start", lambda self: pytest.fail("loaded the model"))
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not a png")
    status, err = run_cli("generate", "--model", "tiny-random", "--image", str(tmp_path / "none.png"), "hi")
    assert status == 2 and f"--image {tmp_path / 'none.png'}: cannot read" in err, err
    status, err = run_cli("generate", "--model", "tiny-random", "--image", str(bad), "hi")
    assert status == 2 and f"--image {bad}: not an image" in err, err
    good = tmp_path / "ok.png"
    good.write_bytes(encoded())
    status, err = run_cli("generate", "--model", "tiny-random", *["--image", str(good)] * 9, "hi")
    assert status == 2 and "9 images" in err, err


def test_cli_text_model_refuses_images(tmp_path):
    good = tmp_path / "ok.png"
    good.write_bytes(encoded())
    status, err = run_cli("generate", "--model", "tiny-random", "--max-tokens", "2", "--image", str(good), "hi")
    assert status == 2 and "--image: this model accepts no images" in err, err
