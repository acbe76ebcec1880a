#!/usr/bin/env bash
# Developer entry point; works on a fresh machine with only python3 (3.10+) and pip.
#
#   bash scripts/dev.sh setup   # create .venv, install torch first, then onebit with its extras
#   bash scripts/dev.sh test    # setup, then lint and run the whole test suite (gloo and MPI ranks)
#   bash scripts/dev.sh demo    # setup, then the demo: 2 CPU ranks with gloo, no cluster needed
#
# TORCH_SPEC chooses the torch build (default torch==2.13.0: the CPU wheel these machines carry;
# installing torch first keeps pip from pulling the CUDA build). ONEBIT_VENV moves the venv.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ONEBIT_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
EXTRAS="${ONEBIT_EXTRAS:-test,mpich,examples,lightning,deepspeed,docs}"

setup() {
    if [ ! -x "$VENV/bin/python" ]; then
        "$PYTHON" -m venv "$VENV"
    fi
    if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
        "$VENV/bin/pip" install --quiet --disable-pip-version-check "$TORCH_SPEC"
    fi
    "$VENV/bin/pip" install --quiet --disable-pip-version-check -e "$ROOT[$EXTRAS]"
}

run_tests() {
    setup
    cd "$ROOT"
    "$VENV/bin/flake8" onebit tests examples benchmarks
    export PATH="$VENV/bin:$PATH"  # mpiexec from the mpich wheel
    "$VENV/bin/python" -m pytest "$@"
}

demo() {
    setup
    cd "$ROOT"
    export PATH="$VENV/bin:$PATH"
    "$VENV/bin/python" examples/bert/compare.py --steps "${DEMO_STEPS:-600}" --out runs/demo --world-size 2 "$@"
}

case "${1:-}" in
    setup) setup ;;
    test) shift; run_tests "$@" ;;
    demo) shift; demo "$@" ;;
    *) echo "usage: bash scripts/dev.sh {setup|test|demo} [args]" >&2; exit 2 ;;
esac
