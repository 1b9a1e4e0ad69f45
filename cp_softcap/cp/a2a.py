"""comm="a2a": all-to-all (Ulysses) context parallelism, and the all-to-all re-sharding it
shares with comm="a2a+p2p" (cp/a2a_p2p.py: the same steps with a ring across an outer group in
place of the one whole-sequence kernel call).

Forward: seq_to_heads on q, k, v within the all-to-all group; attention over the group's whole
sequence for this rank's heads (one kernel call with the real causal/window/softcap); then
heads_to_seq back. The head-sharded q/k/v and the output/LSE (the kernel's for one call, float32
merges for the ring of a2a+p2p) are saved, so the backward
re-sends nothing but dout: it runs the kernel backward and returns the gradients through the
adjoint all-to-all, summing replicated KV heads in float32, cast to the input dtype once. Each
head's gradient is ONE kernel call's, so it travels in the kernel's own dtype (bf16 from
flash-attn: the same result as a float32 copy, at half the bytes).

Layout (within a group of I ranks; rank i holds zigzag halves (first_i, second_i), c tokens
each): seq_to_heads gives every rank the group's whole sequence for its own heads, ordered
    first_0, first_1, ..., first_{I-1}, second_{I-1}, ..., second_0
which is natural order when the group is the whole CP group, and the zigzag layout of the outer
ring (super-chunks o and 2*outer-1-o) when it is the inner group of a hybrid a2a+p2p mesh.

Head assignment: rank j receives query heads [j*Hq/I, (j+1)*Hq/I). K/V heads are split the same
way when Hkv % I == 0; otherwise they are replicated so each rank has the KV heads its query
heads use (GQA models with Hkv < cp keep working); gradients of replicas are summed back.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ..calls import backward_into, disjoint_rows, stream_order
from ..doc_geometry import stream_calls
from ..kernels.base import grad_dtype
from ..merge import GradAccumulator
from ..sinks import apply_sinks, sink_grad, sink_rows
from ..transport import all_to_all
from .guard import guarded


def _order(recv: torch.Tensor, zigzag: bool = True) -> torch.Tensor:
    """[I, B, 2c, h, D] per source rank -> [B, 2cI, h, D] in the documented sequence order
    (zigzag=False, packed documents: the shards back to back in rank order)."""
    if not zigzag:
        return torch.cat(recv.unbind(0), dim=1)
    first, second = recv.chunk(2, dim=2)
    return torch.cat([torch.cat(first.unbind(0), dim=1), torch.cat(second.flip(0).unbind(0), dim=1)], dim=1)


def _unorder(x: torch.Tensor, ranks: int, zigzag: bool = True) -> torch.Tensor:
    """Inverse of _order: [B, 2cI, h, D] -> [I, B, 2c, h, D] (each source rank's tokens)."""
    if not zigzag:
        return torch.stack(x.chunk(ranks, dim=1))
    first, second = x.chunk(2, dim=1)
    firsts = first.chunk(ranks, dim=1)
    seconds = second.chunk(ranks, dim=1)[::-1]
    return torch.stack([torch.cat([f, s], dim=1) for f, s in zip(firsts, seconds)])


def seq_to_heads(x: torch.Tensor, group, index: Sequence[Sequence[int]], op: str,
                 zigzag: bool = True) -> torch.Tensor:
    """x [B, 2c, H, D] (this rank's tokens, all heads) -> [B, 2cI, h, D] (group's tokens, heads
    index[rank]; zigzag: _order's sequence order)."""
    ranks = dist.get_world_size(group)
    flat = torch.tensor([i for idx in index for i in idx], device=x.device)
    b, s, _, d = x.shape
    send = x.index_select(2, flat).view(b, s, ranks, len(index[0]), d).permute(2, 0, 1, 3, 4)
    return _order(all_to_all(send, group, op), zigzag)


def heads_to_seq(y: torch.Tensor, group, op: str, zigzag: bool = True) -> torch.Tensor:
    """y [B, 2cI, h, D] (group's tokens, this rank's h query heads) -> [B, 2c, I*h, D]."""
    ranks = dist.get_world_size(group)
    recv = all_to_all(_unorder(y, ranks, zigzag), group, op)          # [I(src), B, 2c, h, D]
    return torch.cat(recv.unbind(0), dim=2)


def heads_to_seq_sum(g: torch.Tensor, group, index: Sequence[Sequence[int]], num_heads: int, op: str,
                     zigzag: bool = True) -> torch.Tensor:
    """Adjoint of seq_to_heads: g [B, 2cI, h, D] -> [B, 2c, H, D], summing replicated heads in
    float32 (float64 for float64); g travels in its own dtype."""
    ranks = dist.get_world_size(group)
    recv = all_to_all(_unorder(g, ranks, zigzag), group, op)          # [I(src), B, 2c, h, D]
    acc = grad_dtype(g.dtype)
    out = torch.zeros(recv.shape[1:3] + (num_heads, recv.shape[-1]), dtype=acc, device=g.device)
    for j in range(ranks):                                    # fixed order: deterministic
        out.index_add_(2, torch.tensor(index[j], device=g.device), recv[j].to(acc))
    return out


def a2a_forward(ctx, q, k, v, plan, attend, sinks=None):
    """Re-shard by heads, attend(qh, kh, vh, plan) -> (out, lse), re-shard back. sinks [Hq]
    (cp/sinks.py): this rank's query heads' sinks join the rows' final (out, lse) here, once."""
    heads = plan.heads
    zigzag = heads.zigzag_order
    qh = seq_to_heads(q, heads.group, heads.q_index, "a2a.fwd.q", zigzag)
    kh = seq_to_heads(k, heads.group, heads.kv_index, "a2a.fwd.k", zigzag)
    vh = seq_to_heads(v, heads.group, heads.kv_index, "a2a.fwd.v", zigzag)
    out, lse = attend(qh, kh, vh, plan)
    if sinks is not None:
        out, lse = apply_sinks(out, lse, _my_sinks(sinks, heads), plan.grad_dtype)
    ctx.save_for_backward(qh, kh, vh, out, lse, *(() if sinks is None else (sinks,)))
    ctx.plan = plan
    return heads_to_seq(out.to(q.dtype), heads.group, "a2a.fwd.out", zigzag)


def _my_sinks(sinks: torch.Tensor, heads) -> torch.Tensor:
    """The sinks of this rank's query heads (heads.q_index of its rank in the a2a group)."""
    mine = heads.q_index[dist.get_rank(heads.group)]
    return sinks.index_select(0, torch.tensor(mine, device=sinks.device))


def a2a_backward(ctx, dout, attend_backward):
    """Adjoint of a2a_forward; attend_backward(douth, qh, kh, vh, out, lse, plan) -> grads.
    With sinks, ctx.dsinks is the sink gradient [Hq] of THIS rank's own rows (sequence shard),
    every head: each row's term travels back to its owner with the adjoint all-to-all."""
    saved = ctx.saved_tensors           # unpacked once (activation checkpointing allows no more)
    qh, kh, vh, out, lse = saved[:5]
    plan = ctx.plan
    heads, spec = plan.heads, plan.spec
    zigzag = heads.zigzag_order
    douth = seq_to_heads(dout, heads.group, heads.q_index, "a2a.bwd.dout", zigzag)
    if len(saved) == 6:                 # sinks: the same message on every rank of the group
        sinks = saved[5]
        rows = sink_rows(douth, out, lse, _my_sinks(sinks, heads))        # [B, h, S_group]
        rows = heads_to_seq_sum(rows.transpose(1, 2).unsqueeze(-1).contiguous(), heads.group,
                                heads.q_index, spec.num_heads, "a2a.bwd.dsinks", zigzag)
        ctx.dsinks = sink_grad(rows.squeeze(-1).transpose(1, 2), sinks)
    dq, dk, dv = attend_backward(douth, qh, kh, vh, out, lse, plan)
    dq = heads_to_seq_sum(dq, heads.group, heads.q_index, spec.num_heads, "a2a.bwd.dq", zigzag)
    dk = heads_to_seq_sum(dk, heads.group, heads.kv_index, spec.num_kv_heads, "a2a.bwd.dk", zigzag)
    dv = heads_to_seq_sum(dv, heads.group, heads.kv_index, spec.num_kv_heads, "a2a.bwd.dv", zigzag)
    return dq.to(spec.dtype), dk.to(spec.dtype), dv.to(spec.dtype), None


def _attend(q, k, v, plan):
    """The whole sequence on this rank, one kernel call: (out, lse) as the kernel returns them
    (nothing is merged, so a widened copy would only cost memory and the backward's D fix-up)."""
    spec = plan.spec
    if plan.layout is not None:
        return _attend_packed(q, k, v, plan)
    return plan.kernel.forward(q, k, v, scale=spec.scale, softcap=spec.softcap, window=spec.window)


def _attend_backward(dout, q, k, v, out, lse, plan):
    spec = plan.spec
    if plan.layout is not None:
        return _attend_packed_backward(dout, q, k, v, out, lse, plan)
    return plan.kernel.backward(dout, q, k, v, out, lse, scale=spec.scale, softcap=spec.softcap,
                                window=spec.window)


# Packed documents: the all-to-all delivers the group's shards back to back; in global order
# (layout.stream_index) the stream's documents are stream_calls, usually ONE varlen call for
# causal attention. Every row lies in at most one call; padding rows in none (out 0, LSE -inf).

def _attend_packed(q, k, v, plan):
    spec, layout = plan.spec, plan.layout
    idx, inv = stream_order(layout, q.device)
    qg, kg, vg = (t.index_select(1, inv) for t in (q, k, v))
    calls = stream_calls(layout.cu_seqlens, layout.seq_len, spec.window)
    out, lse = disjoint_rows(plan.kernel, qg, kg, vg, calls, spec.scale, spec.softcap, v.shape[-1])
    return out.index_select(1, idx), lse.index_select(2, idx)


def _attend_packed_backward(dout, q, k, v, out, lse, plan):
    spec, layout = plan.spec, plan.layout
    idx, inv = stream_order(layout, q.device)
    dog, qg, kg, vg, og = (t.index_select(1, inv) for t in (dout, q, k, v, out))
    lg = lse.index_select(2, inv)
    calls = stream_calls(layout.cu_seqlens, layout.seq_len, spec.window)
    gdt = plan.partial_dtype
    grads = [GradAccumulator(t.shape, gdt, q.device) for t in (q, k, v)]
    backward_into(plan.kernel, dog, qg, kg, vg, og, lg, None, calls, spec.scale, spec.softcap, *grads)
    return tuple(g.result().index_select(1, idx) for g in grads)


def a2a_function(name: str, attend, attend_backward) -> type:
    """The autograd.Function of an all-to-all scheme whose per-rank attention over the group's
    whole sequence is attend / attend_backward (one kernel call here; a ring for a2a+p2p)."""

    def forward(ctx, q, k, v, plan):
        return a2a_forward(ctx, q, k, v, plan, attend)

    def backward(ctx, dout):
        return a2a_backward(ctx, dout, attend_backward)

    return guarded(type(name, (torch.autograd.Function,),
                        {"forward": staticmethod(forward), "backward": staticmethod(backward)}))


A2AAttention = a2a_function("A2AAttention", _attend, _attend_backward)
