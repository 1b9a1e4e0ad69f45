"""CPU tests of the GPU adapters' pure logic: probe messages without packages/CUDA, signature
detection by parameter names (fa2/fa3), LSE normalisation, FA4 arch rules, flex's final-LSE
reweighting and CPU forward, and the sdpa CUDA split plan. Stand-in modules run the torch kernel."""
import warnings

import pytest
import torch

from cp_softcap.kernels import _common, get_kernel
from cp_softcap.kernels.fa2 import FA2Kernel, backward_has_softcap, signature_family
from cp_softcap.kernels.fa3 import bind_kwargs
from cp_softcap.kernels.fa4 import FA4Kernel, fa4_rejection, tile_window
from cp_softcap.kernels.flex import reweighted_grads_inputs
from cp_softcap.kernels.sdpa import SdpaKernel
from cp_softcap.kernels.torch_kernel import TorchKernel
from cp_softcap.merge import merge
from cp_softcap.spec import make_spec

INF = float("inf")


def _spec(**kw):
    base = dict(head_dim=128, num_heads=4, num_kv_heads=2, dtype=torch.bfloat16, device_type="cuda",
                softcap=50.0, causal=True)
    base.update(kw)
    return make_spec(**base)


# ---- LSE normalisation -------------------------------------------------------------------------
def test_lse_normalisers():
    lse = torch.tensor([[[1.0, INF, -INF]]])
    out = _common.fa2_lse(lse)
    assert out.tolist() == [[[1.0, -INF, -INF]]] and out.dtype == torch.float32
    padded = torch.arange(64.0).reshape(1, 1, 64)
    assert _common.padded_lse(padded, 40).shape == (1, 1, 40)
    assert _common.padded_lse(padded, 40).is_contiguous()
    with pytest.raises(ValueError, match="shorter than Sq=70"):
        _common.padded_lse(padded, 70)
    c = torch.randn(2, 3, 5, 1)
    assert torch.equal(_common.cudnn_lse(c), c.squeeze(-1))
    assert _common.fa_window((None, 0)) == (-1, 0) and _common.fa_window((5, None)) == (5, -1)
    assert _common.softcap_value(None) == 0.0 and _common.softcap_value(30.0) == 30.0


# ---- probes on a machine without CUDA / packages -----------------------------------------------
@pytest.mark.parametrize("name", ["fa2", "fa4"])
def test_cuda_only_probe_names_the_reason(name):
    reason = get_kernel(name).probe(_spec(device_type="cpu"))
    assert reason and "CUDA" in reason and "cpu" in reason


def test_probe_reports_missing_package(monkeypatch):
    k = FA4Kernel()
    monkeypatch.setattr("cp_softcap.kernels.fa4.try_import", lambda m: (None, "ModuleNotFoundError: x"))
    monkeypatch.setattr("cp_softcap.kernels.fa4.cuda_arch", lambda: 90)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    reason = k.probe(_spec())
    assert "flash-attn-4 not importable" in reason and "pip install" in reason
    k2 = FA2Kernel()
    monkeypatch.setattr("cp_softcap.kernels.fa2.try_import", lambda m: (None, "ModuleNotFoundError: y"))
    monkeypatch.setattr("cp_softcap.kernels.fa2.cuda_arch", lambda: 90)
    assert "flash-attn 2 not importable" in k2.probe(_spec())


def test_fa3_is_opt_in(monkeypatch):
    """One home for the opt-in: the selector's rule (the kernel's probe says only whether FA3
    can run here)."""
    from cp_softcap.selector import select
    monkeypatch.delenv("CP_SOFTCAP_FA3", raising=False)
    monkeypatch.setattr(type(get_kernel("fa3")), "probe", lambda self, spec: None)
    with pytest.raises(ValueError, match="CP_SOFTCAP_FA3=1"):
        select(_spec(), "fa3")
    assert select(_spec(), "auto").name != "fa3"
    assert get_kernel("fa3").caps.cp is False


