"""Public ops on the meta device (shape inference, e.g. building a model without memory): the
dispatcher runs each op's fake implementation, which reads no values. Issue 48: the chunked scan with
``seq_idx`` (whose values the eager path reads on the host) raised "Cannot copy out of meta tensor"."""
from __future__ import annotations

import pytest
import torch

from fastmamba.ops import mamba_chunk_scan_combined

B, L, H, P, N, G = 2, 16, 2, 16, 16, 1


def meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, device="meta", dtype=dtype)


@pytest.mark.parametrize("kw", [
    dict(),
    dict(initial_states=meta(B, H, P, N)),
    dict(seq_idx=meta(B, L, dtype=torch.int32)),
    dict(seq_idx=meta(B, L, dtype=torch.int32), initial_states=meta(B, H, P, N), return_final_states=True),
], ids=["plain", "initial_states", "seq_idx", "seq_idx-initial-final"])
def test_chunk_scan_on_meta_gives_shapes(kw):
    res = mamba_chunk_scan_combined(meta(B, L, H, P), meta(B, L, H), meta(H), meta(B, L, G, N), meta(B, L, G, N),
                                    chunk_size=8, **kw)
    out = res[0] if isinstance(res, (tuple, list)) else res
    assert out.device.type == "meta" and tuple(out.shape) == (B, L, H, P)
    if kw.get("return_final_states"):
        assert tuple(res[1].shape) == (B, H, P, N) and res[1].device.type == "meta"


def test_meta_shape_errors_still_name_the_argument():
    with pytest.raises(ValueError, match="seq_idx"):
        mamba_chunk_scan_combined(meta(B, L, H, P), meta(B, L, H), meta(H), meta(B, L, G, N), meta(B, L, G, N),
                                  chunk_size=8, seq_idx=meta(B, L + 1, dtype=torch.int32))
