"""Target ``serve``: a bounded load test of ``fastmamba serve`` on loopback against the offline engine.

    python -m fastmamba.bench serve [--model mamba2-2.7b] [--requests 256] [--concurrency 64]
                                    [--prompt-len 512] [--output-len 128] [--max-batch 64] [--json PATH]
    python -m fastmamba.bench serve --shared-prefix 2048 [--requests 16] [--prompt-len 64] ...

The server runs in a subprocess (``python -m fastmamba.serve`` on a free 127.0.0.1 port); this
process drives it with ``--concurrency`` streaming clients (``--client``: aiohttp where installed, else
httpx) that send ``--requests`` token-id
completions (random prompts, greedy, ``ignore_eos``) and record each request's time to first token
and the gaps between its tokens. Then the server is stopped and the same prompts run through the
offline ``Engine.generate`` in this process. Both sides first run a warm-up of the same traffic on
other prompts (half as many requests), so the CUDA graphs that traffic needs exist before the timed
run, as in a server that has been up a while; the report counts the captures left in the timed run. Reported: request throughput,
output tok/s, time to first token and inter-token latency p50 / p99 for the server, output tok/s
offline, and server / offline.

``--shared-prefix N``: the prefix-cache test instead. Every prompt is one shared N-token system
prompt followed by its own ``--prompt-len`` tokens; the requests go one after another (one client)
to a server with the prefix cache on and then to one with it off (``--prefix-cache-gb 0``), and the
report gives each one's time to first token (median over the requests after the first, which
fills the cache) and the ratio. Without a GPU: the tiny preset with a handful of short requests
(PyTorch reference ops), which checks the plumbing only.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="preset or checkpoint dir (default: mamba2-2.7b on a GPU, "
                        "mamba2-tiny on a CPU)")
    parser.add_argument("--requests", type=int, default=None, help="requests in all (default 256; CPU 8)")
    parser.add_argument("--concurrency", type=int, default=None, help="clients at once (default 64; CPU 4)")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 512; CPU 8)")
    parser.add_argument("--output-len", type=int, default=None, help="tokens generated per request (default 128; CPU 4)")
    parser.add_argument("--max-batch", type=int, default=64, help="the server's and the offline engine's batch")
    parser.add_argument("--prefill-chunk", type=int, default=2048,
                        help="prompt tokens per engine step, server and offline alike (0: whole prompts)")
    parser.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                        help="prefix-cache test: prompts share an N-token system prompt; TTFT with the cache on / off")
    parser.add_argument("--server-args", default="", metavar="ARGS",
                        help="extra arguments for the server (e.g. '--prefix-cache-gb 0'); the offline engine is "
                             "built without a prefix cache either way")
    parser.add_argument("--client", choices=("aiohttp", "httpx"), default=None,
                        help="the benchmark's HTTP client (default: aiohttp where installed, as vLLM's and "
                             "SGLang's serving benchmarks use, else httpx)")
    parser.add_argument("--json", metavar="PATH", help="append the result as one JSON line")


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def vocab_size(name: str) -> int:
    """The vocabulary of a preset or a checkpoint directory (its config.json), without loading
    weights: the random prompts' ids lie below it."""
    from fastmamba.models.config import PRESETS
    from fastmamba.models.nemotron_h import PRESETS as NEMOTRON_H_PRESETS

    cfg = PRESETS.get(name) or NEMOTRON_H_PRESETS.get(name)
    if cfg is not None:
        return cfg.vocab_size
    path = os.path.join(name, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"bench serve: --model {name!r} is neither a preset ({', '.join([*PRESETS, *NEMOTRON_H_PRESETS])}) "
                                "nor a checkpoint directory with a config.json")
    with open(path, encoding="utf-8") as f:
        value = json.load(f).get("vocab_size")
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"bench serve: {path}: `vocab_size` expected a positive int, got {value!r}")
    return value


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_client() -> str:
    """aiohttp where installed (the client of vLLM's and SGLang's serving benchmarks: its per-request
    cost is a third of httpx's on loopback), else httpx (the openai client's transport)."""
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        return "httpx"
    return "aiohttp"


