"""Packed documents on one device: the engine of `cps.attention(q, k, v, cu_seqlens=cu)`.

q/k/v are streams [B, T, H, D] (usually B = 1) that all hold documents [cu[d], cu[d+1]); tokens
past cu[-1] are padding. doc_geometry.stream_calls turns the boundaries into kernel calls (a run of short
documents becomes ONE call with segments=, a document longer than the rest its own call); the
calls' rows are disjoint, so each call writes its rows of (out, lse) and nothing is merged.
Padding rows are in no call: out 0, LSE -inf, zero gradients. Backward runs the same calls with
each row's final (out, lse) and adds each call's dK/dV into its keys.
"""
from __future__ import annotations

from typing import Tuple

import torch

from .calls import backward_into, disjoint_rows
from .merge import GradAccumulator
from .cp.guard import autocast_off, refuse_second_order
from .doc_geometry import stream_calls
from .kernels.torch_kernel import TorchKernel


def second_order_safe(kernel, grads: tuple, inputs: tuple) -> tuple:
    """A one-device backward's gradients. Under create_graph=True only the torch kernel's
    backward is made of differentiable ops (exact double backward); any other kernel's
    gradients raise when a loss differentiates them."""
    if not torch.is_grad_enabled() or isinstance(kernel, TorchKernel):
        return grads
    return refuse_second_order(grads, inputs, (
        f"cp_softcap: double backward through attention with the {kernel.name!r} kernel is not "
        "supported (its backward is not differentiable); pass backend='torch' for a loss that "
        "differentiates these gradients"))


def save_for_local_backward(ctx, plan, q, k, v, out, lse):
    """The end of a one-device forward that returns (out, lse): keeps what its backward needs
    and returns (out in q's dtype, lse). An unused output's gradient then arrives as None (not
    zeros): an unused LSE costs nothing and needs no host sync to detect."""
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.plan = plan
    ctx.set_materialize_grads(False)
    return out.to(q.dtype), lse


def saved_for_local_backward(ctx, dout):
    """(q, k, v, out, lse, dout) of save_for_local_backward, dout contiguous (zeros when the
    output was unused)."""
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros(out.shape, dtype=q.dtype, device=q.device)
    return q, k, v, out, lse, dout.contiguous()


def packed_attention(q, k, v, plan, cu: Tuple[int, ...]):
    """(out in q's dtype, lse) of a packed stream under `plan` (its spec has documents=True)."""
    return PackedAttention.apply(q, k, v, plan, stream_calls(cu, q.shape[1], plan.spec.window))


class PackedAttention(torch.autograd.Function):
    """One device, packed documents: (q, k, v, plan, calls) -> (out in q's dtype, lse).

    Each document lies whole in one call, its rows and its keys alike, so out, dQ and dK/dV take
    each position from exactly one call and stay in the kernel's own dtype (no float32 copy of
    a 16-bit kernel's output, nothing to sum)."""

    @staticmethod
    @autocast_off
    def forward(ctx, q, k, v, plan, calls):
        spec = plan.spec
        out, lse = disjoint_rows(plan.kernel, q, k, v, calls, spec.scale, spec.softcap, v.shape[-1])
        ctx.calls = calls
        return save_for_local_backward(ctx, plan, q, k, v, out, lse)

    @staticmethod
    @autocast_off
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, dout = saved_for_local_backward(ctx, dout)
        spec, kernel, calls = ctx.plan.spec, ctx.plan.kernel, ctx.calls
        own = kernel.partial_dtype(q.dtype)
        dq, dk, dv = (GradAccumulator(x.shape, own, x.device) for x in (q, k, v))
        backward_into(kernel, dout, q, k, v, out, lse, dlse, calls, spec.scale, spec.softcap,
                      dq, dk, dv)
        grads = dq.result().to(q.dtype), dk.result().to(k.dtype), dv.result().to(v.dtype)
        return second_order_safe(kernel, grads, (q, k, v)) + (None, None)
