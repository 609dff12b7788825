"""The Hopper chunk-output kernel (ops/ssd_scan/hopper/chunk_output_kernel.py, Gluon) compiles for sm_90 in each of
its variants, and two programs fit one SM's shared memory (no GPU needed: Triton's compiler and ptxas).
The interpreter cannot run Gluon, so on a CPU this is all there is; the GPU tests in
test_hopper_chunk_output.py run it. The compile runs in a subprocess without ``TRITON_INTERPRET``."""
from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SMEM_PER_SM = 227 * 1024  # the most shared memory an sm_90 SM gives its programs

# the launcher's choices (hopper/chunk_output.py) and the flags its inputs can set
BASE = dict(Q=256, N_PIECES=2, CS_STAGES=1, Z_STAGES=1, K_STAGES=3, PRODUCER_REGS=56, HAS_Z=True, HAS_D=True,
            D_PER_P=False, HAS_SKIP=True, HAS_NORM=False, DIAG_SPLIT=True)
VARIANTS = {
    "2.7b-bf16": {},
    "fp16-no-z-no-d-no-skip": dict(dtype="fp16", HAS_Z=False, HAS_D=False, HAS_SKIP=False, DIAG_SPLIT=False),
    "fp16-D-per-channel": dict(dtype="fp16", D_PER_P=True, DIAG_SPLIT=False),
    "deferred-norm": dict(HAS_NORM=True),
    "N64-Q128": dict(N_PIECES=1, Q=128),
    "Q64": dict(Q=64),
}


def compile_sm90(name: str) -> int:
    """Compile one variant for sm_90; returns its shared memory in bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from fastmamba.ops.ssd_scan.hopper import chunk_output as hopper
    from fastmamba.ops.ssd_scan.hopper.chunk_output_kernel import chunk_output_sm90_kernel

    consts = {**BASE, **VARIANTS[name]}
    dtype = consts.pop("dtype", "bf16")
    layout = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16 if dtype == "bf16" else gl.float16)
    sig = {n: f"tensordesc<{dtype}[64, 64],{layout}>" for n in ("c_desc", "s_desc", "z_desc", "cb_desc", "x_desc",
                                                                 "o_desc")}
    ptrs = dict(table_ptr="*i32", skip_ptr="*i8", cs_ptr="*fp32", dt_ptr="*fp32", D_ptr="*fp32",
                out_ptr=f"*{dtype}", nw_ptr=f"*{dtype}", sq_ptr="*fp32")
    for flag, names in (("HAS_SKIP", ["skip_ptr"]), ("HAS_D", ["D_ptr"]), ("HAS_NORM", ["nw_ptr", "sq_ptr"])):
        if not consts[flag]:
            for n in names:
                ptrs.pop(n)
                consts[n] = None
    sig.update(ptrs)
    for n in ("n_items", "n_chunks", "n_seg", "H", "heads_per_group", "G", "q_pad", "stride_o", "stride_D_h",
              "stride_D_p", "stride_sq"):
        sig[n] = "i32"
    src = GluonASTSource(chunk_output_sm90_kernel, {**sig, **{k: "constexpr" for k in consts}}, consts)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=hopper.MAXNREG))
    assert "wgmma.mma_async" in k.asm["ptx"] and "cp.async.bulk.tensor" in k.asm["ptx"]
    return k.metadata.shared


@pytest.mark.parametrize("name", list(VARIANTS))
def test_hopper_kernel_compiles_for_sm90(name, compiled):
    from fastmamba.ops.ssd_scan.hopper.chunk_output import PROGRAMS_PER_SM

    shared = compiled[name]
    assert 0 < shared * PROGRAMS_PER_SM <= SMEM_PER_SM, f"{shared} bytes of shared memory per program"


if __name__ == "__main__":  # argument: a variant's name, or "all" for {name: result}
    sys.path.insert(0, ROOT)
    if sys.argv[1] == "all":
        print(json.dumps({name: compile_sm90(name) for name in VARIANTS}))
    else:
        print(json.dumps(compile_sm90(sys.argv[1])))
