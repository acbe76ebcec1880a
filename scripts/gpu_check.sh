#!/usr/bin/env bash
# One call that checks onebit's CUDA path on a bare GPU machine, in at most ~8 minutes.
#
#   bash scripts/gpu_check.sh          # results under $OUT if set, else runs/gpu_check/
#
# Needs a Python (python3, or $PYTHON) with torch (a CUDA build), CuPy (cupy-cuda12x/13x), numpy and
# pytest; nothing of onebit installed: it runs this checkout through PYTHONPATH and installs nothing.
# One GPU is enough and more are not used: NCCL cannot run 2 ranks on one GPU, so the 2-rank checks
# use 2 gloo ranks sharing it, and NCCL runs only as a single-rank group (the benchmark). MPI is
# not exercised.
#
# Steps, each with its own time limit (7.7 minutes in all):
#   1. environment    nvidia-smi, versions, the device                            env.txt
#   2. preflight      CuPy runs on the device and compiles onebit's CUDA kernels   preflight.log
#   3. kernel tests   tests/test_kernels.py -k cuda: the CUDA kernels equal the reference bit
#                     for bit (every shape class, odd sizes, segment tables, zero and subnormal
#                     scales, keep masks)                                          kernels.log/.xml
#   4. CUDA tests     tests/test_cuda.py: the three optimizers on CUDA tensors (= reference
#                     kernels bit for bit, = CPU within tolerance; one gloo rank, and 2 gloo
#                     ranks on the one GPU; overlap_backward's staged errors), the codec on
#                     torch's streams without waiting                             cuda.log/.xml
#   5. benchmark      benchmarks/gpu_codec.py: worker/server/decode per element; a compression
#                     step vs all_reduce + torch Adam on a 100M-parameter bucket   gpu_codec.json/.md
# The summary (one screen) is printed last and kept in summary.txt.
#
# Exit codes: 0 every step passed; 1 a step failed or ran out of time; 3 no usable GPU here (nothing
# ran); 4 a prerequisite is missing (Python, torch, numpy, pytest, CuPy).
#
# GPU_CHECK_DRY_RUN=1 runs the same steps without a GPU (the GPU tests skip, the benchmark runs
# small on the CPU): tests/test_gpu_check.py uses it to check this script where there is no GPU.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-$(command -v python3 || command -v python || true)}"
if [ -z "$PYTHON" ] || ! "$PYTHON" -c "import sys; sys.exit(sys.version_info < (3, 10))" 2>/dev/null; then
    echo "gpu_check: no Python 3.10+ to run (python3 or python on the PATH, or \$PYTHON=${PYTHON:-unset})" >&2
    exit 4
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
unset ONEBIT_KERNELS  # "auto" must mean auto
export PYTHONDONTWRITEBYTECODE=1

"$PYTHON" scripts/gpu_env.py detect
detected=$?
if [ "$detected" -ne 0 ]; then
    exit "$detected"
fi

OUT_DIR="${OUT:-$ROOT/runs/gpu_check}"
mkdir -p "$OUT_DIR"
# A previous run's results must not pass for this one's.
rm -f "$OUT_DIR"/{env.txt,summary.txt,gpu_codec.json,gpu_codec.md,gpu_codec_summary.txt} "$OUT_DIR"/*.log "$OUT_DIR"/*.xml
START=$SECONDS
declare -a ROWS=()
FAILED=0
PYTEST=("$PYTHON" -m pytest -q -rfEs -p no:cacheprovider -W "ignore::pytest.PytestConfigWarning")

# On a GPU, a test skipped for want of one means the GPU path did not run: that fails the step.
GPU_SKIPS='SKIPPED.*(no CUDA device|CuPy is not installed|the real CUDA kernels run only on a GPU)'

# run NAME LIMIT LOG CMD...: runs CMD with a time limit, its output in LOG; records a summary row.
run() {
    local name="$1" limit="$2" log="$3"
    shift 3
    local began=$SECONDS status detail
    printf '[%s] %s (limit %ss) ... ' "$(date -u +%H:%M:%S)" "$name" "$limit"
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
    status=$?
    if [ "$status" -eq 0 ] && [ "${GPU_CHECK_DRY_RUN:-0}" != 1 ] && grep -Eq "$GPU_SKIPS" "$log"; then
        status=1
        echo "(tests skipped as if there were no GPU:)" >>"$log"
        grep -E "$GPU_SKIPS" "$log" | head -n 5 >>"$log"
    fi
    case $status in
        0) detail=PASS ;;
        124 | 137) detail=TIMEOUT; FAILED=1 ;;
        *) detail="FAIL (exit $status)"; FAILED=1 ;;
    esac
    echo "$detail, $((SECONDS - began)) s"
    if [ "$status" -ne 0 ]; then
        echo "---- last lines of $log ----"
        tail -n 25 "$log"
        echo "----"
    fi
    local last
    last="$(grep -E '\b(passed|failed|errors?|skipped|no tests ran)\b' "$log" | tail -n 1)"
    [ -z "$last" ] && last="$(tail -n 1 "$log")"
    ROWS+=("$(printf '%-13s %-16s %4ss  %s' "$name" "$detail" "$((SECONDS - began))" "${last:0:90}")")
}

{
    echo "== nvidia-smi =="
    nvidia-smi 2>&1 || echo "(nvidia-smi failed or is missing)"
    echo "== versions =="
} >"$OUT_DIR/env.txt"
run environment 20 "$OUT_DIR/env.log" "$PYTHON" scripts/gpu_env.py env
cat "$OUT_DIR/env.log" >>"$OUT_DIR/env.txt"
run preflight 60 "$OUT_DIR/preflight.log" "$PYTHON" scripts/gpu_env.py preflight
if [ "$FAILED" -eq 0 ]; then
    run "kernel tests" 90 "$OUT_DIR/kernels.log" "${PYTEST[@]}" tests/test_kernels.py -k "cuda and not host" \
        --junitxml "$OUT_DIR/kernels.xml"
    run "CUDA tests" 150 "$OUT_DIR/cuda.log" "${PYTEST[@]}" tests/test_cuda.py --junitxml "$OUT_DIR/cuda.xml"
    if [ "${GPU_CHECK_DRY_RUN:-0}" = 1 ]; then
        BENCH_ARGS=(--device cpu --sizes 65536 --params 65536 --repeats 1)
    else
        BENCH_ARGS=()
    fi
    run benchmark 140 "$OUT_DIR/benchmark.log" "$PYTHON" benchmarks/gpu_codec.py --out "$OUT_DIR" \
        ${BENCH_ARGS[@]+"${BENCH_ARGS[@]}"}
else
    ROWS+=("(a step above failed: the tests and the benchmark did not run)")
fi

{
    echo "==== onebit GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), $((SECONDS - START)) s ===="
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
    sed 's/^/    /' "$OUT_DIR/env.log"
    echo
    for row in "${ROWS[@]}"; do
        echo "$row"
    done
    if [ -f "$OUT_DIR/gpu_codec_summary.txt" ]; then
        echo
        cat "$OUT_DIR/gpu_codec_summary.txt"
    fi
    echo
    if [ "${GPU_CHECK_DRY_RUN:-0}" = 1 ]; then
        echo "DRY RUN (GPU_CHECK_DRY_RUN=1): nothing ran on a GPU"
    fi
    if [ "$FAILED" -eq 0 ]; then
        echo "RESULT: PASS (results in $OUT_DIR)"
    else
        echo "RESULT: FAIL (logs in $OUT_DIR)"
    fi
} | tee "$OUT_DIR/summary.txt"
exit "$FAILED"
