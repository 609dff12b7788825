"""Lean Triton launches (ops/_common/launch.py, issue 19 item 0): after the first call of a signature
the compiled kernel's launcher is called directly. The signature must hold everything Triton
specializes on, or the direct call would run a kernel compiled for other arguments."""
from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl

from fastmamba.ops._common.launch import lean, signature, trailing_params


def test_signature_keys_what_triton_specializes_on():
    t = torch.zeros(8)
    key = signature((t, t[1:], 1, 2, 32, True, 1.0, None, "tf32"))
    assert key[0] == (torch.float32, t.data_ptr() & 15)
    assert key[1] == (torch.float32, (t.data_ptr() + 4) & 15)  # a 4-byte offset is another kernel
    assert key[0] != key[1]
    assert key[2:5] == (1, 2, 32)  # ints by value (== 1 and % 16 are specializations)
    assert key[5] == (bool,) and key[6] == (float,)  # u1 / fp32 whatever the value; typed apart from 1
    assert key[7] is None and key[8] == (str, "tf32")
    assert signature((t.to(torch.bfloat16),)) != signature((t,))  # the dtype is part of the key
    p = torch.nn.Parameter(torch.zeros(8))
    assert signature((p,)) == ((torch.float32, p.data_ptr() & 15),)  # a weight keys as a tensor


def test_signature_keys_unspecialized_ints_by_width_only():
    short = signature((5, 7), unspecialized=(0,))
    other = signature((900, 7), unspecialized=(0,))
    wide = signature((2**40, 7), unspecialized=(0,))
    assert short == other  # a new length is not a new signature
    assert wide != short  # i64 is another kernel


def test_signature_refuses_unhashable_arguments():
    from triton.tools.tensor_descriptor import TensorDescriptor

    desc = TensorDescriptor.from_tensor(torch.zeros(16, 16), [16, 16])
    with pytest.raises(TypeError):  # such a launch goes through Triton's path
        hash(signature((torch.zeros(2), desc)))


def test_switch_reads_its_variable_strictly(monkeypatch):
    from fastmamba.ops._common.launch import env_switch

    monkeypatch.delenv("FASTMAMBA_TEST_SWITCH", raising=False)
    assert env_switch("FASTMAMBA_TEST_SWITCH", True) is True
    for value, want in (("0", False), ("off", False), ("YES", True), ("1", True)):
        monkeypatch.setenv("FASTMAMBA_TEST_SWITCH", value)
        assert env_switch("FASTMAMBA_TEST_SWITCH", True) is want
    monkeypatch.setenv("FASTMAMBA_TEST_SWITCH", "maybe")
    with pytest.raises(ValueError, match="FASTMAMBA_TEST_SWITCH expected 1/0.*'maybe'"):
        env_switch("FASTMAMBA_TEST_SWITCH", True)


def test_trailing_params_fills_keywords_then_defaults():
    P = inspect.Parameter
    fn = SimpleNamespace(__name__="k", params=[SimpleNamespace(name=n, default=d) for n, d in
                                                [("x", P.empty), ("n", P.empty), ("BLOCK", P.empty),
                                                 ("FLAG", False)]])
    assert trailing_params(fn, 2, {"BLOCK": 64, "num_warps": 4}) == (64, False)
    with pytest.raises(TypeError, match="missing argument `BLOCK`"):
        trailing_params(fn, 2, {})


def test_interpreter_and_spies_pass_through():
    class Spy:
        def __getitem__(self, grid):
            return lambda *a, **kw: ("spy", grid)

    spy = Spy()
    k = lean(spy)
    assert k[(2,)](1, 2) == ("spy", (2,))
    assert not k.direct and lean(spy) is k  # kept per function


@triton.jit(do_not_specialize=["n"])
def _axpb_kernel(x_ptr, y_ptr, n, a, b, stride, BLOCK: tl.constexpr, ADD_ONE: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs * stride, mask=mask)
    y = x * a + b
    if ADD_ONE:
        y += 1.0
    tl.store(y_ptr + offs, y, mask=mask)


def _direct(kernel, device):
    """``lean(kernel)``, or a skip where the direct path cannot run (no GPU, or the interpreter)."""
    if device.type != "cuda":
        pytest.skip("needs a CUDA GPU: the direct path calls the compiled kernel's launcher")
    k = lean(kernel)
    if not k.direct:
        pytest.skip("TRITON_INTERPRET is set: Triton's interpreter has no compiled kernels")
    return k


def _ref(x, a, b, stride, n, add_one=False):
    return x[: n * stride: stride][:n] * a + b + (1.0 if add_one else 0.0)


