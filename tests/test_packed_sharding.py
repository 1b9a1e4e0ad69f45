"""cps.sharding with cu_seqlens: round trips, document-relative positions, padding, errors; and
the packed layout itself (cp_softcap.documents): validation, hash, zigzag as the one-document
case, equal token counts, area bookkeeping, the solver, padding bounds."""
import random

import pytest
import torch

from cp_softcap import sharding
from cp_softcap.documents import (CHUNK_CHOICES, assign_chunks, check_cu_seqlens, chunk_areas,
                                  cu_hash, packed_layout)


def brute_area(cu, n, window, tokens):
    """Visible same-document pairs of the queries `tokens`, by enumeration."""
    left, right = window
    doc = [next((d for d in range(len(cu) - 1) if cu[d] <= t < cu[d + 1]), -1) for t in range(n)]
    return sum(1 for i in tokens for j in range(n) if doc[i] >= 0 and doc[i] == doc[j]
               and (left is None or i - left <= j) and (right is None or j <= i + right))


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_round_trip_and_positions(cp):
    rng = random.Random(cp)
    for trial in range(3):
        total = rng.randint(cp, 40 * cp)
        cu = [0]
        while cu[-1] < total - trial:
            cu.append(min(total - trial, cu[-1] + rng.choice([1, 2, 7, total // 2 + 1])))
        cu_t = torch.tensor(cu, dtype=torch.int32) if trial % 2 else cu
        x = torch.randn(2, total, 3)
        shards = [sharding.shard(x, cp, r, cu_seqlens=cu_t) for r in range(cp)]
        n = sharding.packed_len(total, cp)
        assert all(s.shape == (2, n // cp, 3) for s in shards)
        back = sharding.unshard(shards, cu_seqlens=cu_t)
        assert back.shape[1] == n and torch.equal(back[:, :total], x)
        assert torch.count_nonzero(back[:, total:]) == 0                  # padding appended at the end
        assert torch.equal(sharding.unshard(shards, cu_seqlens=cu_t, seq_len=total), x)
        ids = torch.arange(total)
        labels = [sharding.shard(ids, cp, r, cu_seqlens=cu, dim=0, pad_value=-100) for r in range(cp)]
        pos = [sharding.positions(total, cp, r, cu_seqlens=cu) for r in range(cp)]
        for r in range(cp):                                               # positions restart per document
            for g, p in zip(labels[r].tolist(), pos[r].tolist()):
                want = 0 if g == -100 or g >= cu[-1] else g - max(c for c in cu if c <= g)
                assert p == want, (cp, r, g, p, cu)


def test_without_cu_seqlens_is_zigzag():
    x = torch.arange(32).view(1, 32)
    for cp in (1, 2, 4):
        for r in range(cp):
            assert torch.equal(sharding.shard(x, cp, r), torch.cat(
                [x.chunk(2 * cp, 1)[r], x.chunk(2 * cp, 1)[2 * cp - 1 - r]], 1))
            assert torch.equal(sharding.positions(32, cp, r), sharding.shard(torch.arange(32), cp, r, dim=0))


def test_one_causal_document_is_zigzag():
    """One causal document over the whole stream: the solver returns exactly zigzag (m = 2,
    chunks r and 2cp-1-r) and the packed shards equal the zigzag shards."""
    for cp in (2, 3, 4, 8, 16):
        n = 16 * cp * 4
        layout = packed_layout([0, n], n, cp)
        assert layout.chunks_per_rank == 2 and layout.imbalance == 1.0
        assert layout.chunks == tuple((r, 2 * cp - 1 - r) for r in range(cp))
        x = torch.randn(1, n, 2)
        for r in range(cp):
            assert torch.equal(sharding.shard(x, cp, r, cu_seqlens=[0, n]), sharding.shard(x, cp, r))


def test_layout_areas_and_equal_counts():
    rng = random.Random(5)
    for cp in (2, 3, 4):
        total = 16 * cp * 2
        cu = [0]
        while cu[-1] < total - 5:
            cu.append(min(total - 5, cu[-1] + rng.randint(1, total // 2)))
        for causal, window in ((True, None), (True, (3, 0)), (False, None), (False, (2, 5))):
            layout = packed_layout(cu, total, cp, causal=causal, window=window)
            held = sorted(c for h in layout.chunks for c in h)
            assert held == list(range(cp * layout.chunks_per_rank))
            assert all(list(h) == sorted(h) and len(h) == layout.chunks_per_rank for h in layout.chunks)
            for r in range(cp):
                assert layout.rank_area[0][r] == brute_area(cu, layout.seq_len, layout.windows[0],
                                                            layout.index(r).tolist())


def test_assign_chunks_balances_and_is_deterministic():
    rng = random.Random(11)
    for _ in range(20):
        cp, m = rng.randint(2, 6), rng.choice([2, 4])
        areas = [rng.randint(0, 1000) for _ in range(cp * m)]
        got = assign_chunks(areas, cp)
        assert got == assign_chunks(list(areas), cp)
        loads = [sum(areas[c] for c in h) for h in got]
        assert all(len(h) == m for h in got)
        assert got == assign_chunks([areas, [0] * len(areas)], cp)      # joint solver, one live window
        # no single swap can lower the busiest rank (the local-search stopping rule)
        b = max(range(cp), key=lambda r: loads[r])
        for x in got[b]:
            for r in range(cp):
                for y in (got[r] if r != b else ()):
                    d = areas[x] - areas[y]
                    assert not (d > 0 and max(loads[b] - d, loads[r] + d) < loads[b])


def test_realistic_padding_below_one_percent():
    """The library pads fewer than 16 * cp tokens; realistic streams (>= 32K tokens) lose < 1 %."""
    for cp in (2, 4, 8, 16):
        for n in (32768, 32768 + 1000, 131072 - 7, 131072):
            pad = sharding.packed_len(n, cp) - n
            assert 0 <= pad < 16 * cp and pad / n < 0.01
    assert max(CHUNK_CHOICES) == 16


def test_chunk_areas_match_brute_force():
    cu = (0, 1, 4, 11, 12, 25)
    for window in ((None, 0), (None, None), (0, 0), (2, 0), (1, 2), (None, 3), (30, 0)):
        for chunks in (1, 2, 4, 7, 28):
            n = 28
            got = chunk_areas(cu, n, chunks, window)
            c = n // chunks
            assert got == tuple(brute_area(cu, n, window, range(i * c, (i + 1) * c)) for i in range(chunks))


@pytest.mark.parametrize("bad, match", [
    ([1, 5], "must start at 0"),
    ([0, 5, 5, 9], "zero-length document"),
    ([0, 7, 5], "decreasing boundary.*cumulative token offsets"),
    (torch.tensor([0, 32], device="meta"), "meta tensor"),
    ([0], "at least one document"),
    ([0, 40], "past the stream length 32"),
    (torch.tensor([[0, 32]]), "1-D"),
    (torch.tensor([0.0, 32.0]), "integers"),
    ([0, 3.5], "not an int"),
    ([0, True], "not an int"),
    ("0,32", "list of ints"),
])
def test_bad_cu_seqlens(bad, match):
    with pytest.raises((ValueError, TypeError), match=match) as info:
        sharding.shard(torch.zeros(1, 32), 2, 1, cu_seqlens=bad)
    assert "rank 1" in str(info.value)


def test_bad_layout_and_shards():
    layout = packed_layout([0, 64], 64, 2)
    with pytest.raises(ValueError, match="cp=2"):
        sharding.shard(torch.zeros(1, 64), 4, 0, cu_seqlens=layout)
    shards = [sharding.shard(torch.zeros(1, 64), 2, r, cu_seqlens=[0, 64]) for r in range(2)]
    with pytest.raises(ValueError, match="same length"):
        sharding.unshard([shards[0], shards[1][:, 1:]], cu_seqlens=[0, 64])
    with pytest.raises(ValueError, match="seq_len"):
        sharding.unshard(shards, cu_seqlens=[0, 60], seq_len=40)
    with pytest.raises(ValueError, match="outside the CP group"):
        sharding.positions(64, 2, 2, cu_seqlens=[0, 64])


def test_numpy_boundaries_are_accepted():
    np = pytest.importorskip("numpy")
    assert check_cu_seqlens(np.array([0, 3, 9])) == (0, 3, 9)


def test_hash_is_stable_and_sensitive():
    a = check_cu_seqlens(torch.tensor([0, 3, 9]))
    assert a == (0, 3, 9) and cu_hash(a) == cu_hash([0, 3, 9]) == cu_hash((0, 3, 9))
    assert cu_hash(a) != cu_hash((0, 4, 9)) and cu_hash(a) != cu_hash((0, 3, 9, 10))
    assert cu_hash((0, 1)) == 4059051691542397301       # same value in every process and release
    assert packed_layout([0, 3, 9], 9, 2).signature != packed_layout([0, 4, 9], 9, 2).signature


def test_layer_windows_balance_every_layer_kind():
    """Gemma2-like models alternate causal and sliding-window layers on the same shards: a
    layout for both reports both balances and keeps each within 1.10 where the causal-only
    layout leaves the window layers unbalanced."""
    rng = random.Random(0)
    n, cp = 8192, 4
    cu = [0]
    while cu[-1] < n:
        cu.append(min(n, cu[-1] + int(2 ** rng.uniform(4, 13))))
    both = packed_layout(cu, n, cp, layer_windows=[None, (255, 0)])
    alone = packed_layout(cu, n, cp)
    assert both.windows == ((None, 0), (255, 0)) and len(both.imbalances) == 2
    assert max(both.imbalances) <= 1.10, both.imbalances
    assert _ratio(cu, alone, (255, 0)) > 1.10                 # this mix needs the joint balance
    assert both.rank_area[1] == tuple(brute_area(cu, both.seq_len, (255, 0), both.index(r).tolist())
                                      for r in range(cp))
    with pytest.raises(ValueError, match="not both"):
        packed_layout(cu, n, cp, window=(3, 0), layer_windows=[None])


def _ratio(cu, layout, window):
    areas = chunk_areas(tuple(cu), layout.seq_len, layout.cp * layout.chunks_per_rank, window)
    loads = [sum(areas[c] for c in h) for h in layout.chunks]
    return max(loads) * len(loads) / sum(loads)


def test_chunks_per_rank_chosen_by_the_caller():
    """packed_layout(..., chunks_per_rank=m): that m (fewer, longer calls per rank than the
    library's balance-first choice), a round trip through its shards, the layout's compiled
    form carrying m; other values are refused."""
    cu, s, cp = [0, 64], 64, 4
    best = packed_layout(cu, s, cp, layer_windows=[None, (15, 0)])
    two = packed_layout(cu, s, cp, layer_windows=[None, (15, 0)], chunks_per_rank=2)
    assert best.chunks_per_rank > 2 and two.chunks_per_rank == 2
    assert two.imbalance >= best.imbalance
    x = torch.randn(1, s, 3)
    shards = [sharding.shard(x, cp, r, cu_seqlens=two) for r in range(cp)]
    assert torch.equal(sharding.unshard(shards, cu_seqlens=two)[:, :s], x)
    assert two.compiled_form.tolist() == cu + [2]
    for bad in (3, 32, 0, True):
        with pytest.raises(ValueError, match="chunks_per_rank"):
            packed_layout(cu, s, cp, chunks_per_rank=bad)
