"""benchmarks/cp_sim.py --packed: the dry run (CPU, torch kernel, tiny shapes; the cp_sim suite's,
tests/bench_dry.py) records every rank of both layouts, and the simulated ranks' calls cover
exactly the full packed attention (so the timed ratio compares the same work)."""
import pytest
from bench_dry import dry_record

from benchmarks.packing_balance import fixed_layout, mix
from cp_softcap import doc_geometry as dgeo
from cp_softcap.documents import packed_layout

CAUSAL = (None, 0)


@pytest.mark.timeout(1500)
def test_packed_dry_run(tmp_path_factory):
    recs = dry_record(tmp_path_factory, "cp_sim", "cp_sim_packed_short")["records"]
    assert {(r["layout"], r["mode"], r["cp"]) for r in recs} == {
        (lay, m, cp) for lay in ("packed", "zigzag") for m in ("fwd", "fwd+bwd") for cp in (2, 4)}
    for r in recs:
        assert len(r["rank_ms"]) == r["cp"] and r["busiest_ms"] == max(r["rank_ms"]) > 0


def test_rank_calls_cover_the_stream():
    # every rank's self call + ring blocks (what PackedRankSim runs) = the stream's visible area
    s, cp = 2048, 4
    cu = tuple(mix("long-tail", s, 0))
    zig = fixed_layout(cu, s, cp, chunks=tuple((r, 2 * cp - 1 - r) for r in range(cp)))
    for lay in (packed_layout(cu, s, cp, window=CAUSAL), zig):
        total = sum(c.area() for c in dgeo.stream_calls(lay.cu_seqlens, lay.seq_len, CAUSAL))
        ranks = 0
        for r in range(cp):
            ranks += sum(c.area() for c in dgeo.step_calls(lay, r, r, CAUSAL))
            ranks += sum(c.area() for st in range(1, cp)
                         for c in dgeo.block_plan(lay, r, CAUSAL, (st,))[1])
        assert ranks == total
