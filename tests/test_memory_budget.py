"""The memory reserved before KV sizing (runtime/devices/memory.py: runtime_reserve) against the buffers it
predicts, built by the real allocation code on the CPU: graph outputs from the capture path (with a
stand-in capture that runs the forward once, as the real one does), slot buffers, history tables,
and the measured peak temporaries of the real sampling launch."""
import asyncio
import types

import pytest
import torch
from live_bytes import LiveBytes
from test_mixed_graphs import needs_triton

from slipstream import Engine, EngineConfig, SamplingParams
from slipstream.errors import InvalidRequestError
from slipstream.runtime.graphs import cuda_graphs
from slipstream.runtime.step.step_slot import StepSlot
from slipstream.runtime.devices.memory import SAMPLING_BYTES_PER_LOGIT, engine_reserve, kv_pages_for_memory
from slipstream.runtime.step.row_tables import HistoryTables

TEXT_MODEL = types.SimpleNamespace(carry_heads=None)  # kv_pages asks a model only whether it has carry heads

CFG = dict(model="tiny-random", max_batch_size=4, max_num_batched_tokens=48, kv_cache_tokens=1024, page_size=8,
           graph_token_sizes=(16, 32))


def _nbytes(*outputs):
    tensors = [t for o in outputs for t in (o if isinstance(o, tuple) else (o,))]  # (carry graphs: a pair)
    return sum(t.numel() * t.element_size() for t in tensors)


def capture_graph_outputs(monkeypatch, cfg, prepare=lambda runner: None):
    """Install the engine's graphs with a stand-in capture that runs each forward once, as the real
    one does; returns (model config, {kind: the outputs the graphs keep})."""
    from slipstream.speculation.staging import FixedLayout

    held = {"decode": [], "greedy": [], "carry": [], "mixed": [], "spec": [], "spec_sampled": []}

    def stand_in(runner, device, pool, stage, forward=None):
        tensors = stage()
        name = getattr(forward, "__name__", "")
        out = (runner.forward.logits if forward is None else forward)(tensors)  # the output a graph keeps
        kind = ("mixed" if hasattr(tensors, "blocks") else "decode" if forward is None
                else ("spec_sampled" if isinstance(out, tuple) else "spec") if isinstance(tensors, FixedLayout)
                else "carry" if name == "carry" else "greedy")
        held[kind].append(out)
        return types.SimpleNamespace(replay=lambda: out)

    monkeypatch.setattr(cuda_graphs, "_capture", stand_in)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)

    async def run():
        async with Engine(cfg) as engine:
            runner = engine._parts.runner
            prepare(runner)
            runner.model.set_kernel_backend("triton")
            cuda_graphs.install_graphs(runner, engine._parts.device, cfg)
            return engine._parts.model_config

    return asyncio.run(run()), held


@needs_triton
def test_graph_outputs_are_what_the_reserve_predicts(monkeypatch):
    cfg = EngineConfig(**CFG)
    mcfg, held = capture_graph_outputs(monkeypatch, cfg)
    r = engine_reserve(cfg, mcfg, torch.float32)
    assert len(held["decode"]) == len(held["greedy"]) == 2 * 3 and len(held["mixed"]) == 2 * 2  # buckets 1,2,4; 16,32
    assert _nbytes(*held["decode"]) == r.decode_graph_logits
    assert _nbytes(*held["greedy"]) == r.greedy_graph_ids
    assert _nbytes(*held["mixed"]) == r.mixed_graph_logits
    assert r.graph_temporaries >= max(_nbytes(t) for t in held["mixed"] + held["decode"])
    off = engine_reserve(EngineConfig(**CFG, cuda_graphs=False), mcfg, torch.float32)
    assert off.decode_graph_logits == off.mixed_graph_logits == off.graph_temporaries == 0
    assert engine_reserve(EngineConfig(**CFG, mixed_graphs=False), mcfg, torch.float32).mixed_graph_logits == 0


