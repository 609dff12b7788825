"""The SSD scan's chunk-output stage alone: the portable Triton kernel (`_chunk_scan_kernel`) against the
Hopper kernel (ops/ssd_scan/hopper_kernel.py) on the same intermediates, and the whole scan with each
(2.7b shape, B=1, bf16, one CUDA graph, hot L2). Needs an sm_90 GPU.

    python scripts/dev_chunk_output_gluon.py [--lengths 2048,8192]

This script began as the "measure first" experiment of issue 19 item 5, with its own Gluon kernel and
switches (ring depths, programs per SM, register caps, data path only, ...); that kernel became
hopper_kernel.py and the experiment's versions and numbers are in docs/experiments.md. The kernel's
sm_90 compile is tested on the CPU (tests/ops/ssd_scan/test_hopper_kernel_compile.py).

H200, 2026-11-27: L=2048 61.0-62.2 -> 46.8-47.1 us, L=8192 220.8-223.6 -> 178.4-180.3 us; with the
producer-built weights (878e931) 41.7-42.3 / 162.8-163.4 us.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch


def capture_launches(kernels: dict, run) -> tuple[dict, object]:
    """Call ``run()`` with the scan's launcher spied on, to replay kernels on the same intermediates.
    ``kernels``: name -> Triton kernel. Returns (name -> dict(grid, args, kwargs, launcher) of that
    kernel's last launch, what ``run()`` returned)."""
    from fastmamba.ops.ssd_scan import launch as launch_mod

    names = {kernel: name for name, kernel in kernels.items()}
    captured = {}
    real_lean = launch_mod.lean

    def spy(kernel):
        launcher = real_lean(kernel)
        name = names.get(kernel)
        if name is None:
            return launcher

        class _Grid:
            def __getitem__(self, grid):
                def call(*args, **kwargs):
                    captured[name] = dict(grid=grid, args=args, kwargs=kwargs, launcher=launcher)
                    return launcher[grid](*args, **kwargs)
                return call
        return _Grid()

    launch_mod.lean = spy
    try:
        result = run()
    finally:
        launch_mod.lean = real_lean
    return captured, result


def _capture_chunk_scan(L: int, H=80, P=64, G=1, N=128):
    """Run our scan once and keep the chunk-scan kernel's launch (its intermediates included)."""
    from fastmamba.ops.ssd_scan import mamba_chunk_scan_combined
    from fastmamba.ops.ssd_scan.kernel import _chunk_scan_kernel

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=dev, generator=g)
    x = r(1, L, H, P).bfloat16()
    dt = r(1, L, H) * 0.5
    A = -(torch.rand(H, device=dev) + 0.5)
    B = (r(1, L, G, N) * 0.5).bfloat16()
    C = (r(1, L, G, N) * 0.5).bfloat16()
    D = r(H)
    z = r(1, L, H, P).bfloat16()
    bias = r(H) * 0.3
    def scan():
        return mamba_chunk_scan_combined(x, dt, A, B, C, 256, D=D, z=z, dt_bias=bias, dt_softplus=True)

    captured, _ = capture_launches({"scan": _chunk_scan_kernel}, scan)
    return captured["scan"], scan


def _reference(x, z, cb, C, D, states_in, dt_s, cs_s, Q: int) -> torch.Tensor:
    """The stage in fp32 from the same intermediates (dense, one group): [T, H, P]."""
    _, T, H, P = x.shape
    nc = T // Q
    xs = x[0].float().view(nc, Q, H, P).permute(0, 2, 1, 3)  # [nc, H, Q, P]
    zs = z[0].float().view(nc, Q, H, P).permute(0, 2, 1, 3)
    Cc = C[0, :, 0].float().view(nc, 1, Q, -1)  # [nc, 1, Q, N]
    S = states_in[:nc].float()  # [nc, H, P, N]
    cs = cs_s[:, :nc].permute(1, 0, 2)  # [nc, H, Q]
    dt = dt_s[:, :nc].permute(1, 0, 2)
    CB = cb[:nc, 0, :Q, :Q].float().unsqueeze(1)  # [nc, 1, Q, Q]
    causal = torch.ones(Q, Q, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp((cs[..., :, None] - cs[..., None, :]).masked_fill(~causal, float("-inf")))
    # CB's tiles above the diagonal were never written (the scan's buffer is torch.empty): select them away
    weights = torch.where(causal, CB * decay * dt[..., None, :], 0.0)
    y = torch.exp(cs)[..., None] * (Cc @ S.transpose(-1, -2)) + weights @ xs
    y = (y + D.float()[None, :, None, None] * xs) * torch.nn.functional.silu(zs)
    return y.permute(0, 2, 1, 3).reshape(T, H, P)


def graph_time(fn, reps=20, runs=15) -> float:
    """Median µs per call of ``fn`` replayed in a CUDA graph of ``reps`` calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps)
    return statistics.median(times)


def _lengths(text: str) -> list[int]:
    """--lengths: comma-separated sequence lengths, each a positive multiple of the 256-token chunk."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or any(v < 256 or v % 256 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive multiples of 256 (the chunk), got {text!r}")
    return values


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=_lengths, default=[2048, 8192])
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        ap.error("needs an sm_90 GPU (TMA and wgmma)")
    from fastmamba.ops.ssd_scan.hopper import chunk_output_sm90

    print(f"{torch.cuda.get_device_name()}: chunk-output stage and whole scan, µs (median of CUDA-graph replays)")
    print("| L | Triton stage | Hopper stage | Triton scan | Hopper scan | stage error vs fp32: Triton / Hopper |")
    print("|---|---:|---:|---:|---:|---|")
    for L in args.lengths:
        os.environ["FASTMAMBA_HOPPER_SCAN"] = "0"  # the Triton kernel runs, so its launch can be captured
        cap, scan = _capture_chunk_scan(L)
        whole = {"0": graph_time(scan)}
        os.environ["FASTMAMBA_HOPPER_SCAN"] = "1"
        whole["1"] = graph_time(scan)
        a = cap["args"]
        x, z, out, cb, C, D, table, skip, states_in, dt_s, cs_s = a[:11]
        triton_stage = lambda: cap["launcher"][cap["grid"]](*a, **cap["kwargs"])
        got = torch.full_like(out, float("nan"))
        hopper_stage = lambda: chunk_output_sm90(x, z, got, cb, C, D, table, skip, states_in, dt_s, cs_s, None, None,
                                                 n_seg=a[13], chunk_size=256)
        triton_stage()
        hopper_stage()
        torch.cuda.synchronize()
        exact = _reference(x, z, cb, C, D, states_in, dt_s, cs_s, 256)
        err = lambda t: ((t[0].float() - exact).abs().max() / exact.abs().max()).item()
        print(f"| {L} | {graph_time(triton_stage):.1f} | {graph_time(hopper_stage):.1f} | {whole['0']:.1f} | "
              f"{whole['1']:.1f} | {err(out):.2e} / {err(got):.2e} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
