"""Attention sinks on one device (cps.attention(..., sinks=), CPAttention(None)(..., sinks=))
against the float64 reference with a sink column: sinks that dominate some heads' rows,
saturating caps, windows (rows that see no key), GQA, packed documents with padding, the LSE
with its gradient; q/k/v AND sink gradients; a negative control (the sink dropped fails); any
float dtype of the sinks; bad sinks refused with errors that name the fix; no double backward."""
import pytest
import torch

import cp_softcap as cps
from cp_softcap.testing import (TOLERANCES, assert_finite, check_against_reference,
                                reference_with_grads, saturating_qkv)

F64 = torch.float64
SINKS = (10.0, -2.0, 12.0, 0.5)          # heads 0 and 2: the sink dominates their rows

CASES = [  # (options, cu_seqlens)
    (dict(softcap=2.0, causal=True), None),
    (dict(softcap=50.0, causal=True, window=(3, 0)), None),
    (dict(softcap=1.0, causal=False, window=(2, 3)), None),
    (dict(softcap=None, causal=True), None),
    (dict(softcap=5.0, causal=True, window=(3, 0)), [0, 5, 6, 17, 20]),     # 4 padding rows
    (dict(softcap=30.0, causal=False, window=(0, 0)), [0, 1, 9, 24]),
]


def _inputs(seed, hkv=2, s=24, dtype=F64, sink_dtype=F64):
    torch.manual_seed(seed)
    q, k, v, _ = saturating_qkv(2, s, s, 4, hkv, 8, dtype, 3.0)
    sinks = torch.tensor(SINKS, dtype=sink_dtype, requires_grad=True)
    dout = torch.randn(q.shape, dtype=F64).to(dtype)
    return q, k, v, sinks, dout


@pytest.mark.parametrize("i", range(len(CASES)))
def test_sinks_match_reference(i):
    opts, cu = CASES[i]
    q, k, v, sinks, dout = _inputs(100 + i, hkv=1 if i == 2 else 2)
    dlse = torch.randn(2, 4, q.shape[1], dtype=F64)
    out, lse = cps.attention(q, k, v, sinks=sinks, cu_seqlens=cu, return_lse=True, **opts)
    ((out * dout).sum() + (lse * dlse).sum()).backward()
    ref_out, ref_lse, ref_grads = reference_with_grads(q, k, v, dout, dlse=dlse, sinks=sinks,
                                                       bottom_right=False, cu_seqlens=cu, **opts)
    assert_finite(lse, "lse")            # every row sees the sink: never -inf
    errs = check_against_reference(out, (q.grad, k.grad, v.grad, sinks.grad), ref_out, ref_grads,
                                   F64, lse=lse, ref_lse=ref_lse, label=str(CASES[i]))
    assert set(errs) == {"out", "lse", "dq", "dk", "dv", "dsinks"}
    # negative control: the same call without the sink must fail the comparison
    with pytest.raises(AssertionError, match="mismatch"):
        check_against_reference(cps.attention(q, k, v, cu_seqlens=cu, **opts), None, ref_out, None,
                                F64, tol_scale=1e3)


def test_rows_that_see_nothing_get_the_sink():
    """Padding rows (past cu[-1]) and window-empty rows: out 0, lse = sink, zero gradients."""
    q, k, v, sinks, dout = _inputs(7)
    out, lse = cps.attention(q, k, v, sinks=sinks, cu_seqlens=[0, 20], return_lse=True)
    assert torch.equal(out[:, 20:], torch.zeros_like(out[:, 20:]))
    assert torch.equal(lse[:, :, 20:], torch.tensor(SINKS, dtype=F64).view(1, 4, 1).expand(2, 4, 4))
    out.backward(dout)
    assert torch.equal(q.grad[:, 20:], torch.zeros_like(q.grad[:, 20:]))
    assert torch.isfinite(sinks.grad).all()


@pytest.mark.parametrize("sink_dtype", [torch.float32, torch.bfloat16])
def test_sinks_any_float_dtype(sink_dtype):
    """SINKS are exact in bfloat16; the gradient comes back in the sinks' dtype."""
    q, k, v, sinks, dout = _inputs(8, sink_dtype=sink_dtype)
    out = cps.attention(q, k, v, sinks=sinks, softcap=5.0)
    out.backward(dout)
    ref_out, _, ref_grads = reference_with_grads(q, k, v, dout, sinks=sinks, softcap=5.0, causal=True)
    check_against_reference(out, (q.grad, k.grad, v.grad), ref_out, ref_grads[:3], F64)
    assert sinks.grad.dtype == sink_dtype
    torch.testing.assert_close(sinks.grad.double(), ref_grads[3], rtol=1e-2, atol=1e-6)


