"""Running a model on the triton backend from host_batch chunks, for tests/test_fused_model.py and
tests/test_kernel_launches.py."""
import torch

from slipstream.models.kernels.attention import DeviceAttentionMetadata
from slipstream.models.llama.build import random_weights
from host_batch import Chunk, host_batch
from slipstream.models.base import KVCache
from slipstream.models.llama.model import LlamaForCausalLM
from slipstream.models.llama.forward_triton import TritonOptions


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


# The fused decode layer for steps of <= 16 rows (all of two_steps'); the default and LAYERWISE: the 8-launch layer
FUSED_DECODE = TritonOptions(fused_decode_max_rows=16)
LAYERWISE = TritonOptions(fused_decode_max_rows=0)
UNFUSED = TritonOptions(fuse_projections=False)
NO_MLP_GEMM = TritonOptions(mlp_gemm_max_rows=0, fused_decode_max_rows=0)  # gate-up on cuBLAS, then SiLU·up


def build(cfg, dtype, backend, options=None, device="cpu", seed=0):
    model = LlamaForCausalLM.from_weights(cfg, random_weights(cfg, seed), dtype, device)
    if options is None:
        model.set_kernel_backend(backend)  # as the engine calls it (slipstream/api/assemble.py)
    else:
        model.set_kernel_backend(backend, options)
    return model
