"""Tensor parallelism of a Nemotron-H hybrid (``NemotronHLM``): Mamba-2, attention and MLP blocks.

Rank r of w holds (Hq query heads, Hkv KV heads of Dh channels, F MLP channels):
    Mamba-2 blocks   as ``shard.py`` for Mamba2LM (heads and groups split, out_proj row-parallel;
                     n_groups == 1 replicates B/C and the gated norm all-reduces)
    attention        q_proj rows of query heads [r*Hq/w, (r+1)*Hq/w); k_proj / v_proj rows of the
                     KV heads those queries read: [r*Hkv/w, (r+1)*Hkv/w) when w divides Hkv, else
                     (Hkv < w, w a multiple of Hkv) the one KV head of its queries, replicated on
                     w/Hkv ranks; o_proj row-parallel (its query heads' columns) + all-reduce. The
                     paged KV cache of a rank holds its own KV heads only.
    MLP              up_proj column-parallel (rows [r*F/w, (r+1)*F/w)), relu2 is per channel,
                     down_proj row-parallel + all-reduce (a bias on rank 0)
    MoE              every routed expert's channels [r*Fe/w, (r+1)*Fe/w) (``experts.up_proj`` [E, Fe, M']
                     rows along dim 1, ``experts.down_proj`` [E, M', Fe] columns along dim 2) and the
                     shared expert's [r*Fs/w, (r+1)*Fs/w), as the MLP; the router (and so the routing)
                     and the latent projections whole on every rank; the output biases (shared
                     down_proj, fc2_latent_proj) on rank 0, zeros elsewhere; one all-reduce per
                     layer (``MoE.reduce``; fastmamba.layers.moe says why the partial sums add up)
    embeddings, lm_head  vocab-parallel; norms replicated
    MTP layer        not sharded: a rank's model has none (its ``mtp.*`` tensors are skipped), so
                     ``--drafter mtp`` needs tp=1
``check_tp_nemotron_h`` refuses, before anything is read: Hq, F, the experts' widths or the Mamba heads
not divisible by w; Hkv neither a multiple nor a divisor of w; Mamba n_groups > 1 not divisible by w.
Loading (``loading.load_tp_model``): from a checkpoint directory each rank reads its own slices of
the safetensors files, as for Mamba2LM; presets are built whole on the rank's device with the same
seed and sliced (``shard_state_dict_into``).
"""
from __future__ import annotations

import dataclasses

import torch

from fastmamba.distributed.group import TPGroup
from fastmamba.distributed.layers import RowParallelLinear, TPGatedRMSNorm, VocabParallelEmbedding, VocabParallelLMHead
from fastmamba.distributed.shard import WHOLE, Slices, check_tp, mamba_mixer_plan, vocab_plan
from fastmamba.layers.buffers import reset_runtime_buffers


