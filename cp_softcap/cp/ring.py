"""Ring (point-to-point) context parallelism on the zigzag layout.

Step s: rank r computes its queries against the K/V of rank (r - s) mod cp, received directly
from that rank. Only pairs that see something exchange and compute anything (layout.needs), and
only the keys the receiver sees travel (layout.key_range: under causal attention an earlier
rank sends just its first chunk). With a sliding window most steps vanish and a rank waits only
for the peers whose keys its queries can see. A strictly forwarding ring cannot skip steps under
zigzag (rank r needs rank r+1, cp-1 hops away), which is why each step talks to its source rank
directly.

Steps are grouped into blocks (plan.seq.blocks from layout.ring_blocks, about
CP_SOFTCAP_RING_BLOCK_KEYS keys each, the same blocks on every rank). A block's K/V land in one
buffer and calls over the same rows whose keys lie back to back there run as one long kernel
call (layout.block_plan: fully visible pairs, and windowed ones with globally contiguous keys);
the next block is in flight while one computes.

Forward merges every partial into ONE float32 accumulator (LSE merge). Backward re-fetches the
K/V, calls each pair's kernel backward with the final merged out/LSE (exact: docs/kernels.md),
keeps dQ locally in float32 (GradAccumulator: 16-bit kernel partials widen as they are added) and
returns each block's dK/dV partial to the rank that owns the keys, which sums them in float32 in
step order (deterministic). A block whose keys are each read by one kernel call
(layout.block_exclusive: every causal block) returns the kernel's partial in its own dtype (bf16
from flash-attn): widening at the owner gives the same sum as sending a float32 copy, at half
the bytes. Other blocks return float32 sums. Gradients are cast to the input dtype once.

Packed documents (plan.seq.documents, docs/packing.md): the same steps and blocks on the
packed layout, with the geometry of doc_geometry (through calls.py): a member sends only the
key ranges the receiver's queries see in the same document (several ranges travel back to back
in one message), peers with no visible same-document key exchange nothing, calls may hold
several documents (segments), and dK/dV go back over the same ranges, in the kernel's dtype
where doc_geometry.block_exclusive. Padding rows are in no call: out 0, LSE -inf, zero grads.

Message order: every rank posts kv(block 0), then per block i: kv(i+1), dkv(i). Blocks are the
same everywhere, so for any pair of ranks the sends of one match the receives of the other in
the same order, as NCCL and gloo require, even though pairs with nothing to exchange post nothing.
"""
from __future__ import annotations

import torch

from ..merge import GradAccumulator, merge_into, new_accumulator
from ..transport import Exchange
from .. import calls as geo
from .guard import shard_function


class _Block:
    """One block's K/V in flight: its buffers, slots and kernel calls."""

    def __init__(self, seq, op, k, v, steps):
        self.slots, self.calls = geo.block(seq, steps)
        n = sum(s.size for s in self.slots)
        b = k.shape[0]
        self.k = k.new_empty((b, n) + tuple(k.shape[2:]))
        self.v = v.new_empty((b, n) + tuple(v.shape[2:]))
        self.exchange = Exchange(seq.group, op)
        for s in steps:
            dst = (seq.rank + s) % seq.size
            ranges = geo.send_ranges(seq, dst)
            if ranges:
                self.exchange.send(geo.take(k, ranges), dst).send(geo.take(v, ranges), dst)
        for slot in self.slots:
            end = slot.off + slot.size
            self.exchange.recv(self.k[:, slot.off:end], slot.src)
            self.exchange.recv(self.v[:, slot.off:end], slot.src)
        self.exchange.start()

    def wait(self) -> "_Block":
        self.exchange.wait()
        return self


def forward_calls(q, ks, vs, calls, kernel, scale, softcap, acc_out, acc_lse) -> None:
    """Run `calls` (rows of q x keys of ks/vs) and merge each partial into the accumulator."""
    for c in calls:
        out, lse = geo.call_forward(kernel, q, ks, vs, c, scale, softcap)
        merge_into(acc_out[:, c.q0:c.q1], acc_lse[:, :, c.q0:c.q1], out, lse)


def backward_calls(dout, q, ks, vs, out, lse, dlse, calls, kernel, scale, softcap, dq, dk, dv):
    """Backward of `calls` given the final (out, lse); adds into the GradAccumulators dq (rows)
    and dk/dv (keys)."""
    geo.backward_into(kernel, dout, q, ks, vs, out, lse, dlse, calls, scale, softcap, dq, dk, dv)


