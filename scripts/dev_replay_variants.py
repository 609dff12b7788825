"""Replay launch configs side by side (development aid; GPU).

    python scripts/dev_replay_variants.py configs   # main-kernel (block_p, num_warps), one-kernel path
    python scripts/dev_replay_variants.py split     # one-kernel path vs the split path's kernel tiles
    python scripts/dev_replay_variants.py profile   # per-kernel times at the table's configs (or profile-noreplay)
    python scripts/dev_replay_variants.py history   # split path at 1x, 2x, 4x the default history capacity
    python scripts/dev_replay_variants.py tiles     # split path, each output / checkpoint kernel tile
    python scripts/dev_replay_variants.py chain     # split path, the kernel chain with and without PDL
    python scripts/dev_replay_variants.py pre       # split path, the precompute kernel's heads x warps
    python scripts/dev_replay_variants.py pre-native  # ... with its two small dots 16-bit vs TF32
    python scripts/dev_replay_variants.py native    # split path, 16-bit state: C.S on 16-bit tensor cores vs TF32
    python scripts/dev_replay_variants.py history-t16  # split path, T=16: history capacity 32, 48, 64 (default)
    python scripts/dev_replay_variants.py history-every  # T=2 and 16: the state stored every step (C_h = T) vs the default
    python scripts/dev_replay_variants.py concurrent  # split path: checkpoint kernel beside the output kernel (timing only)
    python scripts/dev_replay_variants.py ncu-step-6-float32   # a few Nemotron-H batch-128 T=6 steps (for ncu)
    python scripts/dev_replay_variants.py ncu-split-BPxW   # a few Nemotron-H batch-128 T=6 steps (for ncu)

Each cell: replay + commit per verification step (CUDA graph, median of do_bench, random accepted
counts so the history runs through its steady state); the last line gives each kernel's
(registers, spills).
"""
import sys

import torch

from dev_replay_timing import graph_time  # scripts/ is on the path when run as a script
from fastmamba.ops import allocate_replay_cache, replay_selective_state_update
from fastmamba.ops.replay import configs
from fastmamba.ops.replay import kernel as K

dev = "cuda"
SHAPES = {"nemotron-h": (128, 64, 8, 128), "nemotron-h-tp8": (16, 64, 1, 128)}
MAIN_CONFIGS = [(16, 1), (16, 2), (16, 4), (32, 2), (32, 4), (64, 4)]
# (output kernel tile, checkpoint kernel tile) of the split path
SPLIT_CONFIGS = [((32, 2), (16, 2)), ((32, 2), (16, 4)), ((32, 2), (32, 4)), ((64, 4), (16, 2)), ((64, 4), (16, 4)),
                 ((64, 4), (32, 4))]


def problem(name, T, Bn, sd, noreplay=False, history=None):
    H, P, G, N = SHAPES[name]
    S = 2 * Bn
    g = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=dev, generator=g)
    x = r(Bn, T, H, P).bfloat16(); dt = r(Bn, T, H) - 3; A = -(torch.rand(H, device=dev, generator=g) + 0.5)
    B = r(Bn, T, G, N).bfloat16(); C = r(Bn, T, G, N).bfloat16(); D = r(H); z = r(Bn, T, H, P).bfloat16()
    bias = r(H) * 0.3
    slots = torch.randperm(S, device=dev, generator=g)[:Bn].int()
    acc = torch.randint(1, T + 1, (Bn,), device=dev, dtype=torch.int32, generator=g)
    cache = allocate_replay_cache(S, T, H, P, G, N, sd, torch.bfloat16, dev, history=history)
    cache.state.normal_(generator=g)

    def step():
        y = replay_selective_state_update(*cache, x, dt, A, B, C, D=D, z=z, dt_bias=bias, dt_softplus=True,
                                      state_batch_indices=slots)
        if noreplay:
            cache.hist_len.zero_()
            cache.prev_accepted.zero_()
        else:
            cache.commit(slots, acc, T)
        return y
    return step


def regs(kernel):
    out = set()
    for dev_cache in kernel.device_caches.values():
        for ck in dev_cache[0].values():
            try:
                ck._init_handles()
                out.add((ck.n_regs, ck.n_spills))
            except Exception:  # noqa: BLE001
                pass
    return sorted(out)


def cases():
    out = [("nemotron-h", 6, b, sd) for sd in (torch.float32, torch.float16) for b in (1, 8, 32, 128, 256)]
    out += [("nemotron-h", T, 128, sd) for sd in (torch.float32, torch.float16) for T in (2, 16)]
    out += [("nemotron-h-tp8", 6, b, sd) for sd in (torch.float32, torch.float16) for b in (1, 8, 128, 256)]
    return out


