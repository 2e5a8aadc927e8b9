"""Find the row padding that makes CPU matmul rows independent of how many rows there are.

BLAS picks different kernels (and reduction orders) for small row counts, so row i of
`x[:m] @ w.T` can differ in the last bit from row i of `x @ w.T`. The pipelined loop batches
differently from the blocking one, so without care their greedy tokens could differ after a
near-tie. Which counts are affected depends on the BLAS build and thread count (seen here:
m in {1,2,3,5,6,7,9,10,11} with 2 threads; {1,2,3} with 1), so it is measured at start-up
rather than assumed: the smallest multiple q such that every padded count agrees.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

CANDIDATES = (1, 2, 4, 8, 16)
LARGE = 64


@functools.lru_cache(maxsize=None)
def invariant_row_multiple(in_features: int, out_features: int, threads: int) -> int:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=g)
    x = torch.randn(LARGE, in_features, generator=g)
    ref = F.linear(x, w)
    for q in CANDIDATES:
        counts = list(range(q, 2 * LARGE // 3, q))
        if all(torch.equal(F.linear(x[:m], w), ref[:m]) for m in counts):
            return q
    return CANDIDATES[-1]


def row_multiple_for(config) -> int:
    """Largest requirement over the model's matmul shapes."""
    shapes = {(config.hidden_size, config.intermediate_size), (config.intermediate_size, config.hidden_size),
              (config.hidden_size, config.num_heads * config.head_dim), (config.hidden_size, config.vocab_size)}
    return max(invariant_row_multiple(i, o, torch.get_num_threads()) for i, o in shapes)
