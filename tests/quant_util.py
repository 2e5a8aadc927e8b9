"""Random GGUF blocks of every quantized format the loader keeps quantized (tests of quant_formats, the
CPU kernels and the Triton kernel)."""
import numpy as np

from slipstream.models.kernels.quant_formats import _BLOCK, QUANTIZED_TYPES, repack

FORMATS = sorted(QUANTIZED_TYPES)
# byte offsets of each block's float16 fields (scales, mins): random bytes elsewhere
_HALVES = {"Q4_0": (0,), "Q8_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2),
           "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """[rows, cols / per_block * block_bytes] bytes: random integers, finite small float16 scales."""
    per, nbytes = _BLOCK[name]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (rows, cols // per, nbytes), dtype=np.uint8)
    for at in _HALVES[name]:
        halves = (rng.standard_normal((rows, cols // per)) * 0.02).astype(np.float16)
        b[..., at:at + 2] = halves[..., None].view(np.uint8)
    return b.reshape(rows, -1)


def random_weight(name: str, rows: int, cols: int, seed: int = 0):
    return repack(name, random_blocks(name, rows, cols, seed), cols)
