"""The CP group as the user passes it, resolved: None (one device), a ProcessGroup, a 1-D
DeviceMesh, or for comm="a2a+p2p" the group pair (an inner all-to-all group and an outer ring
group) from a 2-D DeviceMesh (dims: ring, a2a) or a pair (a2a_group, ring_group), which
make_hybrid_groups builds. The CP rank of the pair is ring_rank * a2a_size + a2a_rank
(hybrid_rank). resolve_groups is the one place that turns any of these into (groups, CP size,
CP rank); check_group refuses anything else with the fix.
"""
from __future__ import annotations

from typing import Tuple

import torch.distributed as dist

from .spec import check_comm


def hybrid_groups(group) -> Tuple[object, object]:
    """(inner a2a group, outer ring group) from a 2-D DeviceMesh (dims: ring, a2a) or a pair
    (a2a_group, ring_group)."""
    if is_mesh(group):
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


def resolve_groups(group, comm: str) -> Tuple[tuple, int, int]:
    """((group,) or (a2a group, ring group), CP size, CP rank) for `group` as passed by the user:
    None, a process group, a 1-D DeviceMesh, or for comm='a2a+p2p' a pair / 2-D mesh."""
    check_comm(comm)
    check_group(group, comm)
    if comm == "a2a+p2p":
        inner, outer = hybrid_groups(group)
        return (inner, outer), dist.get_world_size(inner) * dist.get_world_size(outer), hybrid_rank(inner, outer)
    group = _as_process_group(group, comm)
    if group is None:
        return (None,), 1, 0
    if isinstance(group, (tuple, list)):
        raise ValueError("a pair of groups is only meaningful with comm='a2a+p2p'")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("cp_attention got a process group but torch.distributed is not initialised; "
                           "call torch.distributed.init_process_group first (torchrun sets the env), "
                           "or pass group=None for single-device attention")
    return (group,), dist.get_world_size(group), dist.get_rank(group)


def check_group(group, comm: str) -> None:
    """Raise TypeError/ValueError unless `group` is something a CP group can be: None, a
    ProcessGroup, a DeviceMesh, or for comm='a2a+p2p' a pair of ProcessGroups."""
    if group is None or is_mesh(group) or is_group(group) or _non_member(group):
        return
    if isinstance(group, (tuple, list)):
        if group and all(isinstance(r, int) and not isinstance(r, bool) for r in group):
            raise TypeError(f"group={list(group)} is a list of ranks, not a process group: build "
                            f"one with torch.distributed.new_group({list(group)}) (every rank of the "
                            "default group must call it) and pass that, or None for one device")
        if comm != "a2a+p2p":
            raise ValueError(f"group is a {type(group).__name__} of {len(group)}: a pair of groups is "
                             f"only meaningful with comm='a2a+p2p' (got comm={comm!r}); pass one "
                             "ProcessGroup or a 1-D DeviceMesh")
        if len(group) == 2 and all(is_group(g) for g in group):
            return
        raise TypeError(f"comm='a2a+p2p' needs group=(a2a_group, ring_group), two ProcessGroups, "
                        f"got {[type(g).__name__ for g in group]}; build them with "
                        "cp_softcap.make_hybrid_groups(cp_group, a2a_size)")
    if not isinstance(group, (int, float, str)) and not (dist.is_available() and dist.is_initialized()):
        return              # resolve_groups: torch.distributed is not initialised
    hint = (f" (options are keyword arguments: softcap={group!r}?)"
            if isinstance(group, (int, float)) and not isinstance(group, bool) else "")
    raise TypeError(f"group={group!r} ({type(group).__name__}) is not a process group: pass a "
                    "torch.distributed ProcessGroup, a DeviceMesh, or None for one device" + hint)


def _non_member(group) -> bool:
    """What dist.new_group returns on a rank outside the group (an int): check_member says so."""
    return (dist.is_available() and isinstance(group, int)
            and group == dist.GroupMember.NON_GROUP_MEMBER)


def is_group(group) -> bool:
    """A torch.distributed ProcessGroup."""
    return dist.is_available() and isinstance(group, dist.ProcessGroup)


def is_mesh(group) -> bool:
    """A DeviceMesh (the one place that imports its type: torch builds without it have none)."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover
        return False
    return isinstance(group, DeviceMesh)


def _as_process_group(group, comm: str):
    """A 1-D DeviceMesh stands for its process group (2-D meshes are for comm='a2a+p2p')."""
    if is_mesh(group):
        if group.ndim != 1:
            raise ValueError(f"a {group.ndim}-D DeviceMesh needs comm='a2a+p2p'; pass mesh['cp'] for comm={comm!r}")
        return group.get_group()
    return group


def check_member(cp_size: int) -> None:
    """ValueError unless this rank is a member of the CP group (cp_size from resolve_groups)."""
    if cp_size < 1:        # get_world_size(group) is -1 on a rank outside `group`
        me = dist.get_rank() if dist.is_available() and dist.is_initialized() else "?"
        raise ValueError(f"global rank {me} is not a member of the process group passed as the CP "
                         f"group (its size seen from here is {cp_size}); pass the CP group this rank "
                         "belongs to (e.g. mesh['cp'] of a DeviceMesh) or None for one device")
