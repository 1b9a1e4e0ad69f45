"""GPU kernels (fa4, flex, sdpa, fa2, fa3) against the float64 reference, on CUDA only.

Marked `gpu` (and each case with its kernel's marker): skipped without CUDA, and a kernel that
its probe rejects here (package missing, opt-in not set) is skipped with the probe's reason.
Logits saturate tanh (|s| > 2*cap on most entries); every output and gradient is checked for
NaN/inf; a negative control shows that an uncapped kernel would fail.
Run: pytest tests/test_gpu_kernels.py -rs
"""
import pytest
import torch
from markers import with_kernels

from cp_softcap.kernels import get_kernel
from cp_softcap.merge import merge
from cp_softcap.spec import make_spec
from cp_softcap.testing import assert_cap_matters, check_result, saturating_qkv

pytestmark = pytest.mark.gpu
DEV = "cuda"
CAPPED = with_kernels(["fa4", "flex", "fa2", "fa3"])


def kernel_or_skip(name, dtype=torch.bfloat16, d=128, softcap=50.0, hq=4, hkv=2, backward=True,
                   return_lse=False):
    spec = make_spec(head_dim=d, num_heads=hq, num_kv_heads=hkv, dtype=dtype, device_type="cuda",
                     softcap=softcap, needs_backward=backward, return_lse=return_lse)
    k = get_kernel(name)
    reason = k.probe(spec)
    if reason:
        pytest.skip(f"{name}: {reason}")
    return k


def run_case(kernel, b, sq, sk, hq, hkv, d, dtype, softcap, window, dlse=False):
    q, k, v, frac = saturating_qkv(b, sq, sk, hq, hkv, d, dtype, softcap, device=DEV,
                                   requires_grad=False)
    if softcap:
        assert frac > 0.4, f"inputs do not saturate tanh ({frac:.2f})"
    scale = d ** -0.5
    out, lse = kernel.forward(q, k, v, scale=scale, softcap=softcap, window=window)
    assert out.shape == (b, sq, hq, d) and out.dtype in (dtype, torch.float32)
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32 and lse.is_contiguous()
    dout = torch.randn_like(out)
    g_lse = torch.randn_like(lse) if dlse else None
    grads = kernel.backward(dout, q, k, v, out, lse, scale=scale, softcap=softcap, window=window,
                            dlse=g_lse)
    assert all(g.dtype == kernel.partial_dtype(dtype) for g in grads), [g.dtype for g in grads]
    errs = check_result(out, lse, grads, q, k, v, dout, dlse=g_lse, softcap=softcap,
                        window=window, scale=scale, label=f"{kernel.name} {sq}x{sk} {window}")
    if softcap:
        assert_cap_matters(q, k, v, softcap=softcap, dtype=dtype, window=window, scale=scale, out=out)
    return errs


@pytest.mark.parametrize("softcap", [1.0, 5.0, 30.0, 50.0])
@pytest.mark.parametrize("name", CAPPED)
def test_softcap_causal_gqa_bf16(name, softcap):
    kernel = kernel_or_skip(name, softcap=softcap)
    run_case(kernel, 2, 256, 256, 4, 2, 128, torch.bfloat16, softcap, (None, 0))


@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("name", CAPPED)
def test_head_dims(name, d):
    kernel = kernel_or_skip(name, d=d)
    run_case(kernel, 1, 256, 256, 4, 2, d, torch.bfloat16, 50.0, (None, 0))


@pytest.mark.fa2
def test_fa2_installed_signature_carries_softcap_in_backward():
    """The installed flash-attn 2 is told apart by parameter names, and its backward takes the
    cap (2.6.2+); a backward without it would silently train uncapped."""
    kernel_or_skip("fa2")
    from cp_softcap.kernels.fa2 import backward_has_softcap, signature_family
    mod = get_kernel("fa2")._interface()
    family, reason = signature_family(mod._flash_attn_forward, mod._flash_attn_backward)
    assert family in ("split", "tuple") and reason is None, reason
    assert backward_has_softcap(mod._flash_attn_backward)


@pytest.mark.parametrize("name", with_kernels(["fa2", "fa4", "flex"]))
def test_fp16_softcap_window(name):
    kernel = kernel_or_skip(name, dtype=torch.float16, softcap=30.0)
    run_case(kernel, 1, 256, 192, 4, 2, 128, torch.float16, 30.0, (100, 60))


# Shifted, non-causal windows with Sq != Sk: what a windowed ring passes per chunk pair,
# plus Sq > Sk causal (leading rows see no key: out 0, lse -inf).
WINDOWS = [(256, 256, (63, 0)), (128, 256, (100, 60)), (256, 128, (150, 10)),
           (256, 256, (31, 31)), (128, 128, (200, 0)), (256, 128, (None, 0)),
           (128, 256, (None, None))]


