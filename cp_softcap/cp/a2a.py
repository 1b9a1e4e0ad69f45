"""All-to-all (Ulysses) context parallelism, and the hybrid a2a+p2p (Ulysses inside an inner
group, ring across the outer group). comm="a2a" is the hybrid with an outer group of one.

Forward: seq_to_heads on q, k, v within the inner group; the outer ring (or, with no outer
group, one full-sequence kernel call with the real causal/window/softcap); heads_to_seq back.
The head-sharded q/k/v and the float32 output/LSE are saved, so the backward re-sends nothing
but dout: it runs the kernel (or ring) backward and returns the gradients through the adjoint
all-to-all, summing replicated KV heads in float32, cast to the input dtype once. Without an
outer ring each head's gradient is ONE kernel call's, so it travels in the kernel's own dtype
(bf16 from flash-attn: the same result as a float32 copy, at half the bytes); the outer ring's
gradients are float32 sums and travel as such.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .ring import ring_backward, ring_forward
from .ulysses import heads_to_seq, heads_to_seq_sum, kv_head_index, query_head_index, seq_to_heads
from ..kernels.base import grad_dtype


def check_heads(hq: int, hkv: int, inner: int, rank: int) -> None:
    if hq % inner != 0:
        raise ValueError(f"comm='a2a' needs the query head count divisible by the all-to-all group "
                         f"size: {hq} heads, group of {inner} (rank {rank}); use comm='ring' or "
                         "comm='all_gather', or comm='a2a+p2p' with a smaller inner group")


def _local_attention(q, k, v, kernel, scale, softcap, window):
    """Whole-sequence attention on one rank (no outer ring); float32 out for the backward."""
    out, lse = kernel.forward(q, k, v, scale=scale, softcap=softcap, window=window)
    return out.to(grad_dtype(q.dtype)), lse


class UlyssesAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, inner, outer, kernel, scale, softcap, window):
        ranks = dist.get_world_size(inner)
        q_idx = query_head_index(q.shape[2], ranks)
        kv_idx = kv_head_index(q.shape[2], k.shape[2], ranks)
        qh = seq_to_heads(q, inner, q_idx, "a2a.fwd.q")
        kh = seq_to_heads(k, inner, kv_idx, "a2a.fwd.k")
        vh = seq_to_heads(v, inner, kv_idx, "a2a.fwd.v")
        if outer is None:
            out, lse = _local_attention(qh, kh, vh, kernel, scale, softcap, window)
        else:
            out, lse = ring_forward(qh, kh, vh, outer, kernel, scale, softcap, window)
        ctx.save_for_backward(qh, kh, vh, out, lse)
        ctx.args = (inner, outer, kernel, scale, softcap, window, q_idx, kv_idx,
                    q.shape[2], k.shape[2], q.dtype, k.dtype, v.dtype)
        return heads_to_seq(out.to(q.dtype), inner, "a2a.fwd.out")

    @staticmethod
    def backward(ctx, dout):
        qh, kh, vh, out, lse = ctx.saved_tensors
        inner, outer, kernel, scale, softcap, window, q_idx, kv_idx, hq, hkv, qdt, kdt, vdt = ctx.args
        douth = seq_to_heads(dout, inner, q_idx, "a2a.bwd.dout")
        if outer is None:
            dq, dk, dv = kernel.backward(douth, qh, kh, vh, out, lse, scale=scale,
                                                   softcap=softcap, window=window)
        else:
            dq, dk, dv = ring_backward(douth, qh, kh, vh, out, lse, outer, kernel, scale,
                                       softcap, window)
        dq = heads_to_seq_sum(dq, inner, q_idx, hq, "a2a.bwd.dq")
        dk = heads_to_seq_sum(dk, inner, kv_idx, hkv, "a2a.bwd.dk")
        dv = heads_to_seq_sum(dv, inner, kv_idx, hkv, "a2a.bwd.dv")
        return dq.to(qdt), dk.to(kdt), dv.to(vdt), None, None, None, None, None, None
