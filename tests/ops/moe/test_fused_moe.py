"""fused_moe (routed relu² experts) vs its fp32 reference (CPU: the Triton interpreter).

Base row: T=9 tokens, M=48, F=40 (not a power of two), E=6 experts, top-2, fp32, the grouped path;
each other row changes one thing. Outputs are NaN-poisoned ``out=`` buffers.
"""
from __future__ import annotations

import pytest
import torch

from fastmamba.ops.moe import configs, fused_moe
from fastmamba.ops.moe import kernel_common as moe_common
from fastmamba.ops.moe.api import fused_moe_gemv
from fastmamba.ops.moe.align_kernel import launch_align
from fastmamba.ops.moe.kernel_common import align_layout, grouped_rows
from fastmamba.ops.moe.ref import fused_moe_ref
from tests.helpers import nan_like, seeded, tol


def make_inputs(T, M, F, E, k, dtype, device, seed=0):
    """x, w_up, w_down scaled so that outputs are O(1); a random distinct top-k per token and
    positive weights summing to 1."""
    g = seeded(seed)
    x = torch.randn(T, M, generator=g).to(device, dtype)
    w_up = (torch.randn(E, F, M, generator=g) / M ** 0.5).to(device, dtype)
    w_down = (torch.randn(E, M, F, generator=g) / F ** 0.5).to(device, dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(device, torch.int32)
    w = torch.rand(T, k, generator=g) + 0.1
    return x, w_up, w_down, (w / w.sum(-1, keepdim=True)).to(device), ids


def check(x, w_up, w_down, tw, ids, *, op=fused_moe, out_strided=False):
    want = fused_moe_ref(x, w_up, w_down, tw, ids)
    if out_strided:  # every other column of a wider NaN buffer
        big = torch.full((x.shape[0], 2 * x.shape[1]), float("nan"), dtype=x.dtype, device=x.device)
        out = big[:, ::2]
    else:
        out = nan_like(want)
    got = op(x, w_up, w_down, tw, ids, out=out)
    assert got.data_ptr() == out.data_ptr() and got.shape == want.shape and got.dtype == x.dtype
    torch.testing.assert_close(got.float(), want.float(), **tol(x.dtype))
    if out_strided:
        assert torch.isnan(big[:, 1::2]).all()  # the columns between stay untouched


CASES = {  # id: (T, M, F, E, k, dtype)
    "T9-M48-F40-E6-k2-fp32": (9, 48, 40, 6, 2, torch.float32),
    "T9-M48-F40-E6-k2-bf16": (9, 48, 40, 6, 2, torch.bfloat16),
    "T9-M48-F40-E6-k2-fp16": (9, 48, 40, 6, 2, torch.float16),
    "T20-M48-F40-E8-k3-bf16": (20, 48, 40, 8, 3, torch.bfloat16),
    "T6-M16-F16-E4-k1-fp32": (6, 16, 16, 4, 1, torch.float32),
    "T1-M48-F40-E6-k2-fp32-gemv": (1, 48, 40, 6, 2, torch.float32),
    "T3-M48-F40-E6-k3-bf16-gemv": (3, 48, 40, 6, 3, torch.bfloat16),
}


@pytest.mark.parametrize("T,M,F,E,k,dtype", list(CASES.values()), ids=list(CASES))
def test_matches_reference(T, M, F, E, k, dtype, device):
    check(*make_inputs(T, M, F, E, k, dtype, device, seed=T * 100 + k))


def test_strided_x_and_out(device):
    """x a column slice of a wider buffer, out every other column of a NaN buffer (grouped path)."""
    x, w_up, w_down, tw, ids = make_inputs(9, 48, 40, 6, 2, torch.float32, device, seed=5)
    wide = torch.randn(9, 96, device=device)
    wide[:, 48:] = x
    check(wide[:, 48:], w_up, w_down, tw, ids, out_strided=True)


def test_strided_gemv(device):
    """The GEMV path on a transposed x and a strided out."""
    x, w_up, w_down, tw, ids = make_inputs(2, 48, 40, 6, 2, torch.bfloat16, device, seed=6)
    check(x.t().contiguous().t(), w_up, w_down, tw, ids, out_strided=True)


def skewed_routing(T, E, device):
    """Expert 0 gets every token, expert 1 one token, expert 2 the rest; experts 3.. get none."""
    ids = torch.empty(T, 2, dtype=torch.int32)
    ids[:, 0] = 0
    ids[:, 1] = 2
    ids[T // 2, 1] = 1
    return ids.to(device)


@pytest.mark.parametrize("op,lists_max", [(fused_moe, None), (fused_moe, 0), (fused_moe_gemv, None)],
                         ids=["grouped", "grouped-padded-rows", "gemv"])
def test_experts_with_no_one_and_all_tokens(op, lists_max, device, monkeypatch):
    """T=18 > BM=16: expert 0's pairs span two row blocks; experts 3-5 get no token, and their
    weights are NaN: nothing of them may reach the output. The grouped path with either layout."""
    if lists_max is not None:
        monkeypatch.setattr(moe_common, "ALIGN_LISTS_MAX", lists_max)
    x, w_up, w_down, tw, _ = make_inputs(18, 32, 24, 6, 2, torch.float32, device, seed=7)
    ids = skewed_routing(18, 6, device)
    want = fused_moe_ref(x, w_up, w_down, tw, ids)
    w_up[3:], w_down[3:] = float("nan"), float("nan")
    got = op(x, w_up, w_down, tw, ids, out=nan_like(want))
    torch.testing.assert_close(got, want, **tol(x.dtype))


def test_forced_config_with_l2_groups(device):
    """Row blocks of 32 in L2 groups of 4 (the swizzled program order), int64 ids."""
    x, w_up, w_down, tw, ids = make_inputs(20, 48, 40, 8, 3, torch.float32, device, seed=8)
    with configs.forced_config(path="grouped", block_m=32, block_n_up=16, block_k_up=32, block_n_down=16,
                               block_k_down=16, group_m=4, num_warps=4, num_stages=1):
        check(x, w_up, w_down, tw, ids.long())


@pytest.mark.parametrize("lists_max", [None, 0], ids=["per-expert-lists", "padded-rows"])
def test_alignment_is_exact(lists_max, device):
    """Counts equal a bincount; per-expert lists hold each expert's pairs in pair order; padded rows
    hold them (in any order) at the expert's rows, pad rows untouched. Expert 2 gets no pair."""
    T, k, E, bm = 11, 3, 5, 16
    ids = torch.stack([torch.tensor([0, 1, 3, 4])[torch.randperm(4, generator=seeded(i))[:k]] for i in range(T)])
    ids = ids.to(device, torch.int32)
    ws = torch.full((2 * E,), 7, dtype=torch.int32, device=device)  # garbage: launch_align writes what it uses
    layout = align_layout(T * k, E, bm, lists_max)
    assert layout.per_expert == (lists_max is None)
    pairs = torch.full((layout.entries,), -1, dtype=torch.int32, device=device)
    launch_align(ids, ws[:E], ws[E:], pairs, E=E, block_m=bm, layout=layout)
    counts = torch.bincount(ids.flatten().long().cpu(), minlength=E)
    assert counts[2] == 0 and torch.equal(ws[:E].cpu().long(), counts)
    flat, pairs = ids.flatten().cpu(), pairs.cpu().long()
    start = 0
    for e in range(E):
        c = int(counts[e])
        want = torch.nonzero(flat == e).flatten()
        if layout.per_expert:
            assert torch.equal(pairs[e * T * k:e * T * k + c], want)
            assert (pairs[e * T * k + c:(e + 1) * T * k] == -1).all()
        else:
            assert torch.equal(pairs[start:start + c].sort().values, want)
            assert (pairs[start + c:start + -(-c // bm) * bm] == -1).all()  # pad rows untouched
        start += -(-c // bm) * bm
    assert start <= grouped_rows(T * k, E, bm)


def test_gemv_path_equals_reference_on_many_tokens(device):
    """fused_moe_gemv on T=9 (the grouped path's size) agrees with the reference too."""
    check(*make_inputs(9, 48, 40, 6, 2, torch.float16, device, seed=9), op=fused_moe_gemv)


def test_gemv_row_does_not_depend_on_the_others(device):
    """On the GEMV path a token's output is the same, bit for bit, alone or in a batch (each pair is
    its own program): a decode step and a verify step of more tokens agree (fused_moe_gemv)."""
    x, w_up, w_down, tw, ids = make_inputs(3, 48, 40, 6, 2, torch.bfloat16, device, seed=12)
    batch = fused_moe_gemv(x, w_up, w_down, tw, ids)
    alone = fused_moe_gemv(x[1:2], w_up, w_down, tw[1:2], ids[1:2])
    assert torch.equal(batch[1:2], alone)


def test_no_tokens(device):
    x, w_up, w_down, tw, ids = make_inputs(1, 16, 16, 4, 2, torch.float32, device)
    y = fused_moe(x[:0], w_up, w_down, tw[:0], ids[:0])
    assert y.shape == (0, 16)
    assert fused_moe(x[:, :0], w_up[:, :, :0], w_down[:, :0], tw, ids).shape == (1, 0)  # M = 0: nothing to launch


def test_path_choice(monkeypatch):
    """Few tokens take the GEMV path, more the grouped one; the table wins over the heuristic."""
    cpu = torch.device("cpu")
    entry = configs.heuristic(64, 16, 16, 4, 2)._replace(num_stages=7)
    monkeypatch.setitem(configs.TABLE, ("cpu", "bfloat16", 16, 16, 4, 2, 0, 64), entry)
    assert configs.pick_config(cpu, torch.bfloat16, 40, 16, 16, 4, 2) == entry
    # a call with shared-expert slices has its own key (its GEMV grids are larger): not this entry ...
    assert configs.pick_config(cpu, torch.bfloat16, 40, 16, 16, 4, 2, shared=2) == configs.heuristic(40, 16, 16, 4, 2)
    gemv = configs.gemv_heuristic(1, 16, 16)._replace(num_warps=2)
    monkeypatch.setitem(configs.TABLE, configs.table_key(cpu, torch.bfloat16, 1, 16, 16, 4, 2, shared=2), gemv)
    assert configs.pick_config(cpu, torch.bfloat16, 1, 16, 16, 4, 2, shared=2) == gemv  # ... but this one
    assert configs.pick_config(cpu, torch.bfloat16, 1, 16, 16, 4, 2) == configs.heuristic(1, 16, 16, 4, 2)
    assert configs.pick_config(cpu, torch.bfloat16, 1, 2688, 1856, 128, 6).path == "gemv"
    assert configs.pick_config(cpu, torch.bfloat16, configs.GEMV_MAX_TOKENS + 1, 2688, 1856, 128, 6).path == "grouped"
    big = configs.heuristic(4096, 2688, 1856, 128, 6)
    assert big.block_m >= 64 and 1856 % big.block_k_down == 0 and 2688 % big.block_k_up == 0
    assert configs.token_bucket(3) == 4 and configs.token_bucket(10 ** 6) == configs.TOKEN_BUCKETS[-1]
    assert configs.pick_config(cpu, torch.float32, 1, 16, 16, 4, 2, interpreter=True) == configs.INTERPRETER_GEMV


# --- bad input ------------------------------------------------------------------------------------
def _good(device):
    return make_inputs(3, 16, 16, 4, 2, torch.float32, device)


@pytest.mark.parametrize("change,exc,match", [
    (lambda a: {**a, "x": a["x"][0]}, ValueError, r"`x` expected shape \(T, M\)"),
    (lambda a: {**a, "w_up": a["w_up"][:, :, :8]}, ValueError, r"`w_up` expected shape \(E, F, M=16\)"),
    (lambda a: {**a, "w_down": a["w_down"][:, :, :8]}, ValueError, r"`w_down` expected shape \(E=4, M=16, F=16\)"),
    (lambda a: {**a, "w_up": a["w_up"].half()}, TypeError, r"`w_up` has dtype float16 but `x` has float32"),
    (lambda a: {**a, "ids": a["ids"].float()}, TypeError, r"`topk_ids` expected dtype in \(int32, int64\)"),
    (lambda a: {**a, "ids": a["ids"][:2]}, ValueError, r"`topk_ids` expected shape \(T=3, k\)"),
    (lambda a: {**a, "tw": a["tw"][:, :1]}, ValueError, r"`topk_weights` expected shape \(T=3, k=2\)"),
    (lambda a: {**a, "ids": a["ids"] + 4}, ValueError, r"`topk_ids` values must lie in \[0, E=4\)"),
    (lambda a: {**a, "ids": a["ids"] - 4}, ValueError, r"`topk_ids` values must lie in \[0, E=4\)"),
    (lambda a: {**a, "out": torch.empty(3, 8)}, ValueError, r"`out` expected shape \(T=3, M=16\)"),
    (lambda a: {**a, "out": torch.empty(3, 16, dtype=torch.float16)}, TypeError, r"`out` expected dtype in \(float32\)"),
    (lambda a: {**a, "x": a["x"].tolist()}, TypeError, r"`x` expected a torch.Tensor"),
], ids=["x-1d", "w_up-M", "w_down-F", "w_up-dtype", "ids-dtype", "ids-T", "weights-k", "ids-high", "ids-negative",
        "out-shape", "out-dtype", "x-list"])
def test_bad_input(change, exc, match):
    x, w_up, w_down, tw, ids = _good(torch.device("cpu"))
    a = change(dict(x=x, w_up=w_up, w_down=w_down, tw=tw, ids=ids, out=None))
    with pytest.raises(exc, match=match):
        fused_moe(a["x"], a["w_up"], a["w_down"], a["tw"], a["ids"], out=a["out"])


# --- GPU: the real shapes, CUDA graphs ------------------------------------------------------------
SHAPES = {"nano": (2688, 1856, 128, 6), "super-latent": (1024, 2688, 512, 22)}


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 5, 64, 1024])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gpu_shapes_bf16(shape, T):
    M, F, E, k = SHAPES[shape]
    x, w_up, w_down, tw, ids = make_inputs(T, M, F, E, k, torch.bfloat16, torch.device("cuda"), seed=T)
    check(x, w_up, w_down, tw, ids)
    if T <= 64:
        check(x, w_up, w_down, tw, ids, op=fused_moe_gemv)


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("T", [1, 64])
def test_gpu_cuda_graph_and_determinism(T, pdl):
    """Captured in a CUDA graph (no host read), replayed on new inputs; two runs equal bit for bit;
    with programmatic dependent launch on (the GEMV path's kernels read ids and weights early)."""
    from fastmamba.ops._common.pdl import programmatic_dependent_launch
    from fastmamba.ops.moe import moe_route

    M, F, E, k = SHAPES["nano"]
    dev = torch.device("cuda")
    x, w_up, w_down, _, _ = make_inputs(T, M, F, E, k, torch.bfloat16, dev, seed=1)
    logits = torch.randn(T, E, device=dev)
    bias = torch.randn(E, device=dev) * 0.01

    def step():
        r = moe_route(logits, bias, top_k=k, routed_scaling_factor=2.5)
        return fused_moe(x, w_up, w_down, r.weights, r.ids)

    eager = step()
    assert torch.equal(eager, step())
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with programmatic_dependent_launch(pdl), torch.cuda.graph(graph):
        captured = step()
    x.copy_(torch.randn_like(x))
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, step())