class _Client:
    """One HTTP client library behind one call: ``lines(body)`` streams a completion's SSE lines."""

    def __init__(self, kind: str, url: str, concurrency: int):
        self.kind, self.url, self.concurrency = kind, url, concurrency

    async def __aenter__(self):
        if self.kind == "aiohttp":
            import aiohttp

            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.concurrency + 8),
                                                  timeout=aiohttp.ClientTimeout(total=600))
        else:
            import httpx

            limits = httpx.Limits(max_connections=self.concurrency + 8, max_keepalive_connections=self.concurrency + 8)
            self._session = httpx.AsyncClient(base_url=self.url, timeout=600, limits=limits)
        await self._session.__aenter__()
        return self

    async def __aexit__(self, *exc):
        await self._session.__aexit__(*exc)

    async def lines(self, body: bytes):
        """The response's lines (str, without the line break) to a completion request whose JSON
        ``body`` is already encoded; raises on a status other than 200."""
        headers = {"Content-Type": "application/json"}
        if self.kind == "aiohttp":
            async with self._session.post(self.url + "/v1/completions", data=body, headers=headers) as r:
                if r.status != 200:
                    raise RuntimeError(f"server answered {r.status}: {await r.read()}")
                async for raw in r.content:
                    yield raw.decode().rstrip("\r\n")
        else:
            async with self._session.stream("POST", "/v1/completions", content=body, headers=headers) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"server answered {r.status_code}: {await r.aread()}")
                async for line in r.aiter_lines():
                    yield line


async def _drive(url: str, prompts: list[list[int]], output_len: int, concurrency: int, client: str = "httpx") -> dict:
    sem = asyncio.Semaphore(concurrency)
    ttft, itl, counts = [], [], []

    async def one(cl, prompt):
        async with sem:
            # encoded before the clock starts: a request's time to first token runs from when it is sent
            body = json.dumps({"prompt": prompt, "max_tokens": output_len, "temperature": 0, "stream": True,
                               "ignore_eos": True}).encode()
            t0 = time.perf_counter()
            last, n = None, 0
            async for line in cl.lines(body):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                got = len(json.loads(line[6:])["choices"][0]["token_ids"])
                if not got:
                    continue
                now = time.perf_counter()
                if last is None:
                    ttft.append(now - t0)
                else:
                    itl.append(now - last)
                last, n = now, n + got
            counts.append(n)

    async with _Client(client, url, concurrency) as cl:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(cl, p) for p in prompts))
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "ttft": ttft, "itl": itl, "tokens": sum(counts)}


def _engine_timing(url: str) -> dict[str, float]:
    """The server's engine-thread counters from /metrics (steps, seconds in and around steps, tokens)."""
    import httpx

    names = {"fastmamba_engine_steps": "steps", "fastmamba_engine_step_seconds": "step_s",
             "fastmamba_engine_around_seconds": "around_s", "fastmamba_generation_tokens_total": "tokens",
             "fastmamba_engine_prefill_steps": "prefill_steps", "fastmamba_engine_prefill_step_seconds": "prefill_step_s",
             "fastmamba_engine_graph_captures": "captures", "fastmamba_engine_graph_capture_seconds": "capture_s"}
    out = dict.fromkeys(names.values(), 0.0)
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        key = line.split(" ", 1)[0]
        if key in names:
            out[names[key]] = float(line.rsplit(" ", 1)[1])
    return out


def _timed_steps(engine) -> dict[str, float]:
    """Wrap ``engine.step`` to count steps, their seconds and tokens (the offline side of the diagnosis)."""
    timing = {"steps": 0, "step_s": 0.0, "around_s": 0.0, "tokens": 0, "prefill_steps": 0, "prefill_step_s": 0.0,
              "captures": 0, "capture_s": 0.0}
    step = engine.step
    before = engine.graph_captures

    def timed():
        t0 = time.perf_counter()
        fed = engine.stats["prefill_tokens"]
        out = step()
        dt = time.perf_counter() - t0
        timing["steps"] += 1
        timing["step_s"] += dt
        timing["tokens"] += len(out)
        if engine.stats["prefill_tokens"] != fed:
            timing["prefill_steps"] += 1
            timing["prefill_step_s"] += dt
        now = engine.graph_captures
        timing["captures"], timing["capture_s"] = now["count"] - before["count"], now["seconds"] - before["seconds"]
        return out

    engine.step = timed
    return timing


