"""The "copy" rows: a plain copy kernel that moves as many bytes as the case's model.

The '% copy' column compares every kernel with a 2 GiB copy, the steady streaming rate of the
GPU. A decode kernel moving 20 MB cannot reach it: launch, the first loads' latency and the last
stores' drain are a fixed cost that a 2 GiB copy spreads thin. So each case of the ``kernels``
and ``prefill`` targets also times a copy of half its byte model (read half, write half) with
the same method (CUDA graph, rotating buffers, cold L2), and every one of our rows gets
'% size copy' = copy time / our time: how close the kernel comes to a copy of the same size.

The copy is a Triton kernel (16 KB per program, 16-byte vectors), not ``dst.copy_(src)``: inside
a CUDA graph torch's device-to-device copy becomes a memcpy node, which ran at only 65% of the
2 GiB copy's rate even at 1.3 GB on an H200 (2026-11-23), so it would be no bound at all.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from fastmamba.bench import report
from fastmamba.bench.ops._base import Provider
from fastmamba.bench.timing import MakeCall
from fastmamba.ops.runtime import cdiv

NAME = "copy"
PDL = "+pdl"  # the suffix of the PDL rows (ours: fastmamba+pdl)
KIND = "copy"  # neither ours, a peer nor the reference: never checked, never a 'vs' baseline
HEADER_NOTE = (
    "'% size copy' (our rows) = the time of the case's 'copy' row / ours: a Triton copy kernel moving the same "
    "bytes (half read, half written), same timing; for our PDL rows the faster of 'copy' and 'copy+pdl' (the "
    "copy launched with PDL); 100% = as fast as a plain copy of that size, whose fixed launch and drain cost "
    "a 2 GiB copy ('% copy') spreads thin"
)
BLOCK_WORDS = 4096  # 4-byte words per program (16 KB)
WARPS = 8  # 16 words per thread: four 16-byte vectors


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # as our PDL kernels: wait for the previous kernel, then let the next one launch
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def copy_words(src: torch.Tensor, dst: torch.Tensor, pdl: bool = False) -> None:
    """dst[:] = src[:] for 1-d int32 tensors of one length (the copy row's kernel); ``pdl``: a
    programmatic dependent launch (GPU, sm_90+)."""
    n = src.numel()
    _copy_kernel[(cdiv(n, BLOCK_WORDS),)](src, dst, n, BLOCK=BLOCK_WORDS, USE_PDL=pdl, num_warps=WARPS,
                                                  **({"launch_pdl": True} if pdl else {}))


def copy_providers(device: torch.device) -> list[Provider]:
    """The copy rows' providers, plain and (sm_90+) with PDL; CUDA only: on the CPU the timings
    are no speed anyway."""
    if device.type != "cuda":
        return [Provider(NAME, KIND, triton.__version__, None, reason="GPU only")]
    note = "a Triton copy kernel of the case's bytes (half read, half written), same timing"
    provs = [Provider(NAME, KIND, triton.__version__, _unused, note=note)]
    if torch.cuda.get_device_capability(device)[0] >= 9:
        provs.append(Provider(NAME + PDL, KIND, triton.__version__, _unused, note=note + ", launched with PDL"))
    return provs


def _unused(*args: object) -> None:
    raise RuntimeError("the copy provider is bound through copy_calls, not called with the op's arguments")


def copy_calls(nbytes: int, n_sets: int, device: torch.device, pdl: bool = False) -> MakeCall:
    """``make_call(i)``: a call that copies set i's source into its destination, nbytes // 2 each
    rounded up to whole 4-byte words; ``n_sets`` distinct buffer pairs, as the op's rotating
    input sets."""
    words = max(1, -(-(nbytes // 2) // 4))
    pairs = []
    for _ in range(max(1, n_sets)):
        src = torch.ones(words, dtype=torch.int32, device=device)
        pairs.append((src, torch.zeros_like(src)))

    def make_call(i: int):
        src, dst = pairs[i % len(pairs)]
        return lambda: copy_words(src, dst, pdl)

    make_call.pairs = pairs  # (src, dst) per set, for the tests
    return make_call


def fill_size_copy(rows: list[report.Row]) -> None:
    """On every timed row of ours: ``pct_size_copy`` = the case's copy time / its time, x 100 (a
    PDL row of ours: the faster of the plain and the PDL copy)."""
    plain: dict[int, float] = {}
    fastest: dict[int, float] = {}
    for r in rows:
        if r.kind == KIND and r.status == "ok" and r.median_us and r.mode != "cpu":
            if r.provider == NAME:
                plain[r.case_id] = r.median_us
            fastest[r.case_id] = min(fastest.get(r.case_id, r.median_us), r.median_us)
    for r in rows:
        if r.kind != "ours" or r.status != "ok" or not r.median_us or r.mode == "cpu":
            continue
        copy_us = (fastest if r.provider.endswith(PDL) else plain).get(r.case_id)
        if copy_us:
            r.pct_size_copy = 100.0 * copy_us / r.median_us
