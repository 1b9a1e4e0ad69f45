"""The plan of one attention call: everything decided once per call signature.

api.py hands a call's arguments here in one step: `plan_for(q, k, v, group, ...)` (cp_attention)
and `local_plan_for(q, k, v, ...)` (attention) validate everything (q/k/v, boundaries, group,
export) and resolve the call into a `Plan`: the validated AttnSpec, the process group(s) with
this rank's CP size and rank, the selected kernel, the algorithm after comm='auto' and the
zigzag / head geometry it runs on, or for one device the path (one kernel call, packed
documents, the exportable math). Plans are cached per group and call signature
(plan_cache.py: a call whose raw arguments were seen before gets its plan without validating
them, building the spec or reading settings again); a plan refers to its groups weakly
(_GroupRef), so a group and its plans are freed once it is destroyed and the user holds it no
more. The group as the user passes it is resolved by groups.py. The plan is the only thing
that crosses into the algorithms: each autograd.Function takes (q, k, v, plan).

Under CP the first call of a signature (every call with CP_SOFTCAP_CHECK_EVERY_CALL=1) compares
`signature(plan)` across the ranks: every compared field of the plan and of its spec, so a new
field that sizes a message is compared by being added here. A local failure (no kernel for a
forced backend, a bad CP_SOFTCAP_RING_BLOCK_KEYS) is raised only after that exchange, so every
rank fails at once with every rank's value instead of leaving its peers waiting.
"""
from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import settings
from .calls import ring_members
from .comm_model import choose_comm
from .documents import PackedLayout, check_cu_seqlens
from .export import is_exporting, refuse_cp
from .groups import check_member, resolve_groups
from .plan_cache import (ONE_DEVICE, PLANS, cacheable, call_key, call_settings, documents, memo,
                         planning_inputs, recall, remember, weak)
from .heads import check_heads, kv_head_index, query_head_index
from .kernels.base import Kernel, grad_dtype
from .layout import ring_blocks
from .selector import select
from .spec import AttnSpec, check_local_shards, check_qkv, check_sinks, make_spec
from .transport import check_agreement

Backend = Union[str, Kernel]


class _GroupRef:
    """The plan caches are keyed weakly on the group; a plan (their value) holding the group
    strongly would keep every group that ran a CP call alive until the interpreter exits, where
    a process group destroyed late can abort the process (gloo) and its memory is never
    freed. A plan therefore refers to its group weakly; the call that runs it holds the group."""
    group_ref: weakref.ref

    @property
    def group(self):
        group = self.group_ref()
        if group is None:
            raise RuntimeError("the CP process group of this attention call no longer exists "
                               "(torch.distributed.destroy_process_group ran, or the group was "
                               "deleted, between the forward and its backward); keep the group "
                               "until every backward of its calls has run")
        return group


@dataclass(frozen=True)
class SeqShards(_GroupRef):
    """This rank's sequence shard in a ring or all-gather over `size` ranks of `group`: two
    zigzag chunks of `chunk` tokens, or its part of the packed layout `documents`; `blocks`
    groups the ring's steps (layout.ring_blocks)."""
    group_ref: weakref.ref          # see _GroupRef: a cached plan must not keep its group alive
    size: int
    rank: int
    chunk: int
    window: Tuple[Optional[int], Optional[int]]
    blocks: Tuple[Tuple[int, ...], ...] = ()
    documents: Optional[PackedLayout] = None    # packed layout (then `chunk` is unused)
    ring: tuple = ()                # packed: the ring's members as doc_geometry ranks


@dataclass(frozen=True)
class Heads(_GroupRef):
    """The all-to-all re-sharding by heads inside `group` (size ranks): query / KV heads each
    rank receives (KV heads replicated when Hkv % size != 0)."""
    group_ref: weakref.ref
    size: int
    q_index: Tuple[Tuple[int, ...], ...]
    kv_index: Tuple[Tuple[int, ...], ...]
    zigzag_order: bool = True       # False for packed documents: shards stay back to back


