"""Per-kernel GPU times of our SSD scan and mamba_ssm's (development aid).

    python scripts/dev_ssd_profile.py [CONFIG ...]   # CONFIG: SsdScanConfig fields, comma-separated

Each variant's output and final state are compared with the default config's (max |diff| / max |ref|).
"""
import sys, torch
from torch.profiler import profile, ProfilerActivity
from fastmamba.bench import peers
from fastmamba.ops.ssd_scan import mamba_chunk_scan_combined
from fastmamba.ops.ssd_scan import configs
peer = peers._mamba_ssm_peer("ops.triton.ssd_combined", "mamba_chunk_scan_combined")
dev = "cuda"
H, P, G, N = 80, 64, 1, 128
for L in (2048, 8192):
    g = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=dev, generator=g)
    x = r(1, L, H, P).bfloat16(); dt = r(1, L, H) * 0.5; A = -(torch.rand(H, device=dev) + 0.5)
    B = (r(1, L, G, N) * 0.5).bfloat16(); C = (r(1, L, G, N) * 0.5).bfloat16(); D = r(H); z = r(1, L, H, P).bfloat16(); bias = r(H) * 0.3
    init = torch.zeros(1, H, P, N, device=dev)
    kw = dict(D=D, z=z, dt_bias=bias, dt_softplus=True, return_final_states=True, initial_states=init)
    variants = [("ours-default", lambda: mamba_chunk_scan_combined(x, dt, A, B, C, 256, **kw), None)]
    for c in sys.argv[1:]:
        vals = [int(v) for v in c.split(",")]
        variants.append((f"ours-{c}", lambda: mamba_chunk_scan_combined(x, dt, A, B, C, 256, **kw), configs.SsdScanConfig(*vals)))
    variants.append(("mamba_ssm", lambda: peer.fn(x, dt, A, B, C, 256, **kw), None))
    ref = None
    for name, fn, cfg in variants:
        configs._forced = cfg
        for _ in range(3): res = fn()
        torch.cuda.synchronize()
        if ref is None:
            ref = res
        else:
            errs = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(res, ref)]
            print(f"L={L} {name}: vs default, relative max |diff| out {errs[0]:.2e} final {errs[1]:.2e}")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10): fn()
            torch.cuda.synchronize()
        rows = {}
        for e in prof.key_averages():
            if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0) > 0:
                t = getattr(e, "self_device_time_total", 0) / max(e.count, 1)
                if t > 0: rows[e.key[:60]] = (t, e.count)
        total = sum(t for t, _ in rows.values())
        print(f"L={L} {name}: sum of kernel means {total:.1f} us")
        for k, (t, n) in sorted(rows.items(), key=lambda kv: -kv[1][0]):
            print(f"    {t:8.1f} us  x{n:3d}  {k}")
        configs._forced = None
