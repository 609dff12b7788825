"""causal_conv1d_update, one token per request, width 4, SiLU (the decode conv of Mamba-2).

Conv dims of the two model shapes (E = D + 2*G*N: 5376 for mamba2-2.7b, 10240 for Nemotron-H),
bf16 activations and state, state_len W-1 (the usual cache) and W; the state cache has 2*B slots
(layout [S, D, state_len]) and the B requests use a random permutation of them (int32).
The state update is pure data movement, so the check compares it bit for bit.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from fastmamba.bench import bytes as byte_models
from fastmamba.bench import peers
from fastmamba.bench.ops._base import (
    DTYPE_NAMES,
    Case,
    OpBench,
    Provider,
    adapted_peer_provider,
    fastmamba_pdl_provider,
    fastmamba_provider,
    peer_provider,
    reference_provider,
)

GPU_DIMS = (5376, 10240)
CPU_DIMS = (64,)
WIDTH = 4
DTYPE = torch.bfloat16


class ConvUpdateBench(OpBench):
    key = "conv"
    title = "causal_conv1d_update"
    mutated = ("conv_state",)
    exact_state = True

    def cases(self, device: torch.device, batches: Sequence[int]) -> list[Case]:
        dims = GPU_DIMS if device.type == "cuda" else CPU_DIMS
        out = []
        for D in dims:
            for state_len in (WIDTH - 1, WIDTH):
                for B in batches:
                    nbytes = byte_models.conv_update_bytes(
                        B, D, WIDTH, state_len, state_dtype=DTYPE, act_dtype=DTYPE
                    )
                    out.append(
                        Case(
                            op=self.key,
                            shape=f"D{D}",
                            dims=f"W{WIDTH} state_len {state_len}",
                            dtype=f"{DTYPE_NAMES[DTYPE]}/{DTYPE_NAMES[DTYPE]}",
                            batch=B,
                            nbytes=nbytes,
                            params=dict(D=D, W=WIDTH, state_len=state_len, S=2 * B, dtype=DTYPE),
                            variant=f"sl{state_len}",
                        )
                    )
        return out

    def providers(self, device: torch.device) -> list[Provider]:
        return [
            fastmamba_provider("conv1d", "causal_conv1d_update"),
            fastmamba_pdl_provider("conv1d", "causal_conv1d_update", device),
            peer_provider(peers.causal_conv1d_update(), device, "a CUDA extension has no CPU path"),
            adapted_peer_provider(peers.vllm_causal_conv1d_update(), device, vllm_adapter, cpu_reason=VLLM_CPU,
                                  note="out allocated per call, as ours (without it vLLM overwrites x)"),
            reference_provider("conv1d", "causal_conv1d_update_ref"),
        ]

    def skip_reason(self, prov: Provider, case: Case) -> str:
        if prov.name == "vLLM" and case.params["state_len"] != case.params["W"] - 1:
            return "state_len W-1 only (a longer state is its speculative-decoding layout, read from other columns)"
        return ""

    def make_set(self, case: Case, device: torch.device, seed: int) -> dict:
        p = case.params
        B, D, W, L, S, dtype = case.batch, p["D"], p["W"], p["state_len"], p["S"], p["dtype"]
        g = torch.Generator(device=device).manual_seed(seed)
        cpu_g = torch.Generator().manual_seed(seed)

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

        return {
            "x": randn(B, D),
            "conv_state": randn(S, D, L),
            "weight": randn(D, W, scale=0.5),
            "bias": randn(D, scale=0.1),
            "idx": torch.randperm(S, generator=cpu_g)[:B].to(device=device, dtype=torch.int32),
        }

    def args(self, case: Case, inp: dict) -> tuple:
        # causal_conv1d_update(x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices)
        i = inp
        return (i["x"], i["conv_state"], i["weight"], i["bias"], "silu", None, i["idx"])


# the CPU cases are bf16, which its kernel gets wrong under Triton 3.6's interpreter (fp32 matches
# the reference there: tests/bench/test_vllm_peers_cpu.py)
VLLM_CPU = "its bf16 path computes garbage under Triton 3.6's interpreter (the CPU cases are bf16)"


def vllm_adapter(fn):
    """vLLM's causal_conv1d_update with our positional signature (no cache_seqlens: the bench passes
    None), ``out`` allocated here as our op allocates it, padding marked by ``null_block_id``."""

    def call(x, conv_state, weight, bias, activation, cache_seqlens, idx):
        if cache_seqlens is not None:
            raise NotImplementedError("vLLM's causal_conv1d_update has no circular-buffer mode")
        out = torch.empty_like(x)
        fn(x, conv_state, weight, bias, activation, idx, null_block_id=-1, out=out)
        return out

    return call


BENCH = ConvUpdateBench()
