"""The triton backend's fused kernels against their references (interpreted on CPU tensors here,
compiled in the `cuda` tests), projection fusion, and the whole model: triton == reference.

Outputs are poisoned first (NaN or a sentinel) so an element a kernel should write but does not
shows, and one it must not touch is checked to keep its poison."""
import dataclasses

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

from slipstream.models.add_norm_triton import add_rms_norm_reference, add_rms_norm_triton  # noqa: E402
from slipstream.models.attention import DeviceAttentionMetadata  # noqa: E402
from slipstream.models.build import random_weights  # noqa: E402
from slipstream.models.config import tiny_config  # noqa: E402
from slipstream.models.fused_projections import fuse_linears, is_fused_view  # noqa: E402
from slipstream.models.host_batch import Chunk, host_batch  # noqa: E402
from slipstream.models.llama import KVCache, LlamaForCausalLM, RotaryEmbedding  # noqa: E402
from slipstream.models.rotary_kv_triton import rotary_kv_reference, rotary_kv_triton  # noqa: E402
from slipstream.models.silu_mul_triton import silu_mul_reference, silu_mul_triton  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
# fp32: order of operations only; bf16: one rounding step of the output (2^-8 relative) at most
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2)}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
SENTINEL = 123.0


def _device(name):
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    return name


def _close(got, want, dtype):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("mode", ["add", "plain", "rows", "plain_rows"])
def test_add_rms_norm_matches_reference(device, dtype, mode):
    device = _device(device)
    g = torch.Generator().manual_seed(len(mode))
    rows, hidden = 7, 100  # hidden not a power of two: masked tail
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device=device, dtype=dtype)
    residual = (3 * torch.randn(rows, hidden, generator=g)).to(device=device, dtype=dtype)
    x = None if mode.startswith("plain") else torch.randn(rows, hidden, generator=g).to(device=device, dtype=dtype)
    idx = torch.tensor([6, 0, 3, 0], device=device) if mode.endswith("rows") else None
    want_res = residual.clone()
    want = add_rms_norm_reference(x, want_res, weight, 1e-5, rows=idx)
    before = residual.clone()
    got = add_rms_norm_triton(x, residual, weight, 1e-5, rows=idx)
    assert got.shape == want.shape and got.dtype == dtype
    _close(got, want, dtype)
    if mode == "add":  # the sum is stored in place, rounded as the reference's add
        assert not residual.equal(before)
        if dtype == torch.float32 or device == "cuda":
            assert residual.equal(want_res)
        else:  # the interpreter rounds fp32 -> bf16 towards zero (the GPU to nearest even): one step
            _close(residual, want_res, dtype)
    else:  # nothing to store (plain) or nobody reads it (rows)
        assert residual.equal(before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("tokens,heads,kv_heads", [(1, 4, 2), (5, 3, 1)])
def test_rotary_kv_matches_reference_on_fused_qkv_views(device, dtype, tokens, heads, kv_heads):
    device = _device(device)
    cfg = tiny_config()
    rope = RotaryEmbedding(cfg).to(device)
    d, slots = cfg.head_dim, 32
    g = torch.Generator().manual_seed(tokens * 10 + heads)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(device=device, dtype=dtype)

    def split(t):
        q, k, v = t.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
        return q.view(tokens, heads, d), k.view(tokens, kv_heads, d), v.view(tokens, kv_heads, d)

    positions = torch.randint(0, 1024, (tokens,), generator=g).to(device)
    slot_mapping = torch.randperm(slots, generator=g)[:tokens].to(device)
    caches = [torch.full((slots, kv_heads, d), SENTINEL, dtype=dtype, device=device) for _ in range(4)]
    ref_qkv = qkv.clone()
    rotary_kv_reference(*split(ref_qkv), positions, rope.cos, rope.sin, caches[0], caches[1], slot_mapping)
    q, k, v = split(qkv)
    assert tokens == 1 or k.stride(0) == qkv.stride(0)  # strided views into the fused output
    k_before, v_before = k.clone(), v.clone()
    rotary_kv_triton(q, k, v, positions, rope.cos, rope.sin, caches[2], caches[3], slot_mapping)
    _close(q, split(ref_qkv)[0], dtype)  # q rotated in place
    assert k.equal(k_before) and v.equal(v_before)  # the sources are only read
    _close(caches[2], caches[0], dtype)  # rotated k, and only at the tokens' slots
    assert caches[3].equal(caches[1])  # v copied bit for bit
    untouched = torch.ones(slots, dtype=torch.bool, device=device)
    untouched[slot_mapping] = False
    assert (caches[2][untouched] == SENTINEL).all() and (caches[3][untouched] == SENTINEL).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("rows,inter", [(1, 96), (3, 1500)])  # 1500: two column blocks, a masked tail
def test_silu_mul_matches_reference_on_fused_gate_up(device, dtype, rows, inter):
    device = _device(device)
    g = torch.Generator().manual_seed(rows)
    gate_up = (4 * torch.randn(rows, 2 * inter, generator=g)).to(device=device, dtype=dtype)
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    got = silu_mul_triton(gate, up)
    assert got.is_contiguous() and got.shape == (rows, inter)
    _close(got, silu_mul_reference(gate, up), dtype)


def test_kernels_refuse_bad_shapes():
    with pytest.raises(ValueError, match="x must match residual"):
        add_rms_norm_triton(torch.randn(2, 5), torch.randn(2, 4), torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="rows must be"):
        add_rms_norm_triton(None, torch.randn(2, 4), torch.ones(4), 1e-5, rows=torch.zeros(2))
    with pytest.raises(ValueError, match="expected gate"):
        silu_mul_triton(torch.randn(2, 4), torch.randn(2, 5))
    q, kv, cos = torch.randn(2, 2, 8), torch.randn(2, 1, 8), torch.randn(8, 8)
    cache, pos = torch.randn(4, 1, 8), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="expected q"):
        rotary_kv_triton(q, kv, kv, pos, cos, cos, cache[:, :, :4], cache, pos)
    with pytest.raises(TypeError, match="one dtype"):
        rotary_kv_triton(q, kv, kv, pos, cos, cos, cache.double(), cache.double(), pos)


