"""Checks of kernels with document segments (segments=) against the float64 reference.

The reference visibility comes from doc_geometry.DocCall.mask (its own construction of the
per-segment bottom-right rule), never from the kernels' helpers.
"""
from __future__ import annotations

import torch

from cp_softcap.doc_geometry import DocCall
from cp_softcap.kernels.base import Segments
from cp_softcap.testing import assert_finite, lse_err, masked_attention, rel_err, saturating_qkv, tolerance

# (cu_q, cu_k, window, label): documents of length 1, shorter than a block, spanning blocks,
# segments with no rows or no keys, rows whose window hides every key of their segment
SEGMENT_CASES = [
    ((0, 1, 5, 21, 22, 60), (0, 1, 5, 21, 22, 60), (None, 0), "causal-docs-1-4-16-1-38"),
    ((0, 1, 5, 21, 22, 60), (0, 1, 5, 21, 22, 60), (3, 0), "window3-docs-1-4-16-1-38"),
    ((0, 3, 10, 10, 30), (0, 8, 10, 25, 50), (None, 0), "fewer-rows-than-keys-empty-seg"),
    ((0, 5, 12), (0, 0, 30), (None, None), "segment-without-keys"),
    ((0, 10, 20), (0, 4, 20), (None, 0), "more-rows-than-keys-empty-rows"),
    ((0, 10, 41), (0, 10, 41), (2, 3), "two-sided-window"),
    ((0, 7, 33), (0, 19, 52), (5, None), "left-bounded-only"),
]
SEGMENT_IDS = [c[3] for c in SEGMENT_CASES]


def call_mask(segments, window) -> torch.Tensor:
    cu_q, cu_k = segments
    return DocCall(0, cu_q[-1], 0, cu_k[-1], window, tuple(cu_q), tuple(cu_k)).mask()


def reference(q, k, v, dout, mask, softcap, scale):
    """float64 (out, lse, (dq, dk, dv)) of attention under `mask` [Sq, Sk]."""
    leaves = [x.detach().to(torch.float64).requires_grad_(True) for x in (q, k, v)]
    out, lse = masked_attention(*leaves, mask, softcap=softcap, scale=scale)
    grads = torch.autograd.grad(out, leaves, dout.to(torch.float64))
    return out.detach(), lse.detach(), grads


def _cpu(ref):
    out, lse, grads = ref
    return out.cpu(), lse.cpu(), tuple(g.cpu() for g in grads)


def inputs(segments, hq, hkv, d, dtype, softcap, b=1, seed=0, device="cpu"):
    torch.manual_seed(seed)
    sq, sk = segments[0][-1], segments[1][-1]
    q, k, v, frac = saturating_qkv(b, sq, sk, hq, hkv, d, dtype, softcap, requires_grad=False,
                                   device=device)
    dout = torch.randn(b, sq, hq, d, dtype=torch.float64).to(device=device, dtype=dtype)
    return q, k, v, dout, frac


def run_kernel(kernel, q, k, v, dout, *, scale, softcap, window, segments, backward=True):
    out, lse = kernel.forward(q, k, v, scale=scale, softcap=softcap, window=window, segments=segments)
    if not backward:
        return out, lse, None
    grads = kernel.backward(dout, q, k, v, out, lse, scale=scale, softcap=softcap, window=window,
                            segments=segments)
    return out, lse, grads


def check_segmented(kernel, segments, window, *, softcap, dtype, hq=4, hkv=2, d=16, b=1,
                    negative_control=True, backward=True, tols=None, device="cpu"):
    """Run `kernel` with `segments` and compare out, lse and gradients with the float64 reference;
    with negative_control, the result must NOT match the reference without the boundaries.
    Returns the errors."""
    segments = Segments(tuple(segments[0]), tuple(segments[1]))
    q, k, v, dout, frac = inputs(segments, hq, hkv, d, dtype, softcap, b, device=device)
    if softcap is not None:
        assert frac > 0.4, f"inputs do not saturate tanh: only {frac:.2f} of |s| > 2*cap"
    scale = d ** -0.5
    out, lse, grads = run_kernel(kernel, q, k, v, dout, scale=scale, softcap=softcap, window=window,
                                 segments=segments, backward=backward)
    # the float64 reference on the kernel's device (at Gemma2's head shapes and 3,000 tokens it
    # took about two minutes per case on the GPU machine's CPU), compared on the CPU
    mask = call_mask(segments, window)
    ref_out, ref_lse, ref_grads = _cpu(reference(q, k, v, dout, mask.to(q.device), softcap, scale))
    q, k, v, dout, out, lse = (t.cpu() for t in (q, k, v, dout, out, lse))
    grads = None if grads is None else tuple(g.cpu() for g in grads)
    assert_finite(out, "out")
    assert_finite(lse, "lse", allow_neg_inf=True)
    errs = {"out": rel_err(out, ref_out), "lse": lse_err(lse, ref_lse)}
    for name, g, r in zip(("dq", "dk", "dv"), grads or (), ref_grads):
        assert_finite(g, name)
        errs[name] = rel_err(g, r)
    tol = {n: tolerance(dtype, "out" if n == "out" else "lse" if n == "lse" else "grad_exact")
           for n in errs}
    tol.update({n: t for n, t in (tols or {}).items() if n in tol})
    bad = {n: e for n, e in errs.items() if not e <= tol[n]}
    assert not bad, f"{kernel.name} segments={segments} window={window}: errors {bad}"
    empty = ~mask.any(-1)
    if bool(empty.any()):   # rows that see no key: exactly 0 and -inf, zero gradients
        assert bool((out[:, empty] == 0).all()) and bool((lse[:, :, empty] == float("-inf")).all())
        assert grads is None or bool((grads[0][:, empty] == 0).all())
    if negative_control:
        sq, sk = segments[0][-1], segments[1][-1]
        whole = call_mask(Segments((0, sq), (0, sk)), window)
        assert not torch.equal(whole, mask), "the case's boundaries hide nothing"
        with torch.no_grad():
            no_docs = masked_attention(*(t.to(device, torch.float64) for t in (q, k, v)),
                                       whole.to(device), softcap=softcap, scale=scale)[0].cpu()
        diff = rel_err(out, no_docs)
        assert diff > 10 * tolerance(dtype, "out"), (
            f"the result also matches attention WITHOUT document boundaries (diff {diff:.3g})")
    return errs
