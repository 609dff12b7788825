"""selective_state_update, one token per request (the decode step of every Mamba-2 layer).

Inputs as a Mamba-2 layer passes them (and as PEERS.md measured): dt_softplus with dt_bias, the
z gate, D; dt a stride-0 broadcast of [B, H] over P; A, D and dt_bias stride-0 broadcasts of fp32
[H] vectors; a state cache of 2*B slots whose B used rows are a random permutation (int32).
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
    adapted_peer_provider,
    fastmamba_pdl_provider,
    fastmamba_provider,
    peer_provider,
    reference_provider,
)

# name -> (H, P, N, G)
GPU_SHAPES = {
    "mamba2-2.7b": (80, 64, 128, 1),
    "nemotron-h": (128, 64, 128, 8),
}
CPU_SHAPES = {"tiny": (2, 16, 16, 1)}
STATE_DTYPES = (torch.float32, torch.bfloat16)
ACT_DTYPE = torch.bfloat16


class StateUpdateBench(OpBench):
    key = "ssu"
    title = "selective_state_update"
    mutated = ("state",)

    def cases(self, device: torch.device, batches: Sequence[int]) -> list[Case]:
        shapes = GPU_SHAPES if device.type == "cuda" else CPU_SHAPES
        out = []
        for shape, (H, P, N, G) in shapes.items():
            for state_dtype in STATE_DTYPES:
                for B in batches:
                    nbytes = byte_models.ssu_bytes(B, H, P, N, G, state_dtype=state_dtype, act_dtype=ACT_DTYPE)
                    out.append(
                        Case(
                            op=self.key,
                            shape=shape,
                            dims=f"H{H} P{P} N{N} G{G}",
                            dtype=f"{DTYPE_NAMES[state_dtype]}/{DTYPE_NAMES[ACT_DTYPE]}",
                            batch=B,
                            nbytes=nbytes,
                            params=dict(H=H, P=P, N=N, G=G, S=2 * B, state_dtype=state_dtype, act_dtype=ACT_DTYPE),
                        )
                    )
        return out

    def providers(self, device: torch.device) -> list[Provider]:
        return [
            fastmamba_provider("state_update", "selective_state_update"),
            fastmamba_pdl_provider("state_update", "selective_state_update", device),
            peer_provider(peers.mamba_ssm_selective_state_update(), device, MAMBA_SSM_CPU),
            adapted_peer_provider(peers.vllm_selective_state_update(), device, vllm_adapter,
                                  note="out allocated per call, as ours; null_block_id = our pad id -1"),
            reference_provider("state_update", "selective_state_update_ref"),
        ]

    def make_set(self, case: Case, device: torch.device, seed: int) -> dict:
        p = case.params
        B, H, P, N, G, S = case.batch, p["H"], p["P"], p["N"], p["G"], p["S"]
        act = p["act_dtype"]
        g = torch.Generator(device=device).manual_seed(seed)
        cpu_g = torch.Generator().manual_seed(seed)

        def randn(*shape, dtype=torch.float32, scale=1.0):
            return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * scale).to(dtype)

        dt0 = torch.rand(H, generator=g, device=device) * (0.1 - 0.001) + 0.001  # softplus(dt_bias) in [1e-3, 1e-1]
        dt_bias_h = dt0 + torch.log(-torch.expm1(-dt0))  # inverse softplus, as Mamba-2 initialises it
        A_h = -torch.exp(torch.rand(H, generator=g, device=device))
        D_h = randn(H)
        return {
            "state": randn(S, H, P, N, dtype=p["state_dtype"], scale=0.5),
            "x": randn(B, H, P, dtype=act),
            "dt": randn(B, H, dtype=act, scale=0.5).unsqueeze(-1).expand(B, H, P),
            "A": A_h[:, None, None].expand(H, P, N),
            "B": randn(B, G, N, dtype=act, scale=0.25),
            "C": randn(B, G, N, dtype=act, scale=0.25),
            "D": D_h[:, None].expand(H, P),
            "z": randn(B, H, P, dtype=act),
            "dt_bias": dt_bias_h[:, None].expand(H, P),
            "idx": torch.randperm(S, generator=cpu_g)[:B].to(device=device, dtype=torch.int32),
        }

    def args(self, case: Case, inp: dict) -> tuple:
        # selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices)
        i = inp
        return (i["state"], i["x"], i["dt"], i["A"], i["B"], i["C"], i["D"], i["z"], i["dt_bias"], True, i["idx"])


def vllm_adapter(fn):
    """vLLM's selective_state_update with our positional signature: D before dt_bias before z,
    ``out`` required (allocated here, as our op allocates it), padding marked by ``null_block_id``."""

    def call(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, idx):
        out = torch.empty_like(x)
        fn(state, x, dt, A, B, C, D, dt_bias, z, dt_softplus, idx, null_block_id=-1, out=out)
        return out

    return call


BENCH = StateUpdateBench()
