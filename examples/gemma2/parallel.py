"""Process groups and the context-parallel training recipe (see docs: gemma2.md).

Ranks form a dp x cp DeviceMesh with cp on adjacent ranks. All cp ranks of one dp group read the
same batch; each keeps its zigzag shard of ids, labels and position ids. The loss on each rank is
its local cross-entropy SUM divided by the number of valid tokens of the whole step (counted
before sharding, summed over dp); gradients are then SUMMED over dp x cp, which makes the result
equal the single-process loss and gradients.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from cp_softcap import sharding
from cp_softcap.spec import COMM_TYPES


@dataclass
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str
    dp: int
    cp: int
    dp_rank: int
    cp_rank: int
    mesh: object          # DeviceMesh ("dp", "cp")
    dp_group: object
    cp_group: object
    grad_group: object = None   # the dp x cp ranks that share one model (None = the whole world)
    fsdp: bool = False          # parameters sharded by FSDP2 (which then sums the gradients)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_device(local_rank: int, local_world: int, want: str = "auto"):
    """(device, backend): NCCL on this rank's GPU when every local rank can have one, else gloo on
    CPU. want: "auto" | "cpu" | "cuda"."""
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if want not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, got {want!r}")
    if want == "cuda" and n_gpu < local_world:
        raise RuntimeError(f"--device cuda with {local_world} ranks on this node but {n_gpu} GPU(s); "
                           f"use --nproc-per-node {max(n_gpu, 1)} or --device cpu")
    if want != "cpu" and n_gpu >= local_world and n_gpu > 0:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def init(cp: Optional[int] = None, device: str = "auto") -> Dist:
    """Initialise torch.distributed from torchrun's env (or as a 1-rank world when run plainly)
    and build the dp x cp mesh. cp None = all ranks do context parallelism (dp = 1)."""
    if "RANK" not in os.environ:      # plain `python train.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev, backend = pick_device(local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", 1)), device)
    if not dist.is_initialized():
        dist.init_process_group(backend, device_id=dev if backend == "nccl" else None,
                                **_elastic_store_kwargs())
    return make_dist(cp, dev)


def _elastic_store_kwargs() -> dict:
    """Under torchrun, workers share the agent's TCPStore, and torch (2.13) reuses it across
    `--max-restarts` attempts without a per-attempt prefix: restarted workers read the killed
    workers' gloo/NCCL addresses and fail with 'Connection refused'. Namespace the store by the
    attempt (TORCHELASTIC_RESTART_COUNT). Empty (plain env:// init) outside torchrun."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    from datetime import timedelta
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(minutes=10))
    return dict(store=dist.PrefixStore(f"attempt-{attempt}", store), rank=int(os.environ["RANK"]),
                world_size=int(os.environ["WORLD_SIZE"]))


