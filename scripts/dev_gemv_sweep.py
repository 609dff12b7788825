"""Decode-time projections: our Triton GEMV tiles against cuBLAS (F.linear) (development aid; GPU).

    python scripts/dev_gemv_sweep.py [quick] [rows=1,4] [prefill]

mamba2-2.7b in_proj (N=10576, K=2560) and out_proj (N=2560, K=5120), bf16, M rows (default 1, 4;
``prefill``: 16, 64, 128, the short prefills' row counts, with wider tiles in the sweep):
µs per product in a CUDA graph of 64 back-to-back products on 64 distinct weight matrices (as a
decode step streams its 64 layers' weights: none comes from L2, and the launch gaps inside a graph
count), median of do_bench over graph replays; GB/s of the weight bytes.
"""
import itertools
import sys

import torch
import torch.nn.functional as F
import triton

from fastmamba.ops.gemv.kernel import launch_gemv

SHAPES = {"in_proj": (10576, 2560), "out_proj": (2560, 5120)}


LAYERS = 64


def bench(fn) -> float:
    """µs per call of fn(i) (i = 0..LAYERS-1, one weight each) in a graph of LAYERS calls."""
    for i in range(LAYERS):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(LAYERS):
            fn(i)
    return triton.testing.do_bench(graph.replay, warmup=10, rep=200, return_mode="median") * 1e3 / LAYERS


def main() -> None:
    quick = "quick" in sys.argv
    prefill = "prefill" in sys.argv
    row_arg = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("rows=")), None)
    ms = [int(m) for m in row_arg.split(",")] if row_arg else ([16, 64, 128] if prefill else [1, 4])
    if prefill:
        dot_cfgs = list(itertools.product((16, 32, 64, 128), (64, 128, 256), (4, 8), (3, 5)))
    else:
        dot_cfgs = list(itertools.product((16, 32, 64), (128, 256, 512), (4,), (3, 4)))
    fma_cfgs = list(itertools.product((8, 16), (256, 512), (4, 8), (1, 2)))
    if quick:
        dot_cfgs, fma_cfgs = dot_cfgs[::4], fma_cfgs[::4]
    for name, (N, K) in SHAPES.items():
        ws = [torch.randn(N, K, device="cuda").bfloat16() for _ in range(LAYERS)]
        gb = N * K * 2 / 1e9
        for M in ms:
            x = torch.randn(M, K, device="cuda").bfloat16()
            ref = F.linear(x, ws[0])
            out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            t_cublas = bench(lambda i: torch.matmul(x, ws[i].t(), out=out))
            rows = []
            for use_dot, cfgs in ((True, dot_cfgs), (False, fma_cfgs if M == 1 else [])):
                for bn, bk, nw, ns in cfgs:
                    y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                    run = lambda i: launch_gemv(x, ws[i], None, y, block_n=bn, block_k=bk, num_warps=nw,
                                                num_stages=ns, use_dot=use_dot, use_pdl=False)
                    try:
                        run(0)
                        err = (y.float() - ref.float()).abs().max().item()
                        rows.append((bench(run), use_dot, bn, bk, nw, ns, err))
                    except Exception as e:  # noqa: BLE001 (a config that does not compile: skip it)
                        print(f"  {name} M={M} dot={use_dot} {bn}x{bk} w{nw} s{ns}: {type(e).__name__}", flush=True)
            rows.sort()
            print(f"{name} M={M}: cuBLAS {t_cublas:.2f} us ({gb / t_cublas * 1e6:.0f} GB/s)", flush=True)
            if rows:  # the best tile again, each product a programmatic dependent of the one before
                _, use_dot, bn, bk, nw, ns, _ = rows[0]
                t_pdl = bench(lambda i: launch_gemv(x, ws[i], None, y, block_n=bn, block_k=bk, num_warps=nw,
                                                    num_stages=ns, use_dot=use_dot, use_pdl=True))
                print(f"   best tile with PDL: {t_pdl:.2f} us ({gb / t_pdl * 1e6:.0f} GB/s)", flush=True)
            for t, use_dot, bn, bk, nw, ns, err in rows[:6]:
                print(f"   {t:6.2f} us ({gb / t * 1e6:5.0f} GB/s) {'dot' if use_dot else 'fma'} BN{bn} BK{bk} w{nw} s{ns}"
                      f"  max|err| {err:.3g}", flush=True)


if __name__ == "__main__":
    main()
