"""`sdpa`: PyTorch's fused scaled-dot-product attention ops that return the LSE.
Softcap OFF only (SDPA has no tanh capping; the selector never picks it with a cap).

CPU: aten._scaled_dot_product_flash_attention_for_cpu (+ _backward), layout [B, H, L, E].
aten's `is_causal` is TOP-LEFT aligned; the contract is bottom-right. We therefore use
`is_causal` only on square problems; Sq > Sk causal = empty leading rows + a square causal tail;
Sq < Sk causal uses an explicit additive mask. Windows other than causal are not served.
GQA: K/V heads are expanded for the op and their gradients summed back.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..spec import Window
from .base import Capabilities, Kernel, grad_dtype, visible_mask

_NEG_INF = float("-inf")


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, S, Hkv, D] -> [B, Hkv*groups, S, D] (heads repeated in GQA order)."""
    x = x.transpose(1, 2)
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def _reduce_kv(dx: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hq, S, D] gradient of expanded K/V -> [B, S, Hkv, D]."""
    b, hq, s, d = dx.shape
    return dx.reshape(b, hq // groups, groups, s, d).sum(2).transpose(1, 2)


def _plan(sq: int, sk: int, window: Window):
    """(first computed row, is_causal flag, needs explicit mask) for a causal/full window."""
    if window == (None, None):
        return 0, False, False
    if sq >= sk:
        return sq - sk, True, False
    return 0, False, True


class SdpaKernel(Kernel):
    name = "sdpa"
    caps = Capabilities(
        softcap=False, window=False, gqa=True,
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
        devices=frozenset({"cpu"}), backward_devices=frozenset({"cpu"}),
        cp=True, dlse=False, deterministic_backward=True,
        notes=("softcap off only; top-left causal handled by slicing/masking",))

    def _check(self, softcap, window):
        if softcap is not None:
            raise ValueError(f"sdpa kernel called with softcap={softcap}: SDPA cannot apply a cap")
        if window not in ((None, None), (None, 0)):
            raise ValueError(f"sdpa kernel serves only full or causal windows, got {window}")

    def forward(self, q, k, v, *, scale: float, softcap: Optional[float], window: Window):
        self._check(softcap, window)
        b, sq, hq, _ = q.shape
        sk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
        row0, is_causal, masked = _plan(sq, sk, window)
        out = torch.zeros(b, sq, hq, dv, dtype=q.dtype, device=q.device)
        lse = torch.full((b, hq, sq), _NEG_INF, dtype=grad_dtype(q.dtype), device=q.device)
        if row0 >= sq or sk == 0:
            return out, lse
        qt = q[:, row0:].transpose(1, 2)
        mask = self._mask(sq, sk, window, q) if masked else None
        o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qt, _expand_kv(k, hq // hkv), _expand_kv(v, hq // hkv), 0.0, is_causal,
            attn_mask=mask, scale=scale)
        out[:, row0:] = o.transpose(1, 2)
        lse[:, :, row0:] = l
        return out, lse

    @staticmethod
    def _mask(sq, sk, window, q):
        vis = visible_mask(sq, sk, window, q.device)
        return torch.zeros(sq, sk, dtype=q.dtype, device=q.device).masked_fill(~vis, _NEG_INF)

    def backward(self, dout, q, k, v, out, lse, *, scale: float, softcap: Optional[float],
                 window: Window, dlse: Optional[torch.Tensor] = None):
        self._check(softcap, window)
        if dlse is not None:
            raise ValueError("sdpa kernel has no LSE gradient; the selector should not pick it "
                             "when the returned LSE is differentiated")
        b, sq, hq, d = q.shape
        hkv = k.shape[2]
        g = hq // hkv
        acc = grad_dtype(q.dtype)
        row0, is_causal, masked = _plan(sq, sk := k.shape[1], window)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        if row0 >= sq or sk == 0:
            return dq, torch.zeros(k.shape, dtype=acc, device=q.device), torch.zeros(v.shape, dtype=acc, device=q.device)
        mask = self._mask(sq, sk, window, q) if masked else None
        gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout[:, row0:].to(q.dtype).transpose(1, 2), q[:, row0:].transpose(1, 2),
            _expand_kv(k, g), _expand_kv(v, g), out[:, row0:].to(q.dtype).transpose(1, 2),
            lse[:, :, row0:].to(torch.float32 if q.dtype != torch.float64 else torch.float64).contiguous(),
            0.0, is_causal, attn_mask=mask, scale=scale)
        dq[:, row0:] = gq.transpose(1, 2).to(acc)
        return dq, _reduce_kv(gk.to(acc), g), _reduce_kv(gv.to(acc), g)
