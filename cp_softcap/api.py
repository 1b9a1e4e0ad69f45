"""The public entry points: `attention` (one device), `cp_attention` (context parallel, on this
rank's zigzag shards) and `CPAttention` (the parameter-free layer for model code). Every tensor
is [B, S, H, D]: batch, sequence, heads, head dim (SDPA's [B, H, S, D] transposed).

Each call hands its arguments to the plan in one step (plan.py: every validation, the spec,
groups, kernel and algorithm, or the one-device path: one kernel call, packed documents or the
exportable math) and runs what the plan says; the plan is all the algorithms see. causal=True is the default everywhere: these are the
layers of causal language models.
"""
from __future__ import annotations

import warnings
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from .cp.a2a import A2AAttention
from .cp.a2a_p2p import A2AP2PAttention
from .cp.all_gather import AllGatherAttention
from .cp.guard import autocast_off
from .cp.ring import RingAttention
from .compiled import compiled_attention, group_names, register_kernel
from .kernels.base import Kernel
from .export import export_attention
from .packed_local import (packed_attention, save_for_local_backward, saved_for_local_backward,
                           second_order_safe)
from .groups import check_group
from .export import is_exporting
from .plan import Backend, Plan, local_plan_for, plan_for
from .selector import check_backend
from .spec import (alignment_error, check_causal_align, check_comm, normalize_softcap,
                   normalize_window, unaligned)

def compiling() -> bool:
    """True while torch.compile traces the caller (not torch.export / ONNX export, which trace
    the plain-ops math of export.py): the call then goes through compiled.py's operators."""
    return torch.compiler.is_compiling() and not is_exporting()


ALGORITHMS = {"ring": RingAttention, "all_gather": AllGatherAttention, "a2a": A2AAttention,
              "a2a+p2p": A2AP2PAttention}


