"""The float64 packed-document reference (cp_softcap.testing.reference_attention with
cu_seqlens=), and the packed geometry run through it: every rank's calls
(cp_softcap.doc_geometry) with their masks, merged by LSE, reproduce the reference, which is
what the kernels of the next layer must do.

Logits saturate the cap (|s| well above 2 * cap on most entries, caps 1-5 and 30/50); negative
controls show that dropping the document boundaries, the cap, or a call's mask is detected.
"""
import random

import pytest
import torch

from cp_softcap import sharding
from cp_softcap.doc_geometry import step_calls, stream_calls
from cp_softcap.documents import packed_layout
from cp_softcap.spec import normalize_window
from cp_softcap.testing import masked_attention, reference_attention

CAPS = [1.0, 5.0, 30.0, 50.0]


def inputs(s, hq=4, hkv=2, d=8, cap=5.0, grad=True):
    """q/k/v whose scores have std ~ 4 * cap (saturating tanh)."""
    a = (4.0 * cap) ** 0.5
    q = (torch.randn(1, s, hq, d, dtype=torch.float64) * a).requires_grad_(grad)
    k = (torch.randn(1, s, hkv, d, dtype=torch.float64) * a).requires_grad_(grad)
    v = torch.randn(1, s, hkv, d, dtype=torch.float64).requires_grad_(grad)
    return q, k, v


def finite_or_padding(out, lse, pad_rows):
    assert torch.isfinite(out).all()
    assert torch.isfinite(lse[..., :pad_rows]).all()
    assert torch.isneginf(lse[..., pad_rows:]).all()


def grads(fn, q, k, v, w):
    out, lse = fn(q, k, v)
    gq, gk, gv = torch.autograd.grad((out * w).sum(), (q, k, v))
    return out.detach(), lse.detach(), gq, gk, gv


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("causal, window", [(True, None), (True, (3, 0)), (False, None), (False, (2, 4))])
def test_one_document_equals_unpacked(cap, causal, window):
    q, k, v = inputs(24, cap=cap)
    kw = dict(softcap=cap, causal=causal, window=window or (None, None))
    w = torch.randn(1, 24, 4, 8, dtype=torch.float64)
    got = grads(lambda *t: reference_attention(*t, cu_seqlens=[0, 24], **kw), q, k, v, w)
    want = grads(lambda *t: reference_attention(*t, **kw), q, k, v, w)
    for g, r in zip(got, want):          # out, lse, dq, dk, dv
        assert torch.isfinite(g).all() and torch.allclose(g, r, atol=1e-10)


@pytest.mark.parametrize("cap", CAPS)
def test_documents_equal_separate_calls_and_padding_is_inert(cap):
    """Each document alone (reference_attention on its slice) gives the packed result; padding
    rows: out 0, LSE -inf, zero gradients, no NaN. Gradients compared with one shared weight."""
    cu, s = [0, 1, 6, 7, 19, 30], 34
    for causal, window in ((True, None), (True, (4, 0)), (False, (1, 2))):
        q, k, v = inputs(s, cap=cap)
        w = torch.randn(1, s, 4, 8, dtype=torch.float64)
        out, lse = reference_attention(q, k, v, cu_seqlens=cu, softcap=cap, causal=causal, window=window or (None, None))
        finite_or_padding(out, lse, cu[-1])
        g = torch.autograd.grad((out * w).sum(), (q, k, v))
        assert all(torch.isfinite(t).all() for t in g)
        assert (out[:, cu[-1]:] == 0).all() and all((t[:, cu[-1]:] == 0).all() for t in g)
        for a, b in zip(cu, cu[1:]):
            sl = [t[:, a:b].detach().requires_grad_() for t in (q, k, v)]
            o, l = reference_attention(*sl, softcap=cap, causal=causal, window=window or (None, None))
            gs = torch.autograd.grad((o * w[:, a:b]).sum(), sl)
            assert torch.allclose(o, out[:, a:b], atol=1e-11), (a, b)
            assert torch.allclose(l, lse[:, :, a:b], atol=1e-11), (a, b)
            for full, part in zip(g, gs):
                assert torch.allclose(full[:, a:b], part, atol=1e-9), (a, b)


def test_negative_controls():
    """Ignoring the boundaries, or the cap, changes the packed result."""
    cu, s = [0, 5, 13, 20], 20
    q, k, v = inputs(s, cap=2.0, grad=False)
    out, _ = reference_attention(q, k, v, cu_seqlens=cu, softcap=2.0, causal=True)
    one, _ = reference_attention(q, k, v, cu_seqlens=[0, s], softcap=2.0, causal=True)
    nocap, _ = reference_attention(q, k, v, cu_seqlens=cu, softcap=None, causal=True)
    assert torch.allclose(out[:, :5], one[:, :5])                 # the first document is unaffected
    assert (out[:, 5:] - one[:, 5:]).abs().max() > 1e-2
    assert (out - nocap).abs().max() > 1e-2


