"""Target ``e2e``: end-to-end prefill and decode speed of a Mamba-2 LM against the bandwidth roofline.

    python -m fastmamba.bench e2e [--model mamba2-2.7b] [--batch 1,8,64,256] [--prompt-len 128]
                                  [--gen-len 256] [--pdl] [--peer] [--json PATH] [--plot PATH]

Per batch size B: B random prompts are prefilled into their cache slots (timed), then ``gen-len``
greedy decode steps run as CUDA-graph replays (argmax on the GPU, no host sync inside the timed
loop). The roofline of one decode step is the bytes it must move, over the device-to-device copy
bandwidth measured in the same run: every weight once (tied embeddings once) plus each layer's
conv and SSM state rows of the B requests read and written once. With ``--peer``, Hugging Face
transformers' Mamba2ForCausalLM runs the same weights (its plain PyTorch path) at batch 1.
Without a GPU it says so and runs the tiny preset eagerly on the CPU.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from fastmamba.bench.kernels import _int_list


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="preset or checkpoint dir (default: mamba2-2.7b on a GPU, mamba2-tiny on a CPU)")
    parser.add_argument("--batch", type=_int_list, default=None, help="default 1,8,64,256 on a GPU, 1,2 on a CPU")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=256)
    parser.add_argument("--pdl", action="store_true", help="programmatic dependent launch inside the decode graphs")
    parser.add_argument("--peer", action="store_true", help="also time transformers' Mamba2ForCausalLM at batch 1")
    parser.add_argument("--ablate", action="store_true",
                        help="also time batch 1 with each decode trick switched off, and with PDL on")
    parser.add_argument("--json", metavar="PATH", help="append one JSON line per row")
    parser.add_argument("--plot", metavar="PATH", help="PNG of decode tok/s vs batch (needs matplotlib)")


def step_bytes(model, batch: int) -> int:
    """Minimum bytes of one decode step: weights once, plus the B requests' state rows read + written."""
    seen, weights = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            weights += p.numel() * p.element_size()
    c = model.cfg
    conv = 2 * batch * c.conv_dim * c.d_conv * model.dtype.itemsize
    ssm = 2 * batch * c.nheads * c.headdim * c.d_state * 4  # fp32 state
    return weights + c.n_layer * (conv + ssm)


def _timed(fn, device) -> float:
    """Seconds for fn(), synchronised."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def run_batch(model, batch: int, prompt_len: int, gen_len: int, *, pdl: bool, device) -> dict:
    g = torch.Generator(device="cpu").manual_seed(batch)
    prompts = torch.randint(0, model.cfg.vocab_size, (batch, prompt_len), generator=g).to(device)
    cache = model.new_cache(batch)
    slots = cache.alloc(batch)
    model.prefill(prompts[:, :8], cache, slots)  # compile and warm up, then start from zero states
    for conv, ssm in zip(cache.conv, cache.ssm):
        conv.zero_()
        ssm.zero_()
    last = {}
    t_prefill = _timed(lambda: last.setdefault("logits", model.prefill(prompts, cache, slots)), device)
    tokens = last["logits"].argmax(-1)  # the first token to decode

    if device.type == "cuda":
        from fastmamba.generation.cuda_graphs import GraphedDecoder

        decoder = GraphedDecoder(model, cache, batch, pdl=pdl)

        def step(t):
            return decoder.decode(t, slots).argmax(-1)
    else:
        def step(t):
            return model.decode(t, cache, slots).argmax(-1)

    for _ in range(3):  # capture + warm up
        tokens = step(tokens)
    state = {"t": tokens}

    def loop():
        t = state["t"]
        for _ in range(gen_len):
            t = step(t)
        state["t"] = t

    t_decode = _timed(loop, device)
    return {
        "batch": batch,
        "prefill_s": t_prefill,
        "prefill_tok_s": batch * prompt_len / t_prefill,
        "ms_per_step": 1e3 * t_decode / gen_len,
        "decode_tok_s": batch * gen_len / t_decode,
        "step_bytes": step_bytes(model, batch),
    }


def run_peer(model, prompt_len: int, gen_len: int, device) -> dict | None:
    """transformers' Mamba2ForCausalLM on the same weights, batch 1, greedy (its PyTorch path)."""
    try:
        import transformers
    except ImportError as exc:
        print(f"peer skipped: {exc}", file=sys.stderr)
        return None
    c = model.cfg
    hf_cfg = transformers.Mamba2Config(
        hidden_size=c.d_model, num_hidden_layers=c.n_layer, num_heads=c.nheads, head_dim=c.headdim,
        expand=c.expand, state_size=c.d_state, n_groups=c.ngroups, vocab_size=c.vocab_size,
        conv_kernel=c.d_conv, chunk_size=c.chunk_size, tie_word_embeddings=c.tie_embeddings,
        use_conv_bias=c.conv_bias, use_bias=c.proj_bias, layer_norm_epsilon=c.norm_eps,
    )
    with torch.device("meta"):
        hf = transformers.Mamba2ForCausalLM(hf_cfg)
    hf.load_state_dict(model.state_dict(), assign=True, strict=False)
    hf = hf.to(device=device, dtype=model.dtype).eval()
    ids = torch.randint(0, c.vocab_size, (1, prompt_len), device=device)
    kw = dict(max_new_tokens=gen_len, min_new_tokens=gen_len, do_sample=False, use_cache=True)
    with torch.no_grad():
        hf.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up
        t_total = _timed(lambda: hf.generate(ids, **kw), device)
        t_prefill = _timed(lambda: hf(ids), device)
    t_decode = max(t_total - t_prefill, 1e-9)
    return {"batch": 1, "provider": f"transformers {transformers.__version__} (torch path)",
            "ms_per_step": 1e3 * t_decode / gen_len, "decode_tok_s": gen_len / t_decode}


