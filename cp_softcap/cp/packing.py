"""Pack K and V into one flat buffer so each exchange is a single message."""
from __future__ import annotations

from typing import Tuple

import torch


def pack(k: torch.Tensor, v: torch.Tensor, dtype=None) -> torch.Tensor:
    dtype = dtype or k.dtype
    return torch.cat([k.reshape(-1).to(dtype), v.reshape(-1).to(dtype)])


def unpack(buf: torch.Tensor, k_shape, v_shape) -> Tuple[torch.Tensor, torch.Tensor]:
    nk = 1
    for n in k_shape:
        nk *= n
    return buf[:nk].view(k_shape), buf[nk:].view(v_shape)
