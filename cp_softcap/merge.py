"""Merge partial attention results by LSE, in float32, safe for empty rows.

For two disjoint key sets a, b of the same rows:
    LSE = logaddexp(LSE_a, LSE_b);  O = exp(LSE_a - LSE) O_a + exp(LSE_b - LSE) O_b
A partial with LSE = -inf (or +inf, flash-attn 2's marker for an empty row) contributes nothing.
A row empty in every partial ends with out = 0, lse = -inf. No NaN can come out of -inf inputs.

GradAccumulator is the backward's counterpart: the sum of gradient partials, each covering a
range of positions (dim 1) of one tensor. Partials may come in the kernel's own dtype (bf16 from
flash-attn): the in-place add widens them on the fly, so no separate float32 copy of each partial
is made. The first partial that covers the whole tensor is taken as the buffer when it already
has the buffer's dtype (no copy), copied otherwise, so the common case never zero-fills.

A 16-bit buffer is exact only when every position receives at most one partial (the caller's
promise, layout.block_exclusive): 0 + x is x in any dtype.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def clean_lse(lse: torch.Tensor) -> torch.Tensor:
    """Map flash-attn 2's +inf (empty row) to -inf; other values unchanged."""
    return torch.where(lse == float("inf"), torch.full_like(lse, float("-inf")), lse)


def _weight(lse_part: torch.Tensor, lse_total: torch.Tensor) -> torch.Tensor:
    """exp(lse_part - lse_total), 0 where the partial is empty; [B, H, S] -> [B, S, H, 1]."""
    w = torch.exp(lse_part - lse_total)
    w = torch.where(lse_part == float("-inf"), torch.zeros_like(w), w)
    return w.transpose(1, 2).unsqueeze(-1)


def _fused_ok(acc_out: torch.Tensor) -> bool:
    """CUDA float32 accumulators use the one-pass Triton merge (merge_fused.py) when triton is
    importable; CP_SOFTCAP_FUSED_MERGE=0 forces the eager path below."""
    try:
        from .merge_fused import available
    except Exception:
        return False
    return available(acc_out)


def merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor) -> None:
    """Merge (out, lse) into the running accumulator in place.

    acc_out [B, S, H, D] float32 (or float64), acc_lse [B, H, S] same dtype family; out/lse are a
    new partial for the same rows (out in any float dtype). Views (row slices) are fine.
    """
    if acc_out.is_cuda and _fused_ok(acc_out):
        from .merge_fused import merge_into_fused
        merge_into_fused(acc_out, acc_lse, out, lse)
        return
    lse = clean_lse(lse.to(acc_lse.dtype))
    total = torch.logaddexp(acc_lse, lse)
    w_acc = _weight(acc_lse, total)
    w_new = _weight(lse, total)
    acc_out.mul_(w_acc).add_(out.to(acc_out.dtype) * w_new)
    acc_lse.copy_(total)


def merge(parts, acc_dtype: torch.dtype = torch.float32
          ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge an iterable of (out [B,S,H,D], lse [B,H,S]) partials of the same rows."""
    acc_out: Optional[torch.Tensor] = None
    acc_lse: Optional[torch.Tensor] = None
    for out, lse in parts:
        if acc_out is None:
            acc_out = torch.zeros(out.shape, dtype=acc_dtype, device=out.device)
            acc_lse = torch.full(lse.shape, float("-inf"), dtype=acc_dtype, device=lse.device)
        merge_into(acc_out, acc_lse, out, lse)
    if acc_out is None:
        raise ValueError("merge() needs at least one partial")
    return acc_out, acc_lse


def new_accumulator(q_shape, head_dim_v: int, acc_dtype: torch.dtype, device
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Empty (out, lse) accumulator for queries of shape [B, S, H, D]: out = 0, lse = -inf, in
    the accumulation dtype `acc_dtype` (plan.grad_dtype: kernels.base.grad_dtype of the inputs' dtype)."""
    b, s, h, _ = q_shape
    out = torch.zeros(b, s, h, head_dim_v, dtype=acc_dtype, device=device)
    lse = torch.full((b, h, s), float("-inf"), dtype=acc_dtype, device=device)
    return out, lse


class GradAccumulator:
    """The sum of gradient partials over ranges of dim 1 (see the module docstring)."""

    def __init__(self, shape, dtype: torch.dtype, device):
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self._buf = None

    def add(self, lo: int, hi: int, grad: torch.Tensor) -> None:
        if self._buf is None:
            if lo == 0 and hi == self.shape[1]:
                if grad.dtype == self.dtype and grad.is_contiguous() and grad._base is None:
                    self._buf = grad            # a fresh kernel output: ours to add into
                else:
                    self._buf = grad.to(self.dtype, memory_format=torch.contiguous_format, copy=True)
                return
            self._buf = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        self._buf[:, lo:hi] += grad

    def result(self) -> torch.Tensor:
        """The sum (zeros if nothing was added). The buffer itself, not a copy: add nothing after
        handing it out (the ring sends it asynchronously)."""
        if self._buf is None:
            self._buf = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        return self._buf
