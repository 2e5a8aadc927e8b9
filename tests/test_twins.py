"""Twins the other tests leave unchecked (issue 53; inventory: docs/twins.md). A twin computes what
another implementation computes, by other means, chosen by device, backend, CPU or speed; each test
here compares a pair, or each side against a float64 reference.

- the reference attention's batched decode (one padded SDPA call) against its per-sequence path
- speculation's argmax (numpy on the CPU) against the sampler's greedy argmax (torch)
- logits_process.process_logits against sampler.process_group (the same steps, wired twice)
- the compiled CPU products' branches a CPU with AVX512 never runs (the float kernel's AVX2 code,
  the int8 plain C loops and the rounded products' float epilogue): each file built again without
  AVX512, checked against float64 models of the arithmetic
- `cuda`: the compiled attention kernel with a bidirectional prefix (Moondream's, on the GPU)
"""
from __future__ import annotations

import ctypes
import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from quant_util import FORMATS, random_weight

from slipstream.models.kernels import cpu_kernels
from slipstream.models.kernels.attention import AttentionMetadata, paged_attention_reference
from slipstream.models.kernels.quant_linear import cpu_matmul
from slipstream.runtime.sampling.logits_process import process_flags, process_logits
from slipstream.runtime.sampling.sampler import process_group, sample
from slipstream.runtime.sampling.sampling_args import Draw, Penalties, SamplingArgs
from slipstream.speculation.runner import _argmax

CUDA = pytest.param("cuda", marks=pytest.mark.cuda)


# --- the reference attention: batched decode == per sequence -----------------------------------

