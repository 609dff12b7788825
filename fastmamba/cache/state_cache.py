"""Slot pool for the per-layer conv and SSM states of a Mamba-2 model.

Every request holds one slot (an int32 row index) for its whole life; kernels read and write the
pools through those indices, so nothing is reallocated or copied while decoding.

    conv[l]  [S, E, W]     model dtype    (the W layout: the last W inputs of the conv)
    ssm[l]   [S, H, P, N]  fp32 (default), bf16 or fp16
"""
from __future__ import annotations

import torch

from fastmamba.models.config import Mamba2Config


class StateCache:
    def __init__(
        self,
        cfg: Mamba2Config,
        num_slots: int,
        *,
        device: torch.device | str,
        conv_dtype: torch.dtype = torch.bfloat16,
        ssm_dtype: torch.dtype = torch.float32,
    ):
        if ssm_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"StateCache: ssm_dtype must be float32, bfloat16 or float16, got {ssm_dtype}")
        if num_slots < 1:
            raise ValueError(f"StateCache: num_slots must be >= 1, got {num_slots}")
        self.cfg = cfg
        self.num_slots = num_slots
        self.conv = [torch.zeros(num_slots, cfg.conv_dim, cfg.d_conv, device=device, dtype=conv_dtype)
                     for _ in range(cfg.n_layer)]
        self.ssm = [torch.zeros(num_slots, cfg.nheads, cfg.headdim, cfg.d_state, device=device, dtype=ssm_dtype)
                    for _ in range(cfg.n_layer)]
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out 0, 1, 2, ...

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def alloc(self, n: int = 1) -> torch.Tensor:
        """Take ``n`` slots, zero their states, return them as an int32 tensor on the cache's device."""
        if n > len(self._free):
            raise RuntimeError(f"StateCache: {n} slots requested, {len(self._free)} of {self.num_slots} free")
        slots = [self._free.pop() for _ in range(n)]
        idx = torch.tensor(slots, dtype=torch.int32, device=self.conv[0].device)
        for conv, ssm in zip(self.conv, self.ssm):
            conv[idx.long()] = 0
            ssm[idx.long()] = 0
        return idx

    def free(self, slots: torch.Tensor | list[int]) -> None:
        values = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
        for s in values:
            if not 0 <= s < self.num_slots or s in self._free:
                raise ValueError(f"StateCache: slot {s} is not allocated")
            self._free.append(s)
