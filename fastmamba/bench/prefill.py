"""Target ``prefill``: the prefill kernels (causal conv, chunked SSD scan) against their peers.

    python -m fastmamba.bench prefill [--ops conv_fn,ssd] [--quick] [--oracle auto|ref|fp32]
                                      [--json PATH] [--markdown PATH] [--device auto|cuda|cpu]

conv_fn: ``causal_conv1d_fn``, width 4, SiLU, conv dims 5376 and 10240, B x L in {1x2048,
1x8192, 8x2048, 8x8192}, channel-first and channel-last x; µs, GB/s and % of the copy bandwidth.
Peers: Dao-AILab causal-conv1d (CUDA), F.conv1d (channel-first only).

ssd: ``mamba_chunk_scan_combined`` (B=1) and ``ssd_scan_varlen`` (8 sequences) on the mamba2-2.7b
(H80 P64 N128 G1) and Nemotron-H (H128 P64 N128 G8) shapes, L in {2048, 8192}, fp32 and bf16
state; µs, TFLOP/s and % of the bf16 matmul rate measured in the same run, and GB/s. Peer:
mamba_ssm's Triton ``mamba_chunk_scan_combined``.

attn: ``varlen_prefill_attention`` (paged, GQA, Nemotron-H's 32 / 8 heads of 128): prompts 1 x 128,
1 x 2048, 1 x 8192, 8 x 1024, and 4 x 512 after 1536 cached tokens each; µs, TFLOP/s, GB/s. Peer:
PyTorch's SDPA on contiguous K/V gathered beforehand.

The runner is the ``kernels`` target's (``fastmamba.bench.kernels.run_suite``): rotating input
sets, CUDA-graph replays (eager, with a note, for a provider that cannot be captured), one check
per provider against the oracle each op module names. Without a GPU: tiny shapes through the
Triton interpreter (TRITON_INTERPRET=1), which checks the plumbing, not the speed.
"""
from __future__ import annotations

import argparse

from fastmamba.bench.kernels import Suite, add_device_arguments, ops_list, run_suite

OPS = {
    "conv_fn": "fastmamba.bench.ops.conv1d_fn",
    "ssd": "fastmamba.bench.ops.ssd_scan",
    "attn": "fastmamba.bench.ops.prefill_attention",  # hybrid models' packed prefill attention
}
PREFILL = Suite("prefill", "fastmamba prefill benchmark", OPS, matmul=True, size_copy=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ops", type=ops_list(OPS), default=list(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    parser.add_argument(
        "--oracle",
        choices=("auto", "ref", "fp32"),
        default="auto",
        help="what each provider is checked against: the op's PyTorch reference (ref; slow loops), the fp32 "
        "definitions in the bench modules (fp32; fast), or auto: ref on the CPU, fp32 on a GPU",
    )
    add_device_arguments(parser, PREFILL.name)


def run(args: argparse.Namespace, command: str) -> int:
    return run_suite(PREFILL, args, command)
