"""`sdpa`: PyTorch's fused scaled-dot-product attention ops that return the LSE.
Softcap OFF only (SDPA has no tanh capping; the selector never picks it with a cap).

CUDA (sdpa_cuda.py): cuDNN, flash or mem-efficient aten ops, the first that passes a tiny
forward+backward self-test for (dtype, head dims) on this device (order: CP_SOFTCAP_SDPA_OP if
set, else cudnn, flash, efficient; float64 is rejected by the probe). Bottom-right causal with
Sq < Sk is split into a full part (first Sk-Sq keys) and a square causal part, merged in fp32;
their backward runs each part with the final (out, lse), so no bias/mask tensor is ever built.

CPU: aten._scaled_dot_product_flash_attention_for_cpu (+ _backward), layout [B, H, L, E].
aten's `is_causal` is TOP-LEFT aligned; the contract is bottom-right. We therefore use
`is_causal` only on square problems; Sq > Sk causal = empty leading rows + a square causal tail;
Sq < Sk causal uses an explicit additive mask. Windows other than causal are not served.
GQA: K/V heads are expanded for the op and their gradients summed back.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..merge import merge
from ..settings import sdpa_op
from ..spec import Window
from . import sdpa_cuda
from .base import Capabilities, Kernel, grad_dtype, refuse_segments, visible_mask

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
        devices=frozenset({"cpu", "cuda"}), backward_devices=frozenset({"cpu", "cuda"}),
        cp=True, dlse=False, deterministic_backward=True,
        notes=("softcap off only; top-left causal handled by slicing/masking",
               "cuda: cuDNN > flash > efficient aten op, chosen by a self-test per dtype/head dim"))

    def __init__(self):
        self._ops = {}                    # (dtype, d, dv, device index) -> op name or reason

    @staticmethod
    def _order():
        forced = sdpa_op()
        return (forced,) if forced else sdpa_cuda.OPS

    def cuda_op(self, dtype, head_dim: int, head_dim_v: int, device=None) -> Tuple[Optional[str], str]:
        """(op, '') for the first SDPA op that works here, or (None, reasons)."""
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        key = (dtype, head_dim, head_dim_v, dev.index, self._order())
        if key not in self._ops:
            reasons = []
            for op in self._order():
                r = sdpa_cuda.selftest(op, dtype, head_dim, head_dim_v, dev)
                if r is None:
                    self._ops[key] = (op, "")
                    break
                reasons.append(r)
            else:
                self._ops[key] = (None, "; ".join(reasons))
        return self._ops[key]

    def probe(self, spec) -> Optional[str]:
        if spec.device_type != "cuda":
            if spec.head_dim_v != spec.head_dim:   # the CPU SDPA ops need one head size
                return (f"v head dim {spec.head_dim_v} != q/k head dim {spec.head_dim}: the CPU "
                        "SDPA ops need one head size")
            return None
        if not torch.cuda.is_available():
            return "sdpa on cuda needs CUDA, and torch.cuda.is_available() is False here"
        if spec.dtype == torch.float64:
            return "the CUDA SDPA ops with LSE do not support float64; use float32/bf16/fp16"
        op, reason = self.cuda_op(spec.dtype, spec.head_dim, spec.head_dim_v)
        return None if op else reason

    def _check(self, softcap, window):
        if softcap is not None:
            raise ValueError(f"sdpa kernel called with softcap={softcap}: SDPA cannot apply a cap")
        if window not in ((None, None), (None, 0)):
            raise ValueError(f"sdpa kernel serves only full or causal windows, got {window}")

    def forward(self, q, k, v, *, scale: float, softcap: Optional[float], window: Window,
                segments=None):
        refuse_segments(self, segments)
        self._check(softcap, window)
        if q.is_cuda:
            return self._cuda_forward(q, k, v, scale, window)
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
                 window: Window, dlse: Optional[torch.Tensor] = None, segments=None):
        refuse_segments(self, segments)
        self._check(softcap, window)
        if dlse is not None:
            raise ValueError("sdpa kernel has no LSE gradient; the selector should not pick it "
                             "when the returned LSE is differentiated")
        if q.is_cuda:
            return self._cuda_backward(dout, q, k, v, out, lse, scale, window)
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

    # ---- CUDA -------------------------------------------------------------------------------
    def _cuda_parts(self, sq: int, sk: int, window: Window):
        """[(row0, k0, k1, is_causal)]: square/top-left pieces whose union is the contract's
        bottom-right window (full or causal)."""
        if window == (None, None):
            return [(0, 0, sk, False)]
        if sq >= sk:
            return [(sq - sk, 0, sk, True)]            # leading sq-sk rows see no key
        return [(0, 0, sk - sq, False), (0, sk - sq, sk, True)]

    def _cuda_forward(self, q, k, v, scale, window):
        b, sq, hq, _ = q.shape
        sk, g = k.shape[1], hq // k.shape[2]
        op, reason = self.cuda_op(q.dtype, q.shape[-1], v.shape[-1], q.device)
        if op is None:
            raise RuntimeError(f"no CUDA SDPA op works here: {reason}")
        out = torch.zeros(b, sq, hq, v.shape[-1], dtype=q.dtype, device=q.device)
        lse = torch.full((b, hq, sq), _NEG_INF, dtype=torch.float32, device=q.device)
        if sk == 0 or sq == 0:
            return out, lse
        parts = []
        for row0, k0, k1, causal in self._cuda_parts(sq, sk, window):
            o, l = sdpa_cuda.forward(op, q[:, row0:].transpose(1, 2), _expand_bshd(k[:, k0:k1], g),
                                     _expand_bshd(v[:, k0:k1], g), scale=scale, is_causal=causal)
            parts.append((row0, o.transpose(1, 2), l))
        if len(parts) == 1:
            row0, o, l = parts[0]
            out[:, row0:], lse[:, :, row0:] = o, l
            return out, lse
        acc_o, acc_l = merge([(o, l) for _, o, l in parts])
        return acc_o.to(q.dtype), acc_l

    def _cuda_backward(self, dout, q, k, v, out, lse, scale, window):
        sq, sk, g = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        if sk == 0 or sq == 0:
            return dq, dk, dv
        op, reason = self.cuda_op(q.dtype, q.shape[-1], v.shape[-1], q.device)
        if op is None:
            raise RuntimeError(f"no CUDA SDPA op works here: {reason}")
        dout, out = dout.to(q.dtype), out.to(q.dtype)
        for row0, k0, k1, causal in self._cuda_parts(sq, sk, window):
            gq, gk, gv = sdpa_cuda.backward(
                op, dout[:, row0:].transpose(1, 2), q[:, row0:].transpose(1, 2),
                _expand_bshd(k[:, k0:k1], g), _expand_bshd(v[:, k0:k1], g),
                out[:, row0:].transpose(1, 2), lse[:, :, row0:], scale=scale, is_causal=causal)
            dq[:, row0:] += gq.transpose(1, 2)
            dk[:, k0:k1] += _reduce_bshd(gk, g)
            dv[:, k0:k1] += _reduce_bshd(gv, g)
        return dq, dk, dv


def _expand_bshd(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, S, Hkv, D] -> [B, Hkv*groups, S, D] as a transposed view of a [B, S, H, D] tensor
    (the same stride pattern as q's transpose, which cuDNN wants)."""
    return (x.repeat_interleave(groups, dim=2) if groups > 1 else x).transpose(1, 2)


def _reduce_bshd(dx: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hq, S, D] gradient of expanded K/V -> [B, S, Hkv, D] float32."""
    b, hq, s, d = dx.shape
    return dx.float().reshape(b, hq // groups, groups, s, d).sum(2).transpose(1, 2)
