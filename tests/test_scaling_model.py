"""benchmarks/scaling_model.py with fixed kernel times (no GPU): bytes are the library's byte
model, infinite links leave only compute, slow links expose communication, auto's pick is judged."""
import pytest

from benchmarks import scaling_model as sm
from cp_softcap.comm_model import sent_per_rank
from cp_softcap.spec import make_spec


def _times(full_fb=72.0, full_f=13.0, factor=1.1):
    """One cp_sim-like blob: 9B heads, 32K, cp 8, rank time = factor x its pairs' time."""
    recs = []
    for mode, full in (("fwd", full_f), ("fwd+bwd", full_fb)):
        pairs = sum(sm.rank_area(32768, 8, 0, (None, 0), 32768))
        rate = sm.area(32768, 32768, (None, 0)) / full
        recs.append(dict(S=32768, cp=8, block_keys=32768, mode=mode, window=None, rank=0,
                         full_ms=full, rank_ms=factor * pairs / rate))
    return sm.KernelTimes([dict(meta=dict(heads=[16, 8, 256], device="fixed", argv=[]), records=recs)])


def test_area_matches_the_layout():
    from cp_softcap.layout import PairCall
    for sq, sk, w in ((64, 64, (None, 0)), (32, 96, (None, 0)), (64, 64, (10, 0)), (40, 70, (5, 3))):
        assert sm.area(sq, sk, w) == PairCall(0, sq, 0, sk, w).area()


def test_fixed_times_and_links():
    kt = _times()
    assert kt.factor("9B", False, "fwd+bwd", 4096) == pytest.approx(1.1)
    fast = sm.Links(1e12, 1e12, 0.0)
    recs = {r["comm"]: r for r in sm.predict("9B", 16, 32768, "causal", kt, fast)}
    spec = make_spec(head_dim=256, num_heads=16, num_kv_heads=8, dtype=__import__("torch").bfloat16,
                     device_type="cuda", softcap=50.0, causal=True, cp_size=16)
    ring_bytes = max(sum(o.values()) for o in sent_per_rank(spec, 32768, "ring", partial_bytes=2, block_keys=32768))
    assert recs["ring"]["MiB"] == pytest.approx(ring_bytes / 2 ** 20)
    for c in ("ring", "all_gather", "a2a", "a2a+p2p"):      # infinitely fast links: compute only
        assert recs[c]["exposed_ms"] == pytest.approx(0.0, abs=1e-6), c
    assert recs["a2a"]["ratio"] == pytest.approx(1.0)        # one whole-sequence call per rank
    slow = sm.Links(1.0, 0.1, 10.0)                           # 1 GB/s: communication dominates
    recs = {r["comm"]: r for r in sm.predict("9B", 16, 32768, "causal", kt, slow)}
    assert recs["ring"]["exposed_ms"] > recs["ring"]["compute_ms"]
    auto = recs["auto"]
    assert auto["pick"] == "a2a" and auto["best_single"] == "a2a" and auto["auto_right"]


def test_two_streams_overlap():
    ops = [("kv0", "comm", 2.0, ()), ("self", "compute", 3.0, ()), ("kv1", "comm", 2.0, ()),
           ("c0", "compute", 1.0, ("kv0",)), ("c1", "compute", 1.0, ("kv1",))]
    assert sm.two_streams(ops) == (5.0, 5.0)     # self 0..3, c0 3..4, kv1 lands at 4, c1 4..5
