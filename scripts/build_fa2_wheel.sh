#!/usr/bin/env bash
# Build a flash-attn 2 wheel for a GPU machine that has no package index, on a machine that has
# nvcc and the target Python, against the exact torch build the GPU machine runs.
#
#   bash scripts/build_fa2_wheel.sh                      # defaults below: sm90, torch 2.11.0, py3.12
#   TORCH_SPEC=torch==2.11.0 ARCHS=90 PY=python3.12 JOBS=2 TRIM=1 bash scripts/build_fa2_wheel.sh
#   nohup bash scripts/build_fa2_wheel.sh > fa2_build.log 2>&1 &      # 35-90 min on 2 cores
#
# The wheel lands in $OUT_DIR (default .gpu_wheels/, git-ignored), where scripts/stage_gpu_extras.py
# packs it with the other GPU extras for a machine without a package index (docs/gpu.md).
#
# TRIM=1 (default) builds a TEST wheel: head-dim tiles 64/128/256 only and dropout/ALiBi compiled
# out, which halves the number of CUDA files and cuts each one by about a third. Head dims other
# than 64/128/256 then run on the next larger tile (correct, a little slower), and calls with
# dropout or ALiBi raise. TRIM=0 builds upstream's full wheel (about 4x longer). The library never
# uses dropout or ALiBi; softcap, local (window) attention, the backward and uneven K are always
# built, because the library needs each of them.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
FA_VERSION=${FA_VERSION:-2.8.3.post2}
TORCH_SPEC=${TORCH_SPEC:-torch==2.11.0}
ARCHS=${ARCHS:-90}
PY=${PY:-python3.12}
JOBS=${JOBS:-2}
TRIM=${TRIM:-1}
OUT_DIR=${OUT_DIR:-$ROOT/.gpu_wheels}
WORK=${WORK:-$ROOT/.fa2-build}
command -v "$PY" >/dev/null || { echo "build_fa2_wheel: $PY not found; set PY= to the GPU machine's Python" >&2; exit 2; }
command -v nvcc >/dev/null || { echo "build_fa2_wheel: nvcc not found; set PATH/CUDA_HOME to a CUDA toolkit matching the torch build" >&2; exit 2; }
grep -qx "/.fa2-build/" .git/info/exclude 2>/dev/null || echo "/.fa2-build/" >> .git/info/exclude
mkdir -p "$WORK" "$OUT_DIR"

echo "== venv with $TORCH_SPEC for $PY ($(date -u +%H:%M:%S))"
[ -x "$WORK/venv/bin/python" ] || "$PY" -m venv "$WORK/venv"
VPY=$WORK/venv/bin/python
$VPY -m pip install -q --upgrade pip setuptools wheel ninja packaging psutil einops
$VPY -m pip install -q "$TORCH_SPEC"
$VPY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.version.git_version)"

echo "== flash-attn $FA_VERSION sdist"
# setup.py imports torch even for metadata: download from the venv where torch imports.
if ! ls "$WORK"/flash_attn-"$FA_VERSION".tar.gz >/dev/null 2>&1; then
  FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE $VPY -m pip download -q --no-deps --no-build-isolation \
      --no-binary :all: -d "$WORK" "flash-attn==$FA_VERSION"
fi
rm -rf "$WORK/src" && mkdir "$WORK/src"
tar -xzf "$WORK/flash_attn-$FA_VERSION.tar.gz" -C "$WORK/src"
SRC=$WORK/src/flash_attn-$FA_VERSION
# The sdist ships an old flash_attn/cute/ that would overwrite flash-attn-4's package on install.
rm -rf "$SRC/flash_attn/cute"

if [ "$TRIM" = 1 ]; then
  echo "== trimming to head-dim tiles 64/128/256, dropout and ALiBi compiled out"
  $VPY - "$SRC" <<'EOF'
