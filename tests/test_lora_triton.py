"""The CUDA path's LoRA kernels (models/kernels/lora_triton.py: shrink and expand, each token reading
its own slot of the bank) against a float64 reference, on mixes of slots, base rows (slot 0), ranks
padded with zeros, widths that are not a multiple of the blocks and a three-target fused output;
interpreted on CPU tensors here, compiled in the `cuda` tests; the triton backend reading a LoraBank
against the reference backend, and an engine on that path against the CPU engine (interpreted; the
GPU engine's test: tests/test_lora_cuda.py)."""
import pytest
import torch

pytest.importorskip("triton")

from lora_files import MODEL_SPECS, write_adapter  # noqa: E402
from slipstream.models.kernels.lora_triton import (lora_expand_reference, lora_expand_triton,  # noqa: E402
                                                   lora_shrink_reference, lora_shrink_triton)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
# float32: the order of the sums; bfloat16: the weights and x are the rounded values themselves
# (the reference reads them), mid is float32, the output is rounded once (2^-8 of |y|)
TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}
SLOTS = [2, 0, 1, 3, 0, 2, 2, 3, 1]  # every slot present and interleaved, base rows between them


def bank(slots, r, k, ranks, g, dtype, device, n=None):
    """[slots, r, k] random with each slot's rows past its rank zero (a smaller adapter padded)."""
    w = torch.randn(slots, r, k if n is None else n, generator=g)
    for s, rank in enumerate(ranks):
        w[s, rank:] = 0
    return w.to(device=device, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_shrink_and_expand_match_float64(device, dtype):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    g = torch.Generator().manual_seed(3)
    rank, k = 20, 200  # two steps of the expand's rank loop, a partial last block of the shrink's
    n0, n1, n2 = 40, 24, 70  # three targets side by side (q/k/v); 134 is not a multiple of BLOCK_N
    n = n0 + n1 + n2
    slots = torch.tensor(SLOTS, device=device)
    t = slots.shape[0]
    x = torch.randn(t, k, generator=g).to(device=device, dtype=dtype)
    ranks = [20, 3, 5]  # slot 1's rank is max_lora_rank; slots 2 and 3 padded with zeros
    a = torch.cat([bank(3, rank, k, ranks, g, dtype, device) for _ in range(3)], dim=1)  # 3 targets' A rows
    mid = lora_shrink_triton(x, slots, a, out=torch.full((t, 3 * rank), float("nan"), device=device))
    want_mid = lora_shrink_reference(x, slots, a)
    on = slots > 0
    assert mid[~on].isnan().all()  # base rows: nothing computed, nothing written
    err = (mid[on].double() - want_mid[on]).abs().max().item()
    assert err <= 1e-5 * want_mid.abs().max().item()  # float32 sums of the same products

    b = bank(3, rank, None, ranks, g, dtype, device, n=n)
    y = torch.randn(t, n, generator=g).to(device=device, dtype=dtype)
    base = y.clone()
    lora_expand_triton(mid, slots, b, y, (n0, n1))
    want = lora_expand_reference(want_mid, slots, b, base, (n0, n1))
    assert torch.equal(y[~on], base[~on])  # base rows untouched (their mid is NaN)
    err = (y.double() - want).abs().max().item()
    assert err <= TOL[dtype] * want.abs().max().item()

    # one target of the group alone (an unfused output): its column block of B, its rank block of mid
    y1 = base[:, n0:n0 + n1].contiguous()
    lora_expand_triton(mid[:, rank:], slots, b[:, :, n0:n0 + n1], y1)
    torch.testing.assert_close(y1.double(), want[:, n0:n0 + n1], rtol=0, atol=TOL[dtype] * want.abs().max().item())


@pytest.mark.parametrize("device", DEVICES)
def test_a_token_does_not_depend_on_the_batch(device):
    """Fixed-order sums per token, no atomics: a token's output is bit for bit the same alone."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    g = torch.Generator().manual_seed(5)
    slots = torch.tensor(SLOTS, device=device)
    x = torch.randn(len(SLOTS), 96, generator=g).to(device)
    a = torch.randn(3, 16, 96, generator=g).to(device)
    b = torch.randn(3, 16, 80, generator=g).to(device)
    y = torch.randn(len(SLOTS), 80, generator=g).to(device)
    full = y.clone()
    lora_expand_triton(lora_shrink_triton(x, slots, a), slots, b, full)
    for i in (0, 3):
        one = y[i:i + 1].clone()
        lora_expand_triton(lora_shrink_triton(x[i:i + 1], slots[i:i + 1], a), slots[i:i + 1], b, one)
        assert torch.equal(one[0], full[i])


@pytest.mark.cuda
def test_kernels_replay_in_a_cuda_graph_with_other_slots():
    """Captured once, the graph serves any mix of slots written into its slot tensor."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    g = torch.Generator().manual_seed(1)
    slots = torch.tensor(SLOTS, device="cuda")
    x = torch.randn(len(SLOTS), 64, generator=g).cuda()
    a, b = torch.randn(3, 8, 64, generator=g).cuda(), torch.randn(3, 8, 48, generator=g).cuda()
    y0 = torch.randn(len(SLOTS), 48, generator=g).cuda()
    y = y0.clone()
    lora_expand_triton(lora_shrink_triton(x, slots, a), slots, b, y)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mid = lora_shrink_triton(x, slots, a)
        lora_expand_triton(mid, slots, b, y)
    for mix in ([0] * 9, [3, 3, 1, 0, 2, 1, 0, 0, 3]):
        slots.copy_(torch.tensor(mix))
        y.copy_(y0)
        graph.replay()
        torch.cuda.synchronize()
        want = lora_expand_reference(lora_shrink_reference(x, slots, a), slots, b, y0)
        torch.testing.assert_close(y.double(), want, rtol=0, atol=1e-4)


def lora_steps(model, cfg, lora, chunk_slots):
    """tests/triton_model_util.two_steps' two steps, each chunk's tokens with its adapter slot (padding: 0)."""
    from host_batch import Chunk, host_batch
    from triton_model_util import with_device_metadata

    from slipstream.models.base import KVCache

    kv = KVCache(cfg, num_pages=16, page_size=4, dtype=torch.float32, device="cpu")
    kv.k.fill_(float("nan"))
    kv.v.fill_(float("nan"))
    a, b, c = [5, 6, 7, 8, 9, 10], [20, 21, 22], [30, 31, 32, 33, 34]
    out = []
    steps = (([Chunk(a, 0, [3, 7]), Chunk(b[:2], 0, [5], sample=False)], 1),
             ([Chunk([11], 6, [3, 7]), Chunk(b[2:], 2, [5]), Chunk(c, 0, [9, 2])], 8))
    for (step, row_multiple), slots in zip(steps, chunk_slots):
        batch, n = host_batch(step, 4, row_multiple)
        per_token = [s for chunk, s in zip(step, slots) for _ in chunk.tokens]
        per_token += [0] * (batch.input_ids.shape[0] - len(per_token))
        if lora is not None:
            batch.lora = lora(torch.tensor(per_token))
        out.append(model(with_device_metadata(batch), kv)[:n])
    return out


@pytest.mark.filterwarnings(r"ignore:(overflow|invalid value) encountered:RuntimeWarning")
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_triton_backend_with_adapters_equals_reference(tmp_path, fused):
    """The tiny model on the triton backend (interpreted) with a bank of three adapters (ranks 4, 8, 2
    padded to 8; slot 3 never installed, slot 4 installed and unused) computes the reference backend's
    logits for steps mixing adapters and a base row, with fused projections (one expand per q/k/v and
    per gate/up) and without."""
    from triton_model_util import UNFUSED, build

    from slipstream.models.config import tiny_config
    from slipstream.models.lora import LoraInput, load_peft_adapter
    from slipstream.models.lora_bank import LoraBank

    cfg = tiny_config()
    adapters = [None] * 5
    bank = LoraBank(cfg, max_loras=4, max_rank=8, dtype=torch.float32, device="cpu")
    for slot, (rank, targets) in MODEL_SPECS.items():
        adapters[slot] = load_peft_adapter(f"s{slot}", write_adapter(tmp_path / f"s{slot}", cfg, rank, targets, slot), cfg)
        bank.install(slot, bank.stage(adapters[slot]))
    mixes = ([2, 0], [2, 0, 1])  # sequences a (slot 2, all seven targets), b (the base model), c (slot 1)
    reference = build(cfg, torch.float32, "reference")
    want = lora_steps(reference, cfg, lambda s: LoraInput(s, tuple(adapters)), mixes)
    triton_model = build(cfg, torch.float32, "triton", None if fused else UNFUSED)
    got = lora_steps(triton_model, cfg, lambda s: LoraInput(s, tuple(adapters), bank), mixes)
    base = lora_steps(reference, cfg, None, mixes)
    for g, w, b, changed in zip(got, want, base, ([True], [True, False, True])):
        torch.testing.assert_close(g, w, rtol=0, atol=2e-5)
        moved = (w - b).abs().amax(1) > 1e-2  # the adapters' rows differ from the base model's, b's not
        assert moved.tolist() == changed


@pytest.mark.filterwarnings(r"ignore:(overflow|invalid value) encountered:RuntimeWarning")
def test_engine_on_the_bank_path_gives_the_cpu_engines_tokens(tmp_path, monkeypatch):
    """What the CUDA engine runs, on the CPU: the triton backend (interpreted) reading a LoraBank, the
    adapters read to the host, staged in the reading thread and installed through the compute stream
    (ModelRunner.set_lora), two slots for three adapters (an eviction installs over a slot), every
    forward carrying the slots; the greedy tokens equal the CPU backend's engine's."""
    import asyncio

    from slipstream import Engine, EngineConfig, SamplingParams
    from slipstream.api import assemble
    from slipstream.models.config import tiny_config
    from slipstream.models.lora_bank import LoraBank

    cfg = tiny_config()
    folders = {name: write_adapter(tmp_path / name, cfg, rank, targets, seed)
               for seed, (name, (rank, targets)) in enumerate(zip("abc", MODEL_SPECS.values()))}
    waves = [["a", None, "b"], ["c", "b", None]]
    prompts = [[1, 5, 40, 7, 99], [1, 6, 43], [1, 7, 46, 7, 98, 11, 12]]

    async def serve():
        config = EngineConfig(model="tiny-random", dtype="float32", lora_adapters=folders, max_loras=2, max_lora_rank=8,
                              kv_cache_tokens=512, pipeline_depth=2)
        async with Engine(config) as engine:
            outs = []
            for wave in waves:
                done = await asyncio.gather(*(engine.complete(p, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                                               lora=lora)) for p, lora in zip(prompts, wave)))
                outs.append([o.token_ids for o in done])
            return outs, (await engine.stats())["lora"], engine._parts.runner.forward.lora_bank

    want, _, no_bank = asyncio.run(serve())
    assert no_bank is None  # the CPU backend reads the adapters themselves

    def banked(config, model, mcfg, device):
        model.set_kernel_backend("triton")
        return LoraBank(mcfg, config.max_loras, config.max_lora_rank, torch.float32, "cpu")

    monkeypatch.setattr(assemble, "cpu_backend_available", lambda model: False)
    monkeypatch.setattr(assemble, "lora_bank", banked)
    got, stats, bank = asyncio.run(serve())
    assert bank is not None and stats["evictions"] >= 1
    assert got == want
