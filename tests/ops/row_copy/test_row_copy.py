"""copy_rows (fastmamba/ops/row_copy): one row of every layer of stacked state pools, by the
Triton kernel (CPU: the interpreter) against torch's copy (copy_rows_ref)."""
from __future__ import annotations

import pytest
import torch

from fastmamba.ops.row_copy import copy_rows
from fastmamba.ops.row_copy import kernel as row_copy_kernel
from fastmamba.ops.row_copy.ref import copy_rows_ref
from tests.helpers import seeded


def _pools(device, n_layer, rows, row_shape, dtype, seed):
    return torch.randn(n_layer, rows, *row_shape, generator=seeded(seed)).to(device=device, dtype=dtype)


@pytest.fixture
def launches(monkeypatch):
    """Counts the kernel's launches (they still run)."""
    from tests.helpers import count_launches

    return count_launches(monkeypatch, row_copy_kernel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_copy_rows_matches_torch(device, dtype, launches):
    """Odd sizes (a row of 3*7*5 = 105 elements, partial blocks; 4101 > one block of 4096), batch-1
    pools, rows at either end; the other rows of the destination stay bit for bit."""
    for case, (n_layer, row_shape, rows_dst, rows_src, dst_row, src_row) in enumerate([
            (3, (3, 7, 5), 6, 4, 5, 2), (1, (4101,), 1, 2, 0, 1), (2, (2, 16), 9, 9, 0, 8)]):
        src = [_pools(device, n_layer, rows_src, row_shape, dtype, 10 * case)]
        dst = [_pools(device, n_layer, rows_dst, row_shape, dtype, 10 * case + 1)]
        want = [d.clone() for d in dst]
        copy_rows_ref(want, dst_row, src, src_row)
        before = launches[0]
        copy_rows(dst, dst_row, src, src_row)
        assert launches[0] == before + 1, "the kernel did not run"
        assert torch.equal(dst[0], want[0])


def test_copy_rows_of_two_pools_views_with_a_layer_gap(device, launches):
    """Pools that are views with a layer stride wider than rows x row (a slice of a bigger stack) and
    a storage offset; conv-like bf16 and ssm-like fp32 pairs in one call."""
    big = _pools(device, 3, 10, (2, 3), torch.float32, 1)
    ssm_dst = big[:, 2:7]  # layer stride 10 rows, storage offset 2 rows
    ssm_src = _pools(device, 3, 4, (2, 3), torch.float32, 2)
    conv_dst = _pools(device, 3, 5, (6, 3), torch.bfloat16, 3)
    conv_src = _pools(device, 3, 4, (6, 3), torch.bfloat16, 4)
    want_big, want_conv = big.clone(), conv_dst.clone()
    copy_rows_ref([want_big[:, 2:7], want_conv], 4, [ssm_src, conv_src], 3)
    copy_rows([ssm_dst, conv_dst], 4, [ssm_src, conv_src], 3)
    assert launches[0] == 2
    assert torch.equal(big, want_big) and torch.equal(conv_dst, want_conv)
    # rows padded apart (row stride 7 for rows of 5 elements): still one contiguous run per row
    padded = _pools(device, 2, 4, (7,), torch.float32, 11)
    rows = padded[..., :5]
    want = padded.clone()
    src = [_pools(device, 2, 3, (5,), torch.float32, 12)]
    copy_rows_ref([want[..., :5]], 1, src, 2)
    copy_rows([rows], 1, src, 2)
    assert launches[0] == 3 and torch.equal(padded, want)


def test_rows_the_kernel_cannot_take_go_through_torch(device, launches):
    """A dtype change or a row that is not contiguous: torch's copy (cast included), no launch."""
    src = [_pools(device, 2, 3, (4, 4), torch.float32, 5)]
    dst = [_pools(device, 2, 3, (4, 4), torch.bfloat16, 6)]
    want = [dst[0].clone()]
    copy_rows_ref(want, 1, src, 0)
    copy_rows(dst, 1, src, 0)
    assert torch.equal(dst[0], want[0])
    strided = _pools(device, 2, 3, (4, 8), torch.float32, 7)[..., ::2]
    want = [strided.clone()]
    copy_rows_ref(want, 2, src, 1)
    copy_rows([strided], 2, src, 1)
    assert torch.equal(strided, want[0]) and launches[0] == 0


def test_rows_outside_a_pool_raise_before_any_copy(device):
    src = [_pools(device, 2, 3, (4,), torch.float32, 8), _pools(device, 2, 3, (4,), torch.float32, 9)]
    dst = [torch.zeros(2, 5, 4, device=device), torch.zeros(2, 2, 4, device=device)]
    with pytest.raises(IndexError, match="dst_row 3 outside \\[0, 2\\)"):
        copy_rows(dst, 3, src, 0)  # fits the first pool, not the second: nothing copied
    assert not dst[0].any()
    with pytest.raises(IndexError, match="src_row -1"):
        copy_rows(dst, 0, src, -1)
    with pytest.raises(TypeError, match="dst_row expected an int, got Tensor"):
        copy_rows(dst, torch.tensor(0), src, 0)
    with pytest.raises(ValueError, match="2 destination pools for 1 source"):
        copy_rows(dst, 0, src[:1], 0)