def test_fuse_linears_views_one_copy_and_leaves_packed_alone():
    torch.manual_seed(0)
    qkv = [nn.Linear(8, n, bias=True) for n in (8, 4, 4)]
    x = torch.randn(3, 8)
    want = [m(x) for m in qkv]
    weight, bias = fuse_linears(qkv)
    assert weight.shape == (16, 8) and bias.shape == (16,)
    assert all(is_fused_view(m, weight) for m in qkv)  # one copy of the weights in memory
    got = torch.nn.functional.linear(x, weight, bias).split([8, 4, 4], dim=1)
    for a, b, m in zip(got, want, qkv):
        assert a.equal(b) or torch.allclose(a, b, rtol=0, atol=1e-6)
        assert m(x).equal(b)  # the unfused layer still computes the same
    assert fuse_linears([nn.Linear(8, 4), nn.Linear(8, 4, bias=False)]) is None  # mixed biases
    assert fuse_linears([nn.Linear(8, 4), nn.Linear(6, 4)]) is None  # different inputs
    from slipstream.models.cpu_linear import PackedLinear, onednn_available

    if onednn_available():
        packed = [PackedLinear(torch.randn(4, 8)), PackedLinear(torch.randn(4, 8))]
        assert fuse_linears(packed) is None


# ---- the whole model: triton backend (interpreted here) == reference backend ----

