"""A request's images made into what the scheduler needs: load, preprocess, expand the prompt's
`<image>` markers, tokenise, and find each image's placeholder positions (`ImageSpan`).

All of it runs off the event loop (`prepare_images` on a worker thread): decoding and resizing an
image takes milliseconds to hundreds of them, which the tick must not wait through.
Chat messages may carry OpenAI content parts; `split_chat_images` takes each image part out, leaving
a bare `{"type": "image"}` part where the chat template writes its `<image>` marker (the order of
the markers is the order of the images).
"""
from __future__ import annotations

import asyncio
import functools
from typing import Any, Sequence

import numpy as np

from slipstream.errors import InvalidRequestError
from slipstream.images import decode_each
from slipstream.runtime.batch import ImageSpan
from slipstream.runtime.devices.host_copy import pin_pixels

IMAGE_MARKER = "<image>"


def with_markers(prompt: str, n: int) -> str:
    """The prompt with one `<image>` marker per image: as given, or (no marker at all) the images first."""
    count = prompt.count(IMAGE_MARKER)
    if count == 0:
        return IMAGE_MARKER * n + prompt
    if count != n:
        raise InvalidRequestError(f"prompt: it has {count} {IMAGE_MARKER} markers for {n} images (one per image, "
                                  "in order; or none, and the images go first)", param="prompt")
    return prompt


def image_spans(ids: Sequence[int], image_token_id: int, processed: Sequence[Any],
                digests: Sequence[bytes]) -> list[ImageSpan]:
    """Each image's placeholder positions in `ids`: image k takes the next `num_image_tokens` of them."""
    positions = np.flatnonzero(np.asarray(ids, np.int64) == image_token_id)
    want = sum(p.num_image_tokens for p in processed)
    if len(positions) != want:
        raise InvalidRequestError(f"prompt: its text holds {len(positions) - want:+d} image placeholder tokens beyond "
                                  "its images' (the placeholder text may not appear in a prompt)", param="prompt")
    spans, at = [], 0
    for p, digest in zip(processed, digests):
        pos = positions[at:at + p.num_image_tokens].astype(np.int64)
        at += p.num_image_tokens
        spans.append(ImageSpan(int(pos[0]), int(pos[-1]) + 1, digest, p.num_image_tokens, p, pos))
    return spans


def prepare_images(prompt: str, images: Sequence[Any], fields: Sequence[str], processing: Any, tokenizer: Any,
                   image_token_id: int, skill: tuple[str, str] | None = None,
                   pin: bool = False) -> tuple[list[int], list[ImageSpan]]:
    """(token ids, image spans) of a text prompt with images (blocking: run it on a worker thread).
    `skill` (kind, object): a region skill's template instead of the prompt (Moondream's point/detect).
    `pin` (a CUDA engine): the pixels are put in pinned memory here, so the encoder launch in the
    tick only enqueues their copy (runtime/devices/host_copy.py)."""
    processed: list[Any] = []
    digests: list[bytes] = []
    for im in decode_each(images, fields):  # one decoded picture alive at a time (issue 37)
        pictures = processing.preprocess([im.image])
        processed += [pin_pixels(p) for p in pictures] if pin else pictures
        digests.append(im.digest)
        del im
    if skill is not None:
        ids = processing.skill_prompt_ids(skill[0], skill[1], processed, tokenizer)
    elif hasattr(processing, "prompt_ids"):  # a model whose prompt is built from ids (Moondream's template)
        ids = processing.prompt_ids(prompt, processed, tokenizer)
    else:
        ids = tokenizer.encode(processing.expand(with_markers(prompt, len(processed)), processed))
    return ids, image_spans(ids, image_token_id, processed, digests)


async def prepare_images_off_loop(*args: Any, pin: bool = False) -> tuple[list[int], list[ImageSpan]]:
    return await asyncio.to_thread(functools.partial(prepare_images, pin=pin), *args)


def split_chat_images(messages: Any, images: Sequence[Any] = ()) -> tuple[Any, list[Any], list[str]]:
    """Chat messages with image content parts -> (messages whose parts are text only, with an
    `<image>` marker per image part; the images in marker order; each one's request field).
    `images` (the keyword) fill `<image>` markers written in text, in order."""
    if not isinstance(messages, (list, tuple)):
        return messages, list(images), [f"images[{i}]" for i in range(len(images))]
    out, found, fields = [], [], []
    extra = list(enumerate(images))
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, (list, tuple)):
            if isinstance(content, str):
                for _ in range(content.count(IMAGE_MARKER)):
                    if extra:
                        k, obj = extra.pop(0)
                        found.append(obj)
                        fields.append(f"images[{k}]")
            out.append(m)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            field = f"messages[{i}].content[{j}]"
            if kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise InvalidRequestError(f"{field}.image_url.url: must be a string URL", param=f"{field}.image_url.url")
                found.append(url)
                fields.append(f"{field}.image_url.url")
                parts.append({"type": "image"})  # the chat template renders its <image> marker
            elif kind == "image":
                found.append(part.get("image"))
                fields.append(f"{field}.image")
                parts.append({"type": "image"})
            else:
                if kind == "text" and isinstance(part.get("text"), str):
                    for _ in range(part["text"].count(IMAGE_MARKER)):
                        if extra:
                            k, obj = extra.pop(0)
                            found.append(obj)
                            fields.append(f"images[{k}]")
                parts.append(part)
        out.append({**m, "content": parts})
    if extra:
        raise InvalidRequestError(f"images: {len(images)} images but only {len(images) - len(extra)} {IMAGE_MARKER} "
                                  "markers in the messages' text for them", param="images")
    return out, found, fields
