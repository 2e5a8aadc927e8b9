"""transformers at its best, for tools/peers/peer_bench.py: each configuration a system of its own row.

    cb-auto          continuous batching, transformers' own heuristics decide CUDA graphs and async
                     batching (with SDPA, which needs a mask, it turns both off)
    cb-graphs        continuous batching with CUDA graphs explicitly requested (transformers honours
                     the request); async batching still left to its heuristic
    cb-async-forced  the earlier harness's setting: async batching forced on, graphs by heuristic
                     (with SDPA it copies a max_batch_tokens × cache-tokens mask host→device every step)
    static-compile   `generate()` with a static KV cache, which on CUDA transformers compiles
                     (torch.compile, its default CompileConfig: mode "reduce-overhead", i.e. CUDA
                     graphs): its fast path for N = 1 and static batches (N equal-length prompts
                     generated together, no continuous batching). `--hf-compile off` keeps the static
                     cache without compiling (a CPU harness check: compiling on 2 cores takes minutes).

Every configuration gets slipstream's KV budget and per-step token budget (see `hf_cb_config`).
"""
from __future__ import annotations

import statistics
import time

import torch

CB_CONFIGS = {
    "cb-auto": {"use_async_batching": None, "use_cuda_graph": None},
    "cb-graphs": {"use_async_batching": None, "use_cuda_graph": True},
    "cb-async-forced": {"use_async_batching": True, "use_cuda_graph": None},
}
GENERATE_CONFIGS = ("static-compile",)
HF_CONFIGS = (*CB_CONFIGS, *GENERATE_CONFIGS)
DEFAULT_HF_CONFIGS = ("cb-auto", "cb-graphs", "static-compile")


def summarize(wall: float, n: int, length: int, ttfts: list[float], itls: list[float], peak) -> dict:
    return {"tok_s": n * length / wall, "wall_s": wall, "ttft_ms": statistics.median(ttfts) * 1e3,
            "itl_ms": statistics.median(itls) * 1e3, "peak_mib": peak}


def peak_reset(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_mib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None


def hf_generation_config(length: int, **kw):
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=length, do_sample=False, eos_token_id=-1,
                            pad_token_id=0, **kw)


def hf_page_size(cb_config) -> int:
    """Tokens per KV block: `block_size` until transformers 5.17, `page_size` after."""
    return getattr(cb_config, "page_size", None) or cb_config.block_size


