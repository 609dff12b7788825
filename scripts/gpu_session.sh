#!/usr/bin/env bash
# One call on the lent GPU machine: install the optional peers carried as wheels (.whl/), then
# run the steps named on the command line (default: tests tune kernels). Everything lands in
# $OUT (the tool copies it back). Usage on the device:  bash scripts/gpu_session.sh tests kernels
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fastmamba-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Triton's compile cache travels between calls as one tarball (each call gets a fresh machine)
export TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p "$TRITON_CACHE_DIR"
# (only the cubins, launchers and metadata: Triton skips a cached group's missing IR files, and the IR
# made the tarball 9x larger), in parts of 15 MiB (a returned file may have 16 MiB): copy every
# $OUT/triton-cache.txz.part* into .tcache/ (replacing the old parts) after checking them with
# `cat .tcache/triton-cache.txz.part* | xz -t`
ls .tcache/triton-cache.txz.part* >/dev/null 2>&1 && cat .tcache/triton-cache.txz.part* | tar -xJf - -C "$TRITON_CACHE_DIR"

# at most 8 files come back from $OUT (tests.log, tune.*, kernels.*, prefill.*, spec.*, e2e.*, the cache's parts): pick steps to fit
# tune-<op> sweeps one op, e.g. tune-conv_fn, tune-ssd (the prefill ops are not in the default tune)
# spec-<shape> runs the spec benchmark on one shape (nemotron-h, nemotron-h-tp8, mamba2-2.7b);
# e2ef-<model> / e2ekv-<model>: e2e with --quantization fp8 / --kv-cache-dtype fp8; profile-decode-<model>: one
# graphed decode step's kernels (PROFILE_ARGS appended, e.g. "--quantization fp8"); fp8err-<model>: where the FP8
# model's logit error comes from, block by block (kernels vs references, FP8 vs 16 bits, drift); mtp-<model>: the MTP oracle at k 1..7 (MTP_ARGS appended, e.g. "--engine-batches 8,64,256"); fp8moe: the FP8 MoE op vs bf16 and _scaled_mm
# tunemoe-<shape>: the MoE configs at TUNE_BATCH tokens (environment; default 1,2,4: the GEMV path) on that bench shape (nano:
# routed-only and the decode call with the shared expert; nano+shared: the decode call alone), PDL on, cut at TUNE_S (300) s
# apply-gemv / apply-moe: write the TABLE that tunegemv- / tunemoe- printed into the configs module, so that
# the later steps of the same call run it (paste the same block from $OUT/tune-*.txt into the repository after)
# e2esuper: the whole Nemotron-3 Super (random weights) in FP8, built block by block, FP8 K/V, 16-bit SSM states
# (NVIDIA's Hopper recipe), batch SUPER_BATCH (default 1,64): an H200 (~125 GB of weights)
# tunefp8: the FP8 decode GEMVs' configs (fp8_gemv at 1 and 8 rows, the MoE pair GEMV) on the fp8 bench's cases
# (TUNE_FP8_CASES, default nano), PDL on; apply-fp8 writes its TABLE (then e2ef- runs it)
# tunegemv-<preset>: the gemv configs of that preset's decode projections (nemotron-3-nano, nemotron-h-8b, mamba2-2.7b; one row), PDL on
# E2E_ARGS (environment) is appended to the e2em- / e2ef- / e2ekv- / ttftm- commands, e.g. E2E_ARGS="--batch 1"
# ttftm-<model>: bench ttft on that model at TTFT_SHAPES (default 1x8192,8x2048; the floor counts a MoE's active
# experts), e.g. E2E_ARGS="--quantization fp8" bash scripts/gpu_session.sh ttftm-nemotron-3-nano
# capacity-<model>: the planner's max_batch at CAPACITY_CONTEXT (default 8192) on this card, and the start-up time
# (load, engine build, warm-up); E2E_ARGS is appended (e.g. "--quantization fp8 --kv-cache-dtype fp8")
# e2e-spec: batch-1 speculative decoding, K=5, oracle then ngram drafter, against plain decoding
# prefix-<client>: the prefix-cache test (mamba2-2.7b) with that HTTP client; prefixm-<model>: with that model
# (e.g. prefixm-nemotron-h-4b: a hybrid, whose snapshots keep K/V too)
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -c "
import importlib
for name in ('transformers', 'fastapi', 'uvicorn', 'prometheus_client', 'openai', 'mamba_ssm'):
    try:
        print(name, getattr(importlib.import_module(name), '__version__', '?'), end='; ')
    except Exception as e:
        print(name, 'FAILS:', repr(e)[:200], end='; ')
