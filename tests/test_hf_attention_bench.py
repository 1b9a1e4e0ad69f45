"""benchmarks/hf_attention.py's dry run (the hf suite's, tests/bench_dry.py): a tiny HF Gemma2
runs forward + backward with every implementation this machine has, cp_softcap's logits equal
eager's, sdpa is recorded as running without the softcap, and what cannot run here is recorded
with the reason."""
import pytest
from bench_dry import dry_record

pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[test]')")


@pytest.mark.timeout(1500)
def test_dry_run(tmp_path_factory):
    blob = dry_record(tmp_path_factory, "hf", "hf_attention")
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
