"""When and how the chunked scan's chunk-output stage runs as the Hopper kernel (``chunk_output_kernel.py``).

The choice is automatic: an sm_90 GPU, 16-bit activations, head dim 64, state size 64 or 128, a chunk
of 64, 128 or 256 tokens, token-major rows that TMA can address (inner stride 1, 16-byte aligned
rows and bases), enough tokens that the kernel pays (``MIN_TOKENS``), and, by default, a call inside
``hopper_kernels()``. Our callers open that block where the kernel's host cost is paid once or hides:
the CUDA-graph builders around their warm-up and capture (the runtime's ``GraphedPrefill``, the
benches' graph timing), and the models' eager prefill of at least ``EAGER_MIN_TOKENS`` tokens
(``long_prefill_kernels``), whose layers queue ahead of the GPU. Everything else, direct eager calls
and the CPU interpreter included, runs the portable Triton ``_chunk_scan_kernel``, which stays the
tested reference path.

Why not every eager call: the kernel's six TMA descriptors cost host time on every launch (built,
then encoded by the launcher: ~270-440 vs ~165-320 us per ``mamba_chunk_scan_combined`` call on H200
hosts, with ``_common/launch.lean`` keying the descriptors), more than it saves on the GPU for one
call (~15 us at L=2048, ~45 us at L=8192; `bench prefill --eager`, 2.7b L=8192 bf16, read 424 us
eager with it, 334 us without in an earlier job on another H200 host). A model's prefill hides that
host time behind the GPU work of the layers queued before it (`bench ttft`, 1 x 8192 eager: 90.4-90.7
vs 93.4-94.4 ms). A capture outside the block keeps the Triton kernel: the Hopper kernel's first
launch loads a module, which a capture forbids, so the warm-up before a capture must have taken the
same path.
``FASTMAMBA_HOPPER_SCAN``: ``auto`` (default, as above), ``1`` (every call: the GPU tests), ``0`` (never).

Measured (H200, 2.7b shape, one CUDA graph): the stage 125-129 vs 221-223 us at L=8192 and 37 vs 61-62
us at L=2048 against the Triton kernel (5ba606f; separate jobs of one day); the whole scan 1.53x /
1.57x vLLM's at L=2048 / 8192 (bf16 states, `bench prefill --ops ssd --quick` at d8ec886). The
per-call saving the eager policy above weighed (15 / 45 us) is now ~24 / ~95 us: the policy's host
costs were not re-measured since.
"""
from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch

from fastmamba.ops._common.dispatch import interpreter_enabled
from fastmamba.ops._common.launch import lean, register_descriptor_type
from fastmamba.ops._common.pdl import pdl_chained, sm_count
from fastmamba.ops.ssd_scan.chunked.kernel_common import d_strides

MIN_TOKENS = 1024  # timed from 2048 tokens up; shorter calls keep the Triton kernel (not measured there)
EAGER_MIN_TOKENS = 8192  # the models' eager prefills of this many tokens and more take it (long_prefill_kernels)
PROGRAMS_PER_SM = 2  # two persistent programs per SM (~100 KB of shared memory each)
STAGES = (1, 1, 3)  # ring depths: (C, S) per item, z per item, (C B^T, x) per token block
MAXNREG = 128  # register cap of the consumer warpgroup (the producer warp asks for PRODUCER_REGS)
PRODUCER_REGS = 56


@functools.cache
def _gluon():
    """The kernel module and the host TensorDescriptor class, or None where Gluon does not import."""
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        from fastmamba.ops.ssd_scan.hopper import chunk_output_kernel as hopper_kernel
    except ImportError:  # a Triton without Gluon: the portable kernel runs
        return None
    register_descriptor_type(TensorDescriptor)
    return lean(hopper_kernel.chunk_output_sm90_kernel), TensorDescriptor, gl


@functools.cache
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


_inside = 0  # depth of hopper_kernels() blocks


def long_prefill_kernels(tokens: int) -> contextlib.AbstractContextManager:
    """``hopper_kernels()`` for a model's eager prefill of ``tokens`` packed tokens when there are at
    least ``EAGER_MIN_TOKENS`` (its layers' launches run ahead of the GPU, so the kernel's host cost
    hides), else a block that changes nothing."""
    return hopper_kernels() if tokens >= EAGER_MIN_TOKENS else contextlib.nullcontext()


@contextlib.contextmanager
def hopper_kernels() -> Iterator[None]:
    """Calls inside this block take the Hopper chunk-output kernel where it applies (under the default
    ``FASTMAMBA_HOPPER_SCAN=auto``). Wrap a CUDA graph's warm-up and its capture in one such block: the
    kernel's first launch (compile, module load) must happen in the warm-up."""
    global _inside
    _inside += 1
    try:
        yield
    finally:
        _inside -= 1


def _mode() -> str:
    """FASTMAMBA_HOPPER_SCAN: 'auto' (inside ``hopper_kernels()`` only; the default), 'on' or 'off'."""
    value = os.environ.get("FASTMAMBA_HOPPER_SCAN", "auto").strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value in ("1", "true", "yes", "on"):
        return "on"
    if value in ("0", "false", "no", "off"):
        return "off"
    raise ValueError(f"FASTMAMBA_HOPPER_SCAN expected auto, 1/0, true/false, yes/no or on/off, "
                     f"got {os.environ['FASTMAMBA_HOPPER_SCAN']!r}")


def _tma_rows(t: torch.Tensor) -> bool:
    """Whether a [R, L, K, M] tensor is a 2-d [R * L, K * M] TMA view: inner dims packed, rows flat,
    16-byte aligned base and row stride."""
    R, L, K, M = t.shape
    sr, sl, sk, sm = t.stride()
    return (sm == 1 and sk == M and (R == 1 or sr == L * sl) and (sl * t.element_size()) % 16 == 0
            and t.data_ptr() % 16 == 0)


