"""Tensor parallelism over torch.distributed (NCCL on GPUs, gloo on CPUs): one Mamba-2 model
sharded across the ranks of a host. See ``shard.py`` (who holds what, loading), ``layers.py``
(the parallel modules), ``group.py`` (the process group), ``launch.py`` (torchrun or spawn) and
``runtime.py`` (how the engine runs on every rank), ``nemotron_h.py`` (the hybrid: attention, MLP
and Mamba-2 blocks), ``bench.py`` (``fastmamba bench tp``)."""
from fastmamba.distributed.group import TPGroup, destroy_tp, init_tp, under_torchrun
from fastmamba.distributed.launch import run_tp, spawn_tp
from fastmamba.distributed.shard import (LoadStats, ShardedMamba2Config, build_tp_mamba2, check_tp, check_tp_source,
                                         load_tp_model,
                                         local_config, shard_plan, shard_state_dict_into)

__all__ = ["TPGroup", "init_tp", "destroy_tp", "under_torchrun", "run_tp", "spawn_tp", "LoadStats",
           "ShardedMamba2Config", "build_tp_mamba2", "check_tp", "check_tp_source", "load_tp_model", "local_config", "shard_plan",
           "shard_state_dict_into"]
