"""The training step under context parallelism (the CP recipe).

All cp ranks of one dp group read the same batch; each keeps its zigzag shard of ids, labels and
position ids. The loss on each rank is its local cross-entropy SUM divided by the number of valid
tokens of the whole step (counted before sharding, summed over dp); gradients are then SUMMED
over dp x cp, which makes the result equal the single-process loss and gradients. The sum is
made during backward by what parallelize.py applied to the model: DDP (apply_ddp) or FSDP2
(apply_fsdp).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

import cp_softcap as cps

from .parallel import Dist


def labels_of(tokens: torch.Tensor, pad_id: Optional[int] = None) -> torch.Tensor:
    """tokens [B, S+1] -> next-token labels [B, S], pad_id masked to -100."""
    lab = tokens[:, 1:]
    return lab if pad_id is None else lab.masked_fill(lab == pad_id, -100)


def shard_batch(tokens: torch.Tensor, cp: int, cp_rank: int, pad_id: Optional[int] = None):
    """tokens [B, S+1] (the same on all cp ranks) -> (inputs, labels, positions), each [B, S/cp]:
    labels are shifted on the full sequence first (labels equal to pad_id become -100), then all
    three get the same zigzag shard."""
    inp, lab = tokens[:, :-1], labels_of(tokens, pad_id)
    pos = torch.arange(inp.shape[1], device=tokens.device).expand_as(inp)
    cps.sharding.check_divisible(inp.shape[1], cp, what="--seq-len", rank=cp_rank)
    return tuple(cps.sharding.shard(t, cp, cp_rank) for t in (inp, lab, pos))


def count_valid(labels_full: torch.Tensor, d: Dist) -> torch.Tensor:
    """Valid (!= -100) labels of the whole step: this dp group's full batch, summed over dp."""
    n = (labels_full != -100).sum().to(d.device, torch.float64)
    if d.dp > 1:
        dist.all_reduce(n, group=d.dp_group)
    return n


def loss_and_grads(model, tokens: torch.Tensor, d: Dist, autocast=None,
                   pad_id: Optional[int] = None) -> torch.Tensor:
    """One step's forward+backward with the CP recipe. tokens [B, S+1]: this dp group's batch
    (pad_id tokens are not predicted). Leaves the SUMMED (dp x cp) gradients in .grad; returns
    the global mean loss over valid tokens (0-d, the same on every rank)."""
    inp, lab, pos = (t.to(d.device) for t in shard_batch(tokens, d.cp, d.cp_rank, pad_id))
    return _step(model, inp, pos, lab, count_valid(labels_of(tokens, pad_id), d), d, autocast)


def packed_loss_and_grads(model, inp: torch.Tensor, lab: torch.Tensor, cu_seqlens, d: Dist,
                          autocast=None) -> torch.Tensor:
    """loss_and_grads for one packed row (--pack): inp, lab [1, S] from data.get_packed_batch (the
    same on all cp ranks), cu_seqlens its GLOBAL document boundaries (or their PackedLayout,
    e.g. one balanced for several layer windows). Ids, labels (padded with
    -100) and document-relative positions get the packed layout's shard, every attention layer
    gets cu_seqlens, and the loss is divided by the valid labels of the whole step."""
    shard = lambda t, pad: cps.sharding.shard(t, d.cp, d.cp_rank, cu_seqlens=cu_seqlens,  # noqa: E731
                                              pad_value=pad).to(d.device)
    ids, labels = shard(inp, 0), shard(lab, -100)
    pos = cps.sharding.positions(inp.shape[1], d.cp, d.cp_rank, d.device, cu_seqlens=cu_seqlens)[None]
    if isinstance(cu_seqlens, (list, tuple)):
        # a tensor: its values are data to a compiled layer (a list would be constants there,
        # recompiling for every new number of documents)
        cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int64)
    return _step(model, ids, pos, labels, count_valid(lab, d), d, autocast, cu_seqlens=cu_seqlens)


def _step(model, ids, pos, labels, n_valid, d: Dist, autocast, **model_kw) -> torch.Tensor:
    """Forward and backward of this rank's shard with the loss over the step's valid labels (the
    model's DDP or FSDP2 sums the gradients over dp x cp during backward); returns the step's
    global loss."""
    group = d.grad_group
    if dist.get_world_size(group) > 1 and not _reduces_gradients(model):
        raise ValueError(f"the model's gradients would not be summed over the {d.dp} x {d.cp} "
                         "dp x cp ranks: apply parallelize.apply_ddp (or apply_fsdp) to it first, "
                         "as train.py's build does")
    ctx = autocast if autocast is not None else torch.autocast(d.device.type, enabled=False)
    with ctx:
        loss = model(ids, pos, labels=labels, **model_kw) / n_valid.to(torch.float32)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    return total


def _reduces_gradients(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    from .parallelize import is_replicated
    return isinstance(model, FSDPModule) or is_replicated(model)
