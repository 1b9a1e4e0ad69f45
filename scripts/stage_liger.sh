#!/usr/bin/env bash
# Put the liger-kernel wheel into .liger/ (git-ignored), to copy along to a GPU machine that has
# no package index. Its other requirements (torch, triton, packaging) are
# already there, so only liger-kernel itself is staged (pure Python, any platform).
#   bash scripts/stage_liger.sh        # then copy .liger/ along; gpu_check.sh train26 installs it
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(sed -n 's/^gpu = \["liger-kernel==\([^"]*\)"\]$/\1/p' pyproject.toml)
[ -n "$version" ] || { echo "pyproject.toml has no gpu = [\"liger-kernel==X\"] extra" >&2; exit 2; }
rm -rf .liger && mkdir .liger
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    "liger-kernel==$version" -d .liger
ls -la .liger
