"""Seeds for stochastic rounding of 16-bit SSM states, kept on the device and advanced in place.

A 16-bit (fp16 / bf16) SSM state loses the low bits of every update when it is stored with round to
nearest; over many steps the error accumulates with a bias. Stochastic rounding (the ops'
``rand_seed``) rounds up or down with probabilities that make the stored value unbiased. The ops
draw one random number per stored element from (seed, slot, head, p, n), so the seed must change
every step (else the same numbers repeat) and should differ between layers (else every layer
rounds the same element the same way).

``StochasticRounding(n_layer, device, seed)`` holds ``seeds``, an int64 [n_layer] device tensor:
layer i of step k uses ``(seed << 32) + k * n_layer + i``. ``advance()`` adds n_layer in place
(one tiny kernel, no host sync): call it before every step that stores states (prefill, decode,
verify). The tensor keeps its address, so a CUDA graph captured with it reads the new seeds at
every replay. The model's ``prefill_varlen`` / ``decode`` / ``verify`` take it as ``rand_seed``.
"""
from __future__ import annotations

import torch

from fastmamba.models.inputs import check_rand_seed  # (re-exported: it lives with the models' other input checks)

__all__ = ["StochasticRounding", "check_rand_seed"]


class StochasticRounding:
    """Per-layer device seeds for the 16-bit state stores of one model (see the module docstring)."""

    def __init__(self, n_layer: int, device: torch.device | str, seed: int = 0):
        if not (isinstance(n_layer, int) and n_layer >= 1):
            raise ValueError(f"StochasticRounding: n_layer must be an int >= 1, got {n_layer!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
            raise ValueError(f"StochasticRounding: seed must be an int in [0, 2**31), got {seed!r}")
        self.n_layer = n_layer
        with torch.inference_mode(False):  # a plain tensor: advance() may run in or out of inference mode
            self.seeds = torch.arange(n_layer, dtype=torch.int64, device=device) + (seed << 32)

    def advance(self) -> None:
        """Move every layer's seed to the next step's, in place (graph-safe, no host sync)."""
        self.seeds.add_(self.n_layer)

    def reset(self, seed: int = 0) -> None:
        """Back to step 0 of ``seed``, in place."""
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
            raise ValueError(f"StochasticRounding.reset: seed must be an int in [0, 2**31), got {seed!r}")
        self.seeds.copy_(torch.arange(self.n_layer, dtype=torch.int64) + (seed << 32))
