"""Experiment (issue 19 item 4): the fused one-launch varlen scan vs the five-kernel chunked path at
short prompts, the mamba2-2.7b layer shape (H 80, P 64, N 128, G 1, chunk 256).

    python -m fastmamba.bench.ops.scan_small_l                 # the table below, one GPU
    python -m fastmamba.bench.ops.scan_small_l --sweep         # + every fused tile config per shape
    python -m fastmamba.bench.ops.scan_small_l --tiny          # CPU smoke run (interpreter), tiny shape

Per B x L (B sequences of L tokens packed into one ``ssd_scan_varlen`` call, as the model's prefill
passes them): bf16 x, B, C, z; fp32 dt (raw: dt_bias and softplus inside), A, D, dt_bias; an fp32
state pool of B + 2 slots, every sequence continuing from its slot's state. Both paths run inside
``trusted_inputs()`` with ``max_seqlen`` (the runtime's call: no host read), timed as CUDA-graph
replays (``bench.timing.time_graph``: median and p20/p80 per call, L2 flushed between replays,
the calls of one replay rotate over enough input copies to exceed 3x L2). Without CUDA: wall clock
under the interpreter, which checks the plumbing only.

Check per row: the fused output and final states against the chunked path's (relative error norm;
both are checked against the reference by tests/ops/ssd_scan/test_ssd_scan_fused.py).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

from fastmamba.bench.peak import device_name, l2_cache_bytes
from fastmamba.bench.timing import TimingConfig, choose_n_sets, time_calls
from fastmamba.ops.runtime import trusted_inputs
from fastmamba.ops.ssd_scan import ssd_scan_varlen
from fastmamba.ops.ssd_scan.fused import configs as fused_configs
from fastmamba.ops.ssd_scan.fused.configs import forced_fused_config, pick_fused_config

SHAPES = ((1, 16), (1, 64), (1, 128), (1, 512), (4, 128), (16, 64))
LAYER = dict(H=80, P=64, N=128, G=1, chunk=256)  # mamba2-2.7b
TINY = dict(H=2, P=16, N=16, G=1, chunk=16)
TINY_SHAPES = ((1, 7), (2, 5))


def _inputs(nb: int, L: int, H: int, P: int, N: int, G: int, dtype: torch.dtype, state_dtype: torch.dtype,
            device: torch.device, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    T = nb * L

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    return dict(
        x=rnd(T, H, P).to(dtype), dt=rnd(T, H, scale=0.5) - 2.0, A=-(torch.rand(H, generator=g) * 2 + 0.2).to(device),
        B=rnd(T, G, N, scale=0.5).to(dtype), C=rnd(T, G, N, scale=0.5).to(dtype), D=rnd(H), z=rnd(T, H, P).to(dtype),
        dt_bias=rnd(H, scale=0.3), states=rnd(nb + 2, H, P, N).to(state_dtype),
        cu=torch.arange(0, T + 1, L, dtype=torch.int32, device=device),
        slots=torch.arange(nb, dtype=torch.int32, device=device) + 1,
        flags=torch.ones(nb, dtype=torch.bool, device=device),
    )


def _call(inp: dict, L: int, chunk: int, fused: bool, states: torch.Tensor | None = None, out=None):
    with trusted_inputs():
        return ssd_scan_varlen(
            inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["states"] if states is None else states, inp["cu"],
            chunk_size=chunk, D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"], cache_indices=inp["slots"],
            has_initial_state=inp["flags"], out=out, fused=fused, max_seqlen=L,
        )


def _set_bytes(inp: dict) -> int:
    """Bytes one call reads and writes: the touched state rows twice, the token tensors, the output."""
    nb = inp["slots"].shape[0]
    state = 2 * nb * inp["states"][0].numel() * inp["states"].element_size()
    tokens = sum(inp[k].numel() * inp[k].element_size() for k in ("x", "dt", "B", "C", "z")) + inp["x"].numel() * 2
    return state + tokens


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def run_shape(nb: int, L: int, *, shape: dict, dtype: torch.dtype, state_dtype: torch.dtype, device: torch.device,
              config: TimingConfig, configs: list[dict] | None = None, chunk_sizes: list[int] = ()) -> dict:
    H, P, N, G, chunk = shape["H"], shape["P"], shape["N"], shape["G"], shape["chunk"]
    base = _inputs(nb, L, H, P, N, G, dtype, state_dtype, device, seed=nb * 1000 + L)
    # check: the fused path against the chunked path on the same inputs and pool
    init_states = base["states"].clone()  # the timed calls below advance the pool in place
    st_f, st_c = base["states"].clone(), base["states"].clone()
    out_f = _call(base, L, chunk, True, st_f)
    out_c = _call(base, L, chunk, False, st_c)
    live = base["slots"].long()
    check = dict(out_rel_err=_rel(out_f, out_c), state_rel_err=_rel(st_f[live], st_c[live]))
    n_sets = choose_n_sets(_set_bytes(base), l2_cache_bytes(device), cap=16) if device.type == "cuda" else 1
    sets = [base] + [_inputs(nb, L, H, P, N, G, dtype, state_dtype, device, seed=nb * 1000 + L + i)
                     for i in range(1, n_sets)]
    outs = [torch.empty_like(s["x"]) for s in sets]

    def maker(fused: bool):
        return lambda i: (lambda: _call(sets[i], L, chunk, fused, out=outs[i]))

    row = dict(B=nb, L=L, **check, n_sets=n_sets,
               fused_config=pick_fused_config(L, nb, H, P, interpreter=device.type != "cuda")._asdict())
    for name, fused in (("chunked", False), ("fused", True)):
        t = time_calls(maker(fused), n_sets, device=device, config=config)
        row[f"{name}_us"], row[f"{name}_p20_us"], row[f"{name}_p80_us"], row[f"{name}_mode"] = (
            t.median_us, t.p20_us, t.p80_us, t.mode)
    for q in chunk_sizes:  # the chunked path with other chunks (a tiling choice: same result up to rounding)
        st_q = init_states.clone()
        out_q = _call(base, L, q, False, st_q)
        row[f"chunked_q{q}_err"] = max(_rel(out_q, out_c), _rel(st_q[live], st_c[live]))
        row[f"chunked_q{q}_us"] = time_calls(lambda i, q=q: (lambda: _call(sets[i], L, q, False, out=outs[i])), n_sets,
                                             device=device, config=config).median_us
    row["speedup"] = row["chunked_us"] / row["fused_us"]
    row["fused_GBps"] = _set_bytes(base) / (row["fused_us"] * 1e-6) / 1e9
    if configs:
        sweep = []
        for cfg in configs:
            try:
                with forced_fused_config(**cfg):
                    t = time_calls(maker(True), n_sets, device=device, config=TimingConfig.prefill_quick())
                sweep.append(dict(cfg, us=t.median_us))
            except Exception as exc:  # noqa: BLE001 - a config that does not compile (registers, smem) is skipped
                sweep.append(dict(cfg, us=None, error=f"{type(exc).__name__}: {str(exc)[:80]}"))
        ok = [s for s in sweep if s["us"] is not None]
        row["sweep"] = sweep
        row["best"] = min(ok, key=lambda s: s["us"]) if ok else None
    return row


def sweep_configs(L: int, P: int) -> list[dict]:
    """Fused tile configs worth timing at sequences of L tokens."""
    block_ts = [t for t in (16, 32, 64) if t <= max(16, L) and t <= fused_configs.MAX_BLOCK_T]
    block_ps = [p for p in (16, 32, 64) if p <= max(16, P)]
    return [dict(block_t=t, block_p=p, num_warps=w, num_stages=s)
            for t, p, w, s in itertools.product(block_ts, block_ps, (2, 4, 8), (1, 2))
            if s == 1 or t < L]  # pipelining needs more than one trip of the token loop


def _fmt(row: dict) -> str:
    best = ""
    if row.get("best"):
        b = row["best"]
        best = f"  best fused: {b['us']:.1f} us (t{b['block_t']} p{b['block_p']} w{b['num_warps']} s{b.get('num_stages', 1)})"
    return (f"{row['B']:>3} x {row['L']:<5} chunked {row['chunked_us']:9.1f} us ({row['chunked_mode']})  "
            f"fused {row['fused_us']:9.1f} us  {row['speedup']:5.2f}x  {row['fused_GBps']:7.1f} GB/s  "
            f"err out {row['out_rel_err']:.1e} state {row['state_rel_err']:.1e}{best}"
            + "".join(f"  chunk {k[9:-3]}: {v:.1f} us (err {row[k[:-3] + '_err']:.1e})"
                      for k, v in row.items() if k.startswith("chunked_q") and k.endswith("_us")))


def _chunk_sizes(text: str) -> list[int]:
    try:
        sizes = [int(q) for q in text.split(",") if q.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected positive ints like 64,128, got {text!r}") from None
    if any(q < 1 for q in sizes):
        raise argparse.ArgumentTypeError(f"chunk sizes must be >= 1, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m fastmamba.bench.ops.scan_small_l", description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=None, help="comma-separated BxL, e.g. 1x16,4x128 (default: the issue's)")
    ap.add_argument("--state-dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--sweep", action="store_true", help="also time every fused tile config per shape")
    ap.add_argument("--tiny", action="store_true", help="tiny layer shape (CPU smoke run under the interpreter)")
    ap.add_argument("--chunk-sizes", default=[], type=_chunk_sizes,
                    help="also time the chunked path with these chunk sizes, e.g. 64,128")
    ap.add_argument("--quick", action="store_true", help="shorter timing")
    ap.add_argument("--json", default=None, help="write the rows here (JSON lines)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tiny = args.tiny or device.type != "cuda"
    shape = TINY if tiny else LAYER
    if args.shapes:
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
    else:
        shapes = TINY_SHAPES if tiny else SHAPES
    # the interpreter's bf16 tl.dot is wrong in Triton 3.6 (docs/interpreter_bf16.md): fp32 there
    dtype = torch.float32 if device.type != "cuda" else torch.bfloat16
    state_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.state_dtype]
    config = TimingConfig.prefill_quick() if args.quick or device.type != "cuda" else TimingConfig.prefill()
    print(f"# {device_name(device)}; layer H{shape['H']} P{shape['P']} N{shape['N']} G{shape['G']} chunk "
          f"{shape['chunk']}; {str(dtype).split('.')[-1]} activations, {args.state_dtype} state; "
          f"MAX_FUSED_LEN {fused_configs.MAX_FUSED_LEN}; per call, "
          + ("CUDA graph, median" if device.type == "cuda" else "CPU wall clock (interpreter: plumbing only)"))
    rows = []
    for nb, L in shapes:
        configs = sweep_configs(L, shape["P"]) if args.sweep else None
        row = run_shape(nb, L, shape=shape, dtype=dtype, state_dtype=state_dtype, device=device, config=config,
                        configs=configs, chunk_sizes=args.chunk_sizes)
        rows.append(row)
        print(_fmt(row), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            for row in rows:
                f.write(json.dumps(dict(row, device=device_name(device), state_dtype=args.state_dtype)) + "\n")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
