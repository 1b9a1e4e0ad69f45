"""examples/gemma2's memory plan against the measured peak (benchmarks/training/memcheck.py under
torchrun, 2 gloo ranks, CPU: the second step's peak tensor memory from torch.profiler's
allocation records): within 15 % for ring and a2a without AC, bf16 under FSDP2 with
full AC (a wider model, so that activations dominate), and selective AC with a 32000-token
vocabulary in 128-token loss slices."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import gemma2_launch as L  # noqa: E402

MEMCHECK = os.path.join(L.ROOT, "benchmarks", "training", "memcheck.py")
SLOW = pytest.mark.slow       # the default run keeps the two AC modes (FSDP2 with full AC)
CASES = [pytest.param(["--ac", "none"], id="ring", marks=SLOW),
         pytest.param(["--ac", "none", "--comm", "a2a"], id="a2a", marks=SLOW),
         pytest.param(["--ac", "full", "--dtype", "bfloat16", "--fsdp", "--set", "hidden_size=256",
                       "--set", "intermediate_size=1024", "--batch-size", "1", "--seq-len", "4096"],
                      id="fsdp2_full_ac_bf16"),
         pytest.param(["--ac", "selective", "--vocab", "32000", "--batch-size", "1", "--seq-len", "2048",
                       "--loss-chunk", "128"], id="selective_ac_loss_slices")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES)
def test_plan_within_15_percent_of_measured_peak(tmp_path, case):
    L.run(2, MEMCHECK, ["--seq-len", "1024", "--batch-size", "4", "--no-progress", "--no-timing", *case,
                        "--out-dir", str(tmp_path), "--tag", "0"], 140, f"memcheck {' '.join(case)}")
    row = json.load(open(tmp_path / "memcheck_0.json"))["records"][0]
    assert 0.85 <= row["estimate_over_measured"] <= 1.15, row
