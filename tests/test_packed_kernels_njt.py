"""benchmarks/packed_kernels.njt_call (PyTorch SDPA on nested tensors, the varlen ceiling rows):
its layout (documents as jagged rows, KV heads repeated, output and gradients back in the
stream's order) checked on CPU with PyTorch's math backend, which takes only non-causal nested
calls; on the GPU the same function runs cuDNN's and flash's varlen kernels causal."""
import torch

import cp_softcap as cps
from benchmarks.packed_kernels import njt_call

CU = [0, 5, 17, 40, 41, 60]


def test_njt_call_is_attention_one_document_at_a_time():
    torch.manual_seed(0)
    q = torch.randn(1, 64, 4, 8, dtype=torch.float64)
    k, v = (torch.randn(1, 64, 2, 8, dtype=torch.float64) for _ in range(2))
    out = njt_call(q, k, v, CU, "math", backward=True, causal=False)()
    ref = torch.cat([cps.attention(q[:, a:b], k[:, a:b], v[:, a:b], causal=False)
                     for a, b in zip(CU, CU[1:])], 1)[0]
    assert out.shape == ref.shape == (60, 4, 8)
    torch.testing.assert_close(out, ref)
    whole = cps.attention(q[:, :60], k[:, :60], v[:, :60], causal=False)[0]
    assert (out - whole).abs().max() > 1e-2         # the documents are really apart
