"""Double backward on one device (a gradient penalty): exact with the torch kernel (its backward
is plain differentiable ops), checked against float64 autograd through the reference; a clear
error with a kernel whose backward is not differentiable, never a silently dropped term. Under
CP: tests_dist/test_robustness.py."""
from __future__ import annotations

import pytest
import torch

import cp_softcap as cps
from cp_softcap.testing import reference_attention, saturating_qkv


def _penalised_grads(attend, q, k, v, weight):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    loss = (attend(q, k, v) * weight).sum()
    gq, = torch.autograd.grad(loss, q, create_graph=True)
    (loss + gq.pow(2).sum()).backward()
    return q.grad, k.grad, v.grad


@pytest.mark.parametrize("softcap", [None, 2.0, 30.0])
def test_gradient_penalty_is_exact_with_the_torch_kernel(softcap):
    torch.manual_seed(0)
    q, k, v, _ = saturating_qkv(1, 24, 24, 4, 2, 8, torch.float64, softcap, requires_grad=False)
    weight = torch.randn(q.shape, dtype=torch.float64)
    got = _penalised_grads(lambda a, b, c: cps.attention(a, b, c, softcap=softcap, backend="torch"),
                           q, k, v, weight)
    want = _penalised_grads(lambda a, b, c: reference_attention(a, b, c, softcap=softcap, causal=True)[0],
                            q, k, v, weight)
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        assert (g - w).abs().max() <= 1e-9 * w.abs().max()
    if softcap:     # negative control: the penalty's gradient without the cap is far off
        nocap = _penalised_grads(lambda a, b, c: reference_attention(a, b, c, causal=True)[0],
                                 q, k, v, weight)
        assert (nocap[0] - want[0]).abs().max() > 1e-3 * want[0].abs().max()


def test_gradient_penalty_with_a_non_differentiable_backward_raises():
    q, k, v = (torch.randn(1, 16, 2, 8) for _ in range(3))
    with pytest.raises(RuntimeError, match="double backward through attention with the 'sdpa' kernel"):
        _penalised_grads(lambda a, b, c: cps.attention(a, b, c, backend="sdpa"), q, k, v, 1.0)
