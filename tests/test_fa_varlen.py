"""flash-attn varlen paths of the fa2 (and fa4) adapters for packed documents, on CPU through
stand-in modules: the stand-ins check what the adapter passes (3-D token streams, int32
cu_seqlens equal to the segments, max_seqlen ints, window ints, softcap 0.0 for off, +inf LSE
markers in backward) and compute the varlen math with the torch kernel's segments path, so the
adapters' plumbing and LSE conversions are compared with the float64 masked reference."""
import pytest
import torch

from cp_softcap.kernels.base import Segments
from cp_softcap.kernels.fa2 import FA2Kernel, varlen_reason
from cp_softcap.kernels.torch_kernel import TorchKernel
from cp_softcap.spec import make_spec
from cp_softcap.testing import rel_err
from segment_checks import SEGMENT_CASES, SEGMENT_IDS, check_segmented, inputs
from test_kernel_adapters import _fake_fa2

INF = float("inf")
TK = TorchKernel(block_q=16, block_k=24)


def _segments(cu_q, cu_k, max_q, max_k, q):
    assert q.dim() == 3, "varlen functions take one [total, H, D] stream"
    for cu in (cu_q, cu_k):
        assert cu.dtype == torch.int32 and cu.device == q.device
    segs = Segments(tuple(cu_q.tolist()), tuple(cu_k.tolist()))
    assert max_q == max(b - a for a, b in zip(segs.cu_q, segs.cu_q[1:])) and isinstance(max_q, int)
    assert max_k == max(b - a for a, b in zip(segs.cu_k, segs.cu_k[1:])) and isinstance(max_k, int)
    return segs


def _win(left, right):
    assert isinstance(left, int) and isinstance(right, int)
    return (None if left < 0 else left, None if right < 0 else right)


def varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, window, cap):
    assert dropout_p == 0.0 and causal is False and isinstance(cap, float)
    segs = _segments(cu_q, cu_k, max_q, max_k, q)
    out, lse = TK.forward(q[None], k[None], v[None], scale=scale, softcap=cap or None,
                          window=_win(*window), segments=segs)
    lse = lse[0].float()                                            # [H, total_q]
    return out[0].to(q.dtype), torch.where(lse == -INF, torch.full_like(lse, INF), lse)


def varlen_bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, scale, window, cap):
    assert lse.dim() == 2 and lse.shape[1] == q.shape[0], "varlen LSE is [H, total_q]"
    assert not (lse == -INF).any(), "flash-attn backward must get +inf (not -inf) for empty rows"
    segs = _segments(cu_q, cu_k, max_q, max_k, q)
    lse = torch.where(lse == INF, torch.full_like(lse, -INF), lse)[None]
    g = TK.backward(dout[None], q[None], k[None], v[None], out[None], lse, scale=scale,
                    softcap=cap or None, window=_win(*window), segments=segs)
    for dst, src in zip((dq, dk, dv), g):
        dst.copy_(src[0])


def fake_fa2_varlen(family: str):
    m = _fake_fa2(family)
    if family == "split":
        def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                       max_seqlen_k, dropout_p, softmax_scale, causal,
                                       window_size_left=-1, window_size_right=-1, softcap=0.0,
                                       alibi_slopes=None, return_softmax=False, block_table=None,
                                       leftpad_k=None, seqused_k=None, zero_tensors=False):
            out, lse = varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal,
                                  (window_size_left, window_size_right), softcap)
            return out, lse, None, None

        def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                                        cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                        softmax_scale, causal, window_size_left, window_size_right,
                                        softcap, alibi_slopes, deterministic, rng_state=None,
                                        zero_tensors=False):
            varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                       max_seqlen_q, max_seqlen_k, softmax_scale,
                       (window_size_left, window_size_right), softcap)
            return None
    else:
        def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                       max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                       softcap, alibi_slopes, return_softmax, block_table,
                                       leftpad_k=None, seqused_k=None):
            out, lse = varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  dropout_p, softmax_scale, causal, window_size, softcap)
            return out, q, k, v, out, lse, None, None

        def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                                        cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                        softmax_scale, causal, window_size, softcap, alibi_slopes,
                                        deterministic, rng_state=None):
            varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                       max_seqlen_q, max_seqlen_k, softmax_scale, window_size, softcap)
            return dq, dk, dv, None
    m._flash_attn_varlen_forward = _flash_attn_varlen_forward
    m._flash_attn_varlen_backward = _flash_attn_varlen_backward
    return m


