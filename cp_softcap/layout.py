"""Zigzag chunk-pair geometry: which (query rows, key range, local window) each rank computes
against each other rank's K/V. Pure integer arithmetic, shared by every CP algorithm.

A rank's local sequence is 2c tokens: chunk a = global chunk r (local rows 0..c) and chunk
b = global chunk 2cp-1-r (local rows c..2c). For every (Q chunk, KV chunk) pair we trim the
exact visible bounding box under the global rule  i - left <= j <= i + right  and convert the
window to the kernel contract's bottom-right aligned local window (docs/kernels.md):
    d = (oq - ok) - (Sk - Sq);  left' = left - d;  right' = right + d.
Trimming guarantees left', right' >= 0 and that every kept row sees at least one key, so any
kernel that supports windows can serve the pair; pairs that see nothing are dropped.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Tuple

from .sharding import local_chunks
from .spec import Window


@dataclass(frozen=True)
class PairCall:
    """One kernel call: local query rows [q0, q1) x source-rank local keys [k0, k1)."""
    q0: int
    q1: int
    k0: int
    k1: int
    window: Window

    @property
    def full(self) -> bool:
        return self.window == (None, None)

    def area(self) -> int:
        """Visible (query, key) pairs: the work this call does, for load statistics."""
        sq, sk = self.q1 - self.q0, self.k1 - self.k0
        left, right = self.window
        shift = sk - sq
        total = 0
        for i in range(sq):
            lo = 0 if left is None else max(0, i + shift - left)
            hi = sk - 1 if right is None else min(sk - 1, i + shift + right)
            total += max(0, hi - lo + 1)
        return total


def _normalize(window: Window, sq: int, sk: int) -> Window:
    """Sides wide enough to hide nothing become None (unbounded)."""
    left, right = window
    if left is not None and left >= sk - 1:
        left = None
    if right is not None and right >= sq - 1:
        right = None
    return (left, right)


def plan_pair(oq: int, sq: int, ok: int, sk: int, window: Window
              ) -> Optional[Tuple[int, int, int, int, Window]]:
    """Trim the pair (queries at global oq..oq+sq, keys at ok..ok+sk) to its visible box.

    Returns (q0, q1, k0, k1, local_window) relative to the chunks' starts, or None if no query
    sees any key.
    """
    box = trim_box(oq, oq + sq - 1, ok, ok + sk - 1, window)
    if box is None:
        return None
    qa, qb, ka, kb, local = box
    return qa - oq, qb - oq + 1, ka - ok, kb - ok + 1, _normalize(local, qb - qa + 1, kb - ka + 1)


def trim_box(qa: int, qb: int, ka: int, kb: int, window: Window):
    """Rows [qa, qb] x keys [ka, kb] (inclusive global positions) trimmed to the visible box
    under `window`: (qa, qb, ka, kb, raw local window) or None. The raw window is the bottom-right
    aligned one before _normalize, so callers can compare boxes for fusion."""
    left, right = window
    if right is not None:
        qa = max(qa, ka - right)
    if left is not None:
        qb = min(qb, kb + left)
    if qa > qb:
        return None
    if left is not None:
        ka = max(ka, qa - left)
    if right is not None:
        kb = min(kb, qb + right)
    if ka > kb:
        return None
    d = qb - kb              # (qa - ka) - (n_k - n_q): the local shift of bottom-right alignment
    return qa, qb, ka, kb, (None if left is None else left - d, None if right is None else right + d)


@lru_cache(maxsize=4096)
def plan_step(cp: int, q_rank: int, kv_rank: int, chunk: int, window: Window) -> Tuple[PairCall, ...]:
    """Kernel calls for rank q_rank's queries against rank kv_rank's K/V (zigzag layout).

    Fuses pairs into fewer, larger calls where the result is identical: the causal diagonal as
    one causal call; full pairs sharing a KV chunk (or a Q chunk) as one call.
    """
    q_chunks = (q_rank, 2 * cp - 1 - q_rank)
    k_chunks = (kv_rank, 2 * cp - 1 - kv_rank)
    if q_rank == kv_rank and window == (None, 0):
        return (PairCall(0, 2 * chunk, 0, 2 * chunk, (None, 0)),)
    pairs = {}
    for qi, qc in enumerate(q_chunks):
        for ki, kc in enumerate(k_chunks):
            p = plan_pair(qc * chunk, chunk, kc * chunk, chunk, window)
            if p is not None:
                q0, q1, k0, k1, w = p
                pairs[(qi, ki)] = PairCall(q0 + qi * chunk, q1 + qi * chunk, k0 + ki * chunk,
                                           k1 + ki * chunk, w)

    def whole(qi, ki):
        p = pairs.get((qi, ki))
        return p is not None and p.full and p.q1 - p.q0 == chunk and p.k1 - p.k0 == chunk

    if all(whole(qi, ki) for qi in (0, 1) for ki in (0, 1)):
        return (PairCall(0, 2 * chunk, 0, 2 * chunk, (None, None)),)
    calls = []
    for ki in (0, 1):   # both Q chunks fully see one KV chunk
        if whole(0, ki) and whole(1, ki):
            calls.append(PairCall(0, 2 * chunk, ki * chunk, (ki + 1) * chunk, (None, None)))
            del pairs[(0, ki)], pairs[(1, ki)]
    for qi in (0, 1):   # one Q chunk fully sees both KV chunks
        if whole(qi, 0) and whole(qi, 1):
            calls.append(PairCall(qi * chunk, (qi + 1) * chunk, 0, 2 * chunk, (None, None)))
            del pairs[(qi, 0)], pairs[(qi, 1)]
    calls.extend(pairs[key] for key in sorted(pairs))
    return tuple(calls)


@lru_cache(maxsize=256)
def needs(cp: int, chunk: int, window: Window) -> Tuple[Tuple[bool, ...], ...]:
    """needs[q_rank][kv_rank]: whether q_rank's queries see any of kv_rank's keys."""
    return tuple(tuple(bool(plan_step(cp, q, kv, chunk, window)) for kv in range(cp))
                 for q in range(cp))


@lru_cache(maxsize=4096)
def key_range(cp: int, q_rank: int, kv_rank: int, chunk: int, window: Window
              ) -> Optional[Tuple[int, int]]:
    """[k0, k1) of kv_rank's local keys that q_rank's queries see (what the ring sends), or None.
    Under causal zigzag an earlier rank's second chunk is never visible: half-size messages."""
    calls = plan_step(cp, q_rank, kv_rank, chunk, window)
    if not calls:
        return None
    return min(c.k0 for c in calls), max(c.k1 for c in calls)


