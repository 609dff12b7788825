"""Thin tensor-parallel modules that stand in for a model's own ones after sharding (``shard.py``).

    VocabParallelEmbedding  rows [v0, v1) of the embedding; a token outside them looks up zeros,
                            then a sum all-reduce gives every rank the full [.., M] activations
    VocabParallelLMHead     rows [v0, v1) of lm_head: local logits [.., v1 - v0], then an
                            all-gather gives every rank the full [.., V] logits (so every rank
                            samples the same token from the same numbers)
    RowParallelLinear       an nn.Linear over this rank's input columns, whose output is summed
                            over the ranks (``reduce_output``); its bias is the real one on rank 0
                            and zeros elsewhere, so the sum adds it once, whichever path (nn.Linear
                            or fastmamba's ``gemv``) computed the local product
    TPGatedRMSNorm          the Mamba-2 gated RMSNorm when one norm group spans every rank's heads
                            (ngroups = 1 under TP): the sum of squares of the local channels is
                            all-reduced before the rms is taken, or (``defer_to``) travels with
                            the out_proj's all-reduce, which then applies the rms

Column-parallel projections need no module of their own: a rank's ``in_proj`` is an ordinary
nn.Linear whose rows are its slices of z | x | B | C | dt (the loader picks them, ``shard.py``).
Every collective is a torch.distributed call on fixed-size tensors, which NCCL lets a CUDA graph
capture.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastmamba.distributed.group import TPGroup


def split_sizes(n: int, world_size: int) -> list[int]:
    """``n`` rows cut into ``world_size`` contiguous pieces, the first ``n % world_size`` one longer."""
    base, extra = divmod(n, world_size)
    return [base + (r < extra) for r in range(world_size)]


def split_range(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s [start, stop) of ``split_sizes(n, world_size)``."""
    sizes = split_sizes(n, world_size)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


class VocabParallelEmbedding(nn.Module):
    """Embedding rows [v0, v1) of ``num_embeddings`` (``split_range``); forward(ids) -> [.., M] on every rank."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup, device=None, dtype=None):
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        self.vocab_start, self.vocab_end = split_range(num_embeddings, tp.world_size, tp.rank)
        self.weight = nn.Parameter(torch.empty(self.vocab_end - self.vocab_start, embedding_dim, device=device,
                                               dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = torch.where(mine, ids - self.vocab_start, torch.zeros_like(ids))
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)

    def extra_repr(self) -> str:
        return (f"rows [{self.vocab_start}, {self.vocab_end}) of {self.num_embeddings}, "
                f"rank {self.tp.rank}/{self.tp.world_size}")


class VocabParallelLMHead(nn.Module):
    """lm_head rows [v0, v1); forward(x [.., M]) -> full logits [.., V] on every rank (all-gather)."""

    def __init__(self, vocab_size: int, d_model: int, tp: TPGroup, device=None, dtype=None):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.sizes = split_sizes(vocab_size, tp.world_size)
        self.vocab_start, self.vocab_end = split_range(vocab_size, tp.world_size, tp.rank)
        self.weight = nn.Parameter(torch.empty(self.vocab_end - self.vocab_start, d_model, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(F.linear(x, self.weight), self.sizes)

    def extra_repr(self) -> str:
        return f"rows [{self.vocab_start}, {self.vocab_end}) of {self.vocab_size}, rank {self.tp.rank}/{self.tp.world_size}"


class RowParallelLinear(nn.Linear):
    """nn.Linear over this rank's ``in_features`` input columns, output summed over the ranks.

    ``reduce_output(partial)`` is the all-reduce alone: ``Mamba2Mixer._project`` calls it after
    fastmamba's ``gemv`` computed ``partial`` from ``weight`` and ``bias`` directly.

    Deferred norm (``TPGatedRMSNorm`` with ``defer_to=`` this layer): the norm hands over its
    un-normalised output and leaves its local sum of squares in ``pending_sumsq`` [rows, 1]; the
    rms is a per-row scalar, so out_proj(v * rstd) = rstd * out_proj(v), and one all-reduce of
    [partial | sumsq] (fp32) serves both the norm and the projection: one collective per layer
    instead of two."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, bias: bool = False, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.tp = tp
        self.pending_sumsq: torch.Tensor | None = None
        self.norm_size = 0
        self.norm_eps = 0.0

    def reduce_output(self, partial: torch.Tensor) -> torch.Tensor:
        sumsq, self.pending_sumsq = self.pending_sumsq, None
        if sumsq is None:
            return self.tp.all_reduce(partial)
        both = self.tp.all_reduce(torch.cat([partial.float(), sumsq.reshape(*partial.shape[:-1], 1)], dim=-1))
        rstd = torch.rsqrt(both[..., -1:] / self.norm_size + self.norm_eps)
        return (both[..., :-1] * rstd).to(partial.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce_output(F.linear(x, self.weight, self.bias))


class TPGatedRMSNorm(nn.Module):
    """Gated RMSNorm over ``full_size`` channels of which this rank holds ``local_size`` (one norm
    group across every rank). Same contract as ``RMSNormGated.forward(x, z=None)``; fp32 inside,
    output in x's dtype (as ``fastmamba.ops.gated_rmsnorm.ref.rmsnorm_ref``).

    ``defer_to``: a bias-free ``RowParallelLinear`` that always consumes this norm's output next
    (the mixer's out_proj); then forward returns the gated, weighted but not yet normalised
    channels and the out_proj's single all-reduce finishes the norm (see ``RowParallelLinear``).
    Only for norm_before_gate=False (Mamba-2's order: the gate comes before the rms)."""

    def __init__(self, local_size: int, full_size: int, tp: TPGroup, eps: float, norm_before_gate: bool,
                 device=None, dtype=None, *, defer_to: RowParallelLinear | None = None):
        super().__init__()
        if defer_to is not None and (norm_before_gate or defer_to.bias is not None):
            raise ValueError("TPGatedRMSNorm: `defer_to` needs norm_before_gate=False and an out_proj without bias "
                             f"(got norm_before_gate={norm_before_gate}, bias={defer_to.bias is not None})")
        self.tp = tp
        self.full_size = full_size
        self.eps = eps
        self.norm_before_gate = norm_before_gate
        self.weight = nn.Parameter(torch.ones(local_size, device=device, dtype=dtype))
        self.defer_to = [defer_to] if defer_to is not None else None  # a list: not registered as a submodule
        if defer_to is not None:
            defer_to.norm_size, defer_to.norm_eps = full_size, eps

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        v = x.float()
        if z is not None and not self.norm_before_gate:
            v = v * F.silu(z.float())
        sumsq = v.square().sum(-1, keepdim=True)
        if self.defer_to is not None:
            self.defer_to[0].pending_sumsq = sumsq
            return (v * self.weight.float()).to(x.dtype)
        sumsq = self.tp.all_reduce(sumsq)
        y = v * torch.rsqrt(sumsq / self.full_size + self.eps) * self.weight.float()
        if z is not None and self.norm_before_gate:
            y = y * F.silu(z.float())
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"{self.weight.shape[0]} of {self.full_size}, eps={self.eps}, norm_before_gate={self.norm_before_gate}"
                f"{', deferred to out_proj' if self.defer_to else ''}")