def table_cfg(name, T, Bn):
    return configs.lookup(*configs.table_key(programs_per_block=Bn * SHAPES[name][0], t_pad=configs.padded_tokens(T)))


def time_configs():
    """Main-kernel (block_p, num_warps) configs, one-kernel path (the precompute config as the table)."""
    print("shape T batch state | " + " | ".join(f"{bp}x{w}" for bp, w in MAIN_CONFIGS) + "  (us per replay + commit)")
    for case in cases():
        step = problem(*case)
        tab = table_cfg(*case[:3])
        times = []
        for bp, w in MAIN_CONFIGS:
            with configs.forced_config(bp, w, tab.heads, tab.warps_pre):
                times.append(graph_time(step))
        best = min(range(len(times)), key=lambda i: times[i])
        print(f"{case[0]} T={case[1]} b={case[2]} {str(case[3])[6:]} | " + " | ".join(f"{t:.1f}" for t in times)
              + f"  best {MAIN_CONFIGS[best]}", flush=True)
    print("main kernel (regs, spills):", regs(K._replay_main_kernel))


def time_split():
    """One-kernel path (table config) vs the split path with each (output-kernel, checkpoint-kernel) tile."""
    names = ["one"] + [f"out {o[0]}x{o[1]} ck {c[0]}x{c[1]}" for o, c in SPLIT_CONFIGS]
    print("shape T batch state | " + " | ".join(names) + "  (us per replay + commit)")
    for case in cases():
        step = problem(*case)
        tab = table_cfg(*case[:3])
        times = [graph_time(step)]
        for (obp, ow), (cbp, cw) in SPLIT_CONFIGS:
            with configs.forced_config(cbp, cw, tab.heads, tab.warps_pre, split=True, out_block_p=obp, out_warps=ow):
                times.append(graph_time(step))
        best = min(range(len(times)), key=lambda i: times[i])
        print(f"{case[0]} T={case[1]} b={case[2]} {str(case[3])[6:]} | " + " | ".join(f"{t:.1f}" for t in times)
              + f"  best {names[best]} ({times[0] / times[best]:.2f}x)", flush=True)
    for kern in ("_replay_out_kernel", "_replay_checkpoint_kernel", "_replay_precompute_kernel"):
        print(kern, "(regs, spills):", regs(getattr(K, kern)))


def kernel_times(step, calls: int = 20) -> dict[str, float]:
    """Per-kernel device µs per call of ``step`` (torch.profiler, after a warm-up)."""
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    times = {}
    for ev in prof.key_averages():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total = getattr(ev, "device_time_total", None) or ev.cuda_time_total
            times[ev.key.replace("_replay_", "").replace("_kernel", "")[:24]] = round(total / calls, 1)
    return times


def profile_split(noreplay: bool = False):
    """Per-kernel device times of Nemotron-H batch-128 steps at the table's configs (``noreplay``:
    the history emptied after every step, so nothing is replayed: the state-read floor)."""
    for sd in (torch.float32, torch.float16):
        for T in (2, 6, 16):
            step = problem("nemotron-h", T, 128, sd, noreplay=noreplay)
            print(f"T={T} {str(sd)[6:]}{' noreplay' if noreplay else ''}: {kernel_times(step)}", flush=True)


def time_native():
    """Split path, 16-bit state: the output kernel's C.S on 16-bit tensor cores vs TF32, per output tile."""
    tiles = [(32, 2), (32, 4), (64, 4)]
    print("shape T batch state | " + " | ".join(f"{m} {bp}x{w}" for m in ("tf32", "native") for bp, w in tiles))
    for sd in (torch.float16, torch.bfloat16):
        for T in (2, 6, 16):
            step = problem("nemotron-h", T, 128, sd)
            tab = table_cfg("nemotron-h", T, 128)
            times = []
            for native in (False, True):
                K.NATIVE_16BIT_OUT = native
                for bp, w in tiles:
                    with configs.forced_config(tab.block_p, tab.num_warps, tab.heads, tab.warps_pre, split=True,
                                               out_block_p=bp, out_warps=w):
                        times.append(graph_time(step))
            K.NATIVE_16BIT_OUT = True
            print(f"nemotron-h T={T} b=128 {str(sd)[6:]} | " + " | ".join(f"{t:.1f}" for t in times), flush=True)
    print("_replay_out_kernel (regs, spills):", regs(K._replay_out_kernel))


def time_history():
    """Nemotron-H batch 128: whole step and per-kernel times at history capacities 1x, 2x, 4x the default."""
    from fastmamba.ops.replay import default_history
    for sd in (torch.float32, torch.float16):
        for T in (2, 6, 16):
            for mult in (1, 2, 4):
                hist = default_history(T) * mult
                step = problem("nemotron-h", T, 128, sd, history=hist)
                print(f"T={T} {str(sd)[6:]} C_h={hist}: step {graph_time(step):.1f} us {kernel_times(step)}", flush=True)


