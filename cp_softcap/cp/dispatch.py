"""run_cp: validate a CP call, select the kernel, check the ranks agree, run the algorithm."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..api import spec_for
from ..selector import select
from ..spec import check_qkv
from .ring import RingAttention
from .signature import check_signature


def run_cp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *, softcap, causal, window,
           scale, comm: str, backend: str) -> torch.Tensor:
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
    check_signature(group, q, k, v, spec, backend)
    kernel = select(spec, backend).kernel
    if spec.comm == "ring":
        return RingAttention.apply(q, k, v, group, kernel, spec.scale, spec.softcap, spec.window)
    raise ValueError(f"comm={spec.comm!r} is not available yet; use comm='ring'")
