"""Experiment (issue 19 item 5, next step): the SSD scan's chunk states and state passing as ONE Hopper
kernel in Gluon, against the shipped `_chunk_state_kernel` + `_state_passing_kernel` on the same
intermediates (development aid: dense B=1, L a multiple of the 256-token chunk, no initial state).

    python scripts/dev_chunk_states_gluon.py [--lengths 2048,8192] [--configs 4,128,64,1 ...]
    python scripts/dev_chunk_states_gluon.py --compile-only     # sm_90 compile, no GPU needed

Why. At L=8192 (2.7b shape, H200) the two kernels take ~65 + ~33 us of the scan's ~286 us. Between them
the per-chunk states make an fp32 round trip through HBM (84 MB written, read, then 42 MB of bf16
S_in written): ~126 MB beyond the x read. An earlier fused attempt in Triton (one program per
(segment, head, block of N) walking its chunks, `_chunk_state_chain_kernel` before it) ran 123-330 us:
each program's loads waited on its own math. Here a producer warp streams the x and B tiles through
TMA into a ring ahead of the math, so the serial walk over chunks only carries the running state.

Design. One program per (head h, block of 64 state columns nb): the running state S [P=64, 64] fp32
lives in the consumer warpgroup's registers (wgmma accumulator layout). Per chunk c, per 64-token block:
  A = (x^T tile [P, 64 tokens] from shared memory, transposed on load) * w_s,  w_s = exp(cs_last - cs_s) dt_s
  S_loc += A @ B tile [64 tokens, 64 columns]   (wgmma, B from shared memory)
then S_in(c) = S goes out in bf16 (the chunk-output stage reads it) and S = exp(cs_last) S + S_loc.
The final S goes out in fp32. The producer warp computes w_s from the chunk's cs / dt windows and
stores it next to each ring slot. Bytes at L=8192: x 84 MB (read by both column blocks: half from L2),
S_in 42 MB written: ~30 us at this GPU's copy rate; B tiles come from L2.

Status (H200, 2026-11-27): exact against the shipped kernels; 85-87 vs 99-100 us at L=8192, 24 vs 27.5 us
at L=2048 (6 / 4 stages, 128 registers, 64 columns). Each program's walk over its 128 token blocks takes
~660 ns a block whatever the ring depth or wgmma overlap (AHEAD): the serial walk's latency. Not landed
(docs/experiments.md).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from dev_chunk_output_gluon import _lengths, capture_launches, graph_time  # scripts/ is sys.path[0]

from fastmamba.ops.ssd_scan.hopper_kernel import _exp

BM = gl.constexpr(64)  # tokens per ring slot = the head dim P


@gluon.jit
def _producer(x_desc, b_desc, x_smem, b_smem, w_smem, ready, empty, cs_ptr, dt_ptr, n_chunks, n_slots, h, nb, g,
              Q: gl.constexpr, N: gl.constexpr, BN: gl.constexpr, K_STAGES: gl.constexpr):
    M_BLOCKS: gl.constexpr = Q // BM
    blk: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [1, 1], [1, 0])
    win: gl.constexpr = gl.SliceLayout(0, blk)
    offs_w = gl.arange(0, M_BLOCKS, layout=gl.SliceLayout(1, blk))
    tile = offs_w[:, None] * BM + gl.arange(0, BM, layout=win)[None, :]
    last = tile == Q - 1
    nxt_cs = gl.load(cs_ptr + h * n_slots * Q + tile)
    nxt_dt = gl.load(dt_ptr + h * n_slots * Q + tile)
    k_i = 0
    for c in range(n_chunks):
        cs4 = nxt_cs
        dt4 = nxt_dt
        more = tile * 0 + c + 1 < n_chunks
        nxt_cs = gl.load(cs_ptr + (h * n_slots + c + 1) * Q + tile, mask=more, other=0.0)
        nxt_dt = gl.load(dt_ptr + (h * n_slots + c + 1) * Q + tile, mask=more, other=0.0)
        cs_last = gl.sum(gl.sum(gl.where(last, cs4, 0.0), axis=1), axis=0)
        w4 = _exp(cs_last - cs4) * dt4
        for kb in gl.static_range(M_BLOCKS):
            s = k_i % K_STAGES
            mbarrier.wait(empty.index(s), ((k_i // K_STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), (BM * BM + BM * BN) * 2)
            tma.async_copy_global_to_shared(x_desc, [c * Q + kb * BM, h * BM], ready.index(s), x_smem.index(s))
            tma.async_copy_global_to_shared(b_desc, [c * Q + kb * BM, g * N + nb * BN], ready.index(s),
                                            b_smem.index(s))
            w_smem.index(s).store(gl.sum(gl.where(offs_w[:, None] == kb, w4, 0.0), axis=0))
            mbarrier.arrive(ready.index(s))
            k_i += 1


@gluon.jit
def _consumer(x_smem, b_smem, w_smem, ready, empty, cs_ptr, states_in_ptr, final_ptr, n_chunks, n_slots, H, h, nb,
              Q: gl.constexpr, N: gl.constexpr, BN: gl.constexpr, K_STAGES: gl.constexpr, MMA_AHEAD: gl.constexpr):
    M_BLOCKS: gl.constexpr = Q // BM
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    a_cols: gl.constexpr = gl.SliceLayout(0, a_op)
    offs_p = gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
    offs_n = nb * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    tile = offs_p[:, None] * N + offs_n[None, :]  # [P, BN] inside one (chunk, head) state [P, N]
    S = gl.zeros([BM, BN], gl.float32, layout=mma)
    k_i = 0
    nxt_decay = gl.load(cs_ptr + h * n_slots * Q + Q - 1)
    for c in range(n_chunks):
        decay = _exp(gl.zeros([BM], gl.float32, layout=gl.SliceLayout(1, mma)) + nxt_decay)
        nxt_decay = gl.load(cs_ptr + (h * n_slots + c + 1) * Q + Q - 1, mask=c + 1 < n_chunks, other=0.0)
        acc = gl.zeros([BM, BN], gl.float32, layout=mma)
        for kb in gl.static_range(M_BLOCKS):
            s = k_i % K_STAGES
            mbarrier.wait(ready.index(s), (k_i // K_STAGES) & 1)
            xt = x_smem.index(s).permute((1, 0)).load(a_op).to(gl.float32)  # [P, 64 tokens]
            a = (xt * w_smem.index(s).load(a_cols)[None, :]).to(gl.bfloat16)
            acc = warpgroup_mma(a, b_smem.index(s), acc, is_async=True)
            if MMA_AHEAD:  # the previous block's matmul is done: its slot goes back while this one runs
                if kb > 0:
                    acc, a_prev = warpgroup_mma_wait(1, deps=(acc, a_prev))
                    mbarrier.arrive(empty.index((k_i + K_STAGES - 1) % K_STAGES))
                a_prev = a
            else:
                acc = warpgroup_mma_wait(0, deps=(acc,))
                mbarrier.arrive(empty.index(s))
            k_i += 1
        if MMA_AHEAD:
            acc, a_prev = warpgroup_mma_wait(0, deps=(acc, a_prev))
            mbarrier.arrive(empty.index((k_i + K_STAGES - 1) % K_STAGES))
        gl.store(states_in_ptr + (c * H + h).to(gl.int64) * (BM * N) + tile, S.to(gl.bfloat16))
        S = S * decay[:, None] + acc
    gl.store(final_ptr + h * (BM * N) + tile, S)


@gluon.jit
def chunk_states_kernel(x_desc, b_desc, cs_ptr, dt_ptr, states_in_ptr, final_ptr, n_chunks, n_slots, H, heads_per_group,
                        Q: gl.constexpr, N: gl.constexpr, BN: gl.constexpr, K_STAGES: gl.constexpr,
                        PRODUCER_REGS: gl.constexpr, MMA_AHEAD: gl.constexpr):
    """x [T, H * 64], B [T, G * N] bf16 (descriptors: 64 x 64 and 64 x BN boxes); cs / dt [H, n_slots, Q] fp32;
    states_in [chunks, H, 64, N] bf16 (S_in of every chunk); final [H, 64, N] fp32."""
    pid = gl.program_id(0)
    h = pid // (N // BN)
    nb = pid % (N // BN)
    g = h // heads_per_group
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [K_STAGES, BM, BM], x_desc.layout)
    b_smem = gl.allocate_shared_memory(gl.bfloat16, [K_STAGES, BM, BN], b_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.float32, [K_STAGES, BM], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    ready = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [K_STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(K_STAGES):
        mbarrier.init(ready.index(j), count=2)
        mbarrier.init(empty.index(j), count=1)
    fence_async_shared()
    gl.warp_specialize(
        [
            (_consumer, (x_smem, b_smem, w_smem, ready, empty, cs_ptr, states_in_ptr, final_ptr, n_chunks, n_slots, H,
                         h, nb, Q, N, BN, K_STAGES, MMA_AHEAD)),
            (_producer, (x_desc, b_desc, x_smem, b_smem, w_smem, ready, empty, cs_ptr, dt_ptr, n_chunks, n_slots, h, nb,
                         g, Q, N, BN, K_STAGES)),
        ],
        [1],
        [PRODUCER_REGS],
    )


def _desc(t2d: torch.Tensor, block: list[int]):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    return TensorDescriptor(t2d, list(t2d.shape), list(t2d.stride()), block, layout)


def chunk_states(x, B, cs_s, dt_s, states_in, final, *, chunk_size: int, stages: int = 4, maxnreg: int = 128,
                 bn: int = 64, producer_regs: int = 56, ahead: bool = False):
    """x [1, T, H, 64], B [1, T, G, N] bf16; cs_s / dt_s [H, n_slots, Q] fp32 (the cumsum kernel's scratch);
    states_in [chunks, H, 64, N] bf16 and final [H, 64, N] fp32, written."""
    _, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    assert P == 64 and N % 64 == 0 and T % chunk_size == 0 and x.is_contiguous() and B.is_contiguous()
    n_chunks = T // chunk_size
    return chunk_states_kernel[(H * (N // bn),)](
        _desc(x.view(T, H * P), [64, 64]), _desc(B.view(T, G * N), [64, bn]), cs_s, dt_s, states_in, final, n_chunks,
        cs_s.shape[1], H, H // G, Q=chunk_size, N=N, BN=bn, K_STAGES=stages, PRODUCER_REGS=producer_regs, MMA_AHEAD=ahead, num_warps=4,
        maxnreg=maxnreg)


def compile_only() -> None:
    """Compile for sm_90 without a GPU (Triton's compiler and ptxas): shared memory per program."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    for stages, maxnreg, bn, ahead in (_config(c) for c in DEFAULT_CONFIGS):
        descs = {name: f"tensordesc<bf16[64, {w}],{gl.NVMMASharedLayout.get_default_for([64, w], gl.bfloat16)}>"
                 for name, w in (("x_desc", 64), ("b_desc", bn))}
        sig = dict(descs, cs_ptr="*fp32", dt_ptr="*fp32", states_in_ptr="*bf16", final_ptr="*fp32", n_chunks="i32",
                   n_slots="i32", H="i32", heads_per_group="i32")
        consts = dict(Q=256, N=128, BN=bn, K_STAGES=stages, PRODUCER_REGS=56, MMA_AHEAD=ahead)
        src = GluonASTSource(chunk_states_kernel, {**sig, **{k: "constexpr" for k in consts}}, consts)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=maxnreg))
        print(f"stages {stages}, maxnreg {maxnreg}, {bn} columns, mma ahead {ahead}: shared {k.metadata.shared} B")
        _ptxas_warnings(k.asm["ptx"])


