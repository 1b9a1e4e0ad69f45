"""Transport for the CP algorithms: async point-to-point exchange, collectives, timeouts that
turn a missing rank into an error, host staging for gloo + CUDA, byte counters, and the check
that every rank of a group makes the same call.

Messages of different calls never match: inside a CP call (`in_call`) every point-to-point
message is tagged with the call's sequence number, direction, signature digest and operation,
so a rank that skipped a backward, or diverged into another call, is never handed the
messages of a different call: its receives wait and fail with the timeout error below instead
of receiving mis-sized data (which gloo answers by aborting the process). gloo honours tags;
NCCL matches point-to-point messages in posting order and ignores them.

Waits on gloo, and waits whose result the host reads next (the cross-rank checks), block this
thread for at most CP_SOFTCAP_TIMEOUT and then raise naming the op and the rank; gloo
collectives carry the same timeout, so gloo ends the op too and the process can exit (gloo's
teardown of a failed op may end it with SIGABRT). Waits on CUDA
tensors over NCCL only order the current stream after the transfer and return at once: torch's
NCCL wait given a timeout blocks the host thread until the transfer ends, polling every
millisecond, so the kernels of the next ring step could not be queued while the transfer runs.
There a stalled peer is caught by NCCL's watchdog after the process group's timeout
(`init_process_group(timeout=...)`; TORCH_NCCL_BLOCKING_WAIT=1 makes the waiting thread raise
instead, at the cost of blocking waits), and the error is re-raised naming the op and the rank.
Reduce-scatter is an all-to-all plus a local sum in rank order: gloo's reduce_scatter ignores
the wait's timeout (measured, torch 2.13).

gloo cannot send CUDA tensors point-to-point, so when the group's backend is gloo and tensors
live on CUDA, sends copy to host first and receives land in host buffers copied back after the
wait (a debug/testing mode that lets several ranks share one GPU; NCCL is the production path).
"""
from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import timedelta
from typing import Dict, List, Optional, Sequence, Tuple

import hashlib
import pickle

import torch
import torch.distributed as dist
import torch._C._distributed_c10d as c10d      # AllgatherOptions: not re-exported by dist

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


@dataclass(frozen=True)
class Call:
    """One CP call as its messages name it: the per-group sequence number, the direction and
    the digest of the plan's signature (the same on every rank of a call made alike), and the
    CP_SOFTCAP_TIMEOUT its waits use (read when the forward or backward starts; None: read at
    each wait, which raises for an invalid value)."""
    seq: int
    phase: str          # "forward" | "backward"
    digest: str
    timeout: Optional[float] = None

    def tag(self, op: str) -> int:
        """A point-to-point tag for `op` in this call (31 bits: gloo's tags are C ints)."""
        key = f"{self.digest}|{self.seq}|{self.phase}|{op}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "big") >> 1

    def text(self) -> str:
        return f"{self.phase} of call {self.seq}"


_CALL: ContextVar = ContextVar("cp_softcap_call", default=None)


@contextmanager
def in_call(call: Call):
    """Tag the messages sent inside the block with `call` (see the module docstring)."""
    token = _CALL.set(call)
    try:
        yield
    finally:
        _CALL.reset(token)


def current_call() -> Optional[Call]:
    return _CALL.get()


def digest(fields: Sequence[Tuple[str, str]]) -> str:
    """A digest of (name, value) rows, equal on two ranks iff (almost surely) the rows are."""
    text = "\x1f".join(f"{n}\x1e{v}" for n, v in fields)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def on_gloo(group, device) -> bool:
    """Whether ops on `group` with tensors on `device` run on gloo: a group made with
    backend="gloo", or one made with several backends or none named (init_process_group()
    without a backend: CPU tensors go to gloo, CUDA tensors to NCCL)."""
    name = dist.get_backend(group)
    if name in ("gloo", "nccl"):
        return name == "gloo"
    try:
        return isinstance(group._get_backend(torch.device(device)), dist.ProcessGroupGloo)
    except (AttributeError, RuntimeError):
        return False


