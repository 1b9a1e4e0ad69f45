"""benchmarks/peers.py's CPU dry run (2 gloo ranks, tiny float32, our torch kernel): every cps
comm is exact against float64, peers without flash-attn are recorded, not dropped."""
import json

import pytest

from benchmarks import peers


def test_documents_divide_for_the_varlen_peer():
    cu = peers.documents(8192)
    assert cu == [0, 4096, 6144, 7168, 8192]
    assert all((e - b) % (2 * 128) == 0 for b, e in zip(cu, cu[1:]))      # rfa varlen up to N = 128


def test_yunchang_splits():
    assert peers._yunchang_degrees(1, 16, 8) == [(1, 1)]
    assert peers._yunchang_degrees(8, 16, 8) == [(8, 1), (1, 8), (4, 2)]


@pytest.mark.timeout(120)
def test_dry_run(tmp_path):
    rc = peers.main(["--dry-run", "--systems", "cps", "rfa", "yunchang", "--layouts", "window", "packed",
                     "--comms", "ring", "a2a", "--out-dir", str(tmp_path)])
    assert rc == 0
    blob = json.loads((tmp_path / "peers_N2.json").read_text())
    recs = blob["records"]
    assert blob["meta"]["complete"] and blob["meta"]["world"] == 2
    ours = [r for r in recs if r["system"] == "cps"]
    assert len(ours) == 2 * 2 * 2                    # 2 layouts x 2 caps x 2 comms
    assert all(r["status"] == "ok" and r["exact"] and r["fwd_bwd_ms"] > 0 for r in ours), ours
    assert {r["method"] for r in ours} == {"ring auto", "a2a auto"}
    caps = [r for r in ours if r["softcap"]]
    assert all(r["cap_effect"] > 0.1 for r in caps)  # dropping the cap would show as error
    others = [r for r in recs if r["system"] != "cps"]
    assert others and all(r["status"] in ("not installed", "not runnable here", "cannot") and r["reason"]
                          for r in others)
