"""Sizing the KV pool from GPU memory, like vLLM's gpu_memory_utilization.

Order at start: weights are loaded, then one profiling forward of the largest step the planner
can emit (max_num_batched_tokens prompt tokens) runs on a throwaway cache, so the allocator
reserves its peak activations. What the driver still reports free after that is the budget:
`utilization` of it goes to KV pages; the rest stays for graphs and fragmentation.
"""
from __future__ import annotations

import structlog
import torch

from slipstream.errors import InvalidRequestError
from slipstream.intmath import ceil_div
from slipstream.models.attention import AttentionMetadata, DeviceAttentionMetadata
from slipstream.models.llama import ForwardBatch, KVCache

log = structlog.get_logger(__name__)
GiB = 1024**3


def kv_bytes_per_page(config, page_size: int, dtype: torch.dtype) -> int:
    return 2 * config.num_layers * page_size * config.num_kv_heads * config.head_dim * dtype.itemsize


def kv_pages_for_memory(free_bytes: int, utilization: float, bytes_per_page: int, min_pages: int) -> int:
    """Pages (the scratch page included) that fit in `utilization` of `free_bytes`."""
    pages = int(free_bytes * utilization) // bytes_per_page
    if pages < min_pages:
        raise InvalidRequestError(
            f"KV cache: {free_bytes / GiB:.2f} GiB free x gpu_memory_utilization {utilization} holds {pages} "
            f"pages of {bytes_per_page} bytes, fewer than the {min_pages} one longest request needs; "
            "raise gpu_memory_utilization or lower max_model_len")
    return pages


def profile_free_memory(model, config, device, num_tokens: int, page_size: int, dtype: torch.dtype) -> int:
    """Free device bytes after weights and one forward of `num_tokens` prompt tokens."""
    dev = device.torch_device
    pages = ceil_div(num_tokens, page_size) + 1
    kv = KVCache(config, pages, page_size, dtype, dev)
    n = min(num_tokens, config.max_position_embeddings)
    slots = torch.arange(page_size, page_size + n, device=dev)  # page 0 is scratch
    meta = AttentionMetadata([], [], [], page_size)  # the GPU kernel reads only the device copy
    meta.on_device = DeviceAttentionMetadata(torch.tensor([0, n], device=dev), torch.tensor([n], device=dev),
                                             torch.arange(1, pages, device=dev)[None, :], n)
    batch = ForwardBatch(torch.zeros(n, dtype=torch.long, device=dev), torch.arange(n, device=dev), slots,
                         torch.tensor([n - 1], device=dev), meta)
    with torch.no_grad():
        model(batch, kv)
    torch.cuda.synchronize(dev)
    del kv, batch
    free = device.free_memory()
    log.info("memory_profiled", tokens=n, peak_gib=round(torch.cuda.max_memory_allocated(dev) / GiB, 2),
             free_gib=round(free / GiB, 2))
    return free