@dataclass(frozen=True)
class Slot:
    """Keys [k0, k1) of rank `src`, received at ring step `step`, stored at [off, off + k1 - k0)
    of the block's K/V buffers."""
    step: int
    src: int
    k0: int
    k1: int
    off: int


@lru_cache(maxsize=4096)
def block_plan(cp: int, rank: int, chunk: int, window: Window, steps: Tuple[int, ...]
               ) -> Tuple[Tuple[Slot, ...], Tuple[PairCall, ...]]:
    """The slots and kernel calls of one ring block (consecutive steps received together).

    Calls are in block-buffer key coordinates. Two calls over the same query rows whose keys lie
    back to back in the buffer become ONE call (a few long calls run much faster than many short
    ones on a GPU, and each call costs host time): when both are fully visible (softmax over a
    union of fully visible key sets does not depend on their order), or when their keys are
    globally contiguous (the union's visible pairs are exactly the union box under the window,
    which one bottom-right local window describes). With a bounded left window the slots lie in
    the buffer in GLOBAL key order rather than step order, so that a query chunk's earlier
    neighbours, received from different ranks, sit back to back: Gemma2's local layers at 32K,
    cp 8 then run 2 block calls per rank instead of 4. Messages are still posted in step order
    (the ring's _Block), so sends and receives match as before."""
    found = []
    for s in steps:
        src = (rank - s) % cp
        kr = key_range(cp, rank, src, chunk, window)
        if kr is not None:
            found.append((s, src, kr))
    if window[0] is not None:
        found.sort(key=lambda f: _global(cp, f[1], chunk, f[2][0]))
    slots, off = [], 0
    for s, src, (k0, k1) in found:
        slots.append(Slot(s, src, k0, k1, off))
        off += k1 - k0
    calls = []
    for slot in slots:
        shift = slot.off - slot.k0
        for c in plan_step(cp, rank, slot.src, chunk, window):
            call = PairCall(c.q0, c.q1, c.k0 + shift, c.k1 + shift, c.window)
            for i, prev in enumerate(calls):
                merged = _merge(cp, rank, chunk, window, slots, prev, call)
                if merged is not None:
                    calls[i] = merged
                    break
            else:
                calls.append(call)
    return tuple(slots), tuple(calls)


