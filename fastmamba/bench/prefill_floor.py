"""The floor of a whole-model prefill of B x L tokens: the weights it must read and the matmul
FLOPs it must do, each at the rate measured on the machine.

Counting rules (``prefill_work``):
  * bytes: every weight once (shared ones once), but of an untied input embedding table only the
    rows of the T = B x L tokens, and of a MoE layer only the routed experts T tokens can reach
    (min(E, top_k x T) per layer) -- as ``e2e_bytes.decode_weight_bytes`` counts a decode step of T
    tokens; an MTP layer (a drafter) is not read;
  * FLOPs: 2 x T x the *active* matrix parameters: the projections, the shared experts, the
    routers and top_k of E routed experts per MoE layer (not the E of them the checkpoint holds);
    the LM head for the B last positions only (``prefill`` returns the last position's logits);
    no FLOPs for the embedding lookup, the depthwise conv, the scan, norms and attention's score
    matmuls (a lower bound);
  * the FLOPs split by the weights' dtype: FP8 (e4m3) matrices at the FP8 matmul rate
    (``torch._scaled_mm``), the others at the bf16 rate.

floor = max(bytes / copy bandwidth, FLOPs_16 / rate_16 + FLOPs_8 / rate_8).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefillWork:
    """What one prefill of ``batch`` x ``length`` tokens must do (see the module doc)."""

    weight_bytes: int
    flops_16: float  # on 16- or 32-bit weights
    flops_8: float   # on FP8 weights
    active_params: int  # matrix parameters one token runs through (LM head excluded)

    def floor_ms(self, copy_gbs: float, tflops_16: float, tflops_8: float | None) -> float:
        """max(weights read once, the FLOPs at their rates), in ms. ``tflops_8`` None (no FP8 rate
        measured) counts FP8 FLOPs at the 16-bit rate."""
        t8 = tflops_8 if tflops_8 else tflops_16
        compute = self.flops_16 / (tflops_16 * 1e12) + self.flops_8 / (t8 * 1e12)
        return 1e3 * max(self.weight_bytes / (copy_gbs * 1e9), compute)


def prefill_work(model, batch: int, length: int) -> PrefillWork:
    """The bytes and FLOPs floor of ``model.prefill`` of ids [batch, length] (module doc)."""
    from fastmamba.bench.e2e_bytes import decode_weight_bytes, moe_layers

    tokens = batch * length
    routed = {}  # data_ptr of a routed-experts tensor -> the active fraction top_k / E
    for moe in moe_layers(model):
        for t in (moe.experts.up_proj, moe.experts.down_proj):
            routed[t.data_ptr()] = moe.cfg.top_k / moe.cfg.n_experts
    emb, head = model.backbone.embeddings.weight, model.lm_head.weight
    seen = {emb.data_ptr(), head.data_ptr()}  # the lookup costs no FLOPs; the head is counted below
    flops = {1: 0.0, 2: 0.0}  # by the weights' bytes per value: 1 for FP8, 2 for 16 and 32 bits
    active = 0
    for name, p in model.named_parameters():
        if name.startswith("mtp.") or name.endswith("_scale") or p.data_ptr() in seen:  # FP8 scales: no GEMM
            continue
        seen.add(p.data_ptr())
        if p.data_ptr() in routed:
            n = p.numel() * routed[p.data_ptr()]
        elif p.dim() == 2:  # the projections and routers (conv weights are 3-D [C, 1, W], scales 0-/1-D)
            n = p.numel()
        else:
            continue
        active += round(n)
        flops[min(p.element_size(), 2)] += 2.0 * tokens * n
    flops[min(head.element_size(), 2)] += 2.0 * batch * head.numel()  # the B last positions' logits
    return PrefillWork(decode_weight_bytes(model, tokens), flops[2], flops[1], active)
