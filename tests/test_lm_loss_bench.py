"""benchmarks/lm_loss.py's dry run (the training suite's, tests/bench_dry.py): every variant's
loss and gradients stay within bf16 rounding of the float32 loss, and the records are written."""
import pytest
from bench_dry import dry_record


@pytest.mark.timeout(1500)
def test_dry_run_records(tmp_path_factory):
    recs = dry_record(tmp_path_factory, "training", "lm_loss")["records"]
    assert [r["chunk"] for r in recs if r["variant"].startswith("ours")] == [64, 128, 256, 512]
    assert recs[-1]["variant"] == "PyTorch, full logits"
    for r in recs:
        assert r["loss_rel"] < 1e-2 and r["dh_rel"] < 3e-2 and r["dw_rel"] < 3e-2, r
        assert r["ms"] > 0