@pytest.mark.gpu
def test_gpu_direct_launches_match_the_jit(device):
    k = _direct(_axpb_kernel, device)
    k.entries.clear()
    g = torch.Generator(device="cpu").manual_seed(0)
    base = torch.randn(4096, generator=g).to(device)

    def call(x, n, a, b, stride, **kw):
        y = torch.full((n,), float("nan"), device=device)
        k[(triton.cdiv(n, 128),)](x, y, n, a, b, stride, BLOCK=128, **kw)
        return y

    for n in (1000, 37, 1000, 513):  # one signature: n is not specialized
        torch.testing.assert_close(call(base, n, 2.0, 0.5, 1), _ref(base, 2.0, 0.5, 1, n))
    assert len(k.entries) == 1
    # a 4-byte-aligned view: Triton's aligned kernel must not run on it
    torch.testing.assert_close(call(base[1:], 999, 2.0, 0.5, 1), _ref(base[1:], 2.0, 0.5, 1, 999))
    # stride 1 is a constexpr in the JIT's kernel; stride 2 is another one
    torch.testing.assert_close(call(base, 1000, 2.0, 0.5, 2), _ref(base, 2.0, 0.5, 2, 1000))
    torch.testing.assert_close(call(base, 1000, 2.0, 0.5, 1, ADD_ONE=True), _ref(base, 2.0, 0.5, 1, 1000, True))
    assert len(k.entries) == 4
    # repeats of every signature take the direct path and still match
    for _ in range(2):
        torch.testing.assert_close(call(base[1:], 999, -1.0, 0.0, 1), _ref(base[1:], -1.0, 0.0, 1, 999))
        torch.testing.assert_close(call(base, 1000, 2.0, 0.5, 2), _ref(base, 2.0, 0.5, 2, 1000))
    assert len(k.entries) == 4


@pytest.mark.gpu
def test_gpu_direct_launches_capture_in_cuda_graphs_and_respect_hooks(device):
    k = _direct(_axpb_kernel, device)
    x = torch.randn(300, device=device)
    y = torch.empty(300, device=device)
    args = (x, y, 300, 3.0, 1.0, 1)
    k[(3,)](*args, BLOCK=128)  # the JIT's call: compiles, keeps the entry
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        k[(3,)](*args, BLOCK=128)  # the direct call, recorded
    x.copy_(torch.arange(300, device=device, dtype=torch.float32))
    y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, x * 3.0 + 1.0)
    # a launch hook (a profiler) sees every launch: the direct path steps aside
    seen = []
    hook = lambda meta: seen.append(meta)  # noqa: E731
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        k[(3,)](*args, BLOCK=128)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) == 1


@pytest.mark.gpu
def test_gpu_ops_take_the_direct_path(device):
    """A repeated eager op call launches from the kept entry (the decode step's ops)."""
    from fastmamba.ops import selective_state_update
    from fastmamba.ops.state_update.kernel import _selective_state_update_kernel
    from fastmamba.ops.state_update.ref import selective_state_update_ref

    k = _direct(_selective_state_update_kernel, device)
    k.entries.clear()
    direct_launches = []
    H, P, N, S = 3, 16, 16, 5
    g = torch.Generator(device="cpu").manual_seed(1)
    state = torch.randn(S, H, P, N, generator=g).to(device)
    want_state = state.clone()
    for step in range(3):
        if step == 1:  # the first call kept the entry: count the launches made from it
            (entry,) = k.entries.values()
            launch = entry.launch
            entry.launch = lambda *a: (direct_launches.append(1), launch(*a))
        x = torch.randn(2, H, P, generator=g).to(device)
        dt = torch.rand(2, H, P, generator=g).to(device)
        A = -torch.rand(H, P, N, generator=g).to(device)
        B = torch.randn(2, 1, N, generator=g).to(device)
        C = torch.randn(2, 1, N, generator=g).to(device)
        idx = torch.tensor([3, 0], dtype=torch.int32, device=device)
        got = selective_state_update(state, x, dt, A, B, C, state_batch_indices=idx)
        want = selective_state_update_ref(want_state, x, dt, A, B, C, state_batch_indices=idx)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(state, want_state, atol=1e-4, rtol=1e-4)
    assert len(direct_launches) == 2  # the two later calls launched from the kept entry


def test_signature_keys_registered_tma_descriptors():
    """A registered descriptor class (the Hopper scan's Gluon TensorDescriptor) is keyed by dtype, block
    shape, layout and base alignment, not refused: its kernels launch directly after the first call."""
    hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from triton.experimental.gluon import language as gl

    from fastmamba.ops._common.launch import register_descriptor_type

    register_descriptor_type(hopper.TensorDescriptor)

    def desc(dtype, block=(64, 64)):
        t = torch.zeros(128, 64, dtype=dtype)
        gl_dtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
        layout = gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)
        return hopper.TensorDescriptor(t, [128, 64], [64, 1], list(block), layout)

    key = signature((desc(torch.bfloat16), 3))
    hash(key)
    assert key == signature((desc(torch.bfloat16), 3))  # another tensor, same shape and type
    assert key != signature((desc(torch.float16), 3))
    assert key != signature((desc(torch.bfloat16, (32, 64)), 3))
