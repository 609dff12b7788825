"""Tensor-parallel decode benchmark: the same preset at several TP sizes, outputs compared.

    python -m fastmamba.bench.tp --model mamba2-2.7b --tp 1,2 --batch 1 --dtype fp32
    fastmamba bench tp --model mamba2-2.7b --tp 1,2,8 --batch 1,8,64,256      (the same, bf16)

For every TP size N a fresh group of N processes (spawned; one GPU each, NCCL) loads the model
(presets: the same random weights at every N), then per batch size runs ``fastmamba.bench.e2e``'s
``run_batch`` on every rank: prefill, then ``--gen-len`` greedy decode steps replayed from a CUDA
graph that holds the step's collectives. Reported per (N, batch), from rank 0:

    decode tok/s, ms/step, speedup over the smallest N in the list (same batch)
    % roof   the step's bytes on one rank (its weights + states) over its measured copy
             bandwidth, vs the measured ms/step: each GPU's share of the aggregate roofline
    coll ms  the step's collectives alone (n_layer all-reduces of [B, M(+1)], the embedding's
             all-reduce, the logits' all-gather), replayed from their own CUDA graph: the part
             of ms/step that tensor parallelism adds
    same     the greedy tokens equal the first N's (every rank's agree: ``check_ranks_agree``)
    logit err  max relative error of the prefill logits of request 0 vs the first N's

On a CPU (tests, no graphs) it runs with gloo and times eagerly.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from fastmamba.distributed.group import TPGroup
from fastmamba.distributed.launch import spawn_tp
from fastmamba.ops.runtime import graph_capture


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return vals


def _layer_collective(layer) -> str:
    """What one layer's step reduces: "fused" (a Mamba layer whose distributed norm rides in
    out_proj's all-reduce: [B, M + 1] fp32), "separate" (that norm's own [B, 1] all-reduce, then
    out_proj's [B, M]) or "plain" (one [B, M] all-reduce: out_proj, o_proj, down_proj, MoE)."""
    from fastmamba.distributed.layers import TPGatedRMSNorm

    norm = getattr(layer.mixer, "norm", None)
    if isinstance(norm, TPGatedRMSNorm):
        return "fused" if norm.defer_to else "separate"
    return "plain"


def collective_ms(model, tp: TPGroup, batch: int, reps: int = 50) -> float:
    """ms of one decode step's collectives alone (graphed on CUDA); 0 at TP=1. Mamba-2 LMs and
    hybrids alike: the embedding's all-reduce, each layer's (``_layer_collective``), the logits'
    all-gather."""
    if tp.world_size == 1:
        return 0.0
    M, dtype = model.cfg.d_model, model.dtype
    kinds = [_layer_collective(layer) for layer in model.backbone.layers]
    split = [n for n in model.lm_head.sizes]
    bufs = {"emb": torch.zeros(batch, M, device=tp.device, dtype=dtype),
            "fused": torch.zeros(batch, M + 1, device=tp.device, dtype=torch.float32),
            "plain": torch.zeros(batch, M, device=tp.device, dtype=dtype),
            "logits": torch.zeros(batch, split[tp.rank], device=tp.device, dtype=dtype)}
    sumsq = torch.zeros(batch, 1, device=tp.device, dtype=torch.float32)

    def step():
        tp.all_reduce(bufs["emb"])
        for kind in kinds:
            if kind == "separate":
                tp.all_reduce(sumsq)
            tp.all_reduce(bufs["fused" if kind == "fused" else "plain"])
        tp.all_gather_last(bufs["logits"], split)

    if tp.device.type != "cuda":
        step()
        t0 = time.perf_counter()
        for _ in range(reps):
            step()
        return 1e3 * (time.perf_counter() - t0) / reps
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _rank_bench(tp: TPGroup, opts: dict) -> dict:
    from fastmamba.bench.e2e_runs import make_prompts, run_batch, run_batch_hybrid
    from fastmamba.distributed.runtime import check_ranks_agree
    from fastmamba.distributed.loading import load_tp_model

    model = load_tp_model(opts["model"], tp, dtype=opts["dtype"], fuse_norm_reduce=opts["fuse_norm_reduce"])
    copy_gbs = None
    if tp.device.type == "cuda":
        from fastmamba.bench.peak import measure_copy_bandwidth

        copy_gbs = measure_copy_bandwidth(tp.device)
    run = run_batch_hybrid if model.cfg.paged_cache else run_batch  # attention K/V pages: the hybrid runner
    rows = []
    for batch in opts["batch"]:
        prompts = make_prompts(model.cfg.vocab_size, batch, opts["prompt_len"])
        cache = model.new_cache(1, max_seq_len=opts["prompt_len"])  # (a Mamba-2 LM's cache has no K/V to size)
        logits = model.prefill(prompts[:1].to(tp.device), cache, cache.alloc(1)).cpu()
        del cache
        row = run(model, batch, opts["prompt_len"], opts["gen_len"], pdl=opts["pdl"], device=tp.device,
                  prompts=prompts, record=True)
        check_ranks_agree(tp, row["tokens"], who="fastmamba.bench.tp")
        row["coll_ms"] = collective_ms(model, tp, batch)
        row["roofline_ms"] = 1e3 * row["step_bytes"] / (copy_gbs * 1e9) if copy_gbs else None
        row["logits"] = logits
        row["tp"] = tp.world_size
        rows.append(row)
    bytes_read = getattr(getattr(model, "load_stats", None), "bytes_read", None)
    return {"rows": rows, "bytes_read": bytes_read, "device": str(torch.cuda.get_device_name(tp.device))
            if tp.device.type == "cuda" else "cpu"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="mamba2-2.7b",
                   help="a Mamba-2 or Nemotron-H / Nemotron-3 preset, or a safetensors checkpoint directory")
    p.add_argument("--tp", type=_int_list, default=[1, 2], help="TP sizes, e.g. 1,2,8 (default 1,2)")
    p.add_argument("--batch", type=_int_list, default=[1], help="batch sizes (default 1)")
    p.add_argument("--dtype", default=None, help="fp32, fp16, bf16 (default: bf16 on a GPU, fp32 on a CPU)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=256)
    p.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=False,
                   help="programmatic dependent launch inside the decode graphs (default off)")
    p.add_argument("--fuse-norm-reduce", action=argparse.BooleanOptionalAction, default=True,
                   help="ngroups=1: the norm's sum of squares rides in out_proj's all-reduce (default on)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--json", metavar="PATH", help="append one JSON line per row")
    p.add_argument("--require-equal", action="store_true",
                   help="exit 1 unless every TP size's greedy tokens equal the first's")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastmamba.bench.tp", description=__doc__.split("\n")[0])
    add_arguments(p)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    return run(args, " ".join(["python -m fastmamba.bench.tp", *argv]))


