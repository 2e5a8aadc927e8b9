"""Compile the triton backend's fused kernels for a GPU architecture without a GPU, and report
registers, spills (stack) and shared memory per kernel and launch configuration.

    python tools/gpu/kernel_resources.py [--arch 90] [--model random-smollm2-135m | all] [--dtype bfloat16 ...]

Triton's wheel bundles ptxas and cuobjdump, so the whole path (Triton → PTX → cubin) runs on a CPU
machine: a kernel that does not compile, spills registers or asks for too much shared memory shows
here before a GPU is lent. Shapes are a model's (hidden size, heads, head dim, intermediate
size: SHAPES, real configurations of SmolLM2, Llama-3 and Qwen2, and one at head dim 256); the
gate-up GEMM is compiled at each of its row tiles (launch_config for 1, 32 and 256 rows). The
argument types are those the runtime passes (tests/test_kernel_runtime_dtypes.py records them at
the real call sites): every floating tensor, the rotary cos/sin tables included, in the model's
dtype, index tensors int64. tests/test_kernels_compile.py compiles these cases with the GPU
image's triton. Says nothing about speed.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import subprocess
import sys
import tempfile

_sys_path = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _sys_path)  # this checkout

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from slipstream.models.kernels import (add_norm_triton, attention_triton, decode_fused_triton,  # noqa: E402
                                       gate_up_silu_triton, gemv_splitk_triton, rotary_kv_triton, silu_mul_triton)
from slipstream.models.llama.build import RANDOM  # noqa: E402

SHARED_LIMIT = 227 * 1024  # the most shared memory one block may use on sm_90 (H100/H200)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}
TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _shape(name, hidden, intermediate, heads, kv_heads, head_dim, architecture="llama"):
    """Only what the kernels' shapes depend on is real; the rest is SmolLM2's."""
    return lambda: dataclasses.replace(RANDOM["random-smollm2-135m"](), name=name, hidden_size=hidden,
                                       intermediate_size=intermediate, num_heads=heads, num_kv_heads=kv_heads,
                                       head_dim=head_dim, architecture=architecture,
                                       attention_bias=architecture == "qwen2")


# from each model's config.json (hidden, intermediate, heads, kv heads, head dim)
SHAPES = {
    "random-smollm2-135m": RANDOM["random-smollm2-135m"],  # head dim 64, GQA 3
    "llama-3-8b": _shape("llama-3-8b", 4096, 14336, 32, 8, 128),  # head dim 128, GQA 4
    "qwen2-0.5b": _shape("qwen2-0.5b", 896, 4864, 14, 2, 64, "qwen2"),  # head dim 64, GQA 7
    "qwen2-7b": _shape("qwen2-7b", 3584, 18944, 28, 4, 128, "qwen2"),  # head dim 128, GQA 7
    # no Llama or Qwen2 model has it, but the attention kernel has a branch for it (BLOCK_N 32)
    "head-dim-256": _shape("head-dim-256", 3072, 24576, 16, 8, 256),
}


# issue 50's benchmark shapes, by --model name only: not in `all`, whose every case the suite compiles in three
# dtypes (these add ~96 compilations, minutes on the CPU machine); their bf16 cases compiled with triton 3.6.0
# for sm_90, 29 of 29 each without a spill, on 2026-12-02 (docs/benchmarks.md, "Llama-3.2 shapes")
BENCH_SHAPES = {
    "random-llama-3.2-1b": RANDOM["random-llama-3.2-1b"],  # head dim 64, GQA 4
    "random-llama-3.2-3b": RANDOM["random-llama-3.2-3b"],  # head dim 128, GQA 3
}


def compile_kernel(fn, signature: dict, constexprs: dict, arch: int, **options):
    full = dict(signature)
    full.update({name: "constexpr" for name in constexprs})
    return triton.compile(ASTSource(triton.jit(fn), full, constexprs), target=GPUTarget("cuda", arch, 32),
                          options=options)


def resource_usage(compiled) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    fields = dict(part.split(":", 1) for line in out.splitlines() if "REG:" in line for part in line.split())
    return f"{fields.get('REG', '?')} | {fields.get('STACK', '?')} | {compiled.metadata.shared}"


def cases(cfg, dtype):
    p, i32 = PTR[dtype], "i32"
    norm_sig = dict(X=p, R=p, W=p, Y=p, ROWS="*i64", stride_x=i32, stride_r=i32, stride_y=i32, n_cols=i32, eps="fp32")
    block = triton.next_power_of_2(cfg.hidden_size)
    # the fused decode layer's final norm has nothing to add: (False, True)
    for has_x, has_rows in ((True, False), (False, False), (True, True), (False, True)):
        sig = dict(norm_sig, ROWS="*i64" if has_rows else p)  # without rows the caller passes the residual
        yield (add_norm_triton._add_rms_norm_kernel, sig, dict(HAS_X=has_x, HAS_ROWS=has_rows, BLOCK=block),
               dict(num_warps=4 if block <= 2048 else 8))
    strides = ("stride_qt stride_qh stride_kt stride_kh stride_vt stride_vh stride_kct stride_kch stride_vct "
               "stride_vch stride_c").split()
    rot_sig = dict(Q=p, K=p, V=p, KC=p, VC=p, POS="*i64", KV_INDICES="*i64", COS=p, SIN=p, **{s: i32 for s in strides})
    half = cfg.head_dim // 2
    yield (rotary_kv_triton._rotary_kv_kernel, rot_sig,
           dict(HEADS=cfg.num_heads, KV_HEADS=cfg.num_kv_heads, HALF=half, BLOCK=triton.next_power_of_2(half)),
           dict(num_warps=1))
    silu_sig = dict(G=p, U=p, Y=p, stride_g=i32, stride_u=i32, stride_y=i32, n_cols=i32)
    yield (silu_mul_triton._silu_mul_kernel, silu_sig,
           dict(BLOCK=min(silu_mul_triton.BLOCK, triton.next_power_of_2(cfg.intermediate_size))), dict(num_warps=4))
    attn_strides = "stride_qt stride_qh stride_kt stride_kh stride_vt stride_vh stride_ot stride_oh stride_pt stride_bt"
    group = cfg.num_heads // cfg.num_kv_heads
    consts = dict(HEAD_DIM=cfg.head_dim, GROUP=group, DOT_DTYPE=TL[dtype],
                  PRECISION="ieee" if dtype == torch.float32 else None, MIN_SPLIT=attention_triton.MIN_SPLIT)
    # prefill chunks on the sequence grid, the block-table grid of mixed graphs, the sequence grid
    # with a bidirectional prefix (Moondream's image steps), decode, decode split over the keys
    # (the split workspace is fp32; unsplit launches pass `out` in its place); prefill and split decode
    # windowed too (sliding-window layers)
    for flat, bidi, decode, split, windowed in ((False, False, False, False, False), (True, False, False, False, False),
                                                (False, True, False, False, False), (False, False, True, False, False),
                                                (False, False, True, True, False), (False, False, False, False, True),
                                                (False, False, True, True, True)):
        work = "*fp32" if split else p
        attn_sig = dict(Q=p, K=p, V=p, O=p, QS="*i64", KVL="*i64", PT="*i64", BT="*i64", BL="*i64", WA=work,
                        WML=work, **{s: i32 for s in attn_strides.split()}, qk_scale="fp32", page_size=i32,
                        num_splits=i32, window=i32)
        t = attention_triton.tiles(group, cfg.head_dim, dtype, decode)
        yield (attention_triton._grouped_attention_kernel, attn_sig,
               dict(consts, **{k: v for k, v in t.items() if k != "num_warps"}, FLAT=flat, BIDI=bidi, SPLIT=split,
                    WINDOWED=windowed),
               dict(num_warps=t["num_warps"]))
    t = attention_triton.tiles(group, cfg.head_dim, dtype, True)
    merge_sig = dict(O=p, QS="*i64", KVL="*i64", WA="*fp32", WML="*fp32", stride_ot=i32, stride_oh=i32,
                     num_splits=i32)
    yield (attention_triton._merge_splits_kernel, merge_sig,
           dict(HEAD_DIM=cfg.head_dim, BLOCK_D=t["BLOCK_D"], BLOCK_N=t["BLOCK_N"], MIN_SPLIT=attention_triton.MIN_SPLIT,
                BLOCK_S=attention_triton.MAX_SPLITS),
           dict(num_warps=attention_triton.merge_warps(attention_triton.MAX_SPLITS, t["BLOCK_D"])))
    gemm_sig = dict(X=p, W=p, Y=p, M=i32, N=i32, K=i32, stride_xm=i32, stride_wn=i32, stride_ym=i32)
    for rows in (1, 32, 256):
        launch = gate_up_silu_triton.launch_config(rows, cfg.hidden_size, dtype)
        tiles = {k: v for k, v in launch.items() if k.startswith("BLOCK")}
        yield (gate_up_silu_triton._gate_up_silu_kernel, gemm_sig,
               dict(DOT_DTYPE=TL[dtype], PRECISION="ieee" if dtype == torch.float32 else None, **tiles),
               {k: v for k, v in launch.items() if not k.startswith("BLOCK")})
    yield from decode_cases(cfg, dtype)
    yield from gemv_cases(cfg, dtype)


def gemv_cases(cfg, dtype):
    """The split-K GEMV (gemv_splitk_triton.py) at 1 and 8 rows over K = hidden, whole (one launch) and in
    4 slices (fp32 partials), and the ordered reduction of 4 slices."""
    p, i32 = PTR[dtype], "i32"
    for rows in (1, 8):
        for split in (1, 4):  # unsplit, the output is passed in the partials' place
            sig = dict(X=p, W=p, Y=p, P="*fp32" if split > 1 else p, M=i32, N=i32, K=i32, k_per_split=i32,
                       stride_xm=i32, stride_wn=i32, stride_ym=i32)
            launch = gemv_splitk_triton.gemv_launch(rows, cfg.hidden_size, 8, split)
            yield (gemv_splitk_triton._gemv_splitk_kernel, sig,
                   dict(PARTIAL=split > 1, **{k: v for k, v in launch.items() if k.startswith("BLOCK")}),
                   {k: v for k, v in launch.items() if k.startswith("num_")})
    yield (gemv_splitk_triton._splitk_reduce_kernel, dict(P="*fp32", Y=p, M=i32, N=i32, stride_ym=i32),
           dict(SPLIT=4, BLOCK=gemv_splitk_triton.REDUCE_BLOCK), dict(num_warps=4))


def decode_cases(cfg, dtype):
    """The fused small-batch decode layer (decode_fused_triton.py): QKV with and without bias (Qwen2),
    the GEMV with the residual epilogue (o_proj, down) and with the norm prologue + SiLU·up."""
    p, i32 = PTR[dtype], "i32"
    dot = dict(DOT_DTYPE=TL[dtype], PRECISION="ieee" if dtype == torch.float32 else None)
    strides = "stride_xm stride_wn stride_qt stride_qh stride_kct stride_kch stride_vct stride_vch stride_c".split()
    qkv_sig = dict(X=p, NW=p, W=p, B=p, Q=p, KC=p, VC=p, POS="*i64", KV_INDICES="*i64", COS=p, SIN=p, M=i32,
                   K=i32, eps="fp32", **{s: i32 for s in strides})
    lin_sig = dict(X=p, NW=p, W=p, Y=p, M=i32, N=i32, K=i32, eps="fp32", stride_xm=i32, stride_wn=i32,
                   stride_ym=i32)
    # the GEMV path at 1 and 16 rows (its smallest and largest row tile), tl.dot above 16
    for rows in (1, decode_fused_triton.GEMV_MAX_ROWS, decode_fused_triton.GEMV_MAX_ROWS + 1):
        launch = decode_fused_triton.qkv_launch(cfg.hidden_size, dtype, rows)
        for bias in (False, True):
            yield (decode_fused_triton._norm_qkv_rotary_kernel, qkv_sig,
                   dict(HEADS=cfg.num_heads, KV_HEADS=cfg.num_kv_heads, HEAD_DIM=cfg.head_dim,
                        HALF=cfg.head_dim // 2, HAS_BIAS=bias, **dot, **_constexprs(launch)),
                   _options(launch))
        # o_proj (K = heads x head dim), down (K = intermediate), gate-up (K = hidden)
        for k, n, gate_up in ((cfg.num_heads * cfg.head_dim, cfg.hidden_size, False),
                              (cfg.intermediate_size, cfg.hidden_size, False),
                              (cfg.hidden_size, cfg.intermediate_size, True)):
            launch = decode_fused_triton.linear_launch(k, n, dtype, gate_up, rows)
            yield (decode_fused_triton._decode_linear_kernel, lin_sig,
                   dict(NORM=gate_up, GATE_UP=gate_up, RESIDUAL=not gate_up, **dot, **_constexprs(launch)),
                   _options(launch))


def _constexprs(launch: dict) -> dict:
    return {k: v for k, v in launch.items() if not k.startswith("num_")}


def _options(launch: dict) -> dict:
    return {k: v for k, v in launch.items() if k.startswith("num_")}


def unique_cases(shapes, dtypes) -> list[tuple[str, torch.dtype, tuple]]:
    """(shape name, dtype, case) for each distinct compilation of cases() over shapes × dtypes
    (a kernel whose constexprs and launch are the same for two shapes compiles once)."""
    seen, out = set(), []
    for dtype in dtypes:
        for name in shapes:
            for case in cases({**SHAPES, **BENCH_SHAPES}[name](), dtype):
                fn, sig, consts, options = case
                key = (fn, tuple(sig.items()), repr(sorted(consts.items())), tuple(sorted(options.items())))
                if key not in seen:
                    seen.add(key)
                    out.append((name, dtype, case))
    return out


def switches(case) -> tuple:
    """A case's branch-selecting constexprs (flags, dtypes, None): what decides which code compiles."""
    return tuple((n, repr(v)) for n, v in sorted(case[2].items()) if isinstance(v, bool) or not isinstance(v, int))


