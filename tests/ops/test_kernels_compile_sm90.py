"""The kernels that check index values on the device (ops/_common/varlen_checks.py,
ops/_common/slot_errors.py, the replay commit kernel's report) compile for sm_90 in each of their
variants (no GPU needed: Triton's own compiler and ptxas). The interpreter only runs the branches
a test's values reach, so a branch touching a None pointer, or an int Triton turned into a
constant (a launch passing 1 specialises it), compiles nowhere but here.

The compile runs in a subprocess without ``TRITON_INTERPRET`` (Triton reads it at import)."""
from __future__ import annotations

import json
import os
import subprocess
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
    "commit-report-T1-S1": ("fastmamba.ops.replay.kernel", "_commit_kernel",
                            dict(buf_idx_ptr="*i32", accepted_ptr="*i32", hist_ptr="*i32", slots_ptr="*i32",
                                 new_ptr="*i64", err_ptr="*i64"),
                            dict(HAS_SLOTS=True, BLOCK=128, REPORT=True, CHECK_NEW=True, T=1, n_slots=1)),
}


def compile_sm90(name: str) -> int:
    """Compile one variant for sm_90; returns the PTX size in bytes."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, kernel_name, ptrs, consts = VARIANTS[name]
    kernel = getattr(importlib.import_module(module), kernel_name)
    names = kernel.arg_names
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    return len(k.asm["ptx"])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_index_check_kernels_compile_for_sm90(name):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__, name], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        if "ptxas" in done.stderr and ("not found" in done.stderr or "No such file" in done.stderr):
            pytest.skip("Triton's NVIDIA backend has no ptxas here")
        raise AssertionError(f"sm_90 compile failed:\n{done.stderr[-3000:]}")
    assert json.loads(done.stdout.splitlines()[-1]) > 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    print(json.dumps(compile_sm90(sys.argv[1])))
