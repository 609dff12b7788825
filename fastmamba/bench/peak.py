"""Measured peaks: the bandwidth of a large device-to-device copy, the bf16 matmul rate, and the L2 size.

Every GB/s in a report is also shown as a percentage of the copy bandwidth, and every TFLOP/s as
a percentage of the matmul rate, both measured in the same run (STYLE.md section 6). A
spec-sheet figure is never used in their place.

    python -m fastmamba.bench.peak      # prints the GPU name, the copy bandwidth and the matmul rate
"""
from __future__ import annotations

import statistics
import time

import torch

GiB = 1 << 30
DEFAULT_L2_BYTES = 50 * (1 << 20)  # only used if torch cannot report it


def measure_copy_bandwidth(device: torch.device | str, nbytes: int = 2 * GiB) -> float:
    """GB/s (1e9 bytes/s) of ``dst.copy_(src)`` for an ``nbytes`` buffer, counting bytes read + written.

    CUDA: median of ``triton.testing.do_bench`` over a 2 GiB copy (far beyond any L2); the size is
    halved until both buffers fit. CPU: wall-clock median of a few 64 MiB copies (for orientation only).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return _cpu_copy_bandwidth(min(nbytes, 64 << 20))
    while True:
        try:
            ms = _cuda_copy_ms(device, nbytes)
            break
        except torch.cuda.OutOfMemoryError:
            if nbytes <= 256 << 20:
                raise
            nbytes //= 2
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _cuda_copy_ms(device: torch.device, nbytes: int) -> float:
    from triton.testing import do_bench

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    src.fill_(1)
    with torch.cuda.device(device):
        return do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")


def _cpu_copy_bandwidth(nbytes: int, reps: int = 5) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times) / 1e9


def measure_matmul_tflops(device: torch.device | str, n: int = 8192) -> float:
    """TFLOP/s (1e12 flop/s) of ``torch.matmul`` of two n x n matrices, 2*n**3 flops per call.

    CUDA: bf16, n = 8192, median of ``triton.testing.do_bench`` (the rate a bf16 tensor-core
    kernel can reach here, through cuBLAS). CPU: fp32, n = 512, wall-clock median of a few calls
    (for orientation only).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return _cpu_matmul_tflops(min(n, 512))
    ms = _cuda_matmul_ms(device, n)
    torch.cuda.empty_cache()
    return 2 * n**3 / (ms * 1e-3) / 1e12


def measure_fp8_matmul_tflops(device: torch.device | str, n: int = 8192) -> float | None:
    """TFLOP/s of ``torch._scaled_mm`` of two n x n e4m3 matrices (per-tensor scales, bf16 out),
    2*n**3 flops per call: the rate cuBLASLt's FP8 tensor-core GEMM reaches here. None where no FP8
    GEMM runs (a CPU, a GPU before compute capability 8.9, a torch without ``_scaled_mm``)."""
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return None
    try:
        a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt wants
        one = torch.ones((), device=device)
        ms = _cuda_median_ms(device, lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                                                               out_dtype=torch.bfloat16))
    except (RuntimeError, AttributeError):
        return None
    finally:
        torch.cuda.empty_cache()
    return 2 * n**3 / (ms * 1e-3) / 1e12


def _cuda_matmul_ms(device: torch.device, n: int) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return _cuda_median_ms(device, lambda: torch.matmul(a, b))


def _cuda_median_ms(device: torch.device, fn) -> float:
    """Median ms of ``fn()`` on ``device`` (``triton.testing.do_bench``: 50 ms warm-up, 300 ms timed)."""
    from triton.testing import do_bench

    with torch.cuda.device(device):
        return do_bench(fn, warmup=50, rep=300, return_mode="median")


def _cpu_matmul_tflops(n: int, reps: int = 5) -> float:
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    torch.matmul(a, b)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e12


def matmul_description(device: torch.device | str) -> str:
    return "bf16 8192^3 torch.matmul" if torch.device(device).type == "cuda" else "fp32 512^3 host matmul"


def l2_cache_bytes(device: torch.device | str) -> int:
    """L2 size in bytes from the device properties (0 on a CPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES)


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "CPU (no CUDA device)"


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gbps = measure_copy_bandwidth(device)
    l2 = l2_cache_bytes(device)
    tflops = measure_matmul_tflops(device)
    what = "2 GiB device-to-device copy" if device.type == "cuda" else "64 MiB host copy"
    print(f"{device_name(device)}: {gbps:.0f} GB/s ({what}, bytes read + written), L2 {l2 / (1 << 20):.1f} MiB, "
          f"matmul {tflops:.1f} TFLOP/s ({matmul_description(device)})")


if __name__ == "__main__":
    main()
