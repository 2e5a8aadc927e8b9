"""The two implementations of a step's LoRA deltas (models/lora.py: LoraGroups.add, torch matmuls per
adapter; LoraGroups.add_cpu, one compiled sq_lora_add call for all adapters) against a float64
reference, on mixes of adapters of different ranks and targets, base rows and an emptied slot; and
add_cpu's value for a token does not depend on the batch around it (bit for bit)."""
import dataclasses

import pytest
import torch
from lora_files import write_adapter

from slipstream.models.config import tiny_config
from slipstream.models.kernels.cpu_kernels import native_kernels
from slipstream.models.lora import INPUT_GROUPS, LoraGroups, load_peft_adapter, target_shapes

SPECS = [(4, ("q_proj", "v_proj", "down_proj")), (8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                     "up_proj", "down_proj")),
         (3, ("k_proj", "o_proj", "gate_proj", "up_proj")), (16, ("q_proj", "k_proj", "v_proj", "o_proj")),
         (5, ("up_proj",))]


@pytest.fixture(scope="module", params=["tiny", "wide"])
def bank(request, tmp_path_factory):
    config = tiny_config()
    if request.param == "wide":  # outputs of several column blocks of the expand, and widths that are not 16n
        config = dataclasses.replace(config, hidden_size=296, intermediate_size=408, num_heads=6, num_kv_heads=3, head_dim=24)
    root = tmp_path_factory.mktemp("lora-kernel")
    adapters = [load_peft_adapter(f"a{i}", write_adapter(root / f"a{i}", config, r, t, i), config)
                for i, (r, t) in enumerate(SPECS)]
    return config, (None, *adapters[:2], None, *adapters[2:])  # slot 3: emptied (a finished row's)


def reference(config, adapters, slots, layer, group, x, outs):
    """outs + the deltas, in float64 from the adapters' own weights."""
    want = {n: o.double().clone() for n, o in outs.items()}
    for t, s in enumerate(slots.tolist()):
        adapter = adapters[s]
        w = adapter.layers[layer][group] if adapter is not None else None
        if w is None:
            continue
        mid = w.a.double() @ x[t].double()
        for name, lo, hi, b in w.b:
            want[name][t] += mid[lo:hi] @ b.double()  # (b: B^T)
    return want


def inputs(config, group, tokens, seed):
    g = torch.Generator().manual_seed(seed)
    names = INPUT_GROUPS[group]
    n_in = target_shapes(config)[names[0]][0]
    x = torch.randn(tokens, n_in, generator=g)
    widths = [target_shapes(config)[n][1] for n in names]
    fused = torch.randn(tokens, sum(widths) + 7, generator=g)  # outputs as column views of one wider tensor
    outs, at = {}, 0
    for n, w in zip(names, widths):
        outs[n] = fused[:, at:at + w]
        at += w
    return x, fused, outs


needs_kernels = pytest.mark.skipif(native_kernels() is None, reason="no compiled CPU kernels here")


@needs_kernels
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("native", [True, False], ids=["add_cpu", "add"])
def test_both_match_float64(bank, seed, native):
    config, adapters = bank
    g = torch.Generator().manual_seed(100 + seed)
    tokens = [1, 5, 17, 33, 64, 9][seed]
    slots = torch.randint(0, len(adapters), (tokens,), generator=g)
    if seed == 4:
        slots[:] = 2  # every token one adapter's (the group without a token order)
    groups = LoraGroups(slots, adapters)
    lib = native_kernels()
    for layer in range(config.num_layers):
        for group in range(len(INPUT_GROUPS)):
            x, fused, outs = inputs(config, group, tokens, seed * 31 + layer * 4 + group)
            before = fused.clone()
            want = reference(config, adapters, slots, layer, group, x, outs)
            if native:
                groups.add_cpu(lib, layer, group, x, outs)
            else:
                groups.add(layer, group, x, outs)
            for n, o in outs.items():
                # float32 sums of a few hundred products: errors of ~1e-6 of the outputs' scale
                scale = max(1.0, want[n].abs().max().item())
                torch.testing.assert_close(o.double(), want[n], rtol=1e-5, atol=1e-5 * scale)
            covered = sum(o.shape[1] for o in outs.values())
            assert torch.equal(fused[:, covered:], before[:, covered:])  # nothing written past the views


@needs_kernels
def test_add_cpu_does_not_depend_on_the_batch(bank):
    config, adapters = bank
    g = torch.Generator().manual_seed(7)
    slots = torch.randint(0, len(adapters), (24,), generator=g)
    lib = native_kernels()
    for group in range(len(INPUT_GROUPS)):
        x, fused, outs = inputs(config, group, 24, group)
        base = fused.clone()
        LoraGroups(slots, adapters).add_cpu(lib, 1, group, x, outs)
        for t in (0, 11, 23):
            _, alone, alone_outs = inputs(config, group, 1, 0)
            alone.copy_(base[t:t + 1])
            LoraGroups(slots[t:t + 1], adapters).add_cpu(lib, 1, group, x[t:t + 1], alone_outs)
            assert torch.equal(alone[0], fused[t])
