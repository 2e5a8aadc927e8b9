"""Images in requests: decode and validate any image input into an RGB picture with a content digest.

Every public entry (Engine, LLM, Client/worker, `slipstream serve`, the CLI) hands what the user
sent to `load_image` / `load_images`; a bad image raises InvalidRequestError whose message starts
with the request field it came from (e.g. `messages[0].content[1].image_url.url`), and `param`
names that field. Nothing is decoded before its size is known from the header, so a
decompression bomb costs the bytes that were sent, never the pixels it claims.

Pixels are budgeted (issue 37): a request's pictures together at most `max_request_pixels`, checked
from all their headers before any is decoded (InvalidRequestError naming the picture that passes
it), and the pictures decoded here and still alive at most `max_inflight_pixels` in the process
(OverloadedError: retry later); a picture's pixels count until it is freed. Pictures are decoded
one at a time, and once decoded pictures of `TRIM_PIXELS` or more have been freed the C allocator is
asked to return its free memory to the system (glibc keeps freed blocks of a few MB otherwise:
RSS stayed ~300 MB up after a request of 8 pictures of 40 megapixels).

EXIF orientation is not applied: transformers' processors do not apply it either, so the same
file gives the same pixels here and in the reference. Non-RGB modes are composited over white,
as transformers' `convert_to_rgb` does (RGBA, LA, P with transparency, CMYK, L, I;16, ...).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import ctypes
import dataclasses
import hashlib
import io
import os
import re
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, Union, cast

from PIL import Image, UnidentifiedImageError

from slipstream.errors import InvalidRequestError, OverloadedError

ImageLike = Union[Image.Image, bytes, str, os.PathLike]

# Formats decoded in process by Pillow's own code (no external tool such as ghostscript for EPS).
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # (JPEG includes MPO)
_DATA_URL = re.compile(r"data:(?P<type>[^;,]*)(?P<params>(?:;[^;,]*)*),", re.IGNORECASE)


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 * 1024 * 1024  # one encoded image (a file, the bytes, a data URL's payload)
    max_pixels: int = 40_000_000  # width x height, read from the header before decoding
    max_side: int = 8192  # the longer side
    max_images: int = 8  # per request
    max_request_pixels: int = 100_000_000  # all of one request's pictures (about eight 12-megapixel photos)
    max_inflight_pixels: int = 400_000_000  # decoded pictures alive in this process at once (1.2 GB as RGB)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequestError(f"ImageLimits.{f.name} must be an integer >= 1, got {value!r}",
                                          param=f.name)


@dataclass(frozen=True, eq=False)
class ImageInput:
    image: Image.Image  # decoded, mode RGB
    digest: bytes  # sha256 over mode, size and RGB pixels: same pixels, same digest, whatever the file format
    field: str  # the request part it came from


def _error(field: str, what: str) -> InvalidRequestError:
    return InvalidRequestError(f"{field}: {what}", param=field)


def image_digest(image: Image.Image) -> bytes:
    h = hashlib.sha256(f"{image.mode}:{image.width}x{image.height}:".encode())
    h.update(image.tobytes())
    return h.digest()


def load_image(obj: Any, field: str, limits: ImageLimits = ImageLimits()) -> ImageInput:
    """Decode and validate one image (a PIL image, encoded bytes, a file path or a `data:` URL)."""
    return load_request_images([obj], [field], limits)[0]


def load_request_images(objs: Sequence[Any], fields: Sequence[str],
                        limits: ImageLimits = ImageLimits()) -> list[ImageInput]:
    """All of a request's images (blocking): `decode_each` into a list."""
    return list(decode_each(objs, fields, limits))


def decode_each(objs: Sequence[Any], fields: Sequence[str], limits: ImageLimits = ImageLimits()):
    """Yield each image decoded, one at a time, after every header was read and the count and the
    request's pixels checked: a caller that drops each picture before the next holds one at once."""
    objs, fields = list(objs), list(fields)
    check_image_fields(fields, limits)
    opened: list[tuple[Any, str] | None] = []
    total = 0
    item: Any
    for obj, field in zip(objs, fields):
        item = _open(obj, field, limits)
        if not isinstance(item, ImageInput):
            w, h = item.size
            total += w * h
            if total > limits.max_request_pixels:
                raise _error(field, f"the request's images have {total:,} pixels up to this one; at most "
                                    f"{limits.max_request_pixels:,} are accepted in one request")
        opened.append((item, field))
    for i in range(len(opened)):  # no reference kept to a picture once it is handed out
        item, field = cast(tuple[Any, str], opened[i])
        opened[i] = None
        out: Any = item if isinstance(item, ImageInput) else _load(item, field, limits)
        item = None
        yield out
        out = None


