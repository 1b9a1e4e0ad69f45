"""Sums of gradient partials, each covering a range of positions (dim 1) of one tensor.

Partials may come in the kernel's own dtype (bf16 from flash-attn): the in-place add widens them
on the fly, so no separate float32 copy of each partial is made. The first partial that covers
the whole tensor is taken as the buffer when it already has the buffer's dtype (no copy), copied
otherwise, so the common case never zero-fills.

A 16-bit buffer is exact only when every position receives at most one partial (the caller's
promise, layout.block_exclusive): 0 + x is x in any dtype.
"""
from __future__ import annotations

import torch


class GradAccumulator:

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
