"""benchmarks/compile_modes.py's dry run (the compile suite's, tests/bench_dry.py): the harness
runs train.py per mode and records the medians (eager only in the dry run: the compiled modes'
inductor builds take minutes on CI's 2 cores; tests/test_gemma2_compile.py covers both modes'
results)."""
import pytest
from bench_dry import dry_record


@pytest.mark.timeout(1500)
def test_dry_run_records_each_mode(tmp_path_factory):
    (rec,) = dry_record(tmp_path_factory, "compile", "compile_modes")["records"]
    assert rec["mode"] == "eager" and rec["steps"] == 3 and rec["median_tokens_per_s"] > 0
    assert rec["median_mfu"] is None            # no GPU: no MFU
