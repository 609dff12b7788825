"""Host time per call of every public op (issue 19 item 0): the Python work around the kernels.

    python -m fastmamba.bench host [--device cpu|cuda] [--calls N] [--ops ssu,conv,...] [--shape 2.7b|tiny] [--peers]

CPU (no GPU needed; run it with TRITON_INTERPRET=1 in the environment): the ops take their Triton
path on CPU tensors and every kernel launch is stubbed out (the interpreter's
``InterpretedFunction.run`` returns at once), so what is timed is what a call does besides the
kernel: argument checks, index / cu_seqlens host reads, config lookup, allocations, small torch
ops, the launcher's own Python. Triton's real launcher (argument binding, the compiled-kernel
cache lookup) is not in it: on a GPU it adds a few microseconds per launch.

CPU times are this thread's CPU time (``time.thread_time_ns``: steadier on a shared machine).
CUDA: nothing stubbed; N calls are timed with ``time.perf_counter_ns`` without synchronizing
(the queue holds them: a call's kernel is shorter than its host time at these batch-1 shapes),
and the synchronize after them is not counted. Each figure is the median over ``--repeats`` runs
of N calls, in µs per call. GPU runs end with the host limit measured the same way: one
``torch.empty``, one ``torch.add`` and one lean launch of a small Triton kernel. ``--peers`` (GPU):
the peers' calls on the same inputs too, each through its own API as its users call it.

Shapes: mamba2-2.7b (H80 P64 N128 G1, conv dim 5376, W4) at batch 1, L=16 for the prefill ops,
T=4 for the speculative ops. ``--shape tiny`` (H2 P16 N16) for a quick CPU check.

(Folded in from scripts/host_overhead.py, issue 49.)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

SHAPES = {
    # H, P, N, G, conv width
    "2.7b": (80, 64, 128, 1, 4),
    "tiny": (2, 16, 16, 1, 4),
}


def stub_launches() -> None:
    """Make every Triton kernel launch a no-op (CPU timing of the host path only)."""
    import triton.runtime.autotuner as autotuner
    import triton.runtime.interpreter as interp
    import triton.runtime.jit as jit

    interp.InterpretedFunction.run = lambda self, *a, **k: None
    jit.JITFunction.run = lambda self, *a, **k: None
    # a kernel under @triton.heuristics: its values are Triton's launch path too (on a GPU the lean
    # launch skips them once the signature is known)
    autotuner.Heuristics.run = lambda self, *a, **k: None


def build_calls(device: torch.device, shape: str, peers: bool = False) -> dict:
    """op name -> a zero-argument callable making one public call at batch 1; with ``peers``, also
    "op [peer]" -> the same call to each peer that loads (mamba_ssm's and vLLM's Triton ops, GPU only)."""
    from fastmamba import ops
    from fastmamba.ops.replay import allocate_replay_cache

    H, P, N, G, W = SHAPES[shape]
    Dm = H * P
    E = Dm + 2 * G * N
    L, T, S = 16, 4, 4
    bf16, f32 = torch.bfloat16, torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*s, dtype=bf16, scale=0.1):
        return (torch.randn(*s, generator=g) * scale).to(device=device, dtype=dtype)

    idx = torch.tensor([1], dtype=torch.int32, device=device)
    A_h = -torch.rand(H, generator=g).to(device) - 0.5
    D_h, dt_bias = rnd(H, dtype=f32), rnd(H, dtype=f32)
    state = rnd(S, H, P, N, dtype=f32)
    x1, z1 = rnd(1, H, P), rnd(1, H, P)
    dt1 = rnd(1, H).unsqueeze(-1).expand(1, H, P)
    B1, C1 = rnd(1, G, N), rnd(1, G, N)
    A3, D2, bias2 = A_h[:, None, None].expand(H, P, N), D_h[:, None].expand(H, P), dt_bias[:, None].expand(H, P)
    conv_state = rnd(S, E, W - 1)
    conv_w, conv_b = rnd(E, W), rnd(E)
    xc = rnd(1, E)
    xl = rnd(1, L, E).transpose(1, 2)  # channel-last [1, E, L]
    xv = rnd(L, E)
    cu = torch.tensor([0, L], dtype=torch.int32, device=device)
    has_init = torch.tensor([True], device=device)
    xs, zs = rnd(1, L, H, P), rnd(1, L, H, P)
    dts = rnd(1, L, H)
    Bs, Cs = rnd(1, L, G, N), rnd(1, L, G, N)
    norm_x, norm_z, norm_w = rnd(1, Dm), rnd(1, Dm), rnd(Dm)
    res = rnd(1, Dm)
    cache = allocate_replay_cache(S, T, H, P, G, N, f32, bf16, device)
    xr, zr, dtr = rnd(1, T, H, P), rnd(1, T, H, P), rnd(1, T, H)
    Br, Cr = rnd(1, T, G, N), rnd(1, T, G, N)
    accepted = torch.tensor([2], dtype=torch.int32, device=device)
    gated = ops.RMSNormGated(Dm, eps=1e-5, group_size=Dm // G, norm_before_gate=False, device=device, dtype=bf16)

    # the calls a peer makes too, on these same arguments
    ssu_args = (state, x1, dt1, A3, B1, C1, D2, z1, bias2, True, idx)
    conv_args = (xc, conv_state, conv_w, conv_b, "silu", None, idx)
    scan_args, scan_kw = (xs, dts, A_h, Bs, Cs, 256), dict(D=D_h, z=zs, dt_bias=dt_bias, dt_softplus=True)
    norm_args = (norm_x, norm_w, None, norm_z, 1e-5, Dm // G, False)
    calls = {
        "selective_state_update": lambda: ops.selective_state_update(*ssu_args),
        "causal_conv1d_update": lambda: ops.causal_conv1d_update(*conv_args),
        "causal_conv1d_fn": lambda: ops.causal_conv1d_fn(xl, conv_w, conv_b, activation="silu"),
        "causal_conv1d_varlen": lambda: ops.causal_conv1d_varlen(
            xv, conv_w, conv_b, conv_state, cu, idx, has_init, "silu"),
        "mamba_chunk_scan_combined": lambda: ops.mamba_chunk_scan_combined(*scan_args, **scan_kw),
        "ssd_scan_varlen": lambda: ops.ssd_scan_varlen(
            xs[0], dts[0], A_h, Bs[0], Cs[0], state, cu, D=D_h, z=zs[0], dt_bias=dt_bias,
            cache_indices=idx, has_initial_state=has_init),
        "rmsnorm_fn": lambda: ops.rmsnorm_fn(*norm_args),
        "RMSNormGated": lambda: gated(norm_x, norm_z),
        "add_rmsnorm": lambda: ops.add_rmsnorm(norm_x, res, norm_w, 1e-5),
        "replay_selective_state_update": lambda: ops.replay_selective_state_update(
            *cache, xr, dtr, A_h, Br, Cr, D_h, zr, dt_bias, True, idx),
        "commit_accepted": lambda: ops.commit_accepted(
            cache.buf_idx, cache.prev_accepted, cache.hist_len, idx, accepted, tokens=T, history=cache.history),
        "flush_replay_cache": lambda: ops.flush_replay_cache(cache, idx),
    }
    if not peers:
        return calls
    # the peers' eager calls on the same inputs, as a user of theirs makes them (Triton's JIT launch)
    from fastmamba.bench import peers as bench_peers
    from fastmamba.bench.ops import conv1d as conv_bench
    from fastmamba.bench.ops import state_update as ssu_bench

    wanted = {
        "selective_state_update [mamba_ssm]": (bench_peers.mamba_ssm_selective_state_update(), None, ssu_args, {}),
        "selective_state_update [vLLM]": (bench_peers.vllm_selective_state_update(), ssu_bench.vllm_adapter,
                                          ssu_args, {}),
        "causal_conv1d_update [vLLM]": (bench_peers.vllm_causal_conv1d_update(), conv_bench.vllm_adapter,
                                        conv_args, {}),
        "mamba_chunk_scan_combined [mamba_ssm]": (bench_peers.mamba_ssm_chunk_scan_combined(), None, scan_args,
                                                  scan_kw),
        "rmsnorm_fn [mamba_ssm]": (bench_peers.mamba_ssm_rmsnorm_fn(), None, norm_args, {}),
    }
    for name, (peer, adapt, args, kwargs) in wanted.items():
        if not peer.available:
            print(f"# {name}: unavailable: {peer.reason}")
            continue
        fn = adapt(peer.fn) if adapt is not None else peer.fn
        calls[name] = (lambda fn=fn, args=args, kwargs=kwargs: fn(*args, **kwargs))
    return calls


def floor_calls(device: torch.device) -> dict:
    """The host limit on the same machine (GPU runs): what one allocation, one torch op and one
    lean Triton launch cost, the pieces every op's call is made of."""
    from fastmamba.ops._common.launch import lean
    from fastmamba.ops._common.slot_errors import _check_slots_kernel, slot_record

    x = torch.zeros(1, 80, 64, dtype=torch.bfloat16, device=device)
    idx = torch.zeros(1, dtype=torch.int32, device=device)
    err = slot_record("host_overhead", device)[0]
    return {
        "floor: torch.empty (one allocation)": lambda: torch.empty(x.shape, dtype=x.dtype, device=x.device),
        "floor: torch.add (one torch op)": lambda: torch.add(x, x),
        "floor: one lean Triton launch": lambda: lean(_check_slots_kernel)[(1,)](
            idx, 1, err, 1, 4, -1, WHICH=1, BLOCK=256, num_warps=4),
    }


