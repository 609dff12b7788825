#!/usr/bin/env bash
# Issue 19 host-path probe on the lent GPU: lean-launch tests, host µs per op with Triton's JIT
# launch path and with the lean one, the eager prefill's host breakdown, time to first token.
#   bash scripts/gpu_host_probe.sh [ttft shapes]
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fastmamba-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "=== tests $(date +%T)"
timeout 240 python3 -m pytest -q -n 8 tests/ops/test_lean_launch.py tests/ops/test_eager_fast_path.py \
    tests/ops/state_update tests/ops/conv1d tests/ops/ssd_scan tests/ops/gated_rmsnorm tests/ops/add_rmsnorm \
    > "$OUT/tests.log" 2>&1; echo "rc=$?"; tail -n 6 "$OUT/tests.log"
for lean in 0 1; do
    echo "=== host µs, FASTMAMBA_LEAN_LAUNCH=$lean $(date +%T)"
    FASTMAMBA_LEAN_LAUNCH=$lean timeout 200 python3 scripts/host_overhead.py --device cuda 2>&1 | tee -a "$OUT/host.txt"
done
for lean in 0 1; do
    echo "=== eager prefill profile, FASTMAMBA_LEAN_LAUNCH=$lean $(date +%T)"
    FASTMAMBA_LEAN_LAUNCH=$lean timeout 200 python3 scripts/profile_eager_prefill.py --shape 1x16 --top 40 > "$OUT/prof_$lean.txt" 2>&1
    head -1 "$OUT/prof_$lean.txt"
done
echo "=== ttft $(date +%T)"
timeout 300 python3 -m fastmamba.bench ttft --shapes "${1:-1x16,1x128,1x512,1x2048}" 2>&1 | tee "$OUT/ttft.txt" | tail -n 12
