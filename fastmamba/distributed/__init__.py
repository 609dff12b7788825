"""Tensor parallelism over torch.distributed (NCCL on GPUs, gloo on CPUs): one model sharded
across the ranks of a host.

    shard.py       who holds what of a Mamba2LM, per-rank models, loading each rank's slices
    nemotron_h.py  the same for the Nemotron-H hybrid (attention, MLP and Mamba-2 blocks)
    layers.py      the parallel modules (vocab-parallel embedding / lm_head, row-parallel linear,
                   the distributed gated RMSNorm)
    group.py       the process group and its collectives; launch.py: torchrun or spawned ranks
    runtime.py     how the engine runs on every rank (SPMD) and why
    serve_workers.py  ``fastmamba serve --tensor-parallel-size N``: the engine process as rank 0,
                   ranks 1..N-1 fed each step's requests and aborts
    loading.py     ``load_tp_model`` / ``check_tp_source``: a preset or checkpoint directory of either family
    (the benchmark: ``fastmamba bench tp``, in fastmamba/bench/tp.py)

    fastmamba generate --model mamba2-2.7b --prompt-ids 1,2,3 --tp 2          (spawns 2 ranks)
    torchrun --nproc-per-node 2 -m fastmamba.cli generate ... --tp 2          (joins torchrun's)
    fastmamba serve --model DIR --tensor-parallel-size 2                      (rank 0 starts rank 1)
"""
from fastmamba.distributed.group import TPGroup, destroy_tp, init_tp, under_torchrun
from fastmamba.distributed.launch import run_tp, spawn_tp
from fastmamba.distributed.loading import check_tp_source, load_tp_model
from fastmamba.distributed.shard import (LoadStats, ShardedMamba2Config, build_tp_mamba2, check_tp, local_config,
                                         shard_plan, shard_state_dict_into)

__all__ = ["TPGroup", "init_tp", "destroy_tp", "under_torchrun", "run_tp", "spawn_tp", "LoadStats",
           "ShardedMamba2Config", "build_tp_mamba2", "check_tp", "check_tp_source", "load_tp_model", "local_config", "shard_plan",
           "shard_state_dict_into"]