def test_fa4_arch_rules():
    assert fa4_rejection(90, _spec(head_dim=256)) is None
    assert "softcap == 0" in fa4_rejection(100, _spec(head_dim=256))
    assert "softcap == 0" in fa4_rejection(110, _spec(head_dim=256))
    assert fa4_rejection(100, _spec(head_dim=256, softcap=None)) is None
    assert fa4_rejection(100, _spec(head_dim=128)) is None
    assert "no backward" in fa4_rejection(80, _spec())
    assert fa4_rejection(80, _spec(needs_backward=False)) is None
    assert "not supported" in fa4_rejection(75, _spec())
    assert fa4_rejection(None, _spec()) == "no CUDA device"


def test_fa4_tile_window_rules():
    assert tile_window((None, None), 90, 128, 2048, 28672) == (None, 28672)
    assert tile_window((None, None), 90, 112, 300, 100) == (None, 300)
    assert tile_window((None, None), 90, 96, 300, 100) == (None, None)          # same tiles there
    assert tile_window((None, None), 90, 256, 2048, 28672) == (None, None)     # head dim 256
    assert tile_window((None, None), 100, 128, 2048, 28672) == (None, None)    # sm100
    assert tile_window((None, None), None, 128, 8, 8) == (None, None)
    assert tile_window((None, 0), 90, 128, 8, 8) == (None, 0)                  # causal unchanged
    assert tile_window((5, 3), 90, 128, 8, 8) == (5, 3)


@pytest.mark.parametrize("sq,sk,segments", [(40, 9, None), (9, 40, None), (17, 17, None),
                                            (30, 30, ((0, 1, 12, 30), (0, 5, 5, 30))),
                                            (30, 12, ((0, 20, 30), (0, 2, 12)))])
def test_fa4_tile_window_is_the_same_attention(sq, sk, segments):
    """The window tile_window substitutes shows every key to every row (bottom-right aligned,
    per segment too): the reference kernel gives bit-equal results in float64."""
    g = torch.Generator().manual_seed(sq * 100 + sk)
    q = torch.randn(1, sq, 4, 16, generator=g, dtype=torch.float64) * 3
    k, v = (torch.randn(1, sk, 2, 16, generator=g, dtype=torch.float64) * 3 for _ in range(2))
    kern, kw = TorchKernel(), dict(scale=0.25, softcap=5.0)
    if segments is not None:
        kw["segments"] = segments
    win = tile_window((None, None), 90, 128, sq, sk)
    assert win != (None, None)
    o1, l1 = kern.forward(q, k, v, window=(None, None), **kw)
    o2, l2 = kern.forward(q, k, v, window=win, **kw)
    assert torch.equal(o1, o2) and torch.equal(l1, l2) and not o1.isnan().any()


def test_flex_caps_have_no_cpu_backward():
    caps = get_kernel("flex").caps
    assert caps.backward_devices == frozenset({"cuda"}) and "cpu" in caps.devices


# ---- fa2 signature families (by parameter names) and a stand-in module -------------------------
def _fake_fa2(family: str, bwd_softcap: bool = True):
    tk = TorchKernel()

    def win(left, right):
        return (None if left < 0 else left, None if right < 0 else right)

    def fwd(q, k, v, scale, w, cap):
        out, lse = tk.forward(q, k, v, scale=scale, softcap=cap or None, window=w)
        return out, torch.where(lse == -INF, torch.full_like(lse, INF), lse)   # FA2's marker

    def bwd(dout, q, k, v, out, lse, dq, dk, dv, scale, w, cap):
        assert not (lse == -INF).any(), "FA2 backward must get +inf (not -inf) for empty rows"
        lse = torch.where(lse == INF, torch.full_like(lse, -INF), lse)
        g = tk.backward(dout, q, k, v, out, lse, scale=scale, softcap=cap or None, window=w)
        for dst, src in zip((dq, dk, dv), g):
            dst.copy_(src)

    class M:
        pass
    m = M()
    if family == "split":
        def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                                window_size_right, softcap, alibi_slopes, return_softmax):
            out, lse = fwd(q, k, v, softmax_scale, win(window_size_left, window_size_right), softcap)
            return out, lse, None, None

        def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p,
                                 softmax_scale, causal, window_size_left, window_size_right, softcap,
                                 alibi_slopes, deterministic, rng_state=None):
            bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale,
                win(window_size_left, window_size_right), softcap)
            return None
    else:
        def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                                alibi_slopes, return_softmax):
            out, lse = fwd(q, k, v, softmax_scale, win(*window_size), softcap)
            return out, q, k, v, out, lse, None, None

        if bwd_softcap:
            def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p,
                                     softmax_scale, causal, window_size, softcap, alibi_slopes,
                                     deterministic, rng_state=None):
                bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, win(*window_size), softcap)
                return dq, dk, dv, None
        else:
            def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p,
                                     softmax_scale, causal, window_size, alibi_slopes,
                                     deterministic, rng_state=None):
                raise AssertionError("must not be called with a cap")
    m._flash_attn_forward, m._flash_attn_backward = _flash_attn_forward, _flash_attn_backward
    return m


