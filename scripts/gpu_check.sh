#!/usr/bin/env bash
# GPU tests + benchmarks on the GPU machine, writing logs and JSON under $OUT.
#
#   bash scripts/gpu_check.sh all      # one call: FA4 already importable (or not needed)
#   bash scripts/gpu_check.sh nofa4    # run 1 (with .fa4a/ present): env, flex/sdpa/merge
#                                      #   tests, flex+sdpa+cuDNN kernel benchmark
#   bash .fa4b/install.sh && bash scripts/gpu_check.sh fa4
#                                      # run 2 (with .fa4b/ present, right after call 1):
#                                      #   FA4 tests, FA4 kernel benchmark, cp_sim
#   bash .fa4b/install.sh && bash scripts/gpu_check.sh extra
#                                      # (call 2 of a second pair): cp_sim with CUDA graphs,
#                                      #   cp_multi N=1, CP tests with 2/4 ranks on one GPU
#   bash .fa4b/install.sh && bash scripts/gpu_check.sh final
#                                      # (call 2): CP GPU tests, cp_sim with the once-per-backward
#                                      #   O cast and D correction
#   bash .fa4b/install.sh && bash scripts/gpu_check.sh blocks
#                                      # (call 2): every GPU test (CP tests: 2/4 ranks on one
#                                      #   GPU), fa4 framework overhead at 8K/32K, cp_sim sweep
#                                      #   over CP_SOFTCAP_RING_BLOCK_KEYS
#   bash .fa4b/install.sh && bash scripts/gpu_check.sh softcap
#                                      # (call 2): fa4 tests (both softcap implementations),
#                                      #   builtin vs score_mod softcap benchmark, cp_sim profile
#   bash .fa4b/install.sh && bash scripts/gpu_check.sh accum
#                                      # (call 2): fa4 + CP GPU tests, cp_sim sweep (16384/32768
#                                      #   block keys), window 4095, profile at cp 8
#   bash .fa4b/install.sh && bash scripts/gpu_check.sh native
#                                      # (call 2): CP GPU tests, cp_sim with bf16 dK/dV returns,
#                                      #   window 4095 with CUDA graphs, profile at cp 8
#   bash .fa4b/install.sh && bash scripts/gpu_check.sh fa2
#                                      # (call 2, with .fa4b/ .fa2/ present; scripts/stage_fa2.sh
#                                      #   fills .fa2/ first): installs the flash-attn 2 wheel,
#                                      #   fa2 kernel tests, CP tests with fa2 forced, fa2 next to
#                                      #   fa4/flex/cuDNN in the kernel benchmark
#   bash .fa4b/install.sh && bash scripts/gpu_check.sh flexflash
#                                      # (call 2): bitwise bf16-return test, flex's FA4 (CuTe)
#                                      #   backend with a softcap score_mod vs flex Triton / fa4
#   bash scripts/gpu_check.sh packed   # ONE call, with .fa2/ present (no fa4): flash-attn 2 and flex
#                                      #   with packed documents (segments), kernels, autocast and
#                                      #   CP tests on one GPU except the fa4 cases, cp_sim --packed
# Packed documents at fa4 and every GPU test file, three calls back to back on one machine:
#   bash scripts/gpu_check.sh pk1      # call 1, with .fa4a/ present: flex compile probe (small packed
#                                      #   geometries), GPU tests that need neither fa4 nor fa2
#   bash .fa4b/install.sh && bash scripts/gpu_check.sh pk2
#                                      # call 2, with .fa4b/ present (with .fa2 too it is too large
#                                      #   to copy along): fa4 varlen tests, every fa4 kernel and autocast test
#   bash scripts/gpu_check.sh pk2b     # same machine: every CP test on one GPU (packed, unpacked)
#   bash scripts/gpu_check.sh pkcp     # (same machine, with .fa2/ present) pk2b and pk4 in one call:
#                                      #   CP tests with fa4, fa2 and flex, then the fa2 tests
#   bash scripts/gpu_check.sh pk3      # call 3 (same machine, with .fa2/ present): installs flash-attn
#                                      #   2; packed kernels vs cuDNN, cp_sim --packed with fa4, 27B
#                                      #   per-call profile (fully visible calls also as windowed
#                                      #   calls and with the backward in key pieces)
#   bash scripts/gpu_check.sh pk4      # call 4 (same machine): the fa2 kernel, autocast and CP tests
#   bash scripts/gpu_check.sh train26  # with .liger/ present (scripts/stage_liger.sh), fa4 + fa2
#                                      #   installed: Liger vs our pieces, Gemma2 2b 8K train (eager,
#                                      #   expandable segments, --compile, --pack), per-piece speed +
#                                      #   top kernels at 8K and 4K
#   bash scripts/gpu_check.sh train26b # next call, same machine: 32K plan vs measured peak, HF
#                                      #   attention impls (4K), the longest sequence that fits
# Two calls on a fresh machine: the loss, packed-call and fa4-tile changes, re-measured:
#   bash scripts/gpu_check.sh lg1      # call 1, with .fa4a/ .liger/ present: Liger tests on the GPU
#   bash .fa4b/install.sh && bash scripts/gpu_check.sh fix2
#                                      # call 2, with .fa4b/ present: fa4 tests of fully visible calls
#                                      #   (dense and varlen), 2b train at 8K, packed 9B (library vs
#                                      #   FA4 alone), packed overhead, cp_sim 27B per call, speed.py
# What is left on one GPU (after the H200 and H100 runs of 2026-12-06: loss, nx4 on the H200, 8K
# compile/eager/pack on the H200): loss (fresh machine, with .fa2/ .liger/ present) again, for the
# loss that computes its gradients in the forward (benchmarks/lm_loss.py sweeps its slice size
# against Liger's); optionally nx1 then .fa4b/install.sh && nx4 on an H100 (the longest
# --ac selective fit there, 36,864 tokens).
#   bash .fa4b/install.sh && bash scripts/gpu_check.sh mfu
#                                      # call 2, with .fa4b/ present, Liger installed by nx1: speed.py
#                                      #   --compile at 8K (auto's pick, all Liger, none), the top
#                                      #   kernels of auto's pick and where its GPU waited (trace)
#   bash scripts/gpu_check.sh nx1      # (instead of pk1 when only Liger is wanted) with
#                                      #   [".fa4a", ".liger"]: Liger's GPU tests
#   bash scripts/gpu_check.sh nx5      # same machine: packed 27B (library vs FA4 alone)
#   bash scripts/gpu_check.sh loss     # fresh machine, with .fa2/ .liger/ present: our loss against
#                                      #   Liger's on the GPU, the loss alone (benchmarks/lm_loss.py),
#                                      #   speed.py at 8K (the loss's cost in a step)
#   bash scripts/gpu_check.sh nx3      # call 3, with .fa2/ .peers/ present: installs flash-attn 2
#                                      #   and the peers, peers.py at world size 1 (every system)
#   bash scripts/gpu_check.sh nx4      # call 4: 2b at 32K with --ac selective, the longest 2b
#                                      #   sequences the plan fits with --ac selective and --ac full
# On a several-GPU kind, in this order (each is call 2 of a pair, after .fa4a's call 1):
#   bash .fa4b/install.sh && bash scripts/gpu_check.sh nccl
#                                      # CP tests over NCCL, one rank per GPU: every comm type,
#                                      #   causal, window, packed documents; a stalled peer
#   bash .fa4b/install.sh && bash scripts/gpu_check.sh multi
#                                      # cp_multi with every comm (a2a+p2p where the GPU count
#                                      #   allows), and window 4095
#   bash .fa4b/install.sh && bash scripts/gpu_check.sh torchcp
#                                      # torch_cp: cps next to PyTorch's own context_parallel
#   bash scripts/gpu_check.sh peers    # ONE GPU, with .peers/ present (scripts/stage_peers.sh fills it;
#                                      #   flash-attn 2 already installed): peers.py at world size 1
#   On N GPUs (same folders present): torchrun --nproc-per-node N benchmarks/peers.py [--a2a-size 2 4]
#                                      #   -> benchmarks/results/peers_N<N>.json and .png
#   bash .fa4b/install.sh && bash scripts/gpu_check.sh gemma2multi
#                                      # Gemma2 training with cp = every GPU, FSDP2, selective AC
#                                      #   (9b with 8+ GPUs, else 2b), seq 32768
# Dry run on CPU (no GPU): GPU_CHECK_DRY=1 bash scripts/gpu_check.sh all
set -uo pipefail
cd "$(dirname "$0")/.."
phase=${1:-all}
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
# The repo root on the path: scripts run as subprocesses (train.py, speed.py) import cp_softcap
# from the checkout, which the GPU machine does not pip-install.
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
dry=${GPU_CHECK_DRY:-0}
rc=0
step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }
install_fa2() {                                 # the flash-attn 2 wheel carried in .fa2/, if any
  step "install flash-attn 2 from .fa2/"
  if ls .fa2/flash_attn-*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-deps --no-index --no-compile .fa2/flash_attn-*.whl 2>&1 | tail -3
  fi
  $PY -c "import flash_attn, flash_attn_2_cuda; print('flash-attn', flash_attn.__version__)" 2>&1 \
      | tee "$OUT/fa2_import.txt" || rc=1
}

