"""What every CP autograd.Function does around its forward and backward (`guarded`).

* Precision: the library decides it. Forward and backward run with autocast disabled, so a
  call inside `torch.autocast` computes exactly what it computes outside (kernels get the
  tensors' own dtype; the merge and the gradient sums stay float32). Callers under autocast
  get their bf16/fp16 activations attended in bf16/fp16, with float32 accumulation.
* Call identity: each forward takes the next sequence number of its group(s); the backward
  reuses it. Point-to-point messages are tagged with (sequence number, direction, signature
  digest, op) (transport.in_call), so messages of different calls never match. On gloo the
  collective algorithms (all_gather, a2a, a2a+p2p's all-to-all), whose messages carry no tag,
  compare (call, direction, signature) across the group at the start of the forward and of
  the backward: one all_gather of one number, so a rank that skipped a backward or diverged
  into another call fails at once on every rank with every rank's value. On NCCL that check
  would cost a host sync per call and is left to CP_SOFTCAP_CHECK_EVERY_CALL=1.
* Double backward: the gradients a CP backward returns under create_graph=True are wrapped in
  a node that raises when differentiated (at the first double backward, before any message of
  it is sent, so every rank raises and none waits). Differentiating through the gradients
  exactly would need the backward's own communication to be differentiable; first-order
  gradients under create_graph=True stay exact.
"""
from __future__ import annotations

import functools
import weakref
from contextlib import ExitStack

import torch

from ..plan import VALID_INPUTS, signature
from ..plan_cache import call_settings, weak
from ..transport import Call, check_agreement, digest, in_call, on_gloo

DOUBLE_BACKWARD = (
    "cp_softcap: double backward through context-parallel attention is not supported: this "
    "backward runs with create_graph=True (e.g. a gradient penalty taken with "
    "torch.autograd.grad(..., create_graph=True)), and its gradients would not be differentiable. "
    "Take first-order gradients without create_graph=True, or compute the penalty without CP "
    "(group=None on gathered inputs, backend='torch').")

CALL_HINT = ("The ranks are in different attention calls: one rank skipped a forward or backward "
             "(e.g. a skip-this-batch handler on one rank only) or the ranks' calls diverged. "
             "Every CP rank must make the same calls in the same order.")

_SEQ: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_ROWS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _groups(plan) -> tuple:
    return tuple(g for g in ((plan.heads and plan.heads.group), (plan.seq and plan.seq.group))
                 if g is not None)


def _next_seq(plan) -> int:
    groups = _groups(plan)
    per_group, rest = _SEQ.setdefault(groups[0], {}), weak(groups[1:])
    per_group[rest] = per_group.get(rest, 0) + 1
    return per_group[rest]


def _rows(plan) -> tuple:
    """(signature rows, their digest), once per plan."""
    if plan not in _ROWS:
        rows = (VALID_INPUTS,) + signature(plan)
        _ROWS[plan] = (rows, digest(rows))
    return _ROWS[plan]


def _check_call(plan, call: Call) -> None:
    """The per-call check of the collective algorithms on gloo (see the module docstring)."""
    if plan.path == "ring":
        return
    group = plan.heads.group if plan.heads is not None else plan.seq.group
    if not on_gloo(group, "cpu"):
        return
    rows, _ = _rows(plan)
    check_agreement(group, (("call", call.text()),) + rows, torch.device("cpu"),
                    f"the CP per-call check ({call.phase})", hint=CALL_HINT)


@functools.lru_cache(maxsize=None)
def _autocast_devices() -> tuple:
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def _precision(stack: ExitStack) -> None:
    for device in _autocast_devices():
        if torch.is_autocast_enabled(device):
            stack.enter_context(torch.autocast(device, enabled=False))


def autocast_off(fn):
    """Run `fn` with autocast disabled on every device where it is enabled."""
    @functools.wraps(fn)
    def run(*args):
        with ExitStack() as stack:
            _precision(stack)
            return fn(*args)
    return run


class _SecondOrderError(torch.autograd.Function):
    """The gradients as they are, wired to the attention's inputs, with a backward that raises.
    Because its inputs include q, k and v, every path from a loss that differentiates these
    gradients to q, k, v (or to anything they came from) passes through this node, so
    torch.autograd.grad(loss, [k]) and backward(inputs=...) reach the error too, never a
    silently missing term."""

    @staticmethod
    def forward(ctx, message, n, *tensors):
        ctx.message = message
        return tuple(t.view_as(t) for t in tensors[:n])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(ctx.message)


def refuse_second_order(grads: tuple, inputs: tuple, message: str) -> tuple:
    """The gradients (None where absent), made so that differentiating them raises `message`;
    `inputs`: the tensors they are gradients of (q, k, v)."""
    present = [g.detach() for g in grads if g is not None]
    anchors = [t for t in inputs if t is not None and t.requires_grad]
    raised = iter(_SecondOrderError.apply(message, len(present), *present, *anchors))
    return tuple(None if g is None else next(raised) for g in grads)


def guarded(function: type) -> type:
    """Decorate a CP autograd.Function class whose forward is (ctx, q, k, v, plan)."""
    forward, backward = function.forward, function.backward

    def guarded_forward(ctx, q, k, v, plan):
        call = Call(_next_seq(plan), "forward", _rows(plan)[1], call_settings()[0])
        ctx.cp_call = call
        with ExitStack() as stack:
            _precision(stack)
            stack.enter_context(in_call(call))
            _check_call(plan, call)
            return forward(ctx, q, k, v, plan)

    def guarded_backward(ctx, *grads):
        if torch.is_grad_enabled():
            # create_graph=True: raised here, before any message, so every rank doing the same
            # fails at once and the group stays usable (the CP inputs are not kept for backward,
            # so the gradients cannot be wired to them as on one device)
            raise RuntimeError(DOUBLE_BACKWARD)
        call = Call(ctx.cp_call.seq, "backward", ctx.cp_call.digest, call_settings()[0])
        with ExitStack() as stack:
            _precision(stack)
            stack.enter_context(torch.no_grad())
            stack.enter_context(in_call(call))
            _check_call(ctx.plan, call)
            return backward(ctx, *grads)

    function.forward = staticmethod(functools.wraps(forward)(guarded_forward))
    function.backward = staticmethod(functools.wraps(backward)(guarded_backward))
    return function


def shard_function(name: str, forward, backward) -> type:
    """The guarded autograd.Function (q, k, v, plan) -> out of a scheme that attends with this
    rank's own shards as queries: forward(q, k, v, plan) -> (out, lse), out in the accumulation
    dtype where rows were merged (ring), else as the kernel returned it (all_gather);
    backward(dout, q, k, v, out, lse, plan) -> (dq, dk, dv)."""

    def function_forward(ctx, q, k, v, plan):
        out, lse = forward(q, k, v, plan)
        # The backward gets the output as forward made it: a merged O stays in the accumulation
        # dtype, since D = rowsum(dO * O) from a rounded merge loses the gradient of near one-hot
        # (saturated) rows; a row one kernel call served keeps that kernel's own O.
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        return out.to(q.dtype)

    def function_backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = backward(dout, q, k, v, out, lse, ctx.plan)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None

    return guarded(type(name, (torch.autograd.Function,),
                        {"forward": staticmethod(function_forward),
                         "backward": staticmethod(function_backward),
                         "__module__": forward.__module__}))
