"""The replay split path's checkpoint kernel: pointer loads vs the TMA-fed persistent loop
(configs.CKPT_TMA), side by side (development aid; GPU).

    python scripts/dev_replay_ckpt_tma.py

Nemotron-H batch 128, fp16 and fp32 state, T = 2, 6, 16: per variant the step (replay + commit,
CUDA graph, median) and each kernel's time (torch.profiler), and the largest difference of 12
steps' outputs and the final state from the pointer kernel's.
"""
import torch

from dev_replay_timing import graph_time  # scripts/ is on the path when run as a script
from dev_replay_variants import kernel_times, problem
from fastmamba.ops.replay import configs

VARIANTS = [
    None,
    dict(block_p=64, num_warps=8, programs_per_sm=1, stages=2),
    dict(block_p=64, num_warps=8, programs_per_sm=2, stages=2, maxnreg=128),
    dict(block_p=32, num_warps=4, programs_per_sm=4, stages=2, maxnreg=128),
    dict(block_p=32, num_warps=4, programs_per_sm=3, stages=2, maxnreg=128),
    dict(block_p=32, num_warps=4, programs_per_sm=2, stages=3),
]


def main():
    for sd in (torch.float16, torch.float32):
        for T in (2, 6, 16):
            ref = None
            for v in VARIANTS:
                configs.CKPT_TMA = v
                step = problem("nemotron-h", T, 128, sd)
                ys = [step().float() for _ in range(12)]
                kt = kernel_times(step)
                t = graph_time(step)
                name = "pointer" if v is None else "tma " + " ".join(f"{k}={x}" for k, x in v.items())
                print(f"{str(sd)[6:]} T={T} {name}: step {t:.1f} us  kernels {kt}", flush=True)
                if ref is None:
                    ref = ys
                else:
                    diff = max((a - b).abs().max().item() for a, b in zip(ys, ref))
                    print(f"   12 steps' outputs vs pointer: max |diff| {diff:.3g}", flush=True)
    configs.CKPT_TMA = None


if __name__ == "__main__":
    main()