def _local(**kw):
    """A field that differs between ranks by design (or is derived from compared fields): not
    part of the cross-rank signature."""
    return field(metadata={"local": True}, **kw)


@dataclass(frozen=True, eq=False)
class Plan:
    """One attention call, resolved. Compared across ranks: every field not marked local, and
    every field of `spec` (see signature()); a field that sizes a message belongs here, not in
    an argument list. batch and local_len are 0 in a single-device plan (nothing is sent)."""
    spec: AttnSpec
    batch: int
    local_len: int                          # this rank's tokens (q, k and v alike)
    backend: str                            # what the caller asked for: 'auto' or a kernel name
    kernel: Optional[Kernel]                # None only while a failed plan is being compared
    ring_block_keys: Optional[int]          # None only while an invalid setting is compared
    layout: Union[None, PackedLayout, str] = None       # packed documents; str: why they are invalid
    # what the call runs (derived from the above): under CP the comm algorithm after 'auto'
    # ('ring', 'all_gather', 'a2a', 'a2a+p2p'); on one device 'kernel' (one kernel call),
    # 'packed' (packed documents, packed_local.py) or 'export' (the exportable math, export.py)
    path: str = _local(default="kernel")
    rank: int = _local(default=0)           # CP rank: ring rank * a2a size + a2a rank for a2a+p2p
    seq: Optional[SeqShards] = _local(default=None)    # ring / all_gather / a2a+p2p's ring
    heads: Optional[Heads] = _local(default=None)      # a2a / a2a+p2p's all-to-all
    boundaries: Optional[Tuple[int, ...]] = _local(default=None)   # path 'packed': validated cu
    # decided once from the compared fields: the accumulation dtype of out/LSE and of gradient
    # sums (kernels.base.grad_dtype) and the dtype of the kernel's gradient partials (partial_dtype)
    grad_dtype: torch.dtype = _local(init=False)
    partial_dtype: Optional[torch.dtype] = _local(init=False)

    def __post_init__(self):
        dtype = self.spec.dtype
        object.__setattr__(self, "grad_dtype", grad_dtype(dtype))
        object.__setattr__(self, "partial_dtype",
                           None if self.kernel is None else self.kernel.partial_dtype(dtype))

    @property
    def cp_size(self) -> int:
        return self.spec.cp_size


_LABELS = {"local_len": "local seq len", "num_heads": "query heads", "num_kv_heads": "kv heads",
           "head_dim_v": "v head dim", "device_type": "device type", "kernel": "selected kernel",
           "ring_block_keys": "ring block keys", "needs_backward": "needs backward",
           "return_lse": "return lse", "cp_size": "cp size", "documents": "packed documents",
           "layout": "document layout"}


def _text(name: str, value) -> str:
    if name == "kernel":
        return value.name if value is not None else "none (no kernel can serve the call there)"
    if name == "ring_block_keys" and value is None:
        return "invalid CP_SOFTCAP_RING_BLOCK_KEYS"
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if isinstance(value, PackedLayout):
        # the signature hashes the boundaries and the layout: ranks compare 1 number, not the tensor
        return (f"{value.num_docs} documents ending at {value.cu_seqlens[-1]} of {value.seq_len} tokens, "
                f"layout {value.signature:#x}")
    if name == "layout" and value is None:
        return "none (not packed)"
    return str(value)


def signature(plan: Plan) -> Tuple[Tuple[str, str], ...]:
    """(label, value as text) of every compared field of the plan and its spec."""
    rows = []
    for f in dataclasses.fields(plan):
        if f.metadata.get("local"):
            continue
        value = getattr(plan, f.name)
        if isinstance(value, AttnSpec):
            for sf in dataclasses.fields(value):
                sv = getattr(value, sf.name)
                if sf.name == "window":
                    rows += [("window left", str(sv[0])), ("window right", str(sv[1]))]
                else:
                    rows.append((_LABELS.get(sf.name, sf.name.replace("_", " ")), _text(sf.name, sv)))
        else:
            rows.append((_LABELS.get(f.name, f.name.replace("_", " ")), _text(f.name, value)))
    return tuple(rows)