def with_device_metadata(batch):
    """host_batch's metadata plus the device copy the triton backend reads."""
    m = batch.attn
    width = max(len(p) for p in m.page_tables)
    table = torch.tensor([list(p) + [0] * (width - len(p)) for p in m.page_tables], device=batch.input_ids.device)
    qs = m.query_start
    dev = batch.input_ids.device
    m.on_device = DeviceAttentionMetadata(torch.tensor(qs, device=dev), torch.tensor(m.kv_lens, device=dev), table,
                                          max(b - a for a, b in zip(qs, qs[1:])))
    return batch


def two_steps(model, cfg, dtype, device):
    """Step 1 prefills two prompts (one chunked), step 2 mixes a decode, a later chunk and a new
    prompt, padded to 8 rows; returns both steps' logits."""
    kv = KVCache(cfg, num_pages=16, page_size=4, dtype=dtype, device=device)
    kv.k.fill_(float("nan"))  # unwritten slots must never be read
    kv.v.fill_(float("nan"))
    a, b, c = [5, 6, 7, 8, 9, 10], [20, 21, 22], [30, 31, 32, 33, 34]
    out = []
    for step, row_multiple in (([Chunk(a, 0, [3, 7]), Chunk(b[:2], 0, [5], sample=False)], 1),
                               ([Chunk([11], 6, [3, 7]), Chunk(b[2:], 2, [5]), Chunk(c, 0, [9, 2])], 8)):
        batch, n = host_batch(step, 4, row_multiple, device=device)
        out.append(model(with_device_metadata(batch), kv)[:n])
    return out


def build(cfg, dtype, backend, fuse=True, device="cpu", seed=0):
    model = LlamaForCausalLM.from_weights(cfg, random_weights(cfg, seed), dtype, device)
    if fuse:
        model.set_kernel_backend(backend)  # as the engine calls it (slipstream/api/assemble.py)
    else:
        model.set_kernel_backend(backend, fuse=False)
    return model


MODEL_TOL = {torch.float32: 2e-5, torch.bfloat16: 0.1}  # bf16: see test docstring
# Padding rows past the last sequence hold uninitialised attention output (no zero-fill); their
# arithmetic may overflow in the interpreter's numpy, harmlessly (llama.py Attention.forward_triton).
GARBAGE_ROWS_OK = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


@GARBAGE_ROWS_OK
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_triton_backend_equals_reference_fused_and_unfused(device, dtype, arch):
    """Logits of a mixed prefill + decode batch, padded. bf16: the kernels round once where the
    reference rounds twice (rotary, attention's softmax weights), and the interpreter rounds
    towards zero: 0.078 seen on logits of magnitude ~3, where bf16's own drift from the fp32
    reference is 0.045; allow 0.1."""
    device = _device(device)
    cfg = dataclasses.replace(tiny_config(), architecture=arch, attention_bias=arch == "qwen2")
    reference = two_steps(build(cfg, dtype, "reference", device=device), cfg, dtype, device)
    fused_model = build(cfg, dtype, "triton", device=device)
    assert fused_model.fuse_projections() == cfg.num_layers  # already fused: idempotent
    fused = two_steps(fused_model, cfg, dtype, device)
    unfused = two_steps(build(cfg, dtype, "triton", fuse=False, device=device), cfg, dtype, device)
    for f, u, r in zip(fused, unfused, reference):
        assert torch.isfinite(f).all()
        torch.testing.assert_close(f.cpu(), r.cpu(), rtol=0, atol=MODEL_TOL[dtype])
        torch.testing.assert_close(u.cpu(), r.cpu(), rtol=0, atol=MODEL_TOL[dtype])
        if dtype == torch.float32:  # fusing the matmuls alone changes (almost) nothing
            torch.testing.assert_close(f, u, rtol=0, atol=1e-5)


