"""Target ``fp8-error``: where an FP8 model's logit error against its 16-bit weights comes from.

    python -m fastmamba.bench fp8-error [--model nemotron-3-nano] [--prompt-len 64] [--dtype bf16]
                                        [--device auto] [--json PATH]

``bench e2e --quantization fp8`` reports one number, the relative error of the FP8 model's logits
against the same random weights in 16 bits (Nano: 0.91 in norm on an H100). This target tells its
parts apart, block by block, on one random prompt:

- **kernels vs ref**: the block run by the kernels on the device against the same block run by the
  plain-PyTorch references on the CPU (``ops/*/ref.py``), on the same input: a fault of a GPU-only
  path (the tensor-core GEMV, ``torch._scaled_mm``, the grouped W8A8 MoE) shows here. FP8 blocks at
  the prompt's length (the prefill paths) and at 8 and 1 rows (the decode GEMVs); 16-bit blocks at
  the prompt's length, as the yardstick of what the dtype's own rounding gives.
- **FP8 vs 16-bit**: the FP8 block against the 16-bit block, both by the references, on the same
  input (the 16-bit model's input to that block): the quantisation error of one block.
- **drift**: the FP8 model's block output against the 16-bit model's in two whole runs: the
  error each block inherits and adds, as the logits see it; for a MoE block also the share of
  (token, expert) choices the FP8 run's router made differently (a flipped expert replaces a whole
  term of the sum: random routers' scores are close, so small input errors flip many).

All relative errors are ``|a - b| / |b|`` over the block's output [B, L, D] (``bench.ops._base.relative_error``:
inf where the FP8 side is not finite). On a CPU under
``TRITON_INTERPRET=1`` the kernels run in the interpreter (the tiny presets: a check of the wiring).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import NamedTuple

import torch

from fastmamba.bench.e2e_report import append_json
from fastmamba.bench.e2e_runs import DTYPES
from fastmamba.bench.ops._base import relative_error as rel  # |a - b| / |b| (inf where a is not finite)
from fastmamba.bench.peak import device_name

DECODE_ROWS = (8, 1)  # the decode GEMVs' row counts: the tensor-core dot (3-16 rows) and the FMA loop (1-2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="nemotron-3-nano", help="preset or checkpoint dir (default nemotron-3-nano)")
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens of the random prompt (default 64)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="the 16-bit model's dtype (default bf16)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--seed", type=int, default=0, help="of the prompt's token ids (default 0)")
    parser.add_argument("--json", metavar="PATH", help="append one JSON line per block here")


@contextlib.contextmanager
def references_only():
    """CPU tensors run the ops' PyTorch references inside the block, even under TRITON_INTERPRET=1
    (``ops._common.dispatch.interpreter_enabled`` reads the variable at each call)."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


class Run(NamedTuple):
    """What ``whole_run`` records: per block its input (if asked) and output [B, L, D] (fp32, CPU), per MoE block
    (by index) the experts each token was routed to [B * L, k] (CPU), and the last position's logits
    [B, V] (fp32, CPU)."""
    ins: list[torch.Tensor]
    outs: list[torch.Tensor]
    experts: dict[int, torch.Tensor]
    logits: torch.Tensor


@torch.no_grad()
def whole_run(model, ids: torch.Tensor, *, inputs: bool = True) -> Run:
    """One forward of ``ids`` [B, L], recorded (``Run``; ``inputs`` False: no block inputs)."""
    run = Run([], [], {}, torch.empty(0))

    def record(module, args, out):
        if inputs:
            run.ins.append(args[0].detach().float().cpu())
        run.outs.append(out.detach().float().cpu())

    def recording_route(i, route):
        def routed(x):
            routing = route(x)
            run.experts[i] = routing.ids.detach().cpu()
            return routing
        return routed

    blocks = list(model.backbone.layers)
    hooks = [b.register_forward_hook(record) for b in blocks]
    moes = [(i, b.mixer) for i, b in enumerate(blocks) if hasattr(b.mixer, "route")]
    for i, moe in moes:
        moe.route = recording_route(i, moe.route)  # an instance attribute over the method, removed below
    try:
        logits = model(ids)[:, -1].float().cpu()
    finally:
        for h in hooks:
            h.remove()
        for _, moe in moes:
            del moe.route
    return run._replace(logits=logits)


def experts_changed(a: torch.Tensor, b: torch.Tensor) -> float:
    """The fraction of (token, expert) choices in ``a`` [T, k] that ``b`` [T, k] does not make (as sets per token)."""
    same = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1).sum()
    return 1.0 - float(same) / max(a.numel(), 1)


