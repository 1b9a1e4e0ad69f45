"""Export path (torch.onnx.export, torch.export): the `torch` kernel's math written with plain,
differentiable torch ops, so exporters see a clean graph instead of an autograd.Function around a
Python-blocked loop. It materialises the [B, Hq, Sq, Sk] score matrix (fine for export; not used
for training). Same conventions as every kernel: softcap before masking, bottom-right aligned
window, rows that see no key give out = 0 and lse = -inf.

Whether a call is being exported (is_exporting) and the refusals (refuse_cp for context
parallelism; packed documents and a forced non-torch kernel in plan.py) are decided with the
call's plan: ValueErrors that python -O keeps.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .kernels.base import grad_dtype
from .spec import Window

_NEG_INF = float("-inf")


def is_exporting() -> bool:
    """True inside torch.onnx.export (TorchScript or dynamo exporter) or torch.export tracing."""
    try:
        if torch.onnx.is_in_onnx_export():
            return True
    except Exception:  # pragma: no cover  (very old/new torch without the flag module)
        pass
    compiler = getattr(torch, "compiler", None)
    flag = getattr(compiler, "_is_exporting_flag", None)
    if isinstance(flag, bool):
        # the flag itself: some torch releases (2.11 among them) fold torch.compiler.is_exporting()
        # to True inside ANY torch.compile trace, which would send compiled calls to the export math
        return flag
    fn = getattr(compiler, "is_exporting", None)
    return bool(fn()) if fn is not None else False


def refuse_cp(cp_size: int) -> None:
    """Raise when an export traces a context-parallel call."""
    if cp_size > 1 and is_exporting():
        raise ValueError(f"cp_softcap: context-parallel attention (cp={cp_size}) cannot be exported "
                         "(torch.onnx.export / torch.export): its point-to-point collectives are not "
                         "graph ops. Export the model on one device: pass cp_group=None (CPAttention) "
                         "or group=None (cp_attention) and full-length inputs, or call cps.attention.")


def export_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                     softcap: Optional[float], window: Window
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] -> (out [B, Sq, Hq, Dv] in q's dtype, lse [B, Hq, Sq]
    float32, float64 for float64 inputs). Exportable: static shapes in, no data-dependent control flow."""
    acc = grad_dtype(q.dtype)
    b, sq, hq, d = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    g = hq // hkv
    qh = q.to(acc).reshape(b, sq, hkv, g, d).permute(0, 2, 3, 1, 4)          # [B, Hkv, G, Sq, D]
    kh = k.to(acc).permute(0, 2, 1, 3).unsqueeze(2)                            # [B, Hkv, 1, Sk, D]
    vh = v.to(acc).permute(0, 2, 1, 3).unsqueeze(2)
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    left, right = window
    if left is not None or right is not None:
        i = torch.arange(sq, device=q.device).unsqueeze(1) + (sk - sq)
        j = torch.arange(sk, device=q.device).unsqueeze(0)
        visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
        if left is not None:
            visible = visible & (j >= i - left)
        if right is not None:
            visible = visible & (j <= i + right)
        s = s.masked_fill(~visible, _NEG_INF)
    m = s.amax(-1, keepdim=True)
    m = torch.where(m == _NEG_INF, torch.zeros_like(m), m)
    e = torch.exp(s - m)
    l = e.sum(-1, keepdim=True)
    empty = l == 0
    out = torch.matmul(e, vh) / torch.where(empty, torch.ones_like(l), l)
    lse = torch.where(empty, torch.full_like(l, _NEG_INF), m + torch.log(l)).squeeze(-1)
    out = out.permute(0, 3, 1, 2, 4).reshape(b, sq, hq, dv)
    return out.to(q.dtype), lse.reshape(b, hq, sq)
