"""Brute-force checks of the ring's block geometry (cp_softcap.layout: plan_step, key_range,
block_plan, ring_blocks), no processes, no tensors.

For every rank and every block split the ring can use, the (global query, global key) pairs
computed by the self step plus the calls of every block must be EXACTLY the pairs visible under
the mask, each computed once (a pair computed twice enters the LSE merge twice: wrong output),
and every slot must carry exactly key_range of its source (what the sender sends) and nothing
no call reads.

Coordinates, from cp/ring.py: a self-step call's keys are this rank's local keys; a block call's
keys index the block buffer, where slot s holds source s.src's local keys [s.k0, s.k1) at
[s.off, s.off + s.k1 - s.k0). Local index t of rank r is global chunk local_chunks(cp, r)[t // c]
at offset t % c. A call (q0, q1, k0, k1, (left, right)) uses the kernels' bottom-right aligned
window: local row i sees local key j iff i + (sk - sq) - left <= j <= i + (sk - sq) + right.
"""
from collections import Counter

import pytest

from cp_softcap.layout import (PairCall, block_exclusive, block_plan, key_range, needs, plan_step,
                               ring_blocks)
from cp_softcap.sharding import local_chunks

KEYS = (0, 1, "2c", "3c", 10 ** 9)          # CP_SOFTCAP_RING_BLOCK_KEYS values ("2c" = 2 * chunk)