@pytest.mark.parametrize("sq,sk,window", WINDOWS)
@pytest.mark.parametrize("name", CAPPED)
def test_windows(name, sq, sk, window):
    kernel = kernel_or_skip(name, softcap=30.0)
    run_case(kernel, 1, sq, sk, 4, 2, 128, torch.bfloat16, 30.0, window)


@pytest.mark.parametrize("name", with_kernels(["fa4", "flex"]))
def test_lse_gradient(name):
    kernel = kernel_or_skip(name, softcap=30.0, return_lse=True)
    run_case(kernel, 1, 256, 256, 4, 2, 128, torch.bfloat16, 30.0, (None, 0), dlse=True)


@pytest.mark.parametrize("name", with_kernels(["fa4", "flex", "sdpa", "fa2"]))
def test_backward_with_final_merged_lse_is_exact(name):
    """The ring property: per-chunk backward with the FINAL merged (out, lse) sums to the
    full-attention gradients (dK/dV of each chunk, dQ summed over chunks)."""
    cap = None if name == "sdpa" else 30.0
    kernel = kernel_or_skip(name, softcap=cap)
    q, k, v, _ = saturating_qkv(1, 256, 512, 4, 2, 128, torch.bfloat16, cap, device=DEV,
                                requires_grad=False)
    scale, half = 128 ** -0.5, 256
    kw = dict(scale=scale, softcap=cap)
    # keys [0, 256) fully visible; keys [256, 512) causal with the 256 queries (bottom-right)
    pa = kernel.forward(q, k[:, :half], v[:, :half], window=(None, None), **kw)
    pb = kernel.forward(q, k[:, half:], v[:, half:], window=(None, 0), **kw)
    out, lse = merge([pa, pb])                   # float32, as the ring passes it
    dout = torch.randn_like(out).to(q.dtype)
    ga = kernel.backward(dout, q, k[:, :half], v[:, :half], out, lse, window=(None, None), **kw)
    gb = kernel.backward(dout, q, k[:, half:], v[:, half:], out, lse, window=(None, 0), **kw)
    grads = (ga[0] + gb[0], torch.cat([ga[1], gb[1]], 1), torch.cat([ga[2], gb[2]], 1))
    check_result(out, lse, grads, q, k, v, dout, softcap=cap, window=(None, 0), scale=scale,
                 label=f"{name} two-chunk merge")


@pytest.mark.parametrize("window", [(None, None), (None, 0)])
@pytest.mark.parametrize("sq,sk", [(256, 256), (128, 256), (256, 128)])
def test_sdpa_cuda_no_softcap(sq, sk, window):
    kernel = kernel_or_skip("sdpa", softcap=None)
    run_case(kernel, 1, sq, sk, 4, 2, 128, torch.bfloat16, None, window)


def test_fp16_fa4_and_flex():
    for name in ("fa4", "flex"):
        spec = make_spec(head_dim=128, num_heads=4, num_kv_heads=2, dtype=torch.float16,
                         device_type="cuda", softcap=50.0)
        if get_kernel(name).probe(spec) is None:
            run_case(get_kernel(name), 1, 256, 256, 4, 2, 128, torch.float16, 50.0, (None, 0))


def test_selector_picks_fastest_verified_kernel_on_cuda():
    from cp_softcap.selector import select
    spec = make_spec(head_dim=256, num_heads=16, num_kv_heads=8, dtype=torch.bfloat16,
                     device_type="cuda", softcap=50.0, causal=True)
    sel = select(spec)
    expected = "fa4" if get_kernel("fa4").probe(spec) is None else "flex"
    assert sel.name == expected, sel.table()
    nocap = make_spec(head_dim=256, num_heads=16, num_kv_heads=8, dtype=torch.bfloat16,
                      device_type="cuda", softcap=None, causal=True)
    assert select(nocap).name == "sdpa", select(nocap).table()


def test_cps_attention_end_to_end_on_cuda():
    import cp_softcap as cps
    q, k, v, _ = saturating_qkv(1, 256, 256, 4, 2, 128, torch.bfloat16, 50.0, device=DEV)
    out = cps.attention(q, k, v, softcap=50.0, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    check_result(out.detach(), None, (q.grad.float(), k.grad.float(), v.grad.float()), q, k, v,
                 dout, softcap=50.0, causal=True, label="cps.attention")


@pytest.mark.parametrize("softcap", [1.0, 30.0])
@pytest.mark.parametrize("window", [(None, 0), (100, 60)])
@pytest.mark.fa4
def test_fa4_builtin_softcap_impl(softcap, window):
    """FA4's own softcap= path (the adapter's default on sm90 is its score_mod): same checks."""
    kernel_or_skip("fa4", softcap=softcap)
    from cp_softcap.kernels.fa4 import FA4Kernel
    kernel = FA4Kernel(softcap_impl="builtin")
    run_case(kernel, 1, 256, 192, 4, 2, 128, torch.bfloat16, softcap, window, dlse=True)
