"""The one-device packed path adds no copies: with one call over every row, cps.attention returns
the kernel's own output tensor and its gradients are the kernel's own tensors (no float32
buffer, no cast); benchmarks/packed_kernels.py's "library-only" rows time the library through
this stand-in kernel."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import cp_softcap as cps                                             # noqa: E402
from benchmarks.packed_kernels import FreeKernel                    # noqa: E402


class _Recording(FreeKernel):
    def forward(self, q, k, v, **kw):
        self.out = super().forward(q, k, v, **kw)
        return self.out

    def backward(self, *args, **kw):
        self.grads = super().backward(*args, **kw)
        return self.grads


def test_one_call_over_every_row_returns_the_kernels_tensors():
    kern = _Recording()
    q = torch.randn(1, 96, 4, 16, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 96, 2, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    cu = torch.tensor([0, 10, 11, 60, 96], dtype=torch.int32)       # one varlen call
    out, lse = cps.attention(q, k, v, softcap=5.0, cu_seqlens=cu, backend=kern, return_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert out.data_ptr() == kern.out[0].data_ptr() and lse.data_ptr() == kern.out[1].data_ptr()
    out.backward(torch.ones_like(out))
    for leaf, g in zip((q, k, v), kern.grads):
        assert leaf.grad.dtype == torch.bfloat16 and leaf.grad.shape == g.shape