def time_history_t16():
    """Nemotron-H batch 128, T=16: step and per-kernel times at history capacities 32, 48, 64."""
    for sd in (torch.float16, torch.float32):
        for hist in (32, 48, 64):
            step = problem("nemotron-h", 16, 128, sd, history=hist)
            print(f"T=16 {str(sd)[6:]} C_h={hist}: step {graph_time(step):.1f} us {kernel_times(step)}", flush=True)


def time_history_every():
    """Nemotron-H batch 128, T = 2 and 16: the state stored at every step (history capacity T, the
    plain replay design) against the default capacity, step and per-kernel times, and T=16 / T=2."""
    from fastmamba.ops.replay import default_history
    for sd in (torch.float16, torch.float32):
        for every in (True, False):
            steps = {}
            for T in (2, 16):
                hist = T if every else default_history(T)
                step = problem("nemotron-h", T, 128, sd, history=hist)
                steps[T] = graph_time(step)
                print(f"T={T} {str(sd)[6:]} C_h={hist}: step {steps[T]:.1f} us {kernel_times(step)}", flush=True)
            print(f"{str(sd)[6:]} {'every step' if every else 'default history'}: T=16 / T=2 = "
                  f"{steps[16] / steps[2]:.2f}x", flush=True)


def time_concurrent():
    """What running the checkpoint kernel beside the output kernel could gain (TIMING ONLY: the
    checkpoint kernel then overwrites states the output kernel may still read). Nemotron-H batch
    128: the step as shipped, and with the checkpoint kernel launched on a second stream right
    after the precompute kernel (a parallel branch of the CUDA graph) at 1-3 programs per SM,
    PDL chain off in both."""
    from fastmamba.ops.replay import api
    orig = {n: getattr(api, n) for n in ("launch_replay_out", "launch_replay_out_tma",
                                          "launch_replay_checkpoint", "launch_replay_checkpoint_tma")}
    for sd in (torch.float16, torch.float32):
        for T in (2, 6, 16):
            configs.CHAIN_PDL = True
            step = problem("nemotron-h", T, 128, sd)
            line = [f"shipped (PDL chain) {graph_time(step):.1f}"]
            configs.CHAIN_PDL = False
            step = problem("nemotron-h", T, 128, sd)
            line.append(f"no PDL {graph_time(step):.1f}")
            for per_sm in (1, 2, 3):
                side = torch.cuda.Stream()
                ev = torch.cuda.Event()

                def out_first(*a, _f=None, **k):
                    ev.record()
                    return _f(*a, **k)

                def ckpt_beside(*a, _f=None, **k):
                    main = torch.cuda.current_stream()
                    side.wait_event(ev)
                    with torch.cuda.stream(side):
                        k["programs"] = torch.cuda.get_device_properties(0).multi_processor_count * per_sm
                        _f(*a, **k)
                    main.wait_stream(side)

                for n, f in orig.items():
                    wrap = out_first if "out" in n else ckpt_beside
                    setattr(api, n, lambda *a, _w=wrap, _f=f, **k: _w(*a, _f=_f, **k))
                line.append(f"beside {per_sm}/SM {graph_time(step):.1f}")
                for n, f in orig.items():
                    setattr(api, n, f)
            print(f"{str(sd)[6:]} T={T}: " + "  ".join(line) + " us", flush=True)
    configs.CHAIN_PDL = True


def time_chain():
    """Nemotron-H batch 128, split path (precompute 16 heads x 2 warps): the precompute -> output ->
    checkpoint chain with and without PDL (configs.CHAIN_PDL), per checkpoint tile; the outputs of
    12 steps with PDL compared with those without."""
    for sd in (torch.float32, torch.float16):
        for T in (2, 6, 16):
            for cbp, cw in ((64, 4), (32, 4)):
                ref = None
                for pdl in (False, True):
                    configs.CHAIN_PDL = pdl
                    step = problem("nemotron-h", T, 128, sd)
                    with configs.forced_config(cbp, cw, 16, 2, split=True, out_block_p=64, out_warps=4):
                        ys = [step().float() for _ in range(12)]
                        kt = kernel_times(step)
                        print(f"{str(sd)[6:]} T={T} ck {cbp}x{cw} pdl {pdl}: step {graph_time(step):.1f} "
                              f"out {kt.get('out')} ck {kt.get('checkpoint')} pre {kt.get('precompute')}", flush=True)
                    if ref is not None:
                        diff = max((a - b).abs().max().item() for a, b in zip(ys, ref))
                        print(f"   12 steps with PDL vs without: max |diff| {diff:.3g}", flush=True)
                    else:
                        ref = ys
    configs.CHAIN_PDL = True