print()" 2>&1 | tail -1
# the tests that load a full-size preset (and the 5 torchrun launches, which a loaded 16-core machine
# stretched past 200 s) run one at a time after the parallel suite; BIG_K (environment) picks some of
# them for suite-big (a -k expression; BIG itself is set here, so setting it outside does nothing)
BIG="test_torchrun_tp2_exits_0_every_time or test_nano_preset_through_the_engine_on_gpu or test_8b_preset_through_the_engine_on_gpu or test_8b_preset_decodes_on_gpu or test_start_up_time or test_gpu_server_plans_from_the_cards_memory"
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(tests tune kernels)
for step in "${steps[@]}"; do
    echo "=== $step $(date +%T)"
    case "$step" in
        tests)     timeout 400 python3 -m pytest -q -n 8 tests > "$OUT/tests.log" 2>&1; echo "rc=$?"; tail -n 15 "$OUT/tests.log" ;;
        tests-ops) timeout 200 python3 -m pytest -q -n 8 tests/ops > "$OUT/tests.log" 2>&1; echo "rc=$?"; tail -n 15 "$OUT/tests.log" ;;
        tune)      timeout 280 python3 -m fastmamba.bench tune > "$OUT/tune.txt" 2> "$OUT/tune.err"; echo "rc=$?"; cat "$OUT/tune.txt" ;;
        tune-*)    timeout 280 python3 -m fastmamba.bench tune --ops "${step#tune-}" >> "$OUT/tune.txt" 2>> "$OUT/tune.err"; echo "rc=$?"; cat "$OUT/tune.txt" ;;
        kernels)   timeout 540 python3 -m fastmamba.bench kernels --json "$OUT/kernels.jsonl" --markdown "$OUT/kernels.md" > "$OUT/kernels.txt" 2> "$OUT/kernels.err"; echo "rc=$?"; cat "$OUT/kernels.txt" ;;
        prefill)   timeout 540 python3 -m fastmamba.bench prefill --json "$OUT/prefill.jsonl" --markdown "$OUT/prefill.md" > "$OUT/prefill.txt" 2> "$OUT/prefill.err"; echo "rc=$?"; cat "$OUT/prefill.txt" ;;
        spec)      timeout 540 python3 -m fastmamba.bench spec --json "$OUT/spec.jsonl" --markdown "$OUT/spec.md" > "$OUT/spec.txt" 2> "$OUT/spec.err"; echo "rc=$?"; tail -n 60 "$OUT/spec.txt" ;;
        spec-*)    timeout 540 python3 -m fastmamba.bench spec --shapes "${step#spec-}" --json "$OUT/spec.jsonl" --markdown "$OUT/spec-${step#spec-}.md" >> "$OUT/spec.txt" 2>> "$OUT/spec.err"; echo "rc=$?"; tail -n 40 "$OUT/spec.txt" ;;
        e2e-spec)  for d in oracle ngram; do timeout 280 python3 -m fastmamba.bench e2e --batch 1 --gen-len 128 --speculate 5 --drafter $d --json "$OUT/e2e-spec.jsonl" >> "$OUT/e2e-spec.txt" 2>> "$OUT/e2e-spec.err"; echo "rc=$?"; done; cat "$OUT/e2e-spec.txt"; tail -3 "$OUT/e2e-spec.err" ;;
        e2e)       timeout 360 python3 -m fastmamba.bench e2e --peer --json "$OUT/e2e.jsonl" --plot "$OUT/e2e.png" > "$OUT/e2e.txt" 2> "$OUT/e2e.err"; echo "rc=$?"; cat "$OUT/e2e.txt"; tail -5 "$OUT/e2e.err" ;;
        ablate)    timeout 400 python3 -m fastmamba.bench e2e --batch 1 --ablate --json "$OUT/ablate.jsonl" > "$OUT/ablate.txt" 2> "$OUT/ablate.err"; echo "rc=$?"; cat "$OUT/ablate.txt"; tail -3 "$OUT/ablate.err" ;;
        host)      timeout 120 python3 -m fastmamba.bench host --device cuda > "$OUT/host.txt" 2>&1; echo "rc=$?"; cat "$OUT/host.txt" ;;
        tune-attention) timeout 280 python3 -m fastmamba.bench tune-attention --budget-s 100 > "$OUT/tune-attention.txt" 2>&1; echo "rc=$?"; tail -n 40 "$OUT/tune-attention.txt" ;;
        ttft)      timeout 500 python3 -m fastmamba.bench ttft --peer --json "$OUT/ttft.jsonl" > "$OUT/ttft.txt" 2> "$OUT/ttft.err"; echo "rc=$?"; cat "$OUT/ttft.txt"; tail -3 "$OUT/ttft.err" ;;
        ttftm-*)   timeout 400 python3 -m fastmamba.bench ttft --model "${step#ttftm-}" --shapes "${TTFT_SHAPES:-1x8192,8x2048}" ${E2E_ARGS:-} --json "$OUT/ttft.jsonl" >> "$OUT/ttft.txt" 2>> "$OUT/ttft.err"; echo "rc=$?"; tail -n 8 "$OUT/ttft.txt"; tail -3 "$OUT/ttft.err" ;;
        ttft-*)    timeout 400 python3 -m fastmamba.bench ttft --shapes "${step#ttft-}" --json "$OUT/ttft.jsonl" >> "$OUT/ttft.txt" 2>> "$OUT/ttft.err"; echo "rc=$?"; tail -n 14 "$OUT/ttft.txt"; tail -3 "$OUT/ttft.err" ;;
        serve)     timeout 500 python3 -m fastmamba.bench serve --json "$OUT/serve.jsonl" > "$OUT/serve.txt" 2> "$OUT/serve.err"; echo "rc=$?"; cat "$OUT/serve.txt"; tail -3 "$OUT/serve.err" ;;
        profile-graph) timeout 200 python3 -m fastmamba.bench profile graphed > "$OUT/profile-graph.txt" 2>&1; echo "rc=$?"; cat "$OUT/profile-graph.txt" ;;
        profile-eager) timeout 200 python3 -m fastmamba.bench profile eager --shapes 1x16,1x2048 --top 25 > "$OUT/profile-eager.txt" 2>&1; echo "rc=$?"; head -60 "$OUT/profile-eager.txt" ;;
        prefix)    timeout 400 python3 -m fastmamba.bench serve --shared-prefix 2048 --requests 16 --prompt-len 64 --output-len 16 --json "$OUT/prefix.jsonl" > "$OUT/prefix.txt" 2> "$OUT/prefix.err"; echo "rc=$?"; cat "$OUT/prefix.txt"; tail -3 "$OUT/prefix.err" ;;
        prefixm-*) timeout 500 python3 -m fastmamba.bench serve --model "${step#prefixm-}" --shared-prefix 2048 --requests 16 --prompt-len 64 --output-len 16 --json "$OUT/prefix.jsonl" >> "$OUT/prefix.txt" 2>> "$OUT/prefix.err"; echo "rc=$?"; tail -n 9 "$OUT/prefix.txt"; tail -3 "$OUT/prefix.err" ;;
        prefix-*)  timeout 400 python3 -m fastmamba.bench serve --shared-prefix 2048 --requests 16 --prompt-len 64 --output-len 16 --client "${step#prefix-}" --json "$OUT/prefix.jsonl" >> "$OUT/prefix.txt" 2>> "$OUT/prefix.err"; echo "rc=$?"; tail -n 9 "$OUT/prefix.txt"; tail -3 "$OUT/prefix.err" ;;
        chunked)   timeout 300 python3 -m fastmamba.bench chunked --json "$OUT/chunked.jsonl" > "$OUT/chunked.txt" 2> "$OUT/chunked.err"; echo "rc=$?"; cat "$OUT/chunked.txt" ;;
        # the GPU suite: `suite` (everything but $BIG in one pytest), then `suite-big`; or in parts, one call
        # each: suite-ops, suite-rest (or its halves suite-rest-a, suite-rest-b). H100, 2026-12-07, -n 14, the
        # Triton cache warm: suite-ops 214 s; suite-rest-a 480 s before the tests' CPU threads were limited
        # to a worker's share of the cores (14 x 16 threads: its CPU tests hit the 200 s timeout), its three
        # slowest files 21 s after; suite-rest-b 102 s. Keep SUITE_S 60 s under the call's limit (the cache is
        # tarred after it). --durations names the slowest tests; $OUT/failures.txt each failure as it happens.
        # SUITE_S / SUITE_N (environment): their cap in seconds and pytest-xdist workers. `suite` lists the tests
        # that passed or skipped in $OUT/suite-done.txt: copy it to .tcache/ and SUITE_RESUME=1 runs only the
        # rest (a suite cut at the call's limit goes on in the next call, same commit)
        suite)      if [ "${SUITE_RESUME:-0}" = 1 ] && [ -f .tcache/suite-done.txt ]; then
                        cp .tcache/suite-done.txt "$OUT/suite-done.txt"; export FASTMAMBA_RESUME_FROM=.tcache/suite-done.txt
                        echo "resuming: $(wc -l < .tcache/suite-done.txt) tests done before are left out"
                    fi
                    FASTMAMBA_DONE_LOG="$OUT/suite-done.txt" FASTMAMBA_FAILURE_LOG="$OUT/failures.txt" timeout -s INT ${SUITE_S:-520} python3 -m pytest -q -n ${SUITE_N:-14} --tb=short -rfEs --durations=40 --timeout 200 -p no:cacheprovider tests -k "not ($BIG)" > "$OUT/tests-suite.log" 2>&1; echo "rc=$?"; grep -E "^(FAILED|ERROR) |passed|failed" "$OUT/tests-suite.log" | cut -c1-250 | tail -n 40; unset FASTMAMBA_RESUME_FROM ;;
        suite-ops)  FASTMAMBA_FAILURE_LOG="$OUT/failures.txt" timeout -s INT ${SUITE_S:-500} python3 -m pytest -q -n ${SUITE_N:-12} --tb=short -rfEs --durations=25 --timeout 200 -p no:cacheprovider tests/ops > "$OUT/tests-ops.log" 2>&1; echo "rc=$?"; grep -E "^(FAILED|ERROR) |passed|failed" "$OUT/tests-ops.log" | cut -c1-250 | tail -n 40 ;;
        suite-rest) FASTMAMBA_FAILURE_LOG="$OUT/failures.txt" timeout -s INT ${SUITE_S:-500} python3 -m pytest -q -n ${SUITE_N:-12} --tb=short -rfEs --durations=40 --timeout 200 -p no:cacheprovider tests --ignore=tests/ops -k "not ($BIG)" > "$OUT/tests-rest.log" 2>&1; echo "rc=$?"; grep -E "^(FAILED|ERROR) |passed|failed" "$OUT/tests-rest.log" | cut -c1-250 | tail -n 40 ;;
        suite-rest-a) FASTMAMBA_FAILURE_LOG="$OUT/failures.txt" timeout -s INT ${SUITE_S:-500} python3 -m pytest -q -n ${SUITE_N:-12} --tb=short -rfEs --durations=30 --timeout 200 -p no:cacheprovider tests/generation tests/models tests/layers tests/cache tests/runtime -k "not ($BIG)" > "$OUT/tests-rest-a.log" 2>&1; echo "rc=$?"; grep -E "^(FAILED|ERROR) |passed|failed" "$OUT/tests-rest-a.log" | cut -c1-250 | tail -n 40 ;;
        suite-rest-b) FASTMAMBA_FAILURE_LOG="$OUT/failures.txt" timeout -s INT ${SUITE_S:-500} python3 -m pytest -q -n ${SUITE_N:-12} --tb=short -rfEs --durations=30 --timeout 200 -p no:cacheprovider tests --ignore=tests/ops --ignore=tests/generation --ignore=tests/models --ignore=tests/layers --ignore=tests/cache --ignore=tests/runtime -k "not ($BIG)" > "$OUT/tests-rest-b.log" 2>&1; echo "rc=$?"; grep -E "^(FAILED|ERROR) |passed|failed" "$OUT/tests-rest-b.log" | cut -c1-250 | tail -n 40 ;;
        suite-big) if [ "${SUITE_RESUME:-0}" = 1 ] && [ -f .tcache/big-done.txt ]; then
                       cp .tcache/big-done.txt "$OUT/big-done.txt"; export FASTMAMBA_RESUME_FROM=.tcache/big-done.txt
                       echo "resuming: $(wc -l < .tcache/big-done.txt) tests done before are left out"
                   fi
                   FASTMAMBA_DONE_LOG="$OUT/big-done.txt" FASTMAMBA_FAILURE_LOG="$OUT/failures.txt" timeout -s INT ${BIG_S:-450} python3 -m pytest -q -s -rs --durations=10 --timeout 280 -p no:cacheprovider tests -k "${BIG_K:-$BIG}" > "$OUT/tests-big.log" 2>&1; echo "rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|start-up|load" "$OUT/tests-big.log" | tail -n 40; unset FASTMAMBA_RESUME_FROM ;;
        tests-*)   FASTMAMBA_FAILURE_LOG="$OUT/failures.txt" timeout -s INT ${TESTS_S:-400} python3 -m pytest -q -n ${TESTS_N:-8} --tb=short -rfEs --timeout 200 -p no:cacheprovider ${step#tests-} >> "$OUT/tests.log" 2>&1; echo "rc=$?"; grep -E "^(FAILED|ERROR) |passed|failed" "$OUT/tests.log" | cut -c1-250 | tail -n 20 ;;
        crossover) FASTMAMBA_GIT_COMMIT=${FASTMAMBA_GIT_COMMIT:-unknown} timeout 400 python3 -m fastmamba.bench spec --shapes mamba2-2.7b,nemotron-h --tokens 2,4,6,8,16 --state fp32,fp16 --write-table > "$OUT/crossover.txt" 2> "$OUT/crossover.err"; echo "rc=$?"; tail -n 30 "$OUT/crossover.txt"; tail -3 "$OUT/crossover.err"; cp fastmamba/generation/verify_crossover.json "$OUT/" ;;
        eager-*)   timeout 540 python3 -m fastmamba.bench kernels --eager --quick --ops "${step#eager-}" --json "$OUT/eager.jsonl" > "$OUT/eager.txt" 2> "$OUT/eager.err"; echo "rc=$?"; cat "$OUT/eager.txt"; tail -3 "$OUT/eager.err" ;;
        moe)       timeout 300 python3 -m fastmamba.bench kernels --ops moe --json "$OUT/moe.jsonl" --markdown "$OUT/moe.md" > "$OUT/moe.txt" 2> "$OUT/moe.err"; echo "rc=$?"; cat "$OUT/moe.txt"; tail -3 "$OUT/moe.err" ;;
        e2em-*)    timeout 400 python3 -m fastmamba.bench e2e --model "${step#e2em-}" ${E2E_ARGS:-} --json "$OUT/e2e.jsonl" >> "$OUT/e2e.txt" 2>> "$OUT/e2e.err"; echo "rc=$?"; tail -n 12 "$OUT/e2e.txt"; tail -3 "$OUT/e2e.err" ;;
        e2ef-*)    timeout 400 python3 -m fastmamba.bench e2e --model "${step#e2ef-}" --quantization fp8 ${E2E_ARGS:-} --json "$OUT/e2e.jsonl" >> "$OUT/e2e.txt" 2>> "$OUT/e2e.err"; echo "rc=$?"; tail -n 12 "$OUT/e2e.txt"; tail -3 "$OUT/e2e.err" ;;
        e2ekv-*)   timeout 400 python3 -m fastmamba.bench e2e --model "${step#e2ekv-}" --kv-cache-dtype fp8 ${E2E_ARGS:-} --json "$OUT/e2e.jsonl" >> "$OUT/e2e.txt" 2>> "$OUT/e2e.err"; echo "rc=$?"; tail -n 12 "$OUT/e2e.txt"; tail -3 "$OUT/e2e.err" ;;
        profile-decode-*) timeout 300 python3 -m fastmamba.bench profile decode --model "${step#profile-decode-}" --batch 1 --timeline 60 ${PROFILE_ARGS:-} >> "$OUT/profile-decode.txt" 2>&1; echo "rc=$?"; head -n 80 "$OUT/profile-decode.txt" ;;
        mtp-*)     timeout ${MTP_S:-500} python3 -m fastmamba.bench mtp --model "${step#mtp-}" --k 1,2,3,4,5,6,7 --batch 1 --prompt-len 512 --steps 64 ${MTP_ARGS:-} --json "$OUT/mtp.jsonl" > "$OUT/mtp.txt" 2> "$OUT/mtp.err"; echo "rc=$?"; tail -n 30 "$OUT/mtp.txt"; tail -3 "$OUT/mtp.err" ;;
        tunemoe-*) timeout -s INT ${TUNE_S:-300} python3 -m fastmamba.bench tune --ops moe --batch ${TUNE_BATCH:-1,2,4} --cases "${step#tunemoe-}" --pdl > "$OUT/tune-moe.txt" 2>&1; echo "rc=$?"; tail -n 30 "$OUT/tune-moe.txt" ;;
        tunefp8)   timeout -s INT ${TUNE_S:-400} python3 -m fastmamba.bench tune --ops fp8 --pdl --cases "${TUNE_FP8_CASES:-nano}" ${TUNE_BATCH:+--batch $TUNE_BATCH} > "$OUT/tune-fp8.txt" 2>&1; echo "rc=$?"; tail -n 30 "$OUT/tune-fp8.txt" ;;
        tunegemv-*) timeout -s INT ${TUNE_S:-300} python3 -m fastmamba.bench tune --ops gemv --pdl --cases "${step#tunegemv-}" >> "$OUT/tune-gemv.txt" 2>&1; echo "rc=$?"; tail -n 40 "$OUT/tune-gemv.txt" ;;
        capacity-*) timeout 400 python3 -m fastmamba.bench capacity --model "${step#capacity-}" --context ${CAPACITY_CONTEXT:-8192} --startup ${E2E_ARGS:-} --json "$OUT/capacity.jsonl" >> "$OUT/capacity.txt" 2>> "$OUT/capacity.err"; echo "rc=$?"; tail -n 8 "$OUT/capacity.txt"; tail -3 "$OUT/capacity.err" ;;
        e2esuper)  timeout 540 python3 -m fastmamba.bench e2e --model nemotron-3-super --quantization fp8 --batch ${SUPER_BATCH:-1,64} --ssm-dtype fp16 --kv-cache-dtype fp8 --json "$OUT/e2e.jsonl" >> "$OUT/e2e.txt" 2>> "$OUT/e2e.err"; echo "rc=$?"; tail -n 12 "$OUT/e2e.txt"; tail -5 "$OUT/e2e.err" ;;
        apply-*)   python3 scripts/apply_tune_table.py "$OUT/tune-${step#apply-}.txt"; echo "rc=$?" ;;
        fp8err-*)  timeout 400 python3 -m fastmamba.bench fp8-error --model "${step#fp8err-}" --json "$OUT/fp8err.jsonl" > "$OUT/fp8err.txt" 2> "$OUT/fp8err.err"; echo "rc=$?"; cat "$OUT/fp8err.txt"; tail -3 "$OUT/fp8err.err" ;;
        fp8moe)    timeout 300 python3 -m fastmamba.bench fp8 --kinds moe --batch 1,4,16,17,64,256,1024,4096 > "$OUT/fp8moe.txt" 2> "$OUT/fp8moe.err"; echo "rc=$?"; tail -n 40 "$OUT/fp8moe.txt"; tail -3 "$OUT/fp8moe.err" ;;
        hf-*)      timeout 400 python3 -m fastmamba.bench hf --model "${step#hf-}" --batch 1,16 --new-tokens 256 --repeats 1 --json "$OUT/hf.jsonl" >> "$OUT/hf.txt" 2>> "$OUT/hf.err"; echo "rc=$?"; tail -n 12 "$OUT/hf.txt"; tail -3 "$OUT/hf.err" ;;
        *)         echo "unknown step $step" ;;
    esac
done
XZ_OPT=-T0 tar -cJf - --exclude='*.ttir' --exclude='*.ttgir' --exclude='*.llir' --exclude='*.ptx' \
    --exclude='*.source' -C "$TRITON_CACHE_DIR" . 2>/dev/null | split -b 15M -d - "$OUT/triton-cache.txz.part"
ls -la "$OUT"
