"""The plan caches: a warm call finds its plan in one lookup.

Two caches, both per group (a WeakKeyDictionary on the group object, so a reused object address
never finds another group's plans; group=None is ONE_DEVICE): CALLS, keyed on a call's raw
arguments (call_key), skips validation and the spec for a call seen before; PLANS, keyed on the
validated spec, serves calls that cannot be keyed raw. Both are bounded (evict). Plans refer
to their groups weakly (weak), so a destroyed group and its plans are freed. Also here: the
packed layout of the last boundaries seen (documents: every layer of a step passes the same
ones), and the settings read per call (planning_inputs, call_settings), parsed once per raw
value by settings.py.
"""
from __future__ import annotations

import os
import weakref
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from . import settings
from .documents import PackedLayout
from .export import is_exporting
from .sharding import layout_for


def weak(groups: tuple) -> tuple:
    """Groups as weak references, for the caches' keys and values (see plan._GroupRef)."""
    return tuple(weakref.ref(g) if isinstance(g, _PROCESS_GROUP) else g for g in groups)


_PROCESS_GROUP = getattr(dist, "ProcessGroup", ())      # torch builds without distributed


class _OneDevice:
    """Stands for group=None in the plan cache (a key that is never freed)."""


ONE_DEVICE = _OneDevice()
PLANS: "weakref.WeakKeyDictionary[object, Dict[tuple, object]]" = weakref.WeakKeyDictionary()


# ------------------------------------------------------------------ raw calls
#
# A call whose raw arguments were seen before gets its plan from CALLS without validating them
# or building its spec again: the key holds everything validation and the spec depend on (the
# tensors' shapes, dtypes and devices, whether a gradient is needed, the deterministic flag, the
# options with their types, the boundaries' values, the raw planning variables). Calls that
# cannot be keyed so (tensor subclasses, options of other types, a DeviceMesh, an export
# trace) are planned in full every time, through the spec-keyed cache PLANS.

CALLS: "weakref.WeakKeyDictionary[object, Dict[tuple, tuple]]" = weakref.WeakKeyDictionary()
_SCALARS = (type(None), bool, int, float, str)


def _typed(x):
    """x with its type (1 and True, 1.0 and 1 are different options), or None."""
    t = type(x)
    if t in _SCALARS:
        return t, x
    if (t is tuple or t is list) and len(x) == 2 and type(x[0]) in _SCALARS \
            and type(x[1]) in _SCALARS:
        return t, type(x[0]), x[0], type(x[1]), x[1]
    return None


def cacheable(root) -> bool:
    return root is ONE_DEVICE or isinstance(root, _PROCESS_GROUP)


def call_key(q, k, v, call: tuple, options: tuple, cu_seqlens, sinks=None) -> Optional[tuple]:
    """The raw call as a key of CALLS, or None (see above). sinks: its presence and whether it
    needs a gradient are part of the key (its values are not: they are checked every call)."""
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return None
    typed = tuple(_typed(o) for o in options)
    if None in typed or is_exporting():
        return None
    docs = None
    if cu_seqlens is not None:
        docs = cu_seqlens if isinstance(cu_seqlens, PackedLayout) else boundary_values(cu_seqlens)
        if docs is None:
            return None
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or (sinks is not None and sinks.requires_grad))
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor):     # an nn.Parameter (the usual case) is keyed
            return None
        call = call + ("sinks",)
    return (docs, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device,
            v.device, grad, torch.are_deterministic_algorithms_enabled(), planning_inputs(),
            call, typed)


def recall(root, key) -> Optional[tuple]:
    if key is None:
        return None
    try:
        return CALLS[root].get(key)
    except (KeyError, TypeError):       # TypeError: a backend that is no dict key
        return None


def memo(root, key, plan, groups: tuple) -> None:
    """Remember (plan, weak(groups)) for `key`, bounded by evict (keys with boundaries, key[0],
    are the packed ones; calls whose shapes keep changing, e.g. a growing KV length, must not
    grow the cache forever)."""
    if key is None:
        return
    calls = CALLS.setdefault(root, {})
    try:
        calls[key] = (plan, weak(groups))
    except TypeError:
        return
    evict(calls, key[0] is not None, lambda kk, _: kk[0] is not None)


