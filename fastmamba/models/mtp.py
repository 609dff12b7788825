"""Nemotron-3's multi-token-prediction (MTP) layer: the drafter that Super, Ultra and Nano 3.5
Lightning carry inside their checkpoints (``num_nextn_predict_layers: 1``).

Letters: R rows (one token each), M d_model, V vocabulary. One MTP step, for a token x_{t+1} and
the hidden state h_t that predicted it (the target's final-normed hidden, the ``lm_head`` input,
or the MTP's own output of the step before):

    x   = eh_proj(concat(enorm(embed(x_{t+1})), hnorm(h_t)))          [R, M]  (embed and lm_head: the target's)
    for each block of ``mtp_pattern`` ("*E" in the released checkpoints: attention, then MoE):
        normed, residual = rmsnorm(out + residual);  out = block(normed)   (the model's blocks)
    h'  = final_layernorm(out + residual)                              [R, M]  fed to the next step as h
    logits = lm_head(h')                                               [R, V]  draft = argmax

The one layer is reused for every draft of a step, each feeding its output h' forward; its
attention keeps its own K/V (``MTPDrafter`` holds them in a page pool of its own).

Tensor names (NVIDIA's released checkpoints and the names vLLM's ``nemotron_h_mtp.py`` loads;
a ``language_model.`` prefix, as multimodal checkpoints have it, is dropped):

    mtp.layers.0.enorm.weight [M], mtp.layers.0.hnorm.weight [M], mtp.layers.0.eh_proj.weight [M, 2M]
    mtp.layers.{i}.norm.weight [M] and mtp.layers.{i}.mixer.*   as backbone.layers.{i} of the same kind
    mtp.layers.{last}.final_layernorm.weight [M]
    MoE experts per expert (``experts.{e}.up_proj.weight``) or fused (``experts.up_proj``), as the backbone's.

config.json: ``num_nextn_predict_layers`` (0 or absent: no MTP; 1: one layer; more is refused)
and the layer kinds of the MTP layer, ``mtp_hybrid_override_pattern`` (a string, "*E") or
``mtp_layers_block_type`` (a list, ["attention", "moe"]); both present must agree.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from fastmamba.layers.attention import KVBatch
from fastmamba.models.blocks import Batch, RMSNorm, SpecBatch, build_blocks
from fastmamba.models.checkpoint_config import agreed_pattern
from fastmamba.ops import add_rmsnorm

MTP_KINDS = "*-E"  # an MTP layer has no Mamba block (it keeps no recurrent state)
_TYPE_TO_CHAR = {"attention": "*", "full_attention": "*", "mlp": "-", "moe": "E"}


def mtp_pattern_of(cfg: dict[str, Any]) -> str:
    """The MTP layer's pattern from a config.json dict ("" when the checkpoint has none)."""
    n = cfg.get("num_nextn_predict_layers")
    if n is None or n == 0:
        return ""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"NemotronHConfig: `num_nextn_predict_layers` expected an integer >= 0, got {n!r}")
    if n > 1:
        raise ValueError(f"NemotronHConfig: `num_nextn_predict_layers`={n}: only one MTP layer is supported "
                         "(every released Nemotron-3 checkpoint has one)")
    pattern = agreed_pattern(cfg, "mtp_hybrid_override_pattern", ("mtp_layers_block_type",), _TYPE_TO_CHAR)
    if pattern is None:
        raise ValueError("NemotronHConfig: `num_nextn_predict_layers`=1 but config.json names no MTP layer kinds "
                         "(`mtp_hybrid_override_pattern`, e.g. \"*E\", or `mtp_layers_block_type`)")
    check_mtp_pattern(pattern)
    return pattern


def check_mtp_pattern(pattern: str) -> None:
    """ValueError unless ``pattern`` is empty or made of MTP_KINDS (an MTP layer keeps no SSM state)."""
    if not isinstance(pattern, str):
        raise ValueError(f"NemotronHConfig: `mtp_hybrid_override_pattern` expected a string, got {pattern!r}")
    bad = sorted({c for c in pattern if c not in MTP_KINDS})
    if bad:
        raise ValueError(f"NemotronHConfig: `mtp_hybrid_override_pattern` expected characters from '*' (attention), "
                         f"'-' (MLP), 'E' (MoE), got {bad} in {pattern!r}")


