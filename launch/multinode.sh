#!/usr/bin/env bash
# Multi-node with torchrun's c10d rendezvous. Run the same command on every node; the node whose
# address is RDZV_ENDPOINT hosts the rendezvous, node ranks are assigned automatically.
#
#   # on each of 2 nodes (head node reachable as node0):
#   NNODES=2 RDZV_ENDPOINT=node0:29400 JOB_ID=gemma2-42 launch/multinode.sh --cp 16 --ckpt-dir /shared/ckpt
#
# NNODES        number of nodes (required; "MIN:MAX" for elastic)
# RDZV_ENDPOINT host:port of the rendezvous, reachable from all nodes (required)
# JOB_ID        a string shared by the nodes of one job (default: gemma2)
# NPROC         processes per node (default: number of GPUs, or 8 without GPUs: CPU + gloo)
# NODE_RANK     optional fixed node rank (c10d assigns one otherwise)
# SCRIPT        training script (default: examples/gemma2/train.py)
# Checkpoints (--ckpt-dir) must be on a filesystem that all nodes share.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
: "${NNODES:?set NNODES, e.g. NNODES=2}"
: "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port of the rendezvous (reachable from every node)}"
if [ -z "${NPROC:-}" ]; then
  NPROC=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
  [ "$NPROC" -gt 0 ] || NPROC=8
fi
EXTRA=()
[ -n "${NODE_RANK:-}" ] && EXTRA+=(--node-rank "$NODE_RANK")
exec "$PY" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$NPROC" \
  --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "${JOB_ID:-gemma2}" \
  "${EXTRA[@]}" "${SCRIPT:-examples/gemma2/train.py}" "$@"