# ---------------------------------------------------------------------------------- plans

def spec_for(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softcap, causal, window, scale,
             cp_size: int = 1, comm: str = "ring", return_lse: bool = False,
             documents: bool = False, sinks: Optional[torch.Tensor] = None) -> AttnSpec:
    """The validated AttnSpec of a call on these tensors (`sinks`: the validated sinks tensor or
    None; the spec records only their presence)."""
    needs_backward = torch.is_grad_enabled() and any(
        t.requires_grad for t in (q, k, v, sinks) if t is not None)
    refuse_cp(cp_size)     # every CP entry point builds its spec here, before any collective
    check_member(cp_size)
    return make_spec(head_dim=q.shape[-1], head_dim_v=v.shape[-1], num_heads=q.shape[2],
                     num_kv_heads=k.shape[2], dtype=q.dtype, device_type=q.device.type,
                     softcap=softcap, causal=causal, window=window, scale=scale,
                     needs_backward=needs_backward, cp_size=cp_size, comm=comm,
                     return_lse=return_lse, documents=documents, sinks=sinks is not None)


def local_plan(spec: AttnSpec, backend: Backend = "auto") -> Plan:
    """The plan of a single-device call (cached per spec and backend)."""
    key = (spec, backend, planning_inputs())
    plans = PLANS.setdefault(ONE_DEVICE, {})
    if key not in plans:
        kernel = select(spec, backend).kernel
        plans[key] = Plan(spec, 0, 0, _backend_name(backend), kernel, None)
    return plans[key]


# ------------------------------------------------------------------ the public entry points

def local_plan_for(q, k, v, *, softcap, causal, window, scale, backend: Backend,
                   return_lse: bool = False, cu_seqlens=None, sinks=None) -> Plan:
    """The plan of a one-device call (cps.attention): every argument validated, and what the
    call runs decided: path 'kernel' (one kernel call), 'packed' (plan.boundaries) or 'export'.
    sinks: the call's sinks tensor or None (its values are checked on every call)."""
    key = call_key(q, k, v, ("local", backend), (softcap, causal, window, scale, return_lse),
                    cu_seqlens, sinks)
    hit = recall(ONE_DEVICE, key)
    if hit is not None:
        if sinks is not None:
            check_sinks(sinks, q)
        return hit[0]
    plan = _one_device(q, k, v, softcap=softcap, causal=causal, window=window, scale=scale,
                       backend=backend, return_lse=return_lse, cu_seqlens=cu_seqlens, sinks=sinks)
    if plan.path != "export":
        memo(ONE_DEVICE, key, plan, ())
    return plan


def plan_for(q, k, v, group, *, softcap, causal, window, scale, comm: str, backend: Backend,
             cu_seqlens=None, sinks=None) -> Plan:
    """The plan of cps.cp_attention on this rank's shards: the group resolved and every argument
    validated (see the module docstring for the cross-rank check). A group of one rank (or None)
    gives a one-device plan (local_plan_for's, without the LSE); otherwise plan.path names the
    algorithm. cu_seqlens: global document boundaries (or a PackedLayout), validated here;
    invalid ones fail on every rank, after the signature exchange. sinks: the call's sinks
    tensor or None; the ranks compare only its presence (AttnSpec.sinks), and its values are
    checked on every call (a first call shows a bad one to the peers, as for q/k/v)."""
    root = ONE_DEVICE if group is None else group
    rest = ()
    if type(group) in (tuple, list) and len(group) == 2:    # comm='a2a+p2p': (a2a, ring)
        root, rest = group[0], (type(group),) + weak(group[1:])
    key = call_key(q, k, v, ("cp", comm, backend) + rest, (softcap, causal, window, scale),
                    cu_seqlens, sinks) if cacheable(root) else None
    hit = recall(root, key)
    # after destroy_process_group() a call with a group is planned in full, which says so
    if hit is not None and (root is ONE_DEVICE or dist.is_initialized()):
        plan, refs = hit
        if sinks is not None:
            check_sinks(sinks, q, where=f"CP rank {plan.rank}" if refs else "")
        if refs:
            every_call = call_settings()[1]
            if every_call is None:
                settings.check_every_call()     # raises: an invalid CP_SOFTCAP_CHECK_EVERY_CALL
            if every_call:      # the groups are alive: the call passed them (root and key)
                _compare(plan, tuple(r() for r in refs), q.device)
        return plan
    groups, cp, rank = resolve_groups(group, comm)
    if comm != "a2a+p2p" and cp == 1:
        plan, groups = _one_device(q, k, v, softcap=softcap, causal=causal, window=window,
                                   scale=scale, backend=backend, cu_seqlens=cu_seqlens,
                                   sinks=sinks), ()
    else:
        plan = _cp_plan(q, k, v, groups, cp, rank, softcap=softcap, causal=causal, window=window,
                        scale=scale, comm=comm, backend=backend, cu_seqlens=cu_seqlens,
                        sinks=sinks)
    if plan.path != "export":
        memo(root, key, plan, groups)
    return plan


