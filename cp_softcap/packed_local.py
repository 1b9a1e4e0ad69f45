"""Packed documents on one device: the engine of `cps.attention(q, k, v, cu_seqlens=cu)`.

q/k/v are streams [B, T, H, D] (usually B = 1) that all hold documents [cu[d], cu[d+1]); tokens
past cu[-1] are padding. doc_geometry.stream_calls turns the boundaries into kernel calls (a run of short
documents becomes ONE call with segments=, a document longer than the rest its own call); the
calls' rows are disjoint, so each call writes its rows of (out, lse) and nothing is merged.
Padding rows are in no call: out 0, LSE -inf, zero gradients. Backward runs the same calls with
each row's final (out, lse) and adds each call's dK/dV into its keys.

Attention sinks on one device (cps.attention(..., sinks=), sinks.py) run here too, packed or
not (an unpacked call is one call over every row): the sink joins each row's final (out, lse)
once, and the backward hands the kernels those final values (exact, see sinks.py).
"""
from __future__ import annotations

from typing import NamedTuple, Tuple

import torch

from .calls import backward_into, disjoint_rows
from .merge import GradAccumulator
from .cp.guard import autocast_off, refuse_second_order
from .doc_geometry import stream_calls
from .export import export_attention
from .kernels.torch_kernel import TorchKernel
from .sinks import apply_sinks, sink_grad, sink_rows


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


SINKS_SECOND_ORDER = ("cp_softcap: double backward through attention with sinks is not supported "
                      "(its backward treats the final out/LSE as constants); take first-order "
                      "gradients without create_graph=True")


def save_for_local_backward(ctx, plan, q, k, v, out, lse):
    """The end of a one-device forward that returns (out, lse): keeps what its backward needs
    and returns (out in q's dtype, lse). An unused output's gradient then arrives as None (not
    zeros): an unused LSE costs nothing and needs no host sync to detect."""
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.plan = plan
    ctx.set_materialize_grads(False)
    return out.to(q.dtype), lse


def saved_for_local_backward(ctx, dout, saved=None):
    """(q, k, v, out, lse, dout) of save_for_local_backward, dout contiguous (zeros when the
    output was unused). saved: ctx.saved_tensors when the caller already unpacked them (they
    may be unpacked once only, e.g. under activation checkpointing)."""
    q, k, v, out, lse = ctx.saved_tensors if saved is None else saved
    if dout is None:
        dout = torch.zeros(out.shape, dtype=q.dtype, device=q.device)
    return q, k, v, out, lse, dout.contiguous()


def packed_attention(q, k, v, plan, cu: Tuple[int, ...]):
    """(out in q's dtype, lse) of a packed stream under `plan` (its spec has documents=True)."""
    return PackedAttention.apply(q, k, v, plan, stream_calls(cu, q.shape[1], plan.spec.window))


class PackedAttention(torch.autograd.Function):
    """One device, packed documents: (q, k, v, plan, calls[, sinks]) -> (out in q's dtype, lse).

    Each document lies whole in one call, its rows and its keys alike, so out, dQ and dK/dV take
    each position from exactly one call and stay in the kernel's own dtype (no float32 copy of
    a 16-bit kernel's output, nothing to sum). With sinks [Hq] (sinks.py) out and LSE are the
    sink-adjusted ones, kept in the accumulation dtype for the backward; the sink gets a
    gradient when it requires one."""

    @staticmethod
    @autocast_off
    def forward(ctx, q, k, v, plan, calls, sinks=None):
        spec = plan.spec
        out, lse = disjoint_rows(plan.kernel, q, k, v, calls, spec.scale, spec.softcap, v.shape[-1])
        ctx.calls = calls
        if sinks is None:
            return save_for_local_backward(ctx, plan, q, k, v, out, lse)
        out, lse = apply_sinks(out, lse, sinks, plan.grad_dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        return out.to(q.dtype), lse

    @staticmethod
    @autocast_off
    def backward(ctx, dout, dlse):
        dsinks, saved = None, ctx.saved_tensors        # unpacked once (checkpointing)
        with_sinks = len(saved) == 6
        if with_sinks:
            q, k, v, out, lse, sinks = saved
            if dout is None:
                dout = torch.zeros(out.shape, dtype=q.dtype, device=q.device)
            dout = dout.contiguous()
            if ctx.needs_input_grad[5]:
                dsinks = sink_grad(sink_rows(dout, out, lse, sinks, dlse), sinks)
            dout, out, dlse = ctx.plan.kernel.prepare_backward(dout, out, dlse, q.dtype)
        else:
            q, k, v, out, lse, dout = saved_for_local_backward(ctx, dout, saved)
        spec, kernel, calls = ctx.plan.spec, ctx.plan.kernel, ctx.calls
        own = kernel.partial_dtype(q.dtype)
        dq, dk, dv = (GradAccumulator(x.shape, own, x.device) for x in (q, k, v))
        backward_into(kernel, dout, q, k, v, out, lse, dlse, calls, spec.scale, spec.softcap,
                      dq, dk, dv)
        grads = dq.result().to(q.dtype), dk.result().to(k.dtype), dv.result().to(v.dtype)
        if with_sinks:
            if torch.is_grad_enabled():     # create_graph=True: the final (O', L') are constants here
                grads = refuse_second_order(grads + (dsinks,), (q, k, v, sinks), SINKS_SECOND_ORDER)
                return grads[:3] + (None, None, grads[3])
            return grads + (None, None, dsinks)
        return second_order_safe(kernel, grads, (q, k, v)) + (None, None, None)


class _Whole(NamedTuple):
    """One kernel call over every row and key (calls.call_forward's form of an unpacked call)."""
    q0: int
    q1: int
    k0: int
    k1: int
    window: tuple


def one_device_with_sinks(q, k, v, plan, sinks: torch.Tensor):
    """(out in q's dtype, lse) of a one-device plan (path 'kernel', 'packed' or 'export') with
    attention sinks [Hq] (sinks.py); differentiable in q, k, v and sinks."""
    spec = plan.spec
    if plan.path == "export":       # plain ops: autograd differentiates the sink too
        out, lse = export_attention(q, k, v, scale=spec.scale, softcap=spec.softcap, window=spec.window)
        total = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, -1, 1))
        weight = torch.exp(lse - total).transpose(1, 2).unsqueeze(-1)
        return (out.to(lse.dtype) * weight).to(q.dtype), total
    if plan.path == "packed":
        calls = stream_calls(plan.boundaries, q.shape[1], spec.window)
    else:
        calls = (_Whole(0, q.shape[1], 0, k.shape[1], spec.window),)
    return PackedAttention.apply(q, k, v, plan, calls, sinks)


def attention_with_sinks(q, k, v, sinks, *, softcap, causal, window, scale, backend,
                         return_lse: bool = False, cu_seqlens=None):
    """cps.attention(..., sinks=sinks): planned and run on one device (see sinks.py)."""
    from .plan import local_plan_for
    plan = local_plan_for(q, k, v, softcap=softcap, causal=causal, window=window, scale=scale,
                          backend=backend, return_lse=return_lse, cu_seqlens=cu_seqlens,
                          sinks=sinks)
    out, lse = one_device_with_sinks(q, k, v, plan, sinks)
    return (out, lse) if return_lse else out
