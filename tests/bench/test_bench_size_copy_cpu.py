"""The benchmarks' same-size copy rows (fastmamba/bench/size_copy.py): the copy calls, the row the
runner makes of them, and the '% size copy' column on our rows. The copy kernel runs on the GPU
when there is one, else under the Triton interpreter (TRITON_INTERPRET=1)."""
from __future__ import annotations

import pytest
import torch

from fastmamba.bench import kernels, report, size_copy
from fastmamba.bench.ops._base import Case, Provider
from fastmamba.bench.ops.gated_rmsnorm import GatedRMSNormBench
from fastmamba.bench.timing import TimingConfig

CPU = torch.device("cpu")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _row(kind: str, case_id: int, median_us: float | None, mode: str = "graph", provider: str = "p") -> report.Row:
    return report.Row(op="norm", title="t", shape="s", dims="d", dtype="bf16", batch=1, provider=provider, kind=kind,
                      version="v", bytes=100, mode=mode, median_us=median_us, case_id=case_id)


def test_copy_calls_move_half_the_bytes_each_way_and_rotate_buffers():
    make_call = size_copy.copy_calls(1002, 3, DEV)  # 501 bytes each way: 126 words
    srcs = []
    for i in range(3):
        src, dst = make_call.pairs[i]
        dst.fill_(7)  # poison
        make_call(i)()
        assert dst.dtype == torch.int32 and dst.numel() == 126
        assert torch.equal(dst, src) and bool((dst == 1).all())
        srcs.append(src.data_ptr())
    assert len(set(srcs)) == 3  # one buffer pair per set
    make_call.pairs[0][1].zero_()
    make_call(3)()  # the sets cycle as the op's do
    assert bool((make_call.pairs[0][1] == 1).all())


def test_copy_kernel_copies_across_program_boundaries():
    n = size_copy.BLOCK_WORDS + 37  # two programs, the second one masked
    src = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, device=DEV)
    dst = torch.full_like(src, -1)
    size_copy.copy_words(src, dst)
    assert torch.equal(dst, src)


def test_copy_provider_is_gpu_only():
    (prov,) = size_copy.copy_providers(CPU)  # whatever the host has
    assert not prov.available and prov.reason == "GPU only" and prov.kind == size_copy.KIND


def test_runner_times_the_copy_and_marks_it_unchecked():
    bench = GatedRMSNormBench()
    case = Case(op="norm", shape="s", dims="d", dtype="bf16", batch=1, nbytes=4096)
    prov = Provider(size_copy.NAME, size_copy.KIND, "t", lambda *a: None)
    row = kernels._base_row(bench, case, prov)
    fatal = kernels._run_one(bench, case, prov, None, [], 2, DEV, TimingConfig.quick(),
                             {"copy_gbps": 1.0, "l2_bytes": 1 << 20}, row)
    assert fatal == "" and row.status == "ok" and row.check == "same-size copy"
    assert row.median_us > 0 and row.bytes == 4096 and row.n_sets == 2


def test_size_copy_ratio_on_our_rows_only():
    rows = [
        _row("ours", 1, 20.0, provider="fastmamba"),
        _row("ours", 1, 16.0, provider="fastmamba+pdl"),
        _row("peer", 1, 40.0),
        _row(size_copy.KIND, 1, 15.0, provider="copy"),
        _row(size_copy.KIND, 1, 12.0, provider="copy+pdl"),
        _row("ours", 2, 10.0),  # no copy row for case 2
        _row("ours", 3, 10.0, mode="cpu"),  # wall-clock rows get no ratio
        _row(size_copy.KIND, 3, 5.0, mode="cpu", provider="copy"),
        _row("ours", 4, 8.0, provider="fastmamba"),
        _row("ours", 4, 6.0, provider="fastmamba+pdl"),
        _row(size_copy.KIND, 4, 4.5, provider="copy"),
        _row(size_copy.KIND, 4, 5.0, provider="copy+pdl"),  # slower than the plain copy here
    ]
    size_copy.fill_size_copy(rows)
    # plain rows against the plain copy; PDL rows against the faster of the two copies
    assert [r.pct_size_copy for r in rows] == [75.0, 75.0, None, None, None, None, None, None, 56.25, 75.0, None, None]
    table = report.format_table(rows)
    assert "% size copy" in table and "75%" in table and "56%" in table
    for r in rows:
        r.pct_size_copy = None
    assert "% size copy" not in report.format_table(rows)  # the column only when some row has it


def test_peers_ratio_ignores_the_copy_row():
    rows = [_row("ours", 1, 20.0, provider="fastmamba"), _row(size_copy.KIND, 1, 5.0, provider="copy")]
    for r in rows:
        r.status = "ok"
    kernels._fill_ratios(rows)
    assert rows[0].vs == ""  # a copy is no peer


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
def test_gpu_copy_kernel_plain_and_pdl(pdl):
    if pdl and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90+")
    n = 3 * size_copy.BLOCK_WORDS + 5
    src = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, device="cuda")
    dst = torch.full_like(src, -1)
    size_copy.copy_words(src, dst, pdl)
    torch.cuda.synchronize()
    assert torch.equal(dst, src)
    assert len(size_copy.copy_providers(torch.device("cuda"))) == 2
