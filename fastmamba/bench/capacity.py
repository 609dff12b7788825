"""Target ``capacity``: what the capacity planner admits, and (``--startup``) how long start-up takes.

    python -m fastmamba.bench capacity [--model nemotron-3-nano] [--dtype bf16] [--context 8192] [--device-gib 79.6,140]
                                       [--gpu-memory-utilization 0.9] [--ssm-dtype fp32,fp16]
                                       [--quantization fp8] [--kv-cache-dtype fp8] [--tp N] [--startup]
                                       [--json PATH]

The plan is made as ``fastmamba serve`` makes it, from the checkpoint's config alone on the meta
device (``capacity.meta_model``: no weight is read, so it also runs on a CPU). One row per device
size, context and SSM state dtype: the weights, one request's Mamba slot and its K/V at that context,
``max_batch`` as the server picks it (every request can reach the context; at most 256), and the
largest ``max_batch`` the planner admits (the slots plus one full-length request's K/V: pages are
shared, so more requests than the pool holds at full length wait for pages), found by bisection on
``plan_capacity`` itself. Device sizes: ``--device-gib``, else the CUDA device's total memory.
``--tp N``: each GPU of N tensor-parallel ranks, planned for rank 0's share (as ``serve
--tensor-parallel-size N``).

``--startup``: the time to load the weights (``load_model`` onto the device, synchronised), to build
the engine as the server does at the first row's plan (its ``max_batch`` and K/V pages, CUDA graphs on
a GPU), and ``Engine.warm_up`` (the first request's compiles and graph captures): what a server spends
between its imports and its first answer. On a CPU it runs too (the tiny presets: a check of the
plumbing, not a timing).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from fastmamba.bench.e2e import _dtype_list
from fastmamba.bench.e2e_runs import DTYPES
from fastmamba.bench.kernels import _int_list
from fastmamba.generation.capacity import (GiB, MiB, CapacityError, check_utilization, device_memory_bytes,
                                           meta_model, pages_for, plan_capacity, weight_bytes)
from fastmamba.models.quantization import KV_CACHE_DTYPES, QUANTIZATION_CHOICES, plan_kv_cache_dtype

LARGEST_SEARCHED = 1 << 20  # max_batch beyond this is reported as ">= LARGEST_SEARCHED"


def _gib_list(text: str) -> list[float]:
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated GiB, got {text!r}") from None
    if not values or any(not (v > 0) or v == float("inf") for v in values):
        raise argparse.ArgumentTypeError(f"expected positive GiB, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="nemotron-3-nano", help="preset or checkpoint dir (default nemotron-3-nano)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="the weights' dtype (default: a checkpoint's own, bf16 for a preset, as on a GPU)")
    parser.add_argument("--context", type=_int_list, default=[8192], help="tokens one request may reach (default 8192)")
    parser.add_argument("--device-gib", type=_gib_list, default=None,
                        help="device memory sizes to plan for, GiB (default: the CUDA device's total memory)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F",
                        help="the fraction of the device's memory the engine may use (default 0.9, as serve)")
    parser.add_argument("--ssm-dtype", type=_dtype_list, default=None,
                        help="SSM state dtypes, comma-separated from fp32,fp16,bf16 (default: the checkpoint's, else fp32)")
    parser.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default=None,
                        help="fp8: plan (and load) the model quantised on load")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                        help="the K/V page dtype (default: the checkpoint's)")
    parser.add_argument("--tp", type=int, default=1, metavar="N",
                        help="tensor-parallel ranks: plan each GPU for rank 0's share (as serve --tensor-parallel-size N)")
    parser.add_argument("--startup", action="store_true",
                        help="also load the weights, build the engine at the first row's plan and warm it up, timed")
    parser.add_argument("--json", metavar="PATH", help="append one JSON line per row")


def largest_admitted(fits) -> int:
    """The largest m >= 1 with ``fits(m)`` (monotone: true up to some m, false after), 0 when
    ``fits(1)`` is false, capped at LARGEST_SEARCHED."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= LARGEST_SEARCHED and fits(hi):
        lo, hi = hi, 2 * hi
    if hi > LARGEST_SEARCHED:
        return LARGEST_SEARCHED
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def plan_row(meta, *, device_bytes: int, utilization: float, context: int, ssm_dtype: torch.dtype) -> dict:
    """One row: the default plan and the largest admitted max_batch for ``meta`` (a meta-device model)."""
    kw = dict(device_bytes=device_bytes, gpu_memory_utilization=utilization, max_seq_len=context, ssm_dtype=ssm_dtype)
    row = {"device_gib": round(device_bytes / GiB, 2), "utilization": utilization, "context": context,
           "ssm_dtype": next(k for k, v in DTYPES.items() if v == ssm_dtype)}
    try:
        plan = plan_capacity(meta, **kw)
    except CapacityError as exc:
        return row | {"fits": False, "error": str(exc)}

    def fits(m: int) -> bool:
        try:
            plan_capacity(meta, max_batch=m, **kw)
            return True
        except CapacityError:
            return False

    largest = largest_admitted(fits)
    at_largest = plan_capacity(meta, max_batch=largest, **kw)
    return row | {"fits": True, "weights_gib": plan.weight_bytes / GiB, "reserve_gib": plan.reserve_bytes / GiB,
                  "slot_mib": plan.slot_bytes / MiB,
                  "kv_mib_per_request": pages_for(context, plan.page_size) * plan.page_bytes / MiB,
                  "max_batch": plan.max_batch, "kv_pages": plan.kv_pages, "largest_max_batch": largest,
                  "kv_pages_at_largest": at_largest.kv_pages, "page_size": plan.page_size,
                  "summary": plan.summary()}


