"""benchmarks/compile_modes.py's CPU dry run: the harness runs train.py per mode and records the
medians (eager only here: the compiled modes' inductor builds take minutes on CI's 2 cores;
tests/test_gemma2_compile.py covers both modes' results)."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks import compile_modes  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_dry_run_records_each_mode(tmp_path):
    assert compile_modes.main(["--dry-run", "--modes", "eager", "--out-dir", str(tmp_path)]) == 0
    blob = json.load(open(tmp_path / "compile_modes.json"))
    (rec,) = blob["records"]
    assert rec["mode"] == "eager" and rec["steps"] == 3 and rec["median_tokens_per_s"] > 0
    assert rec["median_mfu"] is None            # no GPU: no MFU
