"""Sharding a Mamba-2 LM over the ranks of a tensor-parallel group, and loading each rank's slices.

Which rank holds what (H heads of P channels, G groups of N state, D = H*P, V vocab rows, w ranks,
rank r holds heads [r*H/w, (r+1)*H/w)):

    in_proj   [D + E + H, M]  column-parallel, each part split on its own boundaries:
                              z rows of its heads | x rows of its heads | B rows of its groups |
                              C rows of its groups | dt rows of its heads
    conv1d    [E, 1, W]       the x | B | C channels it keeps (conv states in the cache follow)
    dt_bias, A_log, D  [H]    its heads            norm.weight [D]  its heads' channels
    out_proj  [M, D]          row-parallel: its heads' input columns, then a sum all-reduce; a
                              bias (proj_bias) is held by rank 0, zeros elsewhere
    embeddings, lm_head [V, M]  vocab-parallel: rows ``split_range(V, w, r)`` (V need not divide)
    layer norms, norm_f       replicated

Groups: G % w == 0 splits the groups with the heads (each rank holds G/w whole groups, so the gated
RMSNorm, whose groups are the B/C groups, stays local). G == 1 with w > 1 replicates B and C on
every rank (vLLM does the same) and the norm, whose one group spans all heads, needs the sum of
squares over every rank (``TPGatedRMSNorm``): by default it rides in the out_proj's all-reduce
(the rms is a per-row scalar that commutes with out_proj), so a layer still costs one collective. Every other combination, and H not divisible by w, is refused by
``check_tp`` before anything is read.

Each rank's model is a ``Mamba2LM`` built from a ``ShardedMamba2Config``: the full config with the
rank's own sizes (``d_inner``, ``nheads``, ``ngroups``, ``conv_dim``, ``d_in_proj`` are local), so
the mixer, the state cache (conv [S, E_local, W], SSM [S, H/w, P, N]) and the engine's per-shape
tables run unchanged on the local shape; ``cfg.full`` is the whole model's config.

Loading (``loading.load_tp_model``, for Mamba-2 and Nemotron-H alike: config.json's ``model_type`` picks
the family): from a safetensors checkpoint every rank opens the files and reads its slices only
(``safe_open(...).get_slice``); ``model.load_stats.bytes_read`` counts the bytes of the slices it
read, about 1/w of the sharded tensors plus the replicated ones. A preset (random weights) is built
whole on the rank's device with the same seed everywhere and sliced in memory.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

from fastmamba.distributed.group import TPGroup
from fastmamba.distributed.layers import (RowParallelLinear, TPGatedRMSNorm, VocabParallelEmbedding,
                                          VocabParallelLMHead, split_range)
from fastmamba.layers.buffers import reset_runtime_buffers
from fastmamba.models.config import Mamba2Config
from fastmamba.models.mamba2_lm import Mamba2LM


# ---------------------------------------------------------------------------------------------
# which combinations work


def check_tp(cfg: Mamba2Config, world_size: int, *, who: str = "check_tp") -> None:
    """Raise ValueError, naming the sizes, when ``cfg`` cannot be sharded over ``world_size`` ranks.

    Supported: nheads % world_size == 0, and either ngroups % world_size == 0 (groups split with
    the heads) or ngroups == 1 (B/C replicated). Refused: heads not divisible by the world size;
    ngroups > 1 that the world size does not divide (a group's B/C would straddle ranks)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{who}: world size expected an int >= 1, got {world_size!r}")
    H, G = cfg.nheads, cfg.ngroups
    if H % world_size:
        raise ValueError(f"{who}: cannot shard {H} heads (nheads={H}) over world size {world_size}: the number of "
                         f"heads must be a multiple of the world size (tensor parallelism splits whole heads)")
    if G % world_size and G != 1:
        raise ValueError(f"{who}: cannot shard ngroups={G} B/C groups over world size {world_size}: groups are split "
                         f"when ngroups is a multiple of the world size and replicated when ngroups == 1; "
                         f"ngroups={G} with world size {world_size} is neither (nheads={H})")


@dataclasses.dataclass(frozen=True)
class ShardedMamba2Config(Mamba2Config):
    """One rank's sizes: the full config's fields with ``ngroups`` the groups this rank holds (all
    of them, replicated, when the full model has one) and ``d_inner`` = its heads' channels, so
    ``nheads``, ``conv_dim`` and ``d_in_proj`` are local too. ``full`` is the whole model's config."""

    tp_rank: int = 0
    tp_size: int = 1
    local_d_inner: int = 0
    full_ngroups: int = 1

    @property
    def d_inner(self) -> int:  # this rank's channels (the full model's: ``full.d_inner``)
        return self.local_d_inner

    @property
    def full(self) -> Mamba2Config:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(Mamba2Config)}
        return Mamba2Config(**{**fields, "ngroups": self.full_ngroups})

    @property
    def groups_replicated(self) -> bool:  # B/C (and the norm's one group) on every rank
        return self.tp_size > 1 and self.full_ngroups % self.tp_size != 0


