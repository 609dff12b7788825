"""The Hopper chunk-states kernel (ops/ssd_scan/hopper/states_kernel.py, Gluon) compiles for sm_90 in each
of its variants without spilling, and two programs fit one SM's shared memory (no GPU needed: Triton's
compiler and ptxas, in a subprocess without ``TRITON_INTERPRET``). The GPU tests in
test_hopper_states.py run it."""
from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SMEM_PER_SM = 227 * 1024
PROGRAMS_PER_SM = 2  # what hopper_states.MAXNREG is chosen for: 2 x 8 warps x 128 registers

FLAGS = ("HAS_SKIP", "HAS_INIT", "HAS_FINAL", "HAS_SEG_FINAL")
VARIANTS = {
    "bf16-Q256-all": dict(),
    "bf16-Q256-none": dict(off=FLAGS),
    "fp16-Q64-final-only": dict(dtype="fp16", Q=64, off=("HAS_SKIP", "HAS_INIT", "HAS_SEG_FINAL")),
    "bf16-Q128-int64-cu": dict(Q=128, cu="*i64", off=("HAS_SEG_FINAL",)),
    "bf16-Q256-chunk-out-fp32": dict(chunk_out="fp32"),  # the prefix cache's states after every chunk
    "fp16-Q256-chunk-out-fp16": dict(dtype="fp16", chunk_out="fp16", off=("HAS_SEG_FINAL",)),
}


def compile_sm90(name: str) -> dict:
    """Compile one variant for sm_90: its shared memory in bytes and ptxas's spill report."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from fastmamba.ops.ssd_scan.hopper import states as hopper_states
    from tests.helpers import ptxas_report, spill_lines
    from fastmamba.ops.ssd_scan.hopper.states_kernel import chunk_states_sm90_kernel

    v = VARIANTS[name]
    dtype = v.get("dtype", "bf16")
    layout = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16 if dtype == "bf16" else gl.float16)
    sig = {n: f"tensordesc<{dtype}[64, 64],{layout}>" for n in ("x_desc", "b_desc", "si_desc")}
    consts = dict(Q=v.get("Q", 256), BLOCK_SEG=16, K_STAGES=hopper_states.STAGES,
                  PRODUCER_REGS=hopper_states.PRODUCER_REGS, USE_PDL=True,
                  **{f: f not in v.get("off", ()) for f in FLAGS})
    co = v.get("chunk_out")
    consts["HAS_CHUNK_OUT"] = co is not None
    if co is None:
        consts["co_desc"] = None
    else:  # as hopper_states._chunk_out_desc builds it: unswizzled
        co_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32 if co == "fp32" else 16)
        sig["co_desc"] = f"tensordesc<{co}[64, 64],{co_layout}>"
    ptrs = dict(cu_ptr=v.get("cu", "*i32"), skip_ptr="*i8", cs_ptr="*fp32", dt_ptr="*fp32", table_ptr="*i32",
                init_ptr="*fp32", init_idx_ptr="*i32", final_ptr=f"*{dtype}", final_idx_ptr="*i32",
                seg_final_ptr="*fp32")
    for flag, names in (("HAS_SKIP", ["skip_ptr"]), ("HAS_INIT", ["init_ptr", "init_idx_ptr"]),
                        ("HAS_FINAL", ["final_ptr", "final_idx_ptr"]), ("HAS_SEG_FINAL", ["seg_final_ptr"])):
        if not consts[flag]:
            for n in names:
                ptrs.pop(n)
                consts[n] = None
    sig.update(ptrs)
    for n in ("n_seg", "H", "heads_per_group", "N", "n_chunk_slots",
              *(f"stride_{a}_{b}" for a in ("init", "final", "sf") for b in "shpn")):
        sig[n] = "i32"
    src = GluonASTSource(chunk_states_sm90_kernel, {**sig, **{k: "constexpr" for k in consts}}, consts)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4, maxnreg=hopper_states.MAXNREG))
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    spills = spill_lines(ptxas_report(ptx, "hopper_states"))
    return dict(shared=k.metadata.shared, warps=k.metadata.num_warps, spills=spills)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_hopper_states_kernel_compiles_for_sm90(name, compiled):
    got = compiled[name]
    assert 0 < got["shared"] * PROGRAMS_PER_SM <= SMEM_PER_SM, f"{got['shared']} bytes of shared memory per program"
    assert got["warps"] * 32 * 128 * PROGRAMS_PER_SM <= 64 * 1024, "two programs' registers do not fit an SM"
    assert got["spills"] and all(" 0 bytes spill stores" in s for s in got["spills"]), got["spills"]


if __name__ == "__main__":  # argument: a variant's name, or "all" for {name: result}
    sys.path.insert(0, ROOT)
    if sys.argv[1] == "all":
        print(json.dumps({name: compile_sm90(name) for name in VARIANTS}))
    else:
        print(json.dumps(compile_sm90(sys.argv[1])))
