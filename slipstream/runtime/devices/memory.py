"""Sizing the KV pool from GPU memory, like vLLM's gpu_memory_utilization.

Order at start: weights are loaded, then one profiling forward of the largest step the planner
can emit (max_num_batched_tokens prompt tokens) runs on a throwaway cache, and for a model that
takes images the vision tower encodes the largest image its processing makes (the runner encodes
one image at a time, before the forward that reads it), so the allocator reserves the larger of
the two peaks. What is free after that (`free_after_profile`: what the driver reports, plus what
the caching allocator holds beyond that peak), less what the graphs, sampling, the runner's tables
and the encoder cache's outputs will take (`RuntimeReserve`, all allocated after the KV pool), is
the budget: `utilization` of it goes to KV pages; the rest stays for fragmentation.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import structlog
import torch

from slipstream.errors import InvalidRequestError
from slipstream.grammar.bitmask import words_for
from slipstream.intmath import ceil_div
from slipstream.models.kernels.attention import AttentionMetadata, DeviceAttentionMetadata
from slipstream.models.base import ForwardBatch, KVCache

log = structlog.get_logger(__name__)
GiB = 1024**3


def kv_bytes_per_page(config, page_size: int, dtype: torch.dtype) -> int:
    return 2 * config.num_layers * page_size * config.num_kv_heads * config.head_dim * dtype.itemsize


def kv_pages_for_memory(free_bytes: int, utilization: float, bytes_per_page: int, min_pages: int,
                        reserved_bytes: int = 0) -> int:
    """Pages (the scratch page included) that fit in `utilization` of `free_bytes` less `reserved_bytes`
    (what graphs and sampling take later: RuntimeReserve)."""
    pages = max(0, int((free_bytes - reserved_bytes) * utilization) // bytes_per_page)
    if pages < min_pages:
        raise InvalidRequestError(
            f"KV cache: {free_bytes / GiB:.2f} GiB free, less {reserved_bytes / GiB:.2f} GiB reserved for graphs, "
            f"sampling and encoder outputs, x gpu_memory_utilization {utilization} holds {pages} pages of "
            f"{bytes_per_page} bytes, fewer than the {min_pages} one longest request needs; raise "
            "gpu_memory_utilization, lower max_model_len, "
            "or lower max_batch_size / the graph buckets / encoder_cache_tokens")
    return pages


# Peak temporaries of eagerly sampling one [n, V] group with every feature on (penalties, mask,
# min_tokens, min_p, top-k/top-p sort, the int64 hash noise, logprobs), in bytes per logit: 45
# measured on the CPU (tests/test_memory_budget.py), with room for the GPU sort's double buffers.
SAMPLING_BYTES_PER_LOGIT = 64


@dataclass(frozen=True)
class RuntimeReserve:
    """Device bytes the runner allocates after the KV pool is sized (see `runtime_reserve`)."""

    decode_graph_logits: int  # each (slot, bucket) decode graph keeps its [bucket, V] fp32 logits
    greedy_graph_ids: int  # each greedy decode graph keeps its [bucket] ids
    carry_graph_outputs: int  # a model with carry heads: each carry decode graph keeps its [bucket, V]
    #                           fp32 logits and its [bucket, H] hidden states (runtime/step/carry.py)
    mixed_graph_logits: int  # each (slot, token bucket) mixed graph keeps [min(T, S), V] fp32 logits
    spec_graph_outputs: int  # n-gram speculation: each sampled speculating graph keeps the [B(K + 1), V] fp32
    #                          logits of its fed positions and its [B, K] drafts (SpecRunner.forward_fixed)
    graph_temporaries: int  # the graph pool's scratch: the largest graph's lm_head output in the
    #                         model dtype and the greedy graph's fp32 logits, plus its activations (a
    #                         speculating graph's B(K + 1) positions where that is the most)
    eager_logits: int  # the logits of eager steps, one per slot in flight: [S, V] fp32 (+ model dtype)
    sampling: int  # one sampling group of S rows (SAMPLING_BYTES_PER_LOGIT)
    history: int  # HistoryTables: R x V int32 + 2 bool (penalties, min_tokens)
    slot_buffers: int  # StepSlot device buffers: sampled ids, logprobs, top_logprobs, groups, masks
    encoder_cache: int  # a model that takes images: the EncoderCache's bound, encoder_cache_tokens output
    #                     rows of the text width in the model dtype (entries that admitted requests hold
    #                     may exceed it while they run: scheduler/encoder_cache.py)

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def gib(self) -> dict[str, float]:
        return {f.name: round(getattr(self, f.name) / GiB, 3) for f in fields(self)} | {"total": round(self.total / GiB, 3)}


def runtime_reserve(config, vocab_size: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                    decode_buckets: list[int], token_buckets: list[int], carry: bool = False,
                    encoder_rows: int = 0) -> RuntimeReserve:
    """What graphs, sampling, the runner's tables and the encoder cache need beyond the weights, the
    KV pool and the profiled step. `config`: the EngineConfig (max_batch_size, pipeline_depth,
    cuda_graphs, mixed_graphs); the bucket lists as the graph caches build them (empty: no such
    graphs); `carry`: the model has carry heads (its carry decode graphs are captured at warm-up
    too); `encoder_rows`: the encoder outputs kept (0: a text-only model)."""
    from slipstream.runtime.batch import MAX_TOP_LOGPROBS
    from slipstream.runtime.step.step_slot import MAX_GROUPS

    V, S, slots = vocab_size, config.max_batch_size + 1, config.pipeline_depth  # S: the runner's rows
    model_logits = 0 if dtype == torch.float32 else dtype.itemsize  # the lm_head's output before .float()
    decode = decode_buckets if config.cuda_graphs else []
    mixed = token_buckets if config.cuda_graphs and config.mixed_graphs else []
    spec = config.speculative
    k1 = spec.num_drafts + 1 if spec is not None and spec.method == "ngram" and decode else 0  # (graphable drafter)
    graph_rows = max([*decode, *(min(t, S) for t in mixed), max(decode, default=0) * k1], default=0)
    graph_tokens = max([*decode, *mixed, max(decode, default=0) * k1], default=0)
    return RuntimeReserve(
        decode_graph_logits=slots * sum(decode) * V * 4,
        greedy_graph_ids=slots * sum(decode) * 8,
        carry_graph_outputs=slots * sum(decode) * (V * 4 + hidden_size * dtype.itemsize) if carry else 0,
        mixed_graph_logits=slots * sum(min(t, S) for t in mixed) * V * 4,
        spec_graph_outputs=slots * sum(decode) * (k1 * V * 4 + max(k1 - 1, 0) * 8),
        graph_temporaries=graph_rows * V * (4 + model_logits)
        + graph_tokens * (4 * hidden_size + 3 * intermediate_size) * dtype.itemsize,
        eager_logits=slots * S * V * (4 + model_logits),
        sampling=S * V * SAMPLING_BYTES_PER_LOGIT,
        history=S * V * 6,
        slot_buffers=slots * (8 + S * (8 + 4 + MAX_TOP_LOGPROBS * 12 + MAX_GROUPS * (8 + 4 * words_for(V)))),
        encoder_cache=encoder_rows * hidden_size * dtype.itemsize)


def free_after_profile(driver_free: int, reserved: int, peak: int) -> int:
    """Bytes the KV pool may take once the profiled step ran: what the driver reports free, plus
    what the caching allocator holds beyond the step's peak (`reserved - peak`: blocks nothing uses,
    such as a closed engine's when nobody emptied the cache; the driver counts them as used). The
    peak's own temporaries (`peak - allocated`) are not free: every step of that size needs them."""
    return driver_free + max(0, reserved - peak)


