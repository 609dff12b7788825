"""Target ``mtp``: speculative decoding with the checkpoint's MTP layer, cost-faithful oracle mode.

    python -m fastmamba.bench mtp [--model nemotron-3-nano-mtp] [--k 1,2,3,5,7] [--batch 1]
                                  [--prompt-len 512] [--steps 64] [--accept-length 3.7 --accept-at 7]
                                  [--path replay] [--ssm-dtype fp32] [--no-graphs] [--json PATH]

Random weights accept almost nothing, so the speed of MTP drafting is measured in a **cost-faithful
oracle** mode: every step runs the MTP drafter's full compute (``MTPDrafter.propose_device``: the
catch-up over the accepted positions, then k-1 chained MTP steps, each with the shared lm_head), the verify of
T = k+1 tokens and the commit, exactly as ``Engine(drafter="mtp")`` does, but the number of drafts
accepted comes from a schedule instead of from the drafts: per step and request a run length r with
P(r >= i) = p^i (seeded), accepted n = min(r, k). p solves ``sum_{i=0..A} p^i = L`` for the
published acceptance (``--accept-length`` L = 3.7 tokens per step at ``--accept-at`` A = 7 drafts);
every k then shares the same runs. The emitted tokens are the target's own argmax (its routing as a
trained model's would be, given these weights), so the next step's catch-up and verify see real
inputs. The true acceptance of the weights at hand (drafts equal to the target's argmax) is
reported next to it.

Per (batch B, k), per step: the draft, verify and commit times (median ms; each phase synchronised
on a GPU), the plain decode step's time on the same prompts (a cache without speculation), the
mean distinct routed experts per MoE layer that the verify step's routing touched (and a plain
step's), the byte-model bound of the speedup,

    bound = E[tokens per step] x bytes(plain step) / (bytes(drafts) + bytes(verify))

(bytes: ``fastmamba.bench.e2e`` rules: weights once, a MoE layer's routed experts only those the
step touched, an untied embedding table in its rows; Mamba states read + written; K/V over the
context; drafts: k reads of the MTP layer's weights, its touched experts, and the lm_head), the
measured speedup ``E[tokens per step] x plain / (draft + verify + commit)``, and the verify step's
achieved bandwidth as a % of the measured copy peak. On a GPU the verify and commit steps and the
plain step replay from CUDA graphs (``GraphedVerifier`` / ``GraphedDecoder``, as the engine runs
them), and so does the drafter (``MTPDrafter(cuda_graphs=True)``: the catch-up and drafts 2..k from
one graph; its time includes building the catch-up's inputs on the host; the drafts stay on the
device, as in the engine, and are read back with the verify's argmax).
``--engine-batches 8,64,256`` (``--engine-k``, ``--engine-gen-len``) adds the engine-level check of
the speculation policy: per batch B, ``Engine(model, max_batch=B)`` (plain decoding) and
``Engine(model, max_batch=B, speculate=K, drafter="mtp")`` (its adaptive policy: it weighs the
measured step costs and the acceptance of these weights, which is ~0 for random weights) generate
the same greedy tokens from the same prompts; after an untimed run of each (graph captures, and the
policy's exploration), a second run's decode tok/s are compared (target: the MTP engine never more
than 3% slower), with the policy's choices (how often each k) and the acceptance it saw.

Without a GPU: the tiny preset through the interpreter / references (plumbing, not speed).
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

import torch

PUBLISHED_LENGTH, PUBLISHED_AT = 3.7, 7


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="preset or checkpoint with an MTP layer (default: "
                        "nemotron-3-nano-mtp on a GPU, nemotron-3-tiny-mtp on the CPU)")
    parser.add_argument("--k", default="1,2,3,5,7", help="drafts per step, comma-separated")
    parser.add_argument("--batch", default="1", help="requests, comma-separated")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 512; CPU 8)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 64; CPU 3)")
    parser.add_argument("--accept-length", type=float, default=PUBLISHED_LENGTH,
                        help="mean tokens per step of the schedule at --accept-at drafts (default 3.7)")
    parser.add_argument("--accept-at", type=int, default=PUBLISHED_AT, help="the k of --accept-length (default 7)")
    parser.add_argument("--path", default="replay", choices=("replay", "legacy"), help="verify path")
    parser.add_argument("--ssm-dtype", default="fp32", choices=("fp32", "fp16", "bf16"))
    parser.add_argument("--no-graphs", action="store_true", help="run verify / commit / plain eagerly on a GPU")
    parser.add_argument("--engine-batches", default="", help="also compare Engine(drafter='mtp') with plain "
                        "decoding at these batches, comma-separated (e.g. 8,64,256)")
    parser.add_argument("--engine-k", type=int, default=3, help="speculate K of the engine comparison (default 3)")
    parser.add_argument("--engine-gen-len", type=int, default=None, help="tokens per request there (default 64; CPU 6)")
    parser.add_argument("--engine-prompt-len", type=int, default=None,
                        help="prompt tokens there (default 128: B prompts are prefilled in one eager call)")
    parser.add_argument("--json", default=None, help="append the rows as JSON lines to PATH")
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))


def _ints(text: str, name: str) -> list[int]:
    try:
        out = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"bench mtp: --{name} expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise SystemExit(f"bench mtp: --{name} expected integers >= 1, got {text!r}")
    return out


def acceptance_rate(length: float, at: int) -> float:
    """p with sum_{i=0..at} p^i = length (1 <= length <= at + 1), by bisection."""
    if not 1.0 <= length <= at + 1:
        raise ValueError(f"bench mtp: --accept-length must lie in [1, {at + 1}] for --accept-at {at}, got {length}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(at + 1)) < length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def schedule(p: float, steps: int, batch: int, cap: int, seed: int = 0) -> list[list[int]]:
    """Run lengths r[step][request] with P(r >= i) = p^i, capped at ``cap``."""
    rng = random.Random(seed)
    out = []
    for _ in range(steps):
        row = []
        for _ in range(batch):
            r = 0
            while r < cap and rng.random() < p:
                r += 1
            row.append(r)
        out.append(row)
    return out


@dataclasses.dataclass
class _Req:  # what MTPDrafter reads of a request
    prompt: list
    output: list
    slot: int
    finished: bool = False
    rid: int = 0
    prefilled: int = 0  # prompt positions prefilled (observe_prompt reads it)


class _Experts:
    """Distinct routed experts per MoE layer call (``MoE.route``, the layer's one door to the router),
    recorded while ``on``."""

    def __init__(self):
        from fastmamba.layers.moe import MoE

        self.module, self.route, self.calls, self.on = MoE, MoE.route, [], False

        def counting(*a, **kw):
            routing = self.route(*a, **kw)
            if self.on:
                self.calls.append(int(routing.ids.unique().numel()))
            return routing

        MoE.route = counting

    def take(self) -> list[int]:
        out, self.calls = self.calls, []
        return out

    def close(self) -> None:
        self.module.route = self.route


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device):
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


def _params(model, mtp: bool) -> list[torch.Tensor]:
    seen, out = set(), []
    for name, p in model.named_parameters():
        if name.startswith("mtp.") == mtp and id(p) not in seen:  # tied weights: one Parameter
            seen.add(id(p))
            out.append(p)
    return out


def _weights(params, moe_layers, touched: list[float]) -> int:
    from fastmamba.bench.e2e_bytes import expert_bytes

    total = sum(p.numel() * p.element_size() for p in params)
    for moe, t in zip(moe_layers, touched):
        total -= int((moe.cfg.n_experts - t) * expert_bytes(moe))
    return total


def target_bytes(model, tokens: int, batch: int, context: float, touched: list[float], ssm_dtype) -> int:
    """One target step over ``tokens`` tokens in all (``batch`` requests): weights (routed experts as
    touched, the untied embedding table in its rows), Mamba states read + written, K/V read over the
    context plus the new tokens' written."""
    from fastmamba.bench.e2e_bytes import moe_layers

    c = model.cfg
    total = _weights(_params(model, mtp=False), moe_layers(model), touched)  # the backbone's MoE layers
    emb = model.backbone.embeddings.weight
    if emb.data_ptr() != model.lm_head.weight.data_ptr():
        total -= (emb.shape[0] - min(tokens, emb.shape[0])) * emb.shape[1] * emb.element_size()
    if "M" in c.pattern:
        m = c.mamba
        total += batch * c.pattern.count("M") * 2 * (m.conv_dim * m.d_conv * model.dtype.itemsize
                                                    + m.nheads * m.headdim * m.d_state * ssm_dtype.itemsize)
    if "*" in c.pattern:
        kv = 2 * c.n_kv_heads * c.head_dim * model.dtype.itemsize
        total += int(c.pattern.count("*") * kv * (batch * context + tokens))
    return total


def draft_bytes(model, k: int, batch: int, context: float, touched: list[float]) -> int:
    """k MTP steps: the MTP layer's weights (its routed experts as touched) and the lm_head each,
    its K/V over its context."""
    from fastmamba.bench.e2e_bytes import moe_layers

    per_step = _weights(_params(model, mtp=True), moe_layers(model.mtp), touched)
    per_step += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    c = model.cfg
    kv = 2 * c.n_kv_heads * c.head_dim * model.dtype.itemsize * model.mtp.n_attn_layers
    return k * per_step + int(k * batch * kv * (context + 1))


def _mean_per_layer(calls: list[int], n_layers: int) -> list[float]:
    if not calls or not n_layers:
        return [0.0] * n_layers
    return [statistics.fmean(calls[j::n_layers]) for j in range(n_layers)]


def _prefill(model, cache, prompts, device):
    B, L = prompts.shape
    slots = cache.take(B)
    cu = [i * L for i in range(B + 1)]
    logits = model.prefill_varlen(prompts.reshape(-1), torch.tensor(cu, dtype=torch.int32, device=device), cache,
                                  torch.tensor(slots, dtype=torch.int32, device=device), cu_seqlens_host=cu,
                                  slots_host=slots)
    return slots, logits


def run_plain(model, prompts, steps: int, graphs: bool, ssm_dtype, device, experts: _Experts, n_moe: int):
    B, L = prompts.shape
    cache = model.new_cache(B, max_seq_len=L + steps + 16, ssm_dtype=ssm_dtype)
    sl, logits = _prefill(model, cache, prompts, device)
    slots = torch.tensor(sl, dtype=torch.int32, device=device)
    tok = logits.argmax(-1)
    decoder = None
    if graphs:
        from fastmamba.generation.cuda_graphs import GraphedDecoder

        decoder = GraphedDecoder(model, cache, B)

    def step(t):
        cache.grow(sl, [1] * B)
        out = decoder.decode(t, slots) if decoder is not None else model.decode(t, cache, slots, grow=False)
        return out.argmax(-1)

    times = []
    for s in range(steps + 3):
        tok, secs = _timed(lambda: step(tok), device)
        if s >= 3:
            times.append(secs)
    experts.on = True
    for _ in range(2):  # eager: the routing of two more steps
        cache.grow(sl, [1] * B)
        tok = model.decode(tok, cache, slots, grow=False).argmax(-1)
    experts.on = False
    return statistics.median(times), _mean_per_layer(experts.take(), n_moe)


def run_k(model, prompts, k: int, runs: list[list[int]], steps: int, *, path: str, graphs: bool, ssm_dtype,
          device, experts: _Experts, n_moe: int, n_mtp_moe: int) -> dict:
    from fastmamba.generation.mtp_drafter import MTPDrafter

    B, L = prompts.shape
    warm = 3
    cap = L + (k + 1) * (steps + warm + 4) + 16
    model.keep_hidden = True  # the verify steps' hidden states: the drafter's input
    model.keep_all_hidden = True  # and every prompt position's: the MTP runs over the whole prompt, as the engine
    cache = model.new_cache(B, max_seq_len=cap, ssm_dtype=ssm_dtype, speculate=k)
    if path == "legacy":
        cache.reserve_legacy(B)
    sl, logits = _prefill(model, cache, prompts, device)
    slots = torch.tensor(sl, dtype=torch.int32, device=device)
    first = logits.argmax(-1).tolist()
    reqs = [_Req(prompts[b].tolist(), [first[b]], sl[b], rid=b, prefilled=L) for b in range(B)]
    drafter = MTPDrafter(model, B, max_seq_len=cap, cuda_graphs=graphs)
    hidden, model.all_hidden, model.keep_all_hidden = model.all_hidden, None, False
    drafter.observe_prompt(reqs, hidden, [L] * B)  # untimed, as the engine's prefill
    verifier = None
    if graphs:
        from fastmamba.generation.cuda_graphs import GraphedVerifier

        verifier = GraphedVerifier(model, cache, B)
    T, M = k + 1, model.cfg.d_model
    t = {"draft": [], "verify": [], "commit": []}
    proposed = accepted_true = 0
    verify_experts, draft_experts = [], []
    total = steps + warm + 2
    for s in range(total):
        counting = s >= steps + warm  # the last two steps: eager verify, routing counted
        experts.on = counting
        drafts_d, secs_d = _timed(lambda: drafter.propose_device(reqs, k), device)
        if counting:
            draft_experts += experts.take()
        last = torch.tensor([[r.output[-1]] for r in reqs], dtype=torch.int64, device=device)
        tokens = torch.cat([last, drafts_d], dim=1)  # the drafts never leave the device before the verify

        def verify():
            cache.grow(sl, [T] * B)
            if verifier is not None and not counting:
                out = verifier.verify(tokens, slots, path)
            else:
                out = model.verify(tokens, cache, slots, path=path, grow=False)
            return out.argmax(-1)

        best, secs_v = _timed(verify, device)
        read = torch.cat([tokens[:, 1:], best], dim=1).tolist()  # one read: the drafts, then the argmax
        drafts, best = [row[:k] for row in read], [row[k:] for row in read]
        if counting:
            verify_experts += experts.take()
        hidden = model.last_hidden[:B * T].view(B, T, M)  # a graph's bucket may hold pad rows after them
        n = [min(runs[s % len(runs)][b], k) for b in range(B)]
        acc = torch.tensor([x + 1 for x in n], dtype=torch.int32, device=device)

        def commit():
            if verifier is not None and not counting:
                verifier.commit(slots, acc, path)
            else:
                model.commit(cache, slots, acc, path=path, rollback=False)
            cache.rollback(sl, [T - x - 1 for x in n])

        _, secs_c = _timed(commit, device)
        for b, r in enumerate(reqs):
            m = 0
            while m < k and drafts[b][m] == best[b][m]:
                m += 1
            accepted_true += m
            r.output += best[b][:n[b] + 1]
        proposed += k * B
        drafter.observe(reqs, hidden, [x + 1 for x in n])
        if warm <= s < steps + warm:
            t["draft"].append(secs_d)
            t["verify"].append(secs_v)
            t["commit"].append(secs_c)
    experts.on = False
    context = L + statistics.fmean(len(r.output) for r in reqs) / 2
    return {"draft_s": statistics.median(t["draft"]), "verify_s": statistics.median(t["verify"]),
            "commit_s": statistics.median(t["commit"]), "true_accept": accepted_true / max(proposed, 1),
            "verify_experts": _mean_per_layer(verify_experts, n_moe),
            "draft_experts": _mean_per_layer(draft_experts, n_mtp_moe), "context": context}


def run(args: argparse.Namespace, command: str) -> int:
    from fastmamba.bench.e2e_bytes import moe_layers
    from fastmamba.bench.env import collect
    from fastmamba.bench.peak import measure_copy_bandwidth
    from fastmamba.models.nemotron_h import load_nemotron_h

    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    gpu = device.type == "cuda"
    ks, batches = _ints(args.k, "k"), _ints(args.batch, "batch")
    name = args.model or ("nemotron-3-nano-mtp" if gpu else "nemotron-3-tiny-mtp")
    prompt_len = args.prompt_len or (512 if gpu else 8)
    steps = args.steps or (64 if gpu else 3)
    ssm_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.ssm_dtype]
    graphs = gpu and not args.no_graphs
    p = acceptance_rate(args.accept_length, args.accept_at)
    model = load_nemotron_h(name, device=device)
    if model.mtp is None:
        raise SystemExit(f"bench mtp: {name} has no MTP layer (num_nextn_predict_layers); try nemotron-3-nano-mtp")
    header = collect(device, command)
    peak = measure_copy_bandwidth(device) if gpu else None
    n_mtp_moe = len(moe_layers(model.mtp))
    n_moe = len(moe_layers(model))  # the backbone's
    print(f"# {header['device']}: {name} ({model.dtype}), prompt {prompt_len}, {steps} timed steps, verify path "
          f"{args.path}, {args.ssm_dtype} state, "
          f"{'CUDA graphs (MTP steps, verify, commit, plain)' if graphs else 'eager'}; "
          f"schedule p={p:.4f} per draft ({args.accept_length} tokens/step at k={args.accept_at})"
          + (f"; copy peak {peak / 1e9:.0f} GB/s" if peak else "; CPU: plumbing, not speed"))
    experts = _Experts()
    rows = []
    try:
        for B in batches:
            g = torch.Generator().manual_seed(B)
            prompts = torch.randint(0, model.cfg.vocab_size, (B, prompt_len), generator=g).to(device)
            plain_s, plain_experts = run_plain(model, prompts, steps, graphs, ssm_dtype, device, experts, n_moe)
            plain_bytes = target_bytes(model, B, B, prompt_len + steps / 2, plain_experts, ssm_dtype)
            runs = schedule(p, steps + 8, B, max(ks))
            print(f"batch {B}: plain step {plain_s * 1e3:.3f} ms ({plain_bytes / 1e9:.3f} GB, experts/layer "
                  f"{statistics.fmean(plain_experts or [0]):.1f})")
            print(f"{'k':>3} {'tok/step':>8} {'draft ms':>9} {'verify ms':>9} {'commit ms':>9} {'step ms':>8} "
                  f"{'vs plain':>8} {'exp verify':>10} {'exp draft':>9} {'bound x':>7} {'measured x':>10} "
                  f"{'verify %peak':>12} {'true acc':>8}")
            for k in ks:
                r = run_k(model, prompts, k, runs, steps, path=args.path, graphs=graphs, ssm_dtype=ssm_dtype,
                          device=device, experts=experts, n_moe=n_moe, n_mtp_moe=n_mtp_moe)
                tps = statistics.fmean(min(x, k) + 1 for row in runs[3:steps + 3] for x in row)
                step_s = r["draft_s"] + r["verify_s"] + r["commit_s"]
                vbytes = target_bytes(model, B * (k + 1), B, r["context"], r["verify_experts"], ssm_dtype)
                dbytes = draft_bytes(model, k, B, (r["context"] - prompt_len), r["draft_experts"])
                bound = tps * plain_bytes / (vbytes + dbytes)
                measured = tps * plain_s / step_s
                vpeak = vbytes / r["verify_s"] / peak * 100 if peak else None
                row = {"record": "mtp_oracle", "model": name, "batch": B, "k": k, "tokens_per_step": tps,
                       "draft_ms": r["draft_s"] * 1e3, "verify_ms": r["verify_s"] * 1e3,
                       "commit_ms": r["commit_s"] * 1e3, "plain_ms": plain_s * 1e3,
                       "verify_experts_per_layer": statistics.fmean(r["verify_experts"] or [0]),
                       "plain_experts_per_layer": statistics.fmean(plain_experts or [0]),
                       "draft_experts_per_layer": statistics.fmean(r["draft_experts"] or [0]),
                       "plain_bytes": plain_bytes, "verify_bytes": vbytes, "draft_bytes": dbytes,
                       "byte_bound_speedup": bound, "measured_speedup": measured,
                       "measured_over_bound": measured / bound, "verify_pct_peak": vpeak,
                       "true_accept_rate": r["true_accept"], "schedule_p": p, "path": args.path,
                       "graphs": graphs, "ssm_dtype": args.ssm_dtype, "prompt_len": prompt_len}
                rows.append(row)
                print(f"{k:>3} {tps:>8.2f} {row['draft_ms']:>9.3f} {row['verify_ms']:>9.3f} {row['commit_ms']:>9.3f} "
                      f"{step_s * 1e3:>8.3f} {step_s / plain_s:>7.2f}x {row['verify_experts_per_layer']:>10.1f} "
                      f"{row['draft_experts_per_layer']:>9.1f} {bound:>7.2f} {measured:>10.2f} "
                      f"{(f'{vpeak:.0f}%' if vpeak is not None else '-'):>12} {r['true_accept']:>8.3f}")
            best = max((x for x in rows if x["batch"] == B), key=lambda x: x["byte_bound_speedup"])
            print(f"  best k by the byte bound: k={best['k']} bound {best['byte_bound_speedup']:.2f}x, measured "
                  f"{best['measured_speedup']:.2f}x ({best['measured_over_bound'] * 100:.0f}% of the bound)")
        if args.engine_batches:
            gen_len = args.engine_gen_len or (64 if gpu else 6)
            e_prompt = args.engine_prompt_len or (128 if gpu else prompt_len)
            print(f"engine: plain vs drafter='mtp' (K={args.engine_k}, adaptive policy), prompt {e_prompt}, "
                  f"{gen_len} tokens per request, the second of two runs timed")
            print(f"{'batch':>5} {'plain tok/s':>11} {'mtp tok/s':>10} {'ratio':>6} {'<=3% slower':>11} "
                  f"{'accept':>6} {'match':>5}  k chosen (count)")
            for B in _ints(args.engine_batches, "engine-batches"):
                row = run_engine(model, B, e_prompt, gen_len, args.engine_k, device, name)
                rows.append(row)
                print(f"{B:>5} {row['plain_tok_s']:>11.1f} {row['mtp_tok_s']:>10.1f} {row['ratio']:>6.3f} "
                      f"{'yes' if row['ratio'] >= 0.97 else 'NO':>11} {row['policy']['accept_rate']:>6.3f} "
                      f"{'yes' if row['tokens_match'] else 'NO':>5}  "
                      f"{row['policy']['chosen']}")
    finally:
        experts.close()
    if args.json:
        from fastmamba.bench.report import write_records

        write_records(args.json, rows, header)
    return 0


