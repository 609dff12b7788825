"""Target ``ttft``: time to first token, i.e. a warm whole-model prefill, against its floor.

    python -m fastmamba.bench ttft [--model mamba2-2.7b] [--shapes 1x16,1x128,1x512,1x2048,1x8192,8x2048,32x512] [--peer]
                                   [--reps 7] [--graph-max-tokens 2048] [--json PATH]

Per shape B x L: B random prompts of L tokens are prefilled into fresh cache slots
(``model.prefill``, ids [B, L]; the first token's logits come out of it; a hybrid's slots are
given back and taken again, untimed, before every prefill, since its K/V pages would grow) three
times to warm up, then ``--reps`` times timed (wall clock around the call, synchronised): the median is the
eager time. Where the packed batch fits the graph buckets (``GraphedPrefill.fits``: B*L tokens plus
a padding request within ``--graph-max-tokens``, or B*L exactly a token bucket),
``GraphedPrefill`` (fastmamba/generation/prefill_graphs.py) runs the same prompts from a CUDA graph
(host-side copy of the batch included). The floor (fastmamba.bench.prefill_floor) is max(weight
bytes / copy bandwidth, 2 x tokens x active matrix parameters / matmul rate), the rates measured in
the same run (bf16, and FP8 for FP8 weights): the prefill must read every weight it can reach once
and do the projections' FLOPs -- of a MoE layer top_k of its E experts per token, of the LM head
the last positions only. ``--quantization fp8`` / ``--kv-cache-dtype`` load the model as ``bench
e2e`` does. Without a GPU: the tiny preset on the CPU, which checks the plumbing only.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from fastmamba.models.quantization import KV_CACHE_DTYPES, QUANTIZATION_CHOICES, set_kv_cache_dtype

DEFAULT_SHAPES = "1x16,1x128,1x512,1x2048,1x8192,8x2048,32x512"


def parse_shape(text: str) -> tuple[int, int]:
    """One prefill shape ``BxL`` (e.g. 1x128) -> (B, L); argparse's error for anything else."""
    try:
        b, l = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected B x L like 1x128, got {text!r}") from None
    if b < 1 or l < 1:
        raise argparse.ArgumentTypeError(f"shape {text!r}: batch and length must be >= 1")
    return b, l


def _shapes(text: str) -> list[tuple[int, int]]:
    return [parse_shape(part) for part in text.split(",")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="preset or checkpoint dir (default: mamba2-2.7b on a GPU, "
                        "mamba2-tiny on a CPU)")
    parser.add_argument("--shapes", type=_shapes, default=None, help=f"B x L list (default {DEFAULT_SHAPES} on a GPU)")
    parser.add_argument("--reps", type=int, default=7, help="timed prefills per shape (median reported)")
    parser.add_argument("--graph-max-tokens", type=int, default=2048,
                        help="largest token bucket of the graphed prefill (0: eager only)")
    parser.add_argument("--peer", action="store_true",
                        help="also mamba_ssm's whole-model prefill (MambaLMHeadModel forward, last-token logits, "
                             "eager) with the same weights, side by side (pure Mamba-2 models, GPU)")
    parser.add_argument("--norm-pass", action="store_true",
                        help="the mixers' norm as its own pass (DecodeTricks.norm_in_scan off; pure Mamba-2 "
                             "models): the baseline of the deferred norm")
    parser.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default=None,
                        help="fp8: quantise the 16-bit model on load (as bench e2e --quantization); the floor counts "
                             "FP8 matrices' FLOPs (these, or an FP8 checkpoint's) at the FP8 matmul rate")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                        help="hybrids: the K/V page dtype (as bench e2e --kv-cache-dtype)")
    parser.add_argument("--json", metavar="PATH", help="append one JSON line per shape")


