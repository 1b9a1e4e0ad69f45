"""Ring (point-to-point) context parallelism on the zigzag layout.

Step s: rank r computes its queries against the K/V of rank (r - s) mod cp, received directly
from that rank, while the K/V for the next step are already in flight (posted before compute).
Only pairs that see something exchange and compute anything (layout.needs): with a sliding
window most steps vanish, and a rank waits only for the peers whose keys its queries can see.
A strictly forwarding ring cannot skip steps under zigzag (rank r needs rank r+1, cp-1 hops
away), which is why each step talks to its source rank directly.

Forward merges every partial into ONE float32 accumulator (LSE merge). Backward re-fetches the
K/V, calls each pair's kernel backward with the final merged out/LSE (exact, kernels.md), keeps
dQ locally in float32 and returns each float32 dK/dV partial to the rank that owns the keys,
which sums them in step order (deterministic). Gradients are cast to the input dtype once.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import Exchange
from ..layout import needs, plan_step
from ..merge import merge_into, new_accumulator
from .packing import pack, unpack
from ..kernels.base import grad_dtype


def _step_peers(need, cp: int, rank: int, s: int):
    """(src, dst, recv, send) for step s: recv K/V from src if our queries see its keys, send
    ours to dst if its queries see our keys."""
    src, dst = (rank - s) % cp, (rank + s) % cp
    return src, dst, need[rank][src], s > 0 and need[dst][rank]


# Every rank posts its messages in one global order (kv(1), then per step s: kv(s+1), dkv(s)),
# so for any pair of ranks the sends of one match the receives of the other in the same order,
# as NCCL and gloo require, even though pairs with nothing to exchange post nothing.


def ring_forward(q, k, v, group, kernel, scale, softcap, window):
    """-> (out float32 [B, S, Hq, Dv], lse float32 [B, Hq, S]) for this rank's zigzag queries."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    chunk = q.shape[1] // 2
    need = needs(cp, chunk, window)
    own = pack(k, v)
    acc_out, acc_lse = new_accumulator(q.shape, v.shape[-1], q.dtype, q.device)

    def post(s):
        src, dst, recv, send = _step_peers(need, cp, rank, s)
        return Exchange(group, "ring.fwd.kv").start(own if send else None, dst,
                                                    own if recv else None, src)

    pending = post(1) if cp > 1 else None
    for s in range(cp):
        src, _, recv, _ = _step_peers(need, cp, rank, s)
        kv = own if s == 0 else pending.wait()
        if 0 < s < cp - 1:
            pending = post(s + 1)
        if not recv:
            continue
        ks, vs = unpack(kv, k.shape, v.shape)
        for c in plan_step(cp, rank, src, chunk, window):
            out, lse = kernel.forward(q[:, c.q0:c.q1], ks[:, c.k0:c.k1], vs[:, c.k0:c.k1],
                                      scale=scale, softcap=softcap, window=c.window)
            merge_into(acc_out[:, c.q0:c.q1], acc_lse[:, :, c.q0:c.q1], out, lse)
    return acc_out, acc_lse


def ring_backward(dout, q, k, v, out, lse, group, kernel, scale, softcap, window):
    """-> float32 (dq, dk, dv) of this rank's shards. out/lse: the final merged values."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    chunk = q.shape[1] // 2
    need = needs(cp, chunk, window)
    own = pack(k, v)
    gdt = grad_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=gdt, device=q.device)
    d_own = torch.zeros(own.shape, dtype=gdt, device=q.device)

    def post_kv(s):
        src, dst, recv, send = _step_peers(need, cp, rank, s)
        return Exchange(group, "ring.bwd.kv").start(own if send else None, dst,
                                                    own if recv else None, src)

    def pair_grads(kv, src):
        ks, vs = unpack(kv, k.shape, v.shape)
        d_kv = torch.zeros(own.shape, dtype=gdt, device=q.device)
        dk, dv = unpack(d_kv, k.shape, v.shape)
        for c in plan_step(cp, rank, src, chunk, window):
            gq, gk, gv = kernel.backward(
                dout[:, c.q0:c.q1], q[:, c.q0:c.q1], ks[:, c.k0:c.k1], vs[:, c.k0:c.k1],
                out[:, c.q0:c.q1], lse[:, :, c.q0:c.q1], scale=scale, softcap=softcap,
                window=c.window)
            dq[:, c.q0:c.q1] += gq
            dk[:, c.k0:c.k1] += gk
            dv[:, c.k0:c.k1] += gv
        return d_kv

    pending_kv = post_kv(1) if cp > 1 else None
    pending_grad = None
    for s in range(cp):
        src, dst, recv, send = _step_peers(need, cp, rank, s)
        kv = own if s == 0 else pending_kv.wait()
        if 0 < s < cp - 1:
            pending_kv = post_kv(s + 1)
        d_src = pair_grads(kv, src) if recv else None
        if s == 0:
            d_own += d_src
            continue
        posted = Exchange(group, "ring.bwd.dkv").start(d_src, src, d_own if send else None, dst)
        if pending_grad is not None:
            received = pending_grad.wait()
            if received is not None:
                d_own += received
        pending_grad = posted
    if pending_grad is not None:
        received = pending_grad.wait()
        if received is not None:
            d_own += received
    dk, dv = unpack(d_own, k.shape, v.shape)
    return dq, dk, dv


class RingAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, group, kernel, scale, softcap, window):
        out, lse = ring_forward(q, k, v, group, kernel, scale, softcap, window)
        # The backward gets the float32 merged output: D = rowsum(dO * O) computed from a
        # 16-bit O loses the gradient of near one-hot (saturated) rows.
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, kernel, scale, softcap, window)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, *ctx.args)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None
