#!/usr/bin/env bash
# The one GPU check (issue 23), from a clean checkout, in at most ~8 minutes on one GPU.
#
#   tools/gpu_check.sh                 # on a GPU machine: set up, run python -m tools.gpu_check, write OUT
#   tools/gpu_check.sh --dry-run       # the same code paths on CPU at tiny sizes (about a minute)
#
# Writes $OUT_DIR/gpu_check.json and $OUT_DIR/gpu_check.txt (tools/gpu_check.py says what each
# section checks) and the CUDA test of the memory adapter (tests/test_device_memory.py). Exits
# non-zero when a check failed. Runs from the repository root (where `-m tools.gpu_check` resolves).
#
# Setup. The venv is $VENV. Where the machine's python already imports a CUDA build of torch, the
# venv sees it (--system-site-packages) and nothing is downloaded; otherwise $TORCH_SPEC is
# installed from $TORCH_INDEX_URL (PyTorch's CUDA wheel index; empty: pip's default index) or
# from a local wheel file named by $TORCH_WHEEL. The toolkit itself installs with its test extras,
# or without dependencies when they are importable already (a machine with no network).
set -euo pipefail

TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"                               # the CUDA build to install if none is there
TORCH_INDEX_URL="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cu128}"  # CUDA 12.8 wheels
TORCH_WHEEL="${TORCH_WHEEL:-}"                                          # or a local .whl (no network)
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv-gpu}"
OUT_DIR="${OUT_DIR:-${OUT:-runs/gpu_check}}"
CHECK_TIMEOUT_S="${CHECK_TIMEOUT_S:-420}"                               # the check itself; setup comes first

cd "$(dirname "$0")/.."
DRY=""
if [[ "${1:-}" == "--dry-run" ]]; then
    DRY="--dry-run"
    VENV="${VENV_DRY:-.venv}"                                           # make setup's CPU venv
fi
mkdir -p "$OUT_DIR"
start=$(date +%s)

has_cuda_torch() { "$1" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }

if [[ -n "$DRY" ]]; then
    [[ -x "$VENV/bin/python" ]] || make setup
elif [[ ! -x "$VENV/bin/python" ]] || ! has_cuda_torch "$VENV/bin/python"; then
    if has_cuda_torch "$PYTHON"; then
        "$PYTHON" -m venv --system-site-packages "$VENV"                 # the machine's own CUDA torch
    else
        "$PYTHON" -m venv "$VENV"
        if [[ -n "$TORCH_WHEEL" ]]; then
            "$VENV/bin/python" -m pip install -q "$TORCH_WHEEL"
        elif [[ -n "$TORCH_INDEX_URL" ]]; then
            "$VENV/bin/python" -m pip install -q "$TORCH_SPEC" --index-url "$TORCH_INDEX_URL"
        else
            "$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
        fi
    fi
    if "$VENV/bin/python" -c 'import datasets, tokenizers, safetensors, pytest' 2>/dev/null; then
        "$VENV/bin/python" -m pip install -q --no-deps -e .
    else
        "$VENV/bin/python" -m pip install -q -e ".[test]"
    fi
fi
PY="$VENV/bin/python"
"$PY" -c 'import torch; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs {torch.cuda.device_count()}")'
echo "setup: $(( $(date +%s) - start )) s"

status=0
timeout "$CHECK_TIMEOUT_S" "$PY" -m tools.gpu_check $DRY --out "$OUT_DIR" || status=$?
"$PY" -m pytest -q -p no:cacheprovider tests/test_device_memory.py 2>&1 | tail -3 | tee "$OUT_DIR/test_device_memory.txt" \
    || status=1
echo "gpu_check.sh: $(( $(date +%s) - start )) s in all, exit $status; $OUT_DIR/gpu_check.json"
exit "$status"
