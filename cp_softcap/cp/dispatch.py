"""run_cp: validate a CP call, select the kernel, check the ranks agree, run the algorithm."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from ..api import spec_for
from ..settings import ring_block_keys
from ..selector import select
from ..spec import check_qkv
from .a2a import UlyssesAttention, check_heads
from .all_gather import AllGatherAttention
from .auto import choose_comm
from .ring import RingAttention
from .signature import check_signature


def hybrid_groups(group) -> Tuple[object, object]:
    """(inner a2a group, outer ring group) from a 2-D DeviceMesh (dims: ring, a2a) or a pair
    (a2a_group, ring_group). The CP rank is ring_rank * a2a_size + a2a_rank."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover
        DeviceMesh = ()
    if isinstance(group, DeviceMesh):
        if group.ndim != 2:
            raise ValueError(f"comm='a2a+p2p' needs a 2-D DeviceMesh (ring, a2a), got {group.ndim}-D")
        return group.get_group(1), group.get_group(0)
    if isinstance(group, (tuple, list)) and len(group) == 2:
        return group[0], group[1]
    raise ValueError("comm='a2a+p2p' needs group=(a2a_group, ring_group) or a 2-D DeviceMesh with "
                     "dims (ring, a2a); build one with cp_softcap.make_hybrid_groups(cp_group, a2a_size)")


def make_hybrid_groups(group, a2a_size: int):
    """Split a CP group into consecutive a2a groups of `a2a_size` ranks and ring groups across
    them. Collective: every rank of the default group must call it. Returns (a2a, ring)."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    cp = len(ranks)
    if a2a_size < 1 or cp % a2a_size != 0:
        raise ValueError(f"a2a_size={a2a_size} must divide the CP group size {cp}")
    me = dist.get_rank()
    inner = outer = None
    for o in range(cp // a2a_size):
        members = ranks[o * a2a_size:(o + 1) * a2a_size]
        g = dist.new_group(members)
        if me in members:
            inner = g
    for i in range(a2a_size):
        members = ranks[i::a2a_size]
        g = dist.new_group(members)
        if me in members:
            outer = g
    return inner, outer


def run_cp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *, softcap, causal, window,
           scale, comm: str, backend: str, cp_size: Optional[int] = None) -> torch.Tensor:
    hybrid = comm == "a2a+p2p"
    if hybrid:
        inner, outer = hybrid_groups(group)
        cp = dist.get_world_size(inner) * dist.get_world_size(outer)
        rank = dist.get_rank(outer) * dist.get_world_size(inner) + dist.get_rank(inner)
    else:
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
    where = f"CP rank {rank}"
    check_qkv(q, k, v, where=where)
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"local q has {q.shape[1]} tokens but k/v have {k.shape[1]} on {where}; "
                         "context-parallel attention needs q, k, v sharded the same way "
                         "(cp_softcap.sharding.shard on each)")
    if q.shape[1] == 0 or q.shape[1] % 2 != 0:
        raise ValueError(f"local sequence length {q.shape[1]} on {where} is not a positive even "
                         f"number: the global length must be a multiple of 2*cp={2 * cp}; pad with "
                         f"cp_softcap.sharding.pad_to_multiple(x, {2 * cp}) before sharding")
    spec = spec_for(q, k, v, softcap=softcap, causal=causal, window=window, scale=scale,
                    cp_size=cp, comm=comm)
    # A local failure (no kernel for a forced backend, a bad CP_SOFTCAP_RING_BLOCK_KEYS) is
    # raised only after the signature exchange, so every rank fails at once with all ranks' values
    kernel, keys, local_error = None, -1, None
    try:
        keys = ring_block_keys()
        kernel = select(spec, backend).kernel
    except ValueError as e:
        local_error = e
    for g in ((inner, outer) if hybrid else (group,)):
        check_signature(g, q, k, v, spec, backend, kernel.name if kernel else "none", keys)
    if local_error is not None:
        raise local_error
    if comm == "auto":
        comm = choose_comm(spec, q.shape[1] * cp, q.shape[0],
                           partial_bytes=kernel.partial_dtype(spec.dtype).itemsize)
    args = (spec.scale, spec.softcap, spec.window)
    if comm == "ring":
        return RingAttention.apply(q, k, v, group, kernel, *args)
    if comm == "all_gather":
        return AllGatherAttention.apply(q, k, v, group, kernel, *args)
    if comm == "a2a":
        check_heads(q.shape[2], k.shape[2], cp, rank)
        return UlyssesAttention.apply(q, k, v, group, None, kernel, *args)
    check_heads(q.shape[2], k.shape[2], dist.get_world_size(inner), rank)
    return UlyssesAttention.apply(q, k, v, inner, outer, kernel, *args)