def run(args: argparse.Namespace, command: str) -> int:
    """Target ``tp`` of ``fastmamba bench`` (see the module docstring)."""
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        have = torch.cuda.device_count()
        if max(args.tp) > have:
            raise ValueError(f"--tp {max(args.tp)} needs {max(args.tp)} GPUs, torch sees {have}")
    from fastmamba.distributed.loading import check_tp_source

    for n in args.tp:
        check_tp_source(args.model, n, who="fastmamba.bench.tp")
    opts = {"model": args.model, "batch": args.batch, "dtype": args.dtype, "prompt_len": args.prompt_len,
            "gen_len": args.gen_len, "pdl": args.pdl, "fuse_norm_reduce": args.fuse_norm_reduce}
    results = {}
    for n in args.tp:
        results[n] = spawn_tp(_rank_bench, n, opts, device=args.device, timeout_s=3600)[0]
    base = args.tp[0]
    print(f"# {command}")
    print(f"# model {args.model}, dtype {args.dtype or 'default'}, prompt {args.prompt_len}, gen {args.gen_len}, "
          f"device {results[base]['device']}")
    print(f"{'tp':>3} {'batch':>5} {'tok/s':>10} {'ms/step':>8} {'speedup':>7} {'% roof':>6} {'coll ms':>7} "
          f"{'same':>4} {'logit err':>9}")
    all_equal = True
    for n in args.tp:
        for row, ref in zip(results[n]["rows"], results[base]["rows"]):
            same = row["tokens"] == ref["tokens"]
            all_equal &= same
            err = ((row["logits"] - ref["logits"]).abs().max() / ref["logits"].abs().max()).item()
            roof = f"{100 * row['roofline_ms'] / row['ms_per_step']:.0f}" if row["roofline_ms"] else "-"
            print(f"{n:>3} {row['batch']:>5} {row['decode_tok_s']:>10.1f} {row['ms_per_step']:>8.3f} "
                  f"{row['decode_tok_s'] / ref['decode_tok_s']:>6.2f}x {roof:>6} {row['coll_ms']:>7.3f} "
                  f"{'yes' if same else 'NO':>4} {err:>9.1e}")
            if args.json:
                keep = {k: v for k, v in row.items() if k not in ("tokens", "logits")}
                with open(args.json, "a", encoding="utf-8") as f:
                    f.write(json.dumps({**keep, "model": args.model, "dtype": args.dtype, "same_tokens": same,
                                        "logit_rel_err": err}) + "\n")
    if args.require_equal and not all_equal:
        print("greedy tokens differ between TP sizes", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
