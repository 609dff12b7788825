"""The grouped W8A8 MoE kernels and the decode GEMVs compile for sm_90 (no GPU needed: Triton's compiler
and ptxas) in the variants the launchers pick at nemotron-3-nano's and Super-latent's shapes: the interpreter runs
none of the GPU lowering (the e4m3 x e4m3 ``tl.dot`` on Hopper's tensor cores, early returns), and
ptxas reports register spills.

The compile runs in a subprocess without ``TRITON_INTERPRET`` (Triton reads it at import)."""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
K = "fastmamba.ops.fp8.kernel"
GROUPED = "fastmamba.ops.fp8.grouped_kernel"  # _moe_up_kernel, _moe_down_kernel
_UP = dict(xq_ptr="*fp8e4nv", sx_ptr="*fp32", w_ptr="*fp8e4nv", sw_ptr="*fp32", hs_ptr="*fp32",
           sorted_ptr="*i32", counts_ptr="*i32")
_DOWN = dict(hq_ptr="*fp8e4nv", sh_ptr="*fp32", w_ptr="*fp8e4nv", sw_ptr="*fp32", tw_ptr="*fp32", y_ptr="*fp32",
             sorted_ptr="*i32", counts_ptr="*i32")
# a launch specialises ints equal to 1: unit strides of contiguous weights, per-token scales, routing weights
_UNIT = dict(stride_w_k=1, stride_sx_t=1, stride_sh_p=1, stride_sw_n=1, stride_tw_k=1)
# configs.moe_grouped_config at nano (E 128, M 2688, F 1856: block_k 128 along M, 64 along F) and
# Super-latent (E 512, M 1024, F 2688) widths, few and many rows per expert
_SMALL = dict(BM=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, BLOCK_E=128)
_BIG = dict(BM=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, BLOCK_E=128)

# name -> (kernel, pointer types, constexprs, options)
VARIANTS = {
    "up-BM16-dynamic": ("_moe_up_kernel", dict(_UP, h_ptr="*fp32"),
                        dict(_SMALL, QUANT_H=False, QMAX=448.0, EVEN_K=True, PER_EXPERT=True, hs_ptr=None),
                        dict(num_warps=4, num_stages=4)),
    "up-BM64-static": ("_moe_up_kernel", dict(_UP, h_ptr="*fp8e4nv"),
                       dict(_SMALL, BM=64, BLOCK_N=128, GROUP_M=8, QUANT_H=True, QMAX=448.0, EVEN_K=True,
                            PER_EXPERT=False), dict(num_warps=4, num_stages=4)),
    "up-BM128-super": ("_moe_up_kernel", dict(_UP, h_ptr="*fp32"),
                       dict(_BIG, BLOCK_E=512, QUANT_H=False, QMAX=448.0, EVEN_K=True, PER_EXPERT=False,
                            hs_ptr=None), dict(num_warps=8, num_stages=3)),
    "down-BM16-masked-K": ("_moe_down_kernel", _DOWN, dict(_SMALL, EVEN_K=False, PER_EXPERT=True),
                           dict(num_warps=4, num_stages=4)),
    "down-BM128-nano": ("_moe_down_kernel", _DOWN, dict(_BIG, BLOCK_K=64, EVEN_K=True, PER_EXPERT=False),
                        dict(num_warps=8, num_stages=3)),
}

# the decode GEMVs (fp8_gemv, the MoE pair GEMV) with their default tiles (configs.FMA_DEFAULT at 1 and
# 2 rows, DOT_DEFAULT at 16) and the weight-left dot (swap_ab, which should take Hopper's wgmma)
_GEMV = dict(x_ptr="*bf16", sx_ptr="*fp32", w_ptr="*fp8e4nv", sw_ptr="*fp32", b_ptr="*bf16", add_ptr="*bf16",
             y_ptr="*bf16")
_GEMV_C = dict(HAS_BIAS=False, HAS_ADD=False, RELU2_IN=False, QUANT=1, ON_GPU=True, EVEN=True, USE_PDL=True, ONE_ROW=False,
               AMAX_MIN=1e-12, QMAX=448.0, b_ptr=None, add_ptr=None)
_PAIR = dict(q_ptr="*bf16", sq_ptr="*fp32", w_ptr="*fp8e4nv", s_ptr="*fp32", ids_ptr="*i32", tw_ptr="*fp32",
             out_ptr="*fp32")
_PAIR_C = dict(Q_PER_PAIR=False, RELU2=True, QUANT=1, ON_GPU=True, EVEN=True, USE_PDL=True, AMAX_MIN=1e-12,
               QMAX=448.0)
