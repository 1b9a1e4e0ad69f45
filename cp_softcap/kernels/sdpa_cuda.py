"""CUDA ops behind the `sdpa` kernel: cuDNN, flash and mem-efficient SDPA aten ops that return
the LSE. No softcap (SDPA cannot cap). Layout of the ops is [B, H, L, E]; we pass transposed
views of [B, L, H, E] tensors, all with the same stride pattern (cuDNN is picky about that).

LSE normalisation to the contract's [B, H, L] float32:
    cudnn      returns [B, H, L, 1]            -> squeeze          (backward takes [B, H, L, 1])
    flash      returns [B, H, L]               -> as is
    efficient  returns [B, H, ceil32(L)]       -> slice            (backward takes the padded one)
`is_causal` is TOP-LEFT aligned in all three; sdpa.py passes it only for square pieces: bottom-right
causal with Sq < Sk is split into a full part and a square causal part (sdpa._cuda_parts).
The dropout RNG outputs (seed/offset) are meaningless with dropout 0; backward gets dummies.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..settings import SDPA_OPS
from ._common import cudnn_lse, padded_lse

OPS = SDPA_OPS
_NEG_INF = float("-inf")


def _dummy(device) -> torch.Tensor:
    return torch.zeros(2, dtype=torch.int64, device=device)


def _pad32(n: int) -> int:
    return (n + 31) // 32 * 32


def forward(op: str, q, k, v, *, scale: float, is_causal: bool,
            bias: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """q [B,H,Lq,E], k/v [B,H,Lk,E] (same head count) -> out [B,H,Lq,Ev], lse [B,H,Lq] fp32."""
    aten = torch.ops.aten
    if op == "cudnn":
        res = aten._scaled_dot_product_cudnn_attention(q, k, v, bias, True, 0.0, is_causal, False,
                                                       scale=scale)
        return res[0], cudnn_lse(res[1])
    if op == "flash":
        if bias is not None:
            raise ValueError("the flash SDPA op takes no bias; use op 'efficient' for masks")
        res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
        return res[0], res[1].float().contiguous()
    if op == "efficient":
        res = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, is_causal,
                                                           scale=scale)
        return res[0], padded_lse(res[1], q.shape[2])
    raise ValueError(f"unknown SDPA op {op!r}; choose one of {OPS}")


def backward(op: str, dout, q, k, v, out, lse, *, scale: float, is_causal: bool,
             bias: Optional[torch.Tensor] = None):
    """Gradients (in the op's dtype) of q [B,H,Lq,E], k/v [B,H,Lk,E] given out and lse [B,H,Lq]."""
    aten = torch.ops.aten
    lq, lk = q.shape[2], k.shape[2]
    dev = q.device
    if op == "cudnn":
        lse4 = lse.float().unsqueeze(-1).contiguous()
        return aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse4, _dummy(dev), _dummy(dev), bias, None, None, lq, lk, 0.0,
            is_causal, scale=scale)
    if op == "flash":
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.float().contiguous(), None, None, lq, lk, 0.0, is_causal,
            _dummy(dev), _dummy(dev), scale=scale)
    if op == "efficient":
        padded = torch.full((*lse.shape[:-1], _pad32(lq)), float("inf"), dtype=torch.float32,
                            device=dev)
        padded[..., :lq] = lse
        res = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, bias, out, padded, _dummy(dev), _dummy(dev), 0.0,
            [True, True, True, False], is_causal, scale=scale)
        return res[0], res[1], res[2]
    raise ValueError(f"unknown SDPA op {op!r}; choose one of {OPS}")


def selftest(op: str, dtype, head_dim: int, head_dim_v: int, device) -> Optional[str]:
    """Tiny forward+backward of `op` against float32 math; None if it works, else the reason."""
    try:
        g = torch.Generator(device=device).manual_seed(0)
        b, h, lq, lk = 1, 2, 128, 128
        q = torch.randn(b, lq, h, head_dim, generator=g, device=device, dtype=dtype).transpose(1, 2)
        k = torch.randn(b, lk, h, head_dim, generator=g, device=device, dtype=dtype).transpose(1, 2)
        v = torch.randn(b, lk, h, head_dim_v, generator=g, device=device, dtype=dtype).transpose(1, 2)
        scale = head_dim ** -0.5
        out, lse = forward(op, q, k, v, scale=scale, is_causal=True)
        s = (q.float() @ k.float().transpose(-1, -2)) * scale
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool, device=device).triu(1), _NEG_INF)
        ref_lse = torch.logsumexp(s, -1)
        ref = torch.softmax(s, -1) @ v.float()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        lerr = (lse - ref_lse).abs().max().item()
        if not (err < 2e-2 and lerr < 2e-2):
            return f"SDPA {op} self-test mismatch (out rel err {err:.2e}, lse max err {lerr:.2e})"
        dout = torch.randn_like(out)
        grads = backward(op, dout, q, k, v, out, lse, scale=scale, is_causal=True)
        if not all(torch.isfinite(t).all() for t in grads):
            return f"SDPA {op} backward self-test produced NaN/inf"
        return None
    except Exception as e:  # unsupported dtype/head dim/arch: fail closed with the reason
        return f"SDPA {op} unavailable here ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
