#!/usr/bin/env bash
# The GPU smoke check (bench/gpu_smoke.py says what it runs and promises): a pipeline against train-local on the
# same GPU, bit for bit in fp32 and bf16, on two GPUs where there are two, and a ~85M llama's tokens/s and GPU busy
# share. One JSON line per check. Exit codes: 0 every check held, 1 an exactness check failed, 3 skipped (no CUDA
# device; --device cpu runs the checks' logic on the CPU). Usage: bench/gpu_smoke.sh [--device cuda] [--steps N]
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python=python
[ -x .venv/bin/python ] && python=.venv/bin/python  # the checkout's `make venv`, where there is one
exec "${PYTHON:-$python}" bench/gpu_smoke.py "$@"
