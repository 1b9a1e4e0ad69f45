"""Kernel calls for packed documents: which local query rows see which keys, per pair of ranks.

Pure integer host arithmetic on a PackedLayout (cp_softcap.documents), shared by every CP
algorithm. A DocCall is one kernel call: local query rows [q0, q1) x keys [k0, k1) of some key
buffer, split into `segments` (documents): segment s is rows [q0 + cu_q[s], q0 + cu_q[s+1]) and
keys [k0 + cu_k[s], k0 + cu_k[s+1]); a row sees only keys of its own segment, under the call's
window bottom-right aligned PER SEGMENT (the kernel contract of kernels/base.py, applied to each
segment; flash-attn's varlen functions do exactly this with cu_seqlens_q = cu_q, cu_seqlens_k =
cu_k). A call with one segment is an ordinary chunk-pair call (layout.PairCall).

How calls arise. Each rank's tokens are maximal runs of globally contiguous tokens. For every
(query run, key run, document) the visible box is trimmed exactly as layout.plan_pair does for
zigzag chunk pairs (every kept row sees at least one key, both window sides >= 0 or None).
Boxes adjacent in both rows and keys with the same raw local window fuse into one
multi-segment call: the diagonal of a run holding many short documents is ONE varlen call.
Two disjoint runs share at most one document (the one that crosses the gap between them), so
off-diagonal calls have a single segment. Pairs of ranks with no same-document visible key get
no call and send nothing.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence, Tuple, Union

import torch

from .documents import PackedLayout
from .layout import PairCall, trim_box
from .spec import Window

Run = Tuple[int, int, int]          # (global start, global end, local start)


@dataclass(frozen=True)
class DocCall:
    """One kernel call over document segments (see the module docstring for the rule)."""
    q0: int
    q1: int
    k0: int
    k1: int
    window: Window
    cu_q: Tuple[int, ...]           # segment row boundaries relative to q0: (0, ..., q1 - q0)
    cu_k: Tuple[int, ...]           # segment key boundaries relative to k0: (0, ..., k1 - k0)

    @property
    def segments(self) -> int:
        return len(self.cu_q) - 1

    @property
    def max_q(self) -> int:
        return max(b - a for a, b in zip(self.cu_q, self.cu_q[1:]))

    @property
    def max_k(self) -> int:
        return max(b - a for a, b in zip(self.cu_k, self.cu_k[1:]))

    @property
    def full(self) -> bool:
        return self.window == (None, None)

    def pair_call(self) -> Optional[PairCall]:
        """The same call as an ordinary chunk-pair call when it has one segment, else None."""
        if self.segments != 1:
            return None
        return PairCall(self.q0, self.q1, self.k0, self.k1, self.window)

    def shifted(self, dq: int = 0, dk: int = 0) -> "DocCall":
        return DocCall(self.q0 + dq, self.q1 + dq, self.k0 + dk, self.k1 + dk, self.window,
                       self.cu_q, self.cu_k)

    def area(self) -> int:
        """Visible (query, key) pairs of this call."""
        # each segment is an ordinary bottom-right aligned call of its own rows and keys
        return sum(PairCall(0, self.cu_q[s + 1] - self.cu_q[s], 0, self.cu_k[s + 1] - self.cu_k[s],
                            self.window).area() for s in range(self.segments))

    def token_ids(self, device=None):
        """Per row and per key: (q_seg [nq], q_pos [nq], k_seg [nk], k_pos [nk]) int64, such that
        row i sees key j iff q_seg[i] == k_seg[j] and q_pos[i] - left <= k_pos[j] <= q_pos[i] + right
        (visibility_mask). Positions are in the call's key coordinates, bottom-right aligned per
        segment: what a document-masking kernel (torch blocks, flex mask_mod) compares."""
        nq, nk = self.q1 - self.q0, self.k1 - self.k0
        q_seg = torch.empty(nq, dtype=torch.int64)
        q_pos = torch.empty(nq, dtype=torch.int64)
        k_seg = torch.empty(nk, dtype=torch.int64)
        for s in range(self.segments):
            qa, qb, ka, kb = self.cu_q[s], self.cu_q[s + 1], self.cu_k[s], self.cu_k[s + 1]
            q_seg[qa:qb] = s
            k_seg[ka:kb] = s
            q_pos[qa:qb] = torch.arange(qb - qa) + (kb - (qb - qa))
        k_pos = torch.arange(nk)
        return tuple(t.to(device) for t in (q_seg, q_pos, k_seg, k_pos))

    def mask(self, device=None) -> torch.Tensor:
        """bool [nq, nk]: which (row, key) pairs of the call are visible."""
        return visibility_mask(*self.token_ids(device), self.window)


def visibility_mask(q_doc: torch.Tensor, q_pos: torch.Tensor, k_doc: torch.Tensor,
                    k_pos: torch.Tensor, window: Window) -> torch.Tensor:
    """bool [nq, nk]: q_doc[i] == k_doc[j] >= 0 and q_pos[i] - left <= k_pos[j] <= q_pos[i] + right.

    The document-masking building block for the torch and flex kernels: document ids (-1 =
    padding, sees and is seen by nothing) and positions in one coordinate system (global
    positions with global document ids, or DocCall.token_ids)."""
    left, right = window
    vis = (q_doc[:, None] == k_doc[None, :]) & (q_doc[:, None] >= 0)
    if left is not None:
        vis &= k_pos[None, :] >= q_pos[:, None] - left
    if right is not None:
        vis &= k_pos[None, :] <= q_pos[:, None] + right
    return vis


def _split_wide(box, window: Window):
    """A trimmed box as boxes no flash-attn kernel misreads: [] for None, else the box, or, when
    its left side is bounded, its right side hides nothing and it has more rows than keys + 1,
    the rows that see every key (one fully visible box) and the rest (rows <= keys).

    flash-attn 2 (set_params_fprop/dgrad) replaces an unbounded right side by seqlen_k whenever
    the left side is bounded; bottom-right aligned, right = seqlen_k hides keys from the first
    rows once rows > keys + 1 (a document's start clips the keys of a later query run): the
    forward loses those keys and the backward their dK/dV (measured on an H200: dv 0.25 at
    cp 4, window (100, 0)). Splitting is exact for every kernel."""
    if box is None:
        return []
    qa, qb, ka, kb, raw = box
    left = window[0]
    if left is None or qb - qa <= kb - ka + 1 or (raw[1] is not None and raw[1] < qb - qa):
        return [box]
    last_full = ka + left               # rows up to here see keys ka..kb (every key)
    if last_full >= qb:
        return [box]
    return [b for b in (trim_box(qa, last_full, ka, kb, window), trim_box(last_full + 1, qb, ka, kb, window))
            if b is not None]


def _normalize(raw: Window, cu_q, cu_k) -> Window:
    """A side that hides nothing in any segment becomes None (as layout._normalize per call)."""
    left, right = raw
    if left is not None and left >= max(b - a for a, b in zip(cu_k, cu_k[1:])) - 1:
        left = None
    if right is not None and right >= max(b - a for a, b in zip(cu_q, cu_q[1:])) - 1:
        right = None
    return (left, right)


def run_calls(cu: Tuple[int, ...], q_runs: Sequence[Run], k_runs: Sequence[Run],
              window: Window) -> Tuple[DocCall, ...]:
    """Calls for queries in q_runs against keys in k_runs (local coordinates of each side)."""
    boxes = []
    for qg0, qg1, ql in q_runs:
        for kg0, kg1, kl in k_runs:
            last_doc = len(cu) - 2
            first = max(bisect_right(cu, qg0), bisect_right(cu, kg0)) - 1
            last = min(bisect_right(cu, qg1 - 1), bisect_right(cu, kg1 - 1)) - 1
            for d in range(first, min(last, last_doc) + 1):
                a, b = cu[d], cu[d + 1]
                # empty intersections (qa > qb or ka > kb) come back as None from trim_box
                box = trim_box(max(a, qg0), min(b, qg1) - 1, max(a, kg0), min(b, kg1) - 1, window)
                for qa, qb, ka, kb, raw in _split_wide(box, window):
                    boxes.append((qa - qg0 + ql, qb - qg0 + ql + 1, ka - kg0 + kl, kb - kg0 + kl + 1, raw))
    return _fuse(sorted(boxes, key=lambda b: (b[0], b[2])))


FULL = "full"                       # raw-window marker of a group fused from fully visible boxes


def _fuse(boxes) -> Tuple[DocCall, ...]:
    """Boxes sorted by (q0, k0) -> calls. Four fusions, all exact:
    - fully visible single-document boxes over the same rows with adjacent keys become one full
      call over the joined keys (a long document seen through several earlier key runs);
    - such a full call absorbs the next box over the same rows with adjacent keys whose window
      has no left bound: bottom-right alignment keeps that box's keys where they were and the
      full keys before them stay visible (earlier runs + the causal diagonal = one call);
    - boxes adjacent in rows AND keys with the same raw local window, or all fully visible,
      become one call with one segment each (the documents of a run; non-causal or length-1
      documents too);
    - stacked one-segment calls (see _stack): a run's causal diagonal and the next run's call
      over the same first key become one causal call (the zigzag self step is one call)."""
    groups = []
    for q0, q1, k0, k1, raw in boxes:
        full = _normalize(raw, (0, q1 - q0), (0, k1 - k0)) == (None, None)
        g = groups[-1] if groups else None
        if (g is not None and full and g["raw"] == FULL and (g["q0"], g["q1"]) == (q0, q1)
                and g["k1"] == k0):
            g["k1"], g["cu_k"][-1] = k1, k1 - g["k0"]
        elif (g is not None and g["raw"] == FULL and raw[0] is None and (g["q0"], g["q1"]) == (q0, q1)
              and g["k1"] == k0):
            g["k1"], g["cu_k"][-1], g["raw"] = k1, k1 - g["k0"], raw
        elif (g is not None and g["q1"] == q0 and g["k1"] == k0
              and (g["raw"] == raw or (full and g["raw"] == FULL))):
            g["cu_q"].append(q1 - g["q0"])
            g["cu_k"].append(k1 - g["k0"])
            g["q1"], g["k1"] = q1, k1
        else:
            groups.append({"q0": q0, "q1": q1, "k0": k0, "k1": k1, "raw": FULL if full else raw,
                           "cu_q": [0, q1 - q0], "cu_k": [0, k1 - k0]})
    groups = _stack(groups)
    return tuple(DocCall(g["q0"], g["q1"], g["k0"], g["k1"],
                         (None, None) if g["raw"] == FULL else _normalize(g["raw"], g["cu_q"], g["cu_k"]),
                         tuple(g["cu_q"]), tuple(g["cu_k"])) for g in groups)


def _stack(groups):
    """Join consecutive one-segment groups g, h with h's rows right after g's, the same first
    key, no left bound, g's last row seeing exactly up to g's last key (raw right 0, so g's rows
    see none of h's further keys), h's right side bounded and h's keys reaching at least as
    far: when both bottom-right diagonals are the same line (k1 - q1 + right equal), h's window
    gives g's rows exactly the keys they saw. Also joins two fully visible groups over the same
    keys with adjacent rows (two query runs that both see a whole earlier key range)."""
    out = []
    for h in groups:
        g = out[-1] if out else None
        if (g is not None and g["raw"] == FULL == h["raw"] and h["q0"] == g["q1"]
                and len(g["cu_q"]) == 2 == len(h["cu_q"]) and (g["k0"], g["k1"]) == (h["k0"], h["k1"])):
            g.update(q1=h["q1"], cu_q=[0, h["q1"] - g["q0"]])
        elif (g is not None and len(g["cu_q"]) == 2 and len(h["cu_q"]) == 2 and FULL not in (g["raw"], h["raw"])
                and g["raw"][0] is None and h["raw"][0] is None and g["raw"][1] == 0 and h["raw"][1] is not None
                and h["q0"] == g["q1"] and h["k0"] == g["k0"] and h["k1"] >= g["k1"]
                and g["k1"] - g["q1"] + g["raw"][1] == h["k1"] - h["q1"] + h["raw"][1]):
            g.update(q1=h["q1"], k1=h["k1"], raw=h["raw"], cu_q=[0, h["q1"] - g["q0"]],
                     cu_k=[0, h["k1"] - g["k0"]])
        else:
            out.append(h)
    return out


# --------------------------------------------------------------------------- per pair of ranks
#
# `Ranks` is one CP rank (ring, all_gather) or a tuple of ranks whose shards lie back to back in
# that order (a2a+p2p: the tokens an a2a group holds after its all-to-all, member j's shard at
# [j * local_len, (j + 1) * local_len)).

Ranks = Union[int, Tuple[int, ...]]


@lru_cache(maxsize=4096)
def group_runs(layout: PackedLayout, ranks: Ranks) -> Tuple[Run, ...]:
    """Runs (global start, global end, local start) of `ranks`' tokens in their local order."""
    if isinstance(ranks, int):
        return layout.runs(ranks)
    out = []
    for j, r in enumerate(ranks):
        for g0, g1, l0 in layout.runs(r):
            l0 += j * layout.local_len
            if out and out[-1][1] == g0 and out[-1][2] + out[-1][1] - out[-1][0] == l0:
                out[-1] = (out[-1][0], g1, out[-1][2])
            else:
                out.append((g0, g1, l0))
    return tuple(out)


@lru_cache(maxsize=4096)
def step_calls(layout: PackedLayout, q_rank: Ranks, kv_rank: Ranks, window: Window) -> Tuple[DocCall, ...]:
    """Calls for q_rank's local queries against kv_rank's LOCAL keys (ring, a2a+p2p), sorted by
    rows. `window` is the layer's normalised (left, right); it need not be the layout's."""
    return run_calls(layout.cu_seqlens, group_runs(layout, q_rank), group_runs(layout, kv_rank), window)


@lru_cache(maxsize=4096)
def send_ranges(layout: PackedLayout, q_rank: Ranks, kv_rank: Ranks, window: Window
                ) -> Tuple[Tuple[int, int], ...]:
    """Disjoint ascending [k0, k1) ranges of kv_rank's local keys that q_rank's queries see:
    exactly the keys some call reads (what kv_rank sends to q_rank); () = no message."""
    spans = sorted((c.k0, c.k1) for c in step_calls(layout, q_rank, kv_rank, window))
    out = []
    for k0, k1 in spans:
        if out and k0 <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], k1))
        else:
            out.append((k0, k1))
    return tuple(out)