def needs_staging(group, tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and on_gloo(group, tensor.device)


def stream_ordered(group, tensor: torch.Tensor) -> bool:
    """Whether a wait for an op on `tensor` only orders the current stream (CUDA tensors over
    NCCL or another device backend) instead of blocking this thread (see the module docstring)."""
    return tensor.is_cuda and not needs_staging(group, tensor)


def wait(work, op: str, group, on: torch.Tensor, *, host: bool = False) -> None:
    """Wait for an async work item that writes `on`; host=True when this thread reads the
    result next (so a bounded, blocking wait costs nothing more). Errors and timeouts become
    an actionable error naming the op and the rank."""
    if not host and stream_ordered(group, on):
        try:
            work.wait()
        except RuntimeError as e:
            raise RuntimeError(_timeout_message(op, group, None, e)) from e
        return
    limit = _limit()
    try:
        ok = work.wait(timedelta(seconds=limit))
    except RuntimeError as e:
        raise RuntimeError(_timeout_message(op, group, limit, e)) from e
    if ok is False:
        raise RuntimeError(_timeout_message(op, group, limit, "wait returned False"))


def _limit() -> float:
    """Seconds a wait may take: the current call's timeout, else CP_SOFTCAP_TIMEOUT."""
    call = current_call()
    return call.timeout if call is not None and call.timeout is not None else timeout_s()


def _gloo_options(group, options, device):
    """`options` (a c10d options object) with the wait's timeout when ops on `group` with
    tensors on `device` run on gloo, else None.
    gloo runs a collective on the group's worker thread until the op's own timeout (by default
    the group's: 30 min for new_group), whatever the wait's; a rank that raised the timeout
    error for a stalled peer could not exit before then, nor could torchrun restart the job.
    With the timeout in the op, gloo ends it itself."""
    if not on_gloo(group, device):
        return None
    options.timeout = timedelta(seconds=_limit())
    return options


def _all_gather_list(outs: List[torch.Tensor], x: torch.Tensor, group):
    """dist.all_gather(outs, x, group, async_op=True), on gloo bounded by the wait's timeout."""
    opts = _gloo_options(group, c10d.AllgatherOptions(), x.device)
    if opts is None:
        return dist.all_gather(outs, x, group=group, async_op=True)
    return group.allgather([outs], [x], opts)


def _timeout_message(op: str, group, limit: Optional[float], cause) -> str:
    rank = dist.get_rank(group)
    call = current_call()
    where = f" in the {call.text()} on this group" if call is not None else ""
    after = "the process group's timeout" if limit is None else f"{limit:g}s"
    return (f"cp_softcap: {op}{where} on CP rank {rank} (global rank {dist.get_rank()}) failed or "
            f"timed out after {after} ({cause}). A peer rank probably died, stalled, skipped "
            "a forward or backward, or made a different call (its messages carry its own call "
            "number and signature, so they are never taken for this call's); every rank of the CP "
            "group must call the same attention layers in the same order with the same shapes and "
            "options. Raise CP_SOFTCAP_TIMEOUT (on NCCL: the process group's timeout) if the peers "
            "are just slow. After this error the "
            "group is out of step: build a new one (docs/failures.md, 'After a CP error').")


class Exchange:
    """One batch of point-to-point traffic: sends to peers and receives into given tensors.
    Peers are ranks within `group`. Add with send()/recv(), post with start(); after wait()
    every recv target holds its message. A target that is not contiguous, or a CUDA target
    under gloo, receives through a temporary that is copied in after the wait."""

    def __init__(self, group, op: str):
        self.group, self.op = group, op
        call = current_call()
        self.tag = 0 if call is None else call.tag(op)
        self.ops: list = []
        self.works: list = []
        self._on: Optional[torch.Tensor] = None   # a tensor of the exchange: decides how to wait
        self._copies: list = []          # (target, temporary) pairs to copy after the wait
        self._keep_alive: list = []

    def send(self, tensor: torch.Tensor, peer: int) -> "Exchange":
        buf = tensor.detach()
        buf = buf.cpu() if needs_staging(self.group, buf) else buf.contiguous()
        self._keep_alive.append(buf)
        self._on = buf
        count(self.op, buf)
        self.ops.append(dist.P2POp(dist.isend, buf, dist.get_global_rank(self.group, peer), self.group,
                                   self.tag))
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
        self._on = buf
        self.ops.append(dist.P2POp(dist.irecv, buf, dist.get_global_rank(self.group, peer), self.group,
                                   self.tag))
        return self

    def start(self) -> "Exchange":
        if self.ops:
            self.works = dist.batch_isend_irecv(self.ops)
        self.ops = []
        return self

    def wait(self) -> None:
        for w in self.works:
            wait(w, self.op, self.group, self._on)
        for target, buf in self._copies:
            target.copy_(buf)
        self.works, self._copies, self._keep_alive = [], [], []


# torch >= 2.13 renamed the tensor collectives; older releases have only the old names.
# Same signatures.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather(x: torch.Tensor, group, op: str, async_op: bool = False):
    """[n] on each rank -> [cp, n] (rank order). Returns (output, work or None)."""
    cp = dist.get_world_size(group)
    flat = torch.empty(cp * x.numel(), dtype=x.dtype, device=x.device)
    out = flat.view((cp,) + tuple(x.shape))
    count_bytes(op, x, cp - 1)
    mine = x.contiguous().view(-1)
    opts = _gloo_options(group, c10d.AllgatherOptions(), x.device)
    work = (_all_gather_single(flat, mine, group=group, async_op=True) if opts is None
            else group.allgather([list(flat.view(cp, -1).unbind(0))], [mine], opts))
    if async_op:
        return out, work
    wait(work, op, group, flat)
    return out, None


def reduce_scatter(x: torch.Tensor, group, op: str) -> torch.Tensor:
    """[cp, ...] summed over ranks; this rank gets slot `rank`. An all-to-all (the same bytes
    as a reduce-scatter) and a sum in rank order: deterministic, and bounded by the timeout on
    every backend."""
    parts = all_to_all(x, group, op)
    out = parts[0].clone()
    for part in parts[1:]:
        out += part
    return out


def all_to_all(x: torch.Tensor, group, op: str) -> torch.Tensor:
    """[cp, ...]: slot j goes to rank j; returns [cp, ...] with slot j from rank j."""
    cp = dist.get_world_size(group)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    count_bytes(op, x[0], cp - 1)
    opts = _gloo_options(group, dist.AllToAllOptions(), x.device)
    work = (dist.all_to_all_single(out, x.contiguous(), group=group, async_op=True) if opts is None
            else group.alltoall_base(out, x.contiguous(), [], [], opts))
    wait(work, op, group, out)
    return out


def count_bytes(op: str, piece: torch.Tensor, times: int) -> None:
    """Record `times` copies of `piece` sent by this rank (collectives' algorithmic volume)."""
    for c in _COUNTERS:
        c.sent[op] += piece.numel() * piece.element_size() * times


def _code(fields: Sequence[Tuple[str, str]]) -> float:
    """A 52-bit digest of all `fields`: exact in float64."""
    return float(int(digest(fields), 16) >> 12)


SAME_CALL_HINT = ("Every CP rank must pass shards of the same shape, dtype and options, and select "
                  "the same kernel (same packages installed; or force one with backend=).")


def check_agreement(group, fields: Sequence[Tuple[str, str]], device, what: str,
                    hint: str = SAME_CALL_HINT) -> None:
    """Raise ValueError on every rank of `group` unless every rank passed the same `fields`
    ((name, value as text) pairs). The message names each field that differs with every
    rank's value. One all_gather of one digest (the same size on every rank whatever the
    fields); the texts travel only when a digest differs (every rank then sees the same table,
    so all take that path together)."""
    mine = torch.tensor([_code(fields)], dtype=torch.float64, device=device)
    cp = dist.get_world_size(group)
    everyone = [torch.empty_like(mine) for _ in range(cp)]
    wait(_all_gather_list(everyone, mine, group), what, group, mine, host=True)
    table = torch.cat(everyone).cpu()
    if bool((table == table[0]).all()):
        return
    texts = _gather_objects(dict(fields), group, device, what)
    names = [n for n in dict.fromkeys(n for t in texts for n in t) if all(n in t for t in texts)]
    diffs = []
    for name in names:
        values = [t[name] for t in texts]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {r}: {value}" for r, value in enumerate(values))
            diffs.append(f"{name} differs ({per_rank})")
    raise ValueError(f"cp_softcap: the ranks of the CP group called attention differently "
                     f"(seen on rank {dist.get_rank(group)}): " + "; ".join(diffs or ["(digest only)"])
                     + ". " + hint)


def _gather_objects(obj, group, device, what: str) -> list:
    """Every rank's `obj` (picklable), like all_gather_object but with each wait bounded by
    the timeout: lengths first, then the pickles as uint8 tensors padded to the longest."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    cp = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(cp)]
    mine = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    wait(_all_gather_list(sizes, mine, group), what, group, mine, host=True)
    lengths = [int(t.item()) for t in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    bufs = [torch.empty_like(padded) for _ in range(cp)]
    wait(_all_gather_list(bufs, padded, group), what, group, padded, host=True)
    return [pickle.loads(b[:n].cpu().numpy().tobytes()) for b, n in zip(bufs, lengths)]
