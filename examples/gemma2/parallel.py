"""Setup: the device, the process group and the job's one DeviceMesh (dp x cp, cp on adjacent
ranks), sliced for every group the example uses: cp for CPAttention (unflattened into ring x a2a
for a2a+p2p), dp for the token count, dp x cp flattened for the gradients. Applying AC, compile
and data parallelism (DDP or FSDP2) to the model is parallelize.py; the training step (the CP
recipe) is step.py.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

COMMS = ("ring", "all_gather", "a2a", "a2a+p2p", "auto")


@dataclass(frozen=True)
class Dist:
    """This rank's place in the dp x cp mesh; every group is a slice of the mesh.

    mesh: a DeviceMesh with dims ("dp", "cp"), or ("cp",) alone for a CP job on a subgroup (dp 1).
    """
    mesh: object

    def _size(self, dim: str) -> int:
        return self.mesh[dim].size() if dim in self.mesh.mesh_dim_names else 1

    def _rank(self, dim: str) -> int:
        return self.mesh.get_local_rank(dim) if dim in self.mesh.mesh_dim_names else 0

    dp = property(lambda self: self._size("dp"))
    cp = property(lambda self: self._size("cp"))
    dp_rank = property(lambda self: self._rank("dp"))
    cp_rank = property(lambda self: self._rank("cp"))
    world = property(lambda self: self.mesh.size())
    rank = property(lambda self: dist.get_rank())
    cp_mesh = property(lambda self: self.mesh["cp"])
    cp_group = property(lambda self: self.mesh.get_group("cp"))

    @property
    def dp_group(self):
        return self.mesh.get_group("dp") if self.dp > 1 else None

    @property
    def grad_mesh(self):
        """The ranks that share one model and sum its gradients, all of dp x cp, as a 1-D mesh
        ("dp_cp", flattened from the mesh): what DDP all-reduces over and FSDP2 shards over. Its
        process group is its own, never CPAttention's: gradients are reduced while backward
        still runs the CP collectives, and with dp 1 the cp dim spans the same ranks."""
        if self.mesh.ndim == 1:
            return self.mesh
        return self.mesh["dp", "cp"]._flatten("dp_cp", backend_override=dist.get_backend())

    grad_group = property(lambda self: self.grad_mesh.get_group())

    @property
    def device(self) -> torch.device:
        if self.mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.mesh.device_type)


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
    alone = "RANK" not in os.environ      # plain `python train.py`: a world of one
    if alone:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev, backend = pick_device(local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", 1)), device)
    if not dist.is_initialized():
        # a world of one meets in memory: a free TCP port looked up first can be taken by
        # another process before the store binds it (seen with parallel test runs)
        store = dict(store=dist.HashStore(), rank=0, world_size=1) if alone else _elastic_store_kwargs()
        dist.init_process_group(backend, device_id=dev if backend == "nccl" else None, **store)
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
    """The job's DeviceMesh, dp x cp over the initialised world (cp on adjacent ranks), built
    once: every group the example needs is a slice of it."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    cp = world if cp is None else cp
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1 or world % cp != 0:
        raise ValueError(f"--cp {cp} must be a positive divisor of the world size {world} "
                         f"(dp = world / cp); e.g. --cp {world} or --cp 1")
    return Dist(init_device_mesh(dev.type, (world // cp, cp), mesh_dim_names=("dp", "cp")))


def subgroup_dist(group, device_type: str = "cpu") -> Dist:
    """A CP-only Dist over an existing process group (dp 1): a job that runs on some ranks."""
    from torch.distributed.device_mesh import DeviceMesh
    return Dist(DeviceMesh.from_group(group, device_type, mesh_dim_names=("cp",)))


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
    a2a+p2p the pair (a2a group of `a2a_size` consecutive CP ranks, ring group across them), the
    mesh's cp dim unflattened into ("ring", "a2a"), so that CP rank = ring rank * a2a_size + a2a
    rank, the rank the zigzag shards use. Collective for a2a+p2p (every rank must call it). A
    ("cp",) mesh made from a group (subgroup_dist) is split by cp_softcap.make_hybrid_groups."""
    check_comm(comm, d.cp, num_heads, a2a_size)
    if comm != "a2a+p2p":
        return d.cp_group
    if d.mesh.ndim == 1:
        from cp_softcap import make_hybrid_groups
        return make_hybrid_groups(d.cp_group, a2a_size)
    split = d.cp_mesh._unflatten(0, (d.cp // a2a_size, a2a_size), ("ring", "a2a"))
    return split.get_group("a2a"), split.get_group("ring")
