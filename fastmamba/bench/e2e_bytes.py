"""The roofline of ``bench e2e``: the minimum bytes one decode step of a whole model must move.

Counting rules: every weight read once (shared ones once; of an untied input embedding table only the
B tokens' rows; of a MoE layer only the routed experts the step's tokens chose), each request's conv and
SSM state rows read and written once, and an attention layer's K and V read over the context plus the
new token's written. The decode time's floor is these bytes over the measured copy bandwidth
(``fastmamba.bench.peak.measure_copy_bandwidth``).
"""
from __future__ import annotations

import contextlib
import statistics

import torch


def decode_weight_bytes(model, batch: int, experts_touched: list[float] | None = None) -> int:
    """Weight bytes one decode step of ``batch`` requests must read: every parameter once (shared ones
    once), except an untied input embedding table, of which the step reads only the rows of its
    ``batch`` tokens (at most ``vocab`` distinct rows); a tied table is read whole by the LM head.

    MoE layers: only the routed experts the step's tokens chose are read. ``experts_touched`` gives,
    per MoE layer in order, the mean count of distinct experts a step's routing touched
    (``count_touched_experts``); None counts top_k x batch (at most E) per layer, exact at batch 1.
    """
    seen, weights = set(), 0
    for name, p in model.named_parameters():
        if name.startswith("mtp."):  # an MTP layer (a drafter) is not read by decode
            continue
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            weights += p.numel() * p.element_size()
    emb = model.backbone.embeddings.weight
    if emb.data_ptr() != model.lm_head.weight.data_ptr():  # untied: a gather of B rows, not the table
        weights -= (emb.shape[0] - min(batch, emb.shape[0])) * emb.shape[1] * emb.element_size()
    for j, moe in enumerate(moe_layers(model)):
        n_experts = moe.cfg.n_experts
        touched = experts_touched[j] if experts_touched is not None else min(n_experts, moe.cfg.top_k * batch)
        weights -= int((n_experts - touched) * expert_bytes(moe))
    return weights


def moe_layers(model) -> list:
    """The model's MoE layers (``fastmamba.layers.moe.MoE``), in layer order (those of its backbone:
    an MTP layer's are the drafter's)."""
    from fastmamba.layers.moe import MoE

    return [m for m in getattr(model, "backbone", model).modules() if isinstance(m, MoE)]


def expert_bytes(moe) -> int:
    """Bytes of one routed expert of a MoE layer (its up_proj and down_proj slices)."""
    up, down = moe.experts.up_proj, moe.experts.down_proj
    return (up[0].numel() + down[0].numel()) * up.element_size()


def count_touched_experts(model, step, tokens: torch.Tensor, steps: int = 4) -> list[float]:
    """Mean distinct routed experts per MoE layer over ``steps`` eager decode steps from ``tokens``
    (``step(tokens) -> tokens``): what the byte model of a MoE decode step counts. The timed steps run
    from CUDA graphs, which cannot report their routing; these steps follow them on the same requests."""
    layers = moe_layers(model)
    if not layers:
        return []
    seen: list[list[int]] = [[] for _ in layers]  # per layer: distinct experts of each routing
    with _routings_recorded(layers, seen):
        for _ in range(steps):
            tokens = step(tokens)
    if not all(seen):
        raise RuntimeError(f"e2e: {sum(not s for s in seen)} of {len(layers)} MoE layers routed no token in "
                           f"{steps} decode steps: the expert count of the roofline has nothing to count")
    return [statistics.fmean(s) for s in seen]


@contextlib.contextmanager
def _routings_recorded(layers: list, seen: list[list[int]]):
    """While open, every routing of ``layers[j]`` appends its count of distinct expert ids to ``seen[j]``.
    A layer with a ``route`` method (its one door to the router) is wrapped per instance; older layers
    call the module's ``moe_route`` in layer order, so its calls are dealt out to the layers in turn."""
    import fastmamba.layers.moe as moe_module

    def recording(route, out: list[int]):
        def wrapped(*args, **kwargs):
            routing = route(*args, **kwargs)
            out.append(int(routing.ids.unique().numel()))
            return routing
        return wrapped

    if all(callable(getattr(type(m), "route", None)) for m in layers):
        for m, out in zip(layers, seen):
            m.route = recording(m.route, out)  # an instance attribute: shadows the method
        try:
            yield
        finally:
            for m in layers:
                del m.route
        return
    calls: list[int] = []
    route = moe_module.moe_route
    moe_module.moe_route = recording(route, calls)
    try:
        yield
    finally:
        moe_module.moe_route = route
        for j, out in enumerate(seen):
            out.extend(calls[j::len(layers)])


def step_bytes(model, batch: int, ssm_dtype: torch.dtype = torch.float32) -> int:
    """Minimum bytes of one decode step: the weights it reads (``decode_weight_bytes``), plus the B
    requests' state rows read + written."""
    weights = decode_weight_bytes(model, batch)
    c = model.cfg
    conv = 2 * batch * c.conv_dim * c.d_conv * model.dtype.itemsize
    ssm = 2 * batch * c.nheads * c.headdim * c.d_state * ssm_dtype.itemsize
    return weights + c.n_layer * (conv + ssm)


def hybrid_step_bytes(model, batch: int, context: float, ssm_dtype: torch.dtype = torch.float32,
                      experts_touched: list[float] | None = None) -> int:
    """Minimum bytes of one decode step of a hybrid model: the weights it reads once
    (``decode_weight_bytes``: an untied embedding table only in its B rows); per request, every Mamba
    layer's conv state (model dtype) and SSM state (``ssm_dtype``) read and written, and every
    attention layer's K and V (their page dtype: the model's, or float8) read over ``context`` tokens plus the new token's K and V
    written. The dtypes are the model's: a preset loads in bf16 on a GPU and fp32 on the CPU. MoE
    layers count the routed experts the step touched (``decode_weight_bytes``)."""
    c = model.cfg
    total = decode_weight_bytes(model, batch, experts_touched)
    if "M" in c.pattern:
        m = c.mamba
        conv = m.conv_dim * m.d_conv * model.dtype.itemsize
        ssm = m.nheads * m.headdim * m.d_state * ssm_dtype.itemsize
        per_layer = 2 * (conv + ssm)
        total += batch * c.pattern.count("M") * per_layer
    if "*" in c.pattern:
        from fastmamba.layers.attention import kv_cache_dtype_of

        kv_dtype = kv_cache_dtype_of(model) or model.dtype  # float8 pages (an FP8-K/V checkpoint): 1 byte
        kv_token = 2 * c.n_kv_heads * c.head_dim * kv_dtype.itemsize  # K and V of one token, one layer
        total += int(batch * c.pattern.count("*") * kv_token * (context + 1))
    return total
