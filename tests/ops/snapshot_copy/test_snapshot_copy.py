"""copy_snapshots (fastmamba/ops/snapshot_copy): a layer's prefix-cache snapshots into its pools,
by the Triton kernel (CPU: the interpreter) against the torch indexing it replaces (copy_snapshots_ref),
and the kernel's sm_90 compile (the interpreter does not type-check both branches of an ``if``)."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from fastmamba.ops.snapshot_copy import copy_snapshots
from fastmamba.ops.snapshot_copy import kernel as snapshot_copy_kernel
from fastmamba.ops.snapshot_copy.ref import copy_snapshots_ref


@pytest.fixture
def launches(monkeypatch):
    """Counts the kernel's launches (they still run)."""
    from tests.helpers import count_launches

    return count_launches(monkeypatch, snapshot_copy_kernel)


def _case(device, *, R, E, W, hpn, T, C, rows, chunk_rows, pool_dtype, x_dtype, seed):
    from tests.helpers import seeded  # not at the top: __main__ runs without tests/ on the path

    g = seeded(seed)
    wide = torch.randn(T, E + 9, generator=g).to(device, x_dtype)
    xbc = wide[:, 3:3 + E]  # a column view of a wider buffer, as in_proj's output gives it
    chunk_states = torch.randn(C, *hpn, generator=g).to(device)
    conv = torch.full((R, E, W), float("nan"), device=device, dtype=pool_dtype)
    ssm = torch.full((R, *hpn), float("nan"), device=device, dtype=pool_dtype)
    n = len(rows)
    tokens = torch.randint(0, T, (n, W), generator=g).to(device)
    idx = dict(rows=torch.tensor(rows, device=device), conv_tokens=tokens,
               chunk_rows=torch.tensor(chunk_rows, device=device))
    return conv, ssm, xbc, chunk_states, idx


@pytest.mark.parametrize("pool_dtype,x_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.float32, torch.bfloat16)])
def test_copy_snapshots_matches_torch(device, pool_dtype, x_dtype, launches):
    """Odd sizes (an SSM row of 3*5*7 = 105 elements; 4101 > one block; 37 and 300 conv channels, a
    partial block and more than one; W 4 and 3), one snapshot, a repeated row (a graph's padding), casts
    into the pools' dtype; rows not named keep their NaN poison."""
    cases = [dict(R=5, E=37, W=4, hpn=(3, 5, 7), T=20, C=6, rows=[3], chunk_rows=[4]),
             dict(R=6, E=300, W=3, hpn=(4101,), T=33, C=4, rows=[0, 5, 2, 0], chunk_rows=[1, 3, 0, 1])]
    for k, shape in enumerate(cases):
        conv, ssm, xbc, cs, idx = _case(device, **shape, pool_dtype=pool_dtype, x_dtype=x_dtype, seed=10 * k)
        if shape["rows"] == [0, 5, 2, 0]:  # a repeated row repeats its source too
            idx["conv_tokens"][3] = idx["conv_tokens"][0]
        want_conv, want_ssm = conv.clone(), ssm.clone()
        copy_snapshots_ref(want_conv, want_ssm, idx["rows"], xbc, idx["conv_tokens"], cs, idx["chunk_rows"])
        before = launches[0]
        copy_snapshots(conv, ssm, idx["rows"], xbc, idx["conv_tokens"], cs, idx["chunk_rows"])
        assert launches[0] == before + 1, "the kernel did not run"
        assert torch.allclose(conv, want_conv, equal_nan=True, rtol=0, atol=0)
        # an fp32 state into a 16-bit pool: GPUs round to nearest as torch does; Triton 3.6's interpreter
        # truncates, one 16-bit step at most
        rtol = 2 ** -7 if device.type == "cpu" and pool_dtype != torch.float32 else 0
        assert torch.allclose(ssm, want_ssm, equal_nan=True, rtol=rtol, atol=0)
        written = sorted(set(shape["rows"]))
        assert torch.isfinite(ssm[written]).all() and torch.isfinite(conv[written]).all()
        untouched = [r for r in range(shape["R"]) if r not in written]
        assert torch.isnan(ssm[untouched]).all() and torch.isnan(conv[untouched]).all()


def test_rows_the_kernel_cannot_take_go_through_torch(device, launches):
    """An SSM pool whose rows are not one contiguous run: the torch indexing, no launch; none at all
    without snapshots."""
    conv, ssm, xbc, cs, idx = _case(device, R=4, E=8, W=4, hpn=(2, 3, 8), T=10, C=3, rows=[1, 2], chunk_rows=[0, 2],
                                    pool_dtype=torch.float32, x_dtype=torch.float32, seed=5)
    strided = torch.full((4, 2, 3, 16), float("nan"), device=device)[..., ::2]
    want_conv, want_ssm = conv.clone(), strided.clone()
    copy_snapshots_ref(want_conv, want_ssm, idx["rows"], xbc, idx["conv_tokens"], cs, idx["chunk_rows"])
    copy_snapshots(conv, strided, idx["rows"], xbc, idx["conv_tokens"], cs, idx["chunk_rows"])
    assert launches[0] == 0
    assert torch.allclose(strided, want_ssm, equal_nan=True) and torch.allclose(conv, want_conv, equal_nan=True)
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    copy_snapshots(conv, ssm, empty, xbc, empty.view(0, 4), cs, empty)
    assert launches[0] == 0


def compile_sm90(name: str) -> dict:
    """Compile the kernel for sm_90 (pools' dtype - xbc's dtype, under PDL); its PTX line count."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fastmamba.ops.snapshot_copy.kernel import BLOCK, BLOCK_E, _snapshot_copy_kernel

    pool, x = name.split("-")
    sig = dict(conv_ptr=f"*{pool}", ssm_ptr=f"*{pool}", rows_ptr="*i64", xbc_ptr=f"*{x}", tok_ptr="*i64",
               cs_ptr="*fp32", crow_ptr="*i64")
    for n in ("E", "W", "HPN", "n_ssm_blocks", "stride_conv_r", "stride_conv_e", "stride_conv_w", "stride_ssm_r",
              "stride_xbc_t", "stride_xbc_e", "stride_tok_i", "stride_tok_j", "stride_cs_c"):
        sig[n] = "i32"
    consts = dict(BLOCK=BLOCK, BLOCK_E=BLOCK_E, BLOCK_W=4, USE_PDL=True, PDL_TRIGGER=True)
    src = ASTSource(_snapshot_copy_kernel, {**sig, **{k: "constexpr" for k in consts}}, consts)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    return dict(ptx_lines=len(k.asm["ptx"].splitlines()))


COMPILE_VARIANTS = ["fp32-bf16", "bf16-bf16", "fp32-fp32"]


@pytest.mark.parametrize("name", COMPILE_VARIANTS)
def test_kernel_compiles_for_sm90(name, compiled):
    assert compiled[name]["ptx_lines"] > 0


if __name__ == "__main__":  # argument: a variant's name, or "all" for {name: result}
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
    if sys.argv[1] == "all":
        print(json.dumps({name: compile_sm90(name) for name in COMPILE_VARIANTS}))
    else:
        print(json.dumps(compile_sm90(sys.argv[1])))
