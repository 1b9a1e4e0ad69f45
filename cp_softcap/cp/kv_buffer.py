"""K and V in one flat buffer, so each exchange of both is a single message (not to be confused
with packed documents: this is only how the two tensors travel together)."""
from __future__ import annotations

from typing import Tuple

import torch


def kv_buffer(k: torch.Tensor, v: torch.Tensor, dtype=None) -> torch.Tensor:
    """k and v flattened back to back (in `dtype`, default k's)."""
    dtype = dtype or k.dtype
    return torch.cat([k.reshape(-1).to(dtype), v.reshape(-1).to(dtype)])


def kv_views(buf: torch.Tensor, k_shape, v_shape) -> Tuple[torch.Tensor, torch.Tensor]:
    """(k, v) views of a kv_buffer of those shapes."""
    nk = 1
    for n in k_shape:
        nk *= n
    return buf[:nk].view(k_shape), buf[nk:].view(v_shape)
