"""All-gather context parallelism (Llama-3 style) on the zigzag layout.

K/V are gathered in two pieces: the first halves of every rank (global chunks 0..cp-1, which
arrive in natural order) and the second halves (chunks 2cp-1..cp, reversed). Each local query
chunk attends to exactly its visible key range (causal prefix, trimmed by the window) in ONE
kernel call, no merge. The first local chunk (global chunk r) under causal attention needs only
first halves, so it is computed while the second gather is still in flight. A chunk whose range
lies in one half uses a view of that half; only a range that straddles both is concatenated.
Backward re-gathers K/V (no S-sized buffers kept between passes), accumulates dK/dV in float32
in global order and reduce-scatters them in float32 to their zigzag owners.

Packed documents (plan.seq.documents): one gather of the whole shards, put in global order
(layout.stream_index), and doc_geometry.gathered_calls: for each of this rank's runs, its
documents in one varlen call whose keys of each document end at the run's last query of it.
Every row lies in at most one call (no merge); padding rows in none (out 0, LSE -inf). dK/dV
in global order go back to the back-to-back shard order and are reduce-scattered in float32.
"""
from __future__ import annotations

import torch

from ..doc_geometry import gathered_calls
from ..layout import plan_pair
from ..merge import GradAccumulator
from ..transport import all_gather, reduce_scatter, wait
from ..calls import backward_into, disjoint_rows, rows_out, stream_order
from .guard import shard_function
from .kv_buffer import kv_buffer, kv_views


class _Gathered:
    """The two gathered halves of K/V, in global order, with lazy views of key ranges."""

    def __init__(self, k, v, group, cp, op):
        self.cp, self.k_shape, self.v_shape = cp, k.shape, v.shape
        self.half = k.shape[1] // 2
        k1, k2 = k.chunk(2, dim=1)
        v1, v2 = v.chunk(2, dim=1)
        self.group, self.op = group, op
        self.first, self.w1 = all_gather(kv_buffer(k1, v1), group, op, async_op=True)
        self.second, self.w2 = all_gather(kv_buffer(k2, v2), group, op, async_op=True)
        self._halves = [None, None]

    def _half(self, i):
        if self._halves[i] is None:
            buf, work = (self.first, self.w1) if i == 0 else (self.second, self.w2)
            wait(work, self.op, self.group, buf)
            hk = (self.k_shape[0], self.half) + tuple(self.k_shape[2:])
            hv = (self.v_shape[0], self.half) + tuple(self.v_shape[2:])
            ranks = range(self.cp) if i == 0 else reversed(range(self.cp))
            parts = [kv_views(buf[r], hk, hv) for r in ranks]
            self._halves[i] = (torch.cat([p[0] for p in parts], dim=1),
                               torch.cat([p[1] for p in parts], dim=1))
        return self._halves[i]

    def keys(self, k0: int, k1: int):
        """(K, V) views/copies of global key range [k0, k1)."""
        return key_range(self._half, self.cp * self.half, k0, k1)


def key_range(half, mid: int, k0: int, k1: int):
    """(K, V) of global keys [k0, k1) from the two gathered halves, half(0) holding keys
    [0, mid) and half(1) the rest (each (K, V), asked for only when needed): views of one half,
    or a concatenation of both where the range straddles mid."""
    if k1 <= mid:
        k, v = half(0)
        return k[:, k0:k1], v[:, k0:k1]
    if k0 >= mid:
        k, v = half(1)
        return k[:, k0 - mid:k1 - mid], v[:, k0 - mid:k1 - mid]
    (ka, va), (kb, vb) = half(0), half(1)
    return (torch.cat([ka[:, k0:], kb[:, :k1 - mid]], dim=1),
            torch.cat([va[:, k0:], vb[:, :k1 - mid]], dim=1))


def _chunk_calls(cp: int, rank: int, chunk: int, window):
    """Per local chunk: (local q row offset, plan) with plan = (q0, q1, k0, k1, local window) in
    the chunk's rows and GLOBAL key positions, or None when the chunk sees nothing."""
    total = 2 * cp * chunk
    out = []
    for i, g in enumerate((rank, 2 * cp - 1 - rank)):
        out.append((i * chunk, plan_pair(g * chunk, chunk, 0, total, window)))
    return out


def all_gather_forward(q, k, v, plan):
    """-> (out, lse) of this rank's query shards, in the kernel's dtypes (every row is in one
    kernel call: nothing is merged)."""
    seq, spec = plan.seq, plan.spec
    if seq.documents is not None:
        return _packed_forward(q, k, v, plan)
    kv = _Gathered(k, v, seq.group, seq.size, "all_gather.fwd.kv")

    def parts():
        for row, call in _chunk_calls(seq.size, seq.rank, seq.chunk, seq.window):
            if call is not None:
                q0, q1, k0, k1, w = call
                ks, vs = kv.keys(k0, k1)
                yield (row + q0, row + q1) + tuple(plan.kernel.forward(
                    q[:, row + q0:row + q1], ks, vs, scale=spec.scale, softcap=spec.softcap, window=w))
    # each row is in one call: out and LSE stay in the kernel's dtypes, nothing is merged
    return rows_out(parts(), q, v.shape[-1])