@lru_cache(maxsize=4096)
def recv_calls(layout: PackedLayout, q_rank: Ranks, kv_rank: Ranks, window: Window
               ) -> Tuple[Tuple[Tuple[int, int], ...], Tuple[DocCall, ...]]:
    """(ranges, calls) for a receive buffer holding kv_rank's send_ranges back to back: range i
    at offset sum of the earlier ranges' lengths; the calls' keys index that buffer."""
    ranges = send_ranges(layout, q_rank, kv_rank, window)
    offsets, off = [], 0
    for k0, k1 in ranges:
        offsets.append(off - k0)
        off += k1 - k0
    calls = []
    for c in step_calls(layout, q_rank, kv_rank, window):
        i = bisect_right([r[0] for r in ranges], c.k0) - 1
        calls.append(c.shifted(dk=offsets[i]))
    return ranges, tuple(calls)


@lru_cache(maxsize=256)
def peers(layout: PackedLayout, window: Window) -> Tuple[Tuple[bool, ...], ...]:
    """peers[q_rank][kv_rank]: whether q_rank's queries see any of kv_rank's keys."""
    return tuple(tuple(bool(step_calls(layout, q, kv, window)) for kv in range(layout.cp))
                 for q in range(layout.cp))


@lru_cache(maxsize=1024)
def gathered_calls(layout: PackedLayout, q_rank: Ranks, window: Window) -> Tuple[DocCall, ...]:
    """Calls for q_rank's local queries against the WHOLE stream in global order (all_gather,
    after placing every rank's keys at layout.index(rank)): keys are global positions. A run's
    documents fuse into one varlen call whose keys of each document end at its last query."""
    return run_calls(layout.cu_seqlens, group_runs(layout, q_rank), ((0, layout.seq_len, 0),), window)