def test_sinks_float32_inputs_and_layer():
    """float32 q/k/v through CPAttention(None): within float32's tolerances of float64."""
    q, k, v, sinks, dout = _inputs(9, dtype=torch.float32, sink_dtype=torch.float32)
    layer = cps.CPAttention(None, softcap=5.0, window=(5, 0))
    out = layer(q, k, v, sinks=sinks)
    assert out.dtype == torch.float32
    out.backward(dout)
    ref_out, _, ref_grads = reference_with_grads(q, k, v, dout, sinks=sinks, softcap=5.0,
                                                 causal=True, window=(5, 0))
    check_against_reference(out, (q.grad, k.grad, v.grad, sinks.grad), ref_out, ref_grads, torch.float32)


def test_no_gradient_asked_of_the_sinks():
    q, k, v, _, dout = _inputs(10)
    sinks = torch.tensor(SINKS, dtype=F64)
    cps.attention(q, k, v, sinks=sinks, softcap=2.0).backward(dout)
    assert sinks.grad is None and q.grad is not None
    with torch.no_grad():
        cps.attention(q.detach(), k.detach(), v.detach(), sinks=sinks, softcap=2.0)


@pytest.mark.parametrize("sinks,match", [
    (torch.zeros(3, dtype=F64), r"shape \(3,\) but q has 4 query heads"),
    (torch.zeros(1, 4, dtype=F64), r"shape \(1, 4\)"),
    (torch.zeros(4, dtype=torch.int64), "must be a floating tensor"),
    (torch.tensor([0.0, float("inf"), 0.0, 0.0]), "non-finite"),
    (torch.tensor([0.0, float("nan"), 0.0, 0.0]), "non-finite"),
    (torch.zeros(4, device="meta"), "is on meta but q is on cpu"),
])
def test_bad_sinks_refused(sinks, match):
    q, k, v, _, _ = _inputs(11)
    with pytest.raises(ValueError, match=match) as e:
        cps.attention(q, k, v, sinks=sinks)
    assert "sinks=None" in str(e.value) or "per query head" in str(e.value)
    with pytest.raises(ValueError, match=match):
        cps.cp_attention(q, k, v, None, sinks=sinks)


def test_sinks_not_a_tensor():
    q, k, v, _, _ = _inputs(12)
    with pytest.raises(TypeError, match="sinks must be a torch.Tensor"):
        cps.attention(q, k, v, sinks=[0.0] * 4)


def test_bad_values_after_a_good_call():
    """The values are checked on every call, not only when the call is first planned."""
    q, k, v, sinks, _ = _inputs(13)
    cps.attention(q, k, v, sinks=sinks.detach())
    with pytest.raises(ValueError, match="non-finite"):
        cps.attention(q, k, v, sinks=torch.full((4,), float("inf"), dtype=F64))


def test_no_double_backward_with_sinks():
    q, k, v, sinks, dout = _inputs(14)
    out = cps.attention(q, k, v, sinks=sinks, softcap=2.0, backend="torch")
    (gq,) = torch.autograd.grad((out * dout).sum(), [q], create_graph=True)
    with pytest.raises(RuntimeError, match="double backward through attention with sinks"):
        gq.sum().backward()


def test_spec_records_presence_only():
    from cp_softcap.plan import local_plan_for
    q, k, v, sinks, _ = _inputs(15)
    kw = dict(softcap=None, causal=True, window=None, scale=None, backend="auto")
    with_sinks = local_plan_for(q, k, v, sinks=sinks, **kw)
    assert with_sinks.spec.sinks and not local_plan_for(q, k, v, **kw).spec.sinks
    assert local_plan_for(q, k, v, sinks=sinks * 2, **kw) is with_sinks
    from cp_softcap.plan_cache import call_key      # an nn.Parameter keys the call cache too
    param = torch.nn.Parameter(sinks.detach().clone())
    assert call_key(q, k, v, ("local", "auto"), (None,), None, param) is not None
    assert TOLERANCES[F64]["out"] < 1e-9


@pytest.mark.parametrize("cu", [None, [0, 5, 6, 17, 20]])
@pytest.mark.parametrize("sinks_on", [True, False])
def test_under_activation_checkpointing(cu, sinks_on):
    """Saved tensors are unpacked once per backward (checkpointing refuses a second unpack)."""
    from torch.utils.checkpoint import checkpoint
    q, k, v, sinks, dout = _inputs(16)
    s = sinks if sinks_on else None
    fn = lambda q, k, v, s: cps.attention(q, k, v, sinks=s, softcap=5.0, cu_seqlens=cu)  # noqa: E731
    checkpoint(fn, q, k, v, s, use_reentrant=False).backward(dout)
    got = [t.grad.clone() for t in (q, k, v) + ((sinks,) if sinks_on else ())]
    for t in (q, k, v, sinks):
        t.grad = None
    fn(q, k, v, s).backward(dout)
    for a, t in zip(got, (q, k, v, sinks)):
        assert torch.equal(a, t.grad)
