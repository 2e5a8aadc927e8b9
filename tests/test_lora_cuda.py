"""LoRA adapters on the GPU engine (docs/lora.md, "On CUDA"): decode graphs captured at start serve
changing mixes of adapters and base rows, with an adapter installed under them, without a new capture;
tokens equal the CPU engine's. Collected without a GPU and skipped there (marker `cuda`)."""
import asyncio

import pytest
import torch

from lora_files import MODEL_SPECS, write_adapter

pytest.importorskip("triton")


@pytest.mark.cuda
def test_cuda_engine_graphs_serve_changing_adapter_mixes_without_recapture(tmp_path):
    """The CUDA engine (float32, graphs captured at start, depth 2) with three adapters in two slots:
    waves of requests with changing mixes of adapters and base rows (the third adapter evicts the
    least recently used one: weights installed under the live graphs) replay the decode graphs, no
    graph is captured after start, and every request's greedy tokens equal the CPU engine's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from slipstream import Engine, EngineConfig, SamplingParams
    from slipstream.models.config import tiny_config

    cfg = tiny_config()
    folders = {name: write_adapter(tmp_path / name, cfg, rank, targets, seed)
               for seed, (name, (rank, targets)) in enumerate(zip("abc", MODEL_SPECS.values()))}
    prompts = [[1, 5 + i, 40 + 3 * i, 7, 99 - i] * (1 + i % 3) for i in range(8)]
    waves = [["a", None, "b", "a", None, "b", "a", "b"], ["c", "b", None, "c", "b", None, "c", "c"],
             [None] * 8, ["a", "a", "c", None, "a", "c", "a", None]]

    def params(lora):
        return SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, lora=lora)

    async def serve(device):
        config = EngineConfig(model="tiny-random", device=device, dtype="float32", lora_adapters=folders, max_loras=2,
                              max_lora_rank=8, max_batch_size=16, max_num_batched_tokens=64, kv_cache_tokens=8192,
                              page_size=8, pipeline_depth=2, **({"graph_batch_sizes": (1, 4, 16)} if device == "cuda" else {}))
        async with Engine(config) as engine:
            runner = engine._parts.runner
            caches = [c for c in (getattr(runner, n, None) for n in ("graphs", "greedy_graphs", "mixed_graphs")) if c]
            captured = [{k: id(g) for k, g in c.graphs.items()} for c in caches]
            outs, replays = [], []
            for wave in waves:
                before = sum(sum(c.replays.values()) for c in caches)
                done = await asyncio.gather(*(engine.complete(p, params(lora)) for p, lora in zip(prompts, wave)))
                outs.append([o.token_ids for o in done])
                replays.append(sum(sum(c.replays.values()) for c in caches) - before)
            after = [{k: id(g) for k, g in c.graphs.items()} for c in caches]
            stats = (await engine.stats())["lora"]
        return outs, replays, captured, after, stats

    got, replays, captured, after, stats = asyncio.run(serve("cuda"))
    want, *_ = asyncio.run(serve("cpu"))
    assert captured and all(captured) and after == captured  # every graph from the start, none captured later
    assert all(n > 0 for n in replays)  # every wave's decode steps replayed graphs
    assert stats["evictions"] >= 1  # an adapter was installed under the captured graphs
    assert got == want