@torch.no_grad()
def block_outputs(block, x: torch.Tensor, device: torch.device, dtype: torch.dtype,
                  rows: tuple[int, ...]) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """The block on ``x`` [B, L, D] (fp32, CPU) and on its first r positions for each r in ``rows``:
    by the kernels on ``device``, then (the block moved to the CPU, where it stays) by the references.
    Returns ({r: output}, {r: reference output}), fp32 on the CPU."""
    xs = {r: x[:, :r].to(dtype) for r in rows}
    dev = {r: block(xr.to(device)).float().cpu() for r, xr in xs.items()}
    block.to("cpu")
    with references_only():
        ref = {r: block(xr).float() for r, xr in xs.items()}
    return dev, ref


def run(args: argparse.Namespace, command: str) -> int:
    import fastmamba

    if args.prompt_len < 1:
        print(f"error: --prompt-len must be >= 1, got {args.prompt_len}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    dtype = DTYPES[args.dtype]
    L = args.prompt_len
    rows = (L, *(r for r in DECODE_ROWS if r < L))
    g = torch.Generator().manual_seed(args.seed)

    model = fastmamba.load_model(args.model, device=device, dtype=dtype)
    ids = torch.randint(0, model.cfg.vocab_size, (1, L), generator=g).to(device)
    kinds = [b.kind for b in model.backbone.layers]
    run16 = whole_run(model, ids)
    ref16 = []
    for i, block in enumerate(model.backbone.layers):
        _, ref = block_outputs(block, run16.ins[i], device, dtype, (L,))
        ref16.append(ref[L])
    del model, block
    if device.type == "cuda":
        torch.cuda.empty_cache()

    model = fastmamba.load_model(args.model, device=device, dtype=dtype, quantization="fp8")
    run8 = whole_run(model, ids, inputs=False)  # every block below runs on the 16-bit run's inputs
    logit_err = rel(run8.logits, run16.logits)
    print(f"# {command}\n# {device_name(device)}, {args.model}, {args.dtype} vs FP8 (--quantization fp8), "
          f"one prompt of {L} tokens, torch {torch.__version__}")
    print(f"# logits of the last position, FP8 vs {args.dtype}: relative error {logit_err:.4f}; "
          f"same argmax: {bool((run8.logits.argmax(-1) == run16.logits.argmax(-1)).all())}")
    head = " | ".join(f"FP8 kernels vs ref, {r} rows" for r in rows)
    print(f"| block | kind | {args.dtype} kernels vs ref | {head} | FP8 vs {args.dtype}, same input | drift (whole run) "
          f"| experts changed (whole run) |")
    print("|---:|---|" + "---:|" * (len(rows) + 4))
    out_rows = []
    for i, block in enumerate(model.backbone.layers):
        dev, ref = block_outputs(block, run16.ins[i], device, dtype, rows)
        row = {"block": i, "kind": kinds[i], "kernels_vs_ref_16bit": rel(run16.outs[i], ref16[i]),
               **{f"kernels_vs_ref_fp8_{r}": rel(dev[r], ref[r]) for r in rows},
               "fp8_vs_16bit": rel(ref[L], ref16[i]), "drift": rel(run8.outs[i], run16.outs[i]),
               "experts_changed": (experts_changed(run8.experts[i], run16.experts[i]) if i in run16.experts
                                   else None)}
        out_rows.append(row)
        cells = " | ".join(f"{row[f'kernels_vs_ref_fp8_{r}']:.4f}" for r in rows)
        changed = "" if row["experts_changed"] is None else f"{row['experts_changed']:.1%}"
        print(f"| {i} | {kinds[i]} | {row['kernels_vs_ref_16bit']:.4f} | {cells} | {row['fp8_vs_16bit']:.4f} | "
              f"{row['drift']:.4f} | {changed} |")
    worst = max(max(r[f"kernels_vs_ref_fp8_{n}"] for n in rows) for r in out_rows)
    print(f"# largest FP8 kernels-vs-ref error {worst:.4f} (the {args.dtype} blocks': "
          f"{max(r['kernels_vs_ref_16bit'] for r in out_rows):.4f}); FP8 vs {args.dtype} on the same input: "
          f"median {sorted(r['fp8_vs_16bit'] for r in out_rows)[len(out_rows) // 2]:.4f}")
    if args.json:
        append_json(args.json, out_rows, model=args.model, device=device_name(device), prompt_len=L,
                    logit_rel_err=logit_err, command=command)
    return 0
