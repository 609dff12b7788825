"""Target ``e2e``: end-to-end prefill and decode speed of a Mamba-2 LM against the bandwidth roofline.

    python -m fastmamba.bench e2e [--model mamba2-2.7b] [--batch 1,8,64,256] [--prompt-len 128]
                                  [--gen-len 256] [--no-pdl] [--peer] [--json PATH] [--plot PATH]
                                  [--speculate K [--drafter oracle|ngram|model] [--draft-model M]
                                   [--repetitive-prompt]]
                                  [--ssm-dtype fp32,fp16,bf16] [--stochastic-rounding] [--drift N]

Per batch size B: B random prompts are prefilled into their cache slots (timed), then ``gen-len``
greedy decode steps run as CUDA-graph replays (argmax on the GPU, no host sync inside the timed
loop; programmatic dependent launch inside the graphs where the GPU has it, unless ``--no-pdl``). The roofline of one decode step is the bytes it must move, over the device-to-device copy
bandwidth measured in the same run: every weight once (tied embeddings once; of an untied input
embedding table only the B tokens' rows) plus each layer's conv and SSM state rows of the B requests
read and written once. With ``--peer``, Hugging Face
transformers' Mamba2ForCausalLM runs the same weights (its plain PyTorch path) at batch 1.
Without a GPU it says so and runs the tiny preset eagerly on the CPU.

Hybrid models (``--model nemotron-h-8b``, ``nemotron-h-4b``, ``nemotron-h-tiny`` or a Nemotron-H
checkpoint): the prompts default to 2048 tokens (the decode cost now depends on the context), the
prefill runs in groups of at most ``e2e_runs.HYBRID_PREFILL_TOKENS`` tokens (its time is the batch's
time to first token: every prompt arrives at once), and each decode step first grows the paged KV on the
host (``HybridCache.grow``, as the engine does), then replays the CUDA graph. The roofline bytes
of a step add, per request, the attention layers' K/V read over the mean context of the timed
steps (plus the new token's K/V written) to the weights and the Mamba layers' conv and SSM states
read and written. ``--peer``: transformers' NemotronHForCausalLM.generate on the same weights at
batch 1 (a few tokens: it is slow). ``--speculate K`` (oracle or ngram drafter) as for Mamba-2: the
engine's speculative run against the plain graphed loop, same tokens expected. --drift and
--ablate are Mamba-2 only.

With ``--speculate K`` the plain run of each batch B is also the baseline of speculative decoding:
its greedy tokens are kept (the oracle drafter replays them), then ``Engine(model, max_batch=B,
speculate=K, drafter=...)`` generates as many tokens from the same prompts (its first step, the
prefill, untimed; on a GPU after an untimed warm-up run that captures its graphs). A second table
reports speculative decode tok/s, the speedup over plain decoding, the acceptance rate (accepted
drafts over proposed ones), the mean tokens emitted per request per verify step, and whether the
tokens equal the plain run's (greedy: they should; in bf16 the verify kernels' rounding can flip a
near-tie of a random-weight model's flat logits, after which the tokens differ and the oracle's
drafts are rejected: fp32 runs match exactly). Drafters:
``oracle`` (every draft accepted: the upper bound), ``ngram`` (prompt lookup; prompts are a random
block of 16 tokens repeated unless ``--no-repetitive-prompt``), ``model`` (``--draft-model``,
default mamba2-130m on a GPU and the target itself on a CPU).

16-bit SSM states: ``--ssm-dtype`` lists the state dtypes to time (default fp32); each 16-bit one runs
with round to nearest, or with stochastic rounding under ``--stochastic-rounding`` (the seeds advance
in place before every step, inside the timed loop, as the engine does). ``--drift N`` runs both
roundings for every 16-bit dtype listed, next to an fp32-state run, and adds a second measurement:
``DRIFT_BATCH`` requests generate N greedy tokens with an fp32 state, and every 16-bit variant decodes
the same tokens (teacher forced, in lockstep, each with its own cache) while its logits are compared
with the fp32 run's at every step: relative error ``max|l - l_fp32| / max|l_fp32|`` per request and
step (max and mean over all), and the first step whose argmax differs from the fp32 run's token.

This module holds the command line and its flow; the parts live beside it: ``e2e_bytes`` (the
roofline's byte counts), ``e2e_runs`` (prompts and the timed runs), ``e2e_spec`` (the speculative
run), ``e2e_peers`` (transformers on the same weights), ``e2e_report`` (tables, JSON lines, plot).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from fastmamba.bench.e2e_bytes import hybrid_step_bytes, moe_layers, step_bytes
from fastmamba.bench.e2e_peers import run_peer, run_peer_hybrid
from fastmamba.bench.e2e_report import (append_json, plot_decode, print_decode_table, print_drift_table,
                                        print_hybrid_table, print_spec_table)
from fastmamba.bench.e2e_runs import (DTYPES, LOGIT_POSITIONS, REPEAT_BLOCK, fp8_logit_error, last_logits, make_prompts,
                                      run_batch, run_batch_hybrid, run_drift, state_label, state_variants)
from fastmamba.bench.e2e_spec import DRAFTERS, make_bench_drafter, run_speculative
from fastmamba.bench.kernels import _int_list
from fastmamba.models.quantization import KV_CACHE_DTYPES, QUANTIZATION_CHOICES, set_kv_cache_dtype

DRIFT_BATCH = 4  # requests of the drift measurement


def _dtype_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in DTYPES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {sorted(DTYPES)}, got {text!r}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="preset or checkpoint dir (default: mamba2-2.7b on a GPU, mamba2-tiny on a CPU)")
    parser.add_argument("--batch", type=_int_list, default=None, help="default 1,8,64,256 on a GPU, 1,2 on a CPU")
    parser.add_argument("--prompt-len", type=int, default=None,
                        help="prompt tokens (default 128; 2048 for hybrid models, whose decode reads the context)")
    parser.add_argument("--gen-len", type=int, default=256)
    parser.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=None,
                        help="programmatic dependent launch inside the decode graphs (default: on where the GPU "
                             "has it, sm_90+; --no-pdl turns it off)")
    parser.add_argument("--peer", action="store_true", help="also time transformers' Mamba2ForCausalLM at batch 1")
    parser.add_argument("--ablate", action="store_true",
                        help="also time batch 1 with each decode trick switched off, and with PDL switched")
    parser.add_argument("--json", metavar="PATH", help="append one JSON line per row")
    parser.add_argument("--plot", metavar="PATH", help="PNG of decode tok/s vs batch (needs matplotlib)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="model weights and activations (default: the loader's, bf16 on a GPU)")
    parser.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default=None,
                        help="fp8: quantise the 16-bit model on load (load_model(..., quantization='fp8'): per-channel "
                             "e4m3 weights, dynamic per-token activations), to set FP8 decode beside bf16")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                        help="hybrids: the K/V page dtype (default: the checkpoint's, fp8 e4m3 when it ships k_scale / "
                             "v_scale; fp8: e4m3 pages at scale 1.0 on a preset, half the K/V bytes the roofline counts)")
    parser.add_argument("--verify-path", choices=("auto", "replay", "legacy"), default="auto",
                        help="with --speculate: the engine's verify path (auto: per step from the measured "
                        "crossover table, fastmamba.generation.spec_policy)")
    parser.add_argument("--speculate", type=int, default=0, metavar="K",
                        help="also run speculative decoding with K drafts per step against the plain run (0 = off)")
    parser.add_argument("--drafter", choices=DRAFTERS, default="oracle",
                        help="with --speculate: oracle = replay the plain run (default; every draft accepted), "
                             "ngram = prompt lookup, model = greedy drafts of --draft-model, "
                             "mtp = the checkpoint's MTP layer (hybrids with one: nemotron-3-nano-mtp)")
    parser.add_argument("--draft-model", metavar="DIR|PRESET", default=None,
                        help="with --drafter model (default: mamba2-130m on a GPU, the target on a CPU)")
    parser.add_argument("--ssm-dtype", type=_dtype_list, default=["fp32"], metavar="LIST",
                        help="SSM state dtypes to time, comma-separated from fp32,fp16,bf16 (default fp32)")
    parser.add_argument("--stochastic-rounding", action="store_true",
                        help="16-bit states stored with stochastic rounding (default: round to nearest)")
    parser.add_argument("--drift", type=int, default=0, metavar="N",
                        help="time every 16-bit --ssm-dtype with and without stochastic rounding next to fp32, "
                             f"and report the logits' drift from an fp32-state run over N greedy tokens "
                             f"({DRIFT_BATCH} requests, teacher forced)")
    parser.add_argument("--repetitive-prompt", action=argparse.BooleanOptionalAction, default=None,
                        help=f"prompts made of a random block of {REPEAT_BLOCK} tokens repeated "
                             "(default: on with --drafter ngram, off otherwise)")


def is_hybrid(model) -> bool:
    """A model whose cache pages K/V (Nemotron-H: Mamba-2, attention and MLP layers)."""
    return model.cfg.paged_cache


def _label_row(r: dict, batch: int, label: str, copy_gbs: float) -> dict:
    """A timed decode row's provider (its state label) and roofline columns; logs its ms/step."""
    r["provider"] = "fastmamba" if label == "fp32" else f"fastmamba [{label} state]"
    r["roofline_ms"] = 1e3 * r["step_bytes"] / (copy_gbs * 1e9)
    r["pct_roofline"] = 100 * r["roofline_ms"] / r["ms_per_step"]
    print(f"[e2e] batch {batch}, {label} state: {r['ms_per_step']:.3f} ms/step", file=sys.stderr, flush=True)
    return r