def windows(c: int, cp: int):
    reach = 2 * cp * c                       # wider than the whole sequence
    return [(None, 0), (None, None), (0, 0), (1, 0), (c // 2, 0), (c - 1, 0), (c, 0),
            (c + 1, 0), (2 * c + 1, 0), (3 * c, 0), (reach + 5, 0),
            (c + 1, c // 2), (2, 3), (None, 1), (0, c + 2)]           # two-sided


def global_pos(cp: int, rank: int, chunk: int, t: int) -> int:
    return local_chunks(cp, rank)[t // chunk] * chunk + t % chunk


def visible(i: int, j: int, window) -> bool:
    left, right = window
    return (left is None or i - left <= j) and (right is None or j <= i + right)


def call_cells(call: PairCall):
    """(local row, key index) pairs the kernel computes for `call`; checks each row sees a key."""
    sq, sk = call.q1 - call.q0, call.k1 - call.k0
    assert sq > 0 and sk > 0, call
    left, right = call.window
    assert (left is None or left >= 0) and (right is None or right >= 0), call
    shift = sk - sq
    out = []
    for i in range(sq):
        row = [(call.q0 + i, call.k0 + j) for j in range(sk) if visible(i + shift, j, call.window)]
        assert row, f"row {call.q0 + i} of {call} sees no key (kernel contract: every row sees one)"
        out += row
    assert len(out) == call.area(), call
    return out


def covered(cp: int, rank: int, chunk: int, window, blocks):
    """Counter of (global q, global k) over the self step and every block's calls; also checks
    slots against key_range and the calls' key usage within each slot."""
    pairs = Counter()
    gq = lambda t: global_pos(cp, rank, chunk, t)  # noqa: E731
    for call in plan_step(cp, rank, rank, chunk, window):
        assert 0 <= call.q0 < call.q1 <= 2 * chunk and 0 <= call.k0 < call.k1 <= 2 * chunk, call
        for i, j in call_cells(call):
            pairs[gq(i), global_pos(cp, rank, chunk, j)] += 1
    for steps in blocks:
        slots, calls = block_plan(cp, rank, chunk, window, tuple(steps))
        # slots: one per step with visible keys, packed back to back in step order, or with a
        # bounded left window in the global order of their first keys
        found = []
        for s in steps:
            src = (rank - s) % cp
            kr = key_range(cp, rank, src, chunk, window)
            assert (kr is not None) == needs(cp, chunk, window)[rank][src]
            if kr is not None:
                found.append((s, src, kr[0], kr[1]))
        if window[0] is not None:
            found.sort(key=lambda f: global_pos(cp, f[1], chunk, f[2]))
        expect, off = [], 0
        for s, src, k0, k1 in found:
            expect.append((s, src, k0, k1, off))
            off += k1 - k0
        assert [(sl.step, sl.src, sl.k0, sl.k1, sl.off) for sl in slots] == expect
        owner = {}                           # buffer index -> (src, src local key)
        for sl in slots:
            assert 0 <= sl.k0 < sl.k1 <= 2 * chunk, sl
            for p in range(sl.off, sl.off + sl.k1 - sl.k0):
                owner[p] = (sl.src, sl.k0 + p - sl.off)
        used = {sl.src: set() for sl in slots}
        for call in calls:
            assert 0 <= call.q0 < call.q1 <= 2 * chunk and 0 <= call.k0 < call.k1 <= off, call
            for i, p in call_cells(call):
                src, t = owner[p]
                used[src].add(t)
                pairs[gq(i), global_pos(cp, src, chunk, t)] += 1
        for sl in slots:                     # key_range is the tight box of the keys read
            assert used[sl.src], f"slot {sl} travels but no call reads it"
            assert (min(used[sl.src]), max(used[sl.src]) + 1) == (sl.k0, sl.k1), \
                f"slot {sl}: calls read only {min(used[sl.src])}..{max(used[sl.src])}"
            if window[1] in (None, 0):       # one-sided: every key that travels is read. A
                # two-sided window can leave a hole (the head of chunk a and the tail of chunk b):
                # key_range is one contiguous range, so the hole travels too.
                assert used[sl.src] == set(range(sl.k0, sl.k1)), f"slot {sl}: unread keys travel"
    return pairs


def expected(cp: int, rank: int, chunk: int, window):
    s = 2 * cp * chunk
    return {(global_pos(cp, rank, chunk, t), j) for t in range(2 * chunk) for j in range(s)
            if visible(global_pos(cp, rank, chunk, t), j, window)}


def check(cp: int, chunk: int, window, keys):
    blocks = ring_blocks(cp, 2 * chunk, keys)
    per = max(1, keys // (2 * chunk))
    assert [s for b in blocks for s in b] == list(range(1, cp)), blocks
    assert all(1 <= len(b) <= per for b in blocks), (blocks, per)
    for rank in range(cp):
        # every other rank is the source of exactly one step
        assert sorted((rank - s) % cp for b in blocks for s in b) == [r for r in range(cp) if r != rank]
        pairs = covered(cp, rank, chunk, window, blocks)
        twice = {p: n for p, n in pairs.items() if n > 1}
        assert not twice, f"rank {rank}: pairs computed more than once: {sorted(twice)[:8]}"
        want = expected(cp, rank, chunk, window)
        assert set(pairs) == want, (f"rank {rank}: missing {sorted(want - set(pairs))[:8]}, "
                                    f"extra {sorted(set(pairs) - want)[:8]}")
    # what each sender sends at step s is what its receiver's slot expects (same blocks everywhere)
    for b in blocks:
        slots = {r: {sl.step: sl for sl in block_plan(cp, r, chunk, window, tuple(b))[0]}
                 for r in range(cp)}
        for r in range(cp):
            for s in b:
                dst = (r + s) % cp
                kr = key_range(cp, dst, r, chunk, window)
                got = slots[dst].get(s)
                assert (kr is None) == (got is None)
                if got is not None:
                    assert (got.src, got.k0, got.k1) == (r, kr[0], kr[1])
        # block_exclusive (16-bit dK/dV returns) is exactly "no buffer key read by two calls"
        for r in range(cp):
            reads = Counter(j for c in block_plan(cp, r, chunk, window, tuple(b))[1]
                            for j in range(c.k0, c.k1))
            assert block_exclusive(cp, r, chunk, window, tuple(b)) == all(
                n == 1 for n in reads.values()), (r, b, window)


@pytest.mark.parametrize("chunk", [4, 6])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_block_plan_covers_mask_exactly(cp, chunk):
    for window in windows(chunk, cp):
        for keys in KEYS:
            keys = {"2c": 2 * chunk, "3c": 3 * chunk}.get(keys, keys)
            check(cp, chunk, window, keys)


@pytest.mark.parametrize("window", [(None, 0), (None, None), (5, 0), (9, 0), (30, 0), (5, 2)])
def test_block_plan_cp8(window):
    chunk = 4
    for keys in (0, 2 * chunk, 3 * chunk, 5 * 2 * chunk, 10 ** 9):
        check(8, chunk, window, keys)


def test_ring_blocks_sizes():
    assert ring_blocks(1, 8, 16384) == ()
    assert ring_blocks(4, 8, 0) == ((1,), (2,), (3,))
    assert ring_blocks(4, 8, 7) == ((1,), (2,), (3,))
    assert ring_blocks(4, 8, 16) == ((1, 2), (3,))
    assert ring_blocks(5, 8, 24) == ((1, 2, 3), (4,))
    assert ring_blocks(4, 8, 10 ** 9) == ((1, 2, 3),)


def test_full_steps_coalesce():
    """Non-causal: every other rank is one full call over the same rows, so a block of all of
    them is ONE call over the concatenated keys; causal coalesces too (half-size messages)."""
    cp, chunk = 4, 4
    slots, calls = block_plan(cp, 0, chunk, (None, None), (1, 2, 3))
    assert len(calls) == 1 and calls[0] == PairCall(0, 2 * chunk, 0, 3 * 2 * chunk, (None, None))
    slots, calls = block_plan(cp, 3, chunk, (None, 0), (1, 2, 3))
    assert all(sl.k1 - sl.k0 == chunk for sl in slots)     # earlier ranks send only chunk a
    assert calls == (PairCall(0, 2 * chunk, 0, 3 * chunk, (None, None)),)


def test_window_neighbours_merge_into_one_call_per_query_chunk():
    """Gemma2's local layers (window (4095, 0)) at 32K, cp 8, one block: a query chunk's earlier
    neighbours come from different ranks but lie back to back in the buffer, so each query chunk
    reads them in one call (4 calls per middle rank otherwise); still exactly once per pair
    (the brute-force checks above run the same code on small chunks)."""
    cp, chunk, steps = 8, 2048, tuple(range(1, 8))
    counts = [len(block_plan(cp, r, chunk, (4095, 0), steps)[1]) for r in range(cp)]
    assert counts == [1, 2, 2, 2, 2, 2, 2, 2], counts
    _, calls = block_plan(cp, 3, chunk, (4095, 0), steps)
    assert [c.q1 - c.q0 for c in calls] == [chunk, chunk]          # whole query chunks
    assert all(c.k1 - c.k0 == 2 * chunk - 1 for c in calls)       # two neighbours, trimmed
