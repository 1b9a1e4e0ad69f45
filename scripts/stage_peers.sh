#!/usr/bin/env bash
# Put the peers' wheels for benchmarks/peers.py into .peers/ (git-ignored), to copy along to a
# GPU machine without a package index and install them there:
#   bash scripts/stage_peers.sh            # here, with an index
#   bash scripts/gpu_check.sh peers        # there, with .peers/: pip install --no-index --no-deps
# Both are pure Python (py3-none-any) and need nothing beyond torch and flash-attn 2 (installed
# there separately); ring-flash-attn's package __init__ also imports transformers for its HF
# adapter, which peers.py does without when that import fails. Versions: the ones the harness's
# calls were written against (pyproject.toml, extra "peers").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
rm -rf .peers && mkdir .peers
$PY -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .peers \
    ring-flash-attn==0.1.8 yunchang==0.6.4
ls -la .peers
