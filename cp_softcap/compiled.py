"""Attention inside `torch.compile`: the call as two custom operators the compiler treats as
opaque, so a block holding CPAttention compiles whole (`fullgraph=True` included) and the
library's Python (plan, cross-rank check, collectives, kernel calls) runs eagerly inside them.

    cp_softcap::attention           (q, k, v, sinks, cu_seqlens, cu_seqlens_k, positions, mask,
                                     options...) -> (out, lse, handle)
    cp_softcap::attention_backward  (handle, dout, dlse, shapes, grads) -> [dq, dk, dv, dsinks]

The forward operator runs the very call an eager model makes (api.cp_attention or
api.attention, the same autograd.Function and kernels: compiled and eager results are bitwise
equal) on inputs of its own, and keeps that call's autograd graph under an integer handle; the
backward operator runs the graph's backward. The handle is a 0-d int64 CPU tensor: the compiler
saves it for the backward like any activation, so activation checkpointing (eager
torch.utils.checkpoint around a compiled block, or checkpointing inside it) drops it and
recomputes the call like the rest. A kept graph is freed by its backward, or, when its handle's
memory is gone (checkpointing dropped it, or no backward follows), at the next attention call:
until then it holds one call's attention state. A saved-tensor hook that COPIES saved tensors
(torch.autograd.graph.save_on_cpu(pin_memory=True), compression, offload to disk) copies the
handle too, and the graph is freed before its backward: that backward raises an error saying so.

The inputs are copied into the operator: the compiler reuses the memory of tensors it
considers dead after their last use in the graph, and the kept graph would otherwise hold
views of memory overwritten before its backward. The copy is what eager autograd saves anyway
(the compiled graph no longer needs q, k, v for this backward), so memory is the same.

Everything the compiler sees as an argument is a tensor, an int, a float, a bool or a string:
the process group travels by its registered name (as torch's functional collectives pass it),
a backend Kernel instance by a key registered outside the compiled region (CPAttention does it
when built; or register_kernel), packed boundaries as a tensor (a PackedLayout: its
`compiled_form`, the boundaries followed by its chunks per rank, and its layer windows; the
operator rebuilds the same layout). What recompiles: dynamo guards on the Python values of the
options (softcap, window, comm, ...), which are fixed per layer; boundaries given as a list are
Python values too, so a list of a new length recompiles, while a tensor (or a PackedLayout) of
a new length recompiles once (dynamic after that) and new values never do.

`positions` (the HF integration's position_ids) are read inside the operator too, so that no
layer of a compiled HF model breaks its graph to read them: on one device, without boundaries,
their resets are the packed documents (documents.boundaries_from_positions: the batch rows are
then joined into one stream); under CP they are checked against the layout
(sharding.check_positions). Their values never recompile. Likewise an HF 2-D attention mask must
be all ones, and HF's key boundaries (cu_seq_lens_k) equal the query boundaries: both are
refused from inside the operator with the eager call's error. What is read from them is read
once per forward, not per layer (memo.TensorMemo).
"""
from __future__ import annotations

import contextlib

import itertools
import threading
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

from .documents import PackedLayout, boundaries_from_positions, packed_layout
from .kernels.base import Kernel, grad_dtype
from .memo import TensorMemo
from .sharding import check_positions
from .spec import different_boundaries_error, mask_is_empty, padding_mask_error

_LIVE: Dict[int, tuple] = {}            # handle -> (weak ref to the handle's storage, graph)
_NEXT = itertools.count(1)
_LOCK = threading.Lock()
_KERNELS: Dict[str, Kernel] = {}       # "kernel:<id>" -> a backend given as a Kernel instance
_MASKS = TensorMemo()                   # the last traced HF mask read (once per forward)


# ----------------------------------------------------------------- what crosses the boundary

def group_names(group, comm: str) -> str:
    """The registered names of the CP group(s) as the library resolves `group`, joined by a
    space (custom operators take no list of strings); "" for None."""
    from .groups import resolve_groups
    groups, cp, _ = resolve_groups(group, comm)
    if groups[0] is None:
        return ""
    return " ".join(g.group_name for g in groups)


def _groups(names: str, comm: str):
    from torch.distributed.distributed_c10d import _resolve_process_group
    if not names:
        return None
    groups = tuple(_resolve_process_group(n) for n in names.split(" "))
    return groups if comm == "a2a+p2p" else groups[0]


