import torch

import cp_softcap as cps
from cp_softcap.testing import reference_attention


def test_attention_matches_reference_with_saturating_softcap():
    q = (torch.randn(1, 48, 4, 16) * 4).requires_grad_()
    k = (torch.randn(1, 48, 2, 16) * 4).requires_grad_()
    v = torch.randn(1, 48, 2, 16).requires_grad_()
    out = cps.attention(q, k, v, softcap=2.0, causal=True)
    ref, _ = reference_attention(q, k, v, softcap=2.0, causal=True)
    nocap, _ = reference_attention(q, k, v, causal=True)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max() < 1e-4
    assert (out.double() - nocap).abs().max() > 1e-2   # the cap matters here
