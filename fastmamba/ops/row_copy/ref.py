"""Reference for ``copy_rows``: torch's copy, pool pair by pool pair (no Triton)."""
from __future__ import annotations

from collections.abc import Sequence

import torch


def copy_rows_ref(dst: Sequence[torch.Tensor], dst_row: int, src: Sequence[torch.Tensor], src_row: int) -> None:
    """``dst[k][:, dst_row] = src[k][:, src_row]`` for each pool pair k, with torch's copy (casting to
    ``dst[k]``'s dtype)."""
    for d, s in zip(dst, src):
        d[:, dst_row].copy_(s[:, src_row])
