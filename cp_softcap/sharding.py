"""The layout contract shared by every comm type (zigzag, load-balanced for causal attention).

The global sequence of length S is split into 2*cp equal chunks; rank r holds chunks r and
2cp-1-r, concatenated along the sequence dim. This holds for causal and non-causal attention,
and for every comm type, so layers with different comm types can share the same shards.
"""
from __future__ import annotations

from typing import List, Sequence

import torch
import torch.distributed as dist


def check_divisible(seq_len: int, cp: int, *, what: str = "sequence length", rank=None) -> None:
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp must be a positive int, got {cp!r}")
    if seq_len <= 0 or seq_len % (2 * cp) != 0:
        where = f" on rank {rank}" if rank is not None else ""
        raise ValueError(f"{what} {seq_len}{where} is not a positive multiple of 2*cp={2 * cp}; "
                         f"pad with cp_softcap.sharding.pad_to_multiple(x, {2 * cp}) "
                         "(and mask the padded labels), or use comm='a2a' with heads divisible by cp")


def local_chunks(cp: int, rank: int) -> tuple:
    """The two global chunk indices rank `rank` holds: (rank, 2cp-1-rank)."""
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is outside the CP group of size {cp}")
    return rank, 2 * cp - 1 - rank


def shard(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Global [.., S, ..] -> this rank's [.., S/cp, ..] (chunks rank and 2cp-1-rank)."""
    check_divisible(x.shape[dim], cp, rank=rank)
    chunks = x.chunk(2 * cp, dim=dim)
    a, b = local_chunks(cp, rank)
    return torch.cat([chunks[a], chunks[b]], dim=dim)


def unshard(shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of shard: the list of all ranks' shards (in rank order) -> the global tensor."""
    cp = len(shards)
    if cp == 0:
        raise ValueError("unshard needs at least one shard (the list of every rank's shard, in rank order)")
    sizes = [s.shape[dim] for s in shards]
    for r, n in enumerate(sizes):
        if n != sizes[0]:
            raise ValueError(f"shard of rank {r} has {n} tokens along dim {dim} but rank 0's has "
                             f"{sizes[0]}; every rank's zigzag shard has the same length S/cp")
    if sizes[0] % 2 != 0:
        raise ValueError(f"shards have {sizes[0]} tokens along dim {dim}, which is not even: a zigzag "
                         "shard is two equal chunks (did these come from cp_softcap.sharding.shard?)")
    pieces: List[torch.Tensor] = [None] * (2 * cp)  # type: ignore[list-item]
    for r, s in enumerate(shards):
        first, second = s.chunk(2, dim=dim)
        a, b = local_chunks(cp, r)
        pieces[a], pieces[b] = first, second
    return torch.cat(pieces, dim=dim)


def positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global position ids [S/cp] of this rank's tokens (feed them to RoPE)."""
    check_divisible(seq_len, cp, rank=rank)
    return shard(torch.arange(seq_len, device=device), cp, rank, dim=0)


def gather(x_local: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """All ranks' shards -> the global tensor on every rank (no autograd; for logging/tests)."""
    cp = dist.get_world_size(group)
    parts = [torch.empty_like(x_local) for _ in range(cp)]
    dist.all_gather(parts, x_local.contiguous(), group=group)
    return unshard(parts, dim=dim)


def pad_to_multiple(x: torch.Tensor, multiple: int, dim: int = 1, value=0) -> torch.Tensor:
    """Pad `x` at the end of `dim` to a multiple of `multiple` (e.g. 2*cp) with `value`."""
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise ValueError(f"multiple must be a positive int, got {multiple!r}")
    extra = (-x.shape[dim]) % multiple
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, torch.full(shape, value, dtype=x.dtype, device=x.device)], dim=dim)
