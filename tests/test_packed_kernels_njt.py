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


def test_expanded_backward_call_gives_the_gqa_gradients():
    """packed_kernels.expanded_backward_call: FA4's backward on K/V repeated to the query heads,
    dK/dV summed over each group, equals its backward on the KV heads (the FA4 stand-in of
    tests/test_fa_varlen.py computes through the torch kernel, float64)."""
    from benchmarks.packed_kernels import expanded_backward_call
    from cp_softcap.kernels.fa4 import FA4Kernel
    from test_fa_varlen import fake_fa4
    torch.manual_seed(1)
    q = torch.randn(1, 60, 4, 8, dtype=torch.float64)
    k, v = (torch.randn(1, 60, 2, 8, dtype=torch.float64) for _ in range(2))
    kern = FA4Kernel(module=fake_fa4())
    torch.manual_seed(2)
    gqa = expanded_backward_call(q, k, v, CU, 5.0, True, False, kernel=kern)()
    torch.manual_seed(2)
    expanded = expanded_backward_call(q, k, v, CU, 5.0, True, True, kernel=kern)()
    for a, b, x in zip(gqa, expanded, (q, k, v)):
        assert a.shape == b.shape == x.shape
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
