"""The MoE kernels compile for sm_90 (no GPU needed: Triton's compiler and ptxas) in the variants
the launchers pick for the Nano / Super-latent shapes in bf16: the interpreter runs none of the
GPU lowering (tl.histogram, atomics, early returns, bf16 tl.dot), and ptxas reports register spills.

The compile runs in a subprocess without ``TRITON_INTERPRET`` (Triton reads it at import)."""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
K = "fastmamba.ops.moe.kernel"
_GEMM_PTRS = dict(x_ptr="*bf16", w_ptr="*bf16", h_ptr="*bf16", y_ptr="*bf16", sorted_ptr="*i32", counts_ptr="*i32",
                  tw_ptr="*fp32")

# the strides that are 1 for contiguous x, weights, ids, routing weights and out (the others: 16-divisible)
UNIT_STRIDES = ("stride_le", "stride_ik", "stride_xm", "stride_twk", "stride_om")
_UP_UNIT = dict(stride_wm=1)  # up_proj weights [E, F, M]: contiguous along M
_DOWN_UNIT = dict(stride_wf=1)  # down_proj weights [E, M, F]: contiguous along F

# name -> (kernel, pointer / scalar types, constexprs, options)
VARIANTS = {
    "route-super-grouped": ("_route_kernel", dict(logits_ptr="*fp32", bias_ptr="*fp32", weights_ptr="*fp32",
                                                  ids_ptr="*i32", scale="fp32"),
                            dict(HAS_BIAS=True, TOP_K=22, N_GROUP=8, TOPK_GROUP=4, TOP2=True, RENORM=True,
                                 BLOCK_E=512, BLOCK_G=8, BLOCK_K=32), dict(num_warps=4)),
    "align-one-launch": ("_align_expert_kernel", dict(ids_ptr="*i32", counts_ptr="*i32", lists_ptr="*i32"),
                         dict(BLOCK_P=1024), dict(num_warps=4)),
    "align-count": ("_count_kernel", dict(ids_ptr="*i64", counts_ptr="*i32"), dict(BLOCK_P=256, BLOCK_E=128),
                    dict(num_warps=4)),
    "align-starts": ("_starts_kernel", dict(counts_ptr="*i32", cursor_ptr="*i32"), dict(BM=64, BLOCK_E=512),
                     dict(num_warps=4)),
    "align-scatter": ("_scatter_kernel", dict(ids_ptr="*i32", cursor_ptr="*i32", sorted_ptr="*i32"),
                      dict(BLOCK_P=256), dict(num_warps=4)),
    "up-BM16": ("_up_kernel", _GEMM_PTRS, dict(BM=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, BLOCK_E=128, EVEN_K=True,
                                               DOT_FP32=False, IEEE=False, PER_EXPERT=True, **_UP_UNIT),
                dict(num_warps=4, num_stages=4)),
    "up-BM128-masked-K": ("_up_kernel", _GEMM_PTRS, dict(BM=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, BLOCK_E=512,
                                                         EVEN_K=False, DOT_FP32=False, IEEE=False, PER_EXPERT=False,
                                                         **_UP_UNIT), dict(num_warps=8, num_stages=3)),
    "down-BM64": ("_down_kernel", _GEMM_PTRS, dict(BM=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, BLOCK_E=128,
                                                   EVEN_K=True, DOT_FP32=False, IEEE=False, PER_EXPERT=True, **_DOWN_UNIT),
                  dict(num_warps=4, num_stages=4)),
    "sum-k22-pdl": ("_sum_kernel", dict(y_ptr="*bf16", out_ptr="*bf16", ids_ptr="*i32"),
                    dict(K=22, BLOCK_N=1024, USE_PDL=True), dict(num_warps=4)),
    "up-gemv-pdl": ("_up_gemv_kernel", dict(x_ptr="*bf16", w_ptr="*bf16", h_ptr="*bf16", ids_ptr="*i32"),
                    dict(BLOCK_N=16, BLOCK_K=256, EVEN_K=False, USE_PDL=True, **_UP_UNIT),
                    dict(num_warps=4, num_stages=2)),
    "down-gemv": ("_down_gemv_kernel", dict(h_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", ids_ptr="*i32",
                                            tw_ptr="*fp32"),
                  dict(BLOCK_N=16, BLOCK_K=256, EVEN_K=False, USE_PDL=False, **_DOWN_UNIT),
                  dict(num_warps=4, num_stages=2)),
    "down-gemv-pdl": ("_down_gemv_kernel", dict(h_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", ids_ptr="*i32",
                                                tw_ptr="*fp32"),
                      dict(BLOCK_N=8, BLOCK_K=128, EVEN_K=True, USE_PDL=True, **_DOWN_UNIT),
                      dict(num_warps=4, num_stages=2)),
}


def compile_sm90(name: str) -> dict:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tests.helpers import ptxas_report, spill_lines

    kernel_name, types, consts, options = VARIANTS[name]
    kernel = getattr(importlib.import_module(K), kernel_name)
    names = kernel.arg_names
    consts = {**{n: 1 for n in UNIT_STRIDES if n in names}, **consts}  # a launch specialises ints equal to 1
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if sig[n].startswith("*") or n.startswith("stride")}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()},
                    attrs=aligned)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    return {"ptx": len(k.asm["ptx"]), "spills": spill_lines(ptxas_report(k.asm["ptx"], name))}


def test_moe_kernels_compile_for_sm90_without_spills():
    """Every variant in one subprocess (one Triton import)."""
    from tests.helpers import compile_in_subprocess  # not at the top: __main__ runs without tests/ on the path

    results = compile_in_subprocess(__file__, "all", ROOT)
    assert set(results) == set(VARIANTS)
    for name, result in results.items():
        assert result["ptx"] > 0, name
        assert all("0 bytes spill stores, 0 bytes spill loads" in s for s in result["spills"]), (name, result["spills"])


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    names = list(VARIANTS) if sys.argv[1] == "all" else [sys.argv[1]]
    print(json.dumps({n: compile_sm90(n) for n in names}))