DEFAULT_CONFIGS = ["4,128,64,0", "4,128,64,1", "6,128,64,1", "6,168,64,1"]


def _config(text: str) -> tuple[int, int, int, bool]:
    """--configs entry: K_STAGES,MAXNREG,BN[,AHEAD] (BN 32 or 64 state columns per program; AHEAD 1 leaves
    one wgmma in flight while the next block's operand is built)."""
    try:
        stages, maxnreg, bn, *ahead = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K_STAGES,MAXNREG,BN[,AHEAD], got {text!r}") from None
    if stages < 2 or bn not in (32, 64) or not 24 <= maxnreg <= 256 or ahead not in ([], [0], [1]):
        raise argparse.ArgumentTypeError(
            f"expected K_STAGES >= 2, MAXNREG in 24..256, BN 32 or 64, AHEAD 0 or 1, got {text!r}")
    return stages, maxnreg, bn, bool(ahead and ahead[0])


def _ptxas_warnings(ptx: str) -> None:
    """Print ptxas's performance warnings for sm_90a (e.g. C7515: wgmma serialized)."""
    import subprocess
    import tempfile

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        res = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    for line in res.stderr.splitlines():
        if "warning" in line.lower() or "Performance" in line or "spill" in line:
            print("   ", line.strip()[:160])


