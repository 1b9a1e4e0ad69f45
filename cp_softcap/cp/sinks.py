"""Attention sinks under context parallelism (cps.cp_attention(..., sinks=), math in sinks.py):
the autograd functions (q, k, v, plan, sinks) -> out of every comm type.

ring / all_gather: the algorithm's forward gives each local row's final (out, lse) (the ring's
float32 merge of every chunk; all_gather's one call per row); the sink joins it once, and the
sink-adjusted (O', L') are what the forward returns and what the algorithm's backward hands
every chunk pair's kernel backward (exact). The sink's gradient is the sum over this rank's
rows. a2a / a2a+p2p: the same after the whole attention of this rank's query heads
(plan.heads.q_index), in cp/a2a.py's a2a_forward / a2a_backward; each row's sink term goes back
to the row's owner through the adjoint all-to-all, so there too a rank's sink gradient is the
sum over its own rows, every head. The sum over the CP group (what DDP / FSDP / an all_reduce
of the gradients computes) is the sink's gradient.

Each function is guard.guarded (precision, call identity, per-call check) around a forward of
(ctx, q, k, v, plan): the sinks tensor reaches it on ctx (ctx.sinks), and the sink gradient
comes back the same way (ctx.dsinks).
"""
from __future__ import annotations

import torch

from ..packed_local import one_device_with_sinks
from ..plan import plan_for
from ..sinks import apply_sinks, sink_grad, sink_rows
from .a2a import _attend, _attend_backward, a2a_backward, a2a_forward
from .all_gather import all_gather_backward, all_gather_forward
from .guard import guarded
from .ring import ring_backward, ring_forward


def _sink_function(name: str, forward, backward) -> type:
    """autograd.Function (q, k, v, plan, sinks) -> out around guarded forward(ctx, q, k, v, plan)
    (reads ctx.sinks) and backward(ctx, dout) (sets ctx.dsinks)."""
    inner = guarded(type(name + "Guarded", (torch.autograd.Function,),
                         {"forward": staticmethod(forward), "backward": staticmethod(backward),
                          "__module__": __name__}))

    def outer_forward(ctx, q, k, v, plan, sinks):
        ctx.sinks = sinks
        return inner.forward(ctx, q, k, v, plan)

    def outer_backward(ctx, dout):
        ctx.dsinks = None
        grads = inner.backward(ctx, dout)
        return tuple(grads) + (ctx.dsinks if ctx.needs_input_grad[4] else None,)

    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(outer_forward), "backward": staticmethod(outer_backward),
                 "__module__": __name__})


def _shard(name: str, algorithm_forward, algorithm_backward) -> type:
    """A scheme whose queries are this rank's own shards (ring, all_gather)."""

    def forward(ctx, q, k, v, plan):
        sinks = ctx.sinks
        del ctx.sinks
        out, lse = algorithm_forward(q, k, v, plan)
        out, lse = apply_sinks(out, lse, sinks, plan.grad_dtype)     # once, on the final rows
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.plan = plan
        return out.to(q.dtype)

    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        ctx.dsinks = sink_grad(sink_rows(dout, out, lse, sinks), sinks)
        dq, dk, dv = algorithm_backward(dout, q, k, v, out, lse, ctx.plan)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None

    return _sink_function(name, forward, backward)


def _a2a(name: str, attend, attend_backward) -> type:
    """An all-to-all scheme (cp/a2a.py) whose per-rank attention is attend / attend_backward."""

    def forward(ctx, q, k, v, plan):
        sinks = ctx.sinks
        del ctx.sinks
        return a2a_forward(ctx, q, k, v, plan, attend, sinks)

    def backward(ctx, dout):
        return a2a_backward(ctx, dout, attend_backward)

    return _sink_function(name, forward, backward)


SINK_ALGORITHMS = {
    "ring": _shard("RingSinkAttention", ring_forward, ring_backward),
    "all_gather": _shard("AllGatherSinkAttention", all_gather_forward, all_gather_backward),
    "a2a": _a2a("A2ASinkAttention", _attend, _attend_backward),
    "a2a+p2p": _a2a("A2AP2PSinkAttention", ring_forward, ring_backward),
}


def cp_attention_with_sinks(q, k, v, group, sinks, *, softcap, causal, window, scale, comm,
                            backend, cu_seqlens=None) -> torch.Tensor:
    """cps.cp_attention(..., sinks=sinks): planned (the ranks compare the sinks' presence) and
    run by the comm type's sink function, or on one device for a group of one rank."""
    plan = plan_for(q, k, v, group, softcap=softcap, causal=causal, window=window, scale=scale,
                    comm=comm, backend=backend, cu_seqlens=cu_seqlens, sinks=sinks)
    if plan.path in SINK_ALGORITHMS:
        return SINK_ALGORITHMS[plan.path].apply(q, k, v, plan, sinks)
    return one_device_with_sinks(q, k, v, plan, sinks)[0]