def _median_ms(fn, reps: int, cuda: bool, warmup: int = 3, setup=None) -> float:
    """Median wall ms of ``fn()`` over ``reps`` calls after ``warmup``; ``setup()`` (untimed) runs
    before every call when given."""
    times = []
    for i in range(warmup + reps):
        if setup is not None:
            setup()
        if i < warmup:
            fn()
            continue
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _peer_row(peer, model, ids: torch.Tensor, reps: int) -> tuple[float | None, float | None]:
    """The peer's median prefill ms for ``ids`` [B, L], and max |its last logits - ours| / max |ours|
    (the same weights; bf16 GEMMs blocked differently differ in the last bits); (None, None) when
    it fails (out of memory, a kernel error), which the row shows as a dash."""
    try:
        with torch.inference_mode():
            ms = _median_ms(lambda: peer(ids, num_last_tokens=1), reps, True)
            theirs = peer(ids, num_last_tokens=1).logits[:, -1].float()
            cache = model.new_cache(ids.shape[0])
            ours = model.prefill(ids, cache, cache.alloc(ids.shape[0])).float()
    except Exception as exc:  # noqa: BLE001 - one failed shape is a dash, not a failed run
        print(f"# mamba_ssm at {tuple(ids.shape)}: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
        return None, None
    return ms, float((theirs - ours).abs().max() / ours.abs().max().clamp_min(1e-12))


def load_peer(model, device: torch.device):
    """(mamba_ssm's MambaLMHeadModel with ``model``'s weights, '') or (None, why not)."""
    from fastmamba.bench import peers
    from fastmamba.bench.ops._base import MAMBA_SSM_CPU
    from fastmamba.models.mamba2_lm import Mamba2LM

    if not isinstance(model, Mamba2LM):
        return None, f"mamba_ssm has no {type(model).__name__}"
    if device.type != "cuda":
        return None, MAMBA_SSM_CPU
    peer = peers.mamba_ssm_lm_head_model()
    if not peer.available:
        return None, peer.reason
    try:
        lm = peer.fn(model.cfg, device, model.dtype)
        # the same weights: mamba_ssm names the embedding backbone.embedding
        state = {k.replace("backbone.embeddings.", "backbone.embedding."): v for k, v in model.state_dict().items()}
        missing, unexpected = lm.load_state_dict(state, strict=False)
        if missing:
            return None, f"its parameters {missing[:3]} have no counterpart in ours"
    except Exception as exc:  # noqa: BLE001 - a peer that cannot be built is reported, not fatal
        return None, f"{type(exc).__name__}: {exc}"
    return lm, f"mamba_ssm {peer.version} ({peer.source})"


def run(args: argparse.Namespace, command: str) -> int:
    import fastmamba
    from fastmamba.bench.peak import (device_name, measure_copy_bandwidth, measure_fp8_matmul_tflops,
                                      measure_matmul_tflops)
    from fastmamba.bench.prefill_floor import prefill_work

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    name = args.model or ("mamba2-2.7b" if cuda else "mamba2-tiny")
    shapes = args.shapes or (_shapes(DEFAULT_SHAPES) if cuda else [(2, 5)])
    reps = args.reps if cuda else 1
    if not cuda:
        print("no GPU: the tiny preset on the CPU (Triton interpreter if TRITON_INTERPRET=1); these timings "
              "say nothing about GPU speed", file=sys.stderr)
    copy_gbs = measure_copy_bandwidth(device)
    mm_tflops = measure_matmul_tflops(device)
    model = fastmamba.load_model(name, device=device, quantization=args.quantization)
    try:
        kv = set_kv_cache_dtype(model, args.kv_cache_dtype)
    except ValueError as exc:
        print(f"error: --kv-cache-dtype: {exc}", file=sys.stderr)
        return 2
    if args.norm_pass:
        if not hasattr(model, "set_decode_tricks"):
            print(f"error: --norm-pass needs a pure Mamba-2 model; {name} has no such switch", file=sys.stderr)
            return 2
        model.set_decode_tricks(norm_in_scan=False)
    one_token = prefill_work(model, 1, 1)
    fp8 = one_token.flops_8 > 0  # FP8 matrices: quantised here (--quantization fp8) or shipped by the checkpoint
    fp8_tflops = measure_fp8_matmul_tflops(device) if fp8 else None
    fp8_txt = f", FP8 matmul {fp8_tflops:.0f} TFLOP/s" if fp8_tflops else ""
    print(f"# ttft: {name} ({one_token.active_params / 1e9:.2f} B active matrix params, {model.dtype}"
          f"{', FP8 weights' if fp8 else ''}{f', K/V {kv}' if kv else ''}), {device_name(device)}, "
          f"copy {copy_gbs:.0f} GB/s, matmul {mm_tflops:.0f} TFLOP/s{fp8_txt}, median of {reps} warm prefills; "
          f"command: {command}")
    peer, peer_note = load_peer(model, device) if args.peer else (None, "")
    if args.peer:
        print(f"# peer: {peer_note if peer is not None else 'mamba_ssm unavailable: ' + peer_note}; its MambaLMHeadModel "
              "forward with our weights, last-token logits only, eager (Mamba-2 layers on its unfused path: "
              "nn.Conv1d, then its Triton scan and norms)")
    head = f"{'B x L':>9}  {'eager ms':>9}  {'graphed ms':>10}  {'floor ms':>8}  {'eager/floor':>11}  {'graphed/floor':>13}"
    if peer is not None:
        head += f"  {'mamba_ssm ms':>12}  {'vs mamba_ssm':>12}  {'logits diff':>11}"
    print(head)
    g = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for b, length in shapes:
        ids = torch.randint(0, model.cfg.vocab_size, (b, length), generator=g)
        # a hybrid's cache holds K/V pages that every prefill appends to: each timed prefill gets
        # fresh slots (taken and given back outside the timing); a Mamba-2 cache is overwritten
        paged = model.cfg.paged_cache
        cache = model.new_cache(b, max_seq_len=max(4096, length)) if paged else model.new_cache(b)
        held = {"slots": cache.take(b)}
        slots = torch.tensor(held["slots"], dtype=torch.int32, device=device)

        def fresh_slots() -> None:
            cache.free(held["slots"])
            held["slots"] = cache.take(b)
            slots.copy_(torch.tensor(held["slots"], dtype=torch.int32))

        setup = fresh_slots if paged else None
        ids_dev = ids.to(device)
        eager = _median_ms(lambda: model.prefill(ids_dev, cache, slots), reps, cuda, warmup=3 if cuda else 0,
                           setup=setup)
        graphed = None
        if cuda and args.graph_max_tokens:
            from fastmamba.generation.prefill_graphs import GraphedPrefill

            gp = GraphedPrefill(model, cache, max_tokens=args.graph_max_tokens, max_requests=b)
            if gp.fits([length] * b):
                prompts = ids.tolist()
                graphed = _median_ms(lambda: gp.prefill(prompts, held["slots"], False), reps, cuda, warmup=3,
                                     setup=setup)
            del gp
        work = prefill_work(model, b, length)
        floor = work.floor_ms(copy_gbs, mm_tflops, fp8_tflops)
        row = {"model": name, "batch": b, "length": length, "eager_ms": eager, "graphed_ms": graphed,
               "floor_ms": floor, "device": device_name(device), "command": command,
               "norm_in_scan": not args.norm_pass, "quantization": args.quantization, "kv_cache": kv,
               "weight_bytes": work.weight_bytes, "flops_16": work.flops_16, "flops_8": work.flops_8,
               "copy_gbs": copy_gbs, "matmul_tflops": mm_tflops, "fp8_matmul_tflops": fp8_tflops}
        ptxt = ""
        if peer is not None:
            peer_ms, diff = _peer_row(peer, model, ids_dev, reps)
            best = min(eager, graphed) if graphed is not None else eager
            row.update(peer_ms=peer_ms, logits_rel_diff=diff)
            ptxt = (f"  {peer_ms:12.2f}  {peer_ms / best:11.2f}x  {diff:11.1e}" if peer_ms is not None
                    else f"  {'—':>12}  {'—':>12}  {'—':>11}")
        rows.append(row)
        gtxt = f"{graphed:10.2f}" if graphed is not None else f"{'—':>10}"
        grat = f"{graphed / floor:12.1f}x" if graphed is not None else f"{'—':>13}"
        print(f"{b:>4} x {length:<4}  {eager:9.2f}  {gtxt}  {floor:8.2f}  {eager / floor:10.1f}x  {grat}{ptxt}", flush=True)
        cache = slots = None  # (the closures above are done with them)
        if cuda:
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return 0