def test_slot_buffers_and_history_tables_are_what_the_reserve_predicts():
    from slipstream.models.config import tiny_config

    mcfg = tiny_config(vocab_size=1000)
    cfg = EngineConfig(**CFG)
    r = engine_reserve(cfg, mcfg, torch.bfloat16)
    device = types.SimpleNamespace(torch_device=torch.device("cpu"), unified_memory=False,
                                   host_buffer=lambda shape, dtype: torch.empty(shape, dtype=dtype))
    rows = cfg.max_batch_size + 1  # what the runner allocates (row 0 is the scratch row)
    slot = StepSlot(0, device, rows, mcfg.vocab_size, arena=None)
    on_device = _nbytes(slot.stamp_and_sampled, slot.logprobs, slot.top_values, slot.top_ids, slot.group_dev,
                        slot.mask_dev)
    assert r.slot_buffers == cfg.pipeline_depth * on_device
    h = HistoryTables(rows, mcfg.vocab_size, "cpu")
    assert r.history == _nbytes(h.output_counts, h.prompt_mask, h.stop_mask)
    # bfloat16: the lm_head's output before .float() is one more [rows, V] in the graph pool and per eager step
    f32 = engine_reserve(cfg, mcfg, torch.float32)
    assert r.eager_logits - f32.eager_logits == cfg.pipeline_depth * rows * mcfg.vocab_size * 2


def test_sampling_peak_temporaries_stay_under_the_reserved_bytes_per_logit(monkeypatch):
    """The real launch_sampling of a group whose rows use every feature, measured on the compute
    thread: its peak temporaries per logit are under SAMPLING_BYTES_PER_LOGIT, and not far under."""
    peaks = []

    async def run():
        async with Engine(EngineConfig(**CFG, batch_invariant=False)) as engine:
            compute = engine._parts.device.compute
            launch = compute.launch

            def measured(fn, label=""):
                if label != "sample":
                    return launch(fn, label)

                def run_measured():
                    with LiveBytes() as m:
                        fn()
                    peaks.append(m.peak)
                return launch(run_measured, label)

            monkeypatch.setattr(compute, "launch", measured)
            params = [SamplingParams(max_tokens=4, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=i,
                                     presence_penalty=0.5, frequency_penalty=0.2, repetition_penalty=1.1,
                                     min_tokens=2, logprobs=True, top_logprobs=5, ignore_eos=True) for i in range(4)]
            await asyncio.gather(*(engine.complete([5 + i, 6, 7], p) for i, p in enumerate(params)))
            return engine._parts.model_config.vocab_size

    vocab = asyncio.run(run())
    per_logit = max(peaks) / (4 * vocab)  # the decode steps sample all 4 rows in one group
    print(f"sampling peak: {per_logit:.1f} bytes per logit")
    assert 0.5 * SAMPLING_BYTES_PER_LOGIT < per_logit <= SAMPLING_BYTES_PER_LOGIT, per_logit


def test_kv_sizing_subtracts_the_reserve_and_names_it_when_nothing_fits():
    assert kv_pages_for_memory(10_000, 0.5, 100, 1) == 50
    assert kv_pages_for_memory(10_000, 0.5, 100, 1, reserved_bytes=4_000) == 30
    with pytest.raises(InvalidRequestError, match="reserved for graphs, sampling and encoder outputs"):
        kv_pages_for_memory(10_000, 0.9, 100, 2, reserved_bytes=12_000)


def test_engine_kv_sizing_subtracts_the_reserve_and_logs_it(monkeypatch):
    """assemble.kv_pages on a CUDA-kind device (the profiling forward stubbed): the reserve for this
    config is taken off the free memory before gpu_memory_utilization applies."""
    import structlog

    from slipstream.api import assemble
    from slipstream.models.config import smollm2_135m_config
    from slipstream.runtime.devices import memory

    mcfg = smollm2_135m_config()
    cfg = EngineConfig(model="random-smollm2-135m", device="cuda", dtype="bfloat16", max_batch_size=256,
                       max_num_batched_tokens=512)
    free = 40 * 2**30
    monkeypatch.setattr(memory, "profile_free_memory", lambda *a, **k: free)
    device = types.SimpleNamespace(kind="cuda")
    with structlog.testing.capture_logs() as logs:
        pages = assemble.kv_pages(cfg, TEXT_MODEL, mcfg, device, max_model_len=8192)
    r = engine_reserve(cfg, mcfg, torch.bfloat16)
    per_page = memory.kv_bytes_per_page(mcfg, cfg.page_size, torch.bfloat16)
    assert pages == int((free - r.total) * 0.9) // per_page
    assert r.decode_graph_logits > 800 * 2**20  # 256 rows x 49k vocabulary: 0.86 GB of decode graph logits alone
    logged = next(e for e in logs if e["event"] == "memory_reserved_before_kv")
    assert logged["total"] == round(r.total / 2**30, 3) and logged["decode_graph_logits"] == 0.802  # GiB