def run(args: argparse.Namespace, command: str) -> int:
    import fastmamba
    from fastmamba.bench.peak import device_name, measure_copy_bandwidth

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    name = args.model or ("mamba2-2.7b" if cuda else "mamba2-tiny")
    batches = args.batch or ([1, 8, 64, 256] if cuda else [1, 2])
    gen_len = args.gen_len if cuda else min(args.gen_len, 16)
    prompt_len = args.prompt_len if cuda else min(args.prompt_len, 16)
    if not cuda:
        print("no GPU: running the tiny preset eagerly on the CPU (Triton interpreter if TRITON_INTERPRET=1); "
              "these timings say nothing about GPU speed", file=sys.stderr)
    copy_gbs = measure_copy_bandwidth(device)
    model = fastmamba.load_model(name, device=device)
    header = (f"# e2e decode: {name} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params, "
              f"{model.dtype}), {device_name(device)}, copy {copy_gbs:.0f} GB/s, prompt {prompt_len}, "
              f"gen {gen_len}, CUDA graphs {'on' if cuda else 'off'}, PDL {'on' if args.pdl else 'off'}; "
              f"command: {command}")
    print(header)
    rows = []
    for b in batches:
        r = run_batch(model, b, prompt_len, gen_len, pdl=args.pdl, device=device)
        r["provider"] = "fastmamba"
        r["roofline_ms"] = 1e3 * r["step_bytes"] / (copy_gbs * 1e9)
        r["pct_roofline"] = 100 * r["roofline_ms"] / r["ms_per_step"]
        rows.append(r)
        print(f"[e2e] batch {b}: {r['ms_per_step']:.3f} ms/step", file=sys.stderr, flush=True)
    if args.ablate:
        variants = [("all tricks on", {}, False), ("A recomputed every step", {"cache_A": False}, False),
                    ("silu(z) gate in the norm", {"gate_in_scan": False}, False),
                    ("conv update in PyTorch ops", {"fused_conv": False}, False), ("all on + PDL", {}, True)]
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
    print(f"{'provider':42} {'batch':>5} {'prefill tok/s':>14} {'ms/step':>9} {'decode tok/s':>13} "
          f"{'roofline ms':>12} {'% roofline':>10}")
    for r in rows:
        pre = f"{r['prefill_tok_s']:14.0f}" if "prefill_tok_s" in r else f"{'—':>14}"
        print(f"{r['provider']:42} {r['batch']:5d} {pre} {r['ms_per_step']:9.3f} {r['decode_tok_s']:13.0f} "
              f"{r['roofline_ms']:12.3f} {r['pct_roofline']:9.0f}%")
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(dict(r, model=name, device=device_name(device), copy_gbs=copy_gbs,
                                        command=command)) + "\n")
    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("--plot needs matplotlib; skipped", file=sys.stderr)
        else:
            ours = [r for r in rows if r["provider"] == "fastmamba"]
            fig, ax = plt.subplots(figsize=(6, 4))
            ax.plot([r["batch"] for r in ours], [r["decode_tok_s"] for r in ours], "o-", label="fastmamba")
            ax.plot([r["batch"] for r in ours], [r["batch"] * 1e3 / r["roofline_ms"] for r in ours], "--",
                    label="bandwidth roofline")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("batch")
            ax.set_ylabel("decode tokens / s")
            ax.set_title(f"{name}, {device_name(device)}")
            ax.legend()
            fig.tight_layout()
            fig.savefig(args.plot, dpi=120)
    return 0
