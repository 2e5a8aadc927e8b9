"""Kernel launches of one decode step of the model's triton backend, counted on the CPU.

    python tools/profile/count_launches.py [--model random-smollm2-135m] [--batch 1] [--context 16] [--variants ...]

Runs one decode step (every sequence --context tokens deep, random KV) of the model forward on the
triton backend with its kernels in Triton's interpreter, and counts what a GPU would launch
(tools/common/launch_counter.py): the model's own kernels, not the runner's staging ops
around it (tools/gpu/profile_forward_cuda.py counts those too, on a GPU). Prints the first layer's
launches in order and the totals per variant of slipstream/models/llama/forward_triton.py TritonOptions.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tools", "common")]  # this checkout, the shared helpers

import torch  # noqa: E402

from slipstream.models.kernels.attention import DeviceAttentionMetadata  # noqa: E402
from slipstream.models.llama.build import RANDOM, random_weights  # noqa: E402
from host_batch import Chunk, host_batch  # noqa: E402
from launch_counter import count_launches  # noqa: E402
from slipstream.models.base import KVCache  # noqa: E402
from slipstream.models.llama.model import LlamaForCausalLM  # noqa: E402
from slipstream.models.llama.forward_triton import TritonOptions  # noqa: E402

VARIANTS = {
    "fused-decode": TritonOptions(fused_decode_max_rows=16),  # the 5-launch layer up to 16 rows
    "fused-decode-256": TritonOptions(fused_decode_max_rows=256),  # where does it stop paying?
    "fused": TritonOptions(),  # the default: the 8-launch layer at every batch
    "no-mlp-gemm": TritonOptions(mlp_gemm_max_rows=0, fused_decode_max_rows=0),
    "unfused": TritonOptions(fuse_projections=False, mlp_gemm_max_rows=0, fused_decode_max_rows=0),
}


def decode_step(config, batch_size: int, context: int, page_size: int = 16):
    pages_each = -(-(context + 1) // page_size)
    chunks = [Chunk([3 + s], context, list(range(1 + s * pages_each, 1 + (s + 1) * pages_each)))
              for s in range(batch_size)]
    batch, _ = host_batch(chunks, page_size)
    m = batch.attn
    m.on_device = DeviceAttentionMetadata(torch.tensor(m.query_start), torch.tensor(m.kv_lens),
                                          torch.tensor(m.page_tables), 1)
    kv = KVCache(config, 1 + batch_size * pages_each, page_size, torch.bfloat16, "cpu")
    kv.k.normal_()
    kv.v.normal_()
    return batch, kv


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random-smollm2-135m", choices=sorted(RANDOM))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=16)
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=sorted(VARIANTS))
    args = ap.parse_args(argv)
    from slipstream.provenance import header, provenance

    print(header(provenance()))
    config = RANDOM[args.model]()
    weights = random_weights(config)
    print(f"{args.model}: {config.num_layers} layers, bfloat16, one decode step of batch {args.batch} "
          f"at context {args.context}, kernels interpreted on the CPU\n")
    print("| variant | launches per step (model) | per layer | outside the layers | seconds |")
    print("|---|---:|---:|---:|---:|")
    first_layers = {}
    for name in args.variants:
        model = LlamaForCausalLM.from_weights(config, weights, torch.bfloat16, "cpu")
        model.set_kernel_backend("triton", VARIANTS[name])
        batch, kv = decode_step(config, args.batch, args.context)
        t0 = time.perf_counter()
        with count_launches() as counter, torch.no_grad():
            model(batch, kv)
        seconds = time.perf_counter() - t0
        launches = counter.launches
        # the layers are identical: the per-layer count is what is left after the launches outside them
        # (embedding first; final norm, lm_head and the float cast last), divided by the layer count
        outside = 1 + 3
        per_layer, rest = divmod(len(launches) - outside, config.num_layers)
        first_layers[name] = launches[1:1 + per_layer]
        print(f"| {name} | {len(launches)} | {per_layer}{'' if rest == 0 else f' (+{rest})'} | {outside} | "
              f"{seconds:.1f} |", flush=True)
    for name, layer in first_layers.items():
        print(f"\n{name}, one layer: {' → '.join(layer)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
