"""Tensor parallelism behind ``fastmamba serve --tensor-parallel-size N``.

The server's engine process becomes rank 0 of N. It starts ranks 1..N-1 (``python -m
fastmamba.distributed.serve_workers``, one process each), every rank loads its shard
(``load_tp_model``) and builds the same ``Engine``, and from then on every rank runs that engine
SPMD, as ``generate --tp`` does (``runtime.py``): same requests, same order, same steps, the
logits all-gathered so every rank samples the same tokens. Requests reach rank 0 only (the HTTP
server talks to it), so rank 0's engine is wrapped in a ``LockstepEngine``, which records what the
serving loop does to it and hands the other ranks the same commands before each step.

Protocol: rank 0 -> every other rank, over a local authenticated ``multiprocessing`` connection
(one per rank), one pickled list per message:

    ("setup", {...})                    first: rank, world size, init method, device, model, dtype
    ("engine", engine_kwargs, seed)     after rank 0 loaded its shard: the Engine's options (the K/V
                                        pool sized once, on rank 0) and the shared sampling seed
    [("warm_up",)]                      once, before serving
    [("add", ids, params, rid), ("abort", rid), ..., ("step", last)]
                                        before each step: the requests added and aborted since the
                                        last one, in order, then the step; ``last`` is rank 0's
                                        previous step's (rid, token) pairs, which a rank compares
                                        with its own (a divergence ends that rank, and the step
                                        then fails on rank 0 instead of passing silently)
    [("exit",)]                         the server stopped: leave the group and exit 0

The model's collectives run on the process group (gloo on CPUs, NCCL on GPUs: rank r on GPU r);
the commands do not, because a rank waits for the next one as long as the server is idle, and a
collective would time out (and a broadcast per step would add a device sync). A rank whose
connection closes (rank 0 died) exits with status 1. The other ranks ignore SIGINT and SIGTERM as
the engine process does: the server ends them through rank 0.
"""
from __future__ import annotations

import argparse
import multiprocessing.connection as mpc
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from fastmamba.distributed.runtime import seed_sampler

AUTHKEY_ENV = "FASTMAMBA_TP_AUTHKEY"
CONNECT_TIMEOUT_S = 300.0  # ranks 1..N-1 import torch and connect back within this


def _sampling_seed() -> int:
    return secrets.randbits(63)


class LockstepEngine:
    """Rank 0's ``Engine`` as the serving loop uses it, keeping the other ranks' engines in step.

    ``add_validated_request`` and ``abort`` act on rank 0's engine at once and are queued for the
    others; ``step`` sends the queue, then steps; ``warm_up`` runs on every rank; everything else
    (``finished``, ``waiting``, ``stats``, ``model``, ``cache`` ...) is rank 0's engine's own.
    ``close`` ends the other ranks (called by the engine process when serving ends, and at its exit
    in any case)."""

    def __init__(self, engine, tp, conns: list, procs: list[subprocess.Popen]):
        self._engine, self._tp, self._conns, self._procs = engine, tp, conns, procs
        self._pending: list[tuple] = []
        self._last: list[tuple[int, int]] | None = None
        self._closed = False
        self.worker_exit_codes: list[int | None] | None = None

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def _send(self, commands: list[tuple]) -> None:
        for c in self._conns:
            c.send(commands)

    def add_validated_request(self, ids: list[int], params):
        rid = self._engine.add_validated_request(ids, params)
        self._pending.append(("add", ids, params, rid))
        return rid

    def add_request(self, prompt, params=None):
        """``Engine.add_request`` (checks the prompt and params), queued for the other ranks too."""
        rid = self._engine.add_request(prompt, *(() if params is None else (params,)))
        req = next(r for r in self._engine.waiting if r.rid == rid)
        self._pending.append(("add", req.prompt, req.params, rid))
        return rid

    def abort(self, rid: int) -> bool:
        found = self._engine.abort(rid)
        self._pending.append(("abort", rid))
        return found

    def warm_up(self) -> None:
        self._send([("warm_up",)])
        self._engine.warm_up()

    def step(self):
        commands, self._pending = self._pending + [("step", self._last)], []
        self._send(commands)
        self._last = None
        outputs = self._engine.step()
        self._last = [(o.rid, o.token) for o in outputs]
        return outputs

    def close(self, timeout: float = 30.0) -> list[int | None]:
        """Tell the other ranks to exit, leave the group, wait for them; returns their exit codes
        (also printed on stderr, one line). Idempotent."""
        if self._closed:
            return self.worker_exit_codes or []
        self._closed = True
        from fastmamba.distributed.group import destroy_tp

        sent = True
        try:
            self._send([("exit",)])
        except OSError:
            sent = False
        try:
            destroy_tp(wait=sent)
        except Exception as exc:  # noqa: BLE001 - a rank that died breaks the barrier; the group goes anyway
            print(f"fastmamba serve: leaving the tensor-parallel group: {type(exc).__name__}: {exc}", file=sys.stderr)
        self.worker_exit_codes = _reap(self._procs, timeout)
        for c in self._conns:
            c.close()
        print(f"fastmamba serve: tensor-parallel ranks 1..{len(self._procs)} exited with codes "
              f"{self.worker_exit_codes}", file=sys.stderr, flush=True)
        return self.worker_exit_codes


