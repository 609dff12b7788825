"""The split path's fp32-state output kernel: one tile per program vs the persistent TMA-fed loop
(development aid; GPU).

    python scripts/dev_replay_persist.py [--chain-only]   # Nemotron-H batch 128 / 256, T 6 / 2 / 16

Each cell: the step (replay + commit, CUDA graph, median) with configs.OUT_TMA at the given
setting (None: the one-tile-per-program kernel), with and without the PDL chain; the outputs of
the first step compared with the one-tile kernel's (max |diff| / max |ref|).
"""
import sys

import torch

from dev_replay_timing import graph_time  # scripts/ is on the path when run as a script
from dev_replay_variants import problem
from fastmamba.ops.replay import configs

VARIANTS = [("one-tile", None),
            ("tma 3x2 168", {"programs_per_sm": 3, "stages": 2, "maxnreg": 168}),
            ("tma 3x2 none", {"programs_per_sm": 3, "stages": 2, "maxnreg": None}),
            ("tma 3x2 168 pdl-in", {"programs_per_sm": 3, "stages": 2, "maxnreg": 168, "pdl_in": 1})]


def main():
    shipped = configs.OUT_TMA, configs.CHAIN_PDL
    chains = (True,) if "--chain-only" in sys.argv else (True, False)
    dtypes = [torch.float32]
    try:
        for sd, batch, T in [(sd, b, t) for sd in dtypes for b in (128, 256) for t in (6, 2, 16)]:
            cells = []
            for chain in chains:
                configs.CHAIN_PDL = chain
                ref = None
                for name, setting in VARIANTS:
                    configs.OUT_TMA = setting
                    y = problem("nemotron-h", T, batch, sd)().float()
                    ref = y if ref is None else ref
                    err = ((y - ref).abs().max() / ref.abs().max()).item()
                    t = graph_time(problem("nemotron-h", T, batch, sd))
                    cells.append(f"{name}{'' if chain else ' nopdl'} {t:.1f} ({err:.0e})")
            print(f"{str(sd)[6:]} B={batch} T={T}: " + " | ".join(cells), flush=True)
    finally:
        configs.OUT_TMA, configs.CHAIN_PDL = shipped


if __name__ == "__main__":
    main()