def local_config(cfg: Mamba2Config, rank: int, world_size: int) -> ShardedMamba2Config:
    """Rank ``rank``'s ``ShardedMamba2Config`` of ``cfg`` (``check_tp`` first)."""
    if isinstance(cfg, ShardedMamba2Config):
        raise TypeError("local_config: `cfg` is already one rank's config; pass the full model's (cfg.full)")
    check_tp(cfg, world_size, who="local_config")
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(Mamba2Config)}
    G = cfg.ngroups
    local_groups = G // world_size if G % world_size == 0 else G
    return ShardedMamba2Config(**{**fields, "ngroups": local_groups}, tp_rank=rank, tp_size=world_size,
                               local_d_inner=cfg.d_inner // world_size, full_ngroups=G)


# ---------------------------------------------------------------------------------------------
# the plan: which rows / columns of each checkpoint tensor a rank holds


@dataclasses.dataclass(frozen=True)
class Slices:
    """A rank's part of one tensor: the concatenation along ``dim`` of ``ranges`` [start, stop);
    ``zeros``: the rank holds zeros of the full shape instead (a row-parallel bias off rank 0)."""

    dim: int = 0
    ranges: tuple[tuple[int, int], ...] = ()
    zeros: bool = False


WHOLE = None  # plan value of a replicated tensor


def mamba_mixer_plan(prefix: str, cfg: Mamba2Config, rank: int, world_size: int) -> dict[str, Slices | None]:
    """The plan of one ``Mamba2Mixer``'s tensors (names ``prefix`` + "in_proj.weight" ...) for a
    whole-model mixer config ``cfg`` (``check_tp`` passed)."""
    H, N, G = cfg.nheads, cfg.d_state, cfg.ngroups
    D = cfg.d_inner
    Hl, Dl = H // world_size, D // world_size
    h0, d0 = rank * Hl, rank * Dl
    if G % world_size == 0:
        g0, Gl = rank * (G // world_size), G // world_size
    else:  # G == 1: replicated
        g0, Gl = 0, G
    b0, b1 = g0 * N, (g0 + Gl) * N
    GN = G * N
    in_rows = ((d0, d0 + Dl), (D + d0, D + d0 + Dl), (2 * D + b0, 2 * D + b1), (2 * D + GN + b0, 2 * D + GN + b1),
               (2 * D + 2 * GN + h0, 2 * D + 2 * GN + h0 + Hl))
    conv_rows = ((d0, d0 + Dl), (D + b0, D + b1), (D + GN + b0, D + GN + b1))
    heads = Slices(0, ((h0, h0 + Hl),))
    m = prefix
    plan: dict[str, Slices | None] = {m + "in_proj.weight": Slices(0, in_rows)}
    if cfg.proj_bias:
        plan[m + "in_proj.bias"] = Slices(0, in_rows)
        plan[m + "out_proj.bias"] = WHOLE if rank == 0 else Slices(zeros=True)
    plan[m + "conv1d.weight"] = Slices(0, conv_rows)
    if cfg.conv_bias:
        plan[m + "conv1d.bias"] = Slices(0, conv_rows)
    for name in ("dt_bias", "A_log", "D"):
        plan[m + name] = heads
    plan[m + "norm.weight"] = Slices(0, ((d0, d0 + Dl),))
    plan[m + "out_proj.weight"] = Slices(1, ((d0, d0 + Dl),))
    return plan


def vocab_plan(vocab_size: int, rank: int, world_size: int) -> Slices:
    return Slices(0, (split_range(vocab_size, world_size, rank),))


def shard_plan(cfg: Mamba2Config, rank: int, world_size: int) -> dict[str, Slices | None]:
    """{checkpoint name: Slices, or None (WHOLE) for a replicated tensor} for rank ``rank``; names as
    ``Mamba2LM.state_dict()`` (Hugging Face's), lm_head.weight included even when tied."""
    check_tp(cfg, world_size, who="shard_plan")
    vocab = vocab_plan(cfg.vocab_size, rank, world_size)
    plan: dict[str, Slices | None] = {"backbone.embeddings.weight": vocab, "backbone.norm_f.weight": WHOLE,
                                      "lm_head.weight": vocab}
    for i in range(cfg.n_layer):
        p = f"backbone.layers.{i}."
        plan[p + "norm.weight"] = WHOLE
        plan.update(mamba_mixer_plan(p + "mixer.", cfg, rank, world_size))
    return plan


def full_shapes(cfg: Mamba2Config) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the whole model's tensors (built on the meta device: no memory)."""
    return {k: tuple(v.shape) for k, v in Mamba2LM(cfg, device="meta").state_dict().items()}


def slice_tensor(t: torch.Tensor, s: Slices | None) -> torch.Tensor:
    """A rank's part of a whole tensor ``t`` (a view for one range, else a new tensor)."""
    if s is None:
        return t
    if s.zeros:
        return torch.zeros_like(t)
    parts = [t.narrow(s.dim, a, b - a) for a, b in s.ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=s.dim)


# ---------------------------------------------------------------------------------------------
# the per-rank model


def build_tp_mamba2(cfg: Mamba2Config, tp: TPGroup, *, dtype: torch.dtype, fuse_norm_reduce: bool = True) -> Mamba2LM:
    """Rank ``tp.rank``'s ``Mamba2LM`` (uninitialised weights on ``tp.device``): local mixers, a
    row-parallel out_proj, a distributed norm where groups are replicated, vocab-parallel
    embeddings and lm_head (tied when ``cfg.tie_embeddings``). ``model.tp`` is the group.

    fuse_norm_reduce  where the norm is distributed (ngroups = 1), its sum of squares travels in
                      the out_proj's all-reduce (one collective per layer, not two; see
                      ``RowParallelLinear``); off, or with an out_proj bias or norm_before_gate:
                      a separate all-reduce in the norm"""
    local = local_config(cfg, tp.rank, tp.world_size)
    meta = torch.device("meta")
    model = Mamba2LM(local, device=meta, dtype=dtype)
    model.backbone.embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, tp, device=meta, dtype=dtype)
    model.lm_head = VocabParallelLMHead(cfg.vocab_size, cfg.d_model, tp, device=meta, dtype=dtype)
    for layer in model.backbone.layers:
        mixer = layer.mixer
        mixer.out_proj = RowParallelLinear(local.d_inner, cfg.d_model, tp, bias=cfg.proj_bias, device=meta,
                                           dtype=dtype)
        if local.groups_replicated:
            fuse = fuse_norm_reduce and not cfg.proj_bias and not cfg.norm_before_gate
            mixer.norm = TPGatedRMSNorm(local.d_inner, cfg.d_inner, tp, cfg.norm_eps, cfg.norm_before_gate,
                                        device=meta, dtype=dtype, defer_to=mixer.out_proj if fuse else None)
    model.to_empty(device=tp.device)
    reset_runtime_buffers(model)  # the buffers no checkpoint fills (K/V scales, MoE counters)
    if cfg.tie_embeddings:  # to_empty gives each module its own new tensor
        model.lm_head.weight = model.backbone.embeddings.weight
    model.tp = tp
    model.tp_plan = shard_plan(cfg, tp.rank, tp.world_size)
    model.tp_full_shapes = full_shapes(cfg)
    return model


@dataclasses.dataclass
class LoadStats:
    """What one rank read: ``bytes_read`` (the slices' bytes, as stored in the checkpoint),
    ``tensors_read``, and ``checkpoint_bytes`` (every tensor of the checkpoint, for comparison)."""

    bytes_read: int = 0
    tensors_read: int = 0
    checkpoint_bytes: int = 0


def _fill(model: nn.Module, shapes: Mapping[str, tuple[int, ...]], plan: Mapping[str, Slices | None],
          available: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
          read: Callable[[str, Slices | None], torch.Tensor], where: str) -> None:
    """Copy every target of ``model`` from ``read(name, slices)``; every name, shape and tie is
    checked against ``available`` ({name: (full shape, dtype)}) and ``shapes`` (the whole model's)
    before anything is read."""
    targets = model.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}
    for name, t in targets.items():
        groups.setdefault(id(t), []).append(name)
    problems, jobs = [], []
    for names in groups.values():
        present = [n for n in names if n in available]
        if not present:
            problems.append(f"missing from the checkpoint: {' = '.join(names)}")
            continue
        name = present[0]
        if tuple(available[name][0]) != shapes[name]:
            problems.append(f"{name}: expected {shapes[name]}, got {tuple(available[name][0])}")
            continue
        jobs.append((targets[name], name))
    skipped = getattr(model, "tp_skipped_prefixes", ())  # whole-model tensors no rank holds (an MTP layer)
    unexpected = [n for n in available if n not in shapes and not (skipped and n.startswith(skipped))]
    problems += [f"unexpected in the checkpoint: {n}" for n in unexpected[:20]]
    if problems:
        raise ValueError(f"{where}: checkpoint does not fit the model ({len(problems)} problem(s); nothing was "
                         "read):\n  " + "\n  ".join(problems[:40]))
    with torch.no_grad():
        for target, name in jobs:
            src = read(name, plan[name])
            if tuple(src.shape) != tuple(target.shape):  # a bug of the plan, not of the checkpoint
                raise RuntimeError(f"{where}: {name}: slice {tuple(src.shape)} != local {tuple(target.shape)}")
            target.data.copy_(src)


