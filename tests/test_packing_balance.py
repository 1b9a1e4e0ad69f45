"""benchmarks/packing_balance.py runs (dry run, tiny stream) and its numbers are sane: the
library's layout balances within 1.10 on every mix, never worse than whole-stream zigzag by more
than rounding, equals zigzag on one document, and pads nothing at these lengths."""
import json
import os

from benchmarks import packing_balance


def test_dry_run(tmp_path):
    rows = packing_balance.main(["--dry-run", "--out-dir", str(tmp_path)])
    blob = json.loads((tmp_path / "packing_balance.json").read_text())
    assert blob["meta"]["dry_run"] and blob["records"]
    for r in rows:
        assert r["packed"] <= 1.10, r
        assert r["packed"] <= r["zigzag"] + 1e-9, r
        assert r["packed_pad_pct"] == 0.0
        if r["mix"] == "single":
            assert r["packed"] == r["zigzag"] == 1.0 and r["packed_calls"] == r["zigzag_calls"]
