"""Autocast (single device, CPU bf16): every entry point and CPU kernel gives the same result
inside and outside `torch.autocast`, forward and backward, and that result matches the float64
reference (the library decides the computation precision; autocast must not lower the score
matmuls to bf16, which saturated softcaps turn into large errors). The CP algorithms are
checked the same way in tests_dist/test_robustness.py; CUDA bf16/fp16 in tests/test_gpu_cp.py."""
from __future__ import annotations

import pytest
import torch

import cp_softcap as cps
from cp_softcap.integrations.hf import cp_softcap_attention
from cp_softcap.testing import (assert_cap_matters, check_against_reference, reference_with_grads,
                                saturating_qkv)


def _attention(backend):
    return lambda q, k, v, **kw: cps.attention(q, k, v, backend=backend, **kw)


def _layer(q, k, v, **kw):
    return cps.CPAttention(None, **kw)(q, k, v)


def _hf(q, k, v, softcap, causal):
    assert causal
    out, _ = cp_softcap_attention(torch.nn.Module(), q.transpose(1, 2), k.transpose(1, 2),
                                  v.transpose(1, 2), softcap=softcap)
    return out


ENTRIES = [("attention-torch", _attention("torch"), 50.0), ("attention-torch-cap2", _attention("torch"), 2.0),
           ("attention-auto", _attention("auto"), 30.0), ("attention-sdpa", _attention("sdpa"), None),
           ("cp_attention-no-group", lambda q, k, v, **kw: cps.cp_attention(q, k, v, None, **kw), 5.0),
           ("CPAttention-no-group", _layer, 50.0), ("hf", _hf, 50.0)]


def _run(fn, q, k, v, dout, softcap):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v, softcap=softcap, causal=True)
    out.backward(dout)
    return (out,) + tuple(t.grad for t in (q, k, v))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name,fn,softcap", ENTRIES, ids=[e[0] for e in ENTRIES])
def test_same_result_inside_and_outside_autocast(name, fn, softcap, dtype):
    torch.manual_seed(0)
    q, k, v, _ = saturating_qkv(1, 64, 64, 4, 2, 16, dtype, softcap, requires_grad=False)
    dout = torch.randn(q.shape, dtype=torch.float64).to(dtype)
    plain = _run(fn, q, k, v, dout, softcap)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = _run(fn, q, k, v, dout, softcap)
    for what, a, b in zip(("out", "dq", "dk", "dv"), inside, plain):
        assert a.dtype == b.dtype == dtype, (what, a.dtype)
        assert torch.equal(a, b), f"{name}: {what} differs under autocast"
    ref_out, _, ref_grads = reference_with_grads(q, k, v, dout, softcap=softcap, causal=True)
    check_against_reference(inside[0], inside[1:], ref_out, ref_grads, dtype, label=name)
    if softcap:
        assert_cap_matters(q, k, v, softcap=softcap, dtype=dtype, causal=True, out=inside[0])


def test_flex_forward_inside_and_outside_autocast():
    """flex has no CPU backward: its forward only."""
    torch.manual_seed(1)
    q, k, v, _ = saturating_qkv(1, 32, 32, 2, 2, 16, torch.float32, 30.0, requires_grad=False)
    plain = cps.attention(q, k, v, softcap=30.0, backend="flex")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = cps.attention(q, k, v, softcap=30.0, backend="flex")
    assert inside.dtype == torch.float32 and torch.equal(inside, plain)
    ref_out, _, _ = reference_with_grads(q, k, v, torch.zeros_like(q), softcap=30.0, causal=True)
    check_against_reference(inside, None, ref_out, None, torch.float32, label="flex")
