"""The kernels one decode step launches, counted on the CPU (``bench profile launches``).

    TRITON_INTERPRET=1 python -m fastmamba.bench profile launches [--model nemotron-3-tiny] [--batch 1]
                                                                  [--context 8] [--timeline N]

One eager greedy decode step of a small model on the CPU, under the Triton interpreter: every Triton
launch (by kernel name) and every ATen op outside them that would be a device kernel on a GPU (views,
allocations and metadata left out), each with the package line that issued it. A tiny preset has the
full-size model's layer kinds, so the kernels per layer are the GPU step's (the graph replays the same
launches); what this cannot show is their time (``profile decode`` on a GPU). It found the ~20 PyTorch
kernels of the old K/V page write (docs/experiments/moe.md).
"""
from __future__ import annotations

import argparse
import collections
import sys
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ATen ops that launch no device kernel (views, allocations, metadata)
NO_KERNEL = frozenset({
    "empty", "empty_strided", "empty_like", "view", "_unsafe_view", "reshape", "slice", "as_strided", "alias",
    "detach", "detach_", "t", "transpose", "expand", "select", "unsqueeze", "squeeze", "permute", "split",
    "split_with_sizes", "unbind", "narrow", "lift_fresh", "resolve_conj", "resolve_neg", "_local_scalar_dense",
})


def _where() -> str:
    """The innermost package frame outside ``ops/_common`` and this module: 'layers/attention.py:178'."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename.replace("\\", "/")
        if "/fastmamba/" in path and "/ops/_common/" not in path and not path.endswith("bench/launches.py"):
            return f"{path.split('/fastmamba/')[-1]}:{frame.lineno}"
    return "?"


class _Recorder(TorchDispatchMode):
    """Records ("aten", op, where) for the ATen ops dispatched outside Triton launches (``inside`` > 0
    while ``decode_step_launches``'s wrapper of the interpreter's launch runs one)."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[str, str, str]] = []
        self.inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        # (our registered ops, namespace "fastmamba", only wrap the Triton launches counted below);
        # a `to` that returns its input (already that dtype and device) launches nothing
        if (not self.inside and func.namespace == "aten" and name not in NO_KERNEL
                and not (name == "to" and args and out is args[0])):
            self.events.append(("aten", name, _where()))
        return out


def decode_step_launches(model, batch: int, context: int) -> list[tuple[str, str, str]]:
    """The (kind, name, where) of every launch of one greedy decode step of ``batch`` requests after a
    ``context``-token prefill, in order (CPU model, TRITON_INTERPRET=1)."""
    from triton.runtime.interpreter import InterpretedFunction

    paged = getattr(model.cfg, "paged_cache", False)
    cache = model.new_cache(batch, max_seq_len=context + 8) if paged else model.new_cache(batch)
    slots = cache.alloc(batch)
    prompts = torch.randint(0, model.cfg.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0))
    tokens = model.prefill(prompts, cache, slots).argmax(-1)
    if paged:
        cache.grow(slots.tolist(), [1] * batch)
    rec = _Recorder()
    real = InterpretedFunction.run

    def run(self, *args, **kwargs):
        rec.events.append(("triton", self.fn.__name__, _where()))
        rec.inside += 1
        try:
            return real(self, *args, **kwargs)
        finally:
            rec.inside -= 1

    InterpretedFunction.run = run
    try:
        with rec:
            model.decode(tokens, cache, slots)
    finally:
        InterpretedFunction.run = real
    return rec.events


def table(events: list[tuple[str, str, str]]) -> list[str]:
    """One row per (kind, name, where), most frequent first."""
    counts = collections.Counter(events)
    rows = ["| launches | kind | kernel / op | issued at |", "|---:|---|---|---|"]
    rows += [f"| {n} | {kind} | {name} | {where} |" for (kind, name, where), n in counts.most_common()]
    return rows


def run(args: argparse.Namespace, command: str) -> int:
    from fastmamba.ops._common.dispatch import interpreter_enabled

    if not interpreter_enabled():
        print("error: bench profile launches counts the Triton launches under the interpreter: set "
              "TRITON_INTERPRET=1 before Python starts (on a GPU, `profile decode` times the graphed step)",
              file=sys.stderr)
        return 2
    if args.batch < 1 or args.context < 1 or args.timeline < 0:
        print("error: --batch and --context must be >= 1, --timeline >= 0", file=sys.stderr)
        return 2
    import fastmamba

    name = args.model or "nemotron-3-tiny"
    model = fastmamba.load_model(name, device="cpu", dtype=torch.float32, quantization=getattr(args, "quantization", None))
    events = decode_step_launches(model, args.batch, args.context)
    triton_n = sum(kind == "triton" for kind, _, _ in events)
    print(f"# {command}\n# {name} on the CPU (Triton interpreter), batch {args.batch}, context {args.context}: "
          f"{len(events)} launches in one decode step ({triton_n} Triton, {len(events) - triton_n} ATen)")
    print("\n".join(table(events)))
    if args.timeline:
        print(f"\nthe step's first {args.timeline} launches in order:")
        print("\n".join(f"{i:4d} {kind:6s} {name:40s} {where}" for i, (kind, name, where)
                        in enumerate(events[:args.timeline])))
    return 0
