"""How the engine runs under tensor parallelism: SPMD, every rank runs the same ``Engine``.

Every rank builds an ``Engine`` over its shard of the model, is given the same requests in the same
order and steps it in lockstep; no rank schedules for the others. This works because everything
the scheduler decides from is identical on every rank:
  * the requests and their sampling parameters (each rank is fed the same list; seeded sampling
    uses the same seeds);
  * the logits: ``VocabParallelLMHead`` all-gathers them, so every rank holds the same full [B, V]
    fp32 tensor (a collective delivers the same bytes to every rank), samples the same token and
    finishes the same requests at the same step;
  * the shapes: every rank's cache, CUDA-graph buckets and verify-path table are built from the
    same local sizes.
Why not rank 0 scheduling and broadcasting each step's token ids and metadata: the broadcast is one
more collective, plus a host-to-device copy and a synchronisation, on every step, and at batch 1 a
decode step is ~1-3 ms of which tensor parallelism exists to save a part; SPMD costs nothing per
step. Its risk is divergence (a rank taking a decision from something local, e.g. a clock): the
engine decides nothing from time or memory, and ``check_ranks_agree`` compares the generated ids
of every rank at the end of a run (one small all-gather) so a divergence cannot pass silently.
The HTTP server (``fastmamba serve --tensor-parallel-size N``) keeps SPMD: requests arrive on rank 0
only, so rank 0 sends the other ranks each step's added and aborted requests before the step, over
a plain local connection, not a collective (``serve_workers.py``). Unseeded sampling draws from a
generator that every rank seeds alike (``seed_sampler``; each Engine seeds its own from the OS).
"""
from __future__ import annotations

import hashlib
import secrets

import torch

from fastmamba.distributed.group import TPGroup


def check_ranks_agree(tp: TPGroup, outputs: list[list[int]], *, who: str = "tensor parallelism") -> None:
    """Raise RuntimeError when the ranks' generated ids differ (compared by a digest, one all-gather)."""
    if tp.world_size == 1:
        return
    digest = hashlib.sha256(repr([list(map(int, o)) for o in outputs]).encode()).digest()[:8]
    mine = torch.tensor(list(digest), dtype=torch.int64, device=tp.device)
    every = tp.all_gather_last(mine.unsqueeze(0), [8] * tp.world_size).view(tp.world_size, 8)
    differ = [r for r in range(tp.world_size) if not torch.equal(every[r], every[0])]
    if differ:
        raise RuntimeError(f"{who}: ranks {differ} generated other tokens than rank 0 (SPMD ranks diverged)")


def seed_sampler(engine, seed: int) -> None:
    """Re-seed ``engine``'s shared sampling generator (the one rows without their own ``seed``
    draw from) with ``seed``. Each Engine seeds it from the OS, so without this the ranks draw
    different tokens from the same logits at temperature > 0 and diverge."""
    from fastmamba.generation.sampling import Sampler

    s = engine.sampler
    engine.sampler = Sampler(s.vocab_size, s.device, s.max_batch, seed=seed)


def share_sampling_seed(tp: TPGroup, engine) -> int:
    """``seed_sampler`` with rank 0's random seed on every rank (one broadcast); returns the seed."""
    seed = tp.broadcast_object(secrets.randbits(63) if tp.is_first else None)
    seed_sampler(engine, seed)
    return seed
