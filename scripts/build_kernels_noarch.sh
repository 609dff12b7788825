#!/usr/bin/env bash
# fastmamba's ops as a `kernels` noarch build (pure Python + Triton, nothing to compile):
# kernels_build/fastmamba_kernels/build/torch-{cuda,cpu}/ (git-ignored), each with metadata.json.
#   bash scripts/build_kernels_noarch.sh [--out DIR] [--backends cuda,cpu]     (PYTHON=... to pick one)
# Load it with transformers (see kernels_build/fastmamba_kernels/README.md):
#   KernelConfig(kernel_mapping={"mamba2_scan_forward": "/abs/kernels_build/fastmamba_kernels:Mamba2ScanForward",
#                                ...}, use_local_kernel=True)
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
exec "$py" kernels_build/fastmamba_kernels/build.py "$@"
