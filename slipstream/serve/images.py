"""Images in OpenAI chat requests: `image_url` content parts as data: URLs, or http(s) URLs fetched
here (off the event loop, with a timeout, a size cap and an allow-list of hosts; off by default).

Every image of a request is refused or accepted before the engine sees the request: the count
first, then (cheaply, before fetching anything) whether the model takes images at all, then the
bytes (fetched ones count against the same --max-body-bytes budget as inline ones), then the
decode (slipstream/images.py). Each refusal is InvalidRequestError naming the part.
"""
from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from slipstream.errors import InvalidRequestError
from slipstream.images import (ImageInput, ImageLimits, check_image_count, data_url_bytes, load_images,
                               require_vision)

DEFAULT_FETCH_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ImageServing:
    limits: ImageLimits = field(default_factory=ImageLimits)
    allowed_hosts: frozenset[str] = frozenset()  # hostnames http(s) images may come from; "*": any; empty: none
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S  # the whole fetch of one image, connect to last byte

    def allows(self, host: str | None) -> bool:
        if not host:
            return False
        return "*" in self.allowed_hosts or host.lower() in self.allowed_hosts


def _error(field: str, what: str) -> InvalidRequestError:
    return InvalidRequestError(f"{field}: {what}", param=field)


async def request_images(parts: list[tuple[str, str]], serving: ImageServing, accepts_images: bool,
                         budget: int) -> list[ImageInput]:
    """`parts`: (field, url) in prompt order. `budget`: the bytes all images together may take."""
    if not parts:
        return []
    fields = [f for f, _ in parts]
    check_image_count(len(parts), fields[min(len(parts), serving.limits.max_images + 1) - 1], serving.limits)
    require_vision(accepts_images, fields[0])
    raws: list[bytes] = []
    for f, url in parts:
        left = budget - sum(map(len, raws))
        cap = (left, "bytes left of this request's --max-body-bytes") if left < serving.limits.max_bytes else \
            (serving.limits.max_bytes, "bytes per image")
        raw = await _bytes_of(url, f, serving, cap)
        if len(raw) > left:
            raise _error(f, f"the request's images exceed this server's limit of {budget:,} bytes (--max-body-bytes)")
        raws.append(raw)
    return await load_images(raws, fields, serving.limits)


async def _bytes_of(url: str, field: str, serving: ImageServing, cap: tuple[int, str]) -> bytes:
    scheme = url[:8].lower()
    if scheme.startswith("data:"):
        return data_url_bytes(url, field, serving.limits)
    if not scheme.startswith(("http://", "https://")):
        raise _error(field, "an image URL must be a data: URL or an http(s) URL")
    host = urlsplit(url).hostname
    if not serving.allowed_hosts:
        raise _error(field, "this server does not fetch remote images; send the image as a data: URL, or start "
                            "the server with --allowed-image-hosts HOST[,HOST...] (or '*')")
    if not serving.allows(host):
        raise _error(field, f"this server does not fetch images from {host!r} (not in --allowed-image-hosts)")
    try:
        return await asyncio.wait_for(asyncio.to_thread(_fetch, url, field, serving, cap), serving.fetch_timeout_s)
    except TimeoutError:
        raise _error(field, f"fetching the image took longer than {serving.fetch_timeout_s:g} s") from None


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is followed only to an allowed host: the allow-list is not a suggestion."""

    def __init__(self, serving: ImageServing, field: str):
        self.serving, self.field = serving, field

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        parts = urlsplit(newurl)
        if parts.scheme not in ("http", "https") or not self.serving.allows(parts.hostname):
            raise _error(self.field, f"the image URL redirects to {parts.hostname!r}, which is not in "
                                     "--allowed-image-hosts")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _fetch(url: str, field: str, serving: ImageServing, cap_and_why: tuple[int, str]) -> bytes:
    """On a worker thread. Reads at most cap + 1 bytes, and stops at the deadline between reads."""
    cap, why = cap_and_why
    deadline = time.monotonic() + serving.fetch_timeout_s
    opener = urllib.request.build_opener(_CheckedRedirects(serving, field))
    request = urllib.request.Request(url, headers={"User-Agent": "slipstream", "Accept": "image/*"})
    try:
        with opener.open(request, timeout=serving.fetch_timeout_s) as resp:
            ctype = (resp.headers.get_content_type() or "").lower()
            if not ctype.startswith("image/"):
                raise _error(field, f"the image URL answered with content type {ctype!r}, not image/*")
            declared = resp.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > cap:
                raise _error(field, f"the image at the URL has {int(declared):,} bytes; at most {cap:,} {why}")
            chunks, size = [], 0
            while size <= cap:
                if time.monotonic() > deadline:
                    raise _error(field, f"fetching the image took longer than {serving.fetch_timeout_s:g} s")
                chunk = resp.read(min(1 << 16, cap + 1 - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
            if size > cap:
                raise _error(field, f"the image at the URL has more than {cap:,} bytes; at most {cap:,} {why}")
            return b"".join(chunks)
    except InvalidRequestError:
        raise
    except urllib.error.HTTPError as e:
        raise _error(field, f"fetching the image failed: HTTP {e.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:  # refused, DNS, timeout, bad URL
        reason = getattr(e, "reason", e)
        raise _error(field, f"fetching the image failed: {reason}") from None
