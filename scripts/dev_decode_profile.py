"""Where a decode step's time goes (development aid; GPU).

    python scripts/dev_decode_profile.py [batch ...] [--pdl] [--gemv]   # default: batch 1

--gemv: each batch with the decode projections as cuBLAS, out_proj as fastmamba's gemv, and both
projections as gemv (DecodeTricks.triton_gemv, layers.mamba2.GEMV_PROJECTIONS), PDL off and on.

mamba2-2.7b preset, bf16: the CUDA-graph step time (median of do_bench over graph replays) and
each kernel's device time per step from torch.profiler over eager steps (kernel durations do not
depend on the launch gaps that the graph removes), grouped by kernel name.
"""
import sys
from collections import defaultdict

import torch
import triton

import fastmamba
from fastmamba.generation.cuda_graphs import GraphedDecoder
from fastmamba.layers import mamba2 as mixer_module


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    batches = [int(a) for a in args] or [1]
    model = fastmamba.load_model("mamba2-2.7b", device="cuda", dtype=torch.bfloat16)
    variants = [("default", None, "--pdl" in sys.argv)]
    if "--gemv" in sys.argv:
        variants = [(label, proj, pdl) for pdl in (False, True)
                    for label, proj in (("cuBLAS", ()), ("gemv out_proj", ("out_proj",)),
                                        ("gemv in_proj+out_proj", ("in_proj", "out_proj")))]
    default_proj = mixer_module.GEMV_PROJECTIONS
    for (label, proj, pdl), batch in [(v, b) for b in batches for v in variants]:
        mixer_module.GEMV_PROJECTIONS = default_proj if proj is None else proj
        print(f"== {label}")
        cache = model.new_cache(batch)
        slots = cache.alloc(batch)
        tokens = torch.randint(0, 1000, (batch,), device="cuda")
        decoder = GraphedDecoder(model, cache, batch, pdl=pdl)
        step_ms = triton.testing.do_bench(lambda: decoder.decode(tokens, slots), warmup=50, rep=500,
                                          return_mode="median")
        steps = 10
        for _ in range(3):
            model.decode(tokens, cache, slots)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                model.decode(tokens, cache, slots)
            torch.cuda.synchronize()
        per_name = defaultdict(lambda: [0.0, 0])
        for ev in prof.key_averages():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                total = getattr(ev, "device_time_total", None) or ev.cuda_time_total
                per_name[ev.key][0] += total / steps
                per_name[ev.key][1] += ev.count // steps
        busy = sum(t for t, _ in per_name.values())
        print(f"batch {batch}{' pdl' if pdl else ''}: graph step {step_ms * 1e3:.1f} us; kernels busy {busy:.1f} us/step")
        for name, (t, n) in sorted(per_name.items(), key=lambda kv: -kv[1][0])[:9]:
            print(f"  {t:8.1f} us  {n:4d} launches  {t / max(n, 1):6.2f} us each  {name[:90]}")


if __name__ == "__main__":
    main()
