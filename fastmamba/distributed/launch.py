"""Running a function on every rank of a tensor-parallel group.

    run_tp(fn, tp_size, *args)   under torchrun (RANK / WORLD_SIZE set): joins the group and runs
                                 ``fn(tp, *args)`` in this process (each torchrun process does the
                                 same); else tp_size == 1: runs it here with ``TPGroup.single``;
                                 else spawns ``tp_size`` processes (torch.multiprocessing, "spawn")
                                 and returns rank 0's result
    spawn_tp(fn, world, *args)   the spawning part: every rank's result, in rank order

``fn`` must be importable (a module-level function) and its arguments and result picklable; a
rank that raises sends its exception back and the parent re-raises rank 0's (or the first
failing rank's) with every failing rank's traceback attached, after stopping the other ranks (a
rank left waiting in a collective would otherwise hang).
"""
from __future__ import annotations

import os
import pickle
import queue as queue_mod
import socket
import traceback

import torch
import torch.multiprocessing as mp

from fastmamba.distributed.group import TPGroup, destroy_tp, init_tp, under_torchrun


class RankFailed(RuntimeError):
    """A spawned rank raised something that could not be sent back as itself."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, device_kind: str, fn, args, kwargs, results) -> None:
    try:
        device = None if device_kind == "auto" else device_kind
        if device == "cuda":
            device = torch.device("cuda", rank % torch.cuda.device_count())
        tp = init_tp(rank, world_size, init_method=f"tcp://127.0.0.1:{port}", device=device)
        try:
            # plain pickle (tensors by value): torch's queue would share storages by file
            # descriptor, which dies with this process
            results.put(pickle.dumps((rank, True, fn(tp, *args, **kwargs), None)))
        finally:
            destroy_tp()
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        tb = traceback.format_exc()
        try:
            results.put(pickle.dumps((rank, False, exc, tb)))
        except Exception:  # noqa: BLE001 - an exception that does not pickle
            results.put(pickle.dumps((rank, False, None, tb)))


def spawn_tp(fn, world_size: int, *args, device: str = "auto", timeout_s: float = 600.0, **kwargs) -> list:
    """Run ``fn(tp, *args, **kwargs)`` on ``world_size`` fresh processes joined by gloo (CPU) or NCCL (GPU);
    returns the per-rank results. ``device``: "auto" (GPU ``rank`` when CUDA is present, else CPU),
    "cpu" or "cuda". Raises the failing rank's exception (see the module docstring)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"spawn_tp: `world_size` expected an int >= 1, got {world_size!r}")
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"spawn_tp: `device` expected 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(f"spawn_tp: {world_size} ranks on GPUs need {world_size} GPUs, torch sees "
                         f"{torch.cuda.device_count()}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, device, fn, args, kwargs, results), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    got: dict[int, tuple] = {}
    failed = False
    try:
        while len(got) < world_size:
            try:
                rank, ok, value, tb = pickle.loads(results.get(timeout=timeout_s))
            except queue_mod.Empty:
                raise TimeoutError(f"spawn_tp: ranks {sorted(set(range(world_size)) - set(got))} sent nothing "
                                   f"within {timeout_s} s") from None
            got[rank] = (ok, value, tb)
            if not ok:
                failed = True
                break
            dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode not in (None, 0)]
            if dead:
                raise RankFailed(f"spawn_tp: rank(s) {dead} exited with codes "
                                 f"{[procs[r].exitcode for r in dead]} without a result")
    finally:
        if failed:  # the others may wait in a collective forever: give them a moment, then stop them
            for p in procs:
                p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
    if failed:
        # rank 0's error when it failed, else the first that came back
        while True:
            try:
                rank, ok, value, tb = pickle.loads(results.get(timeout=0.1))
                got.setdefault(rank, (ok, value, tb))
            except (queue_mod.Empty, OSError, ValueError):
                break
        bad = sorted(r for r, (ok, _, _) in got.items() if not ok)
        first = 0 if 0 in bad else bad[0]
        _, exc, _ = got[first]
        notes = "\n".join(f"--- rank {r} ---\n{got[r][2]}" for r in bad)
        if isinstance(exc, BaseException):
            if hasattr(exc, "add_note"):
                exc.add_note(f"(raised on tensor-parallel rank {first} of {world_size})\n{notes}")
            raise exc
        raise RankFailed(f"spawn_tp: rank {first} of {world_size} failed:\n{notes}")
    return [got[r][1] for r in range(world_size)]


def run_tp(fn, tp_size: int, *args, device: str = "auto", **kwargs):
    """``fn(tp, *args)`` on every rank of a tensor-parallel group of ``tp_size``; returns this
    process's result under torchrun, else rank 0's (see the module docstring)."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"run_tp: `tp_size` expected an int >= 1, got {tp_size!r}")
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != tp_size:
            raise ValueError(f"run_tp: --tp {tp_size} but torchrun started {world} processes (WORLD_SIZE={world}); "
                             "pass --nproc-per-node equal to --tp")
        tp = init_tp(device=None if device == "auto" else device)
        try:
            return fn(tp, *args, **kwargs)
        finally:
            destroy_tp()
    if tp_size == 1:
        dev = "cuda" if (device == "cuda" or (device == "auto" and torch.cuda.is_available())) else "cpu"
        return fn(TPGroup.single(dev), *args, **kwargs)
    return spawn_tp(fn, tp_size, *args, device=device, **kwargs)[0]