def time_pre():
    """Nemotron-H batch 128, split path at the table's tiles: the precompute kernel's heads x warps."""
    for sd in (torch.float32, torch.float16):
        for T in (2, 6, 16):
            step = problem("nemotron-h", T, 128, sd)
            for heads, wp in ((16, 2), (16, 4), (8, 2), (8, 4), (4, 1), (4, 2)):
                with configs.forced_config(64, 4, heads, wp, split=True, out_block_p=64, out_warps=4):
                    kt = kernel_times(step)
                    print(f"{str(sd)[6:]} T={T} pre {heads}x{wp}: step {graph_time(step):.1f} out {kt.get('out')} "
                          f"ck {kt.get('checkpoint')} pre {kt.get('precompute')}", flush=True)
    print("(regs, spills) pre:", regs(K._replay_precompute_kernel), "out:", regs(K._replay_out_kernel))


def time_pre_native():
    """Nemotron-H batch 128, split path: the precompute kernel's C B^T and C B_hist^T as 16-bit dots
    (K.NATIVE16_PRECOMPUTE) vs fp32 operands in TF32, per precompute heads x warps."""
    for sd in (torch.float32, torch.float16):
        for T in (2, 6, 16):
            step = problem("nemotron-h", T, 128, sd)
            for native in (False, True):
                K.NATIVE16_PRECOMPUTE = native
                for heads, wp in ((16, 2), (16, 4), (8, 2), (8, 4)):
                    with configs.forced_config(64, 4, heads, wp, split=True, out_block_p=64, out_warps=4):
                        kt = kernel_times(step)
                        print(f"{str(sd)[6:]} T={T} native={native} pre {heads}x{wp}: step {graph_time(step):.1f} "
                              f"out {kt.get('out')} ck {kt.get('checkpoint')} pre {kt.get('precompute')}", flush=True)
    K.NATIVE16_PRECOMPUTE = True


def time_tiles():
    """Nemotron-H batch 128, split path: per-kernel times for each output-kernel tile and each
    checkpoint-kernel tile (the other kernel at the table's config)."""
    for sd in (torch.float32, torch.float16):
        for T in (2, 6, 16):
            step = problem("nemotron-h", T, 128, sd)
            tab = table_cfg("nemotron-h", T, 128)
            for obp, ow in ((64, 4), (64, 8), (32, 2), (32, 4)):
                with configs.forced_config(tab.block_p, tab.num_warps, tab.heads, tab.warps_pre, split=True,
                                           out_block_p=obp, out_warps=ow):
                    print(f"T={T} {str(sd)[6:]} out {obp}x{ow}: step {graph_time(step):.1f} us {kernel_times(step)}",
                          flush=True)
            for cbp, cw in ((16, 2), (32, 4), (64, 4), (64, 8)):
                with configs.forced_config(cbp, cw, tab.heads, tab.warps_pre, split=True,
                                           out_block_p=tab.out_block_p, out_warps=tab.out_warps):
                    print(f"T={T} {str(sd)[6:]} ck {cbp}x{cw}: step {graph_time(step):.1f} us {kernel_times(step)}",
                          flush=True)
    for kern in ("_replay_out_kernel", "_replay_checkpoint_kernel", "_replay_precompute_kernel"):
        print(kern, "(regs, spills):", regs(getattr(K, kern)))


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        if arg == "configs":
            time_configs()
        elif arg == "split":
            time_split()
        elif arg in ("profile", "profile-noreplay"):
            profile_split(noreplay=arg.endswith("noreplay"))
        elif arg == "pre-native":
            time_pre_native()
        elif arg == "history":
            time_history()
        elif arg == "chain":
            time_chain()
        elif arg == "pre":
            time_pre()
        elif arg == "tiles":
            time_tiles()
        elif arg == "native":
            time_native()
        elif arg == "history-t16":
            time_history_t16()
        elif arg == "history-every":
            time_history_every()
        elif arg == "concurrent":
            time_concurrent()
        elif arg.startswith("ncu-step-"):  # e.g. ncu-step-6-float16: a few steps at the table's config
            T, sd = arg[len("ncu-step-"):].split("-")
            step = problem("nemotron-h", int(T), 128, getattr(torch, sd))
            for _ in range(8):
                step()
            torch.cuda.synchronize()
        elif arg.startswith("ncu-split-"):
            bp, w = map(int, arg[len("ncu-split-"):].split("x"))
            step = problem("nemotron-h", 6, 128, torch.float32)
            with configs.forced_config(16, 1, 8, 4, split=True, out_block_p=bp, out_warps=w):
                for _ in range(8):
                    step()
            torch.cuda.synchronize()
