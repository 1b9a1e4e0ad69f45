"""benchmarks/hf_attention.py --dry-run: a tiny HF Gemma2 runs forward + backward with every
implementation this machine has, cp_softcap's logits equal eager's, sdpa is recorded as running
without the softcap, and what cannot run here is recorded with the reason; JSON and PNG go to
$OUT, never into benchmarks/results."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[test]')")
ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)


def test_dry_run(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OUT=str(tmp_path), TMPDIR=str(tmp_path))
    start = time.time()
    res = subprocess.run([sys.executable, "benchmarks/hf_attention.py", "--dry-run", "--steps", "1"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, f"exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    blob = json.loads((tmp_path / "hf_attention.json").read_text())
    assert (tmp_path / "hf_attention.png").is_file() or "matplotlib missing" in res.stdout
    written = [p.name for p in (ROOT / "benchmarks" / "results").glob("hf_attention*")
               if p.stat().st_mtime >= start]
    assert not written, f"the dry run wrote into benchmarks/results: {written}"
    recs = {r["impl"]: r for r in blob["records"]}
    assert list(recs) == ["eager", "cp_softcap", "sdpa", "flash_attention_2"]
    for impl in ("eager", "cp_softcap", "sdpa"):
        r = recs[impl]
        assert "error" not in r, r
        assert r["tokens_per_s"] > 0 and r["loss"] == pytest.approx(recs["eager"]["loss"], rel=1e-2)
    assert recs["eager"]["logits_max_abs_diff"] == 0
    assert recs["cp_softcap"]["softcap"] and recs["cp_softcap"]["logits_max_abs_diff"] < 1e-4
    assert recs["sdpa"]["softcap"] is False and "softcap off" in recs["sdpa"]["forced"]
    assert recs["flash_attention_2"]["skipped"]
    assert blob["meta"]["seq_len"] == 128 and blob["meta"]["cp_softcap_kernel"] == "torch"
