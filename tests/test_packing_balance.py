"""benchmarks/packing_balance.py's dry run (tiny stream; the models suite's, tests/bench_dry.py)
and its numbers are sane: the library's layout balances within 1.10 on every mix, never worse
than whole-stream zigzag by more than rounding, equals zigzag on one document, and pads nothing
at these lengths."""
import pytest
from bench_dry import dry_record


@pytest.mark.timeout(1500)
def test_dry_run(tmp_path_factory):
    blob = dry_record(tmp_path_factory, "models", "packing_balance")
    assert blob["meta"]["dry_run"] and blob["records"]
    for r in blob["meta"]["rows"]:
        assert r["packed"] <= 1.10, r
        assert r["packed"] <= r["zigzag"] + 1e-9, r
        assert r["packed_pad_pct"] == 0.0
        if r["mix"] == "single":
            assert r["packed"] == r["zigzag"] == 1.0 and r["packed_calls"] == r["zigzag_calls"]
