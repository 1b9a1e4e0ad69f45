"""benchmarks/packed_overhead.py runs (dry run), and the one-device packed path adds no copies:
with one call over every row, cps.attention returns the kernel's own output tensor and its
gradients are the kernel's own tensors (no float32 buffer, no cast)."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import cp_softcap as cps                                             # noqa: E402
from benchmarks.packed_overhead import FreeKernel, main             # noqa: E402


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


def test_dry_run_writes_its_records(tmp_path):
    assert main(["--dry-run", "--out-dir", str(tmp_path)]) == 0
    blob = json.load(open(tmp_path / "packed_overhead.json"))
    assert {(r["mix"], r["mode"]) for r in blob["records"]} == {
        (m, mode) for m in ("long-tail", "short") for mode in ("fwd", "fwd+bwd")}
    assert all(r["ms"] > 0 for r in blob["records"])
