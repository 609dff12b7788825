"""The kernels that check index values on the device (ops/_common/varlen_checks.py,
ops/_common/slot_errors.py, the replay commit kernel's report) compile for sm_90 in each of their
variants (no GPU needed: Triton's own compiler and ptxas). The interpreter only runs the branches
a test's values reach, so a branch touching a None pointer, or an int Triton turned into a
constant (a launch passing 1 specialises it), compiles nowhere but here.

The compile runs in a subprocess without ``TRITON_INTERPRET`` (Triton reads it at import)."""
from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name -> (module, kernel, pointer types, constexprs)
VARIANTS = {
    "sanitize-slots": ("fastmamba.ops._common.varlen_checks", "_sanitize_kernel",
                       dict(cu_ptr="*i32", idx_ptr="*i64", safe_ptr="*i32", err_ptr="*i64"),
                       dict(HAS_IDX=True, CU_WHICH=2, IDX_WHICH=1, BLOCK=256)),
    "sanitize-no-slots": ("fastmamba.ops._common.varlen_checks", "_sanitize_kernel",
                          dict(cu_ptr="*i64", safe_ptr="*i32", err_ptr="*i64"),
                          dict(HAS_IDX=False, CU_WHICH=2, IDX_WHICH=1, BLOCK=256, idx_ptr=None, stride_idx=0)),
    "check-slots": ("fastmamba.ops._common.slot_errors", "_check_slots_kernel",
                    dict(idx_ptr="*i32", err_ptr="*i64"), dict(WHICH=1, BLOCK=256)),
    "commit-report-T1-S1": ("fastmamba.ops.replay.commit_kernel", "_commit_kernel",
                            dict(buf_idx_ptr="*i32", accepted_ptr="*i32", hist_ptr="*i32", slots_ptr="*i32",
                                 new_ptr="*i64", err_ptr="*i64"),
                            dict(HAS_SLOTS=True, BLOCK=128, REPORT=True, CHECK_NEW=True, T=1, n_slots=1)),
    # the deferred norm's epilogue (ssd_scan_varlen's norm_weight / norm_sumsq) in both scan paths
    "fused-scan-norm": ("fastmamba.ops.ssd_scan.fused.kernel", "_ssd_scan_fused_kernel",
                        dict(x_ptr="*bf16", dt_ptr="*bf16", A_ptr="*fp32", B_ptr="*bf16", C_ptr="*bf16",
                             D_ptr="*fp32", z_ptr="*bf16", dt_bias_ptr="*fp32", out_ptr="*bf16", states_ptr="*fp32",
                             cu_ptr="*i32", idx_ptr="*i32", init_flag_ptr="*u8", nw_ptr="*bf16", sq_ptr="*fp32",
                             dt_min="fp32", dt_max="fp32"),
                        dict(chunk_out_ptr=None, seed_ptr=None, Q=256, BLOCK_T=32, BLOCK_P=32, BLOCK_N=128,
                             BLOCK_SEG=16, DT_SOFTPLUS=True, HAS_DT_LIMIT=False, A_IS_LOG=True, DOT_PRECISION="tf32",
                             FAST_MATH=True, DOT_UPCAST=False, HAS_IDX=True, HAS_INIT=True, HAS_D=True, HAS_Z=True,
                             HAS_DT_BIAS=True, HAS_CHUNK_OUT=False, STOCHASTIC_ROUND=False, HAS_NORM=True,
                             USE_PDL=True, PDL_TRIGGER=True)),
    "chunk-scan-norm": ("fastmamba.ops.ssd_scan.chunked.kernel", "_chunk_scan_kernel",
                        dict(x_ptr="*bf16", z_ptr="*bf16", out_ptr="*bf16", cb_ptr="*bf16", C_ptr="*bf16",
                             D_ptr="*fp32", table_ptr="*i32", skip_ptr="*i8", states_ptr="*bf16", dt_ptr="*fp32",
                             cs_ptr="*fp32", nw_ptr="*bf16", sq_ptr="*fp32"),
                        dict(Q=256, BLOCK_M=64, BLOCK_K=64, BLOCK_P=64, BLOCK_N=128, HEADS=1, DOT_PRECISION="tf32",
                             HEAD_MAJOR=True, FAST_MATH=True, HAS_D=True, HAS_Z=True, HAS_SKIP=True,
                             DOT_UPCAST=False, HAS_NORM=True, USE_PDL=False, PDL_TRIGGER=True)),
    # the chunk table, dt' / cs and C B^T in one launch (program roles by grid row)
    "chunk-prep": ("fastmamba.ops.ssd_scan.chunked.kernel", "_chunk_prep_kernel",
                   dict(dt_ptr="*fp32", dt_bias_ptr="*fp32", A_ptr="*fp32", cu_ptr="*i32", table_ptr="*i32",
                        dt_out_ptr="*fp32", cs_out_ptr="*fp32", B_ptr="*bf16", C_ptr="*bf16", cb_ptr="*bf16",
                        dt_min="fp32", dt_max="fp32"),
                   dict(Q=256, BLOCK_Q=256, BLOCK_H=8, BLOCK_SEG=16, HAS_DT_BIAS=True, DT_SOFTPLUS=True,
                        HAS_DT_LIMIT=True, A_IS_LOG=False, CB_M=64, CB_N=128, DOT_PRECISION="tf32", DOT_UPCAST=False,
                        USE_PDL=True, PDL_TRIGGER=True)),
    # the Triton chunk-output kernel as the Hopper kernel's fallback on non-finite x (ssd_scan/hopper/chunk_output.py)
    "chunk-scan-only-if-flagged": ("fastmamba.ops.ssd_scan.chunked.kernel", "_chunk_scan_kernel",
                                   dict(x_ptr="*bf16", z_ptr="*bf16", out_ptr="*bf16", cb_ptr="*bf16", C_ptr="*bf16",
                                        D_ptr="*fp32", table_ptr="*i32", skip_ptr="*i8", states_ptr="*bf16",
                                        dt_ptr="*fp32", cs_ptr="*fp32"),
                                   dict(nw_ptr=None, sq_ptr=None, Q=256, BLOCK_M=64, BLOCK_K=64, BLOCK_P=64,
                                        BLOCK_N=128, HEADS=1, DOT_PRECISION="tf32", HEAD_MAJOR=True, FAST_MATH=True,
                                        HAS_D=True, HAS_Z=True, HAS_SKIP=True, DOT_UPCAST=False, HAS_NORM=False,
                                        ONLY_IF_FLAGGED=True, USE_PDL=True, PDL_TRIGGER=True)),
}


def compile_sm90(name: str) -> int:
    """Compile one variant for sm_90; returns the PTX size in bytes."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    module, kernel_name, ptrs, consts = VARIANTS[name]
    kernel = getattr(importlib.import_module(module), kernel_name)
    while not isinstance(kernel, JITFunction):  # @triton.heuristics wraps the JIT function
        kernel = kernel.fn
    names = kernel.arg_names
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    return len(k.asm["ptx"])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_index_check_kernels_compile_for_sm90(name, compiled):
    assert compiled[name] > 0


if __name__ == "__main__":  # argument: a variant's name, or "all" for {name: result}
    sys.path.insert(0, ROOT)
    if sys.argv[1] == "all":
        print(json.dumps({name: compile_sm90(name) for name in VARIANTS}))
    else:
        print(json.dumps(compile_sm90(sys.argv[1])))