def run_engine(model, B: int, prompt_len: int, gen_len: int, K: int, device, name: str) -> dict:
    """Decode tok/s of plain and MTP engines at batch ``B`` (the second of two runs) and the policy's report."""
    from fastmamba.generation.engine import Engine
    from fastmamba.generation.sampling import SamplingParams

    g = torch.Generator().manual_seed(1000 + B)
    prompts = torch.randint(0, model.cfg.vocab_size, (B, prompt_len), generator=g).tolist()
    params = SamplingParams(max_new_tokens=gen_len, ignore_eos=True)
    out, tok_s = {}, {}
    engine = None
    for label, kw in (("plain", {}), ("mtp", {"speculate": K, "drafter": "mtp"})):
        engine = Engine(model, max_batch=B, max_seq_len=prompt_len + gen_len + K + 8, **kw)
        engine.generate(prompts, params)  # graphs, compiles, the policy's exploration: untimed
        rids = [engine.add_request(p, params) for p in prompts]
        engine.step()  # every prompt's prefill: untimed

        def loop():
            while engine.has_unfinished():
                engine.step()

        _, secs = _timed(loop, device)
        out[label] = [engine.finished.pop(rid).output for rid in rids]
        tok_s[label] = B * (gen_len - 1) / secs
        if label == "plain":
            del engine
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {"record": "mtp_engine", "model": name, "batch": B, "speculate": K, "plain_tok_s": tok_s["plain"],
            "mtp_tok_s": tok_s["mtp"], "ratio": tok_s["mtp"] / tok_s["plain"],
            "tokens_match": out["plain"] == out["mtp"],
            "policy": engine.stats.get("policy") or {"accept_rate": float("nan"), "chosen": {}},
            "prompt_len": prompt_len, "gen_len": gen_len}
