#!/usr/bin/env bash
# The wheels the lent GPU machine lacks (no internet there), into .whl/ (git-ignored):
# the `serve` and `test` extras' HTTP stack with every dependency, resolved for its Python 3.12 on
# x86-64 Linux, and mamba_ssm's pure-Python wheel (a benchmark peer: its Triton ops, no CUDA build).
# The device already has torch, triton, transformers, numpy and pytest. scripts/gpu_session.sh
# installs .whl/*.whl into /tmp/site there.
#   bash scripts/fetch_device_wheels.sh [python]      (python: the one that builds mamba_ssm's wheel;
#   default: .venv/bin/python when `make` has made it, since the build imports torch, else python3)
set -euo pipefail
if [ $# -ge 1 ]; then py=$1; elif [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
mkdir -p .whl
"$py" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    fastapi uvicorn prometheus-client uvloop httptools openai httpx aiohttp
# transformers 5.25 (the tests' parity target; the device has 5.17) with what it needs beyond the
# device's packages: its hub client, tokenizers, safetensors, and `kernels` (0.19.1 <= v < 0.20),
# which from_pretrained(use_kernels=True) / KernelConfig ask for (tests/integrations)
"$py" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    --no-deps transformers==5.25.0 huggingface_hub tokenizers safetensors kernels==0.19.1 tomlkit pyyaml
# (--no-build-isolation: mamba_ssm's setup.py imports torch and wheel from the building Python)
"$py" -c "import torch, wheel" 2>/dev/null || "$py" -m pip install -q wheel setuptools
MAMBA_FORCE_BUILD=TRUE MAMBA_SKIP_CUDA_BUILD=TRUE "$py" -m pip wheel -q --no-deps --no-build-isolation \
    mamba-ssm==2.3.2.post1 -w .whl
ls .whl
