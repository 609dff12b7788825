"""Public MoE ops: ``moe_route`` (the router's selection) and ``fused_moe`` (routed relu² experts).

The signatures are the contract the layer (``fastmamba.layers.moe``) and the transformers provider
call. CUDA tensors (and CPU tensors under ``TRITON_INTERPRET=1``) run the Triton kernels of
``kernel.py`` and the other ``*_kernel.py`` files; other CPU tensors run the references of
``ref.py``. Neither op reads a device value on the host: buffers are sized from the shapes alone,
so both can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch

from fastmamba.ops._common.checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_dtype,
    check_int,
    check_flag,
    check_same_device,
    check_same_dtype,
    check_tensors,
)
from fastmamba.ops._common.dispatch import interpreter_enabled, use_triton
from fastmamba.ops._common.host_values import host_reads_allowed
from fastmamba.ops._common.launch import on_device
from fastmamba.ops.moe import configs
from fastmamba.ops._common.host_math import cdiv
from fastmamba.ops._common.pdl import pdl_active
from fastmamba.ops.moe.align_kernel import launch_align
from fastmamba.ops.moe.gemv_kernel import launch_gemv
from fastmamba.ops.moe.kernel import launch_grouped
from fastmamba.ops.moe.kernel_common import align_layout, grouped_rows
from fastmamba.ops.moe.router_kernel import launch_gate, launch_route
from fastmamba.ops.moe.ref import Routing, fused_moe_ref, moe_gate_ref, moe_route_ref

_ROUTE = "moe_route"
_GATE = "moe_gate"
_MOE = "fused_moe"
_GEMV = "fused_moe_gemv"


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def _check_selection(op: str, E: int, correction_bias, top_k, n_group, topk_group, norm_topk_prob,
                     routed_scaling_factor) -> tuple[int, int, int, bool]:
    """The selection arguments of ``moe_route`` / ``moe_gate`` for E experts; returns them checked."""
    top_k = check_int(op, "top_k", top_k)
    n_group = check_int(op, "n_group", n_group)
    topk_group = check_int(op, "topk_group", topk_group)
    norm_topk_prob = check_flag(op, "norm_topk_prob", norm_topk_prob)
    if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, (int, float)):
        raise TypeError(f"{op}: `routed_scaling_factor` expected a float, got "
                        f"{type(routed_scaling_factor).__name__}")
    if n_group < 1 or E % n_group:
        raise ValueError(f"{op}: `n_group`={n_group} must be >= 1 and divide E={E}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"{op}: `topk_group`={topk_group} must lie in [1, n_group={n_group}]")
    kept = topk_group * (E // n_group)
    if not 1 <= top_k <= kept:
        raise ValueError(f"{op}: `top_k`={top_k} must lie in [1, {kept}] (E={E} experts"
                         + (f", {topk_group} of {n_group} groups kept" if n_group > 1 else "") + ")")
    if correction_bias is not None:
        check_dtype(op, "correction_bias", correction_bias, FLOAT_DTYPES)
        if _shape(correction_bias) != (E,):
            raise ValueError(f"{op}: `correction_bias` expected shape (E={E},), got {_shape(correction_bias)}")
    return top_k, n_group, topk_group, norm_topk_prob


def moe_route(router_logits: torch.Tensor, correction_bias: torch.Tensor | None = None, *, top_k: int,
              n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
              routed_scaling_factor: float = 1.0) -> Routing:
    """Pick each token's ``top_k`` experts from its router logits (Nemotron-3's sigmoid router).

    router_logits    [T, E] fp32 (the router's fp32 linear; fp16 / bf16 are read as fp32); read
    correction_bias  [E] float or None: added to the scores for selection only; read
    top_k            experts per token, 1 <= top_k <= topk_group * E / n_group
    n_group, topk_group  grouped selection: keep the topk_group best of n_group groups (E % n_group == 0;
                     a group's score is the sum of its two best biased scores)
    norm_topk_prob   divide the chosen scores by their sum (+1e-20); routed_scaling_factor then scales them
    Returns Routing(weights [T, k] fp32, ids [T, k] int32), new tensors. Ties pick the lower expert id.
    One Triton program per token, no host read. Reference: ``ref.moe_route_ref``.
    """
    check_tensors(_ROUTE, [("router_logits", router_logits)], [("correction_bias", correction_bias)])
    check_dtype(_ROUTE, "router_logits", router_logits, FLOAT_DTYPES)
    if router_logits.dim() != 2:
        raise ValueError(f"{_ROUTE}: `router_logits` expected shape (T, E), got {_shape(router_logits)}")
    T, E = router_logits.shape
    if E < 1:
        raise ValueError(f"{_ROUTE}: `router_logits` has E=0 experts")
    top_k, n_group, topk_group, norm_topk_prob = _check_selection(
        _ROUTE, E, correction_bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
    check_same_device(_ROUTE, [("router_logits", router_logits), ("correction_bias", correction_bias)])
    if not use_triton(router_logits):
        return moe_route_ref(router_logits, correction_bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
                             norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=router_logits.device)
    if T:
        bias = correction_bias.contiguous() if correction_bias is not None else None  # [E]: a no-op as loaded
        with on_device(router_logits):
            launch_route(router_logits, bias, weights, ids, top_k=top_k, n_group=n_group, topk_group=topk_group,
                         renorm=norm_topk_prob, scale=float(routed_scaling_factor))
    return Routing(weights, ids)


def moe_gate(x: torch.Tensor, weight: torch.Tensor, correction_bias: torch.Tensor | None = None, *, top_k: int,
             n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
             arrivals: torch.Tensor | None = None) -> Routing:
    """The router of a few tokens in one launch: logits = x @ weight^T in fp32, then ``moe_route``.

    x               [T, M] bf16 / fp16 / fp32, any strides, T <= ``configs.GATE_MAX_TOKENS``; read in
                    its own dtype (no fp32 copy), each product and the sum in fp32
    weight          [E, M] float (the router's fp32 ``gate.weight``), any strides; read
    correction_bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor: as ``moe_route``
    arrivals        int32 tensor whose first entry is 0 (left 0): the counter by which the last of
                    the GEMV's programs knows it routes (``decode_workspace``). None: a new one (a
                    memset launch more)
    Returns Routing(weights [T, k] fp32, ids [T, k] int32), new tensors: ``moe_route`` of
    ``F.linear(x.float(), weight.float())`` (fp32 sums in another order than a BLAS GEMV: the logits
    agree to fp32 rounding). One kernel: ``cdiv(E, rows)`` programs each compute ``rows`` experts'
    logits; the last to finish routes every token. No host read (CUDA-graph safe).
    Reference: ``ref.moe_gate_ref``.
    """
    check_tensors(_GATE, [("x", x), ("weight", weight)], [("correction_bias", correction_bias),
                                                          ("arrivals", arrivals)])
    check_dtype(_GATE, "x", x, FLOAT_DTYPES)
    check_dtype(_GATE, "weight", weight, FLOAT_DTYPES)
    if x.dim() != 2:
        raise ValueError(f"{_GATE}: `x` expected shape (T, M), got {_shape(x)}")
    T, M = x.shape
    if T > configs.GATE_MAX_TOKENS:
        raise ValueError(f"{_GATE}: `x` has T={T} tokens, more than GATE_MAX_TOKENS={configs.GATE_MAX_TOKENS} "
                         "(route more with the router's GEMM and moe_route)")
    if weight.dim() != 2 or weight.shape[1] != M or weight.shape[0] < 1:
        raise ValueError(f"{_GATE}: `weight` expected shape (E, M={M}) with E >= 1, got {_shape(weight)}")
    E = weight.shape[0]
    top_k, n_group, topk_group, norm_topk_prob = _check_selection(
        _GATE, E, correction_bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
    if arrivals is not None:
        check_dtype(_GATE, "arrivals", arrivals, (torch.int32,))
        if arrivals.numel() < 1:
            raise ValueError(f"{_GATE}: `arrivals` expected at least 1 entry, got {_shape(arrivals)}")
    check_same_device(_GATE, [("x", x), ("weight", weight), ("correction_bias", correction_bias),
                              ("arrivals", arrivals)])
    if not use_triton(x):
        return moe_gate_ref(x, weight, correction_bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
                            norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor)
    dev = x.device
    weights = torch.empty(T, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=dev)
    if T == 0:
        return Routing(weights, ids)
    if arrivals is None:
        arrivals = torch.zeros(1, dtype=torch.int32, device=dev)
    logits = torch.empty(T, E, dtype=torch.float32, device=dev)  # scratch
    bias = correction_bias.contiguous() if correction_bias is not None else None  # [E]: a no-op as loaded
    cfg = configs.gate_config(E, M, interpreter=interpreter_enabled())
    with on_device(x):
        launch_gate(x, weight, bias, logits, weights, ids, arrivals, top_k=top_k, n_group=n_group,
                    topk_group=topk_group, renorm=norm_topk_prob, scale=float(routed_scaling_factor), rows=cfg.rows,
                    block_m=cfg.block_m, num_warps=cfg.num_warps,
                    use_pdl=pdl_active(x, cdiv(E, cfg.rows), cfg.num_warps))
    return Routing(weights, ids)


def decode_workspace(M: int, *, max_tokens: int = configs.GEMV_MAX_TOKENS, device=None) -> torch.Tensor:
    """The int32 zeros a MoE layer keeps for its decode kernels' arrival counters: entry 0 for
    ``moe_gate``, entries 1.. (``max_tokens * M``) for ``fused_moe_gemv``'s fused sum of up to
    ``max_tokens`` tokens of width M (every config's blocks fit). The kernels leave them zero; a
    layer passes ``ws[:1]`` and ``ws[1:]``. Not for two calls running at once (other streams)."""
    return torch.zeros(1 + max_tokens * M, dtype=torch.int32, device=device)


def _check_moe(x, w_up, w_down, topk_weights, topk_ids, out) -> tuple[int, int, int, int, int]:
    """Every check of ``fused_moe``'s arguments; returns (T, M, F, E, k)."""
    check_tensors(_MOE, [("x", x), ("w_up", w_up), ("w_down", w_down), ("topk_weights", topk_weights),
                         ("topk_ids", topk_ids)], [("out", out)])
    check_dtype(_MOE, "x", x, FLOAT_DTYPES)
    check_same_dtype(_MOE, [("x", x), ("w_up", w_up), ("w_down", w_down)])
    if x.dim() != 2:
        raise ValueError(f"{_MOE}: `x` expected shape (T, M), got {_shape(x)}")
    T, M = x.shape
    if w_up.dim() != 3 or w_up.shape[2] != M or w_up.shape[0] < 1:
        raise ValueError(f"{_MOE}: `w_up` expected shape (E, F, M={M}) with E >= 1, got {_shape(w_up)}")
    E, F, _ = w_up.shape
    if _shape(w_down) != (E, M, F):
        raise ValueError(f"{_MOE}: `w_down` expected shape (E={E}, M={M}, F={F}), got {_shape(w_down)}")
    check_dtype(_MOE, "topk_ids", topk_ids, INDEX_DTYPES)
    check_dtype(_MOE, "topk_weights", topk_weights, FLOAT_DTYPES)
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_ids.shape[1] < 1:
        raise ValueError(f"{_MOE}: `topk_ids` expected shape (T={T}, k) with k >= 1, got {_shape(topk_ids)}")
    k = topk_ids.shape[1]
    if _shape(topk_weights) != (T, k):
        raise ValueError(f"{_MOE}: `topk_weights` expected shape (T={T}, k={k}), got {_shape(topk_weights)}")
    if out is not None:
        check_dtype(_MOE, "out", out, (x.dtype,))
        if _shape(out) != (T, M):
            raise ValueError(f"{_MOE}: `out` expected shape (T={T}, M={M}), got {_shape(out)}")
    check_same_device(_MOE, [("x", x), ("w_up", w_up), ("w_down", w_down), ("topk_weights", topk_weights),
                             ("topk_ids", topk_ids), ("out", out)])
    # ids in [0, E): read only where that costs no device sync (CPU tensors, outside capture /
    # tracing / trusted_inputs). On a GPU an id outside the range is not read: its pair adds nothing.
    if not topk_ids.is_cuda and host_reads_allowed(topk_ids) and topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= E:
            raise ValueError(f"{_MOE}: `topk_ids` values must lie in [0, E={E}); got {lo if lo < 0 else hi}")
    return T, M, F, E, k


def fused_moe(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Routed non-gated relu² experts: out[t] = sum_j w[t,j] * w_down[e] @ relu(w_up[e] @ x[t])², e = ids[t,j].

    x             [T, M] bf16 / fp16 / fp32 (M: model or latent width); any strides; read
    w_up          [E, F, M] same dtype as x (transformers' fused ``experts.up_proj``); read
    w_down        [E, M, F] same dtype as x (``experts.down_proj``); read
    topk_weights  [T, k] fp32 (fp16 / bf16 read as fp32); read
    topk_ids      [T, k] int32/int64 in [0, E) (checked on CPU tensors; on a GPU an id outside it adds nothing)
    out           [T, M] x's dtype, optional, any strides (written)
    Returns [T, M] in x's dtype (``out`` when given). fp32 accumulation; the relu² activations and the
    k weighted contributions are rounded to x's dtype before the fp32 k-sum (as vLLM's fused_moe).
    A few tokens (``configs.GEMV_MAX_TOKENS``) take the GEMV path, which reads only the chosen experts;
    more take the grouped GEMM path. No host read of device values (CUDA-graph safe); deterministic.
    Reference: ``ref.fused_moe_ref``.
    """
    T, M, F, E, k = _check_moe(x, w_up, w_down, topk_weights, topk_ids, out)
    if not use_triton(x):
        y = fused_moe_ref(x, w_up, w_down, topk_weights, topk_ids)
        return y if out is None else out.copy_(y)
    interp = interpreter_enabled()
    cfg = configs.pick_config(x.device, x.dtype, T, M, F, E, k, interpreter=interp)
    return _launch(x, w_up, w_down, topk_weights, topk_ids, out, cfg, T, M, F, E, k, interp)


def fused_moe_gemv(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, *, out: torch.Tensor | None = None, shared_up: torch.Tensor | None = None,
                   shared_down: torch.Tensor | None = None, arrivals: torch.Tensor | None = None) -> torch.Tensor:
    """``fused_moe`` on its GEMV path whatever T is (the decode path: each program streams one chosen
    expert's rows, so a step reads only the selected experts' weights). Same arguments and result;
    for a caller that wants one numerical path for every batch size of a decode step. Two more:

    shared_up    [S*F, M], shared_down [M, S*F] (both or neither; x's dtype; strides along M and F
                 equal w_up's and w_down's): a relu² shared expert (``MLP`` without biases) whose
                 width is a multiple of F, run in the same kernels as S more pairs of weight 1.0 per
                 token (relu² acts per feature and down_proj sums over them, so the shared expert is
                 exactly the sum of its S slices of F features). Adds ``down_s @ relu(up_s @ x)²``.
    arrivals     int32 zeros, at least ``T * M`` entries (left zero; ``decode_workspace``): the
                 k-sum is done by the down kernel's last program per (token, block of M), in the
                 same order and rounding as the separate sum kernel, which then does not run.

    Under programmatic dependent launch the shared slices' programs read x without waiting for the
    kernel launched just before (the router, which writes the ids): that kernel must not write x.
    Reference: ``ref.fused_moe_ref`` (plus ``ref.shared_expert_ref``).
    """
    T, M, F, E, k = _check_moe(x, w_up, w_down, topk_weights, topk_ids, out)
    S = _check_gemv_extras(x, F, M, w_up, w_down, shared_up, shared_down, arrivals, T)
    if not use_triton(x):
        y = fused_moe_ref(x, w_up, w_down, topk_weights, topk_ids, shared_up=shared_up, shared_down=shared_down)
        return y if out is None else out.copy_(y)
    interp = interpreter_enabled()
    cfg = configs.pick_config(x.device, x.dtype, T, M, F, E, k, shared=S, interpreter=interp)
    cfg = configs.gemv_config(cfg, T, M, F, interpreter=interp)
    return _launch(x, w_up, w_down, topk_weights, topk_ids, out, cfg, T, M, F, E, k, interp,
                   shared=(shared_up, shared_down) if S else None, arrivals=arrivals)


def _check_gemv_extras(x, F, M, w_up, w_down, shared_up, shared_down, arrivals, T) -> int:
    """``fused_moe_gemv``'s shared expert and arrival counters checked; returns S (0: none)."""
    if (shared_up is None) != (shared_down is None):
        raise ValueError(f"{_GEMV}: `shared_up` and `shared_down` come together, got only "
                         f"`{'shared_up' if shared_down is None else 'shared_down'}`")
    S = 0
    if shared_up is not None:
        check_tensors(_GEMV, [("shared_up", shared_up), ("shared_down", shared_down)])
        check_same_dtype(_GEMV, [("x", x), ("shared_up", shared_up), ("shared_down", shared_down)])
        if shared_up.dim() != 2 or shared_up.shape[1] != M or F == 0 or shared_up.shape[0] % F or not shared_up.shape[0]:
            raise ValueError(f"{_GEMV}: `shared_up` expected shape (S*F, M={M}) with S >= 1 (F={F}), "
                             f"got {_shape(shared_up)}")
        S = shared_up.shape[0] // F
        if _shape(shared_down) != (M, S * F):
            raise ValueError(f"{_GEMV}: `shared_down` expected shape (M={M}, S*F={S * F}), got {_shape(shared_down)}")
        if shared_up.stride(1) != w_up.stride(2) or shared_down.stride(1) != w_down.stride(2):
            raise ValueError(f"{_GEMV}: the shared expert's strides along M / F ({shared_up.stride(1)}, "
                             f"{shared_down.stride(1)}) must equal w_up's / w_down's ({w_up.stride(2)}, "
                             f"{w_down.stride(2)}) (contiguous weights have 1 and 1)")
        check_same_device(_GEMV, [("x", x), ("shared_up", shared_up), ("shared_down", shared_down)])
    if arrivals is not None:
        check_tensors(_GEMV, [("arrivals", arrivals)])
        check_dtype(_GEMV, "arrivals", arrivals, (torch.int32,))
        if arrivals.numel() < T * M:
            raise ValueError(f"{_GEMV}: `arrivals` expected at least T*M={T * M} entries, got {arrivals.numel()}")
        if not arrivals.is_contiguous():
            raise ValueError(f"{_GEMV}: `arrivals` must be contiguous, got strides {arrivals.stride()}")
        check_same_device(_GEMV, [("x", x), ("arrivals", arrivals)])
    return S


def _launch(x, w_up, w_down, tw, ids, out, cfg: configs.MoeConfig, T: int, M: int, F: int, E: int, k: int,
            interp: bool, *, shared: tuple | None = None, arrivals: torch.Tensor | None = None) -> torch.Tensor:
    y = out if out is not None else torch.empty(T, M, dtype=x.dtype, device=x.device)
    if T == 0 or M == 0:
        return y
    if F == 0:  # an empty expert width: every contribution is an empty sum
        return y.zero_()
    dev = x.device
    with on_device(x):
        if cfg.path == "gemv":
            shared_up, shared_down = shared if shared is not None else (None, None)
            P = T * (k + (0 if shared_up is None else shared_up.shape[0] // F))
            h = torch.empty(P, F, dtype=x.dtype, device=dev)
            yp = torch.empty(P, M, dtype=x.dtype, device=dev)  # each pair's weighted contribution
            launch_gemv(x, w_up, w_down, tw, ids, h, yp, y, block_n_up=cfg.block_n_up, block_k_up=cfg.block_k_up,
                        block_n_down=cfg.block_n_down, block_k_down=cfg.block_k_down, num_warps=cfg.num_warps,
                        num_stages=cfg.num_stages, shared_up=shared_up, shared_down=shared_down, arrivals=arrivals,
                        use_dot=cfg.gemv_dot, dot_fp32=interp)
            return y
        if cfg.path != "grouped":
            raise ValueError(f"{_MOE}: config path {cfg.path!r}: expected 'gemv' or 'grouped'")
        P = T * k
        layout = align_layout(P, E, cfg.block_m)
        ws = torch.empty(2 * E, dtype=torch.int32, device=dev)  # counts, cursors (launch_align writes them)
        counts, cursor = ws[:E], ws[E:]
        pairs = torch.empty(layout.entries, dtype=torch.int32, device=dev)
        h = torch.empty(grouped_rows(P, E, cfg.block_m), F, dtype=x.dtype, device=dev)  # relu² rows, expert-sorted
        yp = torch.empty(P, M, dtype=x.dtype, device=dev)  # each pair's weighted contribution
        launch_align(ids, counts, cursor, pairs, E=E, block_m=cfg.block_m, layout=layout)
        launch_grouped(x, w_up, w_down, tw, ids, counts, pairs, layout, h, yp, y, block_m=cfg.block_m,
                       block_n_up=cfg.block_n_up, block_k_up=cfg.block_k_up, block_n_down=cfg.block_n_down,
                       block_k_down=cfg.block_k_down, group_m=cfg.group_m, num_warps=cfg.num_warps,
                       num_stages=cfg.num_stages, dot_fp32=interp)
    return y
