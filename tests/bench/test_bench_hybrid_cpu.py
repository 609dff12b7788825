"""The ``e2e`` target on a hybrid model (nemotron-h-tiny) on the CPU: rows with TTFT, context and
roofline fields, the roofline bytes (weights + KV read + Mamba states read and written), the
transformers peer row, and the options hybrids refuse. Timings here mean nothing.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import fastmamba
from fastmamba.bench import e2e, targets


@pytest.fixture(autouse=True)
def reference_ops(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the bench's bookkeeping, not kernels: the PyTorch references


def test_e2e_hybrid_rows_and_peer(tmp_path, capsys):
    pytest.importorskip("transformers")
    path = tmp_path / "e2e.jsonl"
    argv = ["e2e", "--model", "nemotron-h-tiny", "--batch", "1,3", "--gen-len", "4", "--prompt-len", "10", "--peer",
            "--json", str(path)]
    assert targets.main(argv) == 0
    out = capsys.readouterr().out
    assert "# hybrid: 3 Mamba / 2 attention / 2 MLP layers, context 10" in out
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["provider"], r["batch"]) for r in rows] == [("fastmamba", 1), ("fastmamba", 3),
                                                           (rows[2]["provider"], 1)]
    assert rows[2]["provider"].startswith("transformers ") and rows[2]["fastmamba_speedup"] > 0
    for r in rows:
        assert r["context"] == 10 and r["ttft_ms"] > 0 and r["decode_tok_s"] > 0 and r["pct_roofline"] > 0
    # the bench loads the preset in the loader's default dtype: bf16 on a GPU, fp32 on the CPU (the
    # weights', conv states' and K/V's bytes follow it); the same model here, on the CPU
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    model = fastmamba.load_model("nemotron-h-tiny", device="cpu", dtype=dtype)
    # the mean context of the timed steps: 10 prompt tokens + 3 warm-up steps, then 4 timed ones
    assert rows[1]["step_bytes"] == e2e.hybrid_step_bytes(model, 3, 13 + 1.5)
    # the peer: generate's 3 decode steps (after its first token) read 10, 11, 12 tokens
    assert rows[2]["step_bytes"] == e2e.hybrid_step_bytes(model, 1, 10 + 1)


def test_hybrid_step_bytes_formula():
    model = fastmamba.load_model("nemotron-h-tiny", device="cpu")  # M*-M-*M: 3 Mamba, 2 attention layers
    c, m = model.cfg, model.cfg.mamba
    assert not c.tie_embeddings  # untied: a step reads B rows of the [256, 64] input table, not all of it

    def weights(b):
        return sum(p.numel() * 4 for p in model.parameters()) - (256 - b) * 64 * 4

    mamba = 3 * 2 * (m.conv_dim * 4 * 4 + 8 * 16 * 16 * 4)  # conv [E, W] fp32 + SSM [H, P, N] fp32, read + write
    kv = 2 * 2 * c.n_kv_heads * c.head_dim * 4 * (100 + 1)  # 2 layers, K and V, 100 read + 1 written
    assert e2e.hybrid_step_bytes(model, 1, 100) == weights(1) + mamba + kv
    assert e2e.hybrid_step_bytes(model, 5, 100) == weights(5) + 5 * (mamba + kv)
    assert e2e.hybrid_step_bytes(model, 1, 100, torch.bfloat16) == weights(1) + mamba - 3 * 8 * 16 * 16 * 2 * 2 + kv
    assert e2e.hybrid_step_bytes(model, 300, 0) == sum(p.numel() * 4 for p in model.parameters()) + 300 * (
        mamba + 2 * 2 * c.n_kv_heads * c.head_dim * 4)  # more requests than rows: the whole table, once
    # bf16 (the preset's dtype on a GPU): weights, conv states and K/V at 2 bytes, the SSM state as asked
    bf = fastmamba.load_model("nemotron-h-tiny", device="cpu", dtype=torch.bfloat16)
    assert {p.dtype for p in bf.parameters()} == {torch.bfloat16, torch.float32}  # A_log, D, dt_bias stay fp32
    bf_weights = sum(p.numel() * p.element_size() for p in bf.parameters()) - (256 - 3) * 64 * 2
    bf_mamba = 3 * 2 * (m.conv_dim * 4 * 2 + 8 * 16 * 16 * 4)
    bf_kv = 2 * 2 * c.n_kv_heads * c.head_dim * 2 * (14.5 + 1)
    assert e2e.hybrid_step_bytes(bf, 3, 14.5) == bf_weights + 3 * (bf_mamba + bf_kv)


def test_step_bytes_tied_and_untied():
    """Mamba-2: a tied table is read whole by the LM head; an untied one only in the B tokens' rows."""
    tied = fastmamba.load_model("mamba2-tiny", device="cpu")
    c = tied.cfg
    assert c.tie_embeddings
    params = sum(p.numel() for p in tied.parameters())  # the shared table once
    states = c.n_layer * 2 * (c.conv_dim * c.d_conv * 4 + c.nheads * c.headdim * c.d_state * 4)
    assert e2e.step_bytes(tied, 2) == params * 4 + 2 * states
    untied = type(tied)(dataclasses.replace(c, tie_embeddings=False))
    V, M = untied.backbone.embeddings.weight.shape
    assert e2e.step_bytes(untied, 2) == (params + V * M) * 4 - (V - 2) * M * 4 + 2 * states


def test_e2e_hybrid_refuses_mamba_only_options(capsys):
    assert targets.main(["e2e", "--model", "nemotron-h-tiny", "--drift", "4", "--batch", "1"]) == 2
    assert "not implemented for hybrid" in capsys.readouterr().err


def test_e2e_hybrid_speculative_oracle(tmp_path, capsys):
    """K=2, batch 1, gen-len 6: the engine's speculative tokens equal the plain loop's, every draft accepted."""
    path = tmp_path / "e2e.jsonl"
    argv = ["e2e", "--model", "nemotron-h-tiny", "--batch", "1", "--gen-len", "6", "--prompt-len", "8",
            "--speculate", "2", "--json", str(path)]
    assert targets.main(argv) == 0
    spec = [json.loads(line) for line in path.read_text().splitlines()][-1]
    assert spec["provider"] == "fastmamba speculative K=2 (oracle)" and spec["speculate"] == 2
    assert spec["tokens_match"] is True and spec["acceptance"] == 1.0 and spec["tokens_per_step"] == 3.0
    assert spec["first_mismatch"] == [None]  # no request left the plain run's tokens
    assert "yes" in capsys.readouterr().out.splitlines()[-1]
