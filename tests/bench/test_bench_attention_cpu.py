"""``bench kernels --ops attn`` on the CPU (tiny shapes, the Triton kernel in the interpreter when
TRITON_INTERPRET=1): the paged decode attention rows, checked against the gathered SDPA peer, with
the byte model (K and V read once). Timings here mean nothing.
"""
from __future__ import annotations

import json

import torch

from fastmamba import cli
from fastmamba.bench.ops import paged_attention


def test_kernels_attention_rows(tmp_path):
    out = tmp_path / "rows.jsonl"
    rc = cli.main(["bench", "kernels", "--ops", "attn", "--batch", "1,3", "--quick", "--device", "cpu",
                   "--json", str(out)])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines() if '"record"' not in line]
    cases = {(r["batch"], r["params"]["L"]) for r in rows}
    assert cases == {(b, L) for b in (1, 3) for L in paged_attention.CPU_CONTEXTS}
    assert {r["provider"] for r in rows} == {"fastmamba", "sdpa (gathered)", "torch-ref"}
    assert {r["dims"].endswith(" kv fp8") for r in rows} == {False, True}  # bf16 and float8 pages
    for r in rows:
        assert r["status"] == "ok"
        kv = torch.float8_e4m3fn if r["params"].get("kv_dtype") else None
        assert r["bytes"] == paged_attention.attention_bytes(r["batch"], r["params"]["L"], 4, 2, 16, 4, torch.bfloat16,
                                                             kv)
        if r["provider"] == "fastmamba":
            assert r["check"] == "ok"


def test_make_set_gathers_the_same_cache():
    bench = paged_attention.BENCH
    case = next(c for c in bench.cases(torch.device("cpu"), [3]) if c.params["L"] == 37)
    inp = bench.make_set(case, torch.device("cpu"), seed=1)
    args = bench.args(case, inp)
    assert inp["block_table"].unique().numel() == inp["block_table"].numel()  # no page shared
    want = paged_attention._ref(*args).float()
    for fn in (paged_attention._sdpa, paged_attention._ours):
        torch.testing.assert_close(fn(*args).float(), want, atol=5e-2, rtol=1e-2)


# ---- bench prefill --ops attn: the packed prefill attention ------------------------------------

def test_prefill_attention_rows(tmp_path):
    """``bench prefill --ops attn``: every prompt set, every provider checked against the gathered SDPA
    peer; the byte and FLOP models of the rows (hand count of the causal pairs)."""
    from fastmamba.bench.ops import prefill_attention as pa

    out = tmp_path / "rows.jsonl"
    rc = cli.main(["bench", "prefill", "--ops", "attn", "--quick", "--device", "cpu", "--json", str(out)])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines() if '"record"' not in line]
    assert {(r["batch"], r["params"]["n"], r["params"]["ctx"]) for r in rows} == set(pa.CPU_BATCHES)
    assert {r["provider"] for r in rows} == {"fastmamba", "sdpa (gathered)", "torch-ref"}
    for r in rows:
        B, n, ctx = r["batch"], r["params"]["n"], r["params"]["ctx"]
        assert r["status"] == "ok"
        assert r["bytes"] == pa.attention_bytes(B, n, ctx, 4, 2, 16, 4, torch.bfloat16)
        # query i of a prompt sees ctx + i + 1 keys: 3 prompts of 5 after 6 -> 3 x (30 + 15) pairs
        assert r["flops"] == 4 * 4 * 16 * B * sum(ctx + i + 1 for i in range(n))
        if r["provider"] != "sdpa (gathered)":
            assert r["check"] == "ok"


def test_prefill_attention_set_agrees_across_providers():
    """The three providers read the same prompts and cache from one input set (pages shuffled, K/V
    repeated for the peer where cached tokens come first)."""
    from fastmamba.bench.ops import prefill_attention as pa

    bench = pa.BENCH
    for case in bench.cases(torch.device("cpu")):
        inp = bench.make_set(case, torch.device("cpu"), seed=2)
        args = bench.args(case, inp)
        assert inp["block_table"].unique().numel() == inp["block_table"].numel()  # no page shared
        want = pa._ref(*args).float()
        for fn in (pa._sdpa, pa._ours):
            torch.testing.assert_close(fn(*args).float(), want, atol=5e-2, rtol=1e-2)