# ------------------------------------------------------------------ building a plan

def check_packed(q: torch.Tensor, k: torch.Tensor, cu_seqlens) -> Tuple[int, ...]:
    """The validated boundaries of a packed single-device call (ValueError naming the fix). A
    PackedLayout (what CP calls may pass) stands for its boundaries: one device has no layout."""
    if isinstance(cu_seqlens, PackedLayout):
        cu_seqlens = cu_seqlens.cu_seqlens
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"cu_seqlens= (packed documents) needs q and k/v over the same stream: "
                         f"q has {q.shape[1]} tokens, k/v have {k.shape[1]}")
    return check_cu_seqlens(cu_seqlens, q.shape[1])


def _one_device(q, k, v, *, softcap, causal, window, scale, backend: Backend,
                return_lse: bool = False, cu_seqlens=None, sinks=None) -> Plan:
    check_qkv(q, k, v)
    if sinks is not None:
        check_sinks(sinks, q)
    cu = None if cu_seqlens is None else check_packed(q, k, cu_seqlens)
    packed = cu is not None and cu != (0, q.shape[1])
    spec = spec_for(q, k, v, softcap=softcap, causal=causal, window=window, scale=scale,
                    return_lse=return_lse, documents=packed, sinks=sinks)
    if packed:
        if is_exporting():
            raise ValueError("cu_seqlens= (packed documents) cannot be exported; export the "
                             "model on unpacked inputs")
        return dataclasses.replace(local_plan(spec, backend), path="packed", boundaries=cu)
    if is_exporting():     # torch.onnx.export / torch.export: the torch kernel's math, plain ops
        if backend not in ("auto", "torch"):
            raise ValueError(f"backend={backend!r} cannot be exported; export traces the 'torch' "
                             "kernel's math (cp_softcap.export): pass backend='auto' or 'torch'")
        return Plan(spec, 0, 0, _backend_name(backend), None, None, path="export")
    return local_plan(spec, backend)


def _cp_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: tuple, cp: int, rank: int,
             *, softcap, causal, window, scale, comm: str, backend: Backend, cu_seqlens=None,
             sinks=None) -> Plan:
    """The plan of a context-parallel call on this rank's shards, for groups/cp/rank from
    resolve_groups (cached per group and call signature)."""
    check_member(cp)
    where = f"CP rank {rank}"
    _check_inputs(q, k, v, cp, where, groups, sinks)
    spec = spec_for(q, k, v, softcap=softcap, causal=causal, window=window, scale=scale,
                    cp_size=cp, comm=comm, documents=cu_seqlens is not None, sinks=sinks)
    layout, doc_error = documents(cu_seqlens, q.shape[1], cp)
    key = (spec, q.shape[0], q.shape[1], weak(groups[1:]), backend, planning_inputs(), layout)
    plans = PLANS.setdefault(groups[0], {})
    plan = plans.get(key) if doc_error is None else None
    if plan is None:
        plan, error = _draft(spec, q.shape[0], q.shape[1], backend,
                             layout if doc_error is None else f"invalid: {doc_error}")
        _compare(plan, groups, q.device)
        if doc_error is not None or error is not None:
            failure = (error if doc_error is None
                       else type(doc_error)(f"{doc_error} (on {where}; the same on every rank)"))
            doc_error = error = None
            try:
                raise failure
            finally:
                # no local may hold the raised exception: its traceback holds this frame, and the
                # cycle would keep the process group alive until a garbage collection, which at
                # interpreter exit can tear gloo down out of order (an abort after the error)
                del failure
        plan = _finish(plan, groups, rank)
        remember(plans, key, plan)
    elif settings.check_every_call():
        _compare(plan, groups, q.device)
    return plan


