"""The MoE kernels compile for sm_90 (no GPU needed: Triton's compiler and ptxas) in the variants
the launchers pick for the Nano / Super-latent shapes in bf16: the interpreter runs none of the
GPU lowering (tl.histogram, atomics, early returns, bf16 tl.dot), and ptxas reports register spills.

The compile runs in a subprocess without ``TRITON_INTERPRET`` (Triton reads it at import)."""
from __future__ import annotations

import inspect
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
K = tuple(f"fastmamba.ops.moe.{m}" for m in ("router_kernel", "align_kernel", "kernel", "gemv_kernel"))  # define them
_GATE_PTRS = dict(x_ptr="*bf16", w_ptr="*fp32", bias_ptr="*fp32", logits_ptr="*fp32", weights_ptr="*fp32",
                  ids_ptr="*i32", arrivals_ptr="*i32", scale="fp32")
_GEMM_PTRS = dict(x_ptr="*bf16", w_ptr="*bf16", h_ptr="*bf16", y_ptr="*bf16", sorted_ptr="*i32", counts_ptr="*i32",
                  tw_ptr="*fp32")

# the strides that are 1 for contiguous x, weights, ids, routing weights and out (the others: 16-divisible)
UNIT_STRIDES = ("stride_le", "stride_ik", "stride_xm", "stride_twk", "stride_om")  # (+ the gate's stride_wm)
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
                    dict(K=22, BLOCK_N=1024, USE_PDL=True, N_SHARED=0), dict(num_warps=4)),
    "sum-k6-shared2": ("_sum_kernel", dict(y_ptr="*bf16", out_ptr="*bf16", ids_ptr="*i32"),
                       dict(K=6, BLOCK_N=1024, USE_PDL=False, N_SHARED=2), dict(num_warps=4)),
    "up-gemv-pdl": ("_up_gemv_kernel", dict(x_ptr="*bf16", w_ptr="*bf16", h_ptr="*bf16", ids_ptr="*i32"),
                    dict(sw_ptr=None, K=22, N_SHARED=0, BLOCK_N=16, BLOCK_K=256, EVEN_K=False, USE_PDL=True,
                         **_UP_UNIT), dict(num_warps=4, num_stages=2)),
    "up-gemv-shared-pdl": ("_up_gemv_kernel", dict(x_ptr="*bf16", w_ptr="*bf16", sw_ptr="*bf16", h_ptr="*bf16",
                                                   ids_ptr="*i32"),
                           dict(K=6, N_SHARED=2, BLOCK_N=16, BLOCK_K=256, EVEN_K=False, USE_PDL=True, **_UP_UNIT),
                           dict(num_warps=4, num_stages=2)),
    # 2 warps on a [16, 128] tile (tune's candidates: 72 registers, 14 programs an SM on sm_90)
    "up-gemv-shared-2warps": ("_up_gemv_kernel", dict(x_ptr="*bf16", w_ptr="*bf16", sw_ptr="*bf16", h_ptr="*bf16",
                                                      ids_ptr="*i32"),
                              dict(K=6, N_SHARED=2, BLOCK_N=16, BLOCK_K=128, EVEN_K=True, USE_PDL=True, **_UP_UNIT),
                              dict(num_warps=2, num_stages=2)),
    "down-gemv-shared-sum-2warps": ("_down_gemv_kernel", dict(h_ptr="*bf16", w_ptr="*bf16", sw_ptr="*bf16",
                                                              y_ptr="*bf16", ids_ptr="*i32", tw_ptr="*fp32",
                                                              out_ptr="*bf16", arrivals_ptr="*i32"),
                                    dict(K=6, N_SHARED=2, BLOCK_N=16, BLOCK_K=128, EVEN_K=False, USE_PDL=True,
                                         FUSED_SUM=True, **_DOWN_UNIT), dict(num_warps=2, num_stages=2)),
    # the tensor-core tiles (gemv_dot): the weight tiles stream through cp.async
    "up-gemv-shared-dot": ("_up_gemv_kernel", dict(x_ptr="*bf16", w_ptr="*bf16", sw_ptr="*bf16", h_ptr="*bf16",
                                                   ids_ptr="*i32"),
                           dict(K=6, N_SHARED=2, BLOCK_N=32, BLOCK_K=128, EVEN_K=True, USE_PDL=True, USE_DOT=True,
                                DOT_FP32=False, **_UP_UNIT), dict(num_warps=4, num_stages=4)),
    "down-gemv-shared-sum-dot": ("_down_gemv_kernel", dict(h_ptr="*bf16", w_ptr="*bf16", sw_ptr="*bf16",
                                                           y_ptr="*bf16", ids_ptr="*i32", tw_ptr="*fp32",
                                                           out_ptr="*bf16", arrivals_ptr="*i32"),
                                 dict(K=6, N_SHARED=2, BLOCK_N=32, BLOCK_K=128, EVEN_K=False, USE_PDL=True,
                                      FUSED_SUM=True, USE_DOT=True, DOT_FP32=False, **_DOWN_UNIT),
                                 dict(num_warps=4, num_stages=4)),
    "down-gemv": ("_down_gemv_kernel", dict(h_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", ids_ptr="*i32",
                                            tw_ptr="*fp32", out_ptr="*bf16"),
                  dict(sw_ptr=None, arrivals_ptr=None, K=22, N_SHARED=0, BLOCK_N=16, BLOCK_K=256, EVEN_K=False,
                       USE_PDL=False, FUSED_SUM=False, **_DOWN_UNIT), dict(num_warps=4, num_stages=2)),
    "down-gemv-pdl": ("_down_gemv_kernel", dict(h_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", ids_ptr="*i32",
                                                tw_ptr="*fp32", out_ptr="*bf16"),
                      dict(sw_ptr=None, arrivals_ptr=None, K=6, N_SHARED=0, BLOCK_N=8, BLOCK_K=128, EVEN_K=True,
                           USE_PDL=True, FUSED_SUM=False, **_DOWN_UNIT), dict(num_warps=4, num_stages=2)),
    "down-gemv-shared-sum-pdl": ("_down_gemv_kernel", dict(h_ptr="*bf16", w_ptr="*bf16", sw_ptr="*bf16",
                                                           y_ptr="*bf16", ids_ptr="*i32", tw_ptr="*fp32",
                                                           out_ptr="*bf16", arrivals_ptr="*i32"),
                                 dict(K=6, N_SHARED=2, BLOCK_N=16, BLOCK_K=256, EVEN_K=False, USE_PDL=True,
                                      FUSED_SUM=True, **_DOWN_UNIT), dict(num_warps=4, num_stages=2)),
    "gate-nano-pdl": ("_gate_kernel", _GATE_PTRS, dict(HAS_BIAS=True, TOP_K=6, N_GROUP=1, TOPK_GROUP=1, TOP2=True,
                                                       RENORM=True, BLOCK_E=128, BLOCK_G=1, BLOCK_K=8, ROWS=1,
                                                       BLOCK_M=4096, EVEN_M=False, USE_PDL=True, stride_wm=1),
                      dict(num_warps=4)),
    "gate-super-grouped": ("_gate_kernel", _GATE_PTRS, dict(HAS_BIAS=True, TOP_K=22, N_GROUP=8, TOPK_GROUP=4,
                                                            TOP2=True, RENORM=True, BLOCK_E=512, BLOCK_G=8,
                                                            BLOCK_K=32, ROWS=4, BLOCK_M=1024, EVEN_M=True,
                                                            USE_PDL=False, stride_wm=1), dict(num_warps=4)),
}


