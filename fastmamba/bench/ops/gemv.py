"""``gemv``: the decode-time projections (a linear layer on a few rows), beside cuBLAS.

The GPU cases are the projections a decode step of each preset runs through ``gemv``: the Mamba
in_proj and out_proj, and for the hybrids the fused Q/K/V and o_proj of an attention layer; bf16.
Bytes: the weight, x and y. ``tune --ops gemv`` sweeps the launch configs (at one row: a config
never depends on the row count, ``fastmamba.ops.gemv.configs``) into the (family, dtype, N, K) table.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from fastmamba.bench.ops._base import (
    DTYPE_NAMES,
    Case,
    OpBench,
    Provider,
    fastmamba_pdl_provider,
    fastmamba_provider,
    reference_provider,
)

GPU_PRESETS = ("nemotron-3-nano", "nemotron-h-8b", "mamba2-2.7b")
CPU_SHAPES = {"tiny in_proj": (96, 40), "tiny out_proj": (40, 72)}


def projection_shapes(preset: str) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of the decode projections of a preset that run through ``gemv``."""
    from fastmamba.models.config import PRESETS as MAMBA2
    from fastmamba.models.nemotron_h import PRESETS as HYBRID

    if preset in MAMBA2:
        c = MAMBA2[preset]
        d_inner = c.expand * c.d_model
        heads = d_inner // c.headdim
        return {"in_proj": (2 * d_inner + 2 * c.ngroups * c.d_state + heads, c.d_model),
                "out_proj": (c.d_model, d_inner)}
    c = HYBRID[preset]
    d_inner = c.mamba_nheads * c.mamba_headdim
    shapes = {"in_proj": (2 * d_inner + 2 * c.n_groups * c.d_state + c.mamba_nheads, c.d_model),
              "out_proj": (c.d_model, d_inner)}
    if "*" in c.pattern:
        shapes["qkv"] = ((c.n_heads + 2 * c.n_kv_heads) * c.head_dim, c.d_model)
        shapes["o_proj"] = (c.d_model, c.n_heads * c.head_dim)
    return shapes


def _cublas(x, weight):
    return F.linear(x, weight)


class GemvBench(OpBench):
    key = "gemv"
    title = "gemv"

    def cases(self, device: torch.device, batches: Sequence[int]) -> list[Case]:
        cuda = device.type == "cuda"
        dtype = torch.bfloat16 if cuda else torch.float16
        if cuda:
            shapes = {f"{p} {name}": nk for p in GPU_PRESETS for name, nk in projection_shapes(p).items()}
        else:
            shapes = dict(CPU_SHAPES)
        seen, out = set(), []
        for shape, (N, K) in shapes.items():
            if (N, K) in seen:  # o_proj is out_proj's shape in Nemotron-3 Nano
                continue
            seen.add((N, K))
            size = torch.tensor([], dtype=dtype).element_size()
            for M in batches:
                if M > 16:
                    continue
                out.append(Case(op=self.key, shape=shape, dims=f"N{N} K{K}", dtype=DTYPE_NAMES[dtype], batch=M,
                                nbytes=(N * K + M * K + M * N) * size, flops=2 * M * N * K,
                                params=dict(N=N, K=K, dtype=dtype, device=str(device))))
        return out

    def tune_cases(self, device: torch.device, batches: Sequence[int]) -> list[Case]:
        """One row per shape (a config holds for every row count)."""
        return self.cases(device, [1])

    def tune_table_key(self, configs: object, case: Case) -> tuple:
        p = case.params
        return configs.table_key(torch.device(p["device"]), p["dtype"], p["N"], p["K"])

    def providers(self, device: torch.device) -> list[Provider]:
        cublas = Provider("cuBLAS", "peer", f"torch {torch.__version__}", _cublas if device.type == "cuda" else None,
                          reason="" if device.type == "cuda" else "a GPU library")
        # fastmamba.ops.gemv is the op's package (its function has the same name): named by its module
        return [
            fastmamba_provider("gemv", "gemv", module="api"),
            fastmamba_pdl_provider("gemv", "gemv", device, module="api"),
            cublas,
            reference_provider("gemv", "gemv_ref"),
        ]

    def make_set(self, case: Case, device: torch.device, seed: int) -> dict:
        p = case.params
        g = torch.Generator(device=device).manual_seed(seed)
        return {"x": torch.randn(case.batch, p["K"], generator=g, device=device).to(p["dtype"]),
                "weight": (torch.randn(p["N"], p["K"], generator=g, device=device) / p["K"] ** 0.5).to(p["dtype"])}

    def args(self, case: Case, inp: dict) -> tuple:
        return (inp["x"], inp["weight"])


BENCH = GemvBench()