def make_dist(cp: Optional[int], dev: torch.device) -> Dist:
    """The dp x cp DeviceMesh over the initialised world (cp on adjacent ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    cp = world if cp is None else cp
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1 or world % cp != 0:
        raise ValueError(f"--cp {cp} must be a positive divisor of the world size {world} "
                         f"(dp = world / cp); e.g. --cp {world} or --cp 1")
    mesh = init_device_mesh(dev.type, (world // cp, cp), mesh_dim_names=("dp", "cp"))
    return Dist(rank=rank, world=world, local_rank=int(os.environ.get("LOCAL_RANK", 0)), device=dev,
                backend=dist.get_backend(), dp=world // cp, cp=cp, dp_rank=mesh.get_local_rank("dp"),
                cp_rank=mesh.get_local_rank("cp"), mesh=mesh, dp_group=mesh.get_group("dp"),
                cp_group=mesh.get_group("cp"))


COMMS = COMM_TYPES      # ring, all_gather, a2a, a2a+p2p, auto


def check_comm(comm: str, cp: int, num_heads: int, a2a_size: Optional[int] = None) -> None:
    """Raise ValueError, saying what to use instead, when `comm` cannot run this cp and head
    count: a2a splits the query heads over all cp ranks (Hq % cp == 0; KV heads are replicated
    as needed), a2a+p2p over `a2a_size` ranks (a divisor of cp and of Hq) with a ring across."""
    if comm not in COMMS:
        raise ValueError(f"--comm {comm!r}: choose one of {', '.join(COMMS)}")
    ok = [a for a in range(1, cp + 1) if cp % a == 0 and num_heads % a == 0]
    if comm != "a2a+p2p":
        if a2a_size is not None:
            raise ValueError(f"--a2a-size is only for --comm a2a+p2p (got --comm {comm})")
        if comm == "a2a" and num_heads % cp:
            raise ValueError(f"--comm a2a splits the {num_heads} query heads over cp={cp} ranks, which "
                             f"does not divide them; use a --cp that divides {num_heads}, --comm a2a+p2p "
                             f"--a2a-size {max(ok)}, or --comm ring / all_gather / auto")
        return
    if a2a_size is None:
        raise ValueError(f"--comm a2a+p2p needs --a2a-size N: the all-to-all group size, a divisor of "
                         f"cp={cp} and of the {num_heads} query heads ({', '.join(map(str, ok))})")
    if isinstance(a2a_size, bool) or not isinstance(a2a_size, int) or a2a_size < 1 \
            or cp % a2a_size or num_heads % a2a_size:
        raise ValueError(f"--a2a-size {a2a_size} must divide both cp={cp} and the {num_heads} query "
                         f"heads; use one of {', '.join(map(str, ok))}")


def attention_group(d: Dist, comm: str, num_heads: int, a2a_size: Optional[int] = None):
    """The group argument CPAttention gets for `comm` (after check_comm): d.cp_group, or for
    a2a+p2p the pair (a2a group of `a2a_size` consecutive CP ranks, ring group across them).
    Collective for a2a+p2p (every rank must call it). With dp = 1 the pair comes from
    cp_softcap.make_hybrid_groups; with dp > 1 from a (dp, ring, a2a) DeviceMesh, because
    make_hybrid_groups splits one CP group and each dp replica has its own. Either way CP rank
    = ring rank * a2a_size + a2a rank, the rank the zigzag shards use."""
    check_comm(comm, d.cp, num_heads, a2a_size)
    if comm != "a2a+p2p":
        return d.cp_group
    if d.cp == d.world:
        from cp_softcap import make_hybrid_groups
        return make_hybrid_groups(d.cp_group, a2a_size)
    if d.dp * d.cp != d.world:
        raise ValueError(f"a2a+p2p groups need dp x cp = world ({d.dp} x {d.cp} != {d.world})")
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(d.device.type, (d.dp, d.cp // a2a_size, a2a_size),
                            mesh_dim_names=("dp", "ring", "a2a"))
    return mesh.get_group("a2a"), mesh.get_group("ring")


def shard_model(model, d: Dist) -> None:
    """FSDP2 over all dp x cp ranks (each decoder layer, then the root): parameters, gradients and
    optimizer state sharded. Gradients are SUMMED, not averaged, as the CP recipe needs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh(d.device.type, (d.world,), mesh_dim_names=("fsdp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)    # gloo has no pre-divided reduce-scatter
    d.fsdp = True


def shard_batch(tokens: torch.Tensor, cp: int, cp_rank: int, pad_id: Optional[int] = None):
    """tokens [B, S+1] (the same on all cp ranks) -> (inputs, labels, positions), each [B, S/cp]:
    labels are shifted on the full sequence first (labels equal to pad_id become -100), then all
    three get the same zigzag shard."""
    inp, lab = tokens[:, :-1], labels_of(tokens, pad_id)
    pos = torch.arange(inp.shape[1], device=tokens.device).expand_as(inp)
    sharding.check_divisible(inp.shape[1], cp, what="--seq-len", rank=cp_rank)
    return (sharding.shard(inp, cp, cp_rank), sharding.shard(lab, cp, cp_rank),
            sharding.shard(pos, cp, cp_rank))


def labels_of(tokens: torch.Tensor, pad_id: Optional[int] = None) -> torch.Tensor:
    """tokens [B, S+1] -> next-token labels [B, S], pad_id masked to -100."""
    lab = tokens[:, 1:]
    return lab if pad_id is None else lab.masked_fill(lab == pad_id, -100)


def count_valid(labels_full: torch.Tensor, d: Dist) -> torch.Tensor:
    """Valid (!= -100) labels of the whole step: this dp group's full batch, summed over dp."""
    n = (labels_full != -100).sum().to(d.device, torch.float64)
    if d.dp > 1:
        dist.all_reduce(n, group=d.dp_group)
    return n


def sum_grads(params, group=None) -> None:
    """SUM every gradient over `group` (default: the whole dp x cp world), in one flat buffer."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def loss_and_grads(model, tokens: torch.Tensor, d: Dist, autocast=None,
                   pad_id: Optional[int] = None) -> torch.Tensor:
    """One step's forward+backward with the CP recipe. tokens [B, S+1]: this dp group's batch
    (pad_id tokens are not predicted). Leaves the SUMMED (dp x cp) gradients in .grad; returns
    the global mean loss over valid tokens (a 0-d tensor, the same on every rank)."""
    from .model import loss_sum

    inp, lab, pos = (t.to(d.device) for t in shard_batch(tokens, d.cp, d.cp_rank, pad_id))
    n_valid = count_valid(labels_of(tokens, pad_id), d)
    ctx = autocast if autocast is not None else torch.autocast(d.device.type, enabled=False)
    with ctx:
        logits = model(inp, pos)
    loss = loss_sum(logits, lab) / n_valid.to(torch.float32)
    loss.backward()
    if not d.fsdp:
        sum_grads([p for p in model.parameters()], d.grad_group)
    total = loss.detach().clone()
    dist.all_reduce(total, group=d.grad_group)
    return total
