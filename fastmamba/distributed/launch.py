"""Running a function on every rank of a tensor-parallel group.

    run_tp(fn, tp_size, *args)   under torchrun (RANK / WORLD_SIZE set): joins the group and runs
                                 ``fn(tp, *args)`` in this process (each torchrun process does the
                                 same); else tp_size == 1: runs it here with ``TPGroup.single``;
                                 else spawns ``tp_size`` processes (torch.multiprocessing, "spawn")
                                 and returns rank 0's result
    spawn_tp(fn, world, *args)   the spawning part: every rank's result, in rank order
    check_launch(tp, device)     what a launcher checks before any rank starts: torchrun's world
                                 size against --tp, the device against the GPUs torch sees

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


def launch_rank() -> int:
    """This process's rank under torchrun (RANK), else 0: the process that reports a launch error."""
    return int(os.environ.get("RANK", "0")) if under_torchrun() else 0


def torchrun_world_size() -> int:
    """WORLD_SIZE under torchrun, else 1."""
    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else 1


def check_launch(tp_size: int, device: str | None, *, who: str = "fastmamba", tp_flag: str = "--tp",
                 device_flag: str = "--device") -> str:
    """What a launcher checks before it starts (or joins) any rank; returns the device kind for
    ``run_tp`` / ``spawn_tp``: "auto" (``device`` None: a GPU per rank when CUDA is present, else
    the CPU), "cpu" or "cuda".

    Raises ValueError, naming the flag, the expected and the given value, when: torchrun started a
    number of processes other than ``tp_size`` (WORLD_SIZE; every process would otherwise run its
    own copy of the model and print); ``device`` asks for CUDA and torch sees no GPU, or fewer GPUs
    than ranks on this host; ``device`` names one GPU (each rank takes its own) or is neither cpu
    nor cuda."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"{who}: {tp_flag} expected an int >= 1, got {tp_size!r}")
    world = torchrun_world_size()
    if under_torchrun() and world != tp_size:
        raise ValueError(f"{who}: torchrun started {world} processes (WORLD_SIZE={world}) but {tp_flag} is "
                         f"{tp_size}: pass {tp_flag} {world} to split the model over them, or start "
                         f"torchrun with --nproc-per-node {tp_size}")
    if device is None or str(device) == "auto":
        return "auto"
    text = str(device).strip()
    kind = text.split(":", 1)[0]
    if kind == "cpu":
        return "cpu"
    if kind != "cuda":
        raise ValueError(f"{who}: {device_flag} {text!r} is not a device tensor parallelism runs on; expected "
                         "'cuda' (one GPU per rank) or 'cpu' (gloo ranks on CPUs)")
    if text != "cuda" and tp_size > 1:
        raise ValueError(f"{who}: {device_flag} {text!r} names one GPU, but with {tp_flag} {tp_size} each rank "
                         f"takes its own (rank r: cuda:r, or LOCAL_RANK under torchrun); pass {device_flag} cuda")
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if under_torchrun() else tp_size
    if have < local:
        raise ValueError(f"{who}: {device_flag} {text} with {tp_flag} {tp_size} needs {local} CUDA GPUs on this "
                         f"host, torch sees {have}; pass {device_flag} cpu to run the ranks on CPUs (gloo)")
    return "cuda"


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
        ok = False
        try:
            value = fn(tp, *args, **kwargs)
            ok = True
        finally:
            destroy_tp(wait=ok)
        # plain pickle (tensors by value): torch's queue would share storages by file descriptor,
        # which dies with this process
        results.put(pickle.dumps((rank, True, value, None)))
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
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("run_tp: device 'cuda' asked for, but torch sees no CUDA GPU")
        tp = init_tp(device="cpu" if device == "cpu" else None)  # None: GPU LOCAL_RANK when CUDA is present
        ok = False
        try:
            value = fn(tp, *args, **kwargs)
            ok = True
            return value
        finally:
            destroy_tp(wait=ok)
    if tp_size == 1:
        dev = "cuda" if (device == "cuda" or (device == "auto" and torch.cuda.is_available())) else "cpu"
        return fn(TPGroup.single(dev), *args, **kwargs)
    return spawn_tp(fn, tp_size, *args, device=device, **kwargs)[0]