step "env"
$PY - <<'EOF' 2>&1 | tee "$OUT/env.txt"
import torch, importlib
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "")
for m in ("triton", "flash_attn.cute", "flash_attn.flash_attn_interface", "flash_attn_interface"):
    try:
        importlib.import_module(m); print("import", m, "ok")
    except Exception as e:
        print("import", m, "FAILED:", type(e).__name__, str(e)[:120])
EOF

tests_common="tests/test_gpu_merge.py tests/test_kernel_adapters.py"
bench_out=benchmarks/results
if [ "$dry" = 1 ]; then bench_args="--dry-run --out-dir $OUT"; export CP_SOFTCAP_GPU_TESTS_ON_CPU=1; else bench_args=""; fi

if [ "$phase" = nofa4 ] || [ "$phase" = all ]; then
  step "GPU tests (flex, sdpa, merge; fa4 skipped unless installed)"
  sel="not fa4"; [ "$phase" = all ] && sel=""
  timeout 280 $PY -m pytest tests/test_gpu_kernels.py $tests_common -q -rs --maxfail=20 -n 4 \
      ${sel:+-k "$sel"} -p no:cacheprovider 2>&1 | tee "$OUT/pytest_nofa4.log" | tail -40 || rc=1
  step "kernel benchmark: cuDNN baseline, flex (softcap 50), sdpa adapter (no softcap)"
  pairs="flex:50 sdpa:0"; [ "$phase" = all ] && pairs="fa4:50 fa4:0 flex:50 sdpa:0"
  timeout 260 $PY benchmarks/kernels.py $bench_args --rep-ms 150 --pairs $pairs --tag main 2>&1 | tail -40 || rc=1
  cp $bench_out/kernels_main.json $bench_out/kernels_main.png "$OUT/" 2>/dev/null
fi