def planning_inputs() -> Tuple[str, ...]:
    """The raw values of the variables a call's plan depends on (settings.PLANNING; unvalidated:
    a plan cache key; an invalid value is reported when the plan is built, after the ranks
    compared plans)."""
    return tuple(os.environ.get(name, "") for name in settings.PLANNING)


_PER_CALL: Dict[tuple, tuple] = {}


def call_settings() -> Tuple[Optional[float], Optional[bool]]:
    """(CP_SOFTCAP_TIMEOUT, CP_SOFTCAP_CHECK_EVERY_CALL) as settings.py validates them, read at
    call time and validated once per raw value; None for an invalid value (the settings function
    raises it where the value is used)."""
    raw = tuple(os.environ.get(name, "") for name in settings.PER_CALL)
    if raw not in _PER_CALL:
        values = []
        for read in (settings.timeout_s, settings.check_every_call):
            try:
                values.append(read())
            except ValueError:
                values.append(None)
        _PER_CALL[raw] = tuple(values)
    return _PER_CALL[raw]


MAX_PACKED_PLANS = 16               # per group: packed boundaries change every training step
MAX_CALL_PLANS = 256                # per group (or one device): raw calls remembered


def remember(plans: dict, key: tuple, plan) -> None:
    """Cache `plan`, bounded by evict (shapes that keep changing, e.g. dynamic padding)."""
    plans[key] = plan
    evict(plans, plan.layout is not None, lambda _, p: p.layout is not None)


def evict(cache: dict, added_packed: bool, packed) -> None:
    """Oldest first: packed entries (packed(key, value)) beyond MAX_PACKED_PLANS when a packed
    one was just added, then any entry beyond MAX_CALL_PLANS."""
    if added_packed:
        for old in [k for k, v in cache.items() if packed(k, v)][:-MAX_PACKED_PLANS]:
            del cache[old]
    while len(cache) > MAX_CALL_PLANS:
        del cache[next(iter(cache))]


# The last boundaries and their layout: every layer of a step passes the same boundaries, and
# validating them and finding their layout again would cost each layer ~40 us of host time. The
# cache is keyed on the VALUES (read each call, so a tensor refilled in place, however, is never
# taken for its old contents); a CUDA tensor costs a device sync per call to read, so pass a
# list or a CPU tensor.
_LAST_BOUNDARIES: list = [None]         # ((values, local_len, cp), layout)


def boundary_values(cu_seqlens):
    """The boundaries as a tuple of ints when they are a 1-D integer tensor or a list/tuple of
    ints (the cache key; a CUDA tensor is read, a device sync, so callers that also need the
    values read them once here and pass the tuple); None for anything else (validated in full
    every call)."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or cu_seqlens.is_complex() \
                or cu_seqlens.dtype == torch.bool or cu_seqlens.device.type == "meta":
            return None
        return tuple(cu_seqlens.tolist())
    if isinstance(cu_seqlens, (list, tuple)) and all(type(v) is int for v in cu_seqlens):
        return tuple(cu_seqlens)
    return None


def documents(cu_seqlens, local_len: int, cp: int):
    """(PackedLayout or None, error or None) for the boundaries of a call on local shards of
    local_len tokens (the layout's local length, sharding.shard(..., cu_seqlens=))."""
    if cu_seqlens is None:
        return None, None
    values = boundary_values(cu_seqlens)
    key, last = (values, local_len, cp), _LAST_BOUNDARIES[0]
    if values is not None and last is not None and last[0] == key:
        return last[1], None
    try:
        # no rank in the message: ranks compare it, and equal bad boundaries must read the same
        layout = layout_for(values if values is not None else cu_seqlens, local_len * cp, cp)
    except (TypeError, ValueError) as e:
        return None, e.with_traceback(None)     # kept for later: no frames (see plan_for)
    if values is not None and layout.local_len == local_len:
        _LAST_BOUNDARIES[0] = (key, layout)
    if layout.local_len != local_len:
        return None, ValueError(
            f"local shards have {local_len} tokens, but the packed layout of these "
            f"cu_seqlens over cp={cp} holds {layout.local_len} per rank; shard q, k and v with "
            "cp_softcap.sharding.shard(x, cp, rank, cu_seqlens=cu_seqlens), which pads the stream "
            "to sharding.packed_len(S, cp)")
    return layout, None
