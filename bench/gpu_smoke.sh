#!/usr/bin/env bash
# A GPU smoke run: the 3-node demo with every node on --device cuda in bf16, against train-local in bf16 on the same
# GPU; prints both runs' losses and tokens/s as the commands print them (JSON lines). Needs a CUDA build of torch and
# a GPU; without one it stops at once with one line, exit 2. Usage: bench/gpu_smoke.sh [STEPS] [DEVICE]
set -euo pipefail
steps="${1:-40}"
device="${2:-cuda}"
python="${PYTHON:-python}"
"$python" - "$device" <<'PY' || exit 2
import sys, torch
from geotrain.node.device import DeviceError, describe, resolve_device, supports
try:
    device = resolve_device(sys.argv[1])
except DeviceError as e:
    sys.exit(f"gpu_smoke: {e}")
if device.type != "cuda":
    sys.exit(f"gpu_smoke: {describe(device)} is not a CUDA device")
if not supports(device, "bf16"):
    sys.exit(f"gpu_smoke: {describe(device)} cannot compute in bf16")
print(f"gpu_smoke: {describe(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
PY
settings=(--steps "$steps" --set train.precision=bf16 --json)
echo "demo (3 nodes, --device $device, bf16):"
"$python" -m geotrain demo --nodes 3 --device "$device" "${settings[@]}" | tail -n 1
echo "train-local (--device $device, bf16):"
"$python" -m geotrain train-local --device "$device" "${settings[@]}" | tail -n 1
