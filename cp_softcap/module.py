"""CPAttention (nn.Module) and cp_attention (functional): context-parallel softcapped attention
on local zigzag shards. A group of size 1 or None runs the single-device path."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .api import attention


def _as_group(group, comm: str):
    """A 1-D DeviceMesh stands for its process group (2-D meshes are for comm='a2a+p2p')."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover
        return group
    if isinstance(group, DeviceMesh) and comm != "a2a+p2p":
        if group.ndim != 1:
            raise ValueError(f"a {group.ndim}-D DeviceMesh needs comm='a2a+p2p'; pass mesh['cp'] for comm={comm!r}")
        return group.get_group()
    return group


def _group_size(group) -> int:
    if group is None:
        return 1
    if isinstance(group, (tuple, list)):
        raise ValueError("a pair of groups is only meaningful with comm='a2a+p2p'")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("cp_attention got a process group but torch.distributed is not initialised; "
                           "call torch.distributed.init_process_group first (torchrun sets the env), "
                           "or pass group=None for single-device attention")
    return dist.get_world_size(group)


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *,
                 softcap: Optional[float] = None, causal: bool = True, window=None,
                 scale: Optional[float] = None, comm: str = "ring", backend: str = "auto"
                 ) -> torch.Tensor:
    """Context-parallel attention on this rank's shards.

    q [B, S/cp, Hq, D], k/v [B, S/cp, Hkv, D]: the local shards in the zigzag layout
    (cp_softcap.sharding.shard: rank r holds global chunks r and 2cp-1-r of 2cp equal chunks).
    Returns this rank's shard of the output, [B, S/cp, Hq, Dv], in q's dtype. Differentiable.
    softcap/window/scale/causal mean what they mean for cps.attention, in GLOBAL positions.
    comm: "ring" | "all_gather" | "a2a" | "a2a+p2p" | "auto". group None or of size 1: one device.
    """
    group = _as_group(group, comm)
    if comm != "a2a+p2p" and _group_size(group) == 1:
        return attention(q, k, v, softcap=softcap, causal=causal, window=window, scale=scale,
                         backend=backend)
    from .cp.dispatch import run_cp
    return run_cp(q, k, v, group, softcap=softcap, causal=causal, window=window, scale=scale,
                  comm=comm, backend=backend)


class CPAttention(torch.nn.Module):
    """Parameter-free attention layer for model code: `CPAttention(cp_group, softcap=50.0)`.

    forward(q, k, v) takes the local shards [B, S/cp, H, D] (GQA allowed) and returns the local
    output shard [B, S/cp, Hq, Dv]. See cp_attention for the layout contract.
    """

    def __init__(self, cp_group=None, softcap: Optional[float] = None, *, causal: bool = True,
                 window=None, scale: Optional[float] = None, comm: str = "ring",
                 backend: str = "auto"):
        super().__init__()
        from .spec import COMM_TYPES, normalize_softcap, normalize_window
        self.softcap = normalize_softcap(softcap)
        self.window = normalize_window(window, causal)
        if comm not in COMM_TYPES:
            raise ValueError(f"comm must be one of {COMM_TYPES}, got {comm!r}")
        self.cp_group, self.causal, self.scale = cp_group, causal, scale
        self.comm, self.backend = comm, backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return cp_attention(q, k, v, self.cp_group, softcap=self.softcap, causal=self.causal,
                            window=self.window, scale=self.scale, comm=self.comm,
                            backend=self.backend)

    def extra_repr(self) -> str:
        return (f"softcap={self.softcap}, causal={self.causal}, window={self.window}, "
                f"scale={self.scale}, comm={self.comm!r}, backend={self.backend!r}")
