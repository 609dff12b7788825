"""Tensor parallelism of an MoE hybrid on the Triton kernels (the interpreter on a CPU; the other
tensor-parallel tests run the ops' references): the MoE decode kernels' arrival counters and the
attention's K/V scales are non-persistent buffers that ``to_empty`` leaves uninitialised and no
checkpoint fills; a rank's model must start them as a whole model does (they were garbage: TP=2
generated other tokens than TP=1 on the kernels, and the same ones on the references)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fastmamba.distributed import TPGroup
from fastmamba.distributed.nemotron_h import build_tp_nemotron_h
from fastmamba.layers.buffers import reset_runtime_buffers
from fastmamba.models.nemotron_h import PRESETS

pytestmark = pytest.mark.kernels


def test_rank_model_starts_its_runtime_buffers(monkeypatch):
    """Whatever ``to_empty`` leaves (here: 7 everywhere), the counters are zeros and the scales 1."""
    to_empty = nn.Module.to_empty

    def poisoned(self, *, device, recurse=True):
        out = to_empty(self, device=device, recurse=recurse)
        with torch.no_grad():
            for b in self.buffers():
                b.fill_(7)
        return out

    monkeypatch.setattr(nn.Module, "to_empty", poisoned)
    model = build_tp_nemotron_h(PRESETS["nemotron-3-tiny"], TPGroup(rank=1, world_size=2, device=torch.device("cpu")),
                                dtype=torch.float32)
    blocks = model.backbone.layers
    assert all(int(b.mixer.decode_arrivals.abs().sum()) == 0 for b in blocks if b.kind == "E")
    assert all(float(b.mixer.k_scale) == float(b.mixer.v_scale) == 1.0 for b in blocks if b.kind == "*")


def test_a_layer_without_a_reset_is_named():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("hits", torch.zeros(2), persistent=False)

    with pytest.raises(TypeError, match=r"inner \(Counter\) holds non-persistent buffers \['hits'\]"):
        reset_runtime_buffers(nn.Sequential(nn.Linear(2, 2), nn.ModuleDict({"inner": Counter()})).get_submodule("1"))


def test_generate_tp2_on_the_kernels_equals_tp1(capfd):
    from fastmamba.cli import main

    argv = ["generate", "--model", "nemotron-3-tiny", "--prompt-ids", "1,2,3", "--max-new-tokens", "6", "--device", "cpu",
            "--ignore-eos"]
    assert main(argv) == 0
    single = capfd.readouterr().out.split()
    assert main(argv + ["--tp", "2"]) == 0
    assert len(single) == 6 and capfd.readouterr().out.split() == single
