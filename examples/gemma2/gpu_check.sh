#!/usr/bin/env bash
# The Gemma2 example on one GPU: the memory plan against torch.cuda's measured peak (2b, 8K
# tokens, cp 1, bf16, each --ac), the step time of each --ac choice (2b shapes, 4 layers, steps
# interleaved in one process), and --compile against eager (2b, 4K tokens). JSON lines and logs go
# to $OUT (default /tmp/gemma2_gpu). Run from the repository root: bash examples/gemma2/gpu_check.sh
set -u
OUT=${OUT:-/tmp/gemma2_gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
G=examples/gemma2
phase=${1:-all}
if [[ $phase == all || $phase == memory ]]; then
  for ac in none selective full; do
    python $G/memcheck.py --config 2b --seq-len 8192 --batch-size 1 --ac $ac --no-progress \
      --json "$OUT/memory.jsonl" 2>&1 | tail -3
  done
fi
if [[ $phase == all || $phase == ac ]]; then
  python $G/memcheck.py --ac-timing --config 2b --set num_hidden_layers=4 --seq-len 8192 \
    --batch-size 1 --no-progress --json "$OUT/ac_timing.jsonl" 2>&1 | tail -3
fi
if [[ $phase == all || $phase == compile ]]; then
  for c in "" --compile; do
    python $G/train.py --config 2b --seq-len 4096 --batch-size 1 --max-steps 8 --no-progress \
      --metrics "$OUT/train${c}.jsonl" $c > "$OUT/train${c}.log" 2>&1
    tail -3 "$OUT/train${c}.log"
  done
fi