def shard_state_dict_into(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> LoadStats:
    """Fill a ``build_tp_mamba2`` (or ``build_tp_nemotron_h``) model from the whole model's
    ``state_dict`` (in memory; names as ``normalize_names`` gives them), slicing each tensor by the
    model's plan (``model.tp_plan``)."""
    plan = model.tp_plan
    stats = LoadStats(checkpoint_bytes=sum(t.nbytes for t in state_dict.values()))

    def read(name, s):
        part = slice_tensor(state_dict[name], s)
        if s is None or not s.zeros:
            stats.bytes_read += part.numel() * part.element_size()
            stats.tensors_read += 1
        return part

    _fill(model, model.tp_full_shapes, plan, {k: (tuple(v.shape), v.dtype) for k, v in state_dict.items()}, read,
          "shard_state_dict_into")
    model.load_stats = stats
    return stats


_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                       "I64": torch.int64, "I32": torch.int32}


def _safetensors_files(root: Path) -> list[Path]:
    from fastmamba.models.weights import SAFETENSORS_FILE, SAFETENSORS_INDEX, _read_index

    if (root / SAFETENSORS_FILE).is_file():
        return [root / SAFETENSORS_FILE]
    if (root / SAFETENSORS_INDEX).is_file():
        return _read_index(root / SAFETENSORS_INDEX)[0]
    raise FileNotFoundError(f"load_tp_model: tensor parallelism reads slices of safetensors files; {str(root)!r} "
                            f"holds neither {SAFETENSORS_FILE} nor {SAFETENSORS_INDEX} (convert a .bin checkpoint "
                            "to safetensors first)")


