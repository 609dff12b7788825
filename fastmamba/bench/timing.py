"""Timing: CUDA-graph replays over rotating input sets (cold L2), eager launches, CPU wall-clock.

Decode kernels run for a few microseconds, less than a launch costs from Python, so the default
mode captures many calls in one CUDA graph and times ``graph.replay`` with
``triton.testing.do_bench`` (which also flushes L2 between replays). The calls inside one graph
cycle over ``n_sets`` independent copies of the inputs, sized so that together they exceed a few
times the L2 cache: each call then reads its operands from DRAM, as a real decode step does.

Providers that cannot be captured (a reference that syncs with the host, say) are timed eagerly,
launch overhead included, and the row says so. Without CUDA the same callables are timed with a
wall clock: under the Triton interpreter that checks the plumbing, it says nothing about speed.
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from fastmamba.ops.runtime import graph_capture, hopper_kernels

Call = Callable[[], object]
MakeCall = Callable[[int], Call]


class Timing(NamedTuple):
    """Per-call microseconds (median and the 20th/80th percentiles of the timed replays)."""

    median_us: float
    p20_us: float
    p80_us: float
    mode: str  # "graph", "eager" or "cpu"
    calls: int  # calls per timed replay (or per timed loop)
    n_sets: int  # distinct input sets the calls rotate over
    note: str = ""


@dataclass(frozen=True)
class TimingConfig:
    """How long to time. ``rep_ms`` is stretched to reach ``min_reps`` replays, up to ``max_rep_ms``."""

    warmup_ms: float = 50.0
    rep_ms: float = 200.0
    min_reps: int = 100
    max_rep_ms: float = 2000.0
    min_calls: int = 16  # calls captured per graph (the sets are repeated to reach it)
    cpu_reps: int = 5
    host_calls: int = 200  # back-to-back calls per pass of time_host (few enough not to fill the launch queue)

    @classmethod
    def quick(cls) -> "TimingConfig":
        return cls(warmup_ms=10.0, rep_ms=50.0, min_reps=20, max_rep_ms=400.0, cpu_reps=3)

    @classmethod
    def prefill(cls) -> "TimingConfig":
        """Prefill calls run for 10 us to a few ms: a handful per graph already hides the launch
        (and each one's output lives in the graph's pool), and 20 replays of the long ones are plenty."""
        return cls(warmup_ms=25.0, rep_ms=100.0, min_reps=20, max_rep_ms=500.0, min_calls=4, cpu_reps=3,
                   host_calls=20)

    @classmethod
    def prefill_quick(cls) -> "TimingConfig":
        return cls(warmup_ms=10.0, rep_ms=40.0, min_reps=10, max_rep_ms=200.0, min_calls=2, cpu_reps=1,
                   host_calls=20)


QUANTILES = [0.2, 0.5, 0.8]


def choose_n_sets(bytes_per_set: int, l2_bytes: int, *, cap: int = 64) -> int:
    """Input copies needed for a cold-L2 number: clamp(ceil(3 * L2 / bytes_per_set), 2, cap).

    At least two, so that consecutive calls in a graph never touch the same state: under
    programmatic dependent launch a call may read its cache rows while the previous call is
    still finishing (fastmamba.ops._common.pdl), which is only allowed on different rows.
    """
    if l2_bytes <= 0 or bytes_per_set <= 0:
        return 2
    return max(2, min(cap, math.ceil(3 * l2_bytes / bytes_per_set)))


def is_cold_l2(bytes_per_set: int, n_sets: int, l2_bytes: int, calls: int) -> bool:
    """Whether each timed call finds its operands outside L2.

    True when the rotation covers at least 3x L2 (earlier sets are evicted by the time they come
    round again), or when every set is used once per replay (do_bench flushes L2 between replays).
    """
    return n_sets * bytes_per_set >= 3 * l2_bytes or calls <= n_sets


def _sequence(make_call: MakeCall, n_sets: int, min_calls: int) -> list[Call]:
    calls = [make_call(i) for i in range(n_sets)]
    repeat = max(1, math.ceil(min_calls / n_sets))
    return calls * repeat


def _rep_ms(config: TimingConfig, estimate_ms: float) -> float:
    want = max(config.rep_ms, config.min_reps * estimate_ms)
    return min(want, max(config.max_rep_ms, 5 * estimate_ms))


def _estimate_ms(fn: Call, n: int = 3) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return max(start.elapsed_time(end) / n, 1e-3)


def _do_bench(fn: Call, config: TimingConfig) -> tuple[float, float, float]:
    from triton.testing import do_bench

    rep = _rep_ms(config, _estimate_ms(fn))
    p20, p50, p80 = do_bench(fn, warmup=config.warmup_ms, rep=rep, quantiles=QUANTILES)
    return p20, p50, p80


class GraphCaptureError(RuntimeError):
    """The provider's calls could not be captured in a CUDA graph (the cause is chained)."""


