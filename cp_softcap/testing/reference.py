"""Float64 reference of full (non-CP) attention, differentiable by autograd. It materialises
the whole [B, H, Sq, Sk] score matrix: for checking results, not for training.

Global window rule: key j visible from query i iff i - left <= j <= i + right, positions given by
`q_pos`/`k_pos` (default 0..S-1). Rows that see no key give out = 0 and lse = -inf.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        softcap: Optional[float] = None, causal: bool = False,
                        window=(None, None), scale: Optional[float] = None,
                        q_pos: Optional[torch.Tensor] = None, k_pos: Optional[torch.Tensor] = None,
                        dtype: torch.dtype = torch.float64) -> Tuple[torch.Tensor, torch.Tensor]:
    """q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] -> (out [B, Sq, Hq, Dv], lse [B, Hq, Sq]) in `dtype`."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    qd, kd, vd = (x.to(dtype).transpose(1, 2) for x in (q, k, v))
    kd = kd.repeat_interleave(hq // hkv, dim=1)
    vd = vd.repeat_interleave(hq // hkv, dim=1)
    s = torch.matmul(qd, kd.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    qp = torch.arange(sq, device=q.device) if q_pos is None else q_pos.to(q.device)
    kp = torch.arange(sk, device=q.device) if k_pos is None else k_pos.to(q.device)
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0
    visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if left is not None:
        visible &= kp[None, :] >= qp[:, None] - left
    if right is not None:
        visible &= kp[None, :] <= qp[:, None] + right
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    empty = ~visible.any(-1)
    p = torch.exp(s - torch.where(empty, torch.zeros_like(lse), lse).unsqueeze(-1))
    p = p.masked_fill(~visible, 0.0)
    out = torch.matmul(p, vd).transpose(1, 2)
    return out, lse