def time_host(fn, calls: int, repeats: int, cuda: bool) -> float:
    """Median over ``repeats`` of (elapsed of ``calls`` calls) / calls, in µs; syncs not counted.
    CPU runs count this thread's CPU time (time.thread_time_ns), which a machine shared with other
    work inflates less than wall time; CUDA runs count wall time (the driver's waits are host time)."""
    clock = time.perf_counter_ns if cuda else time.thread_time_ns
    for _ in range(3):
        fn()
    if cuda:
        torch.cuda.synchronize()
    per_call = []
    for _ in range(repeats):
        t0 = clock()
        for _ in range(calls):
            fn()
        per_call.append((clock() - t0) / calls / 1e3)
        if cuda:
            torch.cuda.synchronize()
    return statistics.median(per_call)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--calls", type=_positive_int, default=200, help="calls per timed run")
    parser.add_argument("--repeats", type=_positive_int, default=7)
    parser.add_argument("--ops", default="", help="comma-separated subset (default: all)")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="2.7b")
    parser.add_argument("--peers", action="store_true", help="also time the peers' calls (GPU runs)")


def run(args: argparse.Namespace, command: str) -> int:
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    if not cuda:
        from fastmamba.ops.runtime import interpreter_enabled

        if not interpreter_enabled():
            print("error: the CPU run needs TRITON_INTERPRET=1 (set it before Python starts)", file=sys.stderr)
            return 2
        stub_launches()
    device = torch.device(args.device)
    if args.peers and not cuda:
        print("error: --peers times the peers' real launches: it needs --device cuda", file=sys.stderr)
        return 2
    calls = build_calls(device, args.shape, peers=args.peers)
    ops_named = [name for name in calls if " [" not in name]  # "op [peer]": a peer's call of op
    asked = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = [o for o in asked if o not in ops_named]
    wanted = [name for name in calls if not asked or name.split(" [")[0] in asked]  # with the op's peers
    if unknown:
        print(f"error: unknown op(s) {unknown}; choose from {','.join(ops_named)}", file=sys.stderr)
        return 2
    what = "real launches, no sync counted" if cuda else "kernel launches stubbed (TRITON_INTERPRET=1)"
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    print(f"# {command}")
    print(f"host µs per call, {name}, shape {args.shape} batch 1, {what}; median of {args.repeats} x {args.calls} calls")
    print(f"{'op':40s} {'host µs':>9s}")
    for op in wanted:
        us = time_host(calls[op], args.calls, args.repeats, cuda)
        print(f"{op:40s} {us:9.1f}", flush=True)
    if cuda:
        for name, fn in floor_calls(device).items():
            print(f"{name:40s} {time_host(fn, args.calls, args.repeats, cuda):9.1f}", flush=True)
    return 0