CAPS = [30.0, 50.0, 1.0, 5.0]
# the adapters return a float32 LSE (the contract) and flash-attn computes backward from it
F32_LSE = {"lse": 1e-6, "dq": 1e-5, "dk": 1e-5, "dv": 1e-5}


@pytest.mark.parametrize("family", ["split", "tuple"])
@pytest.mark.parametrize("ci", range(len(SEGMENT_CASES)), ids=SEGMENT_IDS)
def test_fa2_varlen_with_stand_in(ci, family):
    cu_q, cu_k, window, _ = SEGMENT_CASES[ci]
    # batch 2 on odd cases: the rows are joined into one varlen stream, segments repeated
    check_segmented(FA2Kernel(module=fake_fa2_varlen(family)), (cu_q, cu_k), window,
                    softcap=CAPS[ci % 4], dtype=torch.float64, hq=4, hkv=1 + ci % 2, b=1 + ci % 2,
                    tols=F32_LSE)


def test_fa2_batch_rows_joined_and_missing_varlen_functions():
    k = FA2Kernel(module=fake_fa2_varlen("split"))
    q, kk, v, _, _ = inputs(((0, 4, 10), (0, 3, 12)), 2, 2, 16, torch.float64, None, b=3)
    cu_q, cu_k, max_q, max_k = k._packed(((0, 4, 10), (0, 3, 12)), q, kk)
    assert cu_q.tolist() == [0, 4, 10, 14, 20, 24, 30] and cu_k.tolist() == [0, 3, 12, 15, 24, 27, 36]
    assert (max_q, max_k) == (6, 9)
    old = FA2Kernel(module=_fake_fa2("split"))                   # no varlen functions
    assert "varlen" in varlen_reason(old._mod, "split")
    with pytest.raises(RuntimeError, match="varlen"):
        old.forward(q[:1], kk[:1], v[:1], scale=0.25, softcap=None, window=(None, 0),
                    segments=((0, 4, 10), (0, 3, 12)))


def test_fa2_probe_checks_varlen_for_packed_specs(monkeypatch):
    monkeypatch.setattr("cp_softcap.kernels.fa2.cuda_arch", lambda: 90)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    spec = make_spec(head_dim=64, num_heads=4, num_kv_heads=2, dtype=torch.bfloat16,
                     device_type="cuda", softcap=50.0, causal=True, documents=True)
    assert FA2Kernel(module=fake_fa2_varlen("tuple")).probe(spec) is None
    assert "varlen" in FA2Kernel(module=_fake_fa2("tuple")).probe(spec)


