"""Brute-force checks of the packed-document geometry (cp_softcap.doc_geometry), no processes.

For every query rank, the calls against every key rank (step_calls, and the same calls re-based
on the receive buffer by recv_calls), the all-gather calls and the one-device calls must cover
EXACTLY the visible same-document (global q, global k) pairs, each once; inside each call's
rectangle the call's mask must equal the global truth (nothing invisible is computed unmasked,
nothing visible is left to another call); every row of every segment sees a key (the kernel
contract); a peer with nothing visible has no call and sends nothing; what is sent is exactly
the keys some call reads.
"""
import random
from collections import Counter

import pytest
import torch

from cp_softcap.doc_geometry import (DocCall, block_exclusive, block_plan, gathered_calls, peers,
                                     recv_calls, send_ranges, step_calls, stream_calls,
                                     visibility_mask)
from cp_softcap.documents import doc_of, packed_layout
from cp_softcap.layout import plan_step
from cp_softcap.spec import normalize_window


def visible(cu, i: int, j: int, window) -> bool:
    left, right = window
    d = doc_of(cu, i)
    return (d >= 0 and d == doc_of(cu, j) and (left is None or i - left <= j)
            and (right is None or j <= i + right))


def segment_cells(call: DocCall):
    """(row, key) pairs, in call coordinates, a segment-wise kernel computes for `call`."""
    nq, nk = call.q1 - call.q0, call.k1 - call.k0
    assert nq > 0 and nk > 0, call
    for cu, n in ((call.cu_q, nq), (call.cu_k, nk)):
        assert cu[0] == 0 and cu[-1] == n and all(a < b for a, b in zip(cu, cu[1:])), call
    left, right = call.window
    assert (left is None or left >= 0) and (right is None or right >= 0), call
    cells = []
    for s in range(call.segments):
        qa, qb, ka, kb = call.cu_q[s], call.cu_q[s + 1], call.cu_k[s], call.cu_k[s + 1]
        shift = (kb - ka) - (qb - qa)
        for i in range(qb - qa):
            row = [(qa + i, ka + j) for j in range(kb - ka)
                   if (left is None or j >= i + shift - left) and (right is None or j <= i + shift + right)]
            assert row, f"segment {s} row {i} of {call} sees no key"
            cells += row
    assert len(cells) == call.area(), call
    return cells


def check_calls(cu, calls, row_pos, key_pos, window, pairs: Counter):
    """Add each call's global pairs to `pairs`; check the call's mask against the global truth."""
    for call in calls:
        cells = segment_cells(call)
        mask = call.mask()
        assert mask.sum().item() == len(cells)
        assert all(mask[i, j] for i, j in cells)
        for i in range(call.q1 - call.q0):
            for j in range(call.k1 - call.k0):
                gi, gj = row_pos[call.q0 + i], key_pos[call.k0 + j]
                assert bool(mask[i, j]) == visible(cu, gi, gj, window), (call, i, j, gi, gj)
        for i, j in cells:
            pairs[row_pos[call.q0 + i], key_pos[call.k0 + j]] += 1


def expected(cu, rows, seq_len, window):
    return {(i, j) for i in rows for j in range(seq_len) if visible(cu, i, j, window)}


def assert_exact(pairs: Counter, want, what):
    twice = sorted(p for p, n in pairs.items() if n > 1)
    assert not twice, f"{what}: pairs computed more than once: {twice[:8]}"
    assert set(pairs) == want, (f"{what}: missing {sorted(want - set(pairs))[:8]}, "
                                f"extra {sorted(set(pairs) - want)[:8]}")