def hf_cb_config(name: str, kv_tokens: int, batch_tokens: int):
    """slipstream's KV budget and per-step token budget, and the configuration's graph/async choices.
    Left to itself transformers sizes its cache from free memory, and with SDPA keeps an attention mask
    of max_batch_tokens × cache tokens (measured on an H100 with async forced: 454 ms a step, 69 GiB)."""
    from transformers import ContinuousBatchingConfig

    num_blocks = -(-kv_tokens // hf_page_size(ContinuousBatchingConfig()))
    return ContinuousBatchingConfig(num_blocks=num_blocks, max_batch_tokens=batch_tokens, **CB_CONFIGS[name])


class TransformersCB:
    """One persistent continuous-batching manager (started and warmed once, like a slipstream Engine)."""

    def __init__(self, name: str, model, batch: list[list[int]], length: int, device: str, kv_tokens: int,
                 batch_tokens: int):
        from transformers.generation.continuous_batching.continuous_api import WorkloadHints

        self.length, self.device = length, device
        hints = WorkloadHints(max_prompt_length=max(map(len, batch)), max_generated_length=length,
                              num_requests=len(batch))
        cb_config = hf_cb_config(name, kv_tokens, batch_tokens)
        # what was asked of transformers, read before it resolves its heuristics in place
        requested = {"use_async_batching": cb_config.use_async_batching, "use_cuda_graph": cb_config.use_cuda_graph}
        self.manager = model.init_continuous_batching(generation_config=hf_generation_config(length),
                                                      continuous_batching_config=cb_config, workload_hints=hints)
        self.manager.warmup()
        self.manager.start()
        cbc = self.manager.batch_processor.cb_config
        self.settings = {"requested": requested,
                         "attn": model.config._attn_implementation,
                         "use_async_batching": self.manager.batch_processor.use_async_batching,
                         "use_cuda_graph (varlen, decode)": cbc.use_cuda_graph,
                         "num_blocks x block_size": (cbc.num_blocks, hf_page_size(cbc)),
                         "max_batch_tokens": cbc.max_batch_tokens}

    def run(self, batch: list[list[int]]) -> dict:
        peak_reset(self.device)
        t0 = time.perf_counter()
        ids = {self.manager.add_request(p, max_new_tokens=self.length, record_timestamps=True) for p in batch}
        results = {}
        while len(results) < len(ids):
            r = self.manager.get_result(timeout=60)
            if r is None:
                raise RuntimeError("transformers' continuous batching stopped answering")
            if r.request_id in ids and r.is_finished():
                results[r.request_id] = r
        wall = time.perf_counter() - t0
        bad = [r.request_id for r in results.values() if r.error or len(r.generated_tokens) != self.length]
        if bad:
            raise RuntimeError(f"transformers failed or returned wrong lengths for {bad}")
        ttfts = [r.timestamps[0] - t0 for r in results.values()]
        itls = [(r.timestamps[-1] - r.timestamps[0]) / (self.length - 1) for r in results.values()]
        return summarize(wall, len(batch), self.length, ttfts, itls, peak_mib(self.device))

    def close(self) -> None:
        self.manager.stop(block=True, timeout=10)


class _StepClock:
    """A stopping criterion that never stops and notes when each generated token reached the host.

    generate() checks for unfinished sequences on the host after every step (a sync), so the call
    time of this criterion is when that step's token exists."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class TransformersStaticGenerate:
    """`generate()` on a static batch of N equal-length prompts, static KV cache, compiled on CUDA."""

    def __init__(self, model, length: int, device: str, compile_mode: str):
        from transformers import CompileConfig

        self.model, self.length, self.device = model, length, device
        self.compiled = compile_mode != "off" and (device == "cuda" or compile_mode == "force")
        compile_config = CompileConfig() if self.compiled else None
        if compile_config is not None and device != "cuda":
            compile_config._compile_all_devices = True  # transformers compiles only on accelerators by default
        self.config = hf_generation_config(length, cache_implementation="static", compile_config=compile_config,
                                           disable_compile=not self.compiled)
        self.warm: set[int] = set()
        self.settings = {"cache_implementation": "static", "compiled": self.compiled,
                         "compile_config": compile_config.to_dict() if compile_config else None,
                         "attn": model.config._attn_implementation}

    def _generate(self, batch: list[list[int]]):
        from transformers import StoppingCriteriaList

        clock = _StepClock()
        ids = torch.tensor(batch, device=self.device)
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=self.config,
                                      stopping_criteria=StoppingCriteriaList([clock]))
        return out, clock.times

    def run(self, batch: list[list[int]]) -> dict:
        if len({len(p) for p in batch}) != 1:
            raise ValueError("static-compile needs equal-length prompts (a static batch, no padding)")
        if len(batch) not in self.warm:
            # compiled per batch size, and a new size can compile twice (torch marks the changed dimension
            # dynamic and recompiles on the next call; seen on the CPU: 8 then 146 tok/s): two warm-ups per N
            self._generate(batch)
            self._generate(batch)
            self.warm.add(len(batch))
        peak_reset(self.device)
        t0 = time.perf_counter()
        out, times = self._generate(batch)
        wall = time.perf_counter() - t0
        if out.shape[1] - len(batch[0]) != self.length:
            raise RuntimeError(f"generate() returned {out.shape[1] - len(batch[0])} tokens, not {self.length}")
        ttft, itl = times[0] - t0, (times[-1] - times[0]) / (self.length - 1)
        return summarize(wall, len(batch), self.length, [ttft], [itl], peak_mib(self.device))

    def close(self) -> None:
        pass


def make_system(name: str, model, top: list[list[int]], length: int, device: str, kv_tokens: int,
                batch_tokens: int, compile_mode: str):
    if name in CB_CONFIGS:
        return TransformersCB(name, model, top, length, device, kv_tokens, batch_tokens)
    if name == "static-compile":
        return TransformersStaticGenerate(model, length, device, compile_mode)
    raise ValueError(f"unknown transformers configuration {name!r}; known: {', '.join(HF_CONFIGS)}")
