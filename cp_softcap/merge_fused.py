"""Fused LSE merge for CUDA tensors: one Triton pass instead of ~10 eager ops.

merge_into_fused(acc_out, acc_lse, out, lse) does, per row (b, s, h), in float32:
    lse_new = logaddexp(acc_lse, lse)          (+inf in `lse`, flash-attn 2's empty row, = -inf)
    acc_out = w_acc * acc_out + w_new * out    (w = exp(lse_part - lse_new), 0 for empty parts)
    acc_lse = lse_new
reading acc_out/out once and writing acc_out once (the eager version reads and writes the
[B, S, H, D] tensors about five times). Any strides are accepted (row-slice views of a larger
accumulator are the normal case in a ring). A row empty in both stays out = 0, lse = -inf; an
empty accumulator row is overwritten without reading it (so garbage there cannot leak in).

Shapes: acc_out [B, S, H, D] float32, acc_lse [B, H, S] float32, out [B, S, H, D] (any float
dtype), lse [B, H, S] (float32). `available(t)` says whether the fused path applies to `t`.
"""
from __future__ import annotations

import os

import torch

from .settings import fused_merge

try:                                   # triton ships with CUDA builds of torch only
    import triton
    import triton.language as tl
except Exception:                      # pragma: no cover - CPU builds
    triton = None


def available(t: torch.Tensor) -> bool:
    """Fused merge usable for accumulator `t`: CUDA (or TRITON_INTERPRET=1), float32, triton
    importable, and not disabled with CP_SOFTCAP_FUSED_MERGE=0."""
    if triton is None or not fused_merge():
        return False
    if t.dtype != torch.float32:
        return False
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    @triton.jit
    def _merge_kernel(acc_o, acc_l, o, l, n_rows, S, H, D,
                      sao_b, sao_s, sao_h, sao_d, sal_b, sal_h, sal_s,
                      so_b, so_s, so_h, so_d, sl_b, sl_h, sl_s,
                      BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
        mask_r = rows < n_rows
        h = rows % H
        t = rows // H
        s = t % S
        b = t // S
        la = tl.load(acc_l + b * sal_b + h * sal_h + s * sal_s, mask=mask_r, other=float("-inf"))
        ln = tl.load(l + b * sl_b + h * sl_h + s * sl_s, mask=mask_r, other=float("-inf"))
        ln = ln.to(tl.float32)
        ln = tl.where(ln == float("inf"), float("-inf"), ln)
        m = tl.maximum(la, ln)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        ea = tl.exp(la - m_safe)
        en = tl.exp(ln - m_safe)
        tot = ea + en
        empty = tot == 0.0
        inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, tot))
        wa = ea * inv
        wn = en * inv
        lse_new = tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, tot)))
        d = tl.arange(0, BLOCK_D)
        mask = mask_r[:, None] & (d < D)[None, :]
        p_ao = acc_o + (b * sao_b + s * sao_s + h * sao_h)[:, None] + d[None, :] * sao_d
        p_o = o + (b * so_b + s * so_s + h * so_h)[:, None] + d[None, :] * so_d
        read_acc = mask & (wa > 0.0)[:, None]
        ao = tl.load(p_ao, mask=read_acc, other=0.0)
        on = tl.load(p_o, mask=mask & (wn > 0.0)[:, None], other=0.0).to(tl.float32)
        tl.store(p_ao, ao * wa[:, None] + on * wn[:, None], mask=mask)
        tl.store(acc_l + b * sal_b + h * sal_h + s * sal_s, lse_new, mask=mask_r)


def merge_into_fused(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor) -> None:
    """In-place fused merge (see module docstring). Raises RuntimeError if triton is missing."""
    if triton is None:
        raise RuntimeError("merge_into_fused needs triton (CUDA builds of torch ship it); "
                           "use cp_softcap.merge.merge_into instead")
    b, s, h, d = acc_out.shape
    if out.shape != acc_out.shape or acc_lse.shape != (b, h, s) or lse.shape != (b, h, s):
        raise ValueError(f"merge shapes disagree: acc_out {tuple(acc_out.shape)}, out "
                         f"{tuple(out.shape)}, acc_lse {tuple(acc_lse.shape)}, lse {tuple(lse.shape)}; "
                         "expected out [B,S,H,D] and lse [B,H,S] for the same rows")
    if lse.dtype != torch.float32:
        lse = lse.float()
    n_rows = b * s * h
    if n_rows == 0:
        return
    block_d = triton.next_power_of_2(d)
    block_r = max(1, min(64, 4096 // block_d))
    grid = (triton.cdiv(n_rows, block_r),)
    _merge_kernel[grid](acc_out, acc_lse, out, lse, n_rows, s, h, d,
                        *acc_out.stride(), *acc_lse.stride(), *out.stride(), *lse.stride(),
                        BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4)