def _num(x: float) -> str:
    """Two decimals, or three significant digits below 1 (a tiny preset's MiB)."""
    return f"{x:.2f}" if x >= 1 or x == 0 else f"{x:.3g}"


def print_plan_table(rows: list[dict]) -> None:
    print("| device GiB x util | context | SSM state | weights GiB | slot MiB | K/V MiB / request | max_batch (serve's "
          "default) | largest max_batch admitted | K/V pages there |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        head = f"| {r['device_gib']:.1f} x {r['utilization']:g} | {r['context']} | {r['ssm_dtype']} "
        if not r["fits"]:
            print(head + f"| does not fit: {r['error']} | | | | | |")
            continue
        largest = (f">= {r['largest_max_batch']}" if r["largest_max_batch"] >= LARGEST_SEARCHED
                   else str(r["largest_max_batch"]))
        print(head + f"| {_num(r['weights_gib'])} | {_num(r['slot_mib'])} | {_num(r['kv_mib_per_request'])} | "
                     f"{r['max_batch']} | {largest} | {r['kv_pages_at_largest']} |")


def startup(args, row: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """Load (in ``dtype``, the plan's), build (at ``row``'s plan) and warm up an engine, each timed;
    returns the timings."""
    import fastmamba
    from fastmamba.generation.engine import Engine
    from fastmamba.models.quantization import set_kv_cache_dtype

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    t0 = time.perf_counter()
    model = fastmamba.load_model(args.model, device=device, dtype=dtype, quantization=args.quantization)
    sync()
    load_s = time.perf_counter() - t0
    set_kv_cache_dtype(model, args.kv_cache_dtype)
    kv = {"kv_num_pages": row["kv_pages"]} if model.cfg.paged_cache and row["kv_pages"] else {}
    t0 = time.perf_counter()
    engine = Engine(model, max_batch=row["max_batch"], max_seq_len=row["context"], ssm_dtype=DTYPES[row["ssm_dtype"]],
                    **kv)
    sync()
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.warm_up()
    sync()
    warm_s = time.perf_counter() - t0
    graphs = engine.graph_captures
    return {"load_s": load_s, "build_s": build_s, "warm_up_s": warm_s, "graphs": graphs["count"],
            "capture_s": graphs["seconds"], "weights_gib_loaded": weight_bytes(model) / GiB, "max_batch": row["max_batch"],
            "context": row["context"], "startup_s": load_s + build_s + warm_s}


def run(args: argparse.Namespace, command: str) -> int:
    from fastmamba.bench.e2e_report import append_json
    from fastmamba.bench.peak import device_name
    from fastmamba.models.checkpoint_config import ssm_state_dtype

    try:
        check_utilization(args.gpu_memory_utilization)
    except CapacityError as exc:
        print(f"error: --gpu-memory-utilization: {exc}", file=sys.stderr)
        return 2
    if args.tp < 1:
        print(f"error: --tp: expected an integer >= 1, got {args.tp}", file=sys.stderr)
        return 2
    if args.tp > 1 and (args.startup or args.quantization):
        print("error: --tp N plans only: --startup and --quantization run at tp 1 (as serve, which refuses FP8 "
              "weights under tensor parallelism)", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    sizes = [int(g * GiB) for g in args.device_gib] if args.device_gib else []
    if not sizes:
        total = device_memory_bytes(device)
        if total is None:
            print("error: no CUDA device to plan for: give --device-gib (e.g. 79.6 for an H100 80GB)", file=sys.stderr)
            return 2
        sizes = [total]
    dtype = DTYPES[args.dtype] if args.dtype else None
    if args.tp > 1:
        from fastmamba.distributed.loading import tp_meta_model

        meta = tp_meta_model(args.model, args.tp, dtype)
    else:
        meta = meta_model(args.model, dtype, quantization=args.quantization)
    kv_note = plan_kv_cache_dtype(meta, args.model, args.kv_cache_dtype)
    states = [DTYPES[n] for n in args.ssm_dtype] if args.ssm_dtype else [ssm_state_dtype(meta.cfg)[0]]
    print(f"# capacity: {args.model} ({meta.dtype}{', FP8 weights' if args.quantization else ''}"
          f"{f'; per GPU, rank 0 of {args.tp}' if args.tp > 1 else ''}; K/V pages "
          f"{kv_note}), planned from its config alone; {device_name(device)}; command: {command}")
    dtype_name = str(meta.dtype).removeprefix("torch.")
    rows = [plan_row(meta, device_bytes=b, utilization=args.gpu_memory_utilization, context=c, ssm_dtype=s)
            | {"dtype": dtype_name} for b in sizes for c in args.context for s in states]
    print_plan_table(rows)
    if args.startup:
        if not rows[0]["fits"]:
            print("error: --startup: the first row's plan does not fit; nothing to start", file=sys.stderr)
            return 2
        if not cuda:
            print("no GPU: --startup on the CPU checks the plumbing; its times say nothing about a GPU's", file=sys.stderr)
        s = startup(args, rows[0], device, meta.dtype)
        print(f"# start-up at max_batch {s['max_batch']}, context {s['context']}: weights loaded in {s['load_s']:.1f} s "
              f"({s['weights_gib_loaded']:.2f} GiB), engine built in {s['build_s']:.1f} s, warm-up {s['warm_up_s']:.1f} s "
              f"({s['graphs']} CUDA graphs captured in {s['capture_s']:.1f} s); {s['startup_s']:.1f} s in all")
        rows.append(dict(s, kind="startup", dtype=dtype_name))
    if args.json:
        append_json(args.json, rows, model=args.model, device=device_name(device), quantization=args.quantization,
                    tp=args.tp, command=command)
    return 0
