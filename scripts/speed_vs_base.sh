#!/usr/bin/env bash
# HEAD's speed against a base commit, both measured in one GPU job (issue 49: "speed unchanged").
#
# Here (no GPU needed), once:   bash scripts/speed_vs_base.sh prepare 6625510
#   writes the base commit's fastmamba/ package into .base/ (git-ignored, about 2 MB, `git archive`),
#   with .base/COMMIT naming it; the device call carries it: carry [".base", ".whl", "peers"].
# On the device:                bash scripts/speed_vs_base.sh run STEP...
#   every STEP runs one bench command twice, each in a fresh python3 process started from an empty
#   directory (so the working directory cannot shadow either package): once with PYTHONPATH=.base
#   (the base package), once with PYTHONPATH=$PWD (HEAD), base first; SPEED_ROUNDS=2 repeats it
#   HEAD first (ABBA; the table takes the median per side). Same command, same flags, both sides;
#   each side's import path is checked before it runs. Nothing is left running between runs.
#   Results: $OUT/speed-base.jsonl, $OUT/speed-head.jsonl (the benches' --json rows), $OUT/speed.log
#   (every run's stdout and stderr), $OUT/speed.md (the table), $OUT/triton-cache.txz.part* (as gpu_session.sh).
#
# Steps (estimated device time for BOTH sides, one round, H100, Triton cache cold; not yet measured:
# replace with the wall times of the first run):
#   e2e-<model>[@<batches>]  python3 -m fastmamba.bench e2e --model <model> --batch <batches, default
#                            1,8,64,256> --json ...   e2e-mamba2-2.7b ~3 min; e2e-nemotron-h-8b ~5-6 min
#                            (prompts of 2048 tokens; if it runs long, split: e2e-nemotron-h-8b@1,8 and
#                            e2e-nemotron-h-8b@64,256, ~3 min each)
#   ttft[-<model>]           python3 -m fastmamba.bench ttft --model <model, default mamba2-2.7b> --shapes
#                            ${SPEED_TTFT_SHAPES:-1x128,1x2048} --json ...   ~2 min
#   serve[-<model>]          python3 -m fastmamba.bench serve --model <model, default mamba2-2.7b> --json ...
#                            (the default load test: 256 requests, 64 clients, 512 / 128 tokens)   ~5 min
#   all                      the four above in one call (~16 min: too long for one call; use three:
#                            "e2e-mamba2-2.7b ttft", "e2e-nemotron-h-8b", "serve")
# Each run is cut at SPEED_TIMEOUT seconds (default 270), so a step stays under ~9 minutes.
# The table again, over several calls' files:
#   python3 scripts/speed_table.py --base A/speed-base.jsonl B/speed-base.jsonl --head A/speed-head.jsonl ...
# SPEED_E2E_ARGS / SPEED_SERVE_ARGS are appended to every e2e / serve step, both sides alike (e.g.
# SPEED_E2E_ARGS="--prompt-len 512 --gen-len 64": shorter prefills and runs, when the device time is short).
# Environment: OUT (default /tmp/fastmamba-out), SPEED_ROUNDS (1), SPEED_TIMEOUT (270 s a run), SPEED_TTFT_SHAPES,
# PYTHON (python3), SPEED_BASE_DIR (.base; tests/scripts/test_speed_vs_base.py points it at a temporary folder).
# CPU dry run (the tiny presets, TRITON_INTERPRET=1; the benches' CPU defaults: checks the plumbing only):
#   OUT=/tmp/s SPEED_TTFT_SHAPES=1x8 bash scripts/speed_vs_base.sh run e2e-mamba2-tiny@1 ttft-mamba2-tiny
set -u
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
BASE_DIR=${SPEED_BASE_DIR:-$ROOT/.base}  # (tests point it elsewhere)
PY=${PYTHON:-python3}

