"""Ring (point-to-point) context parallelism on the zigzag layout.

Step s: rank r computes its queries against the K/V of rank (r - s) mod cp, received directly
from that rank. Only pairs that see something exchange and compute anything (layout.needs), and
only the keys the receiver sees travel (layout.key_range: under causal attention an earlier
rank sends just its first chunk). With a sliding window most steps vanish and a rank waits only
for the peers whose keys its queries can see. A strictly forwarding ring cannot skip steps under
zigzag (rank r needs rank r+1, cp-1 hops away), which is why each step talks to its source rank
directly.

Steps are grouped into blocks (plan.zigzag.blocks from layout.ring_blocks, about
CP_SOFTCAP_RING_BLOCK_KEYS keys each, the same blocks on every rank). A block's K/V land in one
buffer and its fully visible pairs run as one long kernel call (layout.block_plan); the next
block is in flight while one computes.

Forward merges every partial into ONE float32 accumulator (LSE merge). Backward re-fetches the
K/V, calls each pair's kernel backward with the final merged out/LSE (exact: docs/kernels.md),
keeps dQ locally in float32 (GradAccumulator: 16-bit kernel partials widen as they are added) and
returns each block's dK/dV partial to the rank that owns the keys, which sums them in float32 in
step order (deterministic). A block whose keys are each read by one kernel call
(layout.block_exclusive: every causal block) returns the kernel's partial in its own dtype (bf16
from flash-attn): widening at the owner gives the same sum as sending a float32 copy, at half
the bytes. Other blocks return float32 sums. Gradients are cast to the input dtype once.

Message order: every rank posts kv(block 0), then per block i: kv(i+1), dkv(i). Blocks are the
same everywhere, so for any pair of ranks the sends of one match the receives of the other in
the same order, as NCCL and gloo require, even though pairs with nothing to exchange post nothing.
"""
from __future__ import annotations

import torch

from ..layout import block_exclusive, block_plan, key_range, plan_step
from ..merge import merge_into, new_accumulator
from ..spec import grad_dtype
from ..transport import Exchange
from .grad_accum import GradAccumulator
from .guard import guarded


class _Block:
    """One block's K/V in flight: its buffers, slots and kernel calls."""

    def __init__(self, zz, op, k, v, steps):
        self.slots, self.calls = block_plan(zz.size, zz.rank, zz.chunk, zz.window, steps)
        n = sum(s.k1 - s.k0 for s in self.slots)
        b = k.shape[0]
        self.k = k.new_empty((b, n) + tuple(k.shape[2:]))
        self.v = v.new_empty((b, n) + tuple(v.shape[2:]))
        self.exchange = Exchange(zz.group, op)
        for s in steps:
            dst = (zz.rank + s) % zz.size
            kr = key_range(zz.size, dst, zz.rank, zz.chunk, zz.window)
            if kr is not None:
                self.exchange.send(k[:, kr[0]:kr[1]], dst).send(v[:, kr[0]:kr[1]], dst)
        for slot in self.slots:
            end = slot.off + slot.k1 - slot.k0
            self.exchange.recv(self.k[:, slot.off:end], slot.src)
            self.exchange.recv(self.v[:, slot.off:end], slot.src)
        self.exchange.start()

    def wait(self) -> "_Block":
        self.exchange.wait()
        return self


def forward_calls(q, ks, vs, calls, kernel, scale, softcap, acc_out, acc_lse) -> None:
    """Run `calls` (rows of q x keys of ks/vs) and merge each partial into the accumulator."""
    for c in calls:
        out, lse = kernel.forward(q[:, c.q0:c.q1], ks[:, c.k0:c.k1], vs[:, c.k0:c.k1],
                                  scale=scale, softcap=softcap, window=c.window)
        merge_into(acc_out[:, c.q0:c.q1], acc_lse[:, :, c.q0:c.q1], out, lse)


def backward_calls(dout, q, ks, vs, out, lse, dlse, calls, kernel, scale, softcap, dq, dk, dv):
    """Backward of `calls` given the final (out, lse); adds into the GradAccumulators dq (rows)
    and dk/dv (keys)."""
    for c in calls:
        rows = slice(c.q0, c.q1)
        gq, gk, gv = kernel.backward(
            dout[:, rows], q[:, rows], ks[:, c.k0:c.k1], vs[:, c.k0:c.k1], out[:, rows],
            lse[:, :, rows], scale=scale, softcap=softcap, window=c.window,
            dlse=None if dlse is None else dlse[:, :, rows])
        dq.add(c.q0, c.q1, gq)
        dk.add(c.k0, c.k1, gk)
        dv.add(c.k0, c.k1, gv)


