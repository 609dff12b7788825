"""Wall time of ``StateCache.flush`` on the mamba2-2.7b config (64 layers, speculate=5): what the
engine spends before a plain or legacy verify step of requests whose replay history is pending.

    python scripts/time_state_cache_flush.py        (GPU)

Each slot gets hist_len 3 and prev_accepted 2 (5 history tokens to replay) before every call;
median of 20 synchronised calls after 5 warm-up calls, for 1 and 8 slots.
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from fastmamba.cache.state_cache import StateCache
from fastmamba.models.config import PRESETS


def main() -> int:
    if not torch.cuda.is_available():
        print("error: time_state_cache_flush.py needs a CUDA GPU (torch sees none)", file=sys.stderr)
        return 2
    cache = StateCache(PRESETS["mamba2-2.7b"], 16, device="cuda", conv_dtype=torch.bfloat16,
                       ssm_dtype=torch.float32, speculate=5)
    for n in (1, 8):
        slots = torch.arange(n, dtype=torch.int32, device="cuda")
        times = []
        for _ in range(25):
            cache.hist_len[:n] = 3
            cache.prev_accepted[:n] = 2
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            cache.flush(slots)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        print(f"StateCache.flush of {n} slot(s), 64 layers: {1e3 * statistics.median(times[5:]):.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
