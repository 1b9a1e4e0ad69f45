"""cps.attention(q, k, v, cu_seqlens=cu) on one device against the float64 reference of the
whole stream with a block-diagonal document mask (reference_attention(cu_seqlens=)): saturating caps,
windows, GQA, documents of length 1, shorter than a kernel block, spanning blocks, a padding
tail; gradients (and the LSE's); negative controls without boundaries; errors."""
import random

import pytest
import torch

import cp_softcap as cps
from cp_softcap.doc_geometry import stream_calls
from cp_softcap.kernels.torch_kernel import TorchKernel
from cp_softcap.testing import (assert_finite, lse_err, reference_attention, rel_err, saturating_qkv,
                                tolerance)

SMALL = TorchKernel(block_q=16, block_k=24)      # blocks much smaller than the documents

# (cu_seqlens, stream length, causal, window, softcap, heads q/kv)
CASES = [
    ([0, 1, 5, 30, 31, 70], 76, True, None, 50.0, (4, 2)),      # len 1, < block, > block, padding
    ([0, 1, 5, 30, 31, 70], 70, True, (6, 0), 1.0, (3, 1)),     # sliding window, no padding
    ([0, 40, 41, 64], 72, True, (20, 0), 30.0, (2, 2)),         # window wider than a block
    ([0, 9, 50], 56, False, None, 5.0, (4, 2)),                 # bidirectional documents
    ([0, 9, 50], 50, False, (3, 4), 5.0, (4, 4)),               # two-sided window
]
IDS = ["causal-pad", "window6", "window20", "bidir-pad", "two-sided"]


def _reference(q, k, v, dout, cu, causal, window, softcap, dlse=None):
    leaves = [x.detach().to(torch.float64).requires_grad_(True) for x in (q, k, v)]
    w = (None, None) if window is None else window
    out, lse = reference_attention(*leaves, cu_seqlens=cu, softcap=softcap, causal=causal, window=w)
    outs, grads_in = [out], [dout.to(torch.float64)]
    if dlse is not None:
        outs.append(lse)
        grads_in.append(dlse.to(torch.float64))
    grads = torch.autograd.grad(outs, leaves, grads_in, allow_unused=True)
    return out.detach(), lse.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_packed_matches_reference(case, dtype):
    cu, t, causal, window, softcap, (hq, hkv) = case
    torch.manual_seed(0)
    q, k, v, frac = saturating_qkv(1, t, t, hq, hkv, 16, dtype, softcap)
    assert frac > 0.4
    dout = torch.randn(1, t, hq, 16, dtype=dtype)
    dlse = torch.randn(1, hq, t, dtype=dtype)
    out, lse = cps.attention(q, k, v, softcap=softcap, causal=causal, window=window, backend=SMALL,
                             cu_seqlens=torch.tensor(cu), return_lse=True)
    grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    ref_out, ref_lse, ref_grads = _reference(q, k, v, dout, cu, causal, window, softcap, dlse)
    assert_finite(out, "out")
    for g in grads:
        assert_finite(g, "grad")
    errs = {"out": rel_err(out, ref_out), "lse": lse_err(lse, ref_lse)}
    errs.update({n: rel_err(g, r) for n, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)})
    tol = {n: tolerance(dtype, n if n in ("out", "lse") else "grad_exact") for n in errs}
    assert all(errs[n] <= tol[n] for n in errs), errs
    pad = slice(cu[-1], t)                      # padding: out 0, LSE -inf, zero gradients
    assert bool((out[:, pad] == 0).all()) and bool((lse[:, :, pad] == float("-inf")).all())
    assert all(bool((g[:, pad] == 0).all()) for g in grads)
    # negative control: the same stream without document boundaries differs
    no_docs, _, _ = _reference(q, k, v, dout, [0, cu[-1]], causal, window, softcap)
    assert rel_err(out, no_docs) > 10 * tolerance(dtype, "out")


