"""Integer helpers for launch configs on the host.

Triton 3.6 makes ``triton.cdiv`` and ``triton.next_power_of_2`` constexpr functions: every host call
unwraps its arguments through Triton's constexpr machinery, ~1-2 µs each on a fast CPU (a
chunked-scan launch made 13 such calls). These are the same functions in plain Python, with
Triton's results for every int they are given here (``tests/ops/test_host_math.py``).
"""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, as ``triton.cdiv``: (a + b - 1) // b."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), 0 for n = 0, as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
