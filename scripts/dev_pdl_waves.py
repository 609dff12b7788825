"""Dev experiment: programmatic dependent launch for multi-wave grids, and the conv row kernel.

    python scripts/dev_pdl_waves.py [--ops ssu,conv,norm] [--batch 8,64,256] [--json PATH]

Per decode-kernel case of ``bench kernels`` (CUDA-graph replays over rotating input sets, the
bench's short timing config, cold L2), the time per call under:

    plain        no PDL
    pdl-1wave    PDL on grids that fit in one wave (the library's rule), dependents launched
                 right after each program's wait
    pdl-all      PDL on every grid, early trigger
    pdl-all-exit PDL on every grid, dependents launched as programs exit

and, for the conv cases with state_len 3, each of those with the column kernel and with the
16-byte row kernel (``configs.ROWS_KERNEL``). Prints one line per (case, variant) with µs and %
of the copy bandwidth measured at start. GPU only.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys

import torch

from fastmamba.bench.kernels import load_benches
from fastmamba.bench.peak import device_name, l2_cache_bytes, measure_copy_bandwidth
from fastmamba.bench.timing import choose_n_sets
from fastmamba.bench.tune import _time
from fastmamba.ops._common import pdl
from fastmamba.ops.conv1d import configs as conv_configs
from fastmamba.ops.state_update import configs as ssu_configs

VARIANTS = {  # name -> (PDL on, waves, trigger)
    "plain": (False, "one", "early"),
    "pdl-1wave": (True, "one", "early"),
    "pdl-all": (True, "all", "early"),
    "pdl-all-exit": (True, "all", "exit"),
}


def _no_slots(args_fn, bench):
    """The bench's positional call with its last argument (state_batch_indices) set to None."""
    return lambda case, inp: args_fn(bench, case, inp)[:-1] + (None,)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="ssu,conv,norm")
    ap.add_argument("--batch", default="8,64,256")
    ap.add_argument("--cases", default="", help="comma-separated label substrings to keep")
    ap.add_argument("--json", default=None)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="subset of " + ",".join(VARIANTS))
    ap.add_argument("--kernels", default="", help="conv: columns,rows (default: both for state_len 3, auto for 4)")
    ap.add_argument("--configs", default="", help="conv: BLOCK_DxWARPS,... forced (default: the library's pick); "
                    "ssu: BLOCK_PxWARPS,...")
    ap.add_argument("--no-slots", action="store_true",
                    help="ssu: also time each case without state_batch_indices (row b of the state: no dependent index load)")
    ap.add_argument("--store-early", default="auto", help="ssu: configs.STORE_EARLY values to time: 0, 1, auto")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    copy_gbs = measure_copy_bandwidth(device)
    l2 = l2_cache_bytes(device)
    print(f"# {device_name(device)}, copy {copy_gbs:.0f} GB/s", flush=True)
    batches = [int(b) for b in args.batch.split(",")]
    keep = [c for c in args.cases.split(",") if c]
    out = open(args.json, "a") if args.json else None
    for op in args.ops.split(","):
        bench = load_benches([op])[0]
        prov = bench.providers(device)[0]
        for case in bench.cases(device, batches):
            if keep and not any(k in case.label for k in keep):
                continue
            n_sets = choose_n_sets(case.nbytes, l2)
            sets = [bench.make_set(case, device, seed=i) for i in range(n_sets)]
            if op == "ssu":
                kernels = [f"early{v}" for v in args.store_early.split(",")]  # early0, early1, earlyauto
                kernels += [k + "-noslots" for k in kernels] if args.no_slots else []
            elif op != "conv":
                kernels = ["auto"]
            elif args.kernels:
                kernels = args.kernels.split(",")
            else:
                kernels = ["columns", "rows"] if case.params.get("state_len") == 3 else ["auto"]
            cfgs = [None] if op not in ("conv", "ssu") or not args.configs else [
                tuple(map(int, c.split("x"))) for c in args.configs.split(",")]
            forced = ssu_configs.forced_config if op == "ssu" else conv_configs.forced_config
            for kern, cfg in ((k, c) for k in kernels for c in cfgs):
                conv_configs.ROWS_KERNEL = kern if kern in ("rows", "columns") else "auto"
                ssu_configs.STORE_EARLY = {"early0": False, "early1": True}.get(kern.split("-")[0], "auto")
                bench.args = _no_slots(type(bench).args, bench) if kern.endswith("-noslots") else type(bench).args.__get__(bench)
                tag = kern + ("" if cfg is None else f" {cfg[0]}x{cfg[1]}")
                for name in args.variants.split(","):
                    on, waves, trigger = VARIANTS[name]
                    pdl._waves, pdl._trigger = waves, trigger
                    try:
                        with forced(*cfg) if cfg else contextlib.nullcontext():
                            us = _time(bench, prov, case, sets, n_sets, on, device)
                    except Exception as exc:  # noqa: BLE001
                        print(f"{case.label:44} {tag:14} {name:13} failed: {type(exc).__name__}: {exc}", flush=True)
                        continue
                    pct = 100 * case.nbytes / us / 1e3 / copy_gbs
                    print(f"{case.label:44} {tag:14} {name:13} {us:9.2f} µs {pct:5.1f}%", flush=True)
                    if out:
                        out.write(json.dumps(dict(case=case.label, kernel=tag, variant=name, us=us, pct=pct)) + "\n")
            pdl._waves, pdl._trigger, conv_configs.ROWS_KERNEL = "one", "early", "auto"
            ssu_configs.STORE_EARLY = "auto"
            del sets
            torch.cuda.empty_cache()
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
