"""Small encoded images for the image-input tests, including hostile ones built byte by byte."""
import base64
import io
import struct
import zlib

import numpy as np
from PIL import Image


def picture(width: int, height: int, seed: int) -> Image.Image:
    """A random RGB picture, the same for the same seed."""
    rs = np.random.RandomState(seed)
    return Image.fromarray(rs.randint(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def png(width: int, height: int, seed: int) -> bytes:
    """`picture` encoded as PNG (lossless: decoding gives the same pixels)."""
    buf = io.BytesIO()
    picture(width, height, seed).save(buf, "PNG")
    return buf.getvalue()


def data_url(raw: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(raw).decode()}"


def encoded(w: int = 8, h: int = 6, fmt: str = "PNG", mode: str = "RGB", color=(200, 30, 40)) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (w, h), color if mode == "RGB" else None).save(buf, fmt)
    return buf.getvalue()


def png_header_only(w: int, h: int) -> bytes:
    """A PNG whose header claims w x h with almost no pixel data: what a decompression bomb looks like
    before decoding (a real one compresses the zeros; decoding either would take w*h*3 bytes)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + chunk(b"IEND", b""))
