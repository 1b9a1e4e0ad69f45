#!/usr/bin/env bash
# Put a flash-attn 2 wheel into .fa2/ (git-ignored), to copy along to a GPU machine.
#   bash scripts/stage_fa2.sh path/to/flash_attn-*.whl
# Build such a wheel with scripts/build_fa2_wheel.sh when none exists for the target torch.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 1 ] && [ -f "$1" ] || { echo "usage: $0 path/to/flash_attn-*.whl" >&2; exit 2; }
rm -rf .fa2 && mkdir .fa2 && cp "$1" .fa2/
ls -la .fa2