def _is_hybrid_dir(name: str) -> bool:
    import os

    path = os.path.join(name, "config.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        return json.load(f).get("model_type") == "nemotron_h"


def _run_hybrid(args, model, name, batches, prompt_len, gen_len, variants, copy_gbs, header, device, command) -> int:
    """The e2e table of a hybrid model: decode tok/s, ms/step, % of roofline, TTFT per batch."""
    from fastmamba.bench.peak import device_name

    cuda = device.type == "cuda"
    c = model.cfg
    print(f"# hybrid: {c.pattern.count('M')} Mamba / {c.pattern.count('*')} attention / "
          f"{c.pattern.count('-')} MLP" + (f" / {c.pattern.count('E')} MoE" if "E" in c.pattern else "")
          + f" layers, context {prompt_len}"
          + ("; roofline bytes count the routed experts each step touched (experts/layer: distinct, "
             "mean over MoE layers)" if "E" in c.pattern else ""))
    rows, spec_rows = [], []
    K = args.speculate
    for b in batches:
        prompts = make_prompts(c.vocab_size, b, prompt_len, repetitive=K > 0 and args.drafter == "ngram")
        for v, (ssm_dtype, _) in enumerate(variants):
            if _:
                print("note: --stochastic-rounding is not timed for hybrid models; round to nearest", file=sys.stderr)
            r = run_batch_hybrid(model, b, prompt_len, gen_len, pdl=args.pdl, device=device, prompts=prompts,
                                 ssm_dtype=ssm_dtype, record=bool(K) and v == 0)
            if v == 0:
                plain, plain_tokens = r, r.pop("tokens", None)
            rows.append(_label_row(r, b, state_label(ssm_dtype, False), copy_gbs))
            if cuda:
                torch.cuda.empty_cache()
        if K:
            if args.drafter == "model":
                print("error: --drafter model is not wired for hybrid models; use oracle or ngram", file=sys.stderr)
                return 2
            drafter = make_bench_drafter(args.drafter, prompts=prompts.tolist(), plain_tokens=plain_tokens,
                                         draft_model=model if args.drafter == "mtp" else None, batch=b,
                                         vocab_size=c.vocab_size, max_seq_len=prompt_len + gen_len + 2 * K + 8)
            sr = run_speculative(model, prompts, plain_tokens, gen_len, K, drafter, device=device, pdl=args.pdl,
                                 verify_path=args.verify_path,
                                 engine_kw={"max_seq_len": prompt_len + gen_len + K + 8})
            sr.update(provider=f"fastmamba speculative K={K} ({args.drafter})", drafter=args.drafter,
                      prompt_len=prompt_len, gen_len=gen_len, plain_decode_tok_s=plain["decode_tok_s"],
                      speedup=sr["decode_tok_s"] / plain["decode_tok_s"])
            spec_rows.append(sr)
            print(f"[e2e] batch {b} speculative: {sr['decode_tok_s']:.0f} tok/s, acceptance "
                  f"{sr['acceptance']:.0%}, first token off the plain run's per request: {sr['first_mismatch'][:8]}",
                  file=sys.stderr, flush=True)
            if cuda:
                torch.cuda.empty_cache()
    if args.peer:
        peer_gen = min(gen_len, 16) if cuda else min(gen_len, 4)
        peer = run_peer_hybrid(model, prompt_len, peer_gen, device)
        if peer:
            # its timed decode steps (generate's tokens after the first) read prompt_len .. prompt_len + peer_gen - 2
            peer_context = prompt_len + max(peer_gen - 2, 0) / 2
            peer["step_bytes"] = hybrid_step_bytes(model, 1, peer_context)
            peer["roofline_ms"] = 1e3 * peer["step_bytes"] / (copy_gbs * 1e9)
            peer["pct_roofline"] = 100 * peer["roofline_ms"] / peer["ms_per_step"]
            rows.append(peer)
            ours = next((r for r in rows if r["batch"] == 1 and r["provider"] == "fastmamba"), None)
            if ours:
                peer["fastmamba_speedup"] = ours["decode_tok_s"] / peer["decode_tok_s"]
    print_hybrid_table(rows, moe=bool(moe_layers(model)))
    print_spec_table(spec_rows, hybrid=True)
    if args.json:
        append_json(args.json, rows + spec_rows, model=name, device=device_name(device), copy_gbs=copy_gbs,
                    quantization=args.quantization, kv_cache=args.kv_cache, command=command)
    if args.plot:
        print("--plot: not drawn for hybrid models", file=sys.stderr)
    return 0


def run(args: argparse.Namespace, command: str) -> int:
    import fastmamba
    from fastmamba.bench.peak import device_name, measure_copy_bandwidth

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    name = args.model or ("mamba2-2.7b" if cuda else "mamba2-tiny")
    batches = args.batch or ([1, 8, 64, 256] if cuda else [1, 2])
    gen_len = args.gen_len if cuda else min(args.gen_len, 16)
    hybrid_name = name.startswith("nemotron") or _is_hybrid_dir(name)
    prompt_len = args.prompt_len or (2048 if hybrid_name else 128)
    prompt_len = prompt_len if cuda else min(prompt_len, 16)
    if hybrid_name and (args.drift or args.ablate):
        print("error: --drift and --ablate are not implemented for hybrid (Nemotron-H) models yet",
              file=sys.stderr)
        return 2
    if not cuda:
        print("no GPU: running the tiny preset eagerly on the CPU (Triton interpreter if TRITON_INTERPRET=1); "
              "these timings say nothing about GPU speed", file=sys.stderr)
    K = args.speculate
    if K < 0:
        print(f"error: --speculate expects K >= 0, got {K}", file=sys.stderr)
        return 2
    repetitive = args.repetitive_prompt if args.repetitive_prompt is not None else (K > 0 and args.drafter == "ngram")
    try:
        variants = state_variants(args.ssm_dtype, args.stochastic_rounding, args.drift)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    copy_gbs = measure_copy_bandwidth(device)
    model = fastmamba.load_model(name, device=device, dtype=DTYPES[args.dtype] if args.dtype else None,
                                 quantization=args.quantization)
    try:
        args.kv_cache = set_kv_cache_dtype(model, getattr(args, "kv_cache_dtype", None))  # the caches' page dtype
    except ValueError as exc:
        print(f"error: --kv-cache-dtype: {exc}", file=sys.stderr)
        return 2
    draft_model, draft_name = None, None
    if K and args.drafter == "model":
        from fastmamba.generation.drafters import check_draft_vocab

        draft_name = args.draft_model or ("mamba2-130m" if cuda else name)
        draft_model = fastmamba.load_model(draft_name, dtype=model.dtype, device=device)
        try:
            check_draft_vocab(draft_model.cfg.vocab_size, model.cfg.vocab_size)
        except ValueError as exc:
            print(f"error: --draft-model {draft_name}: {exc}", file=sys.stderr)
            return 2
    if args.pdl is None:
        from fastmamba.ops.runtime import pdl_supported

        args.pdl = cuda and pdl_supported(torch.empty(0, device=device))
    header = (f"# e2e decode: {name} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params, "
              f"{model.dtype}{', FP8 weights' if args.quantization else ''}), {device_name(device)}, copy {copy_gbs:.0f} GB/s, prompt {prompt_len}, "
              f"gen {gen_len}, CUDA graphs {'on' if cuda else 'off'}, PDL {'on' if args.pdl else 'off'}; "
              f"command: {command}")
    if is_hybrid(model):
        header += f"; K/V pages {args.kv_cache}"
    if K:
        header += (f"; speculate K={K}, drafter {args.drafter}"
                   f"{f' ({draft_name})' if draft_name else ''}, {'repetitive' if repetitive else 'random'} prompts")
    print(header)
    rows, spec_rows = [], []
    if args.quantization:  # the FP8 model's logits now, the 16-bit model's once the FP8 one is freed (the end)
        logit_ids = make_prompts(model.cfg.vocab_size, 1, max(min(prompt_len, 128), LOGIT_POSITIONS)).to(device)
        fp8_logits = last_logits(model, logit_ids)
    if is_hybrid(model):
        rc = _run_hybrid(args, model, name, batches, prompt_len, gen_len, variants, copy_gbs, header, device,
                         command)
        if rc == 0 and args.quantization:
            del model
            _report_fp8_logits(args, name, fp8_logits, logit_ids, device, command)
        return rc
    for b in batches:
        prompts = make_prompts(model.cfg.vocab_size, b, prompt_len, repetitive=repetitive)
        for v, (ssm_dtype, rounding) in enumerate(variants):  # the first one is speculation's baseline
            rv = run_batch(model, b, prompt_len, gen_len, pdl=args.pdl, device=device, prompts=prompts,
                           record=bool(K) and v == 0, ssm_dtype=ssm_dtype, stochastic_rounding=rounding)
            rows.append(_label_row(rv, b, state_label(ssm_dtype, rounding), copy_gbs))
            if v == 0:
                r, plain_tokens = rv, rv.pop("tokens", None)
            if cuda:
                torch.cuda.empty_cache()
        if K:
            if cuda:
                torch.cuda.empty_cache()  # the plain run's cache and graphs
            drafter = make_bench_drafter(args.drafter, prompts=prompts.tolist(), plain_tokens=plain_tokens,
                                         draft_model=draft_model, batch=b, vocab_size=model.cfg.vocab_size)
            sr = run_speculative(model, prompts, plain_tokens, gen_len, K, drafter, device=device, pdl=args.pdl,
                                 verify_path=args.verify_path)
            sr.update(provider=f"fastmamba speculative K={K} ({args.drafter})", drafter=args.drafter,
                      draft_model=draft_name, repetitive_prompt=repetitive, prompt_len=prompt_len, gen_len=gen_len,
                      plain_decode_tok_s=r["decode_tok_s"], speedup=sr["decode_tok_s"] / r["decode_tok_s"])
            spec_rows.append(sr)
            del drafter
            if cuda:
                torch.cuda.empty_cache()
            print(f"[e2e] batch {b} speculative: {sr['decode_tok_s']:.0f} tok/s, acceptance "
                  f"{sr['acceptance']:.0%}", file=sys.stderr, flush=True)
    drift_rows = []
    if args.drift:
        prompts = make_prompts(model.cfg.vocab_size, DRIFT_BATCH, prompt_len)
        drift_rows = run_drift(model, prompts, args.drift if cuda else min(args.drift, 16), variants, device=device,
                               pdl=args.pdl)
        for d in drift_rows:
            d["provider"] = "fastmamba drift"
    if args.ablate:
        variants = [("all tricks on", {}, args.pdl), ("A = -exp(A_log) in PyTorch", {"A_in_kernel": False}, args.pdl),
                    ("silu(z) gate in the norm", {"gate_in_scan": False}, args.pdl),
                    ("conv update in PyTorch ops", {"fused_conv": False}, args.pdl),
                    ("projections in cuBLAS", {"triton_gemv": False}, args.pdl)]
        if cuda:  # (the CPU runs no graphs)
            variants.append(("all on, PDL off" if args.pdl else "all on, PDL on", {}, not args.pdl))
        print(f"{'ablation (batch 1)':34} {'ms/step':>9} {'tok/s':>8} {'vs all on':>10}")
        base = None
        for label, switches, pdl in variants:
            model.set_decode_tricks(**switches)
            r = run_batch(model, 1, prompt_len, gen_len, pdl=pdl, device=device)
            base = base or r["ms_per_step"]
            print(f"{label:34} {r['ms_per_step']:9.3f} {r['decode_tok_s']:8.0f} "
                  f"{100 * (r['ms_per_step'] / base - 1):+9.1f}%")
            rows.append(dict(r, provider=f"fastmamba [{label}]", roofline_ms=1e3 * r["step_bytes"] / (copy_gbs * 1e9),
                             pct_roofline=100 * r["step_bytes"] / (copy_gbs * 1e9) * 1e3 / r["ms_per_step"]))
        model.set_decode_tricks()
    if args.peer and cuda:
        peer = run_peer(model, prompt_len, min(gen_len, 64), device)
        if peer:
            peer["roofline_ms"] = 1e3 * step_bytes(model, 1) / (copy_gbs * 1e9)
            peer["pct_roofline"] = 100 * peer["roofline_ms"] / peer["ms_per_step"]
            rows.append(peer)
    print_decode_table(rows)
    print_spec_table(spec_rows, hybrid=False)
    print_drift_table(drift_rows)
    if args.json:
        append_json(args.json, rows + spec_rows + drift_rows, model=name, device=device_name(device),
                    copy_gbs=copy_gbs, quantization=args.quantization, command=command)
    if args.plot:
        plot_decode(args.plot, rows, f"{name}, {device_name(device)}")
    if args.quantization:
        del model
        _report_fp8_logits(args, name, fp8_logits, logit_ids, device, command)
    return 0


def _report_fp8_logits(args, name, fp8_logits, ids, device, command) -> None:
    """Free the FP8 model (the caller dropped its reference), load the same preset or checkpoint in 16
    bits, print and record the logits' relative error (``e2e_runs.fp8_logit_error``)."""
    import gc

    import fastmamba
    from fastmamba.bench.peak import device_name

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    dtype = DTYPES[args.dtype] if args.dtype else None
    row = fp8_logit_error(fp8_logits, lambda: fastmamba.load_model(name, device=device, dtype=dtype), ids, device)
    if "skipped" in row:
        print(f"# FP8 vs 16-bit logits: not measured: {row['skipped']}")
    else:
        print(f"# FP8 vs 16-bit logits (same weights, the last {row['positions']} positions of a {row['prompt_len']}-token "
              f"prompt): relative error {row['rel_err_norm']:.4f} in norm, {row['rel_err_max']:.4f} max |diff| / max |l|")
    if args.json:
        append_json(args.json, [row], model=name, device=device_name(device), quantization=args.quantization,
                    command=command)
