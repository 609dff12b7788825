"""The model's prefill tells the scan the longest prompt (host metadata it validated anyway), so a
batch of short prompts takes the fused one-launch scan even when their total exceeds its limit."""
from __future__ import annotations

import pytest
import torch

import fastmamba
from fastmamba.ops.ssd_scan import api as scan_api
from fastmamba.ops.ssd_scan.fused import api as fused
from fastmamba.ops.ssd_scan.fused import configs as fused_configs
from tests.helpers import seeded, tol


@pytest.fixture(scope="module")
def model():
    # the kernels themselves: CUDA when present, else the interpreter on the CPU
    return fastmamba.load_model("mamba2-tiny", dtype=torch.float32, device="cuda" if torch.cuda.is_available() else "cpu")


def test_short_prompts_take_the_fused_scan_with_the_same_logits(model, monkeypatch):
    count = {"fused": 0, "chunked": 0}

    def counted(fn, key):
        def run(*a, **k):
            count[key] += 1
            return fn(*a, **k)
        return run

    monkeypatch.setattr(fused, "ssd_scan_fused_launch", counted(fused.ssd_scan_fused_launch, "fused"))
    monkeypatch.setattr(scan_api, "ssd_scan_launch", counted(scan_api.ssd_scan_launch, "chunked"))
    # every prompt fits (6 <= 8), their total does not (11 > 8): only the longest prompt tells
    monkeypatch.setattr(fused_configs, "MAX_FUSED_LEN", 8)
    g = seeded(0)
    lengths = (5, 6)
    dev = model.lm_head.weight.device
    ids = torch.randint(0, 256, (sum(lengths),), generator=g).to(dev)
    cu = torch.tensor([0, 5, 11], dtype=torch.int32, device=dev)
    slots = torch.tensor([1, 0], dtype=torch.int32, device=dev)
    logits = {}
    for name, limit in (("fused", 8), ("chunked", -1)):
        monkeypatch.setattr(fused_configs, "MAX_FUSED_LEN", limit)
        cache = model.new_cache(2)
        logits[name] = model.prefill_varlen(ids, cu, cache, slots, has_initial_state=False)
    n_layer = model.cfg.n_layer
    assert count == {"fused": n_layer, "chunked": n_layer}
    torch.testing.assert_close(logits["fused"], logits["chunked"], **tol(torch.float32))