if [ "$phase" = fa4 ] || [ "$phase" = all ]; then
  if [ "$phase" = fa4 ]; then
    step "GPU tests: fa4 + selector + cps.attention"
    timeout 300 $PY -m pytest tests/test_gpu_kernels.py -q -rs -n 4 -p no:cacheprovider \
        -k "fa4 or selector or cps_attention" 2>&1 | tee "$OUT/pytest_fa4.log" | tail -30 || rc=1
    step "kernel benchmark: fa4 (softcap 50 and off) vs cuDNN"
    timeout 240 $PY benchmarks/kernels.py $bench_args --pairs fa4:50 fa4:0 --tag fa4 2>&1 | tail -30 || rc=1
    cp $bench_out/kernels_fa4.json $bench_out/kernels_fa4.png "$OUT/" 2>/dev/null
  fi
  step "cp_sim: rank 0 of a zigzag ring on one GPU"
  timeout 300 $PY benchmarks/cp_sim.py $bench_args 2>&1 | tail -40 || rc=1
  cp $bench_out/cp_sim.json $bench_out/cp_sim.png "$OUT/" 2>/dev/null
fi
if [ "$phase" = extra ]; then                   # after fa4 is installed: graphs, N=1, CP tests
  step "cp_sim with CUDA-graph replay and host time"
  timeout 200 $PY benchmarks/cp_sim.py $bench_args --seqs 32768 131072 --cps 8 4 --graph --tag graph 2>&1 | tail -20 || rc=1
  cp $bench_out/cp_sim_graph.json $bench_out/cp_sim_graph.png "$OUT/" 2>/dev/null
  step "cp_multi with N=1 (single-device path through cps.cp_attention)"
  timeout 90 $PY benchmarks/cp_multi.py $bench_args --seqs 32768 2>&1 | tail -8 || rc=1
  cp $bench_out/cp_multi_N1.json "$OUT/" 2>/dev/null
  step "GPU CP tests: 2 and 4 ranks on one GPU via gloo host staging"
  timeout 240 $PY -m pytest tests/test_gpu_cp.py -q -rs -n 3 -p no:cacheprovider 2>&1 | tee "$OUT/pytest_cp.log" | tail -25 || rc=1
fi
if [ "$phase" = final ]; then                   # after fa4 is installed: prepared bwd + CP tests
  step "GPU CP tests: 2 and 4 ranks on one GPU via gloo host staging"
  timeout 200 $PY -m pytest tests/test_gpu_cp.py -q -rs -n 3 -p no:cacheprovider 2>&1 | tee "$OUT/pytest_cp.log" | tail -12 || rc=1
  step "cp_sim with prepare_backward (O cast and D correction once per backward)"
  timeout 150 $PY benchmarks/cp_sim.py $bench_args --seqs 32768 131072 --cps 8 --merges fused --prepared --tag prepared 2>&1 | tail -8 || rc=1
  cp $bench_out/cp_sim_prepared.json "$OUT/" 2>/dev/null
fi
if [ "$phase" = blocks ]; then                  # after fa4 is installed
  step "GPU tests: kernels (fa4 included), merge, adapters"
  timeout 150 $PY -m pytest tests/test_gpu_kernels.py $tests_common -q -rs -n 4 \
      -p no:cacheprovider 2>&1 | tee "$OUT/pytest_kernels.log" | tail -12 || rc=1
  step "GPU CP tests: 2 and 4 ranks on one GPU via gloo host staging (all comm types)"
  timeout 130 $PY -m pytest tests/test_gpu_cp.py -q -rs -n 3 -p no:cacheprovider 2>&1 | tee "$OUT/pytest_cp.log" | tail -12 || rc=1
  step "framework overhead: cps.attention vs the raw fa4 call (softcap 50), 9B/27B, 8K/32K"
  timeout 110 $PY benchmarks/kernels.py $bench_args --rep-ms 150 --pairs fa4:50 --tag overhead 2>&1 | tail -12 || rc=1
  cp $bench_out/kernels_overhead.json $bench_out/kernels_overhead.png "$OUT/" 2>/dev/null
  step "cp_sim: ring blocks of 0 / 16384 / 32768 keys, 32K and 128K, cp 2/4/8"
  timeout 150 $PY benchmarks/cp_sim.py $bench_args --rep-ms 150 --block-keys 0 16384 32768 --tag blocks 2>&1 | tail -40 || rc=1
  cp $bench_out/cp_sim_blocks.json $bench_out/cp_sim_blocks.png "$OUT/" 2>/dev/null
fi
if [ "$phase" = softcap ]; then                 # after fa4 is installed
  step "GPU tests: fa4 (score_mod and builtin softcap) + selector + cps.attention"
  timeout 200 $PY -m pytest tests/test_gpu_kernels.py -q -rs -n 4 -p no:cacheprovider \
      -k "fa4 or selector or cps_attention" 2>&1 | tee "$OUT/pytest_fa4.log" | tail -12 || rc=1
  step "fa4 softcap: builtin vs score_mod, 9B/27B, 8K/32K"
  timeout 200 $PY benchmarks/fa4_softcap.py $bench_args --rep-ms 150 2>&1 | tail -30 || rc=1
  cp $bench_out/fa4_softcap.json $bench_out/fa4_softcap.png "$OUT/" 2>/dev/null
  step "cp_sim profile: 32K and 128K, cp 8, 32768 block keys"
  timeout 150 $PY benchmarks/cp_sim.py $bench_args --rep-ms 150 --seqs 32768 131072 --cps 8 \
      --block-keys 32768 --profile --tag profile 2>&1 | grep -v USDT | tail -60 || rc=1
  cp $bench_out/cp_sim_profile.json "$OUT/" 2>/dev/null