def register_kernel(kernel: Kernel) -> None:
    """Make a Kernel instance usable as backend= inside torch.compile (call it outside the
    compiled region; CPAttention(backend=kernel) does). Registered instances are kept."""
    _KERNELS[f"kernel:{id(kernel)}"] = kernel


def backend_key(backend) -> str:
    """A backend as a string: its name, or the key of a registered Kernel instance (a lookup:
    registering while dynamo traces would happen only after the graph ran)."""
    if isinstance(backend, Kernel):
        return f"kernel:{id(backend)}"
    return backend


def _backend(key: str):
    if not key.startswith("kernel:"):
        return key
    if key not in _KERNELS:
        raise ValueError(
            "cp_softcap: a Kernel instance passed as backend= inside torch.compile must be "
            "registered outside the compiled region first: build CPAttention(..., backend=kernel) "
            "there, or call cp_softcap.compiled.register_kernel(kernel); or pass the kernel's name")
    return _KERNELS[key]


# Windows cross the boundary as flat int lists, an unbounded side (None) as _NONE.
_NONE = -(1 << 62)


def _flat_windows(windows) -> List[int]:
    return [_NONE if x is None else int(x) for w in windows for x in w]


def _windows(flat: List[int]) -> list:
    return [tuple(None if x == _NONE else x for x in flat[i:i + 2]) for i in range(0, len(flat), 2)]


# ----------------------------------------------------------------- the kept graphs

def _sweep() -> None:
    """Free the graphs whose handle no longer exists anywhere."""
    with _LOCK:
        for key in [k for k, (ref, _) in _LIVE.items() if ref.expired()]:
            del _LIVE[key]


def _keep(graph) -> torch.Tensor:
    handle = torch.tensor(next(_NEXT), dtype=torch.int64)
    with _LOCK:
        _LIVE[int(handle)] = (StorageWeakRef(handle.untyped_storage()), graph)
    return handle


def _take(handle: torch.Tensor):
    with _LOCK:
        entry = _LIVE.pop(int(handle), None)
    if entry is None:
        raise RuntimeError(
            "cp_softcap: backward through compiled attention ran twice for one forward "
            "(retain_graph=True), or after its graph was freed because a saved-tensor hook copied "
            "the activations (e.g. torch.autograd.graph.save_on_cpu(pin_memory=True)); the "
            "compiled attention supports one backward per forward and saved-tensor hooks that "
            "keep the saved tensors themselves (activation checkpointing does)")
    return entry[1]


# ----------------------------------------------------------------- the operators

