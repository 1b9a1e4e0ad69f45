"""The CPU `sdpa` kernel (aten flash-for-cpu ops, softcap off) against the float64 reference:
full and causal with Sq < Sk, Sq == Sk and Sq > Sk (the top-left vs bottom-right trap), GQA,
all dtypes; and its refusals."""
import pytest
import torch

from cp_softcap.kernels import get_kernel
from cp_softcap.testing import assert_finite, check_result, saturating_qkv

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(24, 56), (40, 40), (56, 24)]


@pytest.fixture(scope="module")
def sdpa():
    return get_kernel("sdpa")


@pytest.mark.parametrize("sq,sk", SHAPES, ids=lambda x: str(x))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_matches_reference(sdpa, dtype, causal, sq, sk):
    b, hq, hkv, d = 2, 4, 2, 32
    q, k, v, _ = saturating_qkv(b, sq, sk, hq, hkv, d, dtype, None, spread=3.0)
    dout = torch.randn(b, sq, hq, d).to(dtype)
    window = (None, 0) if causal else (None, None)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    out, lse = sdpa.forward(qd, kd, vd, scale=d ** -0.5, softcap=None, window=window)
    assert out.shape == (b, sq, hq, d) and out.dtype == dtype and lse.shape == (b, hq, sq)
    grads = sdpa.backward(dout, qd, kd, vd, out, lse, scale=d ** -0.5, softcap=None, window=window)
    check_result(out, lse, grads, q, k, v, dout, dtype=dtype, causal=causal)
    if causal and sq > sk:   # bottom-right: the first sq - sk rows see no key
        assert torch.all(out[:, :sq - sk] == 0) and torch.all(lse[:, :, :sq - sk] == float("-inf"))
        assert torch.all(grads[0][:, :sq - sk] == 0)


def test_agrees_with_torch_kernel(sdpa):
    q, k, v, _ = saturating_qkv(1, 30, 50, 4, 1, 16, torch.float32, None, requires_grad=False)
    dout = torch.randn(1, 30, 4, 16)
    t = get_kernel("torch")
    for window in ((None, None), (None, 0)):
        o1, l1 = sdpa.forward(q, k, v, scale=0.3, softcap=None, window=window)
        o2, l2 = t.forward(q, k, v, scale=0.3, softcap=None, window=window)
        torch.testing.assert_close(o1, o2, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-5)
        g1 = sdpa.backward(dout, q, k, v, o1, l1, scale=0.3, softcap=None, window=window)
        g2 = t.backward(dout, q, k, v, o2, l2, scale=0.3, softcap=None, window=window)
        for a, b_ in zip(g1, g2):
            assert_finite(a)
            torch.testing.assert_close(a, b_, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("sq,sk", [(0, 8), (8, 0)])
def test_zero_length(sdpa, sq, sk):
    q, k, v = torch.randn(1, sq, 2, 16), torch.randn(1, sk, 2, 16), torch.randn(1, sk, 2, 16)
    out, lse = sdpa.forward(q, k, v, scale=0.25, softcap=None, window=(None, 0))
    assert out.shape == (1, sq, 2, 16) and torch.all(out == 0) and torch.all(lse == float("-inf"))
    dq, dk, dv = sdpa.backward(torch.ones_like(out), q, k, v, out, lse, scale=0.25, softcap=None,
                               window=(None, 0))
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert all(torch.all(g == 0) for g in (dq, dk, dv))


def test_refuses_softcap(sdpa):
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="softcap=5.0"):
        sdpa.forward(q, q, q, scale=0.25, softcap=5.0, window=(None, None))
    out, lse = sdpa.forward(q, q, q, scale=0.25, softcap=None, window=(None, None))
    with pytest.raises(ValueError, match="softcap=5.0"):
        sdpa.backward(out, q, q, q, out, lse, scale=0.25, softcap=5.0, window=(None, None))


@pytest.mark.parametrize("window", [(3, 0), (None, 2), (4, 4)])
def test_refuses_windows(sdpa, window):
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="window"):
        sdpa.forward(q, q, q, scale=0.25, softcap=None, window=window)


def test_refuses_dlse(sdpa):
    q = torch.randn(1, 8, 2, 16)
    out, lse = sdpa.forward(q, q, q, scale=0.25, softcap=None, window=(None, None))
    with pytest.raises(ValueError, match="LSE"):
        sdpa.backward(out, q, q, q, out, lse, scale=0.25, softcap=None, window=(None, None),
                      dlse=torch.ones_like(lse))


def test_declares_no_softcap():
    caps = get_kernel("sdpa").caps
    assert caps.softcap is False and caps.window is False and caps.dlse is False