def return_dtype(kernel, dtype, cp, rank, chunk, window, steps) -> torch.dtype:
    """dtype of the dK/dV partials `rank` returns for its block `steps` (both ends compute it)."""
    if block_exclusive(cp, rank, chunk, window, steps):
        return kernel.partial_dtype(dtype)
    return grad_dtype(dtype)


def ring_forward(q, k, v, plan):
    """-> (out float32 [B, S, Hq, Dv], lse float32 [B, Hq, S]) for this rank's zigzag queries."""
    zz, args = plan.zigzag, (plan.kernel, plan.spec.scale, plan.spec.softcap)
    acc_out, acc_lse = new_accumulator(q.shape, v.shape[-1], q.dtype, q.device)
    post = lambda i: _Block(zz, "ring.fwd.kv", k, v, zz.blocks[i])  # noqa: E731
    pending = post(0) if zz.blocks else None
    forward_calls(q, k, v, plan_step(zz.size, zz.rank, zz.rank, zz.chunk, zz.window), *args,
                  acc_out, acc_lse)
    for i in range(len(zz.blocks)):
        blk = pending.wait()
        pending = post(i + 1) if i + 1 < len(zz.blocks) else None
        forward_calls(q, blk.k, blk.v, blk.calls, *args, acc_out, acc_lse)
    return acc_out, acc_lse


def ring_backward(dout, q, k, v, out, lse, plan):
    """-> float32 (dq, dk, dv) of this rank's shards. out/lse: the final merged values."""
    zz, kernel = plan.zigzag, plan.kernel
    args = (kernel, plan.spec.scale, plan.spec.softcap)
    gdt = grad_dtype(q.dtype)
    # Once per backward, not per chunk pair: e.g. fa4 casts the float32 O and corrects D here.
    dout, out, dlse = kernel.prepare_backward(dout, out, None, q.dtype)
    dq, dk, dv = (GradAccumulator(t.shape, gdt, q.device) for t in (q, k, v))
    post = lambda i: _Block(zz, "ring.bwd.kv", k, v, zz.blocks[i])  # noqa: E731
    pending = post(0) if zz.blocks else None
    backward_calls(dout, q, k, v, out, lse, dlse,
                   plan_step(zz.size, zz.rank, zz.rank, zz.chunk, zz.window), *args, dq, dk, dv)
    returning = None
    for i, steps in enumerate(zz.blocks):
        blk = pending.wait()
        pending = post(i + 1) if i + 1 < len(zz.blocks) else None
        rdt = lambda r, steps=steps: return_dtype(kernel, q.dtype, zz.size, r, zz.chunk, zz.window, steps)  # noqa: E731
        gk, gv = (GradAccumulator(t.shape, rdt(zz.rank), q.device) for t in (blk.k, blk.v))
        backward_calls(dout, q, blk.k, blk.v, out, lse, dlse, blk.calls, *args, dq, gk, gv)
        posted = _GradReturn(zz, gk.result(), gv.result(), blk.slots, k, v, steps, rdt)
        if returning is not None:
            returning.add_into(dk, dv)
        returning = posted
    if returning is not None:
        returning.add_into(dk, dv)
    return dq.result(), dk.result(), dv.result()


class _GradReturn:
    """One block's dK/dV partials going back to the key owners, and ours coming back (in the
    dtype rdt(sender) of each sender's block)."""

    def __init__(self, zz, gk, gv, slots, k, v, steps, rdt):
        self.exchange = Exchange(zz.group, "ring.bwd.dkv")
        for slot in slots:
            end = slot.off + slot.k1 - slot.k0
            self.exchange.send(gk[:, slot.off:end], slot.src).send(gv[:, slot.off:end], slot.src)
        self.received = []
        b = k.shape[0]
        for s in steps:
            dst = (zz.rank + s) % zz.size
            kr = key_range(zz.size, dst, zz.rank, zz.chunk, zz.window)
            if kr is not None:
                n = kr[1] - kr[0]
                rk = gk.new_empty((b, n) + tuple(k.shape[2:]), dtype=rdt(dst))
                rv = gv.new_empty((b, n) + tuple(v.shape[2:]), dtype=rdt(dst))
                self.exchange.recv(rk, dst).recv(rv, dst)
                self.received.append((kr, rk, rv))
        self.exchange.start()

    def add_into(self, dk, dv) -> None:
        self.exchange.wait()
        for (k0, k1), rk, rv in self.received:      # step order: deterministic sums
            dk.add(k0, k1, rk)
            dv.add(k0, k1, rv)


@guarded
class RingAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, plan):
        out, lse = ring_forward(q, k, v, plan)
        # The backward gets the float32 merged output: D = rowsum(dO * O) computed from a
        # 16-bit O loses the gradient of near one-hot (saturated) rows.
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, ctx.plan)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None