def _reap(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
    return [p.returncode for p in procs]


def _accept(listener: mpc.Listener, procs: list[subprocess.Popen], n: int) -> list:
    """``n`` connections from the started ranks, in rank order; RuntimeError when a rank exits
    first or none comes within ``CONNECT_TIMEOUT_S``."""
    got: dict[int, object] = {}
    failure: list[BaseException] = []

    def accept():
        try:
            while len(got) < n:
                c = listener.accept()
                got[c.recv()] = c
        except (OSError, EOFError) as exc:
            failure.append(exc)

    t = threading.Thread(target=accept, name="fastmamba-tp-accept", daemon=True)
    t.start()
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while t.is_alive():
        t.join(0.2)
        dead = [(r + 1, p.returncode) for r, p in enumerate(procs) if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            listener.close()
            t.join(5)
            why = (f"rank(s) {[r for r, _ in dead]} exited with codes {[c for _, c in dead]}" if dead
                   else f"not every rank connected within {CONNECT_TIMEOUT_S:.0f} s")
            raise RuntimeError(f"tensor-parallel serving could not start its ranks: {why}")
    if failure or len(got) < n:
        raise RuntimeError(f"tensor-parallel serving could not start its ranks: {failure or 'missing connections'}")
    return [got[r] for r in range(1, n + 1)]


def _load(tp, setup: dict):
    from fastmamba.distributed.loading import load_tp_model

    return load_tp_model(setup["model"], tp, dtype=setup["dtype"])


def check_serve_tp(model: str, tp_size: int, device: str | None) -> None:
    """``fastmamba serve --tensor-parallel-size N``'s checks, before the port is bound or any
    process starts: N an int >= 1; for N > 1 the device (``check_launch``) and the model's shapes
    (``check_tp_source``: heads, groups, KV heads, MLP channels divisible). ValueError naming the
    flag and the numbers."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"--tensor-parallel-size: expected an integer >= 1, got {tp_size!r}")
    if tp_size == 1:
        return
    from fastmamba.distributed.launch import check_launch
    from fastmamba.distributed.loading import check_tp_source

    check_launch(tp_size, device, who="--tensor-parallel-size", tp_flag="--tensor-parallel-size")
    check_tp_source(model, tp_size, who=f"--tensor-parallel-size {tp_size}")


def build_tp_engine(tp_size: int, model: str, dtype: str | None, device: str | None, engine_kwargs: dict,
                    engine_options: Callable | None = None) -> LockstepEngine:
    """Run in the server's engine process: start ranks 1..tp_size-1, join the group as rank 0, load
    this rank's shard of ``model`` and return its engine wrapped in a ``LockstepEngine``.

    dtype, device     as ``load_model`` takes them (device None: a GPU per rank when CUDA is present)
    engine_kwargs     the ``Engine``'s options, the same on every rank
    engine_options    optional ``f(model) -> dict`` of more options computed on rank 0 from its
                      loaded shard (the K/V pool's size), sent to the other ranks as they are
    A rank that fails to start, load or build raises RuntimeError / its own error here, after the
    ranks already started are stopped."""
    import torch

    from fastmamba.distributed.group import init_tp
    from fastmamba.distributed.launch import check_launch, free_port
    from fastmamba.generation.engine import Engine

    kind = check_launch(tp_size, device, who="fastmamba serve", tp_flag="--tensor-parallel-size")
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    authkey = secrets.token_bytes(32)
    listener = mpc.Listener(("127.0.0.1", 0), authkey=authkey)
    env = {**os.environ, AUTHKEY_ENV: authkey.hex()}
    host, port = listener.address
    procs = [subprocess.Popen([sys.executable, "-m", "fastmamba.distributed.serve_workers", "--rank", str(r),
                               "--connect", f"{host}:{port}"], env=env)
             for r in range(1, tp_size)]
    conns: list = []
    try:
        conns = _accept(listener, procs, tp_size - 1)
        listener.close()
        setup = {"world_size": tp_size, "init_method": f"tcp://127.0.0.1:{free_port()}", "device": kind,
                 "model": model, "dtype": dtype, "engine_kwargs": engine_kwargs}
        for r, c in enumerate(conns, start=1):
            c.send(("setup", {**setup, "rank": r}))
        tp = init_tp(0, tp_size, init_method=setup["init_method"],
                     device=torch.device("cuda", 0) if kind == "cuda" else "cpu")
        lm = _load(tp, setup)
        kwargs = {**engine_kwargs, **(engine_options(lm) if engine_options is not None else {})}
        seed = _sampling_seed()
        for c in conns:
            c.send(("engine", kwargs, seed))
        engine = Engine(lm, **kwargs)
        seed_sampler(engine, seed)
    except BaseException:
        for c in conns:
            c.close()
        listener.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
        _reap(procs, 5)
        raise
    lockstep = LockstepEngine(engine, tp, conns, procs)
    # the engine process calls close() when serving ends; this covers every other way out of it
    # (multiprocessing runs these finalizers when a child process exits)
    from multiprocessing import util

    util.Finalize(lockstep, lockstep.close, exitpriority=100)
    return lockstep


def _serve_rank(conn, engine) -> None:
    """Ranks 1..N-1: apply rank 0's commands to this rank's engine until ("exit",)."""
    mine: list[tuple[int, int]] | None = None  # this rank's last step's (rid, token) pairs
    while True:
        commands = conn.recv()
        for cmd in commands:
            op = cmd[0]
            if op == "add":
                _, ids, params, want = cmd
                rid = engine.add_validated_request(ids, params)
                if rid != want:
                    raise RuntimeError(f"tensor-parallel rank: request id {rid} where rank 0 has {want} "
                                       "(ranks diverged)")
            elif op == "abort":
                engine.abort(cmd[1])
            elif op == "step":
                if cmd[1] is not None and mine is not None and cmd[1] != mine:
                    raise RuntimeError(f"tensor-parallel rank: the last step gave {mine}, rank 0's gave {cmd[1]} "
                                       "(ranks diverged)")
                mine = None
                try:
                    mine = [(o.rid, o.token) for o in engine.step()]
                except Exception as exc:  # noqa: BLE001 - rank 0's step fails alike and fails its requests
                    print(f"fastmamba serve: tensor-parallel rank step failed: {type(exc).__name__}: {exc}",
                          file=sys.stderr)
            elif op == "warm_up":
                engine.warm_up()
            elif op == "exit":
                return
            else:
                raise RuntimeError(f"tensor-parallel rank: unknown command {op!r}")
        engine.finished.clear()  # rank 0's serving loop collects its own; nobody collects these


def worker_main(argv: list[str] | None = None) -> int:
    """``python -m fastmamba.distributed.serve_workers --rank R --connect HOST:PORT`` (started by
    ``build_tp_engine``; the connection's key comes in the environment)."""
    parser = argparse.ArgumentParser(prog="python -m fastmamba.distributed.serve_workers")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--connect", required=True, metavar="HOST:PORT")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server ends this rank through rank 0
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    key = os.environ.pop(AUTHKEY_ENV, None)
    if key is None:
        print(f"serve_workers: {AUTHKEY_ENV} is not set (this module is started by fastmamba serve)", file=sys.stderr)
        return 2
    host, port = args.connect.rsplit(":", 1)
    import torch

    from fastmamba.distributed.group import destroy_tp, init_tp
    from fastmamba.generation.engine import Engine

    conn = mpc.Client((host, int(port)), authkey=bytes.fromhex(key))
    conn.send(args.rank)
    try:
        kind, setup = conn.recv()
        assert kind == "setup" and setup["rank"] == args.rank, (kind, setup.get("rank"))
        tp = init_tp(args.rank, setup["world_size"], init_method=setup["init_method"],
                     device=torch.device("cuda", args.rank) if setup["device"] == "cuda" else "cpu")
        ok = False
        try:
            lm = _load(tp, setup)
            kind, kwargs, seed = conn.recv()
            engine = Engine(lm, **kwargs)
            seed_sampler(engine, seed)
            _serve_rank(conn, engine)
            ok = True
        finally:
            destroy_tp(wait=ok)
    except EOFError:  # rank 0 is gone without an exit command
        print(f"fastmamba serve: tensor-parallel rank {args.rank}: rank 0 went away; exiting", file=sys.stderr)
        return 1
    finally:
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