def check_layout(layout, window):
    cu, cp, n = layout.cu_seqlens, layout.cp, layout.seq_len
    index = [layout.index(r).tolist() for r in range(cp)]
    for rq in range(cp):
        want = expected(cu, index[rq], n, window)
        pairs, buffered = Counter(), Counter()
        for rk in range(cp):
            calls = step_calls(layout, rq, rk, window)
            ranges = send_ranges(layout, rq, rk, window)
            assert peers(layout, window)[rq][rk] == bool(calls) == bool(ranges)
            check_calls(cu, calls, index[rq], index[rk], window, pairs)
            read = {k for c in calls for k in range(c.k0, c.k1)}
            sent = {k for a, b in ranges for k in range(a, b)}
            assert read == sent, (rq, rk, ranges)
            assert all(a < b for a, b in ranges) and all(
                p[1] < q[0] for p, q in zip(ranges, ranges[1:])), ranges
            got_ranges, bcalls = recv_calls(layout, rq, rk, window)
            assert got_ranges == ranges
            buf = [k for a, b in ranges for k in index[rk][a:b]]
            check_calls(cu, bcalls, index[rq], buf, window, buffered)
        assert_exact(pairs, want, f"rank {rq} step calls")
        assert_exact(buffered, want, f"rank {rq} buffer calls")
        gathered = Counter()
        check_calls(cu, gathered_calls(layout, rq, window), index[rq], list(range(n)), window, gathered)
        assert_exact(gathered, want, f"rank {rq} all-gather calls")


def random_docs(rng: random.Random, cp: int):
    """Boundaries mixing length 1, shorter than a chunk, longer than a rank's share, crossing rank
    borders, and sometimes an all-padding tail; returns (cu, user stream length)."""
    total = rng.choice([16 * cp, 16 * cp + 5, 24 * cp])
    tail = rng.choice([0, 0, 1, total // 3])
    cu = [0]
    while cu[-1] < total - tail:
        kind = rng.random()
        share = total // cp + 1                                 # longer than a rank's share
        n = 1 if kind < 0.25 else rng.randint(2, 5) if kind < 0.65 else rng.randint(share, max(share, total - 1))
        cu.append(min(total - tail, cu[-1] + n))
    return cu, total


WINDOWS = [(None, 0), (None, None), (0, 0), (1, 0), (3, 0), (9, 0), (2, 3), (None, 1), (0, 5), (1000, 0)]


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 5, 8])
def test_calls_cover_documents_exactly(cp):
    rng = random.Random(1000 + cp)
    for trial in range(2 if cp == 8 else 3):
        cu, total = random_docs(rng, cp)
        causal = trial % 2 == 0
        layout = packed_layout(cu, total, cp, causal=causal)
        assert layout.seq_len >= total and layout.seq_len % cp == 0
        windows = WINDOWS if cp <= 4 else [(None, 0), (None, None), (3, 0), (2, 3)]
        for window in windows:
            check_layout(layout, window)


def test_single_document_and_padding_only_rank():
    """A 3-token document in a 128-token stream at cp 8: at least 5 ranks hold only padding and
    must have no call and exchange nothing; one document spanning everything is zigzag."""
    layout = packed_layout([0, 3], 128, 8)
    for window in [(None, 0), (None, None), (2, 0)]:
        check_layout(layout, window)
    idle = [r for r in range(8) if all(d < 0 for d in layout.doc_ids(r).tolist())]
    assert len(idle) >= 5, layout.chunks
    for r in idle:
        assert not any(peers(layout, (None, 0))[r]) and not any(p[r] for p in peers(layout, (None, 0)))
    zig = packed_layout([0, 256], 256, 4)
    check_layout(zig, (None, 0))


def test_short_documents_fuse_into_one_varlen_call():
    """A run of many short documents is ONE call per (run, key run) with one segment per
    document (what flash-attn varlen takes), not one call per document."""
    cu = list(range(0, 257, 4))
    calls = stream_calls(tuple(cu), 256, (None, 0))
    assert len(calls) == 1 and calls[0].segments == 64 and calls[0].max_q == 4
    layout = packed_layout(cu, 256, 4)
    for r in range(4):
        assert len(step_calls(layout, r, r, (None, 0))) == 1
        assert all(not step_calls(layout, r, k, (None, 0)) for k in range(4) if k != r)