def profile_free_memory(model, config, device, num_tokens: int, page_size: int, dtype: torch.dtype,
                        image: Any = None) -> int:
    """Free device bytes after weights and the profiled step (`profile_step`, `free_after_profile`)."""
    dev = device.torch_device
    torch.cuda.reset_peak_memory_stats(dev)  # this step's peak, not an earlier engine's (its KV pool)
    profile_step(model, config, dev, num_tokens, page_size, dtype, image)
    torch.cuda.synchronize(dev)
    driver_free, reserved, peak = device.free_memory(), torch.cuda.memory_reserved(dev), torch.cuda.max_memory_allocated(dev)
    free = free_after_profile(driver_free, reserved, peak)
    log.info("memory_profiled", tokens=min(num_tokens, config.max_position_embeddings), image=image is not None,
             peak_gib=round(peak / GiB, 2), driver_free_gib=round(driver_free / GiB, 2),
             cached_unused_gib=round(max(0, reserved - peak) / GiB, 2), free_gib=round(free / GiB, 2))
    return free


def profile_step(model, config, dev: torch.device, num_tokens: int, page_size: int, dtype: torch.dtype,
                 image: Any = None) -> None:
    """One forward of `num_tokens` prompt tokens on a throwaway cache; then, with `image` (the
    processing's `largest_input`), the vision tower on it, as `ModelRunner.launch_encoder` runs it.
    Nothing is kept: the allocator holds on to the peak."""
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
        del kv, batch
        if image is not None:  # its output is the encoder cache's (RuntimeReserve.encoder_cache)
            model.encode_image(image)


def engine_reserve(config, mcfg, dtype: torch.dtype, carry: bool = False, images: bool = False) -> RuntimeReserve:
    """runtime_reserve for an EngineConfig and a model config, with the engine's own buckets;
    `images`: the model takes images (its encoder cache is reserved)."""
    from slipstream.runtime.graphs.buckets import make_buckets, token_buckets

    return runtime_reserve(config, mcfg.vocab_size, mcfg.hidden_size, mcfg.intermediate_size, dtype,
                           make_buckets(*config.buckets()), token_buckets(*config.token_bucket_range()), carry,
                           config.encoder_cache_tokens if images else 0)