import glob, os, re, sys
src = sys.argv[1]
setup = os.path.join(src, "setup.py")
s = open(setup).read()
# compile the dropout/ALiBi switches out, for nvcc AND the host compiler
flags = ("FLASHATTENTION_DISABLE_DROPOUT", "FLASHATTENTION_DISABLE_ALIBI")
for flag in flags:
    s, n = re.subn(r'#\s*"-D%s",?' % flag, '"-D%s",' % flag, s)
    if n == 0:
        raise SystemExit(f"setup.py layout changed: no commented -D{flag} found; trim by hand or TRIM=0")
s, n = re.subn(r'compiler_c17_flag=\["-O3", "-std=c\+\+17"\]',
               'compiler_c17_flag=["-O3", "-std=c++17", %s]' % ", ".join('"-D%s"' % f for f in flags), s)
if n == 0:
    raise SystemExit("setup.py layout changed: no host compiler flag list found; trim by hand or TRIM=0")
# keep only the kernels of head-dim tiles 64/128/256 (split-KV files stay: mha_fwd uses them)
lines = s.split("\n")
kept = [ln for ln in lines if not re.search(r'"csrc/flash_attn/src/flash_\w*_hdim(\d+)_', ln)
        or re.search(r'_hdim(64|128|256)_', ln)]
if len(kept) == len(lines):
    raise SystemExit("setup.py layout changed: no per-head-dim source list found; trim by hand or TRIM=0")
s = "\n".join(kept)
open(setup, "w").write(s)
sw = os.path.join(src, "csrc/flash_attn/src/static_switch.h")
t = open(sw).read()
start = t.index("#define HEADDIM_SWITCH")
end = t.index("}()", start) + 3
t = t[:start] + """#define HEADDIM_SWITCH(HEADDIM, ...)   \\
  [&] {                                    \\
    if (HEADDIM <= 64) {                   \\
      constexpr static int kHeadDim = 64;  \\
      return __VA_ARGS__();                \\
    } else if (HEADDIM <= 128) {           \\
      constexpr static int kHeadDim = 128; \\
      return __VA_ARGS__();                \\
    } else {                               \\
      constexpr static int kHeadDim = 256; \\
      return __VA_ARGS__();                \\
    }                                      \\
  }()""" + t[end:]
open(sw, "w").write(t)
api = os.path.join(src, "csrc/flash_attn/flash_api.cpp")
a = open(api).read()
a, n = re.subn(r"const int head_size_rounded = [^;]+;",
               "const int head_size_rounded = head_size <= 64 ? 64 : (head_size <= 128 ? 128 : 256);", a)
if n == 0:
    raise SystemExit("flash_api.cpp layout changed: no head_size_rounded found; trim by hand or TRIM=0")
open(api, "w").write(a)
for f in glob.glob(os.path.join(src, "csrc/flash_attn/src/flash_*hdim*.cu")):
    if not re.search(r"hdim(64|128|256)_", os.path.basename(f)):
        os.remove(f)
print("trimmed:", len(glob.glob(os.path.join(src, "csrc/flash_attn/src/*.cu"))), "CUDA files left")
EOF
fi

echo "== build ($JOBS jobs, sm_$ARCHS; $(date -u +%H:%M:%S))"
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
INC=$($VPY -c "import os, nvidia; p = os.path.join(os.path.dirname(nvidia.__file__), 'cu13', 'include'); print(p if os.path.isdir(p) else '')" 2>/dev/null || true)
(cd "$SRC" && CUDA_HOME=$CUDA_HOME ${INC:+CUDA_INC_PATH=$INC} FLASH_ATTN_CUDA_ARCHS=$ARCHS \
   FLASH_ATTENTION_FORCE_BUILD=TRUE MAX_JOBS=$JOBS \
   $VPY -m pip wheel -v --no-deps --no-build-isolation -w "$OUT_DIR" .)
echo "== done ($(date -u +%H:%M:%S))"
ls -la "$OUT_DIR"
$VPY -m pip install -q --no-deps --force-reinstall "$OUT_DIR"/flash_attn-*.whl
$VPY -c "import flash_attn, flash_attn_2_cuda; print('imports: flash-attn', flash_attn.__version__)"