def _global(cp: int, rank: int, chunk: int, t: int) -> int:
    """Global position of rank's local token t (zigzag: sharding.local_chunks)."""
    return local_chunks(cp, rank)[t // chunk] * chunk + t % chunk


def _global_range(cp, chunk, slots, k0: int, k1: int):
    """Global [g0, g1) of buffer keys [k0, k1) when they are globally contiguous, else None
    (they may span several slots, each piece within one of its source's chunks)."""
    g0 = end = None
    for sl in slots:
        lo, hi = max(k0, sl.off), min(k1, sl.off + sl.k1 - sl.k0)
        if lo >= hi:
            continue
        t0, t1 = sl.k0 + lo - sl.off, sl.k0 + hi - sl.off
        if t0 // chunk != (t1 - 1) // chunk:        # spans both of the source's chunks
            return None
        start = _global(cp, sl.src, chunk, t0)
        if end is not None and start != end:
            return None
        g0 = start if g0 is None else g0
        end = start + (t1 - t0)
    return None if g0 is None or end - g0 != k1 - k0 else (g0, end)


def _merge(cp, rank, chunk, window, slots, a: PairCall, b: PairCall) -> Optional[PairCall]:
    """a and b as one call (see block_plan), or None. Globally contiguous keys: a and b are
    trims of one query chunk's rows against the window, so over their union box (rows of
    either, keys of both) the window shows exactly a's pairs and b's (a row outside a's rows
    sees none of a's keys), and every row of the union sees a key."""
    if a.k1 != b.k0:
        return None
    if a.full and b.full:
        if (a.q0, a.q1) != (b.q0, b.q1):
            return None
        return PairCall(a.q0, a.q1, a.k0, b.k1, (None, None))
    q0, q1 = min(a.q0, b.q0), max(a.q1, b.q1)
    if max(a.q0, b.q0) > min(a.q1, b.q1) or q0 // chunk != (q1 - 1) // chunk:
        return None                 # rows apart, or in both local chunks
    ga, gb = _global_range(cp, chunk, slots, a.k0, a.k1), _global_range(cp, chunk, slots, b.k0, b.k1)
    if ga is None or gb is None or ga[1] != gb[0]:
        return None
    qa = _global(cp, rank, chunk, q0)
    union = (qa, qa + q1 - q0 - 1, ga[0], gb[1] - 1)
    box = trim_box(*union, window)
    if box is None or box[:4] != union:
        return None
    return PairCall(q0, q1, a.k0, b.k1, _normalize(box[4], q1 - q0, b.k1 - a.k0))


@lru_cache(maxsize=4096)
def block_exclusive(cp: int, rank: int, chunk: int, window: Window, steps: Tuple[int, ...]) -> bool:
    """True when every key of rank's block (block_plan) is read by at most one kernel call:
    each key's dK/dV is then ONE kernel partial, so it can travel in the kernel's own dtype and
    be widened by its owner, with the same sums as sending a float32 copy. Causal zigzag blocks
    always are; a window can make two calls (two query chunks) read the same keys."""
    _, calls = block_plan(cp, rank, chunk, window, steps)
    spans = sorted((c.k0, c.k1) for c in calls if c.k1 > c.k0)
    return all(prev[1] <= nxt[0] for prev, nxt in zip(spans, spans[1:]))


def ring_blocks(cp: int, local_len: int, keys: int) -> Tuple[Tuple[int, ...], ...]:
    """Steps 1..cp-1 split into consecutive blocks of max(1, keys // local_len) steps. The same
    on every rank (local_len is), so every rank posts its messages in the same global order."""
    per = max(1, keys // max(local_len, 1))
    steps = list(range(1, cp))
    return tuple(tuple(steps[i:i + per]) for i in range(0, len(steps), per))
