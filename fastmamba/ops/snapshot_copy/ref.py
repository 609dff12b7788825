"""Reference for ``copy_snapshots``: the two assignments as torch indexing (no Triton)."""
from __future__ import annotations

import torch


def copy_snapshots_ref(conv: torch.Tensor, ssm: torch.Tensor, rows: torch.Tensor, xbc: torch.Tensor,
                       conv_tokens: torch.Tensor, chunk_states: torch.Tensor, chunk_rows: torch.Tensor) -> None:
    """For every snapshot i (see ``fastmamba.ops.snapshot_copy.api``):

        conv[rows[i]][:, j] = xbc[conv_tokens[i, j]]     for j < W
        ssm[rows[i]]        = chunk_states[chunk_rows[i]]

    cast to the pools' dtypes."""
    conv[rows] = xbc[conv_tokens].transpose(1, 2).to(conv.dtype)
    ssm[rows] = chunk_states[chunk_rows].to(ssm.dtype)
