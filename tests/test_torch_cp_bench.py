"""benchmarks/torch_cp.py's dry run (the peers suite's, tests/bench_dry.py): both systems run on 2
gloo ranks (torch's CP where it works on CPU, its error recorded where it does not), the records
cover every system, case and shape, and where torch's CP produced an output it agrees with cps's
within float32 tolerance."""
import pytest
from bench_dry import dry_record

pytestmark = pytest.mark.timeout(1500)


@pytest.fixture(scope="module")
def blob(tmp_path_factory):
    return dry_record(tmp_path_factory, "peers", "torch_cp_N2")


def test_records_cover_every_system_case_and_shape(blob):
    recs, meta = blob["records"], blob["meta"]
    assert meta["world"] == 2 and meta["backend"] == "gloo" and meta["complete"] is True
    assert meta["shards_match"] is True, "torch's head-tail shards are not cps's zigzag shards"
    hq, hkv, _ = meta["heads"]
    for s_local in meta["local_seqs"]:
        for case in ("no_softcap", "softcap"):
            mine = [r for r in recs if r["S_local"] == s_local and r["case"] == case]
            assert {r["system"] for r in mine} == {"torch_cp", "cps"}, (case, s_local)
            ours = [r for r in mine if r["system"] == "cps"]
            assert {(r["method"], r["kv_heads"]) for r in ours} == \
                {(c, h) for c in meta["comms"] for h in (hkv, hq)}
            for r in ours:
                assert r["error"] is None and r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0, r
            for r in mine:
                if r["system"] == "torch_cp" and (r["fwd_ms"] is None or r["fwd_bwd_ms"] is None):
                    assert r["error"], f"torch record without a time and without its error: {r}"
    sdpa = [r for r in recs if r["method"].startswith("sdpa")]
    assert {r["kv_heads"] for r in sdpa} == {hkv, hq} and any(r["enable_gqa"] for r in sdpa)


def test_outputs_agree_where_torch_ran(blob):
    ran = [r for r in blob["records"] if r["system"] == "torch_cp" and r["fwd_ms"] is not None]
    assert ran, "torch's CP produced no output on CPU (flex's forward runs there)"
    for r in ran:
        assert r["max_abs_diff"] is not None and r["max_abs_diff"] < 1e-5, r
        ours = [c for c in blob["records"] if c["system"] == "cps" and c["case"] == r["case"]
                and c["S_local"] == r["S_local"]]
        assert all(c["ratio_fwd"] > 0 for c in ours), ours
