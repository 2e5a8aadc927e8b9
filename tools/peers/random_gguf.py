"""Write slipstream's random-weight model (e.g. `random-smollm2-135m`, seed 0) as a llama.cpp GGUF.

    python tools/peers/random_gguf.py --spec random-smollm2-135m --dtype f16 --out /tmp/smollm2-random-f16.gguf
    (--dtype q4_1: projections Q4_1, embedding Q8_0, as the default model's GGUF)

The same weights slipstream and tools/peers/peer_bench.py's transformers twin run (slipstream.models.llama.build.
random_weights), renamed to GGUF's llama names, q/k rows permuted to llama.cpp's rotary layout (the
inverse of slipstream's `unpermute_qk`), norms kept in float32 as llama.cpp's converter does. No
real tokenizer travels: by default a synthetic SentencePiece-style vocabulary (pieces "t3", "t4",
…; <s> = 1, </s> = 2) so that llama-server can turn ids into text; `--vocab none` writes
`tokenizer.ggml.model = "none"` (dummy tokens: llama-batched-bench runs, llama-server aborts).
Both tools feed token ids, never text.

The Llama-3.2 shapes (`--spec random-llama-3.2-1b`, `-3b`) are drawn as the engine draws them: on
`--device` (default: CUDA when there is one) in bfloat16 (float32 for `--dtype f32`), so a bf16 GGUF
written on the GPU machine holds the bits a `--dtype bfloat16` engine there runs; their llama3 RoPE
scaling travels as the `rope_freqs` tensor (per-frequency divisors), as llama.cpp's converter writes it.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

_TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(_TOOLS)))  # this checkout's slipstream

from slipstream.models.config import ON_DEVICE_INIT  # noqa: E402
from slipstream.models.llama.build import RANDOM, random_model_weights  # noqa: E402
from slipstream.models.loading.gguf_loader import _GLOBAL_NAMES, _LAYER_NAMES  # noqa: E402

FILE_TYPES = {"f32": 0, "f16": 1, "bf16": 32, "q4_1": 3}  # llama_ftype: ALL_F32, MOSTLY_F16, MOSTLY_BF16, MOSTLY_Q4_1


def permute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF rows (two contiguous halves per head) → llama.cpp's interleaved pairs; inverse of unpermute_qk."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    for g, h in _GLOBAL_NAMES.items():
        if h == hf:
            return g
    parts = hf.split(".")  # model.layers.{i}.{self_attn|mlp|...}.{proj}.weight
    layer, rest = parts[2], ".".join(parts[3:-1])
    for g, h in _LAYER_NAMES.items():
        if h == rest:
            return f"blk.{layer}.{g}.weight"
    raise KeyError(f"no GGUF name for {hf}")


def default_device(spec: str) -> str:
    return "cuda" if spec in ON_DEVICE_INIT and torch.cuda.is_available() else "cpu"


def write(spec: str, dtype: str, out: str, seed: int = 0, vocab: str = "synthetic", device: str | None = None) -> dict:
    import gguf

    config = RANDOM[spec]()
    draw = torch.float32 if dtype == "f32" else torch.bfloat16  # (only ON_DEVICE_INIT specs draw in a dtype)
    weights = random_model_weights(spec, config, seed, draw, device or default_device(spec))
    w = gguf.GGUFWriter(out, "llama")
    w.add_name(f"{spec} (random weights, seed {seed})")
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_dimension_count(config.head_dim)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)
    w.add_file_type(FILE_TYPES[dtype])
    if vocab == "none":
        w.add_tokenizer_model("none")  # dummy tokens: enough for llama-batched-bench, not for llama-server
    else:  # a synthetic SentencePiece-style vocabulary: ids have pieces, so llama-server can detokenize
        w.add_tokenizer_model("llama")
        w.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(3, config.vocab_size)])
        w.add_token_scores([0.0] * config.vocab_size)
        w.add_token_types([2, 3, 3] + [1] * (config.vocab_size - 3))  # unknown, control, control, normal
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    qtype = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
             "bf16": gguf.GGMLQuantizationType.BF16, "q4_1": gguf.GGMLQuantizationType.Q4_1}[dtype]
    for hf, t in weights.items():
        if hf == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: llama.cpp reuses token_embd
        if ".q_proj." in hf:
            t = permute_qk(t, config.num_heads)
        elif ".k_proj." in hf:
            t = permute_qk(t, config.num_kv_heads)
        t = t.cpu()
        if qtype == gguf.GGMLQuantizationType.BF16 and t.ndim > 1:  # torch's rounding, bits as they are
            w.add_tensor(gguf_name(hf), t.to(torch.bfloat16).contiguous().view(torch.int16).numpy(),
                         raw_dtype=qtype)
            continue
        data = t.float().contiguous().numpy()
        # q4_1: the mix of the default model's file (SmolLM2-135M-Instruct.Q4_1.gguf): Q8_0 embedding
        if qtype == gguf.GGMLQuantizationType.Q4_1 and hf in ("model.embed_tokens.weight", "lm_head.weight"):
            w.add_tensor(gguf_name(hf), gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name(hf), data.astype(np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gguf_name(hf), data.astype(np.float16))
        else:
            w.add_tensor(gguf_name(hf), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    if config.rope_freq_factors is not None:  # llama3 scaling: llama.cpp divides each frequency by its entry
        w.add_tensor("rope_freqs.weight", np.array(config.rope_freq_factors, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"spec": spec, "dtype": dtype, "seed": seed, "vocab": vocab, "device": device or default_device(spec),
            "path": out, "bytes": os.path.getsize(out)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="random-smollm2-135m", choices=sorted(RANDOM))
    ap.add_argument("--dtype", default="f16", choices=sorted(FILE_TYPES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", default="synthetic", choices=["synthetic", "none"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default=None, help="where ON_DEVICE_INIT specs are drawn (default: cuda if any)")
    args = ap.parse_args(argv)
    print(write(args.spec, args.dtype, args.out, args.seed, args.vocab, args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
