"""Which verification path a speculative decoding step takes, from measured crossover batches.

``fastmamba bench spec`` times, per (shape, state dtype, T = K+1 tokens per step, batch), the
replay kernels against the per-position ("legacy") path with its copy, and prints and writes (JSON
record ``"record": "spec_choice"``) a ``crossover`` table per (shape, state dtype): T -> the
smallest batch at which replay beat legacy. That table is what ``choose_verify_path`` takes.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

VerifyPath = Literal["replay", "legacy", "plain"]

# tokens per step T -> smallest batch at which replay beats legacy (with its copy); None: it never
# did in the measured range. From `fastmamba bench spec` ("spec_crossover" JSON records), NVIDIA
# H100 80GB HBM3, Triton 3.6.0, 2026-11-22, commits 49359f8 (nemotron-h) and 90652e8
# (nemotron-h-tp8), bf16 activations: replay = op + commit, legacy = per-position states + the
# copy of the accepted one. Keyed by (heads, state dtype); bf16 state uses the fp16 entries.
MEASURED_TABLES: dict[tuple[int, str], dict[int, int | None]] = {
    # Nemotron-H, H128 P64 N128 G8: replay wins at every batch 1..256 and T 2..16
    # (batch 1: 12.9 vs 20.6 us at T=2, 13.5 vs 28.8 at T=6, fp32 state)
    (128, "fp32"): {2: 1, 4: 1, 6: 1, 8: 1, 16: 1},
    (128, "fp16"): {2: 1, 4: 1, 6: 1, 8: 1, 16: 1},
    # its TP=8 slice, H16 P64 N128 G1: legacy keeps batch 1 at T=2 with an fp32 state (11.1 vs 11.3 us)
    (16, "fp32"): {2: 8, 4: 1, 6: 1, 8: 1, 16: 1},
    (16, "fp16"): {2: 1, 4: 1, 6: 1, 8: 1, 16: 1},
}
DEFAULT_TABLE: dict[int, int | None] = MEASURED_TABLES[(128, "fp32")]


def default_table(nheads: int, state_dtype: str = "fp32") -> dict[int, int | None]:
    """The measured table for the nearest number of heads (ratio) with the state dtype ("fp32",
    "fp16" or "bf16"; bf16 uses fp16's, both move half of fp32's bytes).

    >>> default_table(16, "fp32")[2], default_table(80, "fp32")[2], default_table(12, "bf16")[2]
    (8, 1, 1)
    """
    state = "fp32" if state_dtype == "fp32" else "fp16"
    heads = min((h for h, d in MEASURED_TABLES if d == state), key=lambda h: abs(math.log(h / max(nheads, 1))))
    return MEASURED_TABLES[(heads, state)]


# Crossover for an empty table (see choose_verify_path).
PLACEHOLDER_CROSSOVER_BATCH = 8


def choose_verify_path(batch: int, tokens: int, table: Mapping[int | str, int | None] | None = None) -> VerifyPath:
    """The verification path for a step of ``batch`` requests verifying ``tokens`` (T = K+1) each.

    batch   requests in the step (>= 1)
    tokens  T: 1 means nothing was drafted -> "plain" (single-token decode)
    table   T -> crossover batch (replay from that batch up, legacy below; None: legacy at every
            batch), as ``fastmamba bench spec`` reports it (keys may be strings, as JSON has them);
            a T that is not in the table uses the nearest T that is (the larger on a tie).
            None: ``DEFAULT_TABLE``.

    An empty table ({}) means "replay" for batch >= 8 and "legacy" below (a conservative guess
    for a GPU that was not measured).

    >>> choose_verify_path(1, 6), choose_verify_path(8, 6), choose_verify_path(64, 1)
    ('replay', 'replay', 'plain')
    >>> choose_verify_path(1, 6, {}), choose_verify_path(8, 6, {})
    ('legacy', 'replay')
    >>> choose_verify_path(4, 6, {2: 16, 6: 4, 16: None}), choose_verify_path(4, 5, {2: 16, 6: 4, 16: None})
    ('replay', 'replay')
    """
    if batch < 1 or tokens < 1:
        raise ValueError(f"choose_verify_path: batch and tokens must be >= 1, got batch={batch}, tokens={tokens}")
    if tokens == 1:
        return "plain"
    table = DEFAULT_TABLE if table is None else table
    if not table:
        return "replay" if batch >= PLACEHOLDER_CROSSOVER_BATCH else "legacy"
    entries = {int(t): crossover for t, crossover in table.items()}
    nearest = min(entries, key=lambda t: (abs(t - tokens), -t))
    crossover = entries[nearest]
    return "replay" if crossover is not None and batch >= crossover else "legacy"


def expected_tokens_per_step(tokens: int, accept_rate: float) -> float:
    """Tokens a step of T = K+1 yields on average when each draft is accepted with probability
    ``accept_rate`` independently (the first rejection ends the run; the target's own token always
    counts): sum_{i=0..K} rate^i.

    >>> expected_tokens_per_step(1, 0.6), round(expected_tokens_per_step(3, 0.5), 3)
    (1.0, 1.75)
    """
    if not 0.0 <= accept_rate <= 1.0:
        raise ValueError(f"expected_tokens_per_step: accept_rate must lie in [0, 1], got {accept_rate}")
    return sum(accept_rate**i for i in range(tokens))