@GARBAGE_ROWS_OK
def test_triton_backend_runs_packed_projections_unfused():
    """The CPU quantised/packed layers (PackedLinear) have no dense weight: they stay unfused and
    the triton path runs them one by one, with the same logits."""
    from slipstream.models.cpu_linear import PackedLinear, onednn_available, pack_weights

    if not onednn_available():
        pytest.skip("this torch build has no oneDNN")
    cfg = tiny_config()
    reference = two_steps(build(cfg, torch.float32, "reference"), cfg, torch.float32, "cpu")
    rest = random_weights(cfg, 0)
    model = LlamaForCausalLM.from_packed(cfg, rest, pack_weights(cfg, rest))
    model.set_kernel_backend("triton")
    assert model.fuse_projections() == 0 and isinstance(model.model.layers[0].self_attn.q_proj, PackedLinear)
    for got, want in zip(two_steps(model, cfg, torch.float32, "cpu"), reference):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


# ---- kernels per decode step, counted on the CPU ----

class LaunchCounter(TorchDispatchMode):
    """Records what would be a GPU kernel launch: every torch op that computes (views and empty
    allocations launch nothing) and every Triton kernel launch (whose own internal torch ops, in
    the interpreter, are not counted)."""

    NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "lift_fresh"}

    def __init__(self):
        super().__init__()
        self.launches: list[str] = []
        self.inside_triton = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.inside_triton and not func.is_view and name not in self.NO_KERNEL:
            self.launches.append(name)
        return func(*args, **(kwargs or {}))

    def wrap(self, jitted):
        counter = self

        def counting(fn, interpret):
            kernel = jitted(fn, interpret)

            class Launch:
                def __getitem__(self, grid):
                    def run(*args, **kwargs):
                        counter.launches.append(fn.__name__)
                        counter.inside_triton += 1
                        try:
                            return kernel[grid](*args, **kwargs)
                        finally:
                            counter.inside_triton -= 1
                    return run
            return Launch()
        return counting


def decode_launches(num_layers: int, monkeypatch, fuse: bool = True) -> list[str]:
    """Launches of one decode step (three sequences, one token each) on the triton backend."""
    from slipstream.models import add_norm_triton, attention_triton, norm_rope_triton, rotary_kv_triton, \
        silu_mul_triton, triton_jit

    cfg = dataclasses.replace(tiny_config(), num_layers=num_layers)
    model = build(cfg, torch.bfloat16, "triton", fuse=fuse)  # bf16, as served on the GPU
    kv = KVCache(cfg, num_pages=8, page_size=4, dtype=torch.bfloat16, device="cpu")
    batch, _ = host_batch([Chunk([5], 0, [1]), Chunk([6], 0, [2]), Chunk([7], 0, [3])], 4)
    batch = with_device_metadata(batch)
    counter = LaunchCounter()
    for module in (add_norm_triton, attention_triton, norm_rope_triton, rotary_kv_triton, silu_mul_triton):
        monkeypatch.setattr(module, "jitted", counter.wrap(triton_jit.jitted))
    with counter:
        model(batch, kv)
    return counter.launches


# One decode layer on the triton backend: 9 launches, from 18 before fusion (docs/cuda.md).
LAYER = ["_add_rms_norm_kernel", "mm", "_rotary_kv_kernel", "_paged_attention_kernel", "mm",
         "_add_rms_norm_kernel", "mm", "_silu_mul_kernel", "mm"]
# Per step besides the layers: embedding lookup, final norm (sampled rows only), lm_head, and the
# float32 cast of the logits.
OUTSIDE_LAYERS = ["embedding", "_add_rms_norm_kernel", "mm", "_to_copy"]


def test_decode_step_launches_nine_kernels_per_layer(monkeypatch):
    two, three = decode_launches(2, monkeypatch), decode_launches(3, monkeypatch)
    assert three[1:10] == LAYER  # after the embedding lookup, the first layer in order
    assert len(three) - len(two) == len(LAYER)  # what one more layer costs
    assert sorted(two) == sorted(OUTSIDE_LAYERS + 2 * LAYER)
    # SmolLM2-135M (30 layers): 9 * 30 + 4 = 274 kernels a step from the model, 548 before
    assert len(LAYER) * 30 + len(OUTSIDE_LAYERS) == 274