class _LocalAttention(torch.autograd.Function):
    """One kernel call on one device; the plan holds the kernel, scale, softcap and window."""

    @staticmethod
    @autocast_off
    def forward(ctx, q, k, v, plan):
        spec = plan.spec
        out, lse = plan.kernel.forward(q, k, v, scale=spec.scale, softcap=spec.softcap,
                                       window=spec.window)
        return save_for_local_backward(ctx, plan, q, k, v, out, lse)

    @staticmethod
    @autocast_off
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, dout = saved_for_local_backward(ctx, dout)
        spec = ctx.plan.spec
        # one call, nothing to accumulate: the kernel's own dtype, cast once (a no-op for the
        # flash-attn family, whose gradients already have the inputs' dtype)
        dq, dk, dv = ctx.plan.kernel.backward(dout, q, k, v, out, lse,
                                              scale=spec.scale, softcap=spec.softcap,
                                              window=spec.window, dlse=dlse)
        grads = (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype))
        grads = second_order_safe(ctx.plan.kernel, grads, (q, k, v))
        return grads + (None,)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softcap: Optional[float] = None,
              causal: bool = True, window=None, scale: Optional[float] = None,
              backend: Backend = "auto", return_lse: bool = False, cu_seqlens=None,
              sinks: Optional[torch.Tensor] = None, causal_align: Optional[str] = None
              ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Softcapped attention on one device.

    Layout [B, S, H, D] (batch, sequence, heads, head dim): q [B, Sq, Hq, D], k/v
    [B, Sk, Hkv, D] (Hq % Hkv == 0; GQA is not expanded). Tensors in SDPA's [B, H, S, D]
    layout go in as q.transpose(1, 2).
    softcap: None/0.0 = off, else z = softcap * tanh(scale * q.k / softcap) before masking.
    causal: True (the default) hides future keys; pass causal=False for bidirectional attention.
    window: (left, right) or None; query i sees key j iff i - left <= j <= i + right.
    causal=True forces right = 0. backend: "auto", a kernel name, or a Kernel instance.
    causal_align: how queries and keys line up when Sq != Sk under causal=True or a window.
    Such a call must say it, else it is refused with a ValueError (conventions differ:
    flash-attn aligns the last query with the last key, SDPA's is_causal the first with the
    first). 'bottom_right' (query i at key position i + Sk - Sq, a decode step over a KV cache)
    is the one implemented; 'top_left' is refused with its equivalent call. Ignored when
    Sq == Sk.
    Returns out [B, Sq, Hq, Dv] in q's dtype, and with return_lse=True also lse [B, Hq, Sq]
    (float32, float64 for float64 inputs; -inf for rows that see no key), differentiable.

    cu_seqlens (packed documents): boundaries [0, e1, ..., T_docs] (1-D integer tensor or list of
    ints) of the documents packed into one stream, q/k/v [1, T, H, D] (a batch of B streams
    sharing these boundaries works too; for different ones join the rows into one stream,
    listing every boundary). Query i sees key j iff
    both lie in the same document and the causal/window rule holds (positions within the stream;
    a window therefore never crosses a document). Tokens past T_docs are padding: out 0, LSE
    -inf, zero gradients. One document over the whole stream is the unpacked call.

    sinks (attention sinks, gpt-oss's `s_aux`): None, or a floating tensor [Hq] on q's device,
    one finite learned logit per query head that joins every row's softmax denominator and
    attends to nothing: out' = out * sigmoid(lse - sink), lse' = logaddexp(lse, sink) (not
    scaled or softcapped; a row that sees no key gets out 0, lse = sink). Differentiable in
    sinks too.
    """
    check_causal_align(causal_align)
    if cu_seqlens is None and unaligned(q, k, causal, window, causal_align):
        raise alignment_error(q, k, causal, window)
    if compiling():
        out, lse = compiled_attention(q, k, v, group_names_="", comm="ring", backend=backend,
                                      softcap=softcap, causal=causal, window=window, scale=scale,
                                      cu_seqlens=cu_seqlens, one_device=True, sinks=sinks)
        return (out, lse) if return_lse else out
    if sinks is not None:       # attention sinks: sinks.py, run by packed_local.py
        from .packed_local import attention_with_sinks
        return attention_with_sinks(q, k, v, sinks, softcap=softcap, causal=causal, window=window,
                                    scale=scale, backend=backend, return_lse=return_lse,
                                    cu_seqlens=cu_seqlens)
    plan = local_plan_for(q, k, v, softcap=softcap, causal=causal, window=window, scale=scale,
                          backend=backend, return_lse=return_lse, cu_seqlens=cu_seqlens)
    out, lse = _run_one_device(q, k, v, plan)
    return (out, lse) if return_lse else out


def _run_one_device(q, k, v, plan: Plan):
    """(out, lse) of a one-device plan."""
    if plan.path == "packed":
        return packed_attention(q, k, v, plan, plan.boundaries)
    if plan.path == "export":     # torch.onnx.export / torch.export: the torch kernel's math, plain ops
        spec = plan.spec
        return export_attention(q, k, v, scale=spec.scale, softcap=spec.softcap, window=spec.window)
    return _LocalAttention.apply(q, k, v, plan)


def _warn_if_several_ranks() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        warnings.warn(
            f"cp_softcap: attention with group=None runs on this rank's tensors alone (no context "
            f"parallelism) although torch.distributed runs {dist.get_world_size()} ranks; if q/k/v "
            "are sequence shards, pass their CP group (e.g. dist.group.WORLD), else the result is "
            "attention within each shard only", stacklevel=3)


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *,
                 softcap: Optional[float] = None, causal: bool = True, window=None,
                 scale: Optional[float] = None, comm: str = "ring", backend: Backend = "auto",
                 cu_seqlens=None, sinks: Optional[torch.Tensor] = None,
                 causal_align: Optional[str] = None) -> torch.Tensor:
    """Context-parallel attention on this rank's shards.

    Layout [B, S, H, D] (batch, sequence, heads, head dim): q [B, S/cp, Hq, D], k/v
    [B, S/cp, Hkv, D], the local shards in the zigzag layout (cp_softcap.sharding.shard: rank
    r holds global chunks r and 2cp-1-r of 2cp equal chunks). Under CP q and k/v have the same
    length; causal_align matters only on one device (group None or of one rank), as for
    cps.attention.
    Returns this rank's shard of the output, [B, S/cp, Hq, Dv], in q's dtype. Differentiable.
    softcap/window/scale/causal mean what they mean for cps.attention, in GLOBAL positions.
    comm: "ring" | "all_gather" | "a2a" | "a2a+p2p" | "auto". group None or of size 1: one device,
    no context parallelism (unlike torch.distributed, None is NOT the default group: pass
    dist.group.WORLD for a CP group of every rank; a warning says so once when None is passed
    while several ranks run).

    cu_seqlens (packed documents): GLOBAL document boundaries [0, e1, ..., T_docs] of the whole
    stream, identical on every rank (1-D integer tensor, list of ints, or a PackedLayout from
    cp_softcap.documents.packed_layout). The shards are then in the packed layout:
    cp_softcap.sharding.shard(x, cp, rank, cu_seqlens=cu_seqlens) gives each rank
    sharding.packed_len(S, cp) / cp tokens (the stream padded at its end). Query i sees key j
    only within one document (and under causal/window in global positions); tokens past
    T_docs are padding: output 0 and zero gradients. Every comm type serves packed calls; a
    batch of B > 1 streams is allowed under CP when all share these boundaries. The shards
    must come from shard(..., cu_seqlens=) with these same boundaries (or PackedLayout): a
    zigzag shard or another layout of the same length cannot be told apart here and gives a
    wrong result.
    Raises ValueError (TypeError for non-integers) on EVERY rank, naming the rank, when the
    boundaries are not increasing, do not start at 0, end past the stream, differ between
    ranks, or do not match the local shard length.

    sinks: None or a floating tensor [Hq] of per-head attention-sink logits, as for
    cps.attention; under CP the sink joins each query's softmax once, after the merge of every
    chunk. Its gradient on each rank is the sum over THAT rank's query rows (every comm type),
    so the usual gradient reduction across the CP/data-parallel ranks (a sum, as for every
    other parameter) gives the full gradient. The ranks compare the sinks' presence, not values.
    """
    check_causal_align(causal_align)
    if cu_seqlens is None and unaligned(q, k, causal, window, causal_align) \
            and _one_rank(group, comm):
        raise alignment_error(q, k, causal, window)
    if compiling():
        out, _ = compiled_attention(q, k, v, group_names_=group_names(group, comm), comm=comm,
                                    backend=backend, softcap=softcap, causal=causal,
                                    window=window, scale=scale, cu_seqlens=cu_seqlens,
                                    one_device=False, sinks=sinks)
        return out
    if sinks is not None:       # attention sinks: cp/sinks.py
        from .cp.sinks import cp_attention_with_sinks
        if group is None:
            _warn_if_several_ranks()
        return cp_attention_with_sinks(q, k, v, group, sinks, softcap=softcap, causal=causal,
                                       window=window, scale=scale, comm=comm, backend=backend,
                                       cu_seqlens=cu_seqlens)
    if group is None:
        _warn_if_several_ranks()
    plan = plan_for(q, k, v, group, softcap=softcap, causal=causal, window=window, scale=scale,
                    comm=comm, backend=backend, cu_seqlens=cu_seqlens)
    if plan.path in ALGORITHMS:
        return ALGORITHMS[plan.path].apply(q, k, v, plan)
    return _run_one_device(q, k, v, plan)[0]


def _one_rank(group, comm: str) -> bool:
    """Whether `group` runs the call on one device. Asked only of a call about to be refused:
    an invalid group answers False, and the plan refuses it with its own message."""
    try:
        from .groups import resolve_groups
        return comm != "a2a+p2p" and resolve_groups(group, comm)[1] == 1
    except (TypeError, ValueError, RuntimeError):
        return False


class CPAttention(torch.nn.Module):
    """Parameter-free attention layer for model code: `CPAttention(cp_group, softcap=50.0)`
    (causal by default).

    forward(q, k, v, cu_seqlens=None, sinks=None) takes the local shards in the layout
    [B, S/cp, H, D] (batch, sequence, heads, head dim; GQA allowed) and returns the local
    output shard [B, S/cp, Hq, Dv]; cu_seqlens: the global
    document boundaries of a packed stream (shards from sharding.shard(..., cu_seqlens=));
    sinks: the model's learned attention-sink logits [Hq] (a parameter of the model, passed at
    call time; each rank's gradient is the sum over its own rows). causal_align: as for
    cps.attention, for a layer run on one device whose queries and keys differ in length (a
    decode step over a KV cache). See cp_attention for the layout contract and the errors.
    """

    def __init__(self, cp_group=None, softcap: Optional[float] = None, *, causal: bool = True,
                 window=None, scale: Optional[float] = None, comm: str = "ring",
                 backend: Backend = "auto", causal_align: Optional[str] = None):
        super().__init__()
        self.softcap = normalize_softcap(softcap)
        self.window = normalize_window(window, causal)
        check_comm(comm)
        check_causal_align(causal_align)
        self.causal_align = causal_align
        check_backend(backend)
        if isinstance(backend, Kernel):
            register_kernel(backend)        # usable inside torch.compile (compiled.py)
        check_group(cp_group, comm)
        self.cp_group, self.causal, self.scale = cp_group, causal, scale
        self.comm, self.backend = comm, backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cu_seqlens=None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        return cp_attention(q, k, v, self.cp_group, softcap=self.softcap, causal=self.causal,
                            window=self.window, scale=self.scale, comm=self.comm,
                            backend=self.backend, cu_seqlens=cu_seqlens, sinks=sinks,
                            causal_align=self.causal_align)