@pytest.mark.parametrize("lengths,window,n_calls", [
    ([2] * 128, (None, None), 1), ([1] * 256, (None, 0), 1), ([1, 3, 1, 1, 2] * 30, (None, None), 1),
    ([1, 1, 5] * 20, (2, 2), 2),        # the leading full boxes, then the windowed run
])
def test_fully_visible_documents_fuse_into_one_call(lengths, window, n_calls):
    """Non-causal documents and length-1 documents (every box fully visible) fuse like causal
    ones: one call, one segment per document, and every visible pair exactly once."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    total = cu[-1]
    calls = stream_calls(tuple(cu), total, window)
    assert len(calls) == n_calls and sum(c.segments for c in calls) == len(lengths), calls
    pairs = Counter()
    check_calls(tuple(cu), calls, list(range(total)), list(range(total)), window, pairs)
    assert_exact(pairs, expected(tuple(cu), range(total), total, window), "fused full boxes")


def test_stream_calls_and_window_beyond_documents():
    rng = random.Random(7)
    for _ in range(4):
        cu, total = random_docs(rng, 2)
        for window in WINDOWS:
            pairs = Counter()
            calls = stream_calls(tuple(cu), total, window)
            check_calls(tuple(cu), calls, list(range(total)), list(range(total)), window, pairs)
            assert_exact(pairs, expected(tuple(cu), range(total), total, window), "stream")
            # one device: no row and no key in two calls (packed_local keeps out, dQ and dK/dV
            # in the kernel's dtype, unsummed)
            for side in ((c.q0, c.q1) for c in calls), ((c.k0, c.k1) for c in calls):
                spans = sorted(side)
                assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), (cu, window, calls)


def test_visibility_mask_brute_force():
    """visibility_mask against a per-pair loop: document equality (padding -1 sees nothing)
    AND the window; a negative control shows the document term matters."""
    g = torch.Generator().manual_seed(3)
    for window in [(None, 0), (None, None), (2, 0), (1, 3)]:
        window = normalize_window(window, causal=False)
        q_doc = torch.randint(-1, 3, (9,), generator=g)
        k_doc = torch.randint(-1, 3, (11,), generator=g)
        q_pos, k_pos = torch.randint(0, 12, (9,), generator=g), torch.arange(11)
        got = visibility_mask(q_doc, q_pos, k_doc, k_pos, window)
        left, right = window
        for i in range(9):
            for j in range(11):
                want = (q_doc[i] >= 0 and q_doc[i] == k_doc[j]
                        and (left is None or k_pos[j] >= q_pos[i] - left)
                        and (right is None or k_pos[j] <= q_pos[i] + right))
                assert bool(got[i, j]) == bool(want)
        same = torch.zeros(9, dtype=torch.int64), torch.zeros(11, dtype=torch.int64)
        assert not torch.equal(visibility_mask(same[0], q_pos, same[1], k_pos, window), got)


@pytest.mark.parametrize("cp, size", [(4, 2), (6, 3), (8, 2)])
def test_a2a_groups_cover_exactly(cp, size):
    """a2a+p2p: a query group (members' shards back to back) against every key group, through
    step_calls and the buffer of recv_calls, covers the group's visible pairs exactly once."""
    rng = random.Random(cp * 10 + size)
    cu, total = random_docs(rng, cp)
    layout = packed_layout(cu, total, cp)
    groups = [tuple(range(g * size, (g + 1) * size)) for g in range(cp // size)]
    pos = {g: [t for r in g for t in layout.index(r).tolist()] for g in groups}
    for window in [(None, 0), (3, 0), (None, None)]:
        for gq in groups:
            pairs, buffered = Counter(), Counter()
            for gk in groups:
                calls = step_calls(layout, gq, gk, window)
                check_calls(layout.cu_seqlens, calls, pos[gq], pos[gk], window, pairs)
                ranges, bcalls = recv_calls(layout, gq, gk, window)
                buf = [k for a, b in ranges for k in pos[gk][a:b]]
                check_calls(layout.cu_seqlens, bcalls, pos[gq], buf, window, buffered)
            want = expected(layout.cu_seqlens, pos[gq], layout.seq_len, window)
            assert_exact(pairs, want, f"group {gq}")
            assert_exact(buffered, want, f"group {gq} buffer")


def test_stream_index_round_trip():
    layout = packed_layout([0, 5, 40, 90], 100, 4)
    idx = layout.stream_index()
    assert sorted(idx.tolist()) == list(range(layout.seq_len))
    x = torch.arange(layout.seq_len)[None] * 10
    local = torch.cat([x[:, layout.index(r)] for r in range(4)], dim=1)   # what an a2a delivers
    y = torch.empty_like(local)
    y[:, idx] = local
    assert torch.equal(y, x) and torch.equal(y[:, idx], local)


def block_splits(n: int):
    """Ways the ring may group steps 1..n-1 into consecutive blocks: one per step, all in one,
    and pairs."""
    steps = list(range(1, n))
    pairs = [tuple(steps[i:i + 2]) for i in range(0, len(steps), 2)]
    return [[(s,) for s in steps], [tuple(steps)] if steps else [], pairs]


@pytest.mark.parametrize("cp, size", [(1, 1), (2, 1), (3, 1), (5, 1), (4, 2), (6, 2)])
def test_ring_blocks_cover_exactly(cp, size):
    """Self step + every block's calls (block_plan, buffer coordinates) cover each member's
    visible pairs exactly once; each slot holds exactly what its source sends; block_exclusive
    is exactly 'no buffer key read by two calls'. size > 1: a ring of a2a groups."""
    rng = random.Random(50 + cp * size)
    cu, total = random_docs(rng, cp)
    layout = packed_layout(cu, total, cp)
    ring = tuple(tuple(range(g * size, (g + 1) * size)) if size > 1 else g for g in range(cp // size))
    pos = {m: [t for r in ((m,) if isinstance(m, int) else m) for t in layout.index(r).tolist()] for m in ring}
    for window in [(None, 0), (3, 0), (None, None), (1, 2)]:
        for blocks in block_splits(len(ring)):
            for i, me in enumerate(ring):
                pairs = Counter()
                check_calls(layout.cu_seqlens, step_calls(layout, me, me, window), pos[me], pos[me], window, pairs)
                for steps in blocks:
                    slots, calls = block_plan(layout, me, window, steps, ring if size > 1 else ())
                    buf, off = [], 0
                    for slot in slots:
                        assert slot.off == off and slot.ranges
                        assert slot.ranges == send_ranges(layout, me, slot.src, window)
                        assert slot.src == ring[(i - slot.step) % len(ring)]
                        buf += [k for a, b in slot.ranges for k in pos[slot.src][a:b]]
                        off += slot.size
                    check_calls(layout.cu_seqlens, calls, pos[me], buf, window, pairs)
                    reads = Counter(j for c in calls for j in range(c.k0, c.k1))
                    assert set(reads) == set(range(off)), "a key travels that no call reads"
                    assert block_exclusive(layout, me, window, steps, ring if size > 1 else ()) == all(
                        n == 1 for n in reads.values())
                want = expected(layout.cu_seqlens, pos[me], layout.seq_len, window)
                assert_exact(pairs, want, f"member {me} blocks {blocks} window {window}")


def test_one_document_is_the_zigzag_geometry():
    """One document over the whole stream: causal calls are exactly layout.plan_step's zigzag
    calls, and no window needs more calls than plan_step."""
    for cp in (2, 3, 4, 8):
        n = 32 * cp
        layout, chunk = packed_layout([0, n], n, cp), n // (2 * cp)
        for window in [(None, 0), (None, None), (3, 0), (chunk, 0), (2, 3), (chunk + 1, chunk // 2)]:
            for q in range(cp):
                for k in range(cp):
                    ours = step_calls(layout, q, k, window)
                    zig = plan_step(cp, q, k, chunk, window)
                    assert len(ours) <= len(zig), (cp, window, q, k)
                    if window == (None, 0):
                        key = lambda c: (c.q0, c.q1, c.k0, c.k1, c.window)  # noqa: E731
                        assert sorted(map(key, ours)) == sorted(map(key, zig)), (cp, q, k)
