"""Float32 sums of gradient partials, each covering a range of positions (dim 1) of one tensor.

Partials may come in the kernel's own dtype (bf16 from flash-attn): the in-place add widens them
on the fly, so no separate float32 copy of each partial is made. The first partial that covers
the whole tensor is copied instead of added, so the common case never zero-fills.
"""
from __future__ import annotations

import torch


class GradAccumulator:

    def __init__(self, shape, dtype: torch.dtype, device):
        self._buf = torch.empty(shape, dtype=dtype, device=device)
        self._fresh = True

    def add(self, lo: int, hi: int, grad: torch.Tensor) -> None:
        if self._fresh:
            self._fresh = False
            if lo == 0 and hi == self._buf.shape[1]:
                self._buf.copy_(grad)
                return
            self._buf.zero_()
        self._buf[:, lo:hi] += grad

    def result(self) -> torch.Tensor:
        """The sum (zeros if nothing was added)."""
        if self._fresh:
            self._fresh = False
            self._buf.zero_()
        return self._buf
