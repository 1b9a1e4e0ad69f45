"""Fail fast instead of hanging: on the first call per (group, local signature), every rank
exchanges a small vector describing its call and raises, on every rank, naming the ranks and
values that differ. A rank that never arrives becomes a timeout error (comm.wait).

Checking only first calls leaves one gap: ranks that diverge into signatures each of them has
already used (rank 0 calls with softcap 5 while rank 1 calls with 50, both seen before) are not
compared; the call then runs with different options per rank, or, with different sizes, gloo
aborts the receiving process. CP_SOFTCAP_CHECK_EVERY_CALL=1 exchanges the signature on every
call (one small all_gather and a host sync per attention call), which catches that too."""
from __future__ import annotations

from typing import Dict, Tuple

import torch
import torch.distributed as dist

from ..comm import wait
from ..settings import check_every_call
from ..spec import COMM_TYPES, AttnSpec

FIELDS = ("batch", "local seq len", "query heads", "kv heads", "head dim", "v head dim",
          "dtype", "device type", "softcap", "window left", "window right", "causal", "scale",
          "comm", "backend", "kv seq len", "selected kernel", "ring block keys")
_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
_BACKENDS = ("auto", "fa2", "fa3", "fa4", "flex", "sdpa", "torch")
_CHECKED: Dict[Tuple, bool] = {}


def _encode(q, k, v, spec: AttnSpec, backend: str, kernel: str, keys: int) -> Tuple[float, ...]:
    left, right = spec.window
    return (q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3],
            _DTYPE_CODES.get(q.dtype, -1), 1 if q.is_cuda else 0, spec.softcap or 0.0,
            -1 if left is None else left, -1 if right is None else right, float(spec.causal),
            spec.scale, COMM_TYPES.index(spec.comm),
            _BACKENDS.index(backend) if backend in _BACKENDS else -1, k.shape[1],
            _BACKENDS.index(kernel) if kernel in _BACKENDS else -1, keys)


def _decode(field: str, value: float):
    if field == "dtype":
        return {c: str(d).replace("torch.", "") for d, c in _DTYPE_CODES.items()}.get(int(value), "?")
    if field == "comm":
        return COMM_TYPES[int(value)]
    if field == "backend":
        return _BACKENDS[int(value)] if value >= 0 else "?"
    if field == "selected kernel":
        return _BACKENDS[int(value)] if value >= 0 else "none (no kernel can serve the call there)"
    if field == "ring block keys":
        return int(value) if value >= 0 else "invalid CP_SOFTCAP_RING_BLOCK_KEYS"
    if field == "device type":
        return "cuda" if value else "cpu"
    if field in ("window left", "window right"):
        return None if value < 0 else int(value)
    if field == "softcap":
        return None if value == 0 else value
    return value if field == "scale" else int(value)


def check_signature(group, q, k, v, spec: AttnSpec, backend: str, kernel: str, keys: int) -> None:
    """Raise ValueError on every rank if the ranks of `group` disagree on the call, including
    the kernel each selected ("none" where selection failed) and the ring's block size (-1 where
    CP_SOFTCAP_RING_BLOCK_KEYS is invalid): both size the ring's messages and the kernel steers
    comm='auto', so ranks that differ would otherwise hang or fail one by one."""
    local = _encode(q, k, v, spec, backend, kernel, keys)
    key = (id(group), local)
    if key in _CHECKED and not check_every_call():
        return
    device = q.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    mine = torch.tensor(local, dtype=torch.float64, device=device)
    cp = dist.get_world_size(group)
    everyone = [torch.empty_like(mine) for _ in range(cp)]
    wait(dist.all_gather(everyone, mine, group=group, async_op=True), "the CP call-signature check", group)
    table = torch.stack(everyone).cpu()
    diffs = []
    for col, field in enumerate(FIELDS):
        values = table[:, col]
        if not torch.all(values == values[0]):
            per_rank = ", ".join(f"rank {r}: {_decode(field, values[r].item())}" for r in range(cp))
            diffs.append(f"{field} differs ({per_rank})")
    if diffs:
        raise ValueError(f"cp_softcap: the ranks of the CP group called attention differently "
                         f"(seen on rank {dist.get_rank(group)}): " + "; ".join(diffs) +
                         ". Every CP rank must pass shards of the same shape, dtype and options, and select the "
                         "same kernel (same packages installed; or force one with backend=).")
    _CHECKED[key] = True
