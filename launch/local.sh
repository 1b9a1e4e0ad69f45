#!/usr/bin/env bash
# Single node, any number of processes. Arguments after the options go to the training script.
#
#   launch/local.sh                         # 8 ranks (or one per GPU), tiny Gemma2, cp = all ranks
#   NPROC=4 launch/local.sh --cp 2 --max-steps 200 --ckpt-dir runs/ckpt
#   SCRIPT=my_train.py NPROC=2 launch/local.sh --my-flag
#
# NPROC   processes on this node (default: number of GPUs, or 8 without GPUs: CPU + gloo)
# SCRIPT  training script (default: examples/gemma2/train.py)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
if [ -z "${NPROC:-}" ]; then
  NPROC=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
  [ "$NPROC" -gt 0 ] || NPROC=8
fi
SCRIPT=${SCRIPT:-examples/gemma2/train.py}
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" "$SCRIPT" "$@"
