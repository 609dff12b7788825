"""A/B of the Hopper states kernel (ops/ssd_scan/hopper_states.py) inside the whole chunked scan
(development aid; needs an sm_90 GPU):

    python scripts/dev_hopper_states_ab.py [--rounds 2]

For the 2.7b and Nemotron-H shapes at L 2048 and 8192, fp32 and bf16 chunk states (bf16 x, D, z,
initial states, final states returned), each call captured in a CUDA graph inside ``hopper_kernels()``
and timed (``triton.testing.do_bench``, hot L2) with ``FASTMAMBA_HOPPER_STATES=0`` (the two Triton
kernels) and ``1``, alternating per round; then the relative difference of the outputs and final
states of the two paths (0 where they are bit-identical).

H200, 2026-11-27 (commit 04edd28), µs per call, two rounds, off -> on: 2.7b L=2048 69.6 / 70.0 -> 65.4 /
66.6 (fp32 chunk states), 67.0 / 67.1 -> 65.9 / 65.9 (bf16); L=8192 228.3 / 227.4 -> 203.4 / 202.8, 214.8 /
214.2 -> 203.3 / 202.4; Nemotron-H L=2048 108.2 / 108.0 -> 90.0 / 89.8, 102.2 / 102.0 -> 89.1 / 88.7;
L=8192 376.3 / 376.0 -> 296.9 / 306.5, 358.2 / 353.2 -> 298.3 / 298.5. Outputs bit-identical in every
case, final states too with fp32 chunk states (1.7e-3 apart with bf16 ones: the Triton path rounds
each chunk's state to bf16, the walk does not).
"""
from __future__ import annotations

import argparse
import os

import torch
import triton

from fastmamba.ops.ssd_scan import hopper, mamba_chunk_scan_combined

SHAPES = {"mamba2-2.7b": (80, 64, 128, 1), "nemotron-h": (128, 64, 128, 8)}  # H, P, N, G


def _case(H, P, N, G, L, state_dtype):
    g = torch.Generator(device="cuda").manual_seed(L + H)
    r = lambda *s, dt=torch.bfloat16: (torch.randn(*s, device="cuda", generator=g) * 0.5).to(dt)  # noqa: E731
    x, z, B, C = r(1, L, H, P), r(1, L, H, P), r(1, L, G, N), r(1, L, G, N)
    dt, D, bias = r(1, L, H, dt=torch.float32), r(H, dt=torch.float32), r(H, dt=torch.float32)
    A = -torch.rand(H, device="cuda", generator=g) - 0.5
    init = (torch.randn(1, H, P, N, device="cuda", generator=g) * 0.1).to(state_dtype)
    return lambda: mamba_chunk_scan_combined(x, dt, A, B, C, 256, D=D, z=z, dt_bias=bias, dt_softplus=True,
                                             initial_states=init, return_final_states=True, state_dtype=state_dtype)


def _time(fn, flag: str):
    """(µs per call from a CUDA graph, the call's outputs) with FASTMAMBA_HOPPER_STATES=flag."""
    os.environ["FASTMAMBA_HOPPER_STATES"] = flag
    with hopper.hopper_kernels():
        result = fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    return triton.testing.do_bench(graph.replay, warmup=30, rep=200) * 1e3, result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        ap.error("needs an sm_90 GPU")
    print("| shape | L | chunk states | off µs | on µs | out rel. diff | final rel. diff |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for name, (H, P, N, G) in SHAPES.items():
        for L in (2048, 8192):
            for sd in (torch.float32, torch.bfloat16):
                fn = _case(H, P, N, G, L, sd)
                times = {"0": [], "1": []}
                results = {}
                for _ in range(args.rounds):
                    for flag in ("0", "1"):
                        us, results[flag] = _time(fn, flag)
                        times[flag].append(us)
                rel = [((a.float() - b.float()).norm() / b.float().norm()).item()
                       for a, b in zip(results["1"], results["0"])]
                fmt = lambda v: " / ".join(f"{t:.1f}" for t in v)  # noqa: E731
                print(f"| {name} | {L} | {str(sd)[6:]} | {fmt(times['0'])} | {fmt(times['1'])} | {rel[0]:.1e} | "
                      f"{rel[1]:.1e} |", flush=True)


if __name__ == "__main__":
    main()