@lru_cache(maxsize=256)
def stream_calls(cu: Tuple[int, ...], seq_len: int, window: Window) -> Tuple[DocCall, ...]:
    """Calls for a whole stream on one device (cps.attention, a2a after its all-to-all, in
    global order): rows and keys are global positions; tokens past cu[-1] are in no call."""
    return run_calls(cu, ((0, seq_len, 0),), ((0, seq_len, 0),), window)


# --------------------------------------------------------------------------- ring blocks

@dataclass(frozen=True)
class DocSlot:
    """Rank `src`'s local key ranges `ranges` (its send_ranges towards this rank), received at
    ring step `step`, stored back to back from offset `off` of the block's K/V buffers."""
    step: int
    src: "Ranks"                    # a rank, or an a2a group (tuple of ranks) in a ring of groups
    ranges: Tuple[Tuple[int, int], ...]
    off: int

    @property
    def size(self) -> int:
        return sum(b - a for a, b in self.ranges)


@lru_cache(maxsize=4096)
def block_plan(layout: PackedLayout, rank: Ranks, window: Window, steps: Tuple[int, ...],
               ring: Tuple[Ranks, ...] = ()) -> Tuple[Tuple[DocSlot, ...], Tuple[DocCall, ...]]:
    """The slots and calls of one ring block (consecutive steps received together), as
    layout.block_plan for zigzag: calls are in block-buffer key coordinates; fully visible
    one-segment calls over the same rows with adjacent keys are joined into one call.

    `ring` lists the ring members (default: the cp ranks); `rank` is a member and step s
    receives from ring[(i - s) % n] where i is rank's position."""
    members = ring or tuple(range(layout.cp))
    i, n = members.index(rank), len(members)
    slots, calls, off = [], [], 0
    for s in steps:
        src = members[(i - s) % n]
        ranges, step_calls_ = recv_calls(layout, rank, src, window)
        if ranges:
            slot = DocSlot(s, src, ranges, off)
            slots.append(slot)
            calls.extend(c.shifted(dk=off) for c in step_calls_)
            off += slot.size
    return tuple(slots), _join_full(calls)


