"""Transport for the CP algorithms: async point-to-point exchange, collectives, timeouts that
turn a missing rank into an error, host staging for gloo + CUDA, byte counters, and the check
that every rank of a group makes the same call.

gloo cannot send CUDA tensors point-to-point, so when the group's backend is gloo and tensors
live on CUDA, sends copy to host first and receives land in host buffers copied back after the
wait (a debug/testing mode that lets several ranks share one GPU; NCCL is the production path).
"""
from __future__ import annotations

from collections import defaultdict
from datetime import timedelta
from typing import Dict, List, Sequence, Tuple

import hashlib

import torch
import torch.distributed as dist

from .settings import timeout_s


class ByteCounter:
    """Bytes this rank sent, per operation name. `with counting() as c:` scopes a measurement."""

    def __init__(self):
        self.sent: Dict[str, int] = defaultdict(int)

    def add(self, op: str, tensor: torch.Tensor) -> None:
        self.sent[op] += tensor.numel() * tensor.element_size()

    def total(self) -> int:
        return sum(self.sent.values())


_COUNTERS: List[ByteCounter] = []


class counting:
    def __enter__(self) -> ByteCounter:
        self.counter = ByteCounter()
        _COUNTERS.append(self.counter)
        return self.counter

    def __exit__(self, *exc):
        _COUNTERS.remove(self.counter)


def count(op: str, tensor: torch.Tensor) -> None:
    for c in _COUNTERS:
        c.add(op, tensor)


def needs_staging(group, tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and dist.get_backend(group) == "gloo"


def wait(work, op: str, group) -> None:
    """Wait for an async work item, converting a timeout into an actionable error."""
    limit = timeout_s()
    try:
        ok = work.wait(timedelta(seconds=limit))
    except RuntimeError as e:
        raise RuntimeError(_timeout_message(op, group, limit, e)) from e
    if ok is False:
        raise RuntimeError(_timeout_message(op, group, limit, "wait returned False"))


def _timeout_message(op: str, group, limit: float, cause) -> str:
    rank = dist.get_rank(group)
    return (f"cp_softcap: {op} on CP rank {rank} (global rank {dist.get_rank()}) failed or timed out "
            f"after {limit:.0f}s ({cause}). A peer rank probably died, stalled, or did not call the "
            "same attention layer; every rank of the CP group must call it in the same order with "
            "the same shapes. Raise CP_SOFTCAP_TIMEOUT if the peers are just slow.")


class Exchange:
    """One batch of point-to-point traffic: sends to peers and receives into given tensors.
    Peers are ranks within `group`. Add with send()/recv(), post with start(); after wait()
    every recv target holds its message. A target that is not contiguous, or a CUDA target
    under gloo, receives through a temporary that is copied in after the wait."""

    def __init__(self, group, op: str):
        self.group, self.op = group, op
        self.ops: list = []
        self.works: list = []
        self._copies: list = []          # (target, temporary) pairs to copy after the wait
        self._keep_alive: list = []

    def send(self, tensor: torch.Tensor, peer: int) -> "Exchange":
        buf = tensor.detach()
        buf = buf.cpu() if needs_staging(self.group, buf) else buf.contiguous()
        self._keep_alive.append(buf)
        count(self.op, buf)
        self.ops.append(dist.P2POp(dist.isend, buf, dist.get_global_rank(self.group, peer), self.group))
        return self

    def recv(self, target: torch.Tensor, peer: int) -> "Exchange":
        if needs_staging(self.group, target):
            buf = torch.empty(target.shape, dtype=target.dtype)
        elif not target.is_contiguous():
            buf = torch.empty(target.shape, dtype=target.dtype, device=target.device)
        else:
            buf = target
        if buf is not target:
            self._copies.append((target, buf))
        self.ops.append(dist.P2POp(dist.irecv, buf, dist.get_global_rank(self.group, peer), self.group))
        return self

    def start(self) -> "Exchange":
        if self.ops:
            self.works = dist.batch_isend_irecv(self.ops)
        self.ops = []
        return self

    def wait(self) -> None:
        for w in self.works:
            wait(w, self.op, self.group)
        for target, buf in self._copies:
            target.copy_(buf)
        self.works, self._copies, self._keep_alive = [], [], []


# torch >= 2.13 renamed the tensor collectives; older releases have only the old names.
# Same signatures.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather(x: torch.Tensor, group, op: str, async_op: bool = False):
    """[n] on each rank -> [cp, n] (rank order). Returns (output, work or None)."""
    cp = dist.get_world_size(group)
    flat = torch.empty(cp * x.numel(), dtype=x.dtype, device=x.device)
    out = flat.view((cp,) + tuple(x.shape))
    count_bytes(op, x, cp - 1)
    work = _all_gather_single(flat, x.contiguous().view(-1), group=group, async_op=True)
    if async_op:
        return out, work
    wait(work, op, group)
    return out, None


def reduce_scatter(x: torch.Tensor, group, op: str) -> torch.Tensor:
    """[cp, ...] summed over ranks; this rank gets slot `rank`."""
    cp = dist.get_world_size(group)
    out = torch.empty(x[0].numel(), dtype=x.dtype, device=x.device)
    count_bytes(op, x[0], cp - 1)
    wait(_reduce_scatter_single(out, x.contiguous().view(-1), group=group, async_op=True), op, group)
    return out.view(x.shape[1:])


def all_to_all(x: torch.Tensor, group, op: str) -> torch.Tensor:
    """[cp, ...]: slot j goes to rank j; returns [cp, ...] with slot j from rank j."""
    cp = dist.get_world_size(group)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    count_bytes(op, x[0], cp - 1)
    wait(dist.all_to_all_single(out, x.contiguous(), group=group, async_op=True), op, group)
    return out


def count_bytes(op: str, piece: torch.Tensor, times: int) -> None:
    """Record `times` copies of `piece` sent by this rank (collectives' algorithmic volume)."""
    for c in _COUNTERS:
        c.sent[op] += piece.numel() * piece.element_size() * times


def _code(value: str) -> float:
    """A 52-bit digest of `value`: exact in float64, so one small all_gather compares any fields."""
    return float(int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(), "big") >> 12)


def check_agreement(group, fields: Sequence[Tuple[str, str]], device, what: str) -> None:
    """Raise ValueError on every rank of `group` unless every rank passed the same `fields`
    ((name, value as text) pairs, in the same order). The message names each field that
    differs with every rank's value. One all_gather of digests; the texts travel only when
    something differs (every rank then sees the same table, so all take that path together)."""
    mine = torch.tensor([_code(value) for _, value in fields], dtype=torch.float64, device=device)
    cp = dist.get_world_size(group)
    everyone = [torch.empty_like(mine) for _ in range(cp)]
    wait(dist.all_gather(everyone, mine, group=group, async_op=True), what, group)
    table = torch.stack(everyone).cpu()
    if bool((table == table[0]).all()):
        return
    texts: list = [None] * cp
    dist.all_gather_object(texts, [value for _, value in fields], group=group)
    diffs = []
    for col, (name, _) in enumerate(fields):
        if not bool((table[:, col] == table[0, col]).all()):
            per_rank = ", ".join(f"rank {r}: {texts[r][col]}" for r in range(cp))
            diffs.append(f"{name} differs ({per_rank})")
    raise ValueError(f"cp_softcap: the ranks of the CP group called attention differently "
                     f"(seen on rank {dist.get_rank(group)}): " + "; ".join(diffs) +
                     ". Every CP rank must pass shards of the same shape, dtype and options, and "
                     "select the same kernel (same packages installed; or force one with backend=).")
