"""What ``bench e2e`` prints and writes: the decode tables (Mamba-2, hybrid), the speculative and drift
tables, the JSON lines and the decode tok/s plot. Row keys are those of ``fastmamba.bench.e2e_runs``."""
from __future__ import annotations

import json
import sys

from fastmamba.bench.e2e_runs import DTYPES, state_label


def _pre(r: dict) -> str:
    return f"{r['prefill_tok_s']:14.0f}" if "prefill_tok_s" in r else f"{'—':>14}"


def print_decode_table(rows: list[dict]) -> None:
    """A Mamba-2 model's decode rows: prefill tok/s, ms/step, decode tok/s, roofline ms and % of it."""
    print(f"{'provider':42} {'batch':>5} {'prefill tok/s':>14} {'ms/step':>9} {'decode tok/s':>13} "
          f"{'roofline ms':>12} {'% roofline':>10}")
    for r in rows:
        print(f"{r['provider']:42} {r['batch']:5d} {_pre(r)} {r['ms_per_step']:9.3f} {r['decode_tok_s']:13.0f} "
              f"{r['roofline_ms']:12.3f} {r['pct_roofline']:9.0f}%")


def print_hybrid_table(rows: list[dict], *, moe: bool) -> None:
    """A hybrid model's decode rows (context and TTFT columns; experts/layer for MoE models), then the
    fastmamba / transformers ratio where a peer row carries one."""
    print(f"{'provider':34} {'batch':>5} {'context':>7} {'TTFT ms':>9} {'prefill tok/s':>14} {'ms/step':>9} "
          f"{'decode tok/s':>13} {'roofline ms':>12} {'% roofline':>10}" + (" experts/layer" if moe else ""))
    for r in rows:
        experts = f" {r['experts_touched']:13.1f}" if "experts_touched" in r else ""
        print(f"{r['provider']:34} {r['batch']:5d} {r['context']:7d} {r['ttft_ms']:9.2f} {_pre(r)} "
              f"{r['ms_per_step']:9.3f} {r['decode_tok_s']:13.1f} {r['roofline_ms']:12.3f} {r['pct_roofline']:9.0f}%"
              + experts)
    peer = next((r for r in rows if "fastmamba_speedup" in r), None)
    if peer:
        print(f"fastmamba / transformers decode tok/s at batch 1: {peer['fastmamba_speedup']:.1f}x")


def print_spec_table(spec_rows: list[dict], *, hybrid: bool) -> None:
    """Speculative decoding against the plain run; a Mamba-2 model's table adds ms per verify step and
    the engine's steps per verify path."""
    if not spec_rows:
        return
    if hybrid:
        print(f"{'speculative decoding':34} {'batch':>5} {'K':>3} {'plain tok/s':>12} {'spec tok/s':>11} "
              f"{'speedup':>8} {'accepted':>9} {'tok/step':>9} {'match':>6}")
        for r in spec_rows:
            print(f"{r['provider']:34} {r['batch']:5d} {r['speculate']:3d} {r['plain_decode_tok_s']:12.1f} "
                  f"{r['decode_tok_s']:11.1f} {r['speedup']:7.2f}x {r['acceptance']:8.0%} "
                  f"{r['tokens_per_step']:9.2f} {'yes' if r['tokens_match'] else 'NO':>6}")
        return
    print(f"{'speculative decoding':42} {'batch':>5} {'K':>3} {'plain tok/s':>12} {'spec tok/s':>11} "
          f"{'speedup':>8} {'accepted':>9} {'tok/step':>9} {'ms/step':>9} {'match':>6}  steps by path")
    for r in spec_rows:
        paths = " ".join(f"{p}:{n}" for p, n in r.get("steps_by_path", {}).items() if n)
        print(f"{r['provider']:42} {r['batch']:5d} {r['speculate']:3d} {r['plain_decode_tok_s']:12.0f} "
              f"{r['decode_tok_s']:11.0f} {r['speedup']:7.2f}x {r['acceptance']:8.0%} "
              f"{r['tokens_per_step']:9.2f} {r['ms_per_step']:9.3f} {'yes' if r['tokens_match'] else 'NO':>6}  "
              f"{paths} ({r.get('verify_path', 'auto')})")


def print_drift_table(drift_rows: list[dict]) -> None:
    """The logits' drift of each 16-bit state variant from the fp32-state run (``run_drift`` rows)."""
    if not drift_rows:
        return
    print(f"{'logits drift from an fp32-state run':42} {'state':>8} {'requests':>8} {'tokens':>7} "
          f"{'max rel err':>12} {'mean rel err':>13} {'first argmax diff':>18} {'argmax diffs':>13}")
    for r in drift_rows:
        first = "never" if r["first_argmax_diff"] is None else str(r["first_argmax_diff"])
        print(f"{'fastmamba (teacher forced)':42} {state_label(DTYPES[r['ssm_dtype']], r['stochastic_rounding']):>8} "
              f"{r['batch']:8d} {r['tokens']:7d} {r['max_rel_err']:12.3e} {r['mean_rel_err']:13.3e} "
              f"{first:>18} {r['argmax_diffs']:13d}")


def append_json(path: str, rows: list[dict], **fields) -> None:
    """One JSON line per row, each with ``fields`` (model, device, copy_gbs, quantization, command)
    added after the row's own keys."""
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps(dict(r, **fields)) + "\n")


def plot_decode(path: str, rows: list[dict], title: str) -> None:
    """PNG of our decode tok/s against the bandwidth roofline's, per batch (log-log); needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib; skipped", file=sys.stderr)
        return
    ours = [r for r in rows if r["provider"] == "fastmamba"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["batch"] for r in ours], [r["decode_tok_s"] for r in ours], "o-", label="fastmamba")
    ax.plot([r["batch"] for r in ours], [r["batch"] * 1e3 / r["roofline_ms"] for r in ours], "--",
            label="bandwidth roofline")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch")
    ax.set_ylabel("decode tokens / s")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
