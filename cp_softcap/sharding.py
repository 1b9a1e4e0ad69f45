"""The layout contract shared by every comm type (zigzag, load-balanced for causal attention).

The global sequence of length S is split into 2*cp equal chunks; rank r holds chunks r and
2cp-1-r, concatenated along the sequence dim. This holds for causal and non-causal attention,
and for every comm type, so layers with different comm types can share the same shards.

Packed documents (`cu_seqlens=`, docs/packing.md): the stream is padded at its end to
`packed_len(S, cp)` and cut into equal chunks that ranks hold in global order, balanced by
attention area (cp_softcap.documents). Every function here takes the same `cu_seqlens` (a list,
a 1-D integer tensor, or a PackedLayout) and then uses that layout; without it, zigzag.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from .documents import PackedLayout, packed_layout, padded_len
from .memo import TensorMemo
from .spec import check_zigzag_length, fits_zigzag  # noqa: F401 (fits_zigzag: public here)


def check_divisible(seq_len: int, cp: int, *, what: str = "sequence length", rank=None) -> None:
    """Raise unless a global length of `seq_len` splits into 2*cp equal zigzag chunks."""
    check_zigzag_length(seq_len, cp, what=what, where="" if rank is None else f"rank {rank}")


def local_chunks(cp: int, rank: int) -> tuple:
    """The two global chunk indices rank `rank` holds: (rank, 2cp-1-rank)."""
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is outside the CP group of size {cp}")
    return rank, 2 * cp - 1 - rank


def shard(x: torch.Tensor, cp: int, rank: int, dim: int = 1, *, cu_seqlens=None,
          pad_value=0) -> torch.Tensor:
    """Global [.., S, ..] -> this rank's [.., S/cp, ..] (chunks rank and 2cp-1-rank). `dim` is
    the sequence dim: 1, the S of attention's [B, S, H, D] and of token ids [B, S].

    With cu_seqlens (packed documents): this rank's [.., packed_len(S, cp) / cp, ..] in the
    packed layout; x is first padded at its end with `pad_value` (use -100 for labels)."""
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"shard: x has shape {tuple(x.shape)}, which has no dim {dim} to split (the "
                         "sequence dim, 1 by default for [B, S, ...]); pass dim=0 for a 1-D tensor")
    if cu_seqlens is not None:
        layout = layout_for(cu_seqlens, x.shape[dim], cp, rank=rank)
        x = pad_to_multiple(x, layout.seq_len, dim=dim, value=pad_value)   # to exactly seq_len
        return torch.cat([x.narrow(dim, g0, g1 - g0) for g0, g1, _ in layout.runs(rank)], dim=dim)
    check_divisible(x.shape[dim], cp, rank=rank)
    chunks = x.chunk(2 * cp, dim=dim)
    a, b = local_chunks(cp, rank)
    return torch.cat([chunks[a], chunks[b]], dim=dim)


def unshard(shards: Sequence[torch.Tensor], dim: int = 1, *, cu_seqlens=None,
            seq_len: Optional[int] = None) -> torch.Tensor:
    """Inverse of shard: the list of all ranks' shards (in rank order) -> the global tensor.

    With cu_seqlens: the padded packed stream [.., packed_len(S, cp), ..], or its first
    `seq_len` tokens when given (the length before shard padded it)."""
    cp = len(shards)
    if cp == 0:
        raise ValueError("unshard needs at least one shard (the list of every rank's shard, in rank order)")
    if cu_seqlens is not None:
        return _unshard_packed(shards, dim, cu_seqlens, seq_len)
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


def positions(seq_len: int, cp: int, rank: int, device=None, *, cu_seqlens=None) -> torch.Tensor:
    """Global position ids [S/cp] of this rank's tokens (feed them to RoPE).

    With cu_seqlens: DOCUMENT-RELATIVE positions [packed_len(S, cp) / cp] (0 at each document's
    first token, as padding-free collators emit; 0 for padding tokens)."""
    if cu_seqlens is not None:
        return layout_for(cu_seqlens, seq_len, cp, rank=rank).positions(rank, device)
    check_divisible(seq_len, cp, rank=rank)
    return shard(torch.arange(seq_len, device=device), cp, rank, dim=0)


_CHECKED = TensorMemo()


def check_positions(position_ids: torch.Tensor, local_len: int, cp: int, rank: int, *,
                    cu_seqlens=None) -> None:
    """Raise ValueError unless position_ids [..., local_len] (every row) are positions(local_len
    * cp, cp, rank, cu_seqlens=): the positions the attention masks by and RoPE rotates with.
    cu_seqlens: the GLOBAL boundaries (a tuple of ints or a PackedLayout; a list or tensor is
    read again at every call) or None for the zigzag layout. Every layer of one forward passes
    the same tensor: it is read once (memo.TensorMemo)."""
    if not isinstance(cu_seqlens, (type(None), tuple, PackedLayout)):
        _check_positions(position_ids, local_len, cp, rank, cu_seqlens)
        return
    _CHECKED.get(position_ids, (local_len, cp, rank, cu_seqlens),
                 lambda: _check_positions(position_ids, local_len, cp, rank, cu_seqlens))


def _check_positions(position_ids, local_len, cp, rank, cu_seqlens) -> None:
    pos = position_ids.reshape(-1, position_ids.shape[-1])
    expected = positions(local_len * cp, cp, rank, device=position_ids.device, cu_seqlens=cu_seqlens)
    if not (pos.shape[-1] == local_len == expected.shape[-1] and bool((pos == expected).all())):
        what = ("" if cu_seqlens is None else ", cu_seqlens=cu_global") + ")"
        raise ValueError(
            f"rank {rank}: position_ids {tuple(position_ids.shape)} (first row starts "
            f"{pos[0, :4].tolist()}) are not cp_softcap.sharding.positions({local_len * cp}, "
            f"cp={cp}, rank={rank}{what} for this rank's {local_len} tokens; cp_softcap masks by "
            "position and RoPE needs them. Under CP pass "
            "position_ids=cp_softcap.sharding.positions(S, cp, rank)[None] with the zigzag-sharded "
            "input_ids; for packed documents pass the GLOBAL boundaries too: model(..., "
            "cu_seqlens=cu_global, position_ids=positions(S, cp, rank, cu_seqlens=cu_global)[None]), "
            "with the shards from cp_softcap.sharding.shard(..., cu_seqlens=cu_global).")


def gather(x_local: torch.Tensor, group=None, dim: int = 1, *, cu_seqlens=None) -> torch.Tensor:
    """All ranks' shards -> the global tensor on every rank (no autograd; for logging/tests)."""
    cp = dist.get_world_size(group)
    parts = [torch.empty_like(x_local) for _ in range(cp)]
    dist.all_gather(parts, x_local.contiguous(), group=group)
    return unshard(parts, dim=dim, cu_seqlens=cu_seqlens)


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


