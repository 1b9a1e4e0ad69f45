"""cps.attention end to end with autograd against the float64 reference: saturating caps, GQA,
causal, windows with Sq != Sk (bottom-right), all dtypes; return_lse with a gradient through the
LSE; non-contiguous inputs; inputs without requires_grad; empty batch/sequence; and the negative
control proving a dropped cap would be caught. Every check rejects NaN/inf."""
import pytest
import torch

import cp_softcap as cps
from cp_softcap.testing import (GRAD_NAMES, assert_cap_matters, assert_finite, check_against_reference,
                                reference_with_grads, saturating_qkv)

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
DT_IDS = ["fp64", "fp32", "fp16", "bf16"]
NEG_INF = float("-inf")

# (b, sq, sk, hq, hkv, d, softcap, causal, window)
CASES = [
    (2, 40, 40, 4, 2, 32, 50.0, True, None),         # Gemma2 global layer style
    (1, 48, 48, 4, 1, 16, 30.0, True, (11, 0)),      # Gemma2 local layer style, MQA
    (2, 24, 56, 2, 2, 16, 5.0, False, (6, 9)),       # shifted two-sided window, Sq < Sk
    (1, 56, 24, 4, 2, 16, 1.0, True, None),          # Sq > Sk causal: empty leading rows
    (1, 32, 40, 6, 3, 16, 50.0, False, None),        # full, GQA 2
]
CASE_IDS = [f"cap{c[6]:g}-{'causal' if c[7] else 'full'}-w{c[8]}-q{c[1]}k{c[2]}" for c in CASES]


def _leaf(x):
    return x.detach().clone().requires_grad_(True)


def run_attention(q, k, v, dout, dlse=None, **kw):
    """cps.attention forward + autograd backward; returns (out, lse, (dq, dk, dv)). Calls with
    Sq != Sk are bottom-right aligned, as the reference's default (bottom_right=True)."""
    kw.setdefault("causal_align", "bottom_right")
    q, k, v = _leaf(q), _leaf(k), _leaf(v)
    if dlse is None:
        out = cps.attention(q, k, v, **kw)
        lse = None
        loss = (out.to(torch.float64) * dout.to(torch.float64)).sum()
    else:
        out, lse = cps.attention(q, k, v, return_lse=True, **kw)
        finite = lse != NEG_INF
        loss = (out.to(torch.float64) * dout.to(torch.float64)).sum() + \
            torch.where(finite, lse.to(torch.float64) * dlse.to(torch.float64), torch.zeros((), dtype=torch.float64)).sum()
    loss.backward()
    return out.detach(), None if lse is None else lse.detach(), (q.grad, k.grad, v.grad)


