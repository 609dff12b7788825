"""The chunked scan: the portable Triton kernels (``kernel.py``: chunk prep, chunk states, state
passing, chunk output; ``kernel_common.py``: their shared jit helpers), their launch sequence
(``launch.py``) and tuning table (``configs.py``).
Every call that the fused or Hopper families do not take runs here. No imports at package level:
``launch.py`` picks the Hopper kernels where they apply, and the Hopper family reads this one's
helpers."""