def _capture(L: int, H=80, P=64, G=1, N=128):
    """Run our scan once (the Triton kernels) and keep the two state kernels' launches."""
    from fastmamba.ops.ssd_scan import mamba_chunk_scan_combined
    from fastmamba.ops.ssd_scan.kernel import _chunk_state_kernel, _state_passing_kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)
    x = r(1, L, H, P).bfloat16()
    dt = r(1, L, H) * 0.5
    A = -(torch.rand(H, device="cuda") + 0.5)
    B = (r(1, L, G, N) * 0.5).bfloat16()
    C = (r(1, L, G, N) * 0.5).bfloat16()
    os.environ["FASTMAMBA_HOPPER_SCAN"] = "0"
    captured, (_, final) = capture_launches(
        {"state": _chunk_state_kernel, "passing": _state_passing_kernel},
        lambda: mamba_chunk_scan_combined(x, dt, A, B, C, 256, dt_bias=r(H) * 0.3, dt_softplus=True,
                                          return_final_states=True))
    return captured, x, B, final


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=_lengths, default=[2048, 8192], help="comma-separated multiples of 256")
    ap.add_argument("--configs", type=_config, nargs="*", default=[_config(c) for c in DEFAULT_CONFIGS],
                    help="K_STAGES,MAXNREG,BN")
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    if args.compile_only:
        compile_only()
        return
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        ap.error("timing needs an sm_90 GPU; --compile-only runs without one")
    print("| L | kernels | µs | S_in max rel diff | final max rel diff |")
    print("|---|---|---:|---:|---:|")
    for L in args.lengths:
        cap, x, B, final_ref = _capture(L)
        st, ps = cap["state"], cap["passing"]
        shipped = lambda: (st["launcher"][st["grid"]](*st["args"], **st["kwargs"]),
                           ps["launcher"][ps["grid"]](*ps["args"], **ps["kwargs"]))
        states_in_ref = ps["args"][1]  # _state_passing_kernel(states, states_in, cs, ...)
        cs_s, dt_s = st["args"][6], st["args"][5]  # _chunk_state_kernel(x, B, table, skip, states, dt, cs, ...)
        shipped()
        torch.cuda.synchronize()
        ref_in, ref_final = states_in_ref.clone().float(), final_ref[0].float()
        print(f"| {L} | shipped chunk states + state passing | {graph_time(shipped):.1f} | - | - |")
        n_chunks = L // 256
        for stages, maxnreg, bn, ahead in args.configs:
            got_in = torch.full_like(states_in_ref[:n_chunks], float("nan"))
            got_final = torch.full_like(ref_final, float("nan"))
            fn = lambda: chunk_states(x, B, cs_s, dt_s, got_in, got_final, chunk_size=256, stages=stages,
                                      maxnreg=maxnreg, bn=bn, ahead=ahead)
            try:
                fn()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - an experiment: report and go on
                print(f"| {L} | gluon {stages},{maxnreg},{bn},{int(ahead)} | failed: {type(e).__name__}: {str(e)[:200]} | | |")
                continue
            rel = lambda a, b: ((a.float() - b).abs().max() / b.abs().max()).item()
            err_in, err_final = rel(got_in, ref_in[:n_chunks]), rel(got_final, ref_final)
            print(f"| {L} | gluon {stages},{maxnreg},{bn},{int(ahead)} | {graph_time(fn):.1f} | {err_in:.2e} | {err_final:.2e} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