def compile_sm90(name: str) -> dict:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tests.helpers import ptxas_report, spill_lines

    kernel_name, types, consts, options = VARIANTS[name]
    kernel = next(getattr(m, kernel_name) for m in map(importlib.import_module, K) if hasattr(m, kernel_name))
    names = kernel.arg_names
    consts = {**{n: 1 for n in UNIT_STRIDES if n in names}, **consts}  # a launch specialises ints equal to 1
    consts = {**{p.name: p.default for p in kernel.params if p.is_constexpr and p.name not in consts
                 and p.default is not inspect.Parameter.empty}, **consts}  # constexprs left at their defaults
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    # pointers, strides and the widths (Nano's and Super's are multiples of 16: a launch specialises them)
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if sig[n].startswith("*") or n.startswith("stride") or n in ("Mdim", "Fdim")}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()},
                    attrs=aligned)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = k.asm["ptx"]
    return {"ptx": len(ptx), "spills": spill_lines(ptxas_report(ptx, name)), "v4_loads": ptx.count("ld.global.v4"),
            "acq_rel_atomics": ptx.count("atom.global.gpu.acq_rel"), "cg_loads": ptx.count("ld.global.cg"),
            "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"), "mma": ptx.count("mma.sync")}


def test_moe_kernels_compile_for_sm90_without_spills():
    """Every variant in one subprocess (one Triton import)."""
    from tests.helpers import compile_in_subprocess  # not at the top: __main__ runs without tests/ on the path

    results = compile_in_subprocess(__file__, "all", ROOT)
    assert set(results) == set(VARIANTS)
    for name, result in results.items():
        assert result["ptx"] > 0, name
        assert all("0 bytes spill stores, 0 bytes spill loads" in s for s in result["spills"]), (name, result["spills"])
    # the shared expert's weights are picked per program (a select of base and row stride): the weight
    # tiles stay 16-byte loads, as many as without it
    assert results["up-gemv-shared-pdl"]["v4_loads"] == results["up-gemv-pdl"]["v4_loads"] > 0
    assert results["down-gemv-shared-sum-pdl"]["v4_loads"] == results["down-gemv"]["v4_loads"] > 0
    # the tensor-core tiles stream the weights through Triton's cp.async pipeline (the FMA loops do not)
    for name in ("up-gemv-shared-dot", "down-gemv-shared-sum-dot"):
        assert results[name]["cp_async"] > 0 and results[name]["mma"] > 0, (name, results[name])
    assert results["up-gemv-shared-pdl"]["cp_async"] == 0
    # the arrival counters: an acquire-release atomic, and the other programs' rows read through L2
    for name in ("down-gemv-shared-sum-pdl", "down-gemv-shared-sum-dot", "gate-nano-pdl", "gate-super-grouped"):
        assert results[name]["acq_rel_atomics"] == 1 and results[name]["cg_loads"] > 0, (name, results[name])


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    names = list(VARIANTS) if sys.argv[1] == "all" else [sys.argv[1]]
    print(json.dumps({n: compile_sm90(n) for n in names}))