def _open(obj: Any, field: str, limits: ImageLimits) -> "Image.Image | ImageInput":
    """The image with only its header read (size checked), or an ImageInput already decoded."""
    if isinstance(obj, ImageInput):  # already validated (e.g. by the HTTP server): not decoded twice
        return obj if obj.field == field else dataclasses.replace(obj, field=field)
    if isinstance(obj, Image.Image):
        _check_size(obj.size, field, limits)
        return obj
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return _open_bytes(bytes(obj), field, limits)
    if isinstance(obj, str) and obj[:5].lower() == "data:":
        return _open_bytes(data_url_bytes(obj, field, limits), field, limits)
    if isinstance(obj, str) and obj[:8].lower().startswith(("http://", "https://")):
        raise _error(field, "remote image URLs are fetched only by `slipstream serve` (--allowed-image-hosts); "
                            "here, pass the image's bytes, a file path or a data: URL")
    if isinstance(obj, (str, os.PathLike)):
        return _open_bytes(_read_file(obj, field, limits), field, limits)
    raise _error(field, f"an image must be a PIL image, bytes, a file path or a data: URL, "
                        f"got {type(obj).__name__}")


def data_url_bytes(url: str, field: str, limits: ImageLimits = ImageLimits()) -> bytes:
    """The payload of a base64 `data:image/...;base64,` URL, its size checked before it is decoded."""
    m = _DATA_URL.match(url)
    if m is None:
        raise _error(field, "a data: URL must look like data:image/png;base64,<data>")
    media = m.group("type").strip().lower()
    if not media.startswith("image/"):
        raise _error(field, f"the data: URL's content type is {media or 'missing'!r}; an image/* type is needed")
    if "base64" not in [p.strip().lower() for p in m.group("params").split(";")]:
        raise _error(field, "the data: URL must be base64-encoded (data:image/...;base64,...)")
    payload = url[m.end():]
    if len(payload) // 4 * 3 > limits.max_bytes:
        raise _error(field, f"the image is about {len(payload) // 4 * 3:,} bytes; at most {limits.max_bytes:,} "
                            "are accepted")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise _error(field, f"the data: URL's payload is not valid base64 ({e})") from None


def _read_file(path: str | os.PathLike, field: str, limits: ImageLimits) -> bytes:
    p = Path(path)
    try:
        size = p.stat().st_size
        if not p.is_file():
            raise _error(field, f"{str(p)!r} is not a file")
        if size > limits.max_bytes:
            raise _error(field, f"{str(p)!r} has {size:,} bytes; at most {limits.max_bytes:,} are accepted")
        return p.read_bytes()
    except OSError as e:
        raise _error(field, f"cannot read the image file {str(p)!r}: {e.strerror or e}") from None


def _open_bytes(data: bytes, field: str, limits: ImageLimits) -> Image.Image:
    if len(data) > limits.max_bytes:
        raise _error(field, f"the image has {len(data):,} bytes; at most {limits.max_bytes:,} are accepted")
    if not data:
        raise _error(field, "the image is empty (0 bytes)")
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)  # reads the header only
    except Image.DecompressionBombError as e:
        raise _error(field, f"refused as a decompression bomb ({e})") from None
    except UnidentifiedImageError:
        raise _error(field, f"not an image in a supported format ({', '.join(FORMATS)})") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:  # a header Pillow cannot parse
        raise _error(field, f"not a readable image ({e})") from None
    _check_size(image.size, field, limits)
    return image


def _load(image: Image.Image, field: str, limits: ImageLimits) -> ImageInput:
    """Decode an opened image and make it RGB. Pixels decoded here count against the process's
    budget for as long as the RGB picture lives (a caller's picture already in memory does not)."""
    if getattr(image, "fp", None) is None:
        return _finish(image, field)
    n = image.width * image.height
    _hold(n, limits)
    try:
        out = _decode(image, field)
    except BaseException:
        _release(n)
        raise
    weakref.finalize(out.image, _release, n)
    return out


def _decode(image: Image.Image, field: str) -> ImageInput:
    try:
        image.load()
    except Image.DecompressionBombError as e:
        raise _error(field, f"refused as a decompression bomb ({e})") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:  # "image file is truncated", bad data
        raise _error(field, f"the image data is truncated or corrupt ({e})") from None
    return _finish(image, field)


# --- the process's decoded pixels --------------------------------------------------------------
TRIM_PIXELS = 16_000_000  # freed since the last trim: ask the allocator to return memory (48 MB as RGB)
_lock = threading.RLock()  # (a finalizer may run inside a held section, on a gc pass)
_held = 0
_freed = 0


def pixels_held() -> int:
    """Pixels of pictures decoded here and not yet freed."""
    return _held


def _hold(n: int, limits: ImageLimits) -> None:
    global _held
    cap = limits.max_inflight_pixels
    with _lock:
        if _held + n > cap:
            raise OverloadedError(f"decoded images hold {_held:,} pixels in this process and {n:,} more would pass "
                                  f"its limit of {cap:,}; retry later")
        _held += n


def _release(n: int) -> None:
    global _held, _freed
    with _lock:
        _held -= n
        _freed += n
        trim = _freed >= TRIM_PIXELS
        if trim:
            _freed = 0
    if trim:
        _trim()