fi
if [ "$phase" = accum ]; then                   # after fa4 is installed
  step "GPU tests: fa4 kernels + CP on one GPU (ring/all_gather backward through GradAccumulator)"
  timeout 150 $PY -m pytest tests/test_gpu_kernels.py tests/test_kernel_adapters.py -q -rs -n 4 \
      -p no:cacheprovider -k "fa4 or selector or cps_attention" 2>&1 | tee "$OUT/pytest_fa4.log" | tail -6 || rc=1
  timeout 150 $PY -m pytest tests/test_gpu_cp.py -q -rs -n 3 -p no:cacheprovider 2>&1 | tee "$OUT/pytest_cp.log" | tail -8 || rc=1
  step "cp_sim: block keys 16384 / 32768, 32K and 128K, cp 2/4/8 (GradAccumulator backward)"
  timeout 150 $PY benchmarks/cp_sim.py $bench_args --rep-ms 150 --block-keys 16384 32768 --tag accum 2>&1 | tail -30 || rc=1
  step "cp_sim: Gemma2 local layers (window 4095), cp 8"
  timeout 100 $PY benchmarks/cp_sim.py $bench_args --rep-ms 150 --cps 8 --block-keys 16384 32768 --window 4095 --tag window 2>&1 | tail -12 || rc=1
  step "cp_sim profile: 32K and 128K, cp 8, 32768 block keys"
  timeout 100 $PY benchmarks/cp_sim.py $bench_args --rep-ms 150 --seqs 32768 131072 --cps 8 \
      --block-keys 32768 --profile --tag accum_profile 2>&1 | grep -v USDT | tail -40 || rc=1
  cp $bench_out/cp_sim_accum*.json $bench_out/cp_sim_accum.png $bench_out/cp_sim_window.* "$OUT/" 2>/dev/null
fi
if [ "$phase" = fa2 ]; then                     # after fa4 is installed; .fa2/ carried
  install_fa2
  step "GPU tests: fa2 (softcap 1-50 fwd+bwd, windows per chunk pair, empty rows, GQA, D 64/128/256, fp16)"
  timeout 200 $PY -m pytest tests/test_gpu_kernels.py tests/test_kernel_adapters.py -q -rs -n 4 \
      -p no:cacheprovider -k "fa2" 2>&1 | tee "$OUT/pytest_fa2.log" | tail -15 || rc=1
  step "GPU CP tests with fa2 forced: ring / all_gather / a2a, 2 and 4 ranks on one GPU"
  timeout 200 $PY -m pytest tests/test_gpu_cp.py -q -rs -n 4 -p no:cacheprovider -k "fa2" 2>&1 \
      | tee "$OUT/pytest_cp_fa2.log" | tail -12 || rc=1
  step "kernel benchmark: fa2 next to fa4, flex and cuDNN (9B/27B heads, 8K/32K)"
  timeout 240 $PY benchmarks/kernels.py $bench_args --rep-ms 100 --pairs fa2:50 fa2:0 fa4:50 flex:50 \
      --tag fa2 2>&1 | tail -40 || rc=1
  cp $bench_out/kernels_fa2.json $bench_out/kernels_fa2.png "$OUT/" 2>/dev/null
fi
if [ "$phase" = flexflash ]; then               # after fa4 is installed
  step "GPU tests: kernels (fa4, flex, sdpa) and CP on one GPU, incl. the bitwise bf16-return test"
  timeout 100 $PY -m pytest tests/test_gpu_kernels.py -q -rs -n 4 -p no:cacheprovider 2>&1 \
      | tee "$OUT/pytest_kernels.log" | tail -4 || rc=1
  timeout 170 $PY -m pytest tests/test_gpu_cp.py -q -rs -n 4 -p no:cacheprovider 2>&1 \
      | tee "$OUT/pytest_cp.log" | tail -8 || rc=1
  step "flex through FA4's CuTe backend vs flex Triton vs the fa4 adapter (softcap 50)"
  timeout 200 $PY benchmarks/flex_flash.py $bench_args --models 9B --rep-ms 100 2>&1 | tail -30 || rc=1
  cp $bench_out/flex_flash.json $bench_out/flex_flash.png "$OUT/" 2>/dev/null
fi
if [ "$phase" = packed ]; then                  # .fa2/ present; fa4 cases skip themselves
  install_fa2
  step "GPU tests: segments (fa2 varlen, flex, torch), kernels, autocast (fa4 cases skip without it)"
  timeout 170 $PY -m pytest tests/test_gpu_segments.py tests/test_gpu_kernels.py tests/test_gpu_autocast.py \
      -q -rs -n 6 -p no:cacheprovider 2>&1 | tee "$OUT/pytest_packed_kernels.log" | grep -v "^SKIPPED" | tail -25 || rc=1
  step "GPU CP tests: packed documents and every comm type, 2 and 4 ranks on one GPU (fa2, flex)"
  timeout 220 $PY -m pytest tests/test_gpu_packed_cp.py tests/test_gpu_cp.py -q -rs -n 6 -p no:cacheprovider \
      2>&1 | tee "$OUT/pytest_packed_cp.log" | grep -v "^SKIPPED" | tail -25 || rc=1
  step "cp_sim --packed longtail: every rank's packed calls (fa2 segments) vs the full packed stream, cp 8, 128K"
  pk=fa2; [ "$dry" = 1 ] && pk=torch            # the CPU dry run has no flash-attn
  timeout 150 $PY benchmarks/cp_sim.py $bench_args --packed longtail --seqs 131072 --cps 8 --kernel $pk \
      --rep-ms 100 2>&1 | tail -12 || rc=1
  cp $bench_out/cp_sim_packed_longtail.json $bench_out/cp_sim_packed_longtail.png "$OUT/" 2>/dev/null
