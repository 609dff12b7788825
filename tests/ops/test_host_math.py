"""The host-side cdiv / next_power_of_2 give Triton's results (they replace Triton's constexpr
functions in launch configs, where each call costs microseconds)."""
from __future__ import annotations

import triton

from fastmamba.ops._common.host_math import cdiv, next_power_of_2


def test_same_results_as_triton():
    values = list(range(0, 4200)) + [2**k + d for k in range(12, 40) for d in (-1, 0, 1)]
    for n in values:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    for a in list(range(-40, 300)) + [2**31 - 1, 2**31, 10**12 + 7]:
        for b in (1, 2, 3, 7, 16, 64, 100, 256):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
