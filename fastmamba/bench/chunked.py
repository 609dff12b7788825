"""Target ``chunked``: what a long prompt does to running requests, with and without chunked prefill.

    python -m fastmamba.bench chunked [--model mamba2-2.7b] [--running 8] [--prompt-len 8192]
                                      [--budgets none,512,2048] [--prefix-cache-gb 0] [--json PATH]

Per chunk budget (``none``: whole prompts, a step either prefills or decodes): an engine decodes
``--running`` requests (prompt 128, greedy, no end); after a warm-up (graphs captured, the long
prompt's length admitted once and dropped), one request of ``--prompt-len`` fresh tokens arrives
(with ``--prefix-cache-gb``, as the server runs by default, its chunks take the prefix cache's
snapshots every 512 tokens; fresh tokens: no hit on the warm-up's). Every step until
its first token and 8 steps beyond is timed (wall clock: each step ends with the host reading the
sampled tokens). Reported: the running requests' plain step time (median of 16 steps before the
arrival), their inter-token latency p50 / p99 over the window (a step in which they emit nothing
adds to the next gap), the ratio p99 / plain step, and the long prompt's time to first token; the
JSON rows also hold every timed step's wall time from the arrival on (``steps_ms``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def _budgets(text: str) -> list[int | None]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if part in ("none", "0", "off"):
            out.append(None)
        else:
            try:
                out.append(int(part))
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected budgets like none,512,2048, got {part!r}") from None
    return out


def _gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # NaN fails too
        raise argparse.ArgumentTypeError(f"expected GiB >= 0 (0: no prefix cache), got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="preset or checkpoint dir (default: mamba2-2.7b on a GPU, "
                        "mamba2-tiny on a CPU)")
    parser.add_argument("--running", type=int, default=8, help="requests decoding when the long prompt arrives")
    parser.add_argument("--prompt-len", type=int, default=None, help="the long prompt (default 8192; CPU 24)")
    parser.add_argument("--budgets", type=_budgets, default=None, help="chunk budgets (default none,512,2048; "
                        "CPU none,8)")
    parser.add_argument("--prefix-cache-gb", type=_gib, default=0.0,
                        help="prefix cache of this many GiB (the server's default: 4); 0: off")
    parser.add_argument("--json", metavar="PATH", help="append one JSON line per budget")


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _timed_step(engine) -> tuple[float, list]:
    t0 = time.perf_counter()
    outs = engine.step()
    return time.perf_counter() - t0, outs


def measure(model, budget: int | None, running: int, prompt_len: int, vocab: int, prefix_bytes: int = 0) -> dict:
    from fastmamba.generation.engine import Engine
    from fastmamba.generation.sampling import SamplingParams

    g = torch.Generator().manual_seed(0)
    engine = Engine(model, max_batch=running + 1, prefill_chunk=budget, prefix_cache_bytes=prefix_bytes or None)
    params = SamplingParams(max_new_tokens=10**6, ignore_eos=True)
    run_ids = [engine.add_request(torch.randint(0, vocab, (128,), generator=g).tolist(), params)
               for _ in range(running)]
    long_prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
    while len(engine.running) < running:
        engine.step()
    # warm-up: the long prompt once (graphs of its buckets captured), then dropped
    # (two tokens: the step after its prefill decodes running + 1 requests, capturing that graph too)
    warm = engine.add_request(long_prompt, SamplingParams(max_new_tokens=2, ignore_eos=True))
    while engine.has_unfinished() and not any(r.rid == warm for r in engine.finished.values()):
        engine.step()
    engine.finished.pop(warm, None)
    plain = [_timed_step(engine)[0] for _ in range(16)]
    long_prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()  # no prefix-cache hit
    long_rid = engine.add_request(long_prompt, SamplingParams(max_new_tokens=9, ignore_eos=True))
    t_arrive = time.perf_counter()
    last = {rid: t_arrive for rid in run_ids}
    gaps, ttft, after, steps = [], None, 0, []
    while after < 8:
        dt, outs = _timed_step(engine)
        now = time.perf_counter()
        steps.append(1e3 * dt)
        for o in outs:
            if o.rid in last:
                gaps.append(now - last[o.rid])
                last[o.rid] = now
            elif o.rid == long_rid and ttft is None:
                ttft = now - t_arrive
        if ttft is not None:
            after += 1
    for rid in run_ids + [long_rid]:
        engine.abort(rid)
    plain_ms = 1e3 * statistics.median(plain)
    return {"budget": budget, "plain_step_ms": plain_ms, "itl_p50_ms": 1e3 * percentile(gaps, 0.5),
            "itl_p99_ms": 1e3 * percentile(gaps, 0.99), "itl_max_ms": 1e3 * max(gaps),
            "p99_over_plain": 1e3 * percentile(gaps, 0.99) / plain_ms, "long_ttft_ms": 1e3 * ttft,
            "steps_ms": [round(v, 3) for v in steps]}


def run(args: argparse.Namespace, command: str) -> int:
    import fastmamba

    cuda = torch.cuda.is_available()
    name = args.model or ("mamba2-2.7b" if cuda else "mamba2-tiny")
    prompt_len = args.prompt_len or (8192 if cuda else 24)
    budgets = args.budgets or ([None, 512, 2048] if cuda else [None, 8])
    if not cuda:
        print("no GPU: the tiny preset on the CPU; these timings say nothing about GPU speed", file=sys.stderr)
    model = fastmamba.load_model(name)
    dev = torch.cuda.get_device_name() if cuda else "CPU"
    prefix = f"prefix cache {args.prefix_cache_gb:g} GiB" if args.prefix_cache_gb > 0 else "no prefix cache"
    print(f"# chunked prefill: {name}, {dev}, {args.running} running requests (prompt 128), one prompt of "
          f"{prompt_len} tokens arrives, {prefix}; command: {command}")
    print("| chunk budget | plain step ms | ITL p50 ms | ITL p99 ms | ITL max ms | p99 / plain step | long prompt TTFT ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for budget in budgets:
        r = measure(model, budget, args.running, prompt_len, model.cfg.vocab_size,
                    int(args.prefix_cache_gb * (1 << 30)))
        r.update(model=name, device=dev, running=args.running, prompt_len=prompt_len, command=command,
                 prefix_cache_gb=args.prefix_cache_gb)
        rows.append(r)
        print(f"| {budget or 'none (whole prompt)'} | {r['plain_step_ms']:.2f} | {r['itl_p50_ms']:.2f} | "
              f"{r['itl_p99_ms']:.2f} | {r['itl_max_ms']:.2f} | {r['p99_over_plain']:.1f}x | {r['long_ttft_ms']:.1f} |",
              flush=True)
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0