def all_gather_backward(dout, q, k, v, out, lse, plan):
    """-> (dq, dk, dv) of this rank's shards; out/lse: what all_gather_forward returned."""
    seq, spec, kernel = plan.seq, plan.spec, plan.kernel
    if seq.documents is not None:
        return _packed_backward(dout, q, k, v, out, lse, plan)
    kv = _Gathered(k, v, seq.group, seq.size, "all_gather.bwd.kv")
    # once per backward, not per call (e.g. fa4 casts a float32 O and corrects D here)
    dout, out, dlse = kernel.prepare_backward(dout, out, None, q.dtype)
    gdt = plan.grad_dtype
    total = 2 * seq.size * seq.chunk
    dq = GradAccumulator(q.shape, kernel.partial_dtype(q.dtype), q.device)   # rows disjoint
    dk_full = GradAccumulator((k.shape[0], total) + tuple(k.shape[2:]), gdt, q.device)
    dv_full = GradAccumulator((v.shape[0], total) + tuple(v.shape[2:]), gdt, q.device)
    for row, call in _chunk_calls(seq.size, seq.rank, seq.chunk, seq.window):
        if call is None:
            continue
        q0, q1, k0, k1, w = call
        ks, vs = kv.keys(k0, k1)
        rows = slice(row + q0, row + q1)
        gq, gk, gv = kernel.backward(dout[:, rows], q[:, rows], ks, vs, out[:, rows],
                                     lse[:, :, rows], scale=spec.scale, softcap=spec.softcap,
                                     window=w, dlse=None if dlse is None else dlse[:, :, rows])
        dq.add(rows.start, rows.stop, gq)
        dk_full.add(k0, k1, gk)
        dv_full.add(k0, k1, gv)
    # reorder global dK/dV into per-owner zigzag slots and reduce-scatter in float32
    dk_full, dv_full = dk_full.result(), dv_full.result()
    slots = torch.stack([kv_buffer(*_owner_shard(dk_full, dv_full, seq.size, r)) for r in range(seq.size)])
    mine = reduce_scatter(slots, seq.group, "all_gather.bwd.dkv")
    dk, dv = kv_views(mine, k.shape, v.shape)
    return dq.result().to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


AllGatherAttention = shard_function("AllGatherAttention", all_gather_forward, all_gather_backward)


def _owner_shard(dk_full, dv_full, cp, r):
    chunks_k, chunks_v = dk_full.chunk(2 * cp, dim=1), dv_full.chunk(2 * cp, dim=1)
    a, b = r, 2 * cp - 1 - r
    return (torch.cat([chunks_k[a], chunks_k[b]], dim=1), torch.cat([chunks_v[a], chunks_v[b]], dim=1))


def _gather_global(k, v, seq, op):
    """Every rank's whole K/V shard, in global order (packed layout)."""
    buf, _ = all_gather(kv_buffer(k, v), seq.group, op)
    parts = [kv_views(buf[r], k.shape, v.shape) for r in range(seq.size)]
    _, inv = stream_order(seq.documents, k.device)
    return (torch.cat([p[0] for p in parts], dim=1).index_select(1, inv),
            torch.cat([p[1] for p in parts], dim=1).index_select(1, inv))


def _packed_forward(q, k, v, plan):
    seq, spec = plan.seq, plan.spec
    kg, vg = _gather_global(k, v, seq, "all_gather.fwd.kv")
    calls = gathered_calls(seq.documents, seq.rank, seq.window)
    # every row in at most one call: out in the kernel's dtype, nothing to merge
    return disjoint_rows(plan.kernel, q, kg, vg, calls, spec.scale, spec.softcap, v.shape[-1])


def _packed_backward(dout, q, k, v, out, lse, plan):
    seq, spec, kernel = plan.seq, plan.spec, plan.kernel
    kg, vg = _gather_global(k, v, seq, "all_gather.bwd.kv")
    dout, out, dlse = kernel.prepare_backward(dout, out, None, q.dtype)
    gdt = plan.grad_dtype
    dq = GradAccumulator(q.shape, kernel.partial_dtype(q.dtype), q.device)   # rows disjoint
    dk, dv = (GradAccumulator(t.shape, gdt, q.device) for t in (kg, vg))
    calls = gathered_calls(seq.documents, seq.rank, seq.window)
    backward_into(kernel, dout, q, kg, vg, out, lse, dlse, calls, spec.scale, spec.softcap, dq, dk, dv)
    idx, _ = stream_order(seq.documents, q.device)      # global order -> shards back to back
    dk, dv = (g.result().index_select(1, idx) for g in (dk, dv))
    slots = torch.stack([kv_buffer(a, b) for a, b in zip(dk.chunk(seq.size, dim=1), dv.chunk(seq.size, dim=1))])
    dk, dv = kv_views(reduce_scatter(slots, seq.group, "all_gather.bwd.dkv"), k.shape, v.shape)
    return dq.result().to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