@pytest.mark.cuda
def test_cuda_reserve_covers_the_measured_graph_and_sampling_memory():
    """On a GPU: the pool growth warmup logs for all graphs, and the peak a sampled workload of
    max_batch_size rows adds, stay within the parts of the reserve that predict them."""
    import structlog

    from slipstream.models.config import smollm2_135m_config

    cfg = EngineConfig(model="random-smollm2-135m", device="cuda", dtype="bfloat16", max_batch_size=32,
                       max_num_batched_tokens=128, kv_cache_tokens=8192, page_size=16)
    r = engine_reserve(cfg, smollm2_135m_config(), torch.bfloat16)
    params = [SamplingParams(max_tokens=8, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=i,
                             presence_penalty=0.5, min_tokens=2, logprobs=True, top_logprobs=5, ignore_eos=True)
              for i in range(32)]

    async def run():
        async with Engine(cfg) as engine:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            await asyncio.gather(*(engine.complete([5 + i, 6, 7], p) for i, p in enumerate(params)))
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - base

    with structlog.testing.capture_logs() as logs:
        peak = asyncio.run(run())
    grown = sum(e["reserved_gib"] for e in logs if e["event"] == "cuda_graphs_memory") * 2**30
    graphs = r.decode_graph_logits + r.greedy_graph_ids + r.mixed_graph_logits + r.graph_temporaries
    assert 0 < grown <= graphs + 64 * 2**20  # (+ the allocator's segment rounding)
    assert peak <= r.sampling + r.eager_logits + r.history + 64 * 2**20, (peak, r.gib())


@needs_triton
def test_carry_graph_outputs_are_what_the_reserve_predicts(monkeypatch):
    """A model with carry heads captures carry decode graphs at warm-up: each keeps its logits and
    hidden states, which the reserve counts (and only for such a model)."""
    from carry_util import install_heads

    cfg = EngineConfig(**CFG)
    mcfg, held = capture_graph_outputs(monkeypatch, cfg, install_heads)
    assert len(held["carry"]) == 2 * 3  # two slots x buckets 1, 2, 4
    assert _nbytes(*held["carry"]) == engine_reserve(cfg, mcfg, torch.float32, carry=True).carry_graph_outputs
    assert engine_reserve(cfg, mcfg, torch.float32).carry_graph_outputs == 0


@needs_triton
def test_spec_graph_outputs_are_what_the_reserve_predicts(monkeypatch):
    """With n-gram speculation, each sampled speculating graph keeps the logits of its B(K + 1) fed
    positions and its drafts, which the reserve counts; its temporaries cover those logits."""
    from slipstream.params import SpeculativeConfig

    cfg = EngineConfig(**{**CFG, "max_batch_size": 2}, speculative=SpeculativeConfig(num_drafts=2, adaptive=False),
                       graph_batch_sizes=(1, 1, 2), mixed_graphs=False)
    mcfg, held = capture_graph_outputs(monkeypatch, cfg)
    assert len(held["spec"]) == len(held["spec_sampled"]) == 2 * 2  # two slots x buckets 1, 2
    r = engine_reserve(cfg, mcfg, torch.float32)
    assert _nbytes(*held["spec_sampled"]) == r.spec_graph_outputs
    assert r.graph_temporaries >= max(_nbytes(logits) for logits, _ in held["spec_sampled"])
    assert engine_reserve(EngineConfig(**CFG), mcfg, torch.float32).spec_graph_outputs == 0

