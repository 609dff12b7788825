"""One module per op, mirroring ``fastmamba.ops``: cases, input sets, providers, correctness check.

Each module imports its op lazily, so the harness runs (and prints a 'skipped' row) while an op is
missing or broken.
"""
