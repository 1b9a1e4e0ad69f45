"""benchmarks/tile_model.py: its CTA arithmetic on shapes counted by hand, the greedy schedule,
and its dry run in the models suite (tests/bench_dry.py): the fits stay within their stated
residuals and the time splits into shares that sum to one."""
import math

import pytest
from bench_dry import dry_record

from benchmarks import tile_model as tm


def test_cta_loops_counted_by_hand():
    # head dim 128, GQA 2: forward tiles of 128 rows = 64 tokens x 2 heads, 128 keys
    causal = tm.Call("c", [(256, 256, True)], varlen=False)
    assert sorted(tm.forward_ctas(causal, 2, 1, 128)) == [1, 1, 2, 2]     # 4 query tiles x 1 KV head
    # backward: 64 x 128 tiles, one query head per CTA; key tile j is seen by query tiles 2j..3
    assert sorted(tm.backward_ctas(causal, 2, 128)) == [2, 2, 4, 4]
    full = tm.Call("f", [(128, 512, False)], varlen=False)
    assert tm.backward_ctas(full, 1, 128) == [2, 2, 2, 2]                # every key tile sees both
    assert causal.area() == 256 * 257 // 2 and full.area() == 128 * 512
    # bottom-right causal with more keys than queries: each query also sees every earlier key
    assert tm.Call("br", [(4, 10, True)], varlen=True).area() == 4 * 6 + 10


def test_greedy_schedule():
    assert tm.makespan([4, 4, 4], 0.0, sms=3) == 4
    assert tm.makespan([4, 4, 4, 4], 1.0, sms=3) == 10
    assert tm.makespan([1] * 6, 0.0, sms=4) == 2


def test_ring_rank_one_call_has_the_rank_area():
    calls, one = tm.ring_rank(32768, 8, rank=3)
    assert sum(c.area() for c in calls) == one.area()
    s, cp = 32768, 8
    assert one.area() * cp * 2 == pytest.approx(s * (s + 1), rel=1 / cp)   # zigzag: equal shares


@pytest.mark.timeout(600)
def test_dry_run_record(tmp_path_factory):
    blob = dry_record(tmp_path_factory, "models", "tile_model")
    fits = [r for r in blob["records"] if r["kind"] == "fit"]
    assert {(r["model"], r["mode"]) for r in fits} == {(m, d) for m in ("9B", "27B") for d in ("fwd", "bwd")}
    for r in fits:     # 9B: two shapes, two parameters (exact); 27B: four shapes
        assert abs(r["rel_err"]) < 0.15, r
        assert 0 <= r["beta_steps"] < 20, r                 # not pinned at the searched range's end
        shares = [v for k, v in r.items() if k.startswith("share_")]
        assert math.isclose(sum(shares), 1.0, rel_tol=1e-9) and min(shares) >= -1e-9, r
    split = next(r for r in blob["records"] if r["kind"] == "measured split")
    assert 0 < split["other_share"] < 1