def _trim() -> None:
    """glibc's malloc_trim(0), on a thread of its own (it may take milliseconds; it runs wherever the
    last reference to a picture went, the event loop included). Elsewhere nothing."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    threading.Thread(target=trim, args=(0,), name="slipstream-malloc-trim", daemon=True).start()


def _check_size(size: tuple[int, int], field: str, limits: ImageLimits) -> None:
    w, h = size
    if w <= 0 or h <= 0:
        raise _error(field, f"the image is {w}x{h}: it has no pixels")
    if max(w, h) > limits.max_side:
        raise _error(field, f"the image is {w}x{h}; its longer side may be at most {limits.max_side}")
    if w * h > limits.max_pixels:
        raise _error(field, f"the image is {w}x{h} = {w * h:,} pixels; at most {limits.max_pixels:,} are accepted")


def _finish(image: Image.Image, field: str) -> ImageInput:
    try:
        rgb = to_rgb(image)
    except (OSError, ValueError) as e:  # e.g. a PIL image whose lazy decode fails now
        raise _error(field, f"the image cannot be converted to RGB ({e})") from None
    return ImageInput(rgb, image_digest(rgb), field)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB; other modes are composited over white (transparency shows as white, as in transformers)."""
    if image.mode == "RGB":
        return image
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def check_image_count(n: int, field: str, limits: ImageLimits = ImageLimits()) -> None:
    if n > limits.max_images:
        raise _error(field, f"{n} images in one request; at most {limits.max_images} are accepted")


def check_image_fields(fields: Sequence[str], limits: ImageLimits = ImageLimits()) -> None:
    """The count of a request's images, refused naming the first one past the limit (every door alike)."""
    if len(fields) > limits.max_images:
        check_image_count(len(fields), fields[limits.max_images], limits)


def require_vision(accepts_images: bool, field: str) -> None:
    """The refusal every entry gives an image sent to a text-only model (no vision tower)."""
    if not accepts_images:
        raise _error(field, "this model accepts no images (it has no vision tower); send text only")


def model_accepts_images(model_config: Any) -> bool:
    """A model takes images when its config names an image token (ModelConfig.image_token_id)."""
    return getattr(model_config, "image_token_id", None) is not None


def to_bytes(obj: Any, field: str, limits: ImageLimits = ImageLimits()) -> bytes:
    """An image as encoded bytes for the wire (slipstream.Client): encoded input is sent as it is,
    a PIL image as PNG. Only sizes are checked here; the receiving side decodes and validates."""
    if isinstance(obj, ImageInput):
        obj = obj.image
    if isinstance(obj, Image.Image):
        _check_size(obj.size, field, limits)
        buf = io.BytesIO()
        to_rgb(obj).save(buf, "PNG", compress_level=1)  # lossless; fast rather than small
        data = buf.getvalue()
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        data = bytes(obj)
    elif isinstance(obj, str) and obj[:5].lower() == "data:":
        data = data_url_bytes(obj, field, limits)
    elif isinstance(obj, str) and obj[:8].lower().startswith(("http://", "https://")):
        raise _error(field, "remote image URLs are fetched only by `slipstream serve`; pass bytes, a path or a "
                            "data: URL")
    elif isinstance(obj, (str, os.PathLike)):
        data = _read_file(obj, field, limits)
    else:
        raise _error(field, f"an image must be a PIL image, bytes, a file path or a data: URL, "
                            f"got {type(obj).__name__}")
    if len(data) > limits.max_bytes:
        raise _error(field, f"the image has {len(data):,} bytes; at most {limits.max_bytes:,} are accepted")
    return data


def images_to_bytes(objs: Sequence[Any], name: str = "images", limits: ImageLimits = ImageLimits()) -> list[bytes]:
    objs = image_list(objs, name)
    check_image_count(len(objs), f"{name}[{limits.max_images}]" if len(objs) > limits.max_images else name, limits)
    return [to_bytes(o, f"{name}[{i}]", limits) for i, o in enumerate(objs)]


def image_list(objs: Any, name: str = "images") -> list:
    """`images=` of a public call: a list or tuple of images (one image alone is refused, not guessed at)."""
    if not isinstance(objs, (list, tuple)):
        raise _error(name, f"images must be a list of images, got {type(objs).__name__}")
    return list(objs)


async def load_images(objs: Sequence[Any], fields: Sequence[str],
                      limits: ImageLimits = ImageLimits()) -> list[ImageInput]:
    """`load_request_images` on a worker thread: decoding a large JPEG takes from milliseconds to
    hundreds of them, which the event loop (and every request on it) must not wait through."""
    objs, fields = list(objs), list(fields)
    if len(objs) != len(fields):
        raise ValueError(f"load_images: {len(objs)} images but {len(fields)} field names")
    if not objs:
        return []
    check_image_fields(fields, limits)
    return await asyncio.get_running_loop().run_in_executor(None, load_request_images, objs, fields, limits)