def _eager_dispatch():
    """The dispatcher state of an ordinary eager call, for the library call inside an operator.
    A compiled graph's first run goes through a dispatch mode (torch.compile's check that custom
    operators' outputs do not alias their inputs), and inside a mode every dispatch key above
    Python is excluded: functorch's among them, so vmap fails there ("NYI: querying
    is_contiguous inside of vmap"; flex's create_block_mask and its eager path use vmap), and a
    nested torch.compile (flex on CUDA) traces with fake tensors that cannot dispatch. And an
    operator always runs below autograd: inside it no op records a graph, even under
    enable_grad, so a kernel whose backward recomputes its forward and differentiates it (flex)
    fails ("element 0 of tensors does not require grad"); autograd is restored too (the
    operators' own outputs are fresh tensors outside any graph). Autocast's exclusions stay:
    every library Function turns autocast off around its kernels anyway."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    keep = exclude
    for key in _RESTORED_KEYS:
        if exclude.has(key):
            keep = keep.remove(key)
    if keep == exclude:
        return contextlib.nullcontext()
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), keep)


# autograd's keys (an operator's implementation runs below them), and the keys above Python
# that a dispatch mode excludes other than autocast, those this torch names (a few more, e.g.
# the legacy Batched, have no Python name and stay excluded: nothing the library calls uses
# them); resolved once, not per call
_RESTORED_KEYS = tuple(
    key for key in (getattr(torch._C.DispatchKey, name, None) for name in (
        "AutogradFunctionality", "AutogradOther", "AutogradNestedTensor",
        "FuncTorchDynamicLayerFrontMode", "FuncTorchDynamicLayerBackMode", "FuncTorchBatched",
        "FuncTorchVmapMode", "FuncTorchGradWrapper", "Functionalize", "Conjugate", "Negative",
        "ZeroTensor", "ADInplaceOrView", "PythonTLSSnapshot", "PreDispatch"))
    if key is not None)


@torch.library.custom_op("cp_softcap::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  sinks: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                  cu_seqlens_k: Optional[torch.Tensor], positions: Optional[torch.Tensor],
                  mask: Optional[torch.Tensor], groups: str, comm: str, backend: str,
                  softcap: float, causal: bool, window: List[int], scale: float,
                  flags: List[bool], layout_windows: List[int]
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flags: (q, k, v, sinks need gradients, softcap given, scale given, one device with
    return_lse, boundaries form a PackedLayout); window: _flat_windows of the call's window."""
    from .api import attention, cp_attention
    _sweep()
    grads, (has_cap, has_scale, one_device, layout) = flags[:4], flags[4:]
    # causal_align: the traced call was checked before it reached the operator, and
    # 'bottom_right' is the one alignment there is
    options = dict(softcap=softcap if has_cap else None, causal=causal,
                   window=_windows(window)[0], scale=scale if has_scale else None,
                   backend=_backend(backend), causal_align="bottom_right")
    # own copies (see the module docstring); the same values, so the same results
    q, k, v = (t.detach().clone().requires_grad_(g) for t, g in zip((q, k, v), grads))
    if sinks is not None:
        sinks = sinks.detach().clone().requires_grad_(grads[3])
    cu = None
    if cu_seqlens is not None:
        cu = [int(x) for x in cu_seqlens.tolist()]
        if layout:
            cu = _layout(cu[:-1], cu[-1], q.shape[1], groups, layout_windows)
    if mask is not None and not _MASKS.get(mask, None, lambda: mask_is_empty(mask)):
        raise padding_mask_error(mask.shape)        # a 2-D mask (HF's) with zeros
    if cu_seqlens_k is not None and cu_seqlens_k.tolist() != cu_seqlens.tolist():
        raise different_boundaries_error()
    rows = 0                        # > 0: that many batch rows joined into one packed stream
    if positions is not None and one_device and cu is None:
        found = boundaries_from_positions(positions, q.shape[0])
        if found is not None:
            cu, rows = list(found), q.shape[0]
    elif positions is not None and not one_device:
        from .groups import resolve_groups
        _, cp, rank = resolve_groups(_groups(groups, comm), comm)
        check_positions(positions, q.shape[1], cp, rank,
                        cu_seqlens=tuple(cu) if isinstance(cu, list) else cu)
    with torch.enable_grad(), _eager_dispatch():
        if one_device and rows:
            b, s = q.shape[:2]
            joined = [t.reshape(1, b * s, *t.shape[2:]) for t in (q, k, v)]
            out, lse = attention(*joined, return_lse=True, cu_seqlens=cu, sinks=sinks, **options)
            out = out.reshape(b, s, *out.shape[2:])
            lse = lse.reshape(lse.shape[1], b, s).transpose(0, 1)
        elif one_device:
            out, lse = attention(q, k, v, return_lse=True, cu_seqlens=cu, sinks=sinks, **options)
        else:
            out = cp_attention(q, k, v, _groups(groups, comm), comm=comm, cu_seqlens=cu,
                               sinks=sinks, **options)
            lse = out.new_empty((0,), dtype=grad_dtype(q.dtype))       # the fake kernel's
    # fresh, contiguous outputs (the fake kernel's strides; never a view of what the graph keeps)
    fresh = [t.detach().clone(memory_format=torch.contiguous_format) for t in (out, lse)]
    if not any(grads) or not out.requires_grad:
        return fresh[0], fresh[1], torch.zeros((), dtype=torch.int64)
    return fresh[0], fresh[1], _keep((out, lse if one_device else None, (q, k, v, sinks)))


@_attention_op.register_fake
def _(q, k, v, sinks, cu_seqlens, cu_seqlens_k, positions, mask, groups, comm, backend, softcap,
      causal, window, scale, flags, layout_windows):
    b, s, hq = q.shape[:3]
    out = q.new_empty((b, s, hq, v.shape[-1]))
    one_device = flags[6]
    lse = q.new_empty((b, hq, s) if one_device else (0,), dtype=grad_dtype(q.dtype))
    return out, lse, torch.empty((), dtype=torch.int64, device="cpu")


