"""The launcher's side of the Hopper chunk-output kernel, on any device: when the chunk-state
kernel flags a non-finite x (entry 3 of the chunk table's row 0), the Triton kernel launched after
the Hopper one redoes the whole stage; otherwise it exits without writing. The interpreter cannot
run Gluon, so a stand-in takes the Hopper kernel's place here: it poisons the output and sets the
flag or not. The whole path with NaN inputs is tested on the GPU (test_hopper_chunk_output.py)."""
from __future__ import annotations

import pytest
import torch

from fastmamba.ops.ssd_scan import mamba_chunk_scan_combined
from fastmamba.ops.ssd_scan.chunked import launch
from tests.ops.ssd_scan.test_ssd_scan import _inputs


@pytest.mark.parametrize("flag", [0, 1])
def test_triton_kernel_redoes_the_stage_only_when_flagged(device, monkeypatch, flag):
    # chunks of 64: the C B^T buffer is then unpadded (q_pad == Q) under every tile config, as the Hopper
    # path requires
    inp = _inputs((1, 70), 2, 16, 1, 16, torch.float32, device, seed=71)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 64)
    kw = dict(D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"], dt_softplus=True)
    plain = mamba_chunk_scan_combined(*args, **kw)
    calls = []

    def stand_in(x, z, out, cb, C, D, table, *rest, **options):
        calls.append(table[0, 3].item())  # zeroed by the prep kernel, left 0 by the chunk states (finite x)
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


@pytest.mark.parametrize("bad", [None, "nan", "inf", "-inf"])
def test_chunk_state_kernel_flags_a_non_finite_x_for_the_hopper_path(device, monkeypatch, bad):
    """With the Hopper kernel next, the chunk-state kernel sets the flag when any x of a live chunk is
    not finite (here one value in the second, partial chunk), and only then; the Triton kernel then
    gives the plain path's output: nothing before the bad token is touched."""
    inp = _inputs((1, 150), 2, 16, 1, 16, torch.float32, device, seed=73)
    x = inp["x"].clone()
    if bad is not None:
        x[0, 101, 1, 3] = float(bad)
    args = (x, inp["dt"], inp["A"], inp["B"], inp["C"], 64)
    kw = dict(D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"], dt_softplus=True)
    plain = mamba_chunk_scan_combined(*args, **kw)
    seen = []

    def stand_in(x, z, out, cb, C, D, table, *rest, **options):
        seen.append(table[0, 3].item())
        out.fill_(float("nan"))

    monkeypatch.setattr(launch, "hopper_chunk_output_ok", lambda *a: True)
    monkeypatch.setattr(launch, "chunk_output_sm90", stand_in)
    got = mamba_chunk_scan_combined(*args, **kw)
    assert seen == [0 if bad is None else 1]
    if bad is not None:
        torch.testing.assert_close(got, plain, atol=0, rtol=0, equal_nan=True)
        assert torch.isfinite(got[0, :101]).all() and not torch.isfinite(got[0, 101, 1, 3])


def test_cb_tiles_on_the_diagonal_are_zero_above_it(device, monkeypatch):
    """The Hopper kernel's rank-1 diagonal path multiplies C B^T's diagonal tiles without a causal mask:
    the C B^T kernel must leave zeros above the diagonal of those tiles (exactly) and C_t . B_s on and
    below it. Chunks of 128 (two 64-row tiles a side), the second one partial."""
    L, G, N, Q = 200, 1, 16, 128
    inp = _inputs((1, L), 2, 16, G, N, torch.float32, device, seed=72)
    seen = {}

    def stand_in(x, z, out, cb, C, D, table, *rest, **options):
        seen["cb"], seen["table"] = cb.clone(), table.clone()
        table[0, 3] = 1  # the Triton kernel writes the output

    monkeypatch.setattr(launch, "hopper_chunk_output_ok", lambda *a: True)
    monkeypatch.setattr(launch, "chunk_output_sm90", stand_in)
    mamba_chunk_scan_combined(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], Q, D=inp["D"], z=inp["z"])
    cb, table = seen["cb"], seen["table"]
    tile = launch.CB_BLOCK
    for c, (start, length) in enumerate([(0, Q), (Q, L - Q)]):
        assert table[c, :2].tolist() == [start, length]
        Cc = inp["C"][0, start:start + length, 0].double()
        Bc = inp["B"][0, start:start + length, 0].double()
        exact = Cc @ Bc.T
        for m0 in range(0, length, tile):
            diag = cb[c, 0, m0:m0 + tile, m0:m0 + tile].double()
            rows = min(tile, length - m0)
            t = torch.arange(tile, device=cb.device)
            above = t[None, :] > t[:, None]
            assert torch.all(diag[above] == 0), f"chunk {c}, tile at {m0}: non-zero above the diagonal"
            want = exact[m0:m0 + rows, m0:m0 + rows].tril()
            torch.testing.assert_close(diag[:rows, :rows].tril(), want, atol=1e-4, rtol=1e-4)


def test_mode_switch_reads_its_variable_strictly(monkeypatch):
    from fastmamba.ops.ssd_scan.hopper.chunk_output import _mode

    for value, want in (("", "auto"), ("auto", "auto"), ("1", "on"), ("ON", "on"), ("0", "off"), ("no", "off")):
        monkeypatch.setenv("FASTMAMBA_HOPPER_SCAN", value)
        assert _mode() == want
    monkeypatch.delenv("FASTMAMBA_HOPPER_SCAN")
    assert _mode() == "auto"
    monkeypatch.setenv("FASTMAMBA_HOPPER_SCAN", "maybe")
    with pytest.raises(ValueError, match="FASTMAMBA_HOPPER_SCAN"):
        _mode()


def test_hopper_kernels_block_nests_and_unwinds():
    from fastmamba.ops.ssd_scan.hopper import chunk_output as hopper

    assert hopper._inside == 0
    with hopper.hopper_kernels():
        with hopper.hopper_kernels():
            assert hopper._inside == 2
        with pytest.raises(RuntimeError):
            with hopper.hopper_kernels():
                raise RuntimeError("boom")
        assert hopper._inside == 1
    assert hopper._inside == 0


def test_long_prefill_kernels_opens_the_block_from_the_threshold():
    """``long_prefill_kernels(tokens)``: the ``hopper_kernels()`` block from EAGER_MIN_TOKENS packed
    tokens on (a model's eager prefill), no block below."""
    from fastmamba.ops.ssd_scan.hopper import chunk_output as hopper

    with hopper.long_prefill_kernels(hopper.EAGER_MIN_TOKENS - 1):
        assert hopper._inside == 0
    with hopper.long_prefill_kernels(hopper.EAGER_MIN_TOKENS):
        assert hopper._inside == 1
    assert hopper._inside == 0


@pytest.mark.parametrize("sms", [1, 7, 57, 114, 132])
@pytest.mark.parametrize("chunk_size", [64, 128, 256])
def test_hopper_grid_is_a_multiple_of_the_row_blocks(monkeypatch, sms, chunk_size):
    """The kernel turns each program's row block with its turn in the loop ((item + wave) % M_BLOCKS,
    hopper_kernel._item): a one-to-one map of the items only when the program count is a multiple of
    M_BLOCKS = chunk_size / 64. The launcher rounds the grid down to one, whatever the SM count (7 SMs
    give 14 programs, not a multiple of 4), and never launches more programs than items."""
    from fastmamba.ops.ssd_scan.hopper import chunk_output as hopper

    real = hopper._gluon()
    if real is None:
        pytest.skip("this Triton has no Gluon")
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, args, kwargs))

    monkeypatch.setattr(hopper, "_gluon", lambda: (Recorder(), real[1], real[2]))
    monkeypatch.setattr(hopper, "sm_count", lambda t: sms)
    from fastmamba.ops.ssd_scan.hopper.chunk_output_kernel import chunk_output_sm90_kernel

    n_items_at = chunk_output_sm90_kernel.arg_names.index("n_items")
    m_blocks = chunk_size // 64
    for H, n_chunks in ((1, 1), (3, 2), (80, 8)):
        L = n_chunks * chunk_size
        x = torch.zeros(1, L, H, 64, dtype=torch.bfloat16)
        C = torch.zeros(1, L, 1, 64, dtype=torch.bfloat16)
        cb = torch.zeros(n_chunks, 1, chunk_size, chunk_size, dtype=torch.bfloat16)
        states = torch.zeros(n_chunks, H, 64, 64, dtype=torch.bfloat16)
        scratch = torch.zeros(H, n_chunks, chunk_size)
        table = torch.zeros(n_chunks, 4, dtype=torch.int32)
        launches.clear()
        hopper.chunk_output_sm90(x, x, torch.empty_like(x), cb, C, None, table, None, states, scratch, scratch,
                                 None, None, n_seg=1, chunk_size=chunk_size)
        (grid, args, kwargs), = launches
        n_items = H * n_chunks * m_blocks
        assert args[n_items_at] == n_items
        assert grid[0] % m_blocks == 0
        assert m_blocks <= grid[0] <= max(n_items, m_blocks)
        assert grid[0] >= min(n_items, hopper.PROGRAMS_PER_SM * sms) - (m_blocks - 1)


def test_states_switch_reads_its_variable_strictly(monkeypatch):
    from fastmamba.ops.ssd_scan.hopper.states import _enabled

    for value, want in (("0", False), ("off", False), ("1", True), ("", True)):
        monkeypatch.setenv("FASTMAMBA_HOPPER_STATES", value)
        assert _enabled() is want
    monkeypatch.setenv("FASTMAMBA_HOPPER_STATES", "maybe")
    with pytest.raises(ValueError, match="FASTMAMBA_HOPPER_STATES"):
        _enabled()
