"""The launcher's side of the Hopper chunk-output kernel, on any device: when that kernel flags a
non-finite x (entry 3 of the chunk table's row 0), the Triton kernel launched after it redoes the whole
stage; otherwise it exits without writing. The interpreter cannot run Gluon, so a stand-in takes the
Hopper kernel's place here: it poisons the output and sets the flag or not. The real kernel's flag is
tested on the GPU (test_hopper_chunk_output.py: NaN inputs)."""
from __future__ import annotations

import pytest
import torch

from fastmamba.ops.ssd_scan import launch, mamba_chunk_scan_combined
from tests.ops.ssd_scan.test_ssd_scan import _inputs


@pytest.mark.parametrize("flag", [0, 1])
def test_triton_kernel_redoes_the_stage_only_when_flagged(device, monkeypatch, flag):
    inp = _inputs((1, 40), 2, 16, 1, 16, torch.float32, device, seed=71)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 16)
    kw = dict(D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"], dt_softplus=True)
    plain = mamba_chunk_scan_combined(*args, **kw)
    calls = []

    def stand_in(x, z, out, cb, C, D, table, *rest, **options):
        calls.append(table[0, 3].item())  # zeroed by the cumsum kernel before this launch
        out.fill_(float("nan"))
        table[0, 3] = flag

    monkeypatch.setattr(launch, "hopper_chunk_output_ok", lambda *a: True)
    monkeypatch.setattr(launch, "chunk_output_sm90", stand_in)
    got = mamba_chunk_scan_combined(*args, **kw)
    assert calls == [0]
    if flag:
        assert torch.equal(got, plain)
    else:
        assert torch.isnan(got).all()