def compare(q, k, v, dout, out, lse, grads, dtype, dlse=None, **ref_kw):
    ref_out, ref_lse, ref_grads = reference_with_grads(q, k, v, dout, dlse=dlse, **ref_kw)
    for g, x in zip(grads, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
    return check_against_reference(out, grads, ref_out, ref_grads, dtype, lse=lse, ref_lse=ref_lse)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_matches_reference(dtype, case):
    b, sq, sk, hq, hkv, d, cap, causal, window = case
    q, k, v, frac = saturating_qkv(b, sq, sk, hq, hkv, d, dtype, cap)
    assert frac > 0.4
    dout = torch.randn(b, sq, hq, d).to(dtype)
    out, _, grads = run_attention(q, k, v, dout, softcap=cap, causal=causal, window=window)
    assert out.dtype == dtype and out.shape == (b, sq, hq, d)
    compare(q, k, v, dout, out, None, grads, dtype, softcap=cap, causal=causal, window=window)
    assert_cap_matters(q, k, v, softcap=cap, dtype=dtype, causal=causal, window=window, out=out)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("causal,sq,sk", [(False, 32, 32), (True, 24, 40), (True, 40, 24)])
def test_no_softcap_sdpa_path(dtype, causal, sq, sk):
    q, k, v, _ = saturating_qkv(2, sq, sk, 4, 2, 16, dtype, None, spread=3.0)
    dout = torch.randn(2, sq, 4, 16).to(dtype)
    assert cps.select(cps.make_spec(head_dim=16, num_heads=4, num_kv_heads=2, dtype=dtype,
                                    device_type="cpu", causal=causal)).name == "sdpa"
    out, _, grads = run_attention(q, k, v, dout, causal=causal)
    ref_out, ref_lse, ref_grads = reference_with_grads(q, k, v, dout, causal=causal, out_used=out)
    check_against_reference(out, grads, ref_out, ref_grads, dtype)   # sdpa's backward sees the rounded out


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("window", [None, (5, 0)])
def test_return_lse_with_lse_gradient(dtype, window):
    q, k, v, _ = saturating_qkv(1, 36, 44, 4, 2, 16, dtype, 30.0)
    dout = torch.randn(1, 36, 4, 16).to(dtype)
    dlse = torch.randn(1, 4, 36)
    out, lse, grads = run_attention(q, k, v, dout, dlse=dlse, softcap=30.0, causal=True, window=window)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert lse.shape == (1, 4, 36)
    compare(q, k, v, dout, out, lse, grads, dtype, dlse=dlse, softcap=30.0, causal=True, window=window)
    # the lse term really contributes to the gradient
    _, _, plain = run_attention(q, k, v, dout, softcap=30.0, causal=True, window=window)
    assert (plain[0].double() - grads[0].double()).abs().max() > 1e-2 * grads[0].double().abs().max()


@pytest.mark.parametrize("window", [None, (5, 0)])
def test_decode_step_bottom_right_equals_reference(window):
    """One new query over 33 cached keys (a decode step), the alignment said explicitly: the
    query is the last position, as the float64 reference computes it."""
    q, k, v, _ = saturating_qkv(2, 1, 33, 4, 2, 16, torch.float64, 5.0)
    dout = torch.randn(2, 1, 4, 16, dtype=torch.float64)
    out, _, grads = run_attention(q, k, v, dout, softcap=5.0, causal=True, window=window,
                                  causal_align="bottom_right")
    compare(q, k, v, dout, out, None, grads, torch.float64, softcap=5.0, causal=True, window=window)
    with pytest.raises(ValueError, match=r"q has 1 tokens and k/v have 33.*causal_align"):
        cps.attention(q, k, v, softcap=5.0, window=window)


@pytest.mark.parametrize("used", ["lse only", "out only"])
def test_one_of_out_and_lse_unused(used):
    """The unused output's gradient reaches the backward as None (materialize_grads off)."""
    q, k, v, _ = saturating_qkv(1, 28, 32, 4, 2, 16, torch.float32, 30.0)
    q, k, v = _leaf(q), _leaf(k), _leaf(v)
    out, lse = cps.attention(q, k, v, softcap=30.0, causal=True, return_lse=True,
                             causal_align="bottom_right")
    dout, dlse = torch.randn(1, 28, 4, 16), torch.randn(1, 4, 28)
    if used == "lse only":
        dout = torch.zeros_like(dout)
        (lse * dlse).sum().backward()
    else:
        dlse = None
        (out * dout).sum().backward()
    compare(q, k, v, dout, out, lse, (q.grad, k.grad, v.grad), torch.float32, dlse=dlse,
            softcap=30.0, causal=True)


def test_return_lse_forward_only_values():
    q, k, v, _ = saturating_qkv(1, 20, 12, 2, 1, 16, torch.float32, 5.0, requires_grad=False)
    out, lse = cps.attention(q, k, v, softcap=5.0, causal=True, return_lse=True,
                             causal_align="bottom_right")
    ref_out, ref_lse, _ = reference_with_grads(q, k, v, torch.zeros(1, 20, 2, 16), softcap=5.0, causal=True)
    check_against_reference(out, None, ref_out, None, torch.float32, lse=lse, ref_lse=ref_lse)
    assert torch.all(lse[:, :, :8] == NEG_INF) and torch.all(out[:, :8] == 0)


@pytest.mark.parametrize("softcap", [None, 50.0])
def test_non_contiguous_inputs(softcap):
    """[B, H, S, D] tensors transposed to [B, S, H, D], and strided slices, give the same result
    (forward and grads) as contiguous copies."""
    b, s, hq, hkv, d = 2, 40, 4, 2, 16
    q4, k4, v4, _ = saturating_qkv(b, s, s, hq, hkv, d, torch.float32, softcap or 1.0, requires_grad=False)
    qt = q4.transpose(1, 2).contiguous().requires_grad_(True)          # [B, H, S, D] storage
    kt = torch.cat([k4, k4], dim=-1).transpose(1, 2).contiguous().requires_grad_(True)   # wider, sliced below
    vt = v4.transpose(1, 2).contiguous().requires_grad_(True)
    q, k, v = qt.transpose(1, 2), kt.transpose(1, 2)[..., :d], vt.transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous() and not v.is_contiguous()
    dout = torch.randn(b, s, hq, d).transpose(1, 2).contiguous().transpose(1, 2)   # non-contiguous dout
    out = cps.attention(q, k, v, softcap=softcap, causal=True)
    out.backward(dout)
    out_c, _, grads_c = run_attention(q4, k4, v4, dout.contiguous(), softcap=softcap, causal=True)
    assert_finite(out)
    torch.testing.assert_close(out, out_c, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(qt.grad.transpose(1, 2), grads_c[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kt.grad.transpose(1, 2)[..., :d], grads_c[1], rtol=1e-5, atol=1e-6)
    assert torch.all(kt.grad.transpose(1, 2)[..., d:] == 0)
    torch.testing.assert_close(vt.grad.transpose(1, 2), grads_c[2], rtol=1e-5, atol=1e-6)
    compare(q4, k4, v4, dout, out.detach(), None, (qt.grad.transpose(1, 2), kt.grad.transpose(1, 2)[..., :d],
                                                    vt.grad.transpose(1, 2)), torch.float32,
            softcap=softcap, causal=True)


@pytest.mark.parametrize("softcap", [None, 50.0])
def test_inputs_without_requires_grad(softcap):
    q, k, v, _ = saturating_qkv(1, 24, 24, 4, 2, 16, torch.bfloat16, softcap or 1.0, requires_grad=False)
    out = cps.attention(q, k, v, softcap=softcap, causal=True)
    assert not out.requires_grad
    ref_out, _, _ = reference_with_grads(q, k, v, torch.zeros(1, 24, 4, 16), softcap=softcap, causal=True)
    check_against_reference(out, None, ref_out, None, torch.bfloat16)
    with torch.no_grad():
        out2 = cps.attention(q.requires_grad_(), k, v, softcap=softcap, causal=True)
    assert not out2.requires_grad
    torch.testing.assert_close(out, out2, rtol=0, atol=0)


def test_only_q_requires_grad():
    q, k, v, _ = saturating_qkv(1, 24, 30, 4, 2, 16, torch.float32, 50.0, requires_grad=False)
    q.requires_grad_(True)
    dout = torch.randn(1, 24, 4, 16)
    out = cps.attention(q, k, v, softcap=50.0, causal=True, causal_align="bottom_right")
    out.backward(dout)
    assert k.grad is None and v.grad is None
    _, _, ref_grads = reference_with_grads(q, k, v, dout, softcap=50.0, causal=True)
    check_against_reference(out.detach(), (q.grad, torch.zeros_like(k), torch.zeros_like(v)),
                            reference_with_grads(q, k, v, dout, softcap=50.0, causal=True)[0],
                            (ref_grads[0], torch.zeros_like(k), torch.zeros_like(v)), torch.float32)


@pytest.mark.parametrize("softcap", [None, 50.0])
@pytest.mark.parametrize("b,sq,sk", [(0, 8, 8), (2, 0, 8), (2, 8, 0), (2, 0, 0)])
def test_empty_batch_or_sequence(b, sq, sk, softcap):
    """Decision: B = 0 or S = 0 is not an error; the result is the correct empty attention: the
    right shapes, out = 0 and lse = -inf for rows with no keys, and zero gradients."""
    q = torch.randn(b, sq, 4, 16, requires_grad=True)
    k = torch.randn(b, sk, 2, 16, requires_grad=True)
    v = torch.randn(b, sk, 2, 16, requires_grad=True)
    out, lse = cps.attention(q, k, v, softcap=softcap, causal=True, return_lse=True)
    assert out.shape == (b, sq, 4, 16) and lse.shape == (b, 4, sq)
    assert torch.all(out == 0) and torch.all(lse == NEG_INF)
    (out.sum() + torch.where(lse == NEG_INF, 0.0, lse).sum()).backward()
    for x in (q, k, v):
        assert x.grad is not None and x.grad.shape == x.shape and torch.all(x.grad == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("softcap", [1.0, 5.0, 30.0, 50.0])
def test_dropped_cap_would_fail(dtype, softcap):
    """Negative control: the capped result passes against the capped reference and FAILS against
    the uncapped one (out and, for the gradients, dq), so a kernel that silently dropped the cap
    could not pass these tests."""
    q, k, v, _ = saturating_qkv(1, 32, 32, 2, 1, 16, dtype, softcap)
    dout = torch.randn(1, 32, 2, 16).to(dtype)
    out, _, grads = run_attention(q, k, v, dout, softcap=softcap, causal=True)
    compare(q, k, v, dout, out, None, grads, dtype, softcap=softcap, causal=True)
    diff = assert_cap_matters(q, k, v, softcap=softcap, dtype=dtype, causal=True, out=out)
    assert diff > 0.1
    nocap_out, _, nocap_grads = reference_with_grads(q, k, v, dout, causal=True)
    with pytest.raises(AssertionError, match="rel err"):
        check_against_reference(out, grads, nocap_out, nocap_grads, dtype)


# ------------------------------------------------------------------ measured error table
def test_error_table(capsys):
    """Max relative error of out/dq/dk/dv per dtype over the end-to-end cases (saturating caps
    1/5/30/50, GQA, causal, windows, Sq != Sk). Printed for the issue note (pytest -s)."""
    torch.manual_seed(1234)
    rows = {}
    for dtype, name in zip(DTYPES, DT_IDS):
        worst = dict.fromkeys(("out",) + GRAD_NAMES, 0.0)
        for case in CASES:
            b, sq, sk, hq, hkv, d, cap, causal, window = case
            q, k, v, _ = saturating_qkv(b, sq, sk, hq, hkv, d, dtype, cap)
            dout = torch.randn(b, sq, hq, d).to(dtype)
            out, _, grads = run_attention(q, k, v, dout, softcap=cap, causal=causal, window=window)
            errs = compare(q, k, v, dout, out, None, grads, dtype, softcap=cap, causal=causal, window=window)
            for key in worst:
                worst[key] = max(worst[key], errs[key])
        rows[name] = worst
    with capsys.disabled():
        print("\ncps.attention vs float64 reference, max relative error (max|x-ref|/max|ref|):")
        print(f"{'dtype':<6}" + "".join(f"{c:>11}" for c in ("out",) + GRAD_NAMES))
        for name, worst in rows.items():
            print(f"{name:<6}" + "".join(f"{worst[c]:>11.2e}" for c in ("out",) + GRAD_NAMES))