def test_auto_backend_on_cpu_serves_packed_calls_without_softcap():
    """Without softcap sdpa would be first on CPU: packed calls must not reach it."""
    cu, t = [0, 3, 20, 21, 40], 44
    q, k, v, _ = saturating_qkv(1, t, t, 4, 2, 16, torch.float64, None, spread=3.0)
    out = cps.attention(q, k, v, cu_seqlens=cu)
    ref, _, _ = _reference(q, k, v, torch.zeros(1, t, 4, 16), cu, True, None, None)
    assert rel_err(out, ref) < 1e-12
    no_docs, _, _ = _reference(q, k, v, torch.zeros(1, t, 4, 16), [0, cu[-1]], True, None, None)
    assert rel_err(out, no_docs) > 1e-3


@pytest.mark.parametrize("window", [None, (7, 0)])
def test_one_document_is_the_unpacked_call_bitwise(window):
    q, k, v, _ = saturating_qkv(1, 48, 48, 4, 2, 16, torch.float32, 5.0)
    kw = dict(softcap=5.0, window=window, backend=SMALL)
    whole = cps.attention(q, k, v, **kw)
    assert torch.equal(cps.attention(q, k, v, cu_seqlens=[0, 48], **kw), whole)
    # one document and a padding tail: the document's rows are the unpacked call on its tokens
    part = cps.attention(q[:, :40], k[:, :40], v[:, :40], **kw)
    padded = cps.attention(q, k, v, cu_seqlens=[0, 40], **kw)
    assert torch.equal(padded[:, :40], part) and bool((padded[:, 40:] == 0).all())


def test_cp_attention_without_group_takes_the_packed_path():
    q, k, v, _ = saturating_qkv(1, 30, 30, 2, 1, 16, torch.float64, 30.0)
    a = cps.cp_attention(q, k, v, softcap=30.0, cu_seqlens=[0, 7, 25])
    b = cps.attention(q, k, v, softcap=30.0, cu_seqlens=[0, 7, 25])
    assert torch.equal(a, b)


def test_batch_of_streams_and_a_layout_as_boundaries():
    """B streams sharing the boundaries equal each stream alone; a PackedLayout (what CP code
    may pass through cp_attention) stands for its boundaries."""
    from cp_softcap.documents import packed_layout
    cu = [0, 1, 9, 30, 44]
    q, k, v, _ = saturating_qkv(3, 48, 48, 4, 2, 16, torch.float64, 5.0)
    both = cps.attention(q, k, v, softcap=5.0, cu_seqlens=cu, backend=SMALL)
    for b in range(3):
        one = cps.attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], softcap=5.0, cu_seqlens=cu, backend=SMALL)
        assert torch.equal(both[b:b + 1], one)
    layout = packed_layout(cu, 48, 2)
    assert torch.equal(cps.attention(q, k, v, softcap=5.0, cu_seqlens=layout, backend=SMALL), both)


def test_stream_calls_rows_never_overlap():
    """The single-device path writes each call's rows without merging: rows must be disjoint."""
    rng = random.Random(0)
    for _ in range(200):
        t = rng.randint(1, 120)
        cuts = sorted(rng.sample(range(1, t + 1), rng.randint(1, min(t, 12))))
        cu = tuple([0] + cuts)
        window = rng.choice([(None, 0), (None, None), (rng.randint(0, 9), 0),
                             (rng.randint(0, 5), rng.randint(0, 5))])
        seen = torch.zeros(t, dtype=torch.int64)
        for c in stream_calls(cu, t, window):
            seen[c.q0:c.q1] += 1
        assert int(seen.max()) <= 1 and int(seen[:cu[-1]].min()) == 1


@pytest.mark.parametrize("kwargs,match", [
    (dict(k_len=20), "same stream"),
    (dict(cu=[1, 10]), "start at 0"),
    (dict(cu=[0, 10, 40]), "40"),
    (dict(cu=torch.tensor([0.0, 10.0])), "integers"),
])
def test_bad_packed_inputs(kwargs, match):
    b, kl = kwargs.get("batch", 1), kwargs.get("k_len", 30)
    q = torch.randn(b, 30, 2, 8)
    k = torch.randn(b, kl, 2, 8)
    with pytest.raises((ValueError, TypeError), match=match):
        cps.attention(q, k, k, cu_seqlens=kwargs.get("cu", [0, 10, 30]))