prepare() {
    local rev=${1:?usage: speed_vs_base.sh prepare COMMIT}
    local commit
    commit=$(git -C "$ROOT" rev-parse --verify --quiet "$rev^{commit}") || { echo "error: $rev is not a commit" >&2; return 2; }
    case "$BASE_DIR" in "$ROOT"/*)
        git -C "$ROOT" check-ignore -q "$BASE_DIR/" || { echo "error: $BASE_DIR is not git-ignored (add it to .gitignore)" >&2; return 2; } ;;
    esac
    rm -rf "$BASE_DIR/fastmamba"
    mkdir -p "$BASE_DIR"
    git -C "$ROOT" archive --format=tar "$commit" fastmamba | tar -x -C "$BASE_DIR" || return 1
    echo "$commit" > "$BASE_DIR/COMMIT"
    echo "base $commit: $(find "$BASE_DIR/fastmamba" -name '*.py' | wc -l) .py files, $(du -sh "$BASE_DIR" | cut -f1) in $BASE_DIR"
}

# one side of one step: label (base|head), package root, bench arguments...
run_side() {
    local side=$1 src=$2; shift 2
    local pp="$src${SITE:+:$SITE}" got rc
    src=$(cd "$src" && pwd -P)
    got=$(cd "$CWD" && PYTHONPATH="$pp" "$PY" -c 'import os, fastmamba; print(os.path.dirname(os.path.dirname(os.path.realpath(fastmamba.__file__))))' 2>&1)
    if [ "$got" != "$src" ]; then
        echo "error: $side imports fastmamba from '$got', expected $src" | tee -a "$OUT/speed.log"
        return 1
    fi
    local left=""
    command -v nvidia-smi >/dev/null && left=$(nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader 2>/dev/null)
    [ -n "$left" ] && echo "warning: processes still on the GPU before this run: $left" | tee -a "$OUT/speed.log"
    echo "--- $side ($src): $PY -m fastmamba.bench $* --json speed-$side.jsonl" | tee -a "$OUT/speed.log"
    # timeout signals its whole process group (the serve bench's server too), then kills what is left
    (set -o pipefail; cd "$CWD" && PYTHONPATH="$pp" timeout -k 30 "$SPEED_TIMEOUT" \
        "$PY" -m fastmamba.bench "$@" --json "$OUT/speed-$side.jsonl" 2>> "$OUT/speed.log" | tee -a "$OUT/speed.log")
    rc=$?
    echo "rc=$rc" | tee -a "$OUT/speed.log"
    return 0
}

# the bench arguments of one step (printed one per line), or nothing for an unknown step
step_args() {
    local step=$1 model batches
    case "$step" in
        e2e-*)  model=${step#e2e-}; batches=1,8,64,256
                if [[ $model == *@* ]]; then batches=${model#*@}; model=${model%%@*}; fi
                printf '%s\n' e2e --model "$model" --batch "$batches" ${SPEED_E2E_ARGS:-} ;;
        ttft)   step_args ttft-mamba2-2.7b ;;
        ttft-*) printf '%s\n' ttft --model "${step#ttft-}" --shapes "${SPEED_TTFT_SHAPES:-1x128,1x2048}" ;;
        serve)  step_args serve-mamba2-2.7b ;;
        serve-*) printf '%s\n' serve --model "${step#serve-}" ${SPEED_SERVE_ARGS:-} ;;
    esac
}

run_steps() {
    export PYTHONUNBUFFERED=1
    OUT=${OUT:-/tmp/fastmamba-out}; mkdir -p "$OUT"
    SPEED_TIMEOUT=${SPEED_TIMEOUT:-270}
    local rounds=${SPEED_ROUNDS:-1}
    [ -f "$BASE_DIR/fastmamba/__init__.py" ] || { echo "error: no $BASE_DIR/fastmamba: run 'scripts/speed_vs_base.sh prepare COMMIT' here and carry .base" >&2; return 2; }
    SITE=""
    if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then  # the optional peers, as gpu_session.sh installs them
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$ROOT"/.whl/*.whl \
            && SITE=/tmp/site
    fi
    export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
    mkdir -p "$TRITON_CACHE_DIR"
    ls "$ROOT"/.tcache/triton-cache.txz.part* >/dev/null 2>&1 \
        && cat "$ROOT"/.tcache/triton-cache.txz.part* | tar -xJf - -C "$TRITON_CACHE_DIR"
    touch "$OUT/speed-base.jsonl" "$OUT/speed-head.jsonl"
    CWD=$(mktemp -d /tmp/speed-cwd.XXXXXX)  # empty: `python3 -m` puts the working directory first on sys.path
    local steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(all)
    [ "${steps[*]}" = all ] && steps=(e2e-mamba2-2.7b e2e-nemotron-h-8b ttft serve)
    { command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
      # (the device machine's copy carries the working tree; its .git may name an older commit: say so when the tree differs)
      echo "base $(cat "$BASE_DIR/COMMIT" 2>/dev/null || echo '(unknown)'), head $(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo '(working tree, no .git)')$( [ -n "$(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null)" ] && echo ' + a working tree that differs from it')"
      "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } 2>&1 | tee -a "$OUT/speed.log"
    local step r
    local -a args
    for step in "${steps[@]}"; do
        mapfile -t args < <(step_args "$step")
        if [ ${#args[@]} -eq 0 ]; then echo "unknown step $step" | tee -a "$OUT/speed.log"; continue; fi
        for ((r = 1; r <= rounds; r++)); do
            echo "=== $step round $r $(date +%T)" | tee -a "$OUT/speed.log"
            if ((r % 2)); then
                run_side base "$BASE_DIR" "${args[@]}"; run_side head "$ROOT" "${args[@]}"
            else
                run_side head "$ROOT" "${args[@]}"; run_side base "$BASE_DIR" "${args[@]}"
            fi
        done
    done
    rmdir "$CWD" 2>/dev/null
    "$PY" "$ROOT/scripts/speed_table.py" --base "$OUT/speed-base.jsonl" --head "$OUT/speed-head.jsonl" | tee "$OUT/speed.md"
    XZ_OPT=-T0 tar -cJf - --exclude='*.ttir' --exclude='*.ttgir' --exclude='*.llir' --exclude='*.ptx' \
        --exclude='*.source' -C "$TRITON_CACHE_DIR" . 2>/dev/null | split -b 15M -d - "$OUT/triton-cache.txz.part"  # as gpu_session.sh
    ls -la "$OUT"
}

case "${1:-}" in
    prepare) shift; prepare "$@" ;;
    run)     shift; run_steps "$@" ;;
    *)       echo "usage: $0 prepare COMMIT | run STEP... (see the header)" >&2; exit 2 ;;
esac
