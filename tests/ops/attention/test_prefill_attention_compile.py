"""The prefill attention kernel compiled for sm_90 at its default tile (no GPU needed: Triton's
compiler and ptxas, in a subprocess without ``TRITON_INTERPRET``): tensor-core products, K and V
loads pipelined through shared memory in both key loops, no register spills, shared memory within
an SM (the default tile takes 128 KiB: one 8-warp program per SM, the sweep's fastest). The interpreter tests cover its results; this covers what its speed rests on."""
from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SMEM_PER_SM = 227 * 1024


def compile_sm90(dtype: str, kv: str | None = None) -> dict:
    """Compile at Nemotron-H's shape (G 4, Dh 128, pages of 16) with the (128, itemsize) tile;
    returns the PTX's markers, shared memory, warps and ptxas's spill lines. ``kv``: the pages'
    dtype when not q's (``fp8e4nv``: float8 pages)."""
    from fastmamba.ops.attention.configs import PREFILL_TILES
    from fastmamba.ops.attention.prefill_kernel import _paged_prefill_attention_kernel as kernel
    from tests.helpers import compile_triton_sm90, ptxas_report, spill_lines

    tile = PREFILL_TILES[(128, 2)]
    consts = dict(G=4, G_PAD=4, D=128, BLOCK_D=128, PAGE=16, BLOCK_M=tile.rows // 4, BLOCK_N=tile.block_n,
                  PAGES_PER_TILE=tile.block_n // 16, UPCAST=False, KV_FP8=kv == "fp8e4nv", DOT_PRECISION="tf32",
                  stride_q_d=1, stride_k_d=1, stride_v_d=1, stride_bt_p=1, stride_o_d=1)
    kv = kv or dtype
    types = dict(q_ptr=f"*{dtype}", k_ptr=f"*{kv}", v_ptr=f"*{kv}", out_ptr=f"*{dtype}", bt_ptr="*i32",
                 slots_ptr="*i32", cu_ptr="*i32", ctx_ptr="*i64", work_ptr="*i64", ks_ptr="*fp32", vs_ptr="*fp32",
                 qk_scale="fp32")
    k = compile_triton_sm90(kernel, consts, types, num_warps=tile.num_warps, num_stages=tile.num_stages)
    ptx = k.asm["ptx"]
    return dict(mma="mma.sync.aligned" in ptx or "wgmma.mma_async" in ptx, cp_async=ptx.count("cp.async.wait_group"),
                shared=k.metadata.shared, warps=k.metadata.num_warps,
                spills=spill_lines(ptxas_report(ptx, "prefill_attention")))


@pytest.mark.parametrize("kv", ["bf16", "fp8e4nv"], ids=["bf16-pages", "fp8-pages"])
def test_prefill_attention_kernel_compiles_for_sm90(kv):
    from tests.helpers import compile_in_subprocess  # not at the top: __main__ runs without tests/ on the path

    got = compile_in_subprocess(__file__, json.dumps(["bf16", kv]), ROOT)
    assert got["mma"], "q K^T and p V on tensor cores"
    assert got["cp_async"] >= 2, "K / V loads pipelined (cp.async) in both key loops"
    assert 0 < got["shared"] <= SMEM_PER_SM, f"{got['shared']} bytes of shared memory per program"
    assert got["spills"] and all(" 0 bytes spill stores" in s for s in got["spills"]), got["spills"]


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    print(json.dumps(compile_sm90(*json.loads(sys.argv[1]))))