# --------------------------------------------------------------------------- packed documents

def packed_len(seq_len: int, cp: int) -> int:
    """Length of the padded stream the packed layout shards: seq_len rounded up to a multiple of
    16 * cp (seq_len itself for cp = 1). The padding sits at the END of the stream, after the
    last document: it is in no document (out 0, LSE -inf, zero gradients). Fewer than 16 * cp
    tokens: 0.1 % of a 128K stream at cp 8."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp must be a positive int, got {cp!r}")
    return padded_len(seq_len, cp)


def layout_for(cu_seqlens, seq_len: int, cp: int, *, rank=None) -> PackedLayout:
    """The packed layout for document boundaries `cu_seqlens` (list, 1-D integer tensor, or a
    PackedLayout from cp_softcap.documents.packed_layout, e.g. one balanced for a window) of a
    stream of seq_len tokens (before or after padding) over cp ranks. Balanced for causal
    attention unless a PackedLayout says otherwise."""
    if isinstance(cu_seqlens, PackedLayout):
        layout = cu_seqlens
        if layout.cp != cp or packed_len(seq_len, cp) != layout.seq_len or seq_len < layout.cu_seqlens[-1]:
            where = "" if rank is None else f" on rank {rank}"
            raise ValueError(f"the PackedLayout was built for cp={layout.cp} and a stream of "
                             f"{layout.seq_len} padded tokens, but this call has cp={cp} and "
                             f"{seq_len} tokens{where}; build the layout with the same cp and length")
        return layout
    return packed_layout(cu_seqlens, seq_len, cp, rank=rank)


def _unshard_packed(shards, dim: int, cu_seqlens, seq_len: Optional[int]) -> torch.Tensor:
    cp = len(shards)
    n = shards[0].shape[dim]
    for r, s in enumerate(shards):
        if s.shape[dim] != n:
            raise ValueError(f"shard of rank {r} has {s.shape[dim]} tokens along dim {dim} but rank 0's "
                             f"has {n}; every rank's packed shard has the same length")
    layout = layout_for(cu_seqlens, n * cp, cp)
    if layout.local_len != n:
        raise ValueError(f"shards have {n} tokens along dim {dim}, but the packed layout of these "
                         f"cu_seqlens over cp={cp} gives {layout.local_len} per rank "
                         "(did these come from cp_softcap.sharding.shard with the same cu_seqlens?)")
    pieces = []
    for r, s in enumerate(shards):
        pieces += [(g0, s.narrow(dim, local, g1 - g0)) for g0, g1, local in layout.runs(r)]
    full = torch.cat([p for _, p in sorted(pieces, key=lambda t: t[0])], dim=dim)
    if seq_len is None:
        return full
    valid = isinstance(seq_len, int) and not isinstance(seq_len, bool)
    if not valid or not layout.cu_seqlens[-1] <= seq_len <= layout.seq_len:
        raise ValueError(f"seq_len={seq_len!r} must be an int between the last document end "
                         f"{layout.cu_seqlens[-1]} and the padded length {layout.seq_len}")
    return full.narrow(dim, 0, seq_len)
