"""Float64 reference of full (non-CP) attention over packed documents, for tests only (it
materialises the whole score matrix).

Query i sees key j iff both lie in the same document of `cu_seqlens` (tokens [cu[d], cu[d+1]))
and i - left <= j <= i + right in global positions (causal: right = 0). Tokens at or past
cu[-1] are padding: out 0, LSE -inf, zero gradients, never NaN.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch


def document_ids(cu_seqlens: Sequence[int], seq_len: int, device=None) -> torch.Tensor:
    """int64 [seq_len]: the document of each token, -1 for padding."""
    ids = torch.full((seq_len,), -1, dtype=torch.int64, device=device)
    for d in range(len(cu_seqlens) - 1):
        ids[int(cu_seqlens[d]):int(cu_seqlens[d + 1])] = d
    return ids


def document_mask(cu_seqlens: Sequence[int], seq_len: int, *, causal: bool = False,
                  window=(None, None), device=None) -> torch.Tensor:
    """bool [seq_len, seq_len]: block-diagonal document mask AND the window rule."""
    ids = document_ids(cu_seqlens, seq_len, device)
    pos = torch.arange(seq_len, device=device)
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0
    vis = (ids[:, None] == ids[None, :]) & (ids[:, None] >= 0)
    if left is not None:
        vis &= pos[None, :] >= pos[:, None] - left
    if right is not None:
        vis &= pos[None, :] <= pos[:, None] + right
    return vis


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, *,
                     softcap: Optional[float] = None, scale: Optional[float] = None,
                     dtype: torch.dtype = torch.float64) -> Tuple[torch.Tensor, torch.Tensor]:
    """q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D], visible bool [Sq, Sk] -> (out [B, Sq, Hq, Dv],
    lse [B, Hq, Sq]) in `dtype`. Rows with no visible key: out 0, lse -inf, zero gradients."""
    hq, hkv = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qd, kd, vd = (x.to(dtype).transpose(1, 2) for x in (q, k, v))
    kd = kd.repeat_interleave(hq // hkv, dim=1)
    vd = vd.repeat_interleave(hq // hkv, dim=1)
    s = torch.matmul(qd, kd.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    empty = ~visible.any(-1)
    # Empty rows take a finite stand-in before logsumexp so no -inf - (-inf) reaches the backward.
    s = s.masked_fill(~visible, float("-inf")).masked_fill(empty[:, None], 0.0)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).masked_fill(~visible, 0.0)
    out = torch.matmul(p, vd).transpose(1, 2)
    return out, lse.masked_fill(empty, float("-inf"))


def doc_reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            cu_seqlens: Sequence[int], *, softcap: Optional[float] = None,
                            causal: bool = False, window=(None, None),
                            scale: Optional[float] = None, dtype: torch.dtype = torch.float64
                            ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Packed-document attention of a whole stream: q/k/v [B, S, H, D] -> (out, lse)."""
    cu = [int(c) for c in cu_seqlens]
    vis = document_mask(cu, q.shape[1], causal=causal, window=window, device=q.device)
    return masked_attention(q, k, v, vis, softcap=softcap, scale=scale, dtype=dtype)