def check_tp_nemotron_h(cfg, world_size: int, *, who: str = "check_tp_nemotron_h") -> None:
    """Raise ValueError naming the sizes when ``cfg`` (a NemotronHConfig) cannot be split over ``world_size``."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{who}: world size expected an int >= 1, got {world_size!r}")
    w = world_size
    if "E" in cfg.pattern:
        for field in ("moe_intermediate_size", "moe_shared_expert_intermediate_size"):
            if getattr(cfg, field) % w:
                raise ValueError(f"{who}: cannot shard {field}={getattr(cfg, field)} expert channels over world "
                                 f"size {w}: it must be a multiple of the world size")
    if "*" in cfg.pattern:
        if cfg.n_heads % w:
            raise ValueError(f"{who}: cannot shard n_heads={cfg.n_heads} attention heads over world size {w}: "
                             "the query heads must be a multiple of the world size")
        if cfg.n_kv_heads % w and w % cfg.n_kv_heads:
            raise ValueError(f"{who}: cannot shard n_kv_heads={cfg.n_kv_heads} KV heads over world size {w}: KV "
                             "heads are split when a multiple of the world size and replicated when a divisor of it")
    if "-" in cfg.pattern and cfg.intermediate_size % w:
        raise ValueError(f"{who}: cannot shard intermediate_size={cfg.intermediate_size} MLP channels over world "
                         f"size {w}: it must be a multiple of the world size")
    if "M" in cfg.pattern:
        check_tp(cfg.mamba, w, who=who)


def local_nemotron_h_config(cfg, world_size: int):
    """The rank's NemotronHConfig: its query / KV heads, MLP channels, Mamba heads and groups."""
    w = world_size
    return dataclasses.replace(
        cfg, n_heads=cfg.n_heads // w if "*" in cfg.pattern else cfg.n_heads,
        n_kv_heads=(cfg.n_kv_heads // w if cfg.n_kv_heads % w == 0 else 1) if "*" in cfg.pattern else cfg.n_kv_heads,
        intermediate_size=cfg.intermediate_size // w if "-" in cfg.pattern else cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size // w if "E" in cfg.pattern else cfg.moe_intermediate_size,
        moe_shared_expert_intermediate_size=(cfg.moe_shared_expert_intermediate_size // w if "E" in cfg.pattern
                                             else cfg.moe_shared_expert_intermediate_size),
        mamba_nheads=cfg.mamba_nheads // w,
        n_groups=cfg.n_groups // w if cfg.n_groups % w == 0 else cfg.n_groups,
        mtp_pattern="",  # the MTP layer is not sharded (see the module docstring)
    )


def moe_plan(prefix: str, cfg, rank: int, world_size: int) -> dict[str, Slices | None]:
    """The plan of one MoE layer's tensors (names ``prefix`` + "gate.weight" ...) for the whole
    model's config ``cfg`` (``check_tp_nemotron_h`` passed)."""
    w, r, m = world_size, rank, prefix
    fe, fs = cfg.moe_intermediate_size // w, cfg.moe_shared_expert_intermediate_size // w
    last = WHOLE if r == 0 else Slices(zeros=True)  # an output bias: added once by the all-reduce
    plan: dict[str, Slices | None] = {
        m + "gate.weight": WHOLE, m + "gate.e_score_correction_bias": WHOLE,
        m + "experts.up_proj": Slices(1, ((r * fe, (r + 1) * fe),)),
        m + "experts.down_proj": Slices(2, ((r * fe, (r + 1) * fe),)),
        m + "shared_experts.up_proj.weight": Slices(0, ((r * fs, (r + 1) * fs),)),
        m + "shared_experts.down_proj.weight": Slices(1, ((r * fs, (r + 1) * fs),)),
    }
    if cfg.mlp_bias:
        plan[m + "shared_experts.up_proj.bias"] = Slices(0, ((r * fs, (r + 1) * fs),))
        plan[m + "shared_experts.down_proj.bias"] = last
    if cfg.moe_latent_size is not None:
        plan[m + "fc1_latent_proj.weight"] = plan[m + "fc2_latent_proj.weight"] = WHOLE
        if cfg.mlp_bias:
            plan[m + "fc1_latent_proj.bias"], plan[m + "fc2_latent_proj.bias"] = WHOLE, last
    return plan


def nemotron_h_shard_plan(cfg, rank: int, world_size: int) -> dict[str, Slices | None]:
    """{name: Slices or WHOLE} of rank ``rank`` for every tensor of ``NemotronHLM(cfg)``."""
    check_tp_nemotron_h(cfg, world_size, who="nemotron_h_shard_plan")
    w, r = world_size, rank
    vocab = vocab_plan(cfg.vocab_size, r, w)
    plan: dict[str, Slices | None] = {"backbone.embeddings.weight": vocab, "backbone.norm_f.weight": WHOLE,
                                      "lm_head.weight": vocab}
    Dh = cfg.head_dim
    for i, kind in enumerate(cfg.pattern):
        p = f"backbone.layers.{i}."
        plan[p + "norm.weight"] = WHOLE
        m = p + "mixer."
        if kind == "M":
            plan.update(mamba_mixer_plan(m, cfg.mamba, r, w))
        elif kind == "*":
            hq = cfg.n_heads // w
            q0 = r * hq
            if cfg.n_kv_heads % w == 0:
                k0, nk = r * (cfg.n_kv_heads // w), cfg.n_kv_heads // w
            else:  # replicated: the KV head of this rank's query heads
                k0, nk = q0 // (cfg.n_heads // cfg.n_kv_heads), 1
            plan[m + "q_proj.weight"] = Slices(0, ((q0 * Dh, (q0 + hq) * Dh),))
            plan[m + "k_proj.weight"] = Slices(0, ((k0 * Dh, (k0 + nk) * Dh),))
            plan[m + "v_proj.weight"] = Slices(0, ((k0 * Dh, (k0 + nk) * Dh),))
            plan[m + "o_proj.weight"] = Slices(1, ((q0 * Dh, (q0 + hq) * Dh),))
        elif kind == "E":
            plan.update(moe_plan(m, cfg, r, w))
        else:
            f = cfg.intermediate_size // w
            rows = Slices(0, ((r * f, (r + 1) * f),))
            plan[m + "up_proj.weight"] = rows
            plan[m + "down_proj.weight"] = Slices(1, ((r * f, (r + 1) * f),))
            if cfg.mlp_bias:
                plan[m + "up_proj.bias"] = rows
                plan[m + "down_proj.bias"] = WHOLE if r == 0 else Slices(zeros=True)
    return plan


def build_tp_nemotron_h(cfg, tp: TPGroup, *, dtype: torch.dtype, fuse_norm_reduce: bool = True):
    """Rank ``tp.rank``'s ``NemotronHLM`` (uninitialised weights on ``tp.device``); fill it with
    ``shard_state_dict_into``. ``model.cfg`` is the local config, ``model.tp_full_cfg`` the whole one."""
    from fastmamba.models.nemotron_h import NemotronHLM

    check_tp_nemotron_h(cfg, tp.world_size, who="build_tp_nemotron_h")
    local = local_nemotron_h_config(cfg, tp.world_size)
    meta = torch.device("meta")
    model = NemotronHLM(local, device=meta, dtype=dtype)
    model.backbone.embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, tp, device=meta, dtype=dtype)
    model.lm_head = VocabParallelLMHead(cfg.vocab_size, cfg.d_model, tp, device=meta, dtype=dtype)
    replicated_groups = tp.world_size > 1 and cfg.n_groups % tp.world_size != 0
    for block in model.backbone.layers:
        mixer = block.mixer
        if block.kind == "M":
            lm = local.mamba
            mixer.out_proj = RowParallelLinear(lm.d_inner, cfg.d_model, tp, bias=lm.proj_bias, device=meta, dtype=dtype)
            if replicated_groups:
                fuse = fuse_norm_reduce and not lm.proj_bias
                mixer.norm = TPGatedRMSNorm(lm.d_inner, cfg.mamba.d_inner, tp, lm.norm_eps, False, device=meta,
                                            dtype=dtype, defer_to=mixer.out_proj if fuse else None)
        elif block.kind == "*":
            mixer.o_proj = RowParallelLinear(local.n_heads * local.head_dim, cfg.d_model, tp, device=meta,
                                             dtype=dtype)
        elif block.kind == "E":
            mixer.reduce = tp.all_reduce  # the ranks' partial sums of the experts' outputs
        else:
            mixer.down_proj = RowParallelLinear(local.intermediate_size, cfg.d_model, tp, bias=cfg.mlp_bias,
                                                device=meta, dtype=dtype)
    model.to_empty(device=tp.device)
    reset_runtime_buffers(model)  # the buffers no checkpoint fills (K/V scales, MoE counters)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.backbone.embeddings.weight
    model.tp = tp
    model.tp_full_cfg = cfg
    model.tp_plan = nemotron_h_shard_plan(cfg, tp.rank, tp.world_size)
    model.tp_skipped_prefixes = ("mtp.",) if cfg.mtp_pattern else ()  # in a checkpoint, not in a rank's model
    model.tp_full_shapes = {k: tuple(v.shape) for k, v in NemotronHLM(cfg, device=meta).state_dict().items()
                            if not k.startswith(model.tp_skipped_prefixes)}
    model.tp_moe_layers = (cfg.layers_of("E"), cfg.n_routed_experts)  # per-expert checkpoint tensors: stacked
    return model
