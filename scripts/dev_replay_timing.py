"""Speculative verification, T tokens per step: replay vs per-token states (development aid).

Legacy = multi-token selective_state_update writing every position's state into
intermediate_states [B, T, H, P, N] (no copy of the accepted one, as PEERS.md's legacy column).
Replay = replay_selective_state_update (precompute + main kernel) + commit_accepted with random
accepted counts, so the history evolves through its steady state over the timed calls.
Both inside a CUDA graph, median of do_bench; state fp32 or fp16, bf16 activations.
The maintained benchmark is `python -m fastmamba.bench spec`; this is the quick look.
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
shapes = {"2.7b": (80, 64, 1, 128), "nemotron-h": (128, 64, 8, 128), "nemotron-h-tp8": (16, 64, 1, 128)}


def compare(tokens=(2, 6, 16), names=("nemotron-h", "nemotron-h-tp8"), batches=(1, 8, 32, 128, 256)):
    """legacy (no copy) vs replay + commit (random accepted counts in 1..T, steady state across the
    graph's calls), replay with C_h = T (state stored at every step) and with the default history."""
    from fastmamba.ops.replay import default_history
    print("shape T batch state | legacy us | replay C=T us | C=16-multiple >= 2T us | C=default us | legacy/replay(default)")
    for name in names:
        H, P, G, N = shapes[name]
        for T in tokens:
            for sd in (torch.float32, torch.float16):
                for Bn in batches:
                    S = 2 * Bn
                    g = torch.Generator(device=dev).manual_seed(0)
                    r = lambda *s: torch.randn(*s, device=dev, generator=g)
                    x = r(Bn, T, H, P).bfloat16(); dt = r(Bn, T, H); A = -(torch.rand(H, device=dev) + 0.5)
                    B = r(Bn, T, G, N).bfloat16(); C = r(Bn, T, G, N).bfloat16(); D = r(H); z = r(Bn, T, H, P).bfloat16()
                    bias = r(H) * 0.3
                    slots = torch.randperm(S, device=dev)[:Bn].int()
                    acc = torch.randint(1, T + 1, (Bn,), device=dev, dtype=torch.int32)
                    state = r(S, H, P, N).to(sd)
                    Ae = A[:, None, None].expand(H, P, N)
                    dte = dt[..., None].expand(Bn, T, H, P)
                    times = []
                    if Bn * T * H * P * N * state.element_size() < 20e9:
                        inter = torch.empty(Bn, T, H, P, N, device=dev, dtype=sd)
                        legacy = lambda: selective_state_update(state, x, dte, Ae, B, C, D=D[:, None].expand(H, P), z=z,
                                                                dt_bias=bias[:, None].expand(H, P), dt_softplus=True,
                                                                state_batch_indices=slots, intermediate_states=inter)
                        times.append(graph_time(legacy))
                        del inter
                    else:
                        times.append(float("nan"))
                    for hist in (T, max(16, -(-2 * T // 16) * 16), default_history(T)):
                        cache = allocate_replay_cache(S, T, H, P, G, N, sd, torch.bfloat16, dev, history=hist)

                        def replay():
                            replay_selective_state_update(*cache, x, dt, A, B, C, D=D, z=z, dt_bias=bias,
                                                          dt_softplus=True, state_batch_indices=slots)
                            cache.commit(slots, acc, T)
                        try:
                            times.append(graph_time(replay))
                        except Exception as e:
                            times.append(float("nan")); print("replay failed", type(e).__name__, str(e)[:300])
                    tl_, t1, t15, t2 = times
                    print(f"{name} T={T} b={Bn} {str(sd).replace('torch.', '')} | {tl_:.1f} | {t1:.1f} | {t15:.1f} | "
                          f"{t2:.1f} | {tl_ / t2:.2f}x", flush=True)


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
        cache.hist_len.fill_(T)
        times = []
        for bp in (16, 32, 64):
            with configs.forced_config(bp, bp // 16, 8, 4):
                times.append(graph_time(lambda: replay_selective_state_update(
                    *cache, x, dt, A, B, C, D=D, z=z, dt_bias=D * 0, dt_softplus=True, state_batch_indices=slots)))
        print(f"{name} b={Bn} | " + " / ".join(f"{t:.1f}" for t in times), flush=True)


def pdl_effect(batches=(1, 8, 32)):
    """conv update (T tokens, accepted offset) -> replay -> commit, graph-timed with PDL off / on."""
    import sys
    sys.path.insert(0, ".")
    from fastmamba.ops._common.pdl import programmatic_dependent_launch
    from tests.ops.test_pdl_chain import _verify_step
    from fastmamba.ops import allocate_replay_cache
    print("PDL: shape T batch | chain off us | on us")
    for name in ("nemotron-h", "nemotron-h-tp8"):
        H, P, G, N = shapes[name]
        for T in (2, 6):
            for Bn in batches:
                W, E, S = 4, H * P + 2 * G * N, 2 * Bn
                r = lambda *s: torch.randn(*s, device=dev)
                conv_state = r(S, E, W - 1 + T - 1).bfloat16()
                cache = allocate_replay_cache(S, T, H, P, G, N, torch.float32, torch.bfloat16, dev)
                args = (r(Bn, T, E).bfloat16(), r(Bn, T, H * P).bfloat16(), r(Bn, T, H) - 3,
                        r(E, W).bfloat16() * 0.3, r(E).bfloat16(), -torch.exp(torch.rand(H, device=dev)), r(H), r(H),
                        torch.randperm(S, device=dev)[:Bn].int(),
                        torch.randint(1, T + 1, (Bn,), device=dev, dtype=torch.int32),
                        torch.randint(1, T + 1, (Bn,), device=dev, dtype=torch.int32), H, P, G, N)
                times = []
                for on in (False, True):
                    with programmatic_dependent_launch(on):
                        times.append(graph_time(lambda: _verify_step(conv_state, cache, *args)))
                print(f"{name} T={T} b={Bn} | {times[0]:.2f} | {times[1]:.2f}", flush=True)


if __name__ == "__main__":
    import sys as _sys
    if "sweep" in _sys.argv:
        sweep_block_p()
    elif "pdl" in _sys.argv:
        pdl_effect()
    elif "quick" in _sys.argv:
        compare(tokens=(2, 6, 16), names=("nemotron-h",), batches=(1, 128))
    else:
        compare()
