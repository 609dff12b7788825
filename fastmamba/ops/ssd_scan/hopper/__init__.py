"""The Hopper (sm_90, Gluon) kernels of the chunked scan: the chunk-output stage (``chunk_output.py``,
``chunk_output_kernel.py``) and the chunk-states stage (``states.py``, ``states_kernel.py``), with the
rules that pick them and ``hopper_kernels()``, the block inside which calls take them."""
from fastmamba.ops.ssd_scan.hopper.chunk_output import (
    EAGER_MIN_TOKENS,
    MIN_TOKENS,
    PROGRAMS_PER_SM,
    chunk_output_sm90,
    hopper_chunk_output_ok,
    hopper_kernels,
    long_prefill_kernels,
)
from fastmamba.ops.ssd_scan.hopper.states import chunk_states_sm90, hopper_states_ok

__all__ = ["EAGER_MIN_TOKENS", "MIN_TOKENS", "PROGRAMS_PER_SM", "chunk_output_sm90", "chunk_states_sm90",
           "hopper_chunk_output_ok", "hopper_kernels", "hopper_states_ok", "long_prefill_kernels"]
