"""Double backward on one device (a gradient penalty): exact with the torch kernel (its backward
is plain differentiable ops), checked against float64 autograd through the reference; a clear
error with a kernel whose backward is not differentiable, never a silently dropped term. Under
CP: tests_dist/test_robustness.py."""
from __future__ import annotations

import pytest
import torch

import cp_softcap as cps
from cp_softcap.kernels import Kernel
from cp_softcap.kernels.torch_kernel import TorchKernel
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


def _penalty_through(attend, how):
    """loss + |dq|^2, then its gradients taken `how`: every way must reach the error."""
    q, k, v = (torch.randn(1, 16, 2, 8).requires_grad_() for _ in range(3))
    loss = attend(q, k, v).square().sum()
    gq, = torch.autograd.grad(loss, q, create_graph=True)
    total = loss + gq.pow(2).sum()
    if how == "grad k":
        torch.autograd.grad(total, [k])
    elif how == "grad q, k, v":
        torch.autograd.grad(total, [q, k, v])
    elif how == "backward inputs v":
        total.backward(inputs=[v])
    else:
        total.backward()


class _NotTorch(Kernel):
    """The torch kernel's math behind another kernel's name (segments too): a kernel whose
    backward the library treats as not differentiable, on CPU."""
    name = "standin"

    def __init__(self):
        self.inner = TorchKernel()
        self.caps = self.inner.caps

    def probe(self, spec):
        return self.inner.probe(spec)

    def forward(self, *args, **kw):
        return self.inner.forward(*args, **kw)

    def backward(self, *args, **kw):
        return self.inner.backward(*args, **kw)


@pytest.mark.parametrize("how", ["backward", "grad k", "grad q, k, v", "backward inputs v"])
@pytest.mark.parametrize("packed", [False, True])
def test_every_way_of_differentiating_the_gradients_raises(how, packed):
    """autograd.grad(total, [k]) and backward(inputs=...) only run the nodes on a path to the
    requested inputs: the error node is wired to q, k, v, so it is on every such path (a loss
    term silently left out is what this guards against)."""
    docs = dict(cu_seqlens=[0, 5, 16]) if packed else {}
    with pytest.raises(RuntimeError, match="double backward through attention with the 'standin' kernel"):
        _penalty_through(lambda a, b, c: cps.attention(a, b, c, backend=_NotTorch(), **docs), how)