def _start_server(name: str, nreq: int, args: argparse.Namespace, extra: list[str], cuda: bool):
    """``python -m fastmamba.serve`` on a free loopback port; (process, url) once /health answers,
    or (None, error) after printing why not."""
    import httpx

    port = _free_port()
    env = dict(os.environ)
    if not cuda:
        env.pop("TRITON_INTERPRET", None)  # the reference ops: this checks plumbing, not kernels
    proc = subprocess.Popen([sys.executable, "-m", "fastmamba.serve", "--model", name, "--port", str(port),
                             "--max-batch", str(args.max_batch), "--max-waiting", str(nreq + 1),
                             "--prefill-chunk", str(args.prefill_chunk), "--log-level", "warning", *extra],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while True:
        if proc.poll() is not None:
            print(f"error: the server exited with {proc.returncode}", file=sys.stderr)
            return None, "exited"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            print("error: the server did not come up in 600 s", file=sys.stderr)
            return None, "timeout"
        time.sleep(0.5)


def _shared_prefix(args, command: str, name: str, suffixes: list[list[int]], olen: int, cuda: bool) -> int:
    """TTFT of prompts sharing a system prompt, one request at a time, prefix cache on and off."""
    vocab = vocab_size(name)
    system = torch.randint(0, vocab, (args.shared_prefix,), generator=torch.Generator().manual_seed(1)).tolist()
    prompts = [system + s for s in suffixes]
    rows = {}
    for label, extra in (("prefix cache on", []), ("prefix cache off", ["--prefix-cache-gb", "0"])):
        proc, url = _start_server(name, len(prompts), args, extra, cuda)
        if proc is None:
            return 1
        try:
            # warm-up on other system prompts (graphs, compiles; nothing of these prompts is cached)
            other = torch.randint(0, vocab, (2, args.shared_prefix), generator=torch.Generator().manual_seed(2))
            asyncio.run(_drive(url, [o + suffixes[0] for o in other.tolist()], 2, 1, args.client))
            res = asyncio.run(_drive(url, prompts, olen, 1, args.client))
        finally:
            proc.terminate()
            proc.wait(120)
        later = res["ttft"][1:]  # the first request fills the cache
        rows[label] = (1e3 * res["ttft"][0], 1e3 * statistics.median(later), 1e3 * percentile(later, 0.99))
    rows.update(_engine_ttft(name, args, system, suffixes, cuda))
    dev = torch.cuda.get_device_name() if cuda else "CPU (reference ops)"
    print(f"# prefix cache: {name}, {dev}, shared system prompt {args.shared_prefix} tokens + {len(suffixes[0])} own, "
          f"{len(prompts)} requests one at a time, output {olen}, client {args.client}; command: {command}")
    print("| server | first request TTFT ms | later requests TTFT p50 / p99 ms |")
    print("|---|---:|---:|")
    for label, (first, p50, p99) in rows.items():
        print(f"| {label} | {first:.1f} | {p50:.1f} / {p99:.1f} |")
    ratio = rows["prefix cache off"][1] / rows["prefix cache on"][1]
    print(f"later requests' TTFT, cache off / on: {ratio:.2f}x (target >= 5x); in the engine alone (no HTTP): "
          f"{rows['engine, cache off'][1] / rows['engine, cache on'][1]:.1f}x")
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            f.write(json.dumps({"model": name, "shared_prefix": args.shared_prefix, "suffix": len(suffixes[0]),
                                "requests": len(prompts), "ttft_ms": rows, "off_over_on": ratio, "client": args.client,
                                "command": command}) + "\n")
    return 0


def _engine_ttft(name: str, args, system: list[int], suffixes: list[list[int]], cuda: bool) -> dict:
    """The same requests through an in-process ``Engine`` (no HTTP): time from ``add_request`` to
    the request's first token, prefix cache on and off (first request, later ones' p50 / p99)."""
    import fastmamba
    from fastmamba.generation.engine import Engine
    from fastmamba.generation.sampling import SamplingParams

    saved = None if cuda else os.environ.pop("TRITON_INTERPRET", None)
    rows = {}
    try:
        model = fastmamba.load_model(name)
        params = SamplingParams(max_new_tokens=2, ignore_eos=True)
        vocab = model.cfg.vocab_size
        for label, budget in (("engine, cache on", 4 << 30), ("engine, cache off", None)):
            engine = Engine(model, max_batch=args.max_batch, prefill_chunk=args.prefill_chunk or None,
                            prefix_cache_bytes=budget)
            other = torch.randint(0, min(vocab, 50280), (2, len(system)), generator=torch.Generator().manual_seed(2))
            engine.generate([o + suffixes[0] for o in other.tolist()], params)  # warm-up: graphs
            times = []
            for s in suffixes:
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                rid = engine.add_request(system + s, params)
                while not any(o.rid == rid for o in engine.step()):
                    pass
                times.append(time.perf_counter() - t0)
                while engine.has_unfinished():
                    engine.step()
            later = times[1:]
            rows[label] = (1e3 * times[0], 1e3 * statistics.median(later), 1e3 * percentile(later, 0.99))
            del engine
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
    return rows


def run(args: argparse.Namespace, command: str) -> int:
    cuda = torch.cuda.is_available()
    args.client = args.client or default_client()
    name = args.model or ("mamba2-2.7b" if cuda else "mamba2-tiny")
    nreq = args.requests or (256 if cuda else 8)
    conc = args.concurrency or (64 if cuda else 4)
    plen = args.prompt_len or (512 if cuda else 8)
    olen = args.output_len or (128 if cuda else 4)
    g = torch.Generator().manual_seed(0)
    vocab = vocab_size(name)
    prompts = torch.randint(0, vocab, (nreq, plen), generator=g).tolist()
    # the warm-up: the same traffic on other prompts (half as many requests), so that the graphs
    # its arrival pattern needs are captured before the timed run, as in a server that has been up
    # a while (the timed run reports any capture left)
    warm_prompts = torch.randint(0, vocab, (max(conc, nreq // 2), plen), generator=g).tolist()

    if args.shared_prefix:
        return _shared_prefix(args, command, name, prompts, olen, cuda)
    proc, url = _start_server(name, nreq, args, args.server_args.split(), cuda)
    if proc is None:
        return 1
    try:
        asyncio.run(_drive(url, warm_prompts, olen, conc, args.client))
        before = _engine_timing(url)
        res = asyncio.run(_drive(url, prompts, olen, conc, args.client))
        after = _engine_timing(url)
        server_timing = {k: after[k] - before[k] for k in after}
    finally:
        proc.terminate()
        proc.wait(120)

    import fastmamba
    from fastmamba.generation.engine import Engine
    from fastmamba.generation.sampling import SamplingParams

    # without a GPU the offline run uses the reference ops, as the server did (restored afterwards)
    saved = None if cuda else os.environ.pop("TRITON_INTERPRET", None)
    try:
        model = fastmamba.load_model(name)
        engine = Engine(model, max_batch=args.max_batch, prefill_chunk=args.prefill_chunk or None)
        kw = {"max_new_tokens": olen}
        if "ignore_eos" in SamplingParams.__dataclass_fields__:
            kw["ignore_eos"] = True
        params = SamplingParams(**kw)
        engine.generate(warm_prompts, params)  # the warm-up
        if cuda:
            torch.cuda.synchronize()
        offline_timing = _timed_steps(engine)
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        if cuda:
            torch.cuda.synchronize()
        offline_s = time.perf_counter() - t0
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
    offline_tokens = sum(len(o) for o in outs)

    server_tps = res["tokens"] / res["wall_s"]
    offline_tps = offline_tokens / offline_s
    row = {
        "model": name, "requests": nreq, "concurrency": conc, "prompt_len": plen, "output_len": olen,
        "max_batch": args.max_batch, "server_req_per_s": nreq / res["wall_s"], "server_tok_per_s": server_tps,
        "offline_tok_per_s": offline_tps, "server_over_offline": server_tps / offline_tps,
        "ttft_p50_ms": 1e3 * percentile(res["ttft"], 0.5), "ttft_p99_ms": 1e3 * percentile(res["ttft"], 0.99),
        "itl_p50_ms": 1e3 * percentile(res["itl"], 0.5), "itl_p99_ms": 1e3 * percentile(res["itl"], 0.99),
        "client": args.client, "command": command,
    }
    dev = torch.cuda.get_device_name() if cuda else "CPU (reference ops)"
    print(f"# serve load test: {name}, {dev}, {nreq} requests, {conc} concurrent, prompt {plen}, output {olen}, "
          f"max batch {args.max_batch}, client {args.client}; command: {command}")
    print("| provider | req/s | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms |")
    print("|---|---:|---:|---:|---:|")
    print(f"| server (HTTP, streaming) | {row['server_req_per_s']:.2f} | {server_tps:.0f} | "
          f"{row['ttft_p50_ms']:.1f} / {row['ttft_p99_ms']:.1f} | {row['itl_p50_ms']:.2f} / {row['itl_p99_ms']:.2f} |")
    print(f"| offline Engine.generate | {nreq / offline_s:.2f} | {offline_tps:.0f} | — | — |")
    print(f"server / offline output tok/s: {row['server_over_offline']:.2f} (target >= 0.90)")
    print(f"mean output tokens per request: server {res['tokens'] / nreq:.1f}, offline {offline_tokens / nreq:.1f}")
    for label, t, wall in (("server", server_timing, res["wall_s"]), ("offline", offline_timing, offline_s)):
        if t["steps"]:
            print(f"{label} engine: {t['steps']:.0f} steps, {1e3 * t['step_s'] / t['steps']:.2f} ms per step, "
                  f"{t['tokens'] / t['steps']:.1f} tokens per step, {100 * t['step_s'] / wall:.0f}% of the wall time in "
                  f"steps, {1e3 * t['around_s'] / t['steps']:.2f} ms between steps; {t['prefill_steps']:.0f} steps "
                  f"prefilled ({1e3 * t['prefill_step_s'] / max(t['prefill_steps'], 1):.2f} ms each), the others "
                  f"{1e3 * (t['step_s'] - t['prefill_step_s']) / max(t['steps'] - t['prefill_steps'], 1):.2f} ms each; "
                  f"{t['captures']:.0f} CUDA graphs captured in the timed run ({1e3 * t['capture_s']:.0f} ms)")
    row["server_engine"], row["offline_engine"] = server_timing, offline_timing
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
    return 0
