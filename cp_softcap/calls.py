"""Kernel calls and ring geometry shared by the CP algorithms, for zigzag and packed layouts.

A call is a layout.PairCall (zigzag: one chunk pair) or a doc_geometry.DocCall (packed
documents: rows [q0, q1) x keys [k0, k1) split into segments). A one-segment DocCall is an
ordinary pair call, so the kernel gets exactly the arguments of the zigzag path; a call with
several segments passes `segments=(cu_q, cu_k)` (the kernel contract, kernels/base.py; packed
plans select only kernels with caps.segments).

The ring's geometry (which keys travel to whom, the blocks' slots and calls) comes from
layout.py for zigzag and from doc_geometry.py for packed documents; `Slot` is the common form:
the ring member index `src` whose key ranges `ranges` (its local coordinates) lie back to back
from `off` in the block's buffers.
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple, Tuple

import torch

from . import doc_geometry as dg
from . import layout as zz_layout
from .kernels.base import grad_dtype

Ranges = Tuple[Tuple[int, int], ...]


class Slot(NamedTuple):
    src: int                        # ring member index (the peer's rank in the ring's group)
    ranges: Ranges
    off: int
    size: int


# ------------------------------------------------------------------------------ kernel calls

def _segments(c):
    """(cu_q, cu_k) of a multi-segment DocCall, else None (an ordinary pair call)."""
    return (c.cu_q, c.cu_k) if getattr(c, "cu_q", None) is not None and len(c.cu_q) > 2 else None


def call_forward(kernel, q, k, v, c, scale, softcap):
    """(out, lse) of call `c`: rows c.q0:c.q1 of q against keys c.k0:c.k1 of k/v."""
    qs, ks, vs = q[:, c.q0:c.q1], k[:, c.k0:c.k1], v[:, c.k0:c.k1]
    segs = _segments(c)
    if segs is None:        # keyword left out: kernels written before segments= keep working
        return kernel.forward(qs, ks, vs, scale=scale, softcap=softcap, window=c.window)
    return kernel.forward(qs, ks, vs, scale=scale, softcap=softcap, window=c.window, segments=segs)


def call_backward(kernel, dout, q, k, v, out, lse, dlse, c, scale, softcap):
    """(dq, dk, dv) of call `c` given the final (out, lse) of its rows (full-row tensors)."""
    rows, keys = slice(c.q0, c.q1), slice(c.k0, c.k1)
    args = (dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows], lse[:, :, rows])
    dl = None if dlse is None else dlse[:, :, rows]
    segs = _segments(c)
    if segs is None:
        return kernel.backward(*args, scale=scale, softcap=softcap, window=c.window, dlse=dl)
    return kernel.backward(*args, scale=scale, softcap=softcap, window=c.window, dlse=dl, segments=segs)


@lru_cache(maxsize=8)
def stream_order(layout, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(idx, inv) for all ranks' packed shards back to back (what a gather or a sequence
    all-to-all delivers): x[:, inv] puts them in global order, y[:, idx] takes them back.
    Cached for the few layouts of one step (two int64 stream-length device tensors each: 16 MB
    at 1M tokens); the boundaries change every step."""
    idx = layout.stream_index()
    return idx.to(device), torch.argsort(idx).to(device)


def disjoint_rows(kernel, q, k, v, calls, scale, softcap, head_dim_v: int):
    """(out, lse) of calls whose rows are disjoint, in the kernel's own dtypes (see rows_out).
    One call over every row returns the kernel's tensors as they are (the common packed batch:
    one varlen call)."""
    if len(calls) == 1 and (calls[0].q0, calls[0].q1) == (0, q.shape[1]):
        return call_forward(kernel, q, k, v, calls[0], scale, softcap)
    parts = ((c.q0, c.q1) + tuple(call_forward(kernel, q, k, v, c, scale, softcap)) for c in calls)
    return rows_out(parts, q, head_dim_v)


def rows_out(parts, q, head_dim_v: int):
    """(out, lse) over q's rows from parts (q0, q1, out, lse) of disjoint row ranges, kept in the
    kernel's own dtypes: nothing is merged, so a widened accumulator would only cost copies and,
    for fa4, a D fix-up in backward. Rows in no part: out 0, LSE -inf."""
    b, t, hq = q.shape[:3]
    out = lse = None
    for q0, q1, o, l in parts:
        if out is None:
            out = torch.zeros(b, t, hq, head_dim_v, dtype=o.dtype, device=q.device)
            lse = torch.full((b, hq, t), float("-inf"), dtype=l.dtype, device=q.device)
        out[:, q0:q1] = o
        lse[:, :, q0:q1] = l
    if out is None:                 # no row sees a key (all padding, or outside the window)
        out = torch.zeros(b, t, hq, head_dim_v, dtype=q.dtype, device=q.device)
        lse = torch.full((b, hq, t), float("-inf"), dtype=grad_dtype(q.dtype), device=q.device)
    return out, lse


