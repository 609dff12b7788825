"""Helpers shared by every op: input checks, CPU/GPU dispatch, jit math, index buffers."""