def time_graph(make_call: MakeCall, n_sets: int, config: TimingConfig = TimingConfig()) -> Timing:
    """Per-call µs of ``make_call(i)()`` for i in range(n_sets), timed as CUDA-graph replays.

    The graph holds every set's call, repeated until it has at least ``config.min_calls`` calls.
    Warm-up (which also compiles Triton kernels) runs on a side stream before capture, as
    ``torch.cuda.graphs`` requires. Raises GraphCaptureError if capture fails.
    """
    seq = _sequence(make_call, n_sets, config.min_calls)
    with hopper_kernels():  # the Hopper scan kernel (ssd_scan/hopper.py): warmed up here, then captured
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                for call in seq[:n_sets]:
                    call()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

        graph = torch.cuda.CUDAGraph()
        try:
            with graph_capture(graph):
                for call in seq:
                    call()
            graph.replay()
            torch.cuda.synchronize()
        except Exception as exc:
            graph = None  # drop the failed capture (and its memory pool) before cleaning up
            _recover()
            raise GraphCaptureError(f"{type(exc).__name__}: {exc}") from exc
    try:
        p20, p50, p80 = _do_bench(graph.replay, config)
    finally:
        graph = None
    n = len(seq)
    return Timing(p50 * 1e3 / n, p20 * 1e3 / n, p80 * 1e3 / n, "graph", n, n_sets)


def time_eager(make_call: MakeCall, n_sets: int, config: TimingConfig = TimingConfig(), note: str = "") -> Timing:
    """Per-call µs with ordinary launches (Python and launch overhead included).

    Each timed pass calls every set once (L2 is flushed between passes); there is no graph whose
    launch needs amortising, and code that cannot be captured is often slow, so no repeats.
    """
    seq = [make_call(i) for i in range(n_sets)]

    def run_all() -> None:
        for call in seq:
            call()

    run_all()
    torch.cuda.synchronize()
    p20, p50, p80 = _do_bench(run_all, config)
    n = len(seq)
    return Timing(p50 * 1e3 / n, p20 * 1e3 / n, p80 * 1e3 / n, "eager", n, n_sets, note)


def time_host(make_call: MakeCall, n_sets: int, *, calls: int = 200) -> float:
    """Host µs per call: the CPU time the caller spends in one call (Python, checks, launches),
    without waiting for the GPU. ``calls`` back-to-back calls (rotating over the sets) are timed
    with a wall clock and no synchronize; the launch queue (thousands of launches deep) does not
    fill at these counts, so the GPU never holds the host back. Median of 5 such passes."""
    seq = [make_call(i) for i in range(n_sets)]
    for call in seq:  # warm-up: compilation, allocator, config caches
        call()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(5):
        t0 = time.perf_counter()
        for k in range(calls):
            seq[k % n_sets]()
        per_call.append((time.perf_counter() - t0) * 1e6 / calls)
        torch.cuda.synchronize()
    return statistics.median(per_call)


def time_cpu(make_call: MakeCall, n_sets: int = 1, config: TimingConfig = TimingConfig()) -> Timing:
    """Wall-clock µs per call on the CPU: one warm-up pass, then ``config.cpu_reps`` timed passes."""
    calls = [make_call(i) for i in range(n_sets)]
    for call in calls:
        call()
    per_call = []
    for _ in range(max(1, config.cpu_reps)):
        t0 = time.perf_counter()
        for call in calls:
            call()
        per_call.append((time.perf_counter() - t0) * 1e6 / len(calls))
    return Timing(
        statistics.median(per_call), _quantile(per_call, 0.2), _quantile(per_call, 0.8), "cpu", len(calls), n_sets
    )


def time_calls(
    make_call: MakeCall,
    n_sets: int,
    *,
    device: torch.device,
    config: TimingConfig = TimingConfig(),
    graph: bool = True,
    preflight_sync: bool = False,
) -> Timing:
    """Time on ``device``: CUDA graph (falling back to eager, with the reason in ``note``), or CPU.

    ``preflight_sync`` runs one pass eagerly with ``torch.cuda.set_sync_debug_mode("error")`` first
    and skips capture if it syncs with the host (capture would fail, and a failed capture is best
    avoided); use it for code not written for graphs, such as a reference.
    """
    if device.type != "cuda":
        return time_cpu(make_call, n_sets, config)
    if not graph:
        return time_eager(make_call, n_sets, config, note="graph capture not attempted")
    if preflight_sync:
        reason = _host_sync_reason(make_call, n_sets)
        if reason:
            return time_eager(make_call, n_sets, config, note=f"not captured: syncs with the host ({reason})")
    try:
        return time_graph(make_call, n_sets, config)
    except GraphCaptureError as exc:
        return time_eager(make_call, n_sets, config, note=f"graph capture failed: {exc}")


def _host_sync_reason(make_call: MakeCall, n_sets: int) -> str:
    calls = [make_call(i) for i in range(n_sets)]
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for call in calls:
            call()
    except RuntimeError as exc:
        return str(exc).splitlines()[0][:120]
    finally:
        torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.synchronize()
    return ""


def _recover() -> None:
    """After a failed capture: drain the device and free the capture's pool where possible."""
    import gc

    gc.collect()
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except RuntimeError:
        pass


def _quantile(values: list[float], q: float) -> float:
    """Linear-interpolation quantile (as numpy's default) of a short list."""
    s = sorted(values)
    if len(s) == 1:
        return s[0]
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
