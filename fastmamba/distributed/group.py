"""The tensor-parallel process group: who this process is (rank), how many there are (world), and
the three collectives the sharded model needs (all-reduce of a sum, all-gather, broadcast).

    tp = init_tp()                      # under torchrun: RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT
    tp = init_tp(rank=1, world_size=2, init_method="tcp://127.0.0.1:29511")   # spawned by hand
    tp = TPGroup.single()               # TP=1: every collective is the identity, nothing initialised

Backend: NCCL when the device is a GPU, gloo on a CPU (tests). Under NCCL each rank uses GPU
``LOCAL_RANK`` (torchrun) or ``rank``; the first collective runs here, eagerly, because NCCL builds
its communicator lazily and a communicator must exist before a CUDA graph captures a collective.
All collectives are ``torch.distributed``'s own, which NCCL lets a CUDA graph capture.
"""
from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist

# torch 2.13 renames all_gather_into_tensor (deprecated there) to all_gather_single
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def under_torchrun() -> bool:
    """True when the torchrun variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) are all set."""
    return all(v in os.environ for v in TORCHRUN_VARS)


@dataclasses.dataclass
class TPGroup:
    """A tensor-parallel group: ``rank`` in [0, ``world_size``), the torch.distributed ``group``
    (None: the default group), the ``device`` this rank computes on."""

    rank: int
    world_size: int
    device: torch.device
    group: object = None
    backend: str | None = None

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> "TPGroup":
        return cls(0, 1, torch.device(device))

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place (returned for chaining); the identity at world size 1."""
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def all_gather_last(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate every rank's ``t`` along the last dim; rank r's piece has ``sizes[r]`` columns
        (pieces shorter than the longest are padded for the collective and trimmed after)."""
        if self.world_size == 1:
            return t
        width = max(sizes)
        mine = t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))
        mine = mine.movedim(-1, 0).contiguous()  # [width, ...]: all_gather_into_tensor stacks on dim 0
        out = mine.new_empty((self.world_size * width, *mine.shape[1:]))
        _ALL_GATHER(out, mine, group=self.group)
        pieces = out.split(width, dim=0)
        full = torch.cat([p[:n] for p, n in zip(pieces, sizes)], dim=0)
        return full.movedim(0, -1)

    def broadcast_object(self, obj, src: int = 0):
        """``obj`` of rank ``src`` on every rank (pickled; for host-side setup, not for a step)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)


def init_tp(rank: int | None = None, world_size: int | None = None, *, device: torch.device | str | None = None,
            init_method: str | None = None, backend: str | None = None, timeout_s: float = 600.0) -> TPGroup:
    """Join (or create) the default process group and return this rank's ``TPGroup``.

    rank, world_size  given, or both None: read from torchrun's RANK / WORLD_SIZE
    device            default: ``cuda:LOCAL_RANK`` (else ``cuda:rank``) when CUDA is present, else CPU
    init_method       default "env://" (MASTER_ADDR / MASTER_PORT)
    backend           default: "nccl" for a CUDA device, "gloo" for a CPU
    Raises ValueError naming the argument for a rank outside [0, world_size), a world size < 1,
    only one of rank / world_size, or NCCL asked for a CPU device.
    """
    if (rank is None) != (world_size is None):
        raise ValueError(f"init_tp: pass both `rank` and `world_size` or neither (torchrun's RANK / WORLD_SIZE); "
                         f"got rank={rank!r}, world_size={world_size!r}")
    if rank is None:
        if not under_torchrun():
            missing = [v for v in TORCHRUN_VARS if v not in os.environ]
            raise ValueError(f"init_tp: no `rank` / `world_size` given and not under torchrun "
                             f"(environment lacks {', '.join(missing)})")
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not (isinstance(world_size, int) and world_size >= 1):
        raise ValueError(f"init_tp: `world_size` expected an int >= 1, got {world_size!r}")
    if not (isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"init_tp: `rank` expected an int in [0, {world_size}), got {rank!r}")
    if device is None:
        if torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_RANK", rank))
            device = torch.device("cuda", local % torch.cuda.device_count())
        else:
            device = torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"init_tp: backend 'nccl' needs a CUDA device, got device={device}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size == 1 and not dist.is_initialized():
        return TPGroup(0, 1, device, None, None)
    if not dist.is_initialized():
        _import_dynamo_first()
        kw = dict(init_method=init_method or "env://", rank=rank, world_size=world_size,
                  timeout=datetime.timedelta(seconds=timeout_s))
        try:  # device_id (torch >= 2.3) binds the NCCL communicator to this GPU at once
            dist.init_process_group(backend, **kw, **({"device_id": device} if backend == "nccl" else {}))
        except TypeError:
            dist.init_process_group(backend, **kw)
    tp = TPGroup(rank, world_size, device, None, backend)
    warm = torch.ones(1, device=device)
    tp.all_reduce(warm)  # builds NCCL's communicator now, outside any CUDA-graph capture
    if int(warm.item()) != world_size:
        raise RuntimeError(f"init_tp: the first all-reduce summed to {warm.item()}, expected {world_size}")
    return tp


def _import_dynamo_first() -> None:
    """Import ``torch._dynamo`` before the process group exists.

    Importing it while a group is initialised leaves a C++ reference to the group behind (torch
    2.13; it happens behind our back: ``nn.Embedding(..., device="meta")``, which the sharded models
    are built from, runs ``normal_`` on the meta device, whose decomposition imports dynamo). The
    group then outlives ``destroy_process_group``, and so do its gloo threads: at interpreter exit
    one of them dropping the last all-gather's tensors takes the GIL during finalisation, the thread
    is unwound through a noexcept destructor and the process aborts ("terminate called without an
    active exception", SIGABRT) after printing the right tokens. Imported first, nothing pins the
    group and ``destroy_tp`` joins its threads."""
    import torch._dynamo  # noqa: F401


def live_gloo_threads() -> list[str]:
    """Names of this process's threads that belong to gloo (Linux; [] elsewhere): none after a
    clean ``destroy_tp``."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    names = []
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        if "gloo" in name:
            names.append(name)
    return names


def destroy_tp(*, wait: bool = True) -> None:
    """Leave the default process group (no-op when none). ``wait``: first a barrier, so no rank
    tears its sockets down while another still talks to it (pass False after a failure: the other
    ranks may be inside another collective). Destroying the group joins its threads."""
    if dist.is_initialized():
        try:
            if wait:
                dist.barrier()
        finally:
            dist.destroy_process_group()
