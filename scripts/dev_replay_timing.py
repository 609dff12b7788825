"""Speculative verification, T tokens per step: replay vs per-token states (development aid).

Legacy = multi-token selective_state_update writing every position's state into
intermediate_states [B, T, H, P, N] (no copy of the accepted one, as PEERS.md's legacy column).
Replay = replay_selective_state_update (precompute + main kernel), every slot replaying T//2 tokens.
Both inside a CUDA graph, median of do_bench; state fp32 or fp16, bf16 activations.
"""
import torch
from triton.testing import do_bench
from fastmamba.ops import allocate_replay_cache, replay_selective_state_update, selective_state_update
dev = "cuda"
def graph_time(fn):
    fn(); torch.cuda.synchronize()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(4):
            fn()
    return do_bench(g.replay, warmup=10, rep=100, return_mode="median") * 1e3 / 4
T = 6
shapes = {"2.7b": (80, 64, 1, 128), "nemotron-h": (128, 64, 8, 128)}
def compare():
    print("shape batch state | legacy us | replay us | legacy/replay")
    for name, (H, P, G, N) in shapes.items():
        for sd in (torch.float32, torch.float16):
            for Bn in (1, 8, 32, 128, 256):
                S = 2 * Bn
                g = torch.Generator(device=dev).manual_seed(0)
                r = lambda *s: torch.randn(*s, device=dev, generator=g)
                x = r(Bn, T, H, P).bfloat16(); dt = r(Bn, T, H); A = -(torch.rand(H, device=dev) + 0.5)
                B = r(Bn, T, G, N).bfloat16(); C = r(Bn, T, G, N).bfloat16(); D = r(H); z = r(Bn, T, H, P).bfloat16()
                bias = r(H) * 0.3
                slots = torch.randperm(S, device=dev)[:Bn].int()
                state = r(S, H, P, N).to(sd)
                inter = torch.empty(Bn, T, H, P, N, device=dev, dtype=sd)
                Ae = A[:, None, None].expand(H, P, N)
                dte = dt[..., None].expand(Bn, T, H, P)
                legacy = lambda: selective_state_update(state, x, dte, Ae, B, C, D=D[:, None].expand(H, P), z=z,
                                                        dt_bias=bias[:, None].expand(H, P), dt_softplus=True,
                                                        state_batch_indices=slots, intermediate_states=inter)
                cache = allocate_replay_cache(S, T, H, P, G, N, sd, torch.bfloat16, dev)
                cache.prev_accepted.fill_(T // 2)
                replay = lambda: replay_selective_state_update(*cache, x, dt, A, B, C, D=D, z=z, dt_bias=bias,
                                                               dt_softplus=True, state_batch_indices=slots)
                try:
                    tl_ = graph_time(legacy)
                except Exception as e:
                    tl_ = float("nan"); print("legacy failed", type(e).__name__, str(e)[:200])
                try:
                    tr = graph_time(replay)
                except Exception as e:
                    tr = float("nan"); print("replay failed", type(e).__name__, str(e)[:200])
                print(f"{name} b={Bn} {str(sd).replace('torch.', '')} | {tl_:.1f} | {tr:.1f} | {tl_ / tr:.2f}x", flush=True)


def sweep_block_p():
    """Main-kernel P tile at a few points (fp32 state): more, smaller programs vs wgmma tiles."""
    from fastmamba.ops.replay import configs
    print("sweep: shape batch | block_p 16 / 32 / 64 (us)")
    for name, Bn in (("2.7b", 1), ("2.7b", 8), ("2.7b", 128), ("nemotron-h", 8), ("nemotron-h", 128)):
        H, P, G, N = shapes[name]
        S = 2 * Bn
        g = torch.Generator(device=dev).manual_seed(0)
        r = lambda *s: torch.randn(*s, device=dev, generator=g)
        x = r(Bn, T, H, P).bfloat16(); dt = r(Bn, T, H); A = -(torch.rand(H, device=dev) + 0.5)
        B = r(Bn, T, G, N).bfloat16(); C = r(Bn, T, G, N).bfloat16(); D = r(H); z = r(Bn, T, H, P).bfloat16()
        slots = torch.randperm(S, device=dev)[:Bn].int()
        cache = allocate_replay_cache(S, T, H, P, G, N, torch.float32, torch.bfloat16, dev)
        cache.prev_accepted.fill_(T // 2)
        times = []
        for bp in (16, 32, 64):
            with configs.forced_config(bp, bp // 16, 8, 4):
                times.append(graph_time(lambda: replay_selective_state_update(
                    *cache, x, dt, A, B, C, D=D, z=z, dt_bias=D * 0, dt_softplus=True, state_batch_indices=slots)))
        print(f"{name} b={Bn} | " + " / ".join(f"{t:.1f}" for t in times), flush=True)


if __name__ == "__main__":
    import sys as _sys
    if "sweep" in _sys.argv:
        sweep_block_p()
    else:
        compare()