def backward_into(kernel, dout, q, k, v, out, lse, dlse, calls, scale, softcap, dq, dk, dv) -> None:
    """Backward of `calls`, adding into the GradAccumulators dq (rows) and dk/dv (keys)."""
    for c in calls:
        gq, gk, gv = call_backward(kernel, dout, q, k, v, out, lse, dlse, c, scale, softcap)
        dq.add(c.q0, c.q1, gq)
        dk.add(c.k0, c.k1, gk)
        dv.add(c.k0, c.k1, gv)


# ------------------------------------------------------------------------------ ring geometry
#
# seq is a plan.SeqShards or a RingView: size ring members, this rank is member seq.rank;
# seq.documents is None (zigzag chunks of seq.chunk tokens) or the PackedLayout, whose ring
# members are seq.ring (CP ranks, or a2a groups as tuples of CP ranks for a2a+p2p).

class RingView(NamedTuple):
    """The geometry fields of plan.SeqShards, for the byte model (no process group)."""
    size: int
    rank: int
    chunk: int
    window: tuple
    documents: object = None
    ring: tuple = ()


def ring_members(cp: int, a2a_size: int = 1) -> tuple:
    """A packed ring's members as doc_geometry ranks: the CP ranks, or for a2a+p2p the a2a
    groups (ring rank o holds CP ranks o * a2a_size .. (o + 1) * a2a_size - 1)."""
    if a2a_size == 1:
        return tuple(range(cp))
    return tuple(tuple(range(o * a2a_size, (o + 1) * a2a_size)) for o in range(cp // a2a_size))


def self_calls(seq):
    """Calls of this member's queries against its own keys."""
    if seq.documents is None:
        return zz_layout.plan_step(seq.size, seq.rank, seq.rank, seq.chunk, seq.window)
    me = seq.ring[seq.rank]
    return dg.step_calls(seq.documents, me, me, seq.window)


def send_ranges(seq, dst: int) -> Ranges:
    """This member's local key ranges that member dst's queries see (what travels to dst)."""
    if seq.documents is None:
        kr = zz_layout.key_range(seq.size, dst, seq.rank, seq.chunk, seq.window)
        return () if kr is None else (kr,)
    return dg.send_ranges(seq.documents, seq.ring[dst], seq.ring[seq.rank], seq.window)


def block(seq, steps) -> Tuple[Tuple[Slot, ...], tuple]:
    """(slots, calls) of this member's ring block `steps`; calls index the block buffers."""
    if seq.documents is None:
        return _zigzag_block(seq.size, seq.rank, seq.chunk, seq.window, steps)
    return _packed_block(seq.documents, seq.ring, seq.rank, seq.window, steps)


def exclusive(seq, member: int, steps) -> bool:
    """Whether member's block `steps` reads each buffer key in one call (layout.block_exclusive)."""
    if seq.documents is None:
        return zz_layout.block_exclusive(seq.size, member, seq.chunk, seq.window, steps)
    return dg.block_exclusive(seq.documents, seq.ring[member], seq.window, steps, seq.ring)


@lru_cache(maxsize=4096)
def _zigzag_block(cp, rank, chunk, window, steps):
    slots, calls = zz_layout.block_plan(cp, rank, chunk, window, steps)
    return tuple(Slot(s.src, ((s.k0, s.k1),), s.off, s.k1 - s.k0) for s in slots), calls


@lru_cache(maxsize=4096)
def _packed_block(layout, ring, rank, window, steps):
    slots, calls = dg.block_plan(layout, ring[rank], window, steps, ring)
    return tuple(Slot(ring.index(s.src), s.ranges, s.off, s.size) for s in slots), calls


def take(x: torch.Tensor, ranges: Ranges) -> torch.Tensor:
    """x's positions (dim 1) in `ranges`, back to back (a view for one range)."""
    if len(ranges) == 1:
        return x[:, ranges[0][0]:ranges[0][1]]
    return torch.cat([x[:, a:b] for a, b in ranges], dim=1)


def split(buf: torch.Tensor, ranges: Ranges):
    """[(k0, k1, part)] of a buffer holding `ranges` back to back (buf itself for one range)."""
    if len(ranges) == 1:
        return [(ranges[0][0], ranges[0][1], buf)]
    out, off = [], 0
    for a, b in ranges:
        out.append((a, b, buf[:, off:off + b - a]))
        off += b - a
    return out