@torch.library.custom_op("cp_softcap::attention_backward", mutates_args=())
def _backward_op(handle: torch.Tensor, dout: torch.Tensor, dlse: Optional[torch.Tensor],
                 shapes: List[int], grads: List[bool]) -> List[torch.Tensor]:
    out, lse, inputs = _take(handle)
    outputs, grad_outputs = [out], [dout.to(out.dtype)]
    if lse is not None and dlse is not None:
        outputs.append(lse)
        grad_outputs.append(dlse)
    wanted = [t for t, g in zip(inputs, grads) if g and t is not None]
    with _eager_dispatch():
        found = iter(torch.autograd.grad(outputs, wanted, grad_outputs, allow_unused=True))
    result, seen = [], {dout.untyped_storage().data_ptr()}
    for t, g in zip(inputs, grads):
        if t is None:                           # no sinks: an empty placeholder
            result.append(dout.new_empty((0,)))
            continue
        d = next(found) if g else None
        d = torch.zeros_like(t, memory_format=torch.contiguous_format) if d is None else d.contiguous()
        if d.untyped_storage().data_ptr() in seen:      # an operator's outputs may not alias
            d = d.clone()
        seen.add(d.untyped_storage().data_ptr())
        result.append(d)
    return result


@_backward_op.register_fake
def _(handle, dout, dlse, shapes, grads):
    grads_qkv = [dout.new_empty(shapes[i * 4:(i + 1) * 4]) for i in range(3)]
    return grads_qkv + [dout.new_empty(shapes[12:-1], dtype=_DTYPES[shapes[-1]]) if len(shapes) > 13
                        else dout.new_empty((0,))]


_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _setup_context(ctx, inputs, output):
    q, k, v, sinks = inputs[:4]
    flags = inputs[-2]                          # then layout_windows, the last input
    ctx.inputs = len(inputs)
    ctx.shapes = list(q.shape) + list(k.shape) + list(v.shape)
    if sinks is not None:       # its shape, then its dtype's index in _DTYPES
        ctx.shapes += list(sinks.shape) + [_DTYPES.index(sinks.dtype)]
    ctx.grads = list(flags[:4])
    ctx.has_sinks = sinks is not None
    ctx.save_for_backward(output[2])


def _backward(ctx, dout, dlse, dhandle):
    (handle,) = ctx.saved_tensors
    dq, dk, dv, ds = torch.ops.cp_softcap.attention_backward(handle, dout, dlse, ctx.shapes,
                                                             ctx.grads)
    return (dq, dk, dv, ds if ctx.has_sinks else None) + (None,) * (ctx.inputs - 4)


_attention_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------- entry points

def compiled_attention(q, k, v, *, group_names_: str, comm: str, backend, softcap, causal,
                       window, scale, cu_seqlens, one_device: bool, sinks=None, positions=None,
                       mask=None, cu_seqlens_k=None):
    """(out, lse) through the operators; lse is empty for a CP call. Called while dynamo traces.
    positions, mask, cu_seqlens_k: HF's position ids, 2-D attention mask and key boundaries (a
    tensor equal to cu_seqlens), read inside the operator (module docstring), or None."""
    grad = torch.is_grad_enabled()
    grads = [grad and t is not None and t.requires_grad for t in (q, k, v, sinks)]
    cu, layout, lw = _boundaries(cu_seqlens)
    flags = grads + [softcap is not None, scale is not None, one_device, layout]
    out, lse, _ = torch.ops.cp_softcap.attention(
        q, k, v, sinks, cu, cu_seqlens_k, positions, mask, group_names_, comm, backend_key(backend),
        0.0 if softcap is None else float(softcap), bool(causal),
        _flat_windows([window if window is not None else (None, None)]),
        0.0 if scale is None else float(scale), flags, lw)
    return out, lse


def _boundaries(cu_seqlens):
    """(boundaries tensor or None, whether they come from a PackedLayout, its windows flattened)."""
    if cu_seqlens is None:
        return None, False, []
    if isinstance(cu_seqlens, PackedLayout):
        # its boundaries and chunks per rank as one tensor: new values never recompile
        return cu_seqlens.compiled_form, True, _flat_windows(cu_seqlens.windows)
    if isinstance(cu_seqlens, torch.Tensor):
        return cu_seqlens, False, []
    return torch.tensor(list(cu_seqlens), dtype=torch.int64), False, []


def _layout(cu: List[int], chunks_per_rank: int, local_len: int, groups: str,
            flat: List[int]) -> PackedLayout:
    """The caller's PackedLayout again: packed_layout of the same boundaries, length, ranks,
    chunks per rank and layer windows. The windows are stored normalised, so they are passed as
    they are (causal=False: nothing is re-normalised; a bidirectional layout stays
    bidirectional)."""
    from torch.distributed.distributed_c10d import _resolve_process_group
    cp = 1
    for name in groups.split(" "):
        cp *= dist.get_world_size(_resolve_process_group(name))
    return packed_layout(cu, local_len * cp, cp, causal=False, layer_windows=_windows(flat),
                         chunks_per_rank=chunks_per_rank)
