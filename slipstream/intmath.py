"""Integer helpers used across layers (pages per token count, padded sizes)."""
from __future__ import annotations


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for integers, b > 0."""
    return -(-a // b)


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= n."""
    return ceil_div(n, multiple) * multiple
