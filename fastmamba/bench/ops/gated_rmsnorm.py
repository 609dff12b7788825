"""Gated RMSNorm (``rmsnorm_fn`` with z), the last op of a Mamba-2 mixer before out_proj.

M rows (one per decoded token) of the model's d_ssm, normalised per group of d_ssm / G, with
norm_before_gate=False as Mamba-2 and Nemotron-H call it (y = rmsnorm(x * silu(z)) * weight),
eps 1e-5, no bias.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from fastmamba.bench import bytes as byte_models
from fastmamba.bench import peers
from fastmamba.bench.ops._base import (
    DTYPE_NAMES,
    MAMBA_SSM_CPU,
    Case,
    OpBench,
    Provider,
    fastmamba_pdl_provider,
    fastmamba_provider,
    peer_provider,
    reference_provider,
)

# name -> (Dh, G)
GPU_SHAPES = {"nemotron-h": (8192, 8), "mamba2-2.7b": (5120, 1)}
CPU_SHAPES = {"tiny": (64, 2)}
DTYPE = torch.bfloat16
EPS = 1e-5
NORM_BEFORE_GATE = False


class GatedRMSNormBench(OpBench):
    key = "norm"
    title = "rmsnorm_fn"

    def cases(self, device: torch.device, batches: Sequence[int]) -> list[Case]:
        shapes = GPU_SHAPES if device.type == "cuda" else CPU_SHAPES
        out = []
        for shape, (Dh, G) in shapes.items():
            for M in batches:
                out.append(
                    Case(
                        op=self.key,
                        shape=shape,
                        dims=f"Dh{Dh} group {Dh // G}",
                        dtype=DTYPE_NAMES[DTYPE],
                        batch=M,
                        nbytes=byte_models.norm_bytes(M, Dh, act_dtype=DTYPE, has_z=True),
                        params=dict(Dh=Dh, G=G, group_size=Dh // G, dtype=DTYPE),
                    )
                )
        return out

    def providers(self, device: torch.device) -> list[Provider]:
        return [
            fastmamba_provider("gated_rmsnorm", "rmsnorm_fn"),
            fastmamba_pdl_provider("gated_rmsnorm", "rmsnorm_fn", device),
            peer_provider(peers.mamba_ssm_rmsnorm_fn(), device, MAMBA_SSM_CPU),
            reference_provider("gated_rmsnorm", "rmsnorm_ref"),
        ]

    def make_set(self, case: Case, device: torch.device, seed: int) -> dict:
        p = case.params
        M, Dh, dtype = case.batch, p["Dh"], p["dtype"]
        g = torch.Generator(device=device).manual_seed(seed)
        return {
            "x": torch.randn(M, Dh, generator=g, device=device).to(dtype),
            "z": torch.randn(M, Dh, generator=g, device=device).to(dtype),
            "weight": (1.0 + 0.1 * torch.randn(Dh, generator=g, device=device)).to(dtype),
        }

    def args(self, case: Case, inp: dict) -> tuple:
        # rmsnorm_fn(x, weight, bias, z, eps, group_size, norm_before_gate)
        return (inp["x"], inp["weight"], None, inp["z"], EPS, case.params["group_size"], NORM_BEFORE_GATE)


BENCH = GatedRMSNormBench()