def _per_expert_members(model: nn.Module, available: dict[str, tuple[tuple[int, ...], torch.dtype]]
                        ) -> dict[str, list[str]]:
    """MoE experts stored one by one (``experts.{e}.up_proj.weight``, NVIDIA's and transformers 5.25's
    form) as the fused tensors the model holds: ``available`` gets each fused name with its stacked
    shape in place of its per-expert names; returns {fused name: the per-expert names, in expert
    order}. The checks (an expert missing or extra, shapes that differ, both forms) are
    ``weights.stack_experts``'s, run on meta tensors (nothing is read)."""
    layers, n_experts = getattr(model, "tp_moe_layers", ((), 0))
    if not layers:
        return {}
    from fastmamba.models.weights import stack_experts

    meta = {n: torch.empty(shape, dtype=dtype, device="meta") for n, (shape, dtype) in available.items()}
    members: dict[str, list[str]] = {}
    stack_experts(meta, layers, n_experts, members=members)
    for name, names in members.items():
        available[name] = (tuple(meta[name].shape), meta[name].dtype)
        for n in names:
            del available[n]
    return members


def load_safetensors_slices(model: nn.Module, root: str | os.PathLike) -> LoadStats:
    """Fill a ``build_tp_mamba2`` (or ``build_tp_nemotron_h``) model from the safetensors checkpoint in ``root``, reading only this
    rank's slices (``get_slice``); the headers are read first and checked (names, shapes, ties)."""
    from safetensors import safe_open

    from fastmamba.models.weights import _STATE_SPACES_RENAMES

    plan = model.tp_plan
    stats = LoadStats()
    handles, where_is, available = {}, {}, {}
    try:
        for path in _safetensors_files(Path(root)):
            f = safe_open(str(path), framework="pt", device="cpu")
            handles[path] = f
            for key in f.keys():
                name = _STATE_SPACES_RENAMES.get(key, key)
                if name in where_is:
                    raise ValueError(f"load_tp_model: tensor {name!r} appears twice (again in {str(path)!r})")
                sl = f.get_slice(key)
                shape = tuple(sl.get_shape())
                dtype = _SAFETENSORS_DTYPES.get(sl.get_dtype(), torch.float32)
                where_is[name] = (path, key)
                available[name] = (shape, dtype)
                n = 1
                for s in shape:
                    n *= s
                stats.checkpoint_bytes += n * torch.empty((), dtype=dtype).element_size()

        stacked = _per_expert_members(model, available)

        def read_one(name, dim, ranges):
            path, key = where_is[name]
            sl = handles[path].get_slice(key)
            if ranges is None:
                return sl[:]
            pieces = [sl[(slice(None),) * dim + (slice(a, b),)] for a, b in ranges]
            return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)

        def read(name, s):
            if s is not None and s.zeros:
                return torch.zeros(available[name][0])
            ranges = None if s is None else s.ranges
            if name in stacked:  # one expert's tensor at a time: dim d of the fused form is dim d-1 of each
                if s is not None and s.dim == 0:
                    raise RuntimeError(f"load_tp_model: {name}: a plan that splits the experts themselves")
                part = torch.stack([read_one(n, 0 if s is None else s.dim - 1, ranges) for n in stacked[name]])
            else:
                part = read_one(name, 0 if s is None else s.dim, ranges)
            stats.bytes_read += part.numel() * part.element_size()
            stats.tensors_read += 1
            return part

        _fill(model, model.tp_full_shapes, plan, available, read, "load_tp_model")
    finally:
        handles.clear()
    model.load_stats = stats
    return stats