fi
if [ "$phase" = native ]; then                  # after fa4 is installed
  step "GPU CP tests: 2 and 4 ranks on one GPU (fa4 bf16 dK/dV returns in the ring)"
  timeout 150 $PY -m pytest tests/test_gpu_cp.py -q -rs -n 3 -p no:cacheprovider 2>&1 | tee "$OUT/pytest_cp.log" | tail -8 || rc=1
  step "cp_sim: block keys 16384 / 32768, cp 4/8, 32K and 128K (native-dtype dK/dV returns)"
  timeout 150 $PY benchmarks/cp_sim.py $bench_args --rep-ms 300 --cps 4 8 --block-keys 16384 32768 --tag native 2>&1 | tail -20 || rc=1
  step "cp_sim: Gemma2-27B heads (32/16, D 128), cp 8, 32768 block keys"
  timeout 100 $PY benchmarks/cp_sim.py $bench_args --rep-ms 150 --cps 8 --block-keys 32768 --heads 32 16 128 --tag native_27b 2>&1 | tail -6 || rc=1
  step "cp_sim: window 4095, cp 8, with CUDA-graph replay (host-bound?)"
  timeout 120 $PY benchmarks/cp_sim.py $bench_args --rep-ms 150 --cps 8 --block-keys 32768 --window 4095 --graph --tag native_window 2>&1 | tail -8 || rc=1
  step "cp_sim profile: 32K and 128K, cp 8, 32768 block keys"
  timeout 100 $PY benchmarks/cp_sim.py $bench_args --rep-ms 150 --seqs 32768 131072 --cps 8 \
      --block-keys 32768 --profile --tag native_profile 2>&1 | grep -v USDT | tail -36 || rc=1
  cp $bench_out/cp_sim_native*.json $bench_out/cp_sim_native*.png "$OUT/" 2>/dev/null
