"""Every copy between host and device memory in the runtime goes through here.

A non_blocking copy is only asynchronous when its host side is one contiguous range of pinned
memory. Given a strided view (e.g. the first k columns of an [n, 20] buffer) or pageable memory,
torch copies through a pageable temporary and the host waits for the stream: a hidden sync that
quietly turns depth 2 into depth 1. So the helpers refuse such a host side (PipelineInvariantError),
on the CPU device too for the contiguity (its host buffers are not pinned, by design), where the
tests can catch a wrong layout without a GPU.
"""
from __future__ import annotations

import numpy as np
import torch

from slipstream.errors import PipelineInvariantError


def check_host_side(host: torch.Tensor, device_side: torch.Tensor, what: str) -> None:
    if not host.is_contiguous():
        raise PipelineInvariantError(f"{what}: host view of shape {tuple(host.shape)} is not contiguous "
                                     "(torch would copy through a pageable temporary and block the host)")
    if device_side.is_cuda and not host.is_pinned():
        raise PipelineInvariantError(f"{what}: host buffer is not pinned (the copy would block the host)")


def copy_to_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst (host landing buffer view) <- src (device), asynchronously on the current stream."""
    check_host_side(dst, src, "device->host copy")
    dst.copy_(src, non_blocking=True)


def copy_to_device(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst (device) <- src (host staging view), asynchronously on the current stream."""
    check_host_side(src, dst, "host->device copy")
    dst.copy_(src, non_blocking=True)


def upload_array(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A device tensor holding `values`, on the current stream, without blocking the host: staged in
    pinned memory (torch's host caching allocator keeps the block until the copy has run) and copied
    with non_blocking. On the CPU, the array itself."""
    host = torch.from_numpy(np.ascontiguousarray(values))
    if device.type == "cpu":
        return host
    host = host.pin_memory()
    out = torch.empty(host.shape, dtype=host.dtype, device=device)
    copy_to_device(out, host)
    return out


def pin_pixels(processed):
    """A preprocessed image (any family's dataclass with `pixel_values`) whose pixels sit in one
    contiguous range of pinned memory: run where the picture is made, off the event loop
    (api/image_prompt.py), so that the encoder launch inside the tick only enqueues an asynchronous
    copy (`stage_pixels`). Not `Tensor.pin_memory()`, which keeps a strided layout (the H200 run of
    2026-11-27: Idefics3's tiles, HWC memory seen as CHW, were refused at launch)."""
    import dataclasses

    pixels = processed.pixel_values
    pinned = torch.empty(pixels.shape, dtype=pixels.dtype, pin_memory=True)
    pinned.copy_(pixels)
    return dataclasses.replace(processed, pixel_values=pinned)


def stage_pixels(pixels: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The device copy of pixels pinned beforehand (`pin_pixels`), enqueued on the current stream;
    pixels that are not pinned are refused (pinning them here would copy megabytes inside the tick,
    and a pageable copy would block the host). On the CPU, the tensor itself, refused as on a GPU
    when it is not contiguous (a processor's strided pixels fail the CPU tests too)."""
    if device.type == "cpu":
        check_host_side(pixels, pixels, "pixels for the encoder")
        return pixels
    out = torch.empty(pixels.shape, dtype=pixels.dtype, device=device)
    copy_to_device(out, pixels)
    return out
