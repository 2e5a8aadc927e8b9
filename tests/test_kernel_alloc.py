"""The compiled CPU kernels without memory (issue 48, item 8): every scratch allocation is checked
(kernel_alloc_cpu.h), a kernel that cannot have its scratch returns SQ_ENOMEM, the binding raises
MemoryError, and the next call computes as before. sq_fail_allocs(n) fails the n-th allocation, so
each test takes every allocation of a call in turn; a scan of the sources keeps any allocation from
bypassing the check."""
import re
from pathlib import Path

import pytest
import torch
from quant_util import random_weight

from slipstream.models.kernels import cpu_kernels
from slipstream.models.kernels.quant_linear import cpu_matmul

lib = cpu_kernels.native_kernels()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler: the compiled CPU kernels are unavailable")
KERNELS = Path(cpu_kernels.__file__).parent


def each_allocation_failing(call):
    """call() with its 1st, 2nd, ... allocation failing, each a MemoryError, until a run that makes
    no more allocations than that: (the allocations it makes, its result)."""
    n = 1
    try:
        while True:
            lib.sq_fail_allocs(n)
            try:
                out = call()
            except MemoryError:
                n += 1
                continue
            return n - 1, out
    finally:
        lib.sq_fail_allocs(0)


# (format, activations, allocations of one call): float products allocate only the offsets' sums
@pytest.mark.parametrize("name,mode,allocs", [("Q4_1", "float", 1), ("Q5_1", "float", 1), ("Q8_0", "float", 0),
                                              ("Q4_1", "int8", 2), ("Q6_K", "int8", 2), ("Q4_0", "int16", 2),
                                              ("Q6_K", "int16", 2)])
def test_quantized_products_raise_memory_error(name, mode, allocs):
    w = random_weight(name, 40, 256)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    expected = cpu_matmul(x, w, lib=lib, activations=mode)
    made, y = each_allocation_failing(lambda: cpu_matmul(x, w, lib=lib, activations=mode))
    assert made == allocs
    assert torch.equal(y, expected)
    if mode == "float":
        made, y = each_allocation_failing(lambda: cpu_matmul(x, w, invariant=True, lib=lib))
        assert made == allocs and torch.equal(y, cpu_matmul(x, w, invariant=True, lib=lib))


def test_attention_raises_memory_error():
    g = torch.Generator().manual_seed(2)
    hq, hk, d, ps = 4, 2, 32, 4
    q = torch.randn(6, hq * d, generator=g)
    k, v = torch.randn(40, hk, d, generator=g), torch.randn(40, hk, d, generator=g)
    qs, lens, table = torch.tensor([0, 5, 6]), torch.tensor([8, 21]), torch.tensor([[5, 2, 0, 0, 0, 0],
                                                                                    [1, 7, 3, 9, 4, 6]])

    def attend():
        out = torch.zeros(6, hq * d)
        cpu_kernels.check_rc(lib.sq_attention(q.data_ptr(), hq * d, k.data_ptr(), v.data_ptr(), qs.data_ptr(),
                                              lens.data_ptr(), table.data_ptr(), 6, ps, 2, hq, hk, d, d ** -0.5, 0,
                                              out.data_ptr()), "shape")
        return out

    expected = attend()
    made, out = each_allocation_failing(attend)
    assert made >= 2  # the work items' table, then each thread's scratch
    assert torch.equal(out, expected)


def quantized_model(name: str, activations: str):
    """tiny_config with every projection quantized (`name`) on the cpu backend: the one-call stack."""
    from slipstream.models.config import tiny_config
    from slipstream.models.llama.build import random_weights
    from slipstream.models.llama.model import LlamaForCausalLM

    cfg = tiny_config()
    weights = random_weights(cfg, seed=3)
    for key, t in list(weights.items()):
        if key.endswith("_proj.weight"):
            weights[key] = random_weight(name, t.shape[0], t.shape[1], seed=len(key))
    model = LlamaForCausalLM.from_quantized(cfg, weights, torch.float32, "cpu")
    model.set_kernel_backend("cpu")
    model.set_activations(activations)
    return model, cfg


@pytest.mark.parametrize("name,mode,per_layer", [("Q4_1", "float", 4 + 2), ("Q4_0", "int8", 4 * 2 + 2)])
def test_decoder_forward_raises_memory_error(name, mode, per_layer):
    """sq_decoder_forward (llama_forward_cpu.c): its own buffers, then each layer's products and
    attention; a failure anywhere ends the call with MemoryError, none is swallowed (the count)."""
    from host_batch import Chunk, host_batch

    from slipstream.models.base import KVCache
    from slipstream.models.llama import forward_cpu

    model, cfg = quantized_model(name, mode)
    kv = KVCache(cfg, 8, 4, torch.float32, "cpu")

    def step():
        batch, _ = host_batch([Chunk([5, 9, 77, 3, 101], 0, [1, 2]), Chunk([8], 0, [3])], 4)
        return model(batch, kv)

    expected = step()
    assert forward_cpu.decoder_layers(model)  # (the one-call stack runs)
    made, logits = each_allocation_failing(step)
    assert made >= 6 + cfg.num_layers * per_layer
    assert torch.equal(logits, expected)


ALLOCATORS = re.compile(r"\b(malloc|calloc|realloc|aligned_alloc|posix_memalign|strdup|alloca)\s*\(")
CHECKED = r"(!\s*{v}\b|\b{v}\s*(&&|\|\||\?|==\s*NULL|!=\s*NULL)|if\s*\(\s*{v}\s*\))"


@pytest.mark.parametrize("path", sorted(p for p in [*KERNELS.glob("*.c"), *KERNELS.glob("*.h")]
                                         if p.name != "kernel_alloc_cpu.h"), ids=lambda p: p.name)
def test_every_allocation_is_checked(path):
    """Static: the kernel sources allocate only through sq_malloc / sq_calloc, and every pointer they
    return is tested before use (crude: the variable is tested somewhere after the allocation)."""
    text = re.sub(r"/\*.*?\*/", "", path.read_text(), flags=re.S)  # (comments may say "malloc")
    assert not ALLOCATORS.findall(text), f"{path.name}: allocate with sq_malloc / sq_calloc (kernel_alloc_cpu.h)"
    for m in re.finditer(r"(\w+)\s*=\s*(\([^()]*\)\s*)?sq_(malloc|calloc)\(", text):
        rest = text[m.end():]
        assert re.search(CHECKED.format(v=re.escape(m.group(1))), rest), \
            f"{path.name}: {m.group(1)} = sq_{m.group(3)}(...) is never tested for NULL"