fi
# pytest -v: each test's verdict is in the log as it finishes, so a run cut by its timeout still
# names the failures; the tail shows the failures and the counts.
verdicts() { grep -E "(FAILED|ERROR) |^E  .*(mismatch|Error)|[0-9]+ (passed|failed)" | cut -c1-300 | tail -${1:-40}; }
install_liger() {                               # the liger-kernel wheel carried in .liger/, if any
  step "install liger-kernel from .liger/"
  if ls .liger/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-deps --no-index --no-compile .liger/*.whl 2>&1 | tail -3
  fi
}
if [ "$phase" = pk1 ]; then                     # with .fa4a/ .liger/ present: part a of fa4 stays for pk2
  install_liger
  step "GPU tests without fa4/fa2: flex, sdpa, torch, merge, adapters, autocast, segments"
  timeout 280 $PY -m pytest tests/test_gpu_kernels.py tests/test_gpu_merge.py tests/test_kernel_adapters.py \
      tests/test_gpu_autocast.py tests/test_gpu_segments.py -v -rf --tb=short -n 8 -p no:cacheprovider \
      -k "not fa4 and not fa2" 2>&1 | tee "$OUT/pytest_pk1.log" | verdicts || rc=1
fi
if [ "$phase" = pk2 ]; then
  step "GPU tests: fa4 varlen (segments), fa4 kernels, autocast"
  timeout 470 $PY -m pytest tests/test_gpu_segments.py tests/test_gpu_kernels.py tests/test_gpu_autocast.py \
      tests/test_kernel_adapters.py -v -rf --tb=short -n 8 -p no:cacheprovider -k "fa4 or auto" 2>&1 \
      | tee "$OUT/pytest_pk2_kernels.log" | verdicts || rc=1
fi
if [ "$phase" = pk2b ]; then                    # same machine, fa4 installed by pk2
  step "GPU CP tests: packed and unpacked, every comm type, 2 and 4 ranks on one GPU"
  timeout 500 $PY -m pytest tests/test_gpu_packed_cp.py tests/test_gpu_cp.py -v -rf --tb=short -n 6 \
      -p no:cacheprovider -k "not fa2" 2>&1 | tee "$OUT/pytest_pk2_cp.log" | verdicts || rc=1
fi
if [ "$phase" = pkcp ]; then                    # with .fa2/ present, fa4 installed by pk2: pk2b and pk4 in one call
  install_fa2
  step "GPU CP tests with every kernel (fa4, fa2, flex), packed and unpacked, 2 and 4 ranks on one GPU"
  timeout 270 $PY -m pytest tests/test_gpu_packed_cp.py tests/test_gpu_cp.py -v -rf --tb=short -n 8 \
      -p no:cacheprovider 2>&1 | tee "$OUT/pytest_pkcp.log" | verdicts || rc=1
  step "GPU kernel, segments and autocast tests with flash-attn 2"
  timeout 110 $PY -m pytest tests/test_gpu_segments.py tests/test_gpu_kernels.py tests/test_gpu_autocast.py \
      -v -rf --tb=short -n 8 -p no:cacheprovider -k fa2 2>&1 | tee "$OUT/pytest_fa2.log" | verdicts || rc=1
fi
if [ "$phase" = pk3 ]; then
  install_fa2
  step "packed kernels: fa4 / fa2 / flex packed vs cuDNN dense causal of the same area (128K)"
  timeout 200 $PY benchmarks/packed_kernels.py $bench_args --rep-ms 100 2>&1 | tail -30 || rc=1
  cp $bench_out/packed_kernels.json $bench_out/packed_kernels.png "$OUT/" 2>/dev/null
  for m in longtail short; do
    step "cp_sim --packed $m with fa4, 128K, cp 8 (long-tail: the busiest rank profiled next to the full call)"
    prof=""; [ $m = longtail ] && prof="--profile"
    timeout 150 $PY benchmarks/cp_sim.py $bench_args --packed $m --seqs 131072 --cps 8 --kernel fa4 \
        --rep-ms 60 --tag fa4 $prof 2>&1 | grep -v USDT | tail -60 || rc=1
    cp $bench_out/cp_sim_packed_${m}_fa4.json "$OUT/" 2>/dev/null
  done
  step "cp_sim 27B heads (32/16, D 128), 32K, cp 8: profile and every call alone"
  timeout 120 $PY benchmarks/cp_sim.py $bench_args --rep-ms 60 --seqs 32768 --cps 8 --block-keys 32768 \
      --heads 32 16 128 --profile --per-call --tag profile_27b 2>&1 | grep -v USDT | tail -50 || rc=1
  cp $bench_out/cp_sim_profile_27b.json $bench_out/cp_sim_percall_9b.json "$OUT/" 2>/dev/null
  step "cp_sim: Gemma2's local layers (window 4095), 9B heads, 32K, cp 8, host time and CUDA-graph replay"
  timeout 90 $PY benchmarks/cp_sim.py $bench_args --rep-ms 60 --seqs 32768 --cps 8 --block-keys 32768 \
      --window 4095 --graph --tag window 2>&1 | tail -6 || rc=1
  cp $bench_out/cp_sim_window.json "$OUT/" 2>/dev/null
fi
if [ "$phase" = pk4 ]; then                     # flash-attn 2 installed by pk3 on this machine
  step "GPU tests with flash-attn 2: kernels, segments, autocast, packed and unpacked CP"
  timeout 420 $PY -m pytest tests/test_gpu_segments.py tests/test_gpu_kernels.py tests/test_gpu_autocast.py \
      tests/test_gpu_packed_cp.py tests/test_gpu_cp.py -v -rf --tb=short -n 8 -p no:cacheprovider -k fa2 \
      2>&1 | tee "$OUT/pytest_pk4.log" | verdicts || rc=1
fi
if [ "$phase" = peers ] || [ "$phase" = nx3 ]; then   # one GPU, with .peers/ present (scripts/stage_peers.sh) and .fa2
  install_fa2
  step "install ring-flash-attn and yunchang from .peers/"
  if ls .peers/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-deps --no-index --no-compile .peers/*.whl 2>&1 | tail -3
  fi
  step "peers: cps next to ring-flash-attn, yunchang and torch context_parallel, world size 1 (exactness vs float64 + fwd+bwd)"
  peers_run() {                                 # model, tag, extra flags: one JSON per run, written
    timeout 240 $PY benchmarks/peers.py $bench_args --models $1 --tag $2 "${@:3}" 2>&1 \
        | tee "$OUT/peers_N1_$2.log" | tail -45 || rc=1   # as it goes: a time limit keeps the first cases
    cp $bench_out/peers_N1_$2.json $bench_out/peers_N1_$2.png "$OUT/" 2>/dev/null
  }
  if [ "$phase" = nx3 ]; then                   # the H200 run of 2026-12-06 has 9B causal and window
    peers_run 27B 27b                           # without cap: the 27B heads, then 9B's other cases
    peers_run 9B 9b_rest --layouts window packed
  else
    peers_run 9B 9b
    peers_run 27B 27b
  fi
fi
if [ "$phase" = nx1 ]; then                     # fresh machine, with .fa4a/ .liger/ present
  install_liger
  step "Liger's pieces against ours in bf16 on the GPU"
  timeout 200 $PY -m pytest tests/test_gemma2_liger.py -q -rf -p no:cacheprovider 2>&1 | tail -8 || rc=1
fi
if [ "$phase" = mfu ]; then                     # with .fa4b/ present after .fa4b/install.sh; Liger from nx1
  step "speed.py --compile, 2b at 8K: auto's pick (Liger's loss), all Liger, none; top kernels"
  timeout 420 $PY examples/gemma2/speed.py --config 2b --seq-len 8192 --batch-size 1 --no-progress --compile \
      --warm 2 --steps 3 --json "$OUT/speed_compile.jsonl" --profile-table "$OUT/profile_compile.txt" \
      --trace "$OUT/trace_compile.json.gz" 2>&1 | grep -v "^ \|exe_args" | tail -30 || rc=1
fi
if [ "$phase" = nx5 ]; then                     # same machine, fa4 installed
  step "packed kernels, 27B heads: the library's packed call against FA4's varlen function alone"
  timeout 70 $PY benchmarks/packed_kernels.py --rep-ms 50 --models 27B --kernels fa4 fa4-kernel \
      --tag 27b 2>&1 | tail -10 || rc=1
  cp $bench_out/packed_kernels_27b.json "$OUT/" 2>/dev/null
fi
if [ "$phase" = nx4 ]; then                     # fa4 installed; .liger/ too (the plan counts its pieces)
  install_liger
  plan_and_train() {                           # seq, ac, steps, time limit, metrics name: 2b
    $PY examples/gemma2/train.py --plan --config 2b --seq-len $1 --batch-size 1 --ac $2 | grep "peak ="
    timeout $4 $PY examples/gemma2/train.py --config 2b --seq-len $1 --batch-size 1 --ac $2 --max-steps $3 \
        --no-progress --metrics "$OUT/$5.jsonl" 2>&1 | grep -v "^step " | tail -2 || rc=1
    tail -1 "$OUT/$5.jsonl" 2>/dev/null
  }
  longest_fit() {                               # ac, lengths longest first: the first the plan fits
    local ac=$1 L; shift
    for L in "$@"; do
      $PY examples/gemma2/train.py --plan --config 2b --seq-len $L --batch-size 1 --ac $ac | tail -1 \
          | grep -q '^fits' && { echo $L; return; }
    done
  }
  step "2b at 32K with --ac selective: the plan's peak against max_memory_allocated"
  plan_and_train 32768 selective 4 100 train_32k_selective
  for spec in "selective 120 3 90112 81920 65536 49152 40960 36864" \
              "full 280 2 294912 262144 196608 131072 98304 65536"; do   # ~88K / ~296K on an H200 (Liger)
    set -- $spec
    fit=$(longest_fit $1 "${@:4}")
    if [ -n "$fit" ]; then
      step "the longest 2b sequence the plan fits with --ac $1: $fit tokens"
      plan_and_train $fit $1 $3 $2 train_longest_${1}_$fit
    else
      step "the plan fits none of ${*:4} tokens with --ac $1: no longest-fit run"
    fi
  done
fi
if [ "$phase" = loss ]; then                    # fresh machine, with .fa2/ .liger/ present (no fa4 needed)
  install_fa2
  install_liger
  step "our loss under autocast on the GPU (bf16 matmuls forward and backward), against Liger's, a training step"
  timeout 150 $PY -m pytest tests/test_gemma2_loss.py tests/test_gemma2_liger.py -q -rf -p no:cacheprovider \
      -k "cuda or loss_with_softcap or training_step" 2>&1 | tail -8 || rc=1
  step "the LM-head loss alone, 2b's head at 8K tokens: ours at 1-8x its default slices (eager, and compiled at 1x and 8x), Liger's, full logits"
  timeout 200 $PY benchmarks/lm_loss.py --out-dir "$OUT" 2>&1 | tail -11 || rc=1
  step "speed.py, 2b at 8K (flash-attn 2): all Liger pieces, each left out, none; the loss's cost"
  timeout 300 $PY examples/gemma2/speed.py --config 2b --seq-len 8192 --batch-size 1 --no-progress \
      --warm 2 --steps 3 --json "$OUT/speed_loss.jsonl" 2>&1 | grep -v "^ \|exe_args" | tail -12 || rc=1
fi
if [ "$phase" = lg1 ]; then                     # fresh machine, with .fa4a/ .liger/ present
  install_liger
  step "Liger's loss (slices, autocast dtype) against ours in bf16"
  timeout 40 $PY -m pytest tests/test_gemma2_liger.py -q -rf -p no:cacheprovider -k "loss_with_softcap or training_step" \
      2>&1 | tail -8 || rc=1
fi
if [ "$phase" = fix2 ]; then                    # next call, with .fa4b/ present, after .fa4b/install.sh
  step "fa4 GPU tests: fully visible calls (windowed tiles at head dim 128) and the merged-LSE backward"
  timeout 80 $PY -m pytest tests/test_gpu_kernels.py tests/test_gpu_segments.py -v -rf --tb=short -n 8 \
      -p no:cacheprovider -k "(fa4 and (windows or merged)) or (gemma2_heads and full)" 2>&1 \
      | tee "$OUT/pytest_fix2.log" | verdicts || rc=1
  step "Gemma2 2b, 8K tokens, one GPU"
  timeout 80 $PY examples/gemma2/train.py --config 2b --seq-len 8192 --batch-size 1 --max-steps 4 \
      --no-progress --metrics "$OUT/train_fix2.jsonl" 2>&1 | grep -v "^step " | tail -4 || rc=1
  tail -1 "$OUT/train_fix2.jsonl"
  step "packed kernels, 9B heads: the library's packed call against FA4's varlen function alone"
  timeout 60 $PY benchmarks/packed_kernels.py --rep-ms 50 --models 9B --kernels fa4 fa4-kernel \
      --tag fix2 2>&1 | tail -10 || rc=1
  cp $bench_out/packed_kernels_fix2.json "$OUT/" 2>/dev/null
  timeout 40 $PY benchmarks/packed_overhead.py --rep-ms 100 2>&1 | tail -6 || rc=1
  step "cp_sim 27B heads, 32K, cp 8: every call alone"
  timeout 50 $PY benchmarks/cp_sim.py --rep-ms 40 --seqs 32768 --cps 8 --block-keys 32768 \
      --heads 32 16 128 --per-call --tag percall_27b 2>&1 | grep -v USDT | tail -10 || rc=1
  cp $bench_out/cp_sim_percall_27b.json "$OUT/" 2>/dev/null
  step "speed.py at 8K: each Liger piece on and off, then the top kernels"
  timeout 110 $PY examples/gemma2/speed.py --config 2b --seq-len 8192 --batch-size 1 --no-progress --warm 1 \
      --steps 2 --json "$OUT/speed_fix2.jsonl" --profile-table "$OUT/profile_fix2.txt" 2>&1 | grep -v "^ " | tail -12 || rc=1
fi
if [ "$phase" = train26 ] || [ "$phase" = train26b ]; then   # one GPU; fa4 and fa2 installed
  G=examples/gemma2; T=/tmp/$phase; rm -rf $T; mkdir -p $T; log="$OUT/$phase.log"
  if [ "$dry" = 1 ]; then m=tiny; s4=128; s8=256; s32=512; n=3; hf="--dry-run --steps 1"
  else m=2b; s4=4096; s8=8192; s32=32768; n=6
    # HF's Gemma2 at 8K needs more than an H100's 80 GB (float32 logits and their softcap alone
    # take about 25 GB): 8K on a larger card, 4K otherwise
    gib=$($PY -c "import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)")
    hf="--seq-len $([ "$gib" -gt 100 ] && echo 8192 || echo 4096)"; fi
  run26() {   # name, time limit, train.py flags: metrics to $T/name.jsonl
    local name=$1 lim=$2; shift 2
    step "train.py $name: $*"
    timeout "$lim" $PY $G/train.py --config $m --batch-size 1 --no-progress --metrics "$T/$name.jsonl" "$@" \
        2>&1 | tee -a "$log" | grep -v "^step " | tail -5 || rc=1
    tail -1 "$T/$name.jsonl" 2>/dev/null
  }
fi
if [ "$phase" = train26 ]; then                 # call 1 of 2: with .liger/ present
  install_liger
  $PY -c "import sys; sys.path.insert(0, 'examples'); from gemma2 import fused; print('liger:', fused.liger_problem() or 'imports')" 2>&1 | tee -a "$log"
  step "Liger's RMSNorm/GEGLU/RoPE/loss against ours in bf16; the FLOP formula against flop_counter"
  timeout 150 $PY -m pytest tests/test_gemma2_liger.py tests/test_gemma2_flops.py -q -rf -p no:cacheprovider \
      2>&1 | tee -a "$log" | tail -15 || rc=1
  run26 8k 120 --seq-len $s8 --max-steps $n
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True run26 8k_expandable 120 --seq-len $s8 --max-steps $n
  run26 8k_compile 200 --seq-len $s8 --max-steps $n --compile
  run26 8k_pack 120 --seq-len $s8 --max-steps $n --pack
  for L in $s8 $s4; do
    step "speed.py at $L tokens: each Liger piece on and off, then the top kernels"
    timeout 150 $PY $G/speed.py --config $m --seq-len $L --batch-size 1 --no-progress --json "$T/speed_$L.jsonl" \
        --profile-table "$OUT/profile26_$L.txt" 2>&1 | tee -a "$log" | grep -v "^ " | tail -12 || rc=1
  done
fi
if [ "$phase" = train26b ]; then                # call 2 of 2 (same machine, nothing carried)
  ac=selective
  $PY $G/train.py --plan --config $m --seq-len $s32 --batch-size 1 --ac selective | tail -1 | grep -q '^fits' || ac=full
  step "$s32 tokens, --ac $ac: memory plan against max_memory_allocated, then MFU"
  timeout 120 $PY $G/memcheck.py --config $m --seq-len $s32 --batch-size 1 --ac $ac --no-progress \
      --json "$T/memcheck.jsonl" 2>&1 | tee -a "$log" | tail -2 || rc=1
  run26 32k_$ac 120 --seq-len $s32 --ac $ac --max-steps 4
  step "HF Gemma2 with cp_softcap / eager / sdpa / flash_attention_2"
  timeout 170 $PY benchmarks/hf_attention.py $hf --out-dir "$OUT" 2>&1 | tee -a "$log" | cut -c1-200 | tail -8 || rc=1
  for L in 131072 114688 98304 81920 65536 49152; do
    [ "$dry" = 1 ] && L=1024
    $PY $G/train.py --plan --config $m --seq-len $L --batch-size 1 --ac full | tail -1 | grep -q '^fits' && break
  done
  run26 longest_${L}_full 150 --seq-len $L --ac full --max-steps 3
fi
if [ "$phase" = train26 ] || [ "$phase" = train26b ]; then
  $PY - "$T" "$OUT/$phase.jsonl" <<'EOF'
import json, os, sys
src, dst = sys.argv[1], sys.argv[2]
with open(dst, "w") as out:
    for name in sorted(os.listdir(src)):
        for line in open(os.path.join(src, name)):
            out.write(json.dumps({"run": name[:-len(".jsonl")], **json.loads(line)}) + "\n")
print("wrote", dst)
EOF
fi
if [ "$phase" = nccl ]; then                    # several GPUs; fa2 cases skip without flash-attn 2
  step "GPU CP tests over NCCL, one rank per GPU: every comm type, window, packed documents, stalled peer"
  timeout 540 $PY -m pytest tests/test_gpu_cp.py tests/test_gpu_packed_cp.py -k nccl -q -rs \
      -p no:cacheprovider 2>&1 | tee "$OUT/pytest_nccl.log" | grep -v "^SKIPPED" | tail -30 || rc=1
fi
if [ "$phase" = gemma2multi ]; then
  n=$($PY -c "import torch; print(torch.cuda.device_count())")
  cfg=2b; [ "$n" -ge 8 ] && cfg=9b
  step "Gemma2 $cfg, seq 32768, cp=$n, FSDP2, selective AC: the memory plan, then 8 steps"
  g2="--config $cfg --seq-len 32768 --batch-size 1 --fsdp --ac selective"
  $PY examples/gemma2/train.py --plan --world-size "$n" $g2 2>&1 | tail -25 | tee "$OUT/gemma2_plan.txt"
  timeout 480 torchrun --nproc-per-node "$n" examples/gemma2/train.py $g2 --max-steps 8 --log-every 1 --no-progress \
      --metrics "$OUT/gemma2_${cfg}_32k_cp$n.json" 2>&1 | tail -30 || rc=1
fi
if [ "$phase" = multi ]; then                   # on a machine with several GPUs (fa4 installed)
  n=$($PY -c "import torch; print(torch.cuda.device_count())")
  sizes=""; for a in 2 4; do [ $((n % a)) = 0 ] && [ "$a" -lt "$n" ] && sizes="$sizes $a"; done
  step "cp_multi: N=$n GPUs, NCCL, ring / all_gather / a2a / auto${sizes:+ / a2a+p2p ($sizes)}"
  timeout 280 torchrun --nproc-per-node "$n" benchmarks/cp_multi.py --rep-ms 150 ${sizes:+--a2a-size $sizes} 2>&1 | tail -14 || rc=1
  cp $bench_out/cp_multi_N$n.json $bench_out/cp_multi_N$n.png "$OUT/" 2>/dev/null
  step "cp_multi: N=$n, Gemma2 local layers (window 4095)"
  timeout 200 torchrun --nproc-per-node "$n" benchmarks/cp_multi.py --rep-ms 150 --window 4095 --tag window ${sizes:+--a2a-size $sizes} 2>&1 | tail -14 || rc=1
  cp $bench_out/cp_multi_N${n}_window.* "$OUT/" 2>/dev/null
fi
if [ "$phase" = torchcp ]; then
  n=$($PY -c "import torch; print(torch.cuda.device_count())")
  step "torch_cp: N=$n, cps vs PyTorch's context_parallel (SDPA CP without softcap, flex CP with softcap 50)"
  timeout 360 torchrun --nproc-per-node "$n" benchmarks/torch_cp.py --rep-ms 150 2>&1 | tail -50 || rc=1
  cp $bench_out/torch_cp_N$n.json $bench_out/torch_cp_N$n.png "$OUT/" 2>/dev/null
fi
step "done rc=$rc"
exit $rc
