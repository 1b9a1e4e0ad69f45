"""examples/gemma2's Linear under autocast: the float32 weight's gradient comes out of its matmul
in float32 (model._LowPrecisionLinear) instead of a bf16 matmul output cast to float32. The
forward and the input's gradient are autocast's, bitwise; the weight's gradient is the float32
sum of the same bf16 products, checked against float64 (autocast's own is rounded to bf16 and
fails that check); outside autocast it is nn.Linear. On CUDA (torch.mm's out_dtype) too."""
import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from gemma2 import model as gm  # noqa: E402

pytestmark = pytest.mark.timeout(120)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _run(cls, device):
    torch.manual_seed(0)
    lin = cls(96, 80, bias=False).to(device)
    with torch.no_grad():
        lin.weight.normal_(0, 0.2)
    x = torch.randn(3, 40, 96, device=device).bfloat16().requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        y = lin(x)
    g = torch.randn(y.shape, device=device).bfloat16()
    y.backward(g)
    return x, g, y, x.grad, lin.weight.grad, lin.weight


@pytest.mark.parametrize("device", DEVICES)
def test_forward_and_input_gradient_are_autocasts_weight_gradient_float32_exact(device):
    x, g, y, gx, gw, w = _run(gm.Linear, device)
    _, _, ref_y, ref_gx, ref_gw, _ = _run(nn.Linear, device)
    assert y.dtype == torch.bfloat16 and torch.equal(y, ref_y)
    assert gx.dtype == torch.bfloat16 and torch.equal(gx, ref_gx)
    assert gw.dtype == torch.float32 and torch.isfinite(gw).all()
    # float64 sum of the same bf16 products: ours is float32 accumulation only
    exact = (g.double().reshape(-1, 80).t() @ x.detach().double().reshape(-1, 96))
    scale = exact.abs().max()
    assert ((gw.double() - exact).abs().max() / scale) < 1e-5
    # autocast's weight gradient went through bf16 on the way: the same check catches it
    assert ((ref_gw.double() - exact).abs().max() / scale) > 1e-4


def test_outside_autocast_it_is_nn_linear():
    torch.manual_seed(0)
    lin, ref = gm.Linear(16, 8, bias=False), nn.Linear(16, 8, bias=False)
    ref.load_state_dict(lin.state_dict())
    x = torch.randn(4, 16, dtype=torch.float64)
    lin, ref = lin.double(), ref.double()
    a, b = lin(x), ref(x)
    a.sum().backward()
    b.sum().backward()
    assert torch.equal(a, b) and torch.equal(lin.weight.grad, ref.weight.grad)
