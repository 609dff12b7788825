"""The paged decode kernel compiled for sm_90 (no GPU needed: Triton's own ptxas), checked for the
software pipeline its speed rests on: at the default tile, num_stages - 1 K and V buffers in shared
memory beyond the one computed, the loop waiting only for the oldest tile, tensor-core products.
A page-id vector load used to become a pipelined level of its own, which left K and V a single
buffer and a wait for every load at each trip: the GPU then idles while a program's loads fly.

The compile runs in a subprocess without ``TRITON_INTERPRET`` (Triton reads it at import)."""
from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def compile_sm90(block_n: int, num_warps: int, num_stages: int, split: bool, fp8: bool = False) -> dict:
    """Compile the kernel at the Nemotron-H shape (G 4, Dh 128, 16-token pages, bf16 queries; bf16
    or float8 pages) for sm_90; returns its TTGIR and PTX. Runs in the interpreter-free subprocess."""
    from fastmamba.ops.attention.kernel import _paged_decode_attention_kernel as kernel
    from tests.helpers import compile_triton_sm90

    consts = dict(G=4, D=128, PAGE=16, BLOCK_G=16, BLOCK_D=128, BLOCK_N=block_n, PAGES_PER_TILE=block_n // 16,
                  SPLIT=split, UPCAST=False, KV_FP8=fp8, DOT_PRECISION="tf32",
                  stride_q_d=1, stride_k_d=1, stride_v_d=1, stride_bt_p=1, stride_o_d=1)
    kv = "*fp8e4nv" if fp8 else "*bf16"
    types = dict(q_ptr="*bf16", k_ptr=kv, v_ptr=kv, bt_ptr="*i32", lens_ptr="*i32", slots_ptr="*i32",
                 out_ptr="*bf16", part_ml_ptr="*fp32", part_o_ptr="*fp32", ks_ptr="*fp32", vs_ptr="*fp32",
                 qk_scale="fp32")
    k = compile_triton_sm90(kernel, consts, types, num_warps=num_warps, num_stages=num_stages)
    return {"ttgir": k.asm["ttgir"], "ptx": k.asm["ptx"]}


def _run(block_n: int, num_warps: int, num_stages: int, split: bool, fp8: bool = False) -> dict:
    from tests.helpers import compile_in_subprocess  # not at the top: __main__ runs without tests/ on the path

    return compile_in_subprocess(__file__, json.dumps([block_n, num_warps, num_stages, split, fp8]), ROOT)


@pytest.mark.parametrize("num_stages,split", [(3, False), (4, True)], ids=["st3", "st4-split"])
def test_default_tile_is_software_pipelined_on_sm90(num_stages, split):
    from fastmamba.ops.attention.configs import TILES

    block_n, warps, _ = TILES[(128, 2)]
    asm = _run(block_n, warps, num_stages, split)
    ttgir, ptx = asm["ttgir"], asm["ptx"]
    bufs = f"memdesc<{num_stages - 1}x{block_n}x128xbf16"
    assert ttgir.count(f"ttg.local_alloc : () -> !ttg.{bufs}") == 2, "K and V: num_stages - 1 buffers each"
    # in the loop, wait until only the newest tiles' K and V copies (2 commit groups a tile) are in flight
    assert f"{{num = {2 * (num_stages - 2)} : i32}}" in ttgir
    assert "cp.async" in ptx and "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx


def test_fp8_pages_stay_pipelined_on_sm90():
    """float8 pages: the same pipeline over 1-byte tiles (half the shared memory and bytes in
    flight per tile), each converted to bf16 for the same tensor-core products."""
    from fastmamba.ops.attention.configs import TILES

    block_n, warps, stages = TILES[(128, 1)]  # float8 pages' row (itemsize 1)
    asm = _run(block_n, warps, stages, False, True)
    ttgir, ptx = asm["ttgir"], asm["ptx"]
    bufs = f"memdesc<{stages - 1}x{block_n}x128xf8E4M3FN"
    assert ttgir.count(f"ttg.local_alloc : () -> !ttg.{bufs}") == 2, "K and V: num_stages - 1 float8 buffers each"
    assert "cp.async" in ptx and "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    print(json.dumps(compile_sm90(*json.loads(sys.argv[1]))))
