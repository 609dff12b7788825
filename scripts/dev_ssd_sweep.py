"""Sweep the chunk-scan kernel's tiles on the GPU (development aid): whole-op time in a CUDA graph."""
import itertools, sys, torch
from triton.testing import do_bench
from fastmamba.ops.ssd_scan import mamba_chunk_scan_combined, configs
dev = "cuda"
def graph_time(fn):
    fn(); torch.cuda.synchronize()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return do_bench(g.replay, warmup=10, rep=60, return_mode="median") * 1e3
shapes = {"2.7b": (80, 64, 1, 128), "nemotron": (128, 64, 8, 128)}
for name in sys.argv[1].split(","):
    H, P, G, N = shapes[name]
    for L in (2048, 8192):
        g = torch.Generator(device=dev).manual_seed(0)
        r = lambda *s: torch.randn(*s, device=dev, generator=g)
        x = r(1, L, H, P).bfloat16(); dt = r(1, L, H) * 0.5; A = -(torch.rand(H, device=dev) + 0.5)
        B = (r(1, L, G, N) * 0.5).bfloat16(); C = (r(1, L, G, N) * 0.5).bfloat16(); D = r(H); z = r(1, L, H, P).bfloat16()
        kw = dict(D=D, z=z, dt_bias=r(H) * 0.3, dt_softplus=True, return_final_states=True, initial_states=torch.zeros(1, H, P, N, device=dev))
        res = []
        for bm, bk, bp, w, st, hm in itertools.product((64, 128), (32, 64), (0, 32), (4, 8), (1, 2, 3), (1,)):
            if bm == 128 and w == 4:
                continue
            cfg = configs.SsdScanConfig(32, 128, 4, bm, bk, bp, w, st, 256, hm, 1)
            configs._forced = cfg
            try:
                t = graph_time(lambda: mamba_chunk_scan_combined(x, dt, A, B, C, 256, **kw))
            except Exception:  # a config that fails to compile or launch is skipped
                t = float("inf")
            configs._forced = None
            res.append((t, cfg))
        res.sort(key=lambda v: v[0])
        print(f"{name} L={L}: best {[(round(t,1), tuple(c)[3:10]) for t, c in res[:6]]}", flush=True)
        print(f"    worst {[(round(t,1), tuple(c)[3:10]) for t, c in res[-3:]]}", flush=True)