def test_fa2_signature_detection():
    m = _fake_fa2("split")
    assert signature_family(m._flash_attn_forward, m._flash_attn_backward)[0] == "split"
    m = _fake_fa2("tuple")
    assert signature_family(m._flash_attn_forward, m._flash_attn_backward)[0] == "tuple"
    old = _fake_fa2("tuple", bwd_softcap=False)
    assert not backward_has_softcap(old._flash_attn_backward)

    def pre26(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax):
        pass
    fam, reason = signature_family(pre26, m._flash_attn_backward)
    assert fam is None and "no softcap" in reason


@pytest.mark.parametrize("family", ["split", "tuple"])
def test_fa2_adapter_with_stand_in_matches_torch_kernel(family):
    k = FA2Kernel(module=_fake_fa2(family))
    tk = TorchKernel()
    q = torch.randn(1, 24, 4, 16, dtype=torch.float64) * 3
    kk = torch.randn(1, 16, 2, 16, dtype=torch.float64) * 3
    v = torch.randn(1, 16, 2, 16, dtype=torch.float64)
    kw = dict(scale=0.25, softcap=5.0, window=(None, 0))      # Sq > Sk causal: 8 empty rows
    out, lse = k.forward(q, kk, v, **kw)
    ref_out, ref_lse = tk.forward(q, kk, v, **kw)
    assert (lse[..., :8] == -INF).all() and torch.equal(lse, ref_lse.float()) and torch.equal(out, ref_out)
    dout = torch.randn_like(out)
    for g, rg in zip(k.backward(dout, q, kk, v, out, lse, **kw),
                     tk.backward(dout, q, kk, v, out, lse, **kw)):
        assert g.dtype == rg.dtype == torch.float64 and torch.allclose(g, rg, atol=1e-5)
    # the flash-attn family's gradients come in the input dtype, and the kernel says so
    assert k.partial_dtype(torch.bfloat16) == torch.bfloat16
    assert tk.partial_dtype(torch.bfloat16) == torch.float32


def test_fa2_refuses_capped_backward_on_old_flash_attn():
    k = FA2Kernel(module=_fake_fa2("tuple", bwd_softcap=False))
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(RuntimeError, match="2.6.2"):
        k.backward(q, q, q, q, q, torch.zeros(1, 2, 8), scale=1.0, softcap=5.0, window=(None, None))


# ---- fa3 keyword binding ---------------------------------------------------------------------------
def test_fa3_bind_kwargs_by_names():
    def new(q, k, v, cu_seqlens_q, softmax_scale, causal, window_size_left=-1,
            window_size_right=-1, attention_chunk=0, softcap=0.0):
        pass

    def old(q, k, v, k_new, softmax_scale, causal, window_size=(-1, -1), softcap=0.0):
        pass
    kw = bind_kwargs(new, dict(q=1, k=2, v=3, softmax_scale=0.1, causal=False, softcap=5.0,
                               deterministic=True), (None, 0))
    assert kw["window_size_left"] == -1 and kw["window_size_right"] == 0
    assert kw["cu_seqlens_q"] is None and "deterministic" not in kw
    kw = bind_kwargs(old, dict(q=1, k=2, v=3, softmax_scale=0.1, causal=False, softcap=5.0), (7, 3))
    assert kw["window_size"] == (7, 3) and kw["k_new"] is None
    with pytest.raises(TypeError, match="lacks parameters"):
        bind_kwargs(old, dict(q=1, bogus=2), (None, None))