def _join_full(calls) -> Tuple[DocCall, ...]:
    """Join fully visible one-segment calls over the same rows whose keys are adjacent (the same
    long document seen through consecutive slots): softmax over a union of fully visible key
    sets does not depend on how it is split."""
    full = sorted((c for c in calls if c.full and c.segments == 1), key=lambda c: (c.q0, c.q1, c.k0))
    joined = []
    for c in full:
        p = joined[-1] if joined else None
        if p is not None and (p.q0, p.q1) == (c.q0, c.q1) and p.k1 == c.k0:
            joined[-1] = DocCall(p.q0, p.q1, p.k0, c.k1, (None, None), (0, p.q1 - p.q0), (0, c.k1 - p.k0))
        else:
            joined.append(c)
    return tuple(joined) + tuple(c for c in calls if not (c.full and c.segments == 1))


@lru_cache(maxsize=4096)
def block_exclusive(layout: PackedLayout, rank: Ranks, window: Window, steps: Tuple[int, ...],
                    ring: Tuple[Ranks, ...] = ()) -> bool:
    """True when no key of the block's buffer is read by two calls: each key's dK/dV is then ONE
    kernel partial and may travel back in the kernel's own dtype (as layout.block_exclusive)."""
    spans = sorted((c.k0, c.k1) for c in block_plan(layout, rank, window, steps, ring)[1])
    return all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
