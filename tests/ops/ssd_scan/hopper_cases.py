"""What the Hopper kernels' GPU tests share (test_hopper_chunk_output.py, test_hopper_states.py): a spy
on one of ``launch``'s Hopper entry points with the switch that turns it on or off, a helper that runs
a call both ways, and the varlen case with odd lengths, a pad slot and cached initial states."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import seeded
from tests.ops.ssd_scan.test_ssd_scan import _inputs

# the Hopper kernels' GPU test files: pytestmark = NEEDS_SM90
NEEDS_SM90 = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                       reason="the Hopper kernels need an sm_90 GPU"),
]

PAD = -1
# one token, an empty sequence, exactly a chunk, a chunk and a bit, chunks ending mid row block, a pad
# slot, some sequences from their cache slot; slot 2 and the last slot are nobody's
LENS, SLOTS = (700, 1, 0, 256, 63, 1091, 77), (5, 0, 4, PAD, 1, 3, 6)


def spy_launches(monkeypatch, attr: str, switch: str) -> list:
    """A list that records each call of ``launch.<attr>`` (its first argument's shape); its ``use(flag)``
    sets the environment variable ``switch`` to 1 or 0."""
    from fastmamba.ops.ssd_scan.chunked import launch

    class Calls(list):
        def use(self, flag: bool) -> None:
            monkeypatch.setenv(switch, "1" if flag else "0")

    calls = Calls()
    real = getattr(launch, attr)

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(launch, attr, spy)
    return calls


def run_both(calls, fn, what: str):
    """(fn() with the spied kernel on, fn() with it off); asserts that only the first ran it."""
    calls.use(True)
    n = len(calls)
    got = fn()
    torch.cuda.synchronize()
    assert len(calls) == n + 1, f"the {what} did not run"
    calls.use(False)
    want = fn()
    assert len(calls) == n + 1
    return got, want


def floats(v):
    return v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v


def varlen_case(device, lens, slots, *, H=4, G=2, N=128, dtype=torch.bfloat16, seed=0, state_dtype=torch.float32):
    """(x, dt, A, B, C), a state cache of len(lens) + 2 slots, cu_seqlens, and ``ssd_scan_varlen``'s
    keywords (chunk 256, D per channel, z, every other sequence from its cached state)."""
    inp = _inputs((sum(lens),), H, 64, G, N, dtype, device, seed, dt_scale=0.5)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    states = torch.randn(len(lens) + 2, H, 64, N, generator=seeded(seed + 1)).to(device, state_dtype)
    kw = dict(chunk_size=256, D=torch.randn(H, 64, generator=seeded(seed + 2)).to(device), z=inp["z"],
              dt_bias=inp["dt_bias"], cache_indices=torch.tensor(slots, dtype=torch.int32, device=device),
              has_initial_state=torch.tensor([i % 2 == 0 for i in range(len(lens))], device=device))
    return (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"]), states, cu, kw