def hopper_chunk_output_ok(x: torch.Tensor, z: torch.Tensor | None, out: torch.Tensor, C: torch.Tensor,
                           chunk_size: int) -> bool:
    """Whether ``chunk_output_sm90`` covers this call (x, z, out [R, L, H, P]; C [R, L, G, N])."""
    if not x.is_cuda or interpreter_enabled():
        return False
    mode = _mode()
    tokens = x.shape[0] * x.shape[1]
    if mode == "off" or x.dtype not in (torch.bfloat16, torch.float16) or tokens < MIN_TOKENS:
        return False
    if mode == "auto" and not _inside:
        return False
    if not _sm90(x.device.index if x.device.index is not None else torch.cuda.current_device()):
        return False
    if x.shape[3] != 64 or C.shape[3] not in (64, 128) or chunk_size not in (64, 128, 256):
        return False
    tensors = (x, out, C) if z is None else (x, out, C, z)
    if any(t.dtype != x.dtype or not _tma_rows(t) for t in tensors):
        return False
    return _gluon() is not None


@functools.cache
def _layout(gl, dtype: torch.dtype, block: tuple[int, int]):
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def _desc(TensorDescriptor, gl, t2d: torch.Tensor, block: tuple[int, int], layout=None):
    """A host TMA descriptor of the 2-d view t2d (``layout``: its shared-memory layout, default the
    16-bit NVMMA one of ``_layout``). Built without the dataclass's ``__post_init__``
    (its per-field assertions cost a few us a descriptor on the GPU hosts): ``hopper_chunk_output_ok`` has checked the
    caller's tensors (``_tma_rows``) and the launcher's scratch is allocated contiguous and aligned."""
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(base=t2d, shape=list(t2d.shape), strides=list(t2d.stride()), block_shape=list(block),
                         layout=_layout(gl, t2d.dtype, block) if layout is None else layout, padding="zero")
    return desc


def _rows2d(t: torch.Tensor) -> torch.Tensor:
    """[R, L, K, M] (checked by _tma_rows) -> the [R * L, K * M] view with the same row stride."""
    R, L, K, M = t.shape
    return t.as_strided((R * L, K * M), (t.stride(1), 1))


def chunk_output_sm90(x, z, out, cb, C, D, table, skip, states_in, dt_scratch, cs_scratch, norm_weight,
                      norm_sumsq, *, n_seg: int, chunk_size: int) -> None:
    """The chunk-output stage on the Hopper kernel; arguments as ``_chunk_scan_kernel`` gets them:
    x, z, out [R, L, H, P]; cb [chunks, G, q_pad, q_pad]; C [R, L, G, N]; D [H] or [H, P] or None;
    table [chunks, 4] int32; skip [n_seg] int8 or None; states_in [chunks, H, P, N] (x's dtype);
    dt / cs scratch [H, chunks, Q] fp32; norm_weight [H * P] and norm_sumsq [R * L, H * P / 16] or None.
    The chunk-state kernel sets table[0, 3] when x holds a non-finite value: the caller then runs the
    Triton kernel with ONLY_IF_FLAGGED after this one (``launch.py``)."""
    kernel, TensorDescriptor, gl = _gluon()
    R, L, H, P = x.shape
    G, N = C.shape[2], C.shape[3]
    n_chunks, q_pad = cb.shape[0], cb.shape[-1]
    bm = 64
    descs = [
        _desc(TensorDescriptor, gl, _rows2d(C), (bm, 64)),
        _desc(TensorDescriptor, gl, states_in.view(n_chunks * H * P, N), (bm, 64)),
        _desc(TensorDescriptor, gl, _rows2d(z if z is not None else x), (bm, bm)),
        _desc(TensorDescriptor, gl, cb.view(n_chunks * G * q_pad, q_pad), (bm, bm)),
        _desc(TensorDescriptor, gl, _rows2d(x), (bm, bm)),
        _desc(TensorDescriptor, gl, _rows2d(out), (bm, bm)),
    ]
    m_blocks = chunk_size // bm
    n_items = H * n_chunks * m_blocks
    # a multiple of m_blocks: the kernel turns each program's row block with its wave (hopper_kernel._item)
    programs = min(n_items, sm_count(x) * PROGRAMS_PER_SM)
    grid = (max(m_blocks, programs - programs % m_blocks),)
    cs_stages, z_stages, k_stages = STAGES
    # one wave of persistent programs (4 + 4 warps: the producer's group), after the state passing
    use_pdl = pdl_chained(x, grid[0], 8)
    kernel[grid](
        *descs, table, skip, cs_scratch, dt_scratch, D, out, norm_weight, norm_sumsq,
        n_items, n_chunks, n_seg, H, H // G, G, q_pad, out.stride(1), *d_strides(D),
        norm_sumsq.stride(0) if norm_sumsq is not None else 0,
        Q=chunk_size, N_PIECES=N // 64, CS_STAGES=cs_stages, Z_STAGES=z_stages, K_STAGES=k_stages,
        PRODUCER_REGS=PRODUCER_REGS, HAS_Z=z is not None, HAS_D=D is not None, D_PER_P=D is not None and D.dim() == 2,
        HAS_SKIP=skip is not None, HAS_NORM=norm_sumsq is not None, DIAG_SPLIT=x.dtype == torch.bfloat16,
        USE_PDL=use_pdl, launch_pdl=use_pdl, num_warps=4, maxnreg=MAXNREG,
    )
