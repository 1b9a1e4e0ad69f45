"""The group pair of comm="a2a+p2p": an inner all-to-all group and an outer ring group, from a 2-D
DeviceMesh (dims: ring, a2a) or a pair (a2a_group, ring_group); make_hybrid_groups builds the
pair. The CP rank is ring_rank * a2a_size + a2a_rank (hybrid_rank).
"""
from __future__ import annotations

from typing import Tuple

import torch.distributed as dist


def hybrid_groups(group) -> Tuple[object, object]:
    """(inner a2a group, outer ring group) from a 2-D DeviceMesh (dims: ring, a2a) or a pair
    (a2a_group, ring_group)."""
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


def hybrid_rank(inner, outer) -> int:
    """This rank's CP rank in the hybrid layout: ring rank * a2a size + a2a rank."""
    return dist.get_rank(outer) * dist.get_world_size(inner) + dist.get_rank(inner)


def make_hybrid_groups(group, a2a_size: int):
    """Split a CP group into consecutive a2a groups of `a2a_size` ranks and ring groups across
    them. Collective: every rank of the default group must call it. Returns (a2a, ring)."""
    if isinstance(a2a_size, bool) or not isinstance(a2a_size, int):
        raise TypeError(f"a2a_size={a2a_size!r} ({type(a2a_size).__name__}) must be an int (e.g. "
                        f"{int(a2a_size) if isinstance(a2a_size, float) and a2a_size.is_integer() else 2}"
                        "; use // for an integer division)")
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