def prepare_mtp_state_dict(state_dict: dict[str, torch.Tensor], cfg):
    """Returns the config to build the model from, after, in ``state_dict``: ``language_model.mtp.*``
    renamed ``mtp.*`` and the MTP MoE layers' per-expert tensors stacked into the fused form
    (``fastmamba.models.weights.stack_experts``).

    A config that names an MTP layer for a checkpoint without any ``mtp.*`` tensor (transformers'
    ``save_pretrained`` drops them) gives a model without one: the config comes back with
    ``mtp_pattern=""`` and ``mtp_absent=True``, and ``drafter="mtp"`` says so. Some but not all
    of them: ``load_into`` names the missing ones. A config without an MTP layer keeps the
    checkpoint's ``mtp.*`` tensors, which ``load_into`` then names as unexpected."""
    for name in [n for n in state_dict if n.startswith("language_model.mtp.")]:
        state_dict[name.removeprefix("language_model.")] = state_dict.pop(name)
    pattern = getattr(cfg, "mtp_pattern", "")
    if pattern and not any(n.startswith("mtp.") for n in state_dict):
        return dataclasses.replace(cfg, mtp_pattern="", mtp_absent=True)
    if pattern:
        from fastmamba.models.weights import stack_experts

        stack_experts(state_dict, [i for i, c in enumerate(pattern) if c == "E"], cfg.n_routed_experts,
                      prefix="mtp.layers.{i}.mixer.experts.")
    return cfg


def build_mtp(cfg, device=None, dtype=None) -> "MTP | None":
    """The model's MTP module, or None when ``cfg.mtp_pattern`` is empty (the hook ``NemotronHLM`` calls)."""
    pattern = getattr(cfg, "mtp_pattern", "")
    return MTP(cfg, device=device, dtype=dtype) if pattern else None


class MTP(nn.Module):
    """The MTP layer's weights (``mtp.layers.{i}``) and its step, ``forward_rows``.

    Its blocks are the model's own kinds (``fastmamba.models.blocks``) built over ``cfg.mtp_pattern``;
    the first also holds ``enorm``, ``hnorm`` and ``eh_proj``, the last ``final_layernorm``. The
    embeddings and ``lm_head`` are the target's (passed to ``forward_rows`` / applied by the caller).
    """

    def __init__(self, cfg, device=None, dtype=None):
        super().__init__()
        check_mtp_pattern(cfg.mtp_pattern)
        inner = dataclasses.replace(cfg, pattern=cfg.mtp_pattern, mtp_pattern="")
        self.pattern = cfg.mtp_pattern
        self.eps = cfg.norm_eps
        self.residual_in_fp32 = cfg.residual_in_fp32
        self.layers = build_blocks(inner, device=device, dtype=dtype, name="mtp.layers")
        M = cfg.d_model
        first, last = self.layers[0], self.layers[-1]
        first.enorm = RMSNorm(M, cfg.norm_eps, device=device, dtype=dtype)
        first.hnorm = RMSNorm(M, cfg.norm_eps, device=device, dtype=dtype)
        first.eh_proj = nn.Linear(2 * M, M, bias=False, device=device, dtype=dtype)
        last.final_layernorm = RMSNorm(M, cfg.norm_eps, device=device, dtype=dtype)

    @property
    def n_attn_layers(self) -> int:
        return self.pattern.count("*")

    def forward_rows(self, embeds: torch.Tensor, hidden: torch.Tensor, pages, rows: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
        """One MTP step for R independent rows: embeds [R, M] (the embedded next tokens), hidden
        [R, M] (the hidden states before them) -> the MTP's final-normed hidden [R, M].

        pages      the MTP's ``KVPages`` (one layer per '*' of the pattern); mutated: row r's K/V
                   are written at position ``positions[r]`` of pool row ``rows[r]``
        rows       [R] int32: each token's pool row (rows may repeat: a request's several tokens);
                   -1 marks a pad row (its K/V go to the scratch page, it reads nothing, its output
                   is meaningless)
        positions  [R] int64: each token's position in its pool row; token r attends to that
                   row's first positions[r] + 1 entries (its own included). The caller grew the
                   rows' pages to cover them, and writes a row's positions in increasing order
                   within one call only when each one's earlier positions are written already
                   (tokens of a call see each other's K/V: the write comes before the read).
        """
        rdtype = torch.float32 if self.residual_in_fp32 else embeds.dtype
        first = self.layers[0]
        e, _ = add_rmsnorm(embeds, None, first.enorm.weight, self.eps)
        h, _ = add_rmsnorm(hidden.to(embeds.dtype), None, first.hnorm.weight, self.eps)
        out = first.eh_proj(torch.cat([e, h], dim=-1))
        batch = None
        if self.n_attn_layers:
            R = rows.shape[0]
            dev = rows.device
            kv = KVBatch(pages.block_table, pages.seq_lens, rows, positions)
            live = torch.where(rows >= 0, torch.arange(R, dtype=torch.int32, device=dev), -1).to(torch.int32)
            kv_read = KVBatch(pages.block_table[rows.long().clamp(min=0)], (positions + 1).to(torch.int32), live,
                              positions)
            batch = Batch(rows, kv=kv, spec=SpecBatch(1, "plain", None, [], None, kv_read))
        holder = SimpleNamespace(kv=pages)
        residual = None
        for block in self.layers:
            normed, residual = add_rmsnorm(out, residual, block.norm.weight, self.eps, residual_dtype=rdtype)
            out = block.verify(normed, holder, batch)
        final = self.layers[-1].final_layernorm
        h_out, _ = add_rmsnorm(out, residual, final.weight, self.eps, residual_dtype=rdtype)
        return h_out