def tile(case) -> int:
    """How big a case's tiles are: shared memory and registers grow with it."""
    sizes = [v for n, v in case[2].items() if isinstance(v, int) and not isinstance(v, bool)
             and n.startswith(("BLOCK", "Q_BLOCK", "QB", "HEAD_DIM"))]
    return math.prod(sizes) * case[3].get("num_stages", 1) * case[3].get("num_warps", 1)


def cover_cases(shapes, dtypes) -> list[tuple[str, torch.dtype, tuple]]:
    """The cases of unique_cases that cover every (kernel, dtype, switches): per combination the one
    with the largest tiles. A type error is decided by the dtype and the branches taken, a shared
    memory or register limit by the largest tile, so this set fails wherever the whole set would
    fail for those two reasons (the whole set, without --cover, takes ~4x longer)."""
    best: dict[tuple, tuple[str, torch.dtype, tuple]] = {}
    for name, dtype, case in unique_cases(shapes, dtypes):
        key = (case[0], dtype, switches(case))
        if key not in best or tile(case) > tile(best[key][2]):
            best[key] = (name, dtype, case)
    return list(best.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (H100/H200)")
    ap.add_argument("--model", default="random-smollm2-135m", choices=[*SHAPES, *BENCH_SHAPES, "all"],
                    help="whose shapes (all: every one of SHAPES, each distinct compilation once)")
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"], choices=list(DTYPES))
    ap.add_argument("--no-usage", action="store_true", help="compile only (no cuobjdump)")
    ap.add_argument("--cover", action="store_true",
                    help="only the cases that cover each kernel x dtype x branch at its largest tiles")
    args = ap.parse_args(argv)
    from slipstream.provenance import header, provenance

    shapes = list(SHAPES) if args.model == "all" else [args.model]
    print(header(provenance()))
    print(f"sm_{args.arch}, triton {triton.__version__}, shapes of {', '.join(shapes)}\n")
    print("| kernel | shapes of | dtype | constexprs | launch | registers | stack (spill) bytes | shared bytes |")
    print("|---|---|---|---|---|---:|---:|---:|")
    failed = 0
    todo = (cover_cases if args.cover else unique_cases)(shapes, [DTYPES[d] for d in args.dtype])
    for name, dtype, (fn, sig, consts, options) in todo:
        shown = {k: v for k, v in consts.items() if k not in ("DOT_DTYPE", "PRECISION")}
        try:
            compiled = compile_kernel(fn, sig, consts, args.arch, **options)
            if not compiled.asm["cubin"] or compiled.metadata.shared > SHARED_LIMIT:
                raise RuntimeError(f"no cubin, or {compiled.metadata.shared} bytes of shared memory")
            usage = f"? | ? | {compiled.metadata.shared}" if args.no_usage else resource_usage(compiled)
        except Exception as e:  # noqa: BLE001 - list every case that fails, then fail
            failed += 1
            usage = f"FAILED: {str(e).strip().splitlines()[0] if str(e).strip() else repr(e)} | | "
        print(f"| `{fn.__name__}` | {name} | {str(dtype)[6:]} | {shown} | {options} | {usage} |", flush=True)
    print(f"\n{len(todo) - failed} of {len(todo)} compiled for sm_{args.arch} with triton {triton.__version__}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