# ---- fa4: FA4's _flash_attn_fwd/_bwd with cu_seqlens, through a stand-in of flash_attn.cute ----
def fake_fa4():
    """A stand-in of flash_attn.cute.interface (4.0.0b36 keywords): dense [B, S, H, D] calls, and
    varlen calls on one [total, H, D] stream with an [H, total] LSE (-inf for empty rows, as FA4)."""
    import types

    def _unpack(q, k, cu_q, cu_k, max_q, max_k):
        if cu_q is None:
            assert cu_k is None and max_q is None and max_k is None and q.dim() == 4
            return None
        return _segments(cu_q, cu_k, max_q, max_k, q)

    def _flash_attn_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                        seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None,
                        causal=False, softcap=None, window_size_left=None, window_size_right=None,
                        return_lse=False, score_mod=None, **unused):
        assert causal is False and return_lse and isinstance(softcap, float)
        if score_mod is not None:           # the sm90 form: cap * tanh(u), u = s * scale / cap
            assert softcap == 0.0
            softmax_scale, softcap = softmax_scale * score_mod.cap, score_mod.cap
        segs = _unpack(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        if segs is None:
            out, lse = TK.forward(q, k, v, scale=softmax_scale, softcap=softcap or None,
                                  window=(window_size_left, window_size_right))
            return out.to(q.dtype), lse, None, None, None
        out, lse = TK.forward(q[None], k[None], v[None], scale=softmax_scale, softcap=softcap or None,
                              window=(window_size_left, window_size_right), segments=segs)
        return out[0].to(q.dtype), lse[0].float(), None, None, None

    def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
                        window_size_left=None, window_size_right=None, cu_seqlens_q=None,
                        cu_seqlens_k=None, seqused_q=None, seqused_k=None, max_seqlen_q=None,
                        max_seqlen_k=None, deterministic=False, dq=None, dk=None, dv=None,
                        score_mod=None, score_mod_bwd=None, dlse=None, **unused):
        assert lse.dtype == torch.float32 and lse.is_contiguous()
        assert out.dtype == dout.dtype == q.dtype, "FA4 takes O and dO in the input dtype"
        assert isinstance(deterministic, bool)
        if score_mod is not None:
            assert softcap == 0.0 and score_mod_bwd is not None and score_mod_bwd.cap == score_mod.cap
            softmax_scale, softcap = softmax_scale * score_mod.cap, score_mod.cap
        segs = _unpack(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        kw = dict(scale=softmax_scale, softcap=softcap or None,
                  window=(window_size_left, window_size_right))
        if segs is None:
            return TK.backward(dout, q, k, v, out, lse, dlse=dlse, **kw)
        assert lse.shape == (q.shape[1], q.shape[0]), "varlen LSE is [H, total_q]"
        assert out.shape == dout.shape == q.shape[:2] + v.shape[-1:] and k.shape[0] == v.shape[0]
        assert dlse is None or (dlse.shape == lse.shape and dlse.is_contiguous())
        g = TK.backward(dout[None], q[None], k[None], v[None], out[None], lse[None],
                        dlse=None if dlse is None else dlse[None], segments=segs, **kw)
        given = (dq, dk, dv)
        if all(t is None for t in given):
            return tuple(x[0].to(q.dtype) for x in g)
        for t, x, ref in zip(given, g, (q, k, v)):      # as FA4: checked, written, returned
            assert t.shape == ref.shape and t.dtype == q.dtype and t.device == q.device
            t.copy_(x[0])
        return given

    return types.SimpleNamespace(_flash_attn_fwd=_flash_attn_fwd, _flash_attn_bwd=_flash_attn_bwd)


def _sm90_softcap(monkeypatch):
    """The adapter as on sm90: softcap through score_mod with the scale folded into the cap
    (stand-in mods that carry their cap), instead of FA4's softcap= that the CPU path takes."""
    import functools

    from cp_softcap.kernels import fa4, fa4_softcap

    def mods(cap):
        f, b = (lambda *a: None), (lambda *a: None)
        f.cap = b.cap = cap
        return f, b
    monkeypatch.setattr(fa4, "cuda_arch", lambda device=None: 90)
    monkeypatch.setattr(fa4, "softcap_kwargs", functools.partial(fa4_softcap.softcap_kwargs, mods=mods))


@pytest.mark.parametrize("arch", ["sm90", "other"])
@pytest.mark.parametrize("ci", range(len(SEGMENT_CASES)), ids=SEGMENT_IDS)
def test_fa4_varlen_with_stand_in(ci, arch, monkeypatch):
    from cp_softcap.kernels.fa4 import FA4Kernel
    if arch == "sm90":
        _sm90_softcap(monkeypatch)
    cu_q, cu_k, window, _ = SEGMENT_CASES[ci]
    check_segmented(FA4Kernel(module=fake_fa4()), (cu_q, cu_k), window, softcap=CAPS[ci % 4],
                    dtype=torch.float64, hq=4, hkv=1 + ci % 2, b=1 + ci % 2, tols=F32_LSE)


def test_fa4_varlen_dlse_and_float32_out():
    """The LSE gradient and the float32 O of the CP merge (D corrected through dLSE) reach FA4's
    varlen backward as [H, B * Sq]: gradients equal the torch kernel's on the same inputs."""
    from cp_softcap.kernels.fa4 import FA4Kernel
    segs = Segments((0, 3, 9, 20), (0, 5, 9, 26))
    q, k, v, dout, _ = inputs(segs, 4, 2, 16, torch.float64, 5.0, b=2)
    kw = dict(scale=0.25, softcap=5.0, window=(4, 0), segments=segs)
    fa4 = FA4Kernel(module=fake_fa4())
    out, lse = fa4.forward(q, k, v, **kw)
    ref_out, ref_lse = TK.forward(q, k, v, **kw)
    assert torch.allclose(out, ref_out.to(out.dtype)) and torch.allclose(lse, ref_lse.float())
    dlse = torch.randn_like(lse)
    got = fa4.backward(dout, q, k, v, ref_out.float(), lse, dlse=dlse, **kw)
    want = TK.backward(dout, q, k, v, ref_out, lse, dlse=dlse, **kw)
    for g, w in zip(got, want):
        assert g.shape == w.shape and rel_err(g, w) < 1e-5


def _no_varlen_fa2():
    m = fake_fa2_varlen("split")
    m._flash_attn_varlen_forward = None            # one segment must never reach it
    return FA2Kernel(module=m)


def _fa4():
    from cp_softcap.kernels.fa4 import FA4Kernel
    return FA4Kernel(module=fake_fa4())


@pytest.mark.parametrize("make", [_no_varlen_fa2, _fa4], ids=["fa2", "fa4"])
def test_one_segment_takes_the_unsegmented_path(make):
    """One segment is the ordinary call: same result, no varlen tensors built."""
    kern = make()
    q, kk, v, _, _ = inputs(((0, 10), (0, 12)), 2, 1, 16, torch.float64, 5.0)
    kw = dict(scale=0.25, softcap=5.0, window=(None, 0))
    a = kern.forward(q, kk, v, **kw)
    b = kern.forward(q, kk, v, segments=((0, 10), (0, 12)), **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert kern._varlen._cache == {}, "one segment must not build varlen tensors"


@pytest.mark.parametrize("make", [lambda: FA2Kernel(module=fake_fa2_varlen("split")), _fa4],
                         ids=["fa2", "fa4"])
def test_varlen_gradients_are_adopted_not_copied(make):
    """The varlen backward returns the [B, S, H, D] buffers the kernel wrote (not views of its
    [B * S, H, D] outputs), so a packed call's gradient sum takes them as they are instead of
    copying dQ, dK and dV (2.1 GB read and written at 128K tokens with Gemma2 9B heads)."""
    from cp_softcap.merge import GradAccumulator
    segs = Segments((0, 3, 9, 20), (0, 3, 9, 20))
    q, k, v, dout, _ = inputs(segs, 4, 2, 16, torch.float32, 5.0, b=2)
    kw = dict(scale=0.25, softcap=5.0, window=(None, 0), segments=segs)
    kern = make()
    out, lse = kern.forward(q, k, v, **kw)
    grads = kern.backward(dout, q, k, v, out, lse, **kw)
    want = TK.backward(dout, q, k, v, out, lse, **kw)
    for g, w, x in zip(grads, want, (q, k, v)):
        assert rel_err(g, w) < 1e-5
        acc = GradAccumulator(x.shape, x.dtype, x.device)
        acc.add(0, x.shape[1], g)
        assert acc.result() is g