def _paged(kv_lens, kv_heads, d, page_size, seed):
    """float64 caches poisoned with NaN outside the contexts, shuffled page tables (lists)."""
    g = torch.Generator().manual_seed(seed)
    n_pages = [-(-n // page_size) for n in kv_lens]
    order = torch.randperm(sum(n_pages) + 3, generator=g).tolist()
    tables, at = [], 0
    for n in n_pages:
        tables.append(order[at:at + n])
        at += n
    slots = (sum(n_pages) + 3) * page_size
    k = torch.full((slots, kv_heads, d), float("nan"), dtype=torch.float64)
    v = k.clone()
    for pages, n in zip(tables, kv_lens):
        idx = torch.tensor([pages[p // page_size] * page_size + p % page_size for p in range(n)])
        k[idx] = torch.randn(n, kv_heads, d, generator=g, dtype=torch.float64)
        v[idx] = torch.randn(n, kv_heads, d, generator=g, dtype=torch.float64)
    return k, v, tables


@pytest.mark.parametrize("window", [None, 1, 6, 40])
def test_reference_attention_batched_decode_equals_per_sequence(window):
    """A decode-only step of several sequences runs as one padded, masked SDPA call (the fast path);
    compute_dtype=float64 (the invariant path) runs each sequence alone. In float64 they agree to
    rounding: padding masked, windows cut at the same key, GQA and the scale alike."""
    kv_lens, heads, kv_heads, d, ps = [1, 9, 33, 5, 17], 6, 2, 16, 4
    k, v, tables = _paged(kv_lens, kv_heads, d, ps, seed=window or 0)
    q = torch.randn(len(kv_lens), heads, d, generator=torch.Generator().manual_seed(9), dtype=torch.float64)

    def run(compute_dtype):
        meta = AttentionMetadata(list(range(len(kv_lens) + 1)), kv_lens, tables, ps)
        out = torch.zeros_like(q)
        paged_attention_reference(q, k, v, meta, out, compute_dtype, window, scale=0.3)
        return out, meta

    batched, meta = run(None)
    assert meta.cpu_plan.padded is not None and meta.cpu_plan.mask is not None  # (the batched path ran)
    single, meta = run(torch.float64)
    assert meta.cpu_plan.padded is None
    assert torch.isfinite(batched).all()
    torch.testing.assert_close(batched, single, rtol=1e-12, atol=1e-12)


# --- the kernels' RMSNorm reference == the reference model's RMSNorm ------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_kernels_norm_reference_is_the_models_norm(dtype):
    """The Triton norm kernels are tested against add_norm_triton.add_rms_norm_reference, a second
    statement of llama/model.py's RMSNorm: the two give the same bits, so those tests test against
    what the reference backend computes (rows selected or not, with the residual's add or not)."""
    from slipstream.models.kernels.add_norm_triton import add_rms_norm_reference
    from slipstream.models.llama.model import RMSNorm

    g = torch.Generator().manual_seed(6)
    x, delta = (torch.randn(6, 96, generator=g).to(dtype) for _ in range(2))
    norm = RMSNorm(96, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=g))
    norm = norm.to(dtype)
    with torch.no_grad():
        assert torch.equal(add_rms_norm_reference(None, x.clone(), norm.weight, norm.eps), norm(x))
        rows = torch.tensor([4, 0])
        assert torch.equal(add_rms_norm_reference(delta, x.clone(), norm.weight, norm.eps, rows), norm(x + delta)[rows])


# --- speculation's argmax == the sampler's greedy argmax ------------------------------------------

@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_spec_argmax_equals_the_samplers_greedy_argmax(device):
    """Replay emits what one-token decoding emits only if its argmax (numpy on the CPU) picks the same
    index as the sampler's (torch): first of tied maxima, NaN as the maximum, an all -inf row, values
    one float32 step apart, int64 ids; on a non-contiguous view of the logits too."""
    g = torch.Generator().manual_seed(4)
    wide = torch.randn(7, 3001, generator=g)
    logits = wide[:, :3000]  # (a view, as a vocab-trimmed head gives)
    logits[0, [5, 900, 2999]] = 50.0  # ties: the first wins
    logits[1, 17] = float("nan")
    logits[1, 3] = float("inf")
    logits[2] = float("-inf")
    logits[3, 100] = 40.0
    logits[3, 10] = float(np.nextafter(np.float32(40.0), np.float32(0)))  # one step below, earlier
    logits[4, 2000] = logits[4, 1000] = float("inf")
    logits = logits.to(device)
    got = _argmax(logits)
    want = sample(logits, SamplingArgs(torch.zeros(7, dtype=torch.int64, device=device)))
    assert got.dtype == want.dtype == torch.int64 and got.device == want.device
    assert torch.equal(got, want)
    assert got[:5].tolist() == [5, 17, 0, 100, 1000]


# --- process_logits == process_group --------------------------------------------------------------

def test_process_logits_equals_process_group():
    """The two wirings of penalties -> min_tokens -> min_p (logits_process.process_logits with host
    flags; sampler.process_group with SamplingArgs, what the runner runs) give the same bits, on rows
    where the order matters: a stop token that is the most likely token, min_tokens holding it back,
    then min_p's threshold taken from what is left."""
    n, vocab = 5, 64
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(n, vocab, generator=g) * 3
    logits[:, 7] = 12.0  # the stop token leads every row
    counts = torch.randint(0, 3, (n, vocab), generator=g, dtype=torch.int32)
    prompt = torch.rand(n, vocab, generator=g) < 0.2
    stop = torch.zeros(n, vocab, dtype=torch.bool)
    stop[:, 7] = True
    presence = torch.tensor([0.0, 0.5, 1.0, 0.0, -0.5])
    frequency = torch.tensor([0.0, 0.3, 0.0, 1.0, 0.2])
    repetition = torch.tensor([1.0, 1.3, 1.0, 0.8, 1.1])
    index = torch.tensor([0, 1, 5, 2, 9])
    min_tokens = torch.tensor([3, 0, 6, 3, 0])
    temperature = torch.tensor([0.8, 0.0, 1.2, 0.7, 1.0])
    min_p = torch.tensor([0.05, 0.2, 0.1, 0.0, 0.3])

    class Row:  # SamplingParams' fields, as process_flags reads them
        def __init__(self, i):
            self.presence_penalty, self.frequency_penalty = float(presence[i]), float(frequency[i])
            self.repetition_penalty, self.min_tokens = float(repetition[i]), int(min_tokens[i])
            self.temperature, self.min_p, self.top_logprobs = float(temperature[i]), float(min_p[i]), 0

    flags = process_flags([Row(i) for i in range(n)], index.tolist())
    assert flags.penalties and flags.min_tokens and flags.min_p
    old = process_logits(logits, flags, counts, prompt, stop, presence, frequency, repetition, index, min_tokens,
                         temperature, min_p)
    args = SamplingArgs(index, draw=Draw(temperature, torch.arange(n), None),
                        penalties=Penalties(presence, frequency, repetition), min_tokens=min_tokens, min_p=min_p)
    new = process_group(logits, args, (counts, prompt, stop))
    assert torch.equal(old, new)
    assert torch.isinf(new[0, 7]) and torch.isfinite(new[1, 7])  # (min_tokens held row 0's stop token back)


# --- the compiled CPU products without AVX512 ------------------------------------------------------

def _native_macros(cc: str) -> str:
    done = subprocess.run([cc, "-march=native", "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True,
                          text=True, timeout=60)
    return done.stdout


@pytest.fixture(scope="module")
def no_avx512(tmp_path_factory):
    """{source: library} of each products file built alone as the library builds it, less AVX512:
    what a CPU without AVX512 runs (its AVX2 / plain C branches), built in parallel."""
    cc = cpu_kernels._compiler()
    if cc is None:
        pytest.skip("no C compiler: no compiled CPU kernels")
    if "__AVX512F__" not in _native_macros(cc):
        pytest.skip("this CPU has no AVX512: the library is already this build (tests/test_quant_kernels.py)")
    out, src = tmp_path_factory.mktemp("no-avx512"), Path(cpu_kernels.__file__).parent
    # (not quant_matmul_q16_cpu.c: its plain loop has its own build in test_quant_kernels.py, and its
    # epilogue is the q8 file's, quant_rounded_cpu.h; one build fewer keeps this file fast)
    names = ("quant_matmul_cpu.c", "quant_matmul_q8_cpu.c")
    libs, errors = {}, {}
    for flags in (cpu_kernels.FLAGS, tuple(f for f in cpu_kernels.FLAGS if f != "-fopenmp")):  # (no OpenMP: once more)
        jobs = {n: subprocess.Popen([cc, *flags, "-mno-avx512f", str(src / n), "-lm", "-o", str(out / f"{n}.so")],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for n in names if n not in libs}
        for n, job in jobs.items():
            errors[n] = job.communicate(timeout=600)[1].decode(errors="replace")[-2000:]
            if job.returncode == 0:
                libs[n] = cpu_kernels._declare(ctypes.CDLL(str(out / f"{n}.so")), missing_ok=True)
    assert len(libs) == len(names), {n: errors[n] for n in names if n not in libs}
    return libs


def int8_model(x, w):
    """float64 model of the int8-activation products: x rounded per group to
    rint(float32(x * float32(127 / max|x|))), scale max|x| / 127 (0 below SQ_TINY_GROUP) against the
    weights' integers; the offsets against exact x."""
    gs = 32 if w.kind == "u4" else w.group
    g = x.view(x.shape[0], -1, gs)
    amax = g.abs().amax(-1, keepdim=True)
    keep = amax >= 2.0 ** -111
    inv = torch.where(keep, torch.full_like(amax, 127.0) / amax, 0)
    xq = (torch.round(g * inv).double() * torch.where(keep, amax / 127, 0).double()).view_as(x)
    offsets = replace(w, values=torch.zeros_like(w.values)).dequantize().double()  # q = 0: the offset
    return xq @ (w.dequantize().double() - offsets).T + x.double() @ offsets.T


def _inputs(k: int = 512):
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(3))
    x[4, 32:64] = 0  # an all-zero group
    x[2, 64:96] *= 1e-30  # a tiny group
    return x


def _relative(y, ref) -> float:
    return (y.double() - ref).abs().max().item() / ref.abs().max().item()


@pytest.mark.parametrize("name", FORMATS)
def test_float_products_without_avx512_match_float64(no_avx512, name):
    """quant_matmul_cpu.c's AVX2 branches (widening, float16 scales through F16C): the default
    products on a CPU without AVX512 (activations "auto" is "float" there)."""
    lib = no_avx512["quant_matmul_cpu.c"]
    w, x = random_weight(name, 83, 512), _inputs()  # 6 panels, the last partial
    for m in (1, 3, 9, 17):  # (passes of 8 rows, then 1)
        ref = x[:m].double() @ w.dequantize().double().T
        assert _relative(cpu_matmul(x[:m], w, lib=lib), ref) <= 1e-5, m
    full = cpu_matmul(x, w, invariant=True, lib=lib)
    assert _relative(full, x.double() @ w.dequantize().double().T) <= 1e-5
    for m in (1, 5, 9):
        assert torch.equal(cpu_matmul(x[:m], w, invariant=True, lib=lib), full[:m]), m


# The int8 products of i8-kind weights (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0), built without AVX512 (the plain C
# loop of group_dots_i8) by GCC 12.2 at -O3, were wrong in a pass of a single row (M = 1, or the last row
# of 9 or 17): errors of the order of the outputs themselves. The same loop was right built with
# -mno-avx512vnni (AVX512F kept), with -fno-tree-vectorize or at -O1, so quant_matmul_q8_cpu.c now turns
# the loop vectorizer off for its plain path (mutant: without that pragma, these five cases fail).
INT8_CASES = list(FORMATS)


@pytest.mark.parametrize("name", INT8_CASES)
def test_int8_products_without_avx512_match_their_model(no_avx512, name):
    """quant_matmul_q8_cpu.c's plain C loops (no VNNI) and the shared float epilogue's non-AVX512
    code (quant_rounded_cpu.h): as the float64 model says, a row's bits whatever the rows beside it."""
    lib = no_avx512["quant_matmul_q8_cpu.c"]
    w, x = random_weight(name, 83, 512), _inputs()
    full = cpu_matmul(x, w, lib=lib, activations="int8")
    for m in (1, 2, 9, 17):
        assert _relative(cpu_matmul(x[:m], w, lib=lib, activations="int8"), int8_model(x[:m], w)) <= 1e-5, m
        assert torch.equal(cpu_matmul(x[:m], w, lib=lib, activations="int8"), full[:m]), m


# --- cuda: the compiled attention kernel with a bidirectional prefix -----------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("flat", [False, True], ids=["grid", "block_table"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_bidirectional_prefix_compiled_cuda(dtype, flat):
    """Moondream's attention on the GPU (the triton backend): the interpreted kernel's cases
    (tests/test_attention_triton.py), compiled, against the float64 reference."""
    ta = pytest.importorskip("test_attention_triton")  # (needs triton: imported only here)
    for q_lens, kv_lens, prefixes in ta.BIDI_SEQS:
        q, k, v, meta, dev = ta._make(q_lens, kv_lens, 4, 2, 16, 8, 2, dtype, 41, device="cuda")
        bidi = torch.tensor(prefixes, dtype=dev["kv_lens"].dtype, device="cuda")
        blocks = None
        if flat:
            blocks = torch.tensor(ta.ab.query_blocks(q_lens, ta.ab.num_query_programs(q.shape[0] + 8, len(q_lens) + 1)),
                                  dtype=torch.int64, device="cuda")
        out = torch.full(q.shape, ta.SENTINEL, dtype=dtype, device="cuda")
        ta.at.paged_attention_triton(q, k, v, dev["query_start"], dev["kv_lens"], dev["page_table"], meta.page_size,
                                     max(q_lens), out, blocks=blocks, bidirectional_lens=bidi)
        atol, rtol = ta.TOL[dtype]
        torch.testing.assert_close(out.cpu().double(), ta._bidi_reference(q, k, v, meta, prefixes), atol=atol,
                                   rtol=rtol)
        assert (out[meta.query_start[-1]:] == ta.SENTINEL).all()
