"""KV sizing counts what the caching allocator holds unused as free (issue 48, defect 2).

The driver's free figure (`torch.cuda.mem_get_info`) counts the allocator's cached blocks as used:
on an H200 an engine closed without its cache emptied left 125 GiB cached, and the next engines
sized their pools from the 13.85 and then 1.29 GiB the driver reported. Here torch.cuda's memory
calls are a fake caching allocator (the driver's free bytes, reserved, allocated, the peak) and the
profiling forward allocates and frees its temporaries on it.
"""
import types

import pytest
import torch

from slipstream.api import assemble
from slipstream.models.config import smollm2_135m_config
from slipstream.params import EngineConfig
from slipstream.runtime.devices import memory

GiB = 2**30
TOTAL = 140 * GiB
WEIGHTS = 1 * GiB
STEP_PEAK = 2 * GiB  # the profiled forward's temporaries


class FakeAllocator:
    """torch's caching allocator as the sizing sees it: freed blocks stay reserved (the driver
    counts them as used) until empty_cache; allocations reuse them before asking the driver."""

    def __init__(self, cached_unused: int = 0, stale_peak: int = 0):
        self.allocated = WEIGHTS
        self.reserved = WEIGHTS + cached_unused
        self.peak = max(self.reserved, stale_peak)  # an earlier engine's pool set the process's peak
        self.driver_free = TOTAL - self.reserved

    def alloc(self, n: int) -> None:
        self.allocated += n
        grow = max(0, self.allocated - self.reserved)
        self.reserved += grow
        self.driver_free -= grow
        self.peak = max(self.peak, self.allocated)

    def free(self, n: int) -> None:
        self.allocated -= n  # (cached: reserved stays)

    def empty_cache(self) -> None:
        self.driver_free += self.reserved - self.allocated
        self.reserved = self.allocated

    def install(self, monkeypatch) -> None:
        def reset(device=None):
            self.peak = self.allocated

        for name, fn in (("mem_get_info", lambda device=None: (self.driver_free, TOTAL)),
                         ("memory_reserved", lambda device=None: self.reserved),
                         ("memory_allocated", lambda device=None: self.allocated),
                         ("max_memory_allocated", lambda device=None: self.peak),
                         ("reset_peak_memory_stats", reset), ("synchronize", lambda device=None: None),
                         ("empty_cache", self.empty_cache)):
            monkeypatch.setattr(torch.cuda, name, fn)

        def profile_step(*args, **kwargs):
            self.alloc(STEP_PEAK)
            self.free(STEP_PEAK)

        monkeypatch.setattr(memory, "profile_step", profile_step)


def fake_cuda_device():
    """A CUDA-kind device whose free_memory is CUDADevice's (the driver's figure)."""
    from slipstream.runtime.devices.cuda_device import CUDADevice

    device = types.SimpleNamespace(kind="cuda", torch_device=torch.device("cuda", 0))
    device.free_memory = lambda: CUDADevice.free_memory(device)
    return device


def profiled_free(fake: FakeAllocator, monkeypatch) -> int:
    fake.install(monkeypatch)
    return memory.profile_free_memory(None, smollm2_135m_config(), fake_cuda_device(), 512, 16, torch.bfloat16)


def test_free_after_profile_adds_what_the_allocator_holds_beyond_the_step_peak():
    assert memory.free_after_profile(10 * GiB, reserved=130 * GiB, peak=5 * GiB) == 135 * GiB
    assert memory.free_after_profile(10 * GiB, reserved=5 * GiB, peak=5 * GiB) == 10 * GiB
    assert memory.free_after_profile(10 * GiB, reserved=4 * GiB, peak=5 * GiB) == 10 * GiB  # (emptied since)


@pytest.mark.parametrize("cached_gib", [0, 1, 125])
def test_profiled_free_memory_counts_cached_blocks_and_keeps_the_step_peak(monkeypatch, cached_gib):
    """What the allocator caches unused is free (the profiled step reuses it first); the step's own
    temporaries are not, with or without a cache; an earlier engine's peak does not hide the cache."""
    fake = FakeAllocator(cached_unused=cached_gib * GiB, stale_peak=126 * GiB)
    free = profiled_free(fake, monkeypatch)
    assert free == TOTAL - WEIGHTS - STEP_PEAK  # the same as with nothing cached


def test_ten_engines_one_after_another_get_the_same_kv_pool(monkeypatch):
    """Each engine's pool is sized, allocated and freed back into the allocator's cache (a close
    that empties nothing): every later engine is sized like the first."""
    cfg = EngineConfig(model="random-smollm2-135m", device="cuda", dtype="bfloat16", max_batch_size=32,
                       max_num_batched_tokens=512)
    mcfg, per_page = smollm2_135m_config(), memory.kv_bytes_per_page(smollm2_135m_config(), 16, torch.bfloat16)
    reserve = memory.engine_reserve(cfg, mcfg, torch.bfloat16).total
    fake = FakeAllocator()
    fake.install(monkeypatch)
    model = types.SimpleNamespace(carry_heads=None)
    sizes = []
    for _ in range(10):
        pages = assemble.kv_pages(cfg, model, mcfg, fake_cuda_device(), max_model_len=2048)
        sizes.append(pages)
        used = pages * per_page + reserve
        fake.alloc(used)
        fake.free(used)
    assert sizes == [sizes[0]] * 10, sizes
    assert sizes[0] == int((TOTAL - WEIGHTS - STEP_PEAK - reserve) * cfg.gpu_memory_utilization) // per_page
