"""Per-kernel times of one replay verification step (precompute, main, commit), from torch.profiler,
over a few launch configs (development aid). python scripts/dev_replay_profile.py [T] [batch]"""
import sys

import torch

from fastmamba.ops import allocate_replay_cache, replay_selective_state_update
from types import SimpleNamespace

from fastmamba.ops.replay import api

dev = "cuda"
CFGS = [None, (16, 1, 8, 4), (32, 1, 8, 4), (32, 2, 16, 4), (64, 4, 8, 4)]
NO_REPLAY = "noreplay" in sys.argv  # commit accepted = 0 and history emptied: k = 0, no replay loop
args = [a for a in sys.argv[1:] if a.isdigit()]
T = int(args[0]) if args else 6
Bn = int(args[1]) if len(args) > 1 else 128
for name, (H, P, G, N) in {"nemotron-h": (128, 64, 8, 128), "nemotron-h-tp8": (16, 64, 1, 128)}.items():
    for sd in (torch.float32, torch.float16):
        S = 2 * Bn
        r = lambda *s: torch.randn(*s, device=dev)
        x = r(Bn, T, H, P).bfloat16(); dt = r(Bn, T, H) - 3; A = -(torch.rand(H, device=dev) + 0.5)
        B = r(Bn, T, G, N).bfloat16(); C = r(Bn, T, G, N).bfloat16(); D = r(H); z = r(Bn, T, H, P).bfloat16()
        slots = torch.randperm(S, device=dev)[:Bn].int()
        acc = torch.randint(1, T + 1, (Bn,), device=dev, dtype=torch.int32)
        cache = allocate_replay_cache(S, T, H, P, G, N, sd, torch.bfloat16, dev)
        cache.state.normal_()
        default_pick = api.pick_config
        for cfg in CFGS:
            def step():
                replay_selective_state_update(*cache, x, dt, A, B, C, D=D, z=z, dt_bias=D * 0.1, dt_softplus=True,
                                              state_batch_indices=slots)
                if NO_REPLAY:
                    cache.hist_len.zero_()
                    cache.prev_accepted.zero_()
                else:
                    cache.commit(slots, acc, T)
            if cfg:
                api.pick_config = lambda cfg=cfg, **kw: SimpleNamespace(block_p=cfg[0], num_warps=cfg[1], heads=cfg[2],
                                                                        warps_pre=cfg[3])
            else:
                api.pick_config = default_pick
            try:
                if True:
                    for _ in range(20):
                        step()
                    torch.cuda.synchronize()
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                        for _ in range(40):
                            step()
                        torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                print(name, sd, cfg, "failed", type(e).__name__, str(e)[:200])
                continue
            times = {}
            for ev in prof.key_averages():
                if ev.device_type == torch.autograd.DeviceType.CUDA:
                    times[ev.key] = ev.device_time_total / ev.count if hasattr(ev, "device_time_total") else ev.cuda_time_total / ev.count
            short = {k.replace("_replay_", "").replace("_kernel", ""): round(v, 1) for k, v in times.items()
                     if "replay" in k or "commit" in k}
            state_mb = Bn * H * P * N * cache.state.element_size() / 1e6
            main = short.get("main", float("nan"))
            from fastmamba.ops.replay import kernel as K
            regs = []
            for dev_cache in K._replay_main_kernel.device_caches.values():
                for ck in dev_cache[0].values():
                    try:
                        ck._init_handles()
                        regs.append((ck.n_regs, ck.n_spills))
                    except Exception:  # noqa: BLE001
                        pass
            print(f"{name} {str(sd)[6:]} T={T} b={Bn} cfg={cfg}: {short}  main reads {state_mb:.0f} MB state -> "
                  f"{state_mb / main:.2f} TB/s; main kernels compiled so far (regs, spills): {sorted(set(regs))}", flush=True)