def test_boundaries_as_tensor_and_bad_boundaries():
    """A tensor of boundaries gives the list's result; boundaries the library rejects, or q and
    k/v of different lengths, are refused with the library's error."""
    cu, s = [0, 3, 10], 12
    q, k, v = inputs(s, grad=False)
    out, lse = reference_attention(q, k, v, cu_seqlens=cu, softcap=2.0, causal=True)
    t_out, t_lse = reference_attention(q, k, v, cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                                       softcap=2.0, causal=True)
    assert torch.equal(out, t_out) and torch.equal(lse, t_lse)
    with pytest.raises(ValueError, match="strictly increasing"):
        reference_attention(q, k, v, cu_seqlens=[0, 3, 3, 10])
    with pytest.raises(ValueError, match="past the stream length"):
        reference_attention(q, k, v, cu_seqlens=[0, 3, 13])
    with pytest.raises(ValueError, match="same stream"):
        reference_attention(q[:, :10], k, v, cu_seqlens=cu)


def merge(parts, rows, hq, dv):
    """LSE-merge float64 partials [(rows index, out, lse)] into (out [1, rows, hq, dv], lse)."""
    lse = torch.full((1, hq, rows), float("-inf"), dtype=torch.float64)
    for idx, _, l in parts:
        lse[:, :, idx] = torch.logaddexp(lse[:, :, idx], l)
    out = torch.zeros(1, rows, hq, dv, dtype=torch.float64)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    for idx, o, l in parts:
        out[:, idx] += o * torch.exp(l - safe[:, :, idx]).transpose(1, 2).unsqueeze(-1)
    return out, lse


def run_geometry(layout, q, k, v, cap, window, masked=True):
    """Every rank's packed calls, each a masked float64 attention, merged per rank."""
    shards = [[sharding.shard(t, layout.cp, r, cu_seqlens=layout) for t in (q, k, v)]
              for r in range(layout.cp)]
    results = []
    for rq in range(layout.cp):
        qs = shards[rq][0]
        parts = []
        for rk in range(layout.cp):
            ks, vs = shards[rk][1], shards[rk][2]
            for c in step_calls(layout, rq, rk, window):
                vis = c.mask() if masked else torch.ones(c.q1 - c.q0, c.k1 - c.k0, dtype=torch.bool)
                o, l = masked_attention(qs[:, c.q0:c.q1], ks[:, c.k0:c.k1], vs[:, c.k0:c.k1], vis, softcap=cap)
                parts.append((torch.arange(c.q0, c.q1), o, l))
        results.append(merge(parts, qs.shape[1], qs.shape[2], vs.shape[-1]))
    return results


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_packed_geometry_reproduces_reference(cp):
    """Simulated CP: rank rq's calls against every rank's shards, with their masks, LSE-merged,
    equal the reference's rows of rq (padding rows LSE -inf, out 0); a negative control that
    runs each call's rectangle unmasked must fail."""
    rng = random.Random(cp)
    total = 16 * cp + 3
    cu = [0]
    while cu[-1] < total - 4:
        cu.append(min(total - 4, cu[-1] + rng.choice([1, 3, 9, total // 2])))
    q, k, v = inputs(total, cap=3.0, grad=False)
    layout = packed_layout(cu, total, cp)
    padded = [sharding.pad_to_multiple(t, layout.seq_len) for t in (q, k, v)]
    for causal, window in ((True, None), (True, (5, 0)), (False, None), (False, (2, 3))):
        w = normalize_window(window, causal)
        ref_out, ref_lse = reference_attention(*padded, cu_seqlens=cu, softcap=3.0, causal=causal, window=w)
        got = run_geometry(layout, q, k, v, 3.0, w)
        for r, (out, lse) in enumerate(got):
            idx = layout.index(r)
            assert torch.allclose(out, ref_out[:, idx], atol=1e-10), (r, w)
            finite = torch.isfinite(ref_lse[:, :, idx])
            assert torch.equal(finite, torch.isfinite(lse)), (r, w)
            assert torch.allclose(lse[finite], ref_lse[:, :, idx][finite], atol=1e-10), (r, w)
        masked_somewhere = any(not c.mask().all() for rq in range(cp) for rk in range(cp)
                               for c in step_calls(layout, rq, rk, w))
        if masked_somewhere:                 # (full attention over whole documents needs no mask)
            bad = run_geometry(layout, q, k, v, 3.0, w, masked=False)
            assert any(not torch.allclose(o, ref_out[:, layout.index(r)], atol=1e-6)
                       for r, (o, _) in enumerate(bad)), w
        else:
            assert w == (None, None)


def test_stream_calls_reproduce_reference():
    cu, s = (0, 2, 3, 11, 20), 23
    q, k, v = inputs(s, cap=1.0, grad=False)
    for w in [(None, 0), (3, 0), (None, None)]:
        ref_out, _ = reference_attention(q, k, v, cu_seqlens=cu, softcap=1.0, window=w)
        parts = []
        for c in stream_calls(cu, s, w):
            o, l = masked_attention(q[:, c.q0:c.q1], k[:, c.k0:c.k1], v[:, c.k0:c.k1], c.mask(), softcap=1.0)
            parts.append((torch.arange(c.q0, c.q1), o, l))
        out, _ = merge(parts, s, 4, 8)
        assert torch.allclose(out, ref_out, atol=1e-11)
