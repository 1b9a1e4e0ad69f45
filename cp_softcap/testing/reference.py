"""Float64 reference of full (non-CP) attention, differentiable by autograd. It materialises
the whole [B, H, Sq, Sk] score matrix: for checking results, not for training.

Global window rule: key j visible from query i iff i - left <= j <= i + right, positions given by
`q_pos`/`k_pos` (default 0..S-1). Packed documents (`cu_seqlens`, tokens [cu[d], cu[d+1]) form
document d): key j is visible from query i only if both lie in the same document, and the
window rule holds in stream positions (a window never crosses a document). Tokens at or past
cu[-1] are padding. Rows that see no key (padding included) give out = 0, lse = -inf and zero
gradients, never NaN.

Attention sinks (`sinks` [Hq]): one more column of logit sinks[h] (not scaled, not softcapped)
and value 0 in every row's softmax; a row that sees no key then gives out = 0, lse = sinks[h].
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..documents import check_cu_seqlens


def visible_mask(sq: int, sk: int, *, causal: bool = False, window=(None, None),
                 q_pos: Optional[torch.Tensor] = None, k_pos: Optional[torch.Tensor] = None,
                 cu_seqlens=None, device=None) -> torch.Tensor:
    """bool [Sq, Sk]: which keys each query sees under the window rule (and, with cu_seqlens,
    the document boundaries; then Sq must equal Sk: one stream)."""
    qp = torch.arange(sq, device=device) if q_pos is None else q_pos.to(device)
    kp = torch.arange(sk, device=device) if k_pos is None else k_pos.to(device)
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0
    visible = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left is not None:
        visible &= kp[None, :] >= qp[:, None] - left
    if right is not None:
        visible &= kp[None, :] <= qp[:, None] + right
    if cu_seqlens is not None:
        if sq != sk:
            raise ValueError(f"cu_seqlens= (packed documents) needs q and k/v over the same stream: "
                             f"q has {sq} tokens, k/v have {sk}")
        cu = check_cu_seqlens(cu_seqlens, sq)
        ids = torch.full((sq,), -1, dtype=torch.int64, device=device)       # -1: padding
        for d in range(len(cu) - 1):
            ids[cu[d]:cu[d + 1]] = d
        visible &= (ids[:, None] == ids[None, :]) & (ids[:, None] >= 0)
    return visible


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, *,
                     softcap: Optional[float] = None, scale: Optional[float] = None,
                     dtype: torch.dtype = torch.float64, sinks: Optional[torch.Tensor] = None
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D], visible bool [Sq, Sk] -> (out [B, Sq, Hq, Dv],
    lse [B, Hq, Sq]) in `dtype`. Rows with no visible key: out 0, lse -inf, zero gradients.
    sinks [Hq]: a sink column of that logit and value 0 in every row (differentiable)."""
    hq, hkv = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qd, kd, vd = (x.to(dtype).transpose(1, 2) for x in (q, k, v))
    kd = kd.repeat_interleave(hq // hkv, dim=1)
    vd = vd.repeat_interleave(hq // hkv, dim=1)
    s = torch.matmul(qd, kd.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if sinks is not None:       # every row sees the sink: no row is empty
        s = s.masked_fill(~visible, float("-inf"))
        sink = sinks.to(dtype).view(1, hq, 1, 1).expand(s.shape[0], hq, s.shape[2], 1)
        lse = torch.logsumexp(torch.cat([s, sink], dim=-1), dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1)).masked_fill(~visible, 0.0)
        return torch.matmul(p, vd).transpose(1, 2), lse
    empty = ~visible.any(-1)
    # Empty rows take a finite stand-in before logsumexp so no -inf - (-inf) reaches the backward.
    s = s.masked_fill(~visible, float("-inf")).masked_fill(empty[:, None], 0.0)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).masked_fill(~visible, 0.0)
    out = torch.matmul(p, vd).transpose(1, 2)
    return out, lse.masked_fill(empty, float("-inf"))


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        softcap: Optional[float] = None, causal: bool = False,
                        window=(None, None), scale: Optional[float] = None,
                        q_pos: Optional[torch.Tensor] = None, k_pos: Optional[torch.Tensor] = None,
                        cu_seqlens=None, dtype: torch.dtype = torch.float64,
                        sinks: Optional[torch.Tensor] = None
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] (batch, sequence, heads, head dim, as
    cp_softcap.attention takes them) -> (out [B, Sq, Hq, Dv], lse [B, Hq, Sq]) in `dtype`.
    Positions default to 0..S-1 for queries and keys alike (top-left when Sq != Sk); for the
    library's bottom-right alignment pass testing.bottom_right_positions(Sq, Sk) as
    q_pos/k_pos (reference_with_grads does it by default).
    cu_seqlens: boundaries [0, e1, ..., T_docs] of packed documents (as `cp_softcap.attention`
    takes them), or None for one sequence. sinks [Hq]: attention sinks (see the module
    docstring)."""
    visible = visible_mask(q.shape[1], k.shape[1], causal=causal, window=window, q_pos=q_pos,
                           k_pos=k_pos, cu_seqlens=cu_seqlens, device=q.device)
    return masked_attention(q, k, v, visible, softcap=softcap, scale=scale, dtype=dtype, sinks=sinks)
