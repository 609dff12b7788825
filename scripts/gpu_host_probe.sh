#!/usr/bin/env bash
# Issue 19 host-path probe on the lent GPU: lean-launch tests, host µs per op, the eager prefill's
# host breakdown, time to first token, eager op timings with the peers side by side.
#   bash scripts/gpu_host_probe.sh [steps...]   steps: tests host prof ttft eager  (default: all)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fastmamba-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(tests host prof ttft eager)
for step in "${steps[@]}"; do
    echo "=== $step $(date +%T)"
    case "$step" in
        tests) timeout 240 python3 -m pytest -q -n 8 tests/ops/test_lean_launch.py tests/ops/test_eager_fast_path.py \
                   tests/ops/conv1d_fn tests/ops/gated_rmsnorm > "$OUT/tests.log" 2>&1; echo "rc=$?"; tail -n 4 "$OUT/tests.log" ;;
        host) for lean in 0 1; do
                  echo "--- FASTMAMBA_LEAN_LAUNCH=$lean"
                  FASTMAMBA_LEAN_LAUNCH=$lean timeout 200 python3 scripts/host_overhead.py --device cuda 2>&1 | tee -a "$OUT/host.txt"
              done ;;
        prof) for shape in 1x16 1x2048; do
                  timeout 200 python3 scripts/profile_eager_prefill.py --shape $shape --top 25 > "$OUT/prof_$shape.txt" 2>&1
                  sed -n '/wall/,/^ *[0-9]* function calls/p' "$OUT/prof_$shape.txt" | grep -v "function calls"
              done ;;
        ttft) timeout 400 python3 -m fastmamba.bench ttft 2>&1 | tee "$OUT/ttft.txt" | tail -n 12 ;;
        eager) timeout 300 python3 -m fastmamba.bench kernels --eager --quick --batch 1 --ops ssu,conv,norm --markdown "$OUT/eager_kernels.md" > "$OUT/eager_kernels.txt" 2>&1; echo "rc=$?"; cat "$OUT/eager_kernels.md"
               timeout 300 python3 -m fastmamba.bench prefill --eager --markdown "$OUT/eager_prefill.md" > "$OUT/eager_prefill.txt" 2>&1; echo "rc=$?"; cat "$OUT/eager_prefill.md" ;;
    esac
done