# ---- flex: final-LSE reweighting and CPU forward ---------------------------------------------------
def test_flex_reweighting_gives_final_lse_gradients():
    tk = TorchKernel()
    q = torch.randn(1, 16, 4, 8, dtype=torch.float64) * 3
    k = torch.randn(1, 32, 2, 8, dtype=torch.float64) * 3
    v = torch.randn(1, 32, 2, 8, dtype=torch.float64)
    kw = dict(scale=0.3, softcap=2.0, window=(None, None))
    (oa, la), (ob, lb) = tk.forward(q, k[:, :16], v[:, :16], **kw), tk.forward(q, k[:, 16:], v[:, 16:], **kw)
    out, lse = merge([(oa, la), (ob, lb)], torch.float64)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    dq, dk, dv = tk.backward(dout, q, k, v, out, lse, dlse=dlse, **kw)
    dout_p, dlse_p = reweighted_grads_inputs(dout, oa, la, out, lse, dlse)
    dqa, dka, dva = tk.backward(dout_p, q, k[:, :16], v[:, :16], oa, la, dlse=dlse_p, **kw)
    dqb, _, _ = tk.backward(dout, q, k[:, 16:], v[:, 16:], out, lse, dlse=dlse, **kw)
    for x, y in ((dqa + dqb, dq), (dka, dk[:, :16]), (dva, dv[:, :16])):
        assert torch.allclose(x, y, atol=1e-10)


@pytest.mark.parametrize("sq,sk,window", [(64, 64, (None, 0)), (48, 96, (20, 30)),
                                          (96, 48, (60, 5)), (96, 48, (None, 0)), (32, 64, (3, 3))])
def test_flex_cpu_forward_matches_torch_kernel(sq, sk, window):
    fk, tk = get_kernel("flex"), TorchKernel()
    q, k, v = torch.randn(1, sq, 4, 32) * 3, torch.randn(1, sk, 2, 32) * 3, torch.randn(1, sk, 2, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")            # "flex without torch.compile" on CPU
        out, lse = fk.forward(q, k, v, scale=32 ** -0.5, softcap=5.0, window=window)
    ref_out, ref_lse = tk.forward(q, k, v, scale=32 ** -0.5, softcap=5.0, window=window)
    assert torch.equal(lse == -INF, ref_lse == -INF)
    assert (out - ref_out).abs().max() < 1e-5
    assert (lse - ref_lse).nan_to_num(0).abs().max() < 1e-5
    assert fk.block_mask(sq, sk, window, q.device) is fk.block_mask(sq, sk, window, q.device)


# ---- sdpa CUDA plan --------------------------------------------------------------------------------
def test_sdpa_cuda_parts_cover_bottom_right_causal():
    parts = SdpaKernel()._cuda_parts
    assert parts(8, 8, (None, None)) == [(0, 0, 8, False)]
    assert parts(12, 8, (None, 0)) == [(4, 0, 8, True)]
    assert parts(8, 12, (None, 0)) == [(0, 0, 4, False), (0, 4, 12, True)]


def test_sdpa_probe_on_cuda_spec_without_cuda():
    reason = SdpaKernel().probe(_spec(softcap=None))
    if not torch.cuda.is_available():
        assert "CUDA" in reason


def test_fa4_exact_d_correction_through_dlse():
    """Backward with a rounded O and the corrected dLSE equals backward with the float32 O."""
    from cp_softcap.kernels.fa4 import exact_d_dlse
    tk = TorchKernel()
    q = torch.randn(1, 32, 4, 16) * 3
    k, v = torch.randn(1, 32, 2, 16) * 3, torch.randn(1, 32, 2, 16)
    kw = dict(scale=0.25, softcap=2.0, window=(None, 0))
    out32, lse = tk.forward(q, k, v, **kw)
    out_k = out32.to(torch.bfloat16).float()
    dout = torch.randn_like(out32)
    want = tk.backward(dout, q, k, v, out32, lse, **kw)
    got = tk.backward(dout, q, k, v, out_k, lse, dlse=exact_d_dlse(dout, out32, out_k, None), **kw)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-5, rtol=1e-4)