def return_dtype(partial: torch.dtype, acc: torch.dtype, exclusive: bool) -> torch.dtype:
    """dtype of the dK/dV partials of a block: the kernel's own (plan.partial_dtype) when the
    block is exclusive (each of its keys is read by one kernel call: calls.exclusive; both ends
    compute it), else the accumulation dtype (plan.grad_dtype)."""
    return partial if exclusive else acc


def ring_forward(q, k, v, plan):
    """-> (out float32 [B, S, Hq, Dv], lse float32 [B, Hq, S]) for this rank's queries."""
    seq, args = plan.seq, (plan.kernel, plan.spec.scale, plan.spec.softcap)
    acc_out, acc_lse = new_accumulator(q.shape, v.shape[-1], plan.grad_dtype, q.device)
    post = lambda i: _Block(seq, "ring.fwd.kv", k, v, seq.blocks[i])  # noqa: E731
    pending = post(0) if seq.blocks else None
    forward_calls(q, k, v, geo.self_calls(seq), *args, acc_out, acc_lse)
    for i in range(len(seq.blocks)):
        blk = pending.wait()
        pending = post(i + 1) if i + 1 < len(seq.blocks) else None
        forward_calls(q, blk.k, blk.v, blk.calls, *args, acc_out, acc_lse)
    return acc_out, acc_lse


def ring_backward(dout, q, k, v, out, lse, plan):
    """-> float32 (dq, dk, dv) of this rank's shards. out/lse: the final merged values."""
    seq, kernel = plan.seq, plan.kernel
    args = (kernel, plan.spec.scale, plan.spec.softcap)
    gdt, partial = plan.grad_dtype, plan.partial_dtype
    # Once per backward, not per chunk pair: e.g. fa4 casts the float32 O and corrects D here.
    dout, out, dlse = kernel.prepare_backward(dout, out, None, q.dtype)
    dq, dk, dv = (GradAccumulator(t.shape, gdt, q.device) for t in (q, k, v))
    post = lambda i: _Block(seq, "ring.bwd.kv", k, v, seq.blocks[i])  # noqa: E731
    pending = post(0) if seq.blocks else None
    backward_calls(dout, q, k, v, out, lse, dlse, geo.self_calls(seq), *args, dq, dk, dv)
    returning = None
    for i, steps in enumerate(seq.blocks):
        blk = pending.wait()
        pending = post(i + 1) if i + 1 < len(seq.blocks) else None
        rdt = lambda r, steps=steps: return_dtype(partial, gdt, geo.exclusive(seq, r, steps))  # noqa: E731
        gk, gv = (GradAccumulator(t.shape, rdt(seq.rank), q.device) for t in (blk.k, blk.v))
        backward_calls(dout, q, blk.k, blk.v, out, lse, dlse, blk.calls, *args, dq, gk, gv)
        posted = _GradReturn(seq, gk.result(), gv.result(), blk.slots, k, v, steps, rdt)
        if returning is not None:
            returning.add_into(dk, dv)
        returning = posted
    if returning is not None:
        returning.add_into(dk, dv)
    return dq.result(), dk.result(), dv.result()


class _GradReturn:
    """One block's dK/dV partials going back to the key owners, and ours coming back (in the
    dtype rdt(sender) of each sender's block)."""

    def __init__(self, seq, gk, gv, slots, k, v, steps, rdt):
        self.exchange = Exchange(seq.group, "ring.bwd.dkv")
        for slot in slots:
            end = slot.off + slot.size
            self.exchange.send(gk[:, slot.off:end], slot.src).send(gv[:, slot.off:end], slot.src)
        self.received = []
        b = k.shape[0]
        for s in steps:
            dst = (seq.rank + s) % seq.size
            ranges = geo.send_ranges(seq, dst)
            if ranges:
                n = sum(b1 - b0 for b0, b1 in ranges)
                rk = gk.new_empty((b, n) + tuple(k.shape[2:]), dtype=rdt(dst))
                rv = gv.new_empty((b, n) + tuple(v.shape[2:]), dtype=rdt(dst))
                self.exchange.recv(rk, dst).recv(rv, dst)
                self.received.append((ranges, rk, rv))
        self.exchange.start()

    def add_into(self, dk, dv) -> None:
        self.exchange.wait()
        for ranges, rk, rv in self.received:        # step order: deterministic sums
            for (k0, k1, pk), (_, _, pv) in zip(geo.split(rk, ranges), geo.split(rv, ranges)):
                dk.add(k0, k1, pk)
                dv.add(k0, k1, pv)


RingAttention = shard_function("RingAttention", ring_forward, ring_backward)