def _backend_name(backend: Backend) -> str:
    return backend.name if isinstance(backend, Kernel) else str(backend)


def _draft(spec: AttnSpec, batch: int, local_len: int, backend: Backend, documents=None):
    """(plan with the compared fields, local error or None)."""
    kernel = keys = error = None
    try:
        keys = settings.ring_block_keys()
        kernel = select(spec, backend).kernel
    except ValueError as e:
        error = e.with_traceback(None)            # kept for later: no frames (see plan_for)
    return Plan(spec, batch, local_len, _backend_name(backend), kernel, keys, documents), error


VALID_INPUTS = ("inputs", "valid")     # the first compared row of every rank with valid inputs


def _compare(plan: Plan, groups: tuple, device) -> None:
    for g in groups:
        on = device if dist.get_backend(g) == "nccl" else torch.device("cpu")
        check_agreement(g, (VALID_INPUTS,) + signature(plan), on, "the CP call-signature check")


def _check_inputs(q, k, v, cp: int, where: str, groups: tuple, sinks=None) -> None:
    """check_qkv, check_local_shards (and check_sinks). A bad input is first shown to the peers
    in place of this rank's signature (so a peer in its first-call check fails at once, naming
    this rank's error) and then raised here."""
    try:
        check_qkv(q, k, v, where=where)
        check_local_shards(q, k, cp, where)
        if sinks is not None:
            check_sinks(sinks, q, where=where)
    except (TypeError, ValueError) as error:
        row = (("inputs", f"invalid on {where}: {type(error).__name__}: {error}"),)
        for g in groups:
            on = q.device if dist.get_backend(g) == "nccl" and torch.is_tensor(q) else torch.device("cpu")
            try:
                check_agreement(g, row, on, "the CP call-signature check")
            except (ValueError, RuntimeError):
                pass            # the peers saw it (or did not wait for it): this rank's own error
        raise


def _finish(plan: Plan, groups: tuple, rank: int) -> Plan:
    """Resolve comm='auto' and the algorithm's geometry (after the ranks agreed)."""
    spec, cp, layout = plan.spec, plan.cp_size, plan.layout
    comm = spec.comm
    if comm == "auto":
        comm = choose_comm(spec, plan.local_len * cp, plan.batch, block_keys=plan.ring_block_keys,
                           partial_bytes=plan.partial_dtype.itemsize,
                           documents=layout)
    seq = heads = None
    if comm in ("a2a", "a2a+p2p"):
        group = groups[0]
        size = dist.get_world_size(group)
        check_heads(spec.num_heads, size, rank, comm)
        heads = Heads(weakref.ref(group), size, _tuples(query_head_index(spec.num_heads, size)),
                      _tuples(kv_head_index(spec.num_heads, spec.num_kv_heads, size)), layout is None)
    if comm != "a2a":
        group = groups[-1]
        size, ring_len = dist.get_world_size(group), plan.local_len * (heads.size if heads else 1)
        blocks = ring_blocks(size, ring_len, plan.ring_block_keys) if comm != "all_gather" else ()
        seq = SeqShards(weakref.ref(group), size, dist.get_rank(group), ring_len // 2, spec.window, blocks,
                        layout, ring_members(cp, heads.size if heads else 1) if layout else ())
    return dataclasses.replace(plan, path=comm, rank=rank, seq=seq, heads=heads)


def _tuples(index) -> Tuple[Tuple[int, ...], ...]:
    return tuple(tuple(i) for i in index)