VARIANTS.update({
    "gemv-fma-1row": ("_fp8_gemv_kernel", _GEMV, dict(_GEMV_C, USE_DOT=False, SWAP_AB=False, BLOCK_T=1, BLOCK_N=16,
                                                       BLOCK_K=1024, ONE_ROW=True), dict(num_warps=4, num_stages=2)),
    "gemv-fma-2rows": ("_fp8_gemv_kernel", _GEMV, dict(_GEMV_C, USE_DOT=False, SWAP_AB=False, BLOCK_T=2, BLOCK_N=16,
                                                        BLOCK_K=512), dict(num_warps=4, num_stages=2)),
    "gemv-dot": ("_fp8_gemv_kernel", _GEMV, dict(_GEMV_C, USE_DOT=True, SWAP_AB=False, BLOCK_T=16, BLOCK_N=64,
                                                  BLOCK_K=128), dict(num_warps=4, num_stages=3)),
    "gemv-swap": ("_fp8_gemv_kernel", _GEMV, dict(_GEMV_C, USE_DOT=True, SWAP_AB=True, BLOCK_T=16, BLOCK_N=64,
                                                   BLOCK_K=128), dict(num_warps=4, num_stages=3)),
    # fp32 with add=: the sum must stay an add of its own (add.rn), not an fma with the product
    "gemv-fma-add-fp32": ("_fp8_gemv_kernel", dict(_GEMV, x_ptr="*fp32", add_ptr="*fp32", y_ptr="*fp32"),
                          dict({k: v for k, v in _GEMV_C.items() if k != "add_ptr"}, HAS_ADD=True, USE_DOT=False, SWAP_AB=False, BLOCK_T=1,
                               BLOCK_N=16, BLOCK_K=1024, ONE_ROW=True), dict(num_warps=4, num_stages=2)),
    "pair-fma": ("_moe_pair_gemv_kernel", _PAIR, dict(_PAIR_C, USE_DOT=False, SWAP_AB=False, BLOCK_N=16,
                                                      BLOCK_K=1024), dict(num_warps=4, num_stages=2)),
    "pair-swap": ("_moe_pair_gemv_kernel", _PAIR, dict(_PAIR_C, USE_DOT=True, SWAP_AB=True, BLOCK_N=64,
                                                       BLOCK_K=128), dict(num_warps=4, num_stages=3)),
})


def expected_mma(name: str) -> str:
    """"wgmma" (Hopper's warpgroup MMA on e4m3 operands), "mma" (mma.sync: Triton 3.6 converts the e4m3
    tiles to f16 for it, exactly) or "none" (the FMA loops)."""
    consts = VARIANTS[name][2]
    if "BM" in consts:
        return "wgmma" if consts["BM"] >= 64 else "mma"
    if not consts["USE_DOT"]:
        return "none"
    return "wgmma" if consts["SWAP_AB"] else "mma"


def compile_sm90(name: str) -> dict:
    import importlib

    from triton.runtime.autotuner import Heuristics

    from tests.helpers import compile_triton_sm90, ptxas_report, spill_lines

    kernel_name, types, consts, options = VARIANTS[name]
    kernel = getattr(importlib.import_module(GROUPED if kernel_name.startswith("_moe_") and "pair" not in kernel_name
                                             else K), kernel_name)
    if isinstance(kernel, Heuristics):
        kernel = kernel.fn
    consts = {**{n: v for n, v in _UNIT.items() if n in kernel.arg_names}, **consts}
    ptx = compile_triton_sm90(kernel, consts, types, **options).asm["ptx"]
    mmas = {line.split()[0] for line in ptx.splitlines() if "mma" in line and line.split()[0].startswith(("mma", "wgmma.mma"))}
    return {"ptx": len(ptx), "fp8_wgmma": any(m.startswith("wgmma.mma_async") and "e4m3.e4m3" in m for m in mmas),
            "mma_sync": any(m.startswith("mma.sync") for m in mmas), "add_rn": "add.rn.f32" in ptx,
            "spills": spill_lines(ptxas_report(ptx, name))}


def test_fp8_kernels_compile_for_sm90_without_spills():
    """Every variant in one subprocess (one Triton import); from 64-row blocks and in the weight-left
    decode dot the PTX multiplies e4m3 operands on Hopper's warpgroup MMA (not an upcast to 16 bits);
    smaller blocks take mma.sync (over f16 copies of the e4m3 tiles); the FMA loops run no MMA."""
    from tests.helpers import compile_in_subprocess  # not at the top: __main__ runs without tests/ on the path

    results = compile_in_subprocess(__file__, "all", ROOT)
    assert set(results) == set(VARIANTS)
    for name, result in results.items():
        assert result["ptx"] > 0, name
        mma = expected_mma(name)
        assert result["fp8_wgmma"] == (mma == "wgmma"), name  # 64+ rows / the weight on the left: Hopper's warpgroup MMA
        assert result["mma_sync"] == (mma == "mma"), name
        assert result["add_rn"] or "add" not in name, name
        assert all("0 bytes spill stores, 0 bytes spill loads" in s for s in result["spills"]), (name, result["spills"])


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    names = list(VARIANTS) if sys.argv[1] == "all" else [sys.argv[1]]
    print(json.dumps({n: compile_sm90(n) for n in names}))
