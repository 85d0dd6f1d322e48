#!/usr/bin/env bash
# The GPU checks, on a CUDA machine that has torch and Triton but no vLLM (and no network): the package is laid out
# in a temporary folder as `pip install` would (kernels/ -> rcstat_vllm/kernels), nothing is installed.
#   bash benchmarks/gpu_check.sh [results folder] [gpu_check.py args]   (default benchmarks/results; all parts)
# Writes gpu_check_<card>.json and scoring_cuda_<card>.json there and prints the compiled kernel tests' summary.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RESULTS="$(realpath -m "${1:-$ROOT/benchmarks/results}")"
shift || true
cd "$ROOT"
PKG="$(mktemp -d)"
trap 'rm -rf "$PKG"' EXIT
cp -r rcstat_vllm "$PKG/"
cp -r kernels "$PKG/rcstat_vllm/kernels"
export PYTHONPATH="$PKG:$ROOT" PYTHONUNBUFFERED=1
PYTHON="${PYTHON:-python3}"
CARD="$("$PYTHON" -c 'import re, torch; n = torch.cuda.get_device_name(); m = re.search(r"\b[A-Z]\d{2,4}\b", n); print((m.group(0) if m else n.split()[-1]).lower())')"
mkdir -p "$RESULTS"
echo "[gpu_check] card: $CARD; results in $RESULTS"
# Each step runs whatever the one before found (device time is scarce); the exit status says whether any failed.
failed=()
# From the package copy's folder: pytest puts the working directory first on sys.path, and the checkout's own
# rcstat_vllm/ has no kernels/ inside.
(cd "$PKG" && TRITON_INTERPRET=0 "$PYTHON" -m pytest -q -p no:cacheprovider --rootdir "$ROOT" "$ROOT/tests/test_kernels.py") ||
    failed+=("compiled kernel tests")
"$PYTHON" benchmarks/gpu_check.py --json "$RESULTS/gpu_check_$CARD.json" "$@" || failed+=("gpu_check.py")
"$PYTHON" benchmarks/scoring.py --sizes 4096,16384,65536,131072 --json "$RESULTS/scoring_cuda_$CARD.json" ||
    failed+=("scoring.py")
if [ ${#failed[@]} -gt 0 ]; then
    echo "[gpu_check] FAILED: ${failed[*]}"
    exit 1
fi
echo "[gpu_check] all passed"