def test_fa4_exact_d_dlse_with_16bit_inputs_matches_float32_formula():
    """The ring passes bf16 dO/O_k: the promoted one-pass form equals the float32 formula."""
    from cp_softcap.kernels.fa4 import exact_d_dlse
    out32 = torch.randn(2, 24, 4, 16)
    out_k, dout = out32.to(torch.bfloat16), torch.randn(2, 24, 4, 16).to(torch.bfloat16)
    dlse = torch.randn(2, 4, 24)
    want = dlse - (dout.float() * (out32 - out_k.float())).sum(-1).transpose(1, 2)
    got = exact_d_dlse(dout, out32, out_k, dlse)
    assert got.dtype == torch.float32 and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_fa4_softcap_kwargs():
    from cp_softcap.kernels.fa4_softcap import softcap_kwargs
    mods = lambda cap: (("fwd", cap), ("bwd", cap))                              # noqa: E731
    assert softcap_kwargs("score_mod", 90, 0.125, None, True, mods) == dict(softmax_scale=0.125,
                                                                           softcap=0.0)
    assert softcap_kwargs("builtin", 90, 0.125, 50.0, True, mods) == dict(softmax_scale=0.125,
                                                                         softcap=50.0)
    assert softcap_kwargs("score_mod", 100, 0.125, 50.0, True, mods)["softcap"] == 50.0  # sm90 only
    fwd = softcap_kwargs("score_mod", 90, 0.125, 50.0, False, mods)
    assert fwd == dict(softmax_scale=0.125 / 50.0, softcap=0.0, score_mod=("fwd", 50.0))
    bwd = softcap_kwargs("score_mod", 90, 0.125, 50.0, True, mods)
    assert bwd["score_mod_bwd"] == ("bwd", 50.0) and bwd["softcap"] == 0.0
    with pytest.raises(ValueError, match="softcap_impl"):
        FA4Kernel(softcap_impl="fast")


@pytest.mark.parametrize("name,native", [("fa2", True), ("fa3", True), ("fa4", True),
                                         ("flex", False), ("sdpa", False), ("torch", False)])
def test_partial_dtype_is_the_kernels_declared_gradient_dtype(name, native):
    kernel = get_kernel(name)
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        want = dtype if native else (torch.float64 if dtype == torch.float64 else torch.float32)
        assert kernel.partial_dtype(dtype) == want, (name, dtype)


def test_fa4_silences_only_its_aux_data_compile_warning():
    """Once FA4 is bound, its DSL's per-compile 'aux_data cannot be converted to a JitArgument'
    warning is filtered; any other warning, from FA4 or elsewhere, still shows."""
    import types
    import warnings

    from cp_softcap.kernels import fa4

    def fake(*names):                                   # a function taking these keywords
        namespace = {}
        exec(f"def f(q, k, v, *, {', '.join(names)}): pass", namespace)
        return namespace["f"]

    mod = types.SimpleNamespace(_flash_attn_fwd=fake(*fa4._FWD_KW, *fa4._VARLEN_KW),
                                _flash_attn_bwd=fake(*fa4._BWD_KW, *fa4._VARLEN_KW))
    aux = ("Argument aux_data (position 17) cannot be converted to a JitArgument for function "
           "'cutlass___call___flash_attncuteflash_fwd_sm90'. Its type is not supported.")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.warn(aux, UserWarning)                 # before FA4 is bound: shown
        assert FA4Kernel(module=mod)._mod is mod
        warnings.warn(aux, UserWarning)                 # after: filtered
        warnings.warn("Argument q cannot be converted", UserWarning)
    assert [str(w.message)[:21] for w in seen] == ["Argument aux_data (po", "Argument q cannot be "]
