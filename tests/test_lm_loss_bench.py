"""benchmarks/lm_loss.py runs (dry run): every variant's loss and gradients stay within bf16
rounding of the float32 loss, and the records (and the plot, where matplotlib is installed) are
written."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.lm_loss import main  # noqa: E402


def test_dry_run_writes_its_records(tmp_path, capsys):
    assert main(["--dry-run", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    recs = json.load(open(tmp_path / "lm_loss.json"))["records"]
    assert [r["chunk"] for r in recs if r["variant"].startswith("ours")] == [64, 128, 256, 512]
    assert recs[-1]["variant"] == "PyTorch, full logits"
    for r in recs:
        assert r["loss_rel"] < 1e-2 and r["dh_rel"] < 3e-2 and r["dw_rel"] < 3e-2, r
        assert r["ms"] > 0
    assert (tmp_path / "lm_loss.png").is_file() or "matplotlib missing" in out
