"""Checks of attention results against the float64 reference (see cp_softcap.testing).

    q, k, v, frac = saturating_qkv(1, 64, 64, 4, 2, 32, torch.bfloat16, softcap=50.0)
    ref_out, ref_lse, ref_grads = reference_with_grads(q, k, v, dout, softcap=50.0, causal=True)
    errs = check_against_reference(out, (dq, dk, dv), ref_out, ref_grads, torch.bfloat16)
    assert_cap_matters(q, k, v, softcap=50.0, dtype=torch.bfloat16, causal=True)

Error measure everywhere: max |x - ref| / max |ref| over the whole tensor (a max-normalised
relative error; element-wise relative error is meaningless where ref is ~0).
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple

import torch

from .reference import reference_attention

# Max relative error allowed per dtype.
#   out, lse:    vs the exact float64 reference. 16-bit outputs are rounded once to the input dtype
#                (2^-9 / 2^-12 relative) on top of float32 accumulation.
#   grad:        dq/dk/dv vs the ROUNDING-AWARE float64 reference (see reference_with_grads(
#                out_used=...)): every kernel (flash-attn included) computes D = rowsum(dO * O) from
#                the O it was given, i.e. the output rounded to 16 bits; the aware reference uses
#                the same O, so what is left is accumulation error plus the final cast.
#   grad_exact:  dq/dk/dv vs the exact float64 reference. With 16-bit inputs and saturating caps the
#                rounding of O in D dominates wherever a row's softmax is nearly one-hot (true
#                dq/dk are then tiny): measured up to ~0.15 for bf16 and ~1e-2 for fp16 on small
#                windows. This bound only catches gross errors; 'grad' is the precise check.
TOLERANCES: Dict[torch.dtype, Dict[str, float]] = {
    torch.float64: {"out": 1e-12, "grad": 1e-11, "grad_exact": 1e-11, "lse": 1e-12},
    torch.float32: {"out": 1e-5, "grad": 5e-5, "grad_exact": 5e-5, "lse": 5e-5},
    torch.float16: {"out": 1e-3, "grad": 1e-3, "grad_exact": 3e-2, "lse": 2e-4},
    torch.bfloat16: {"out": 8e-3, "grad": 8e-3, "grad_exact": 0.3, "lse": 2e-4},
}

GRAD_NAMES = ("dq", "dk", "dv")


def tolerance(dtype: torch.dtype, what: str = "out") -> float:
    """Allowed max relative error of `what` ('out', 'grad' or 'lse') for inputs of `dtype`."""
    return TOLERANCES[dtype][what]


def assert_finite(t: Optional[torch.Tensor], name: str = "tensor", allow_neg_inf: bool = False) -> None:
    """Fail on any NaN or inf (or NaN / +inf only, when allow_neg_inf: LSE of empty rows)."""
    if t is None:
        return
    if allow_neg_inf:
        bad = torch.isnan(t) | (t == float("inf"))
    else:
        bad = ~torch.isfinite(t)
    if bool(bad.any()):
        raise AssertionError(f"{name} has {int(bad.sum())} non-finite entries (of {t.numel()}); "
                             f"first at index {tuple(bad.nonzero()[0].tolist())}")


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref| in float64 (0 if both are all zero; inf if only ref is)."""
    x64, r64 = x.detach().to(torch.float64), ref.detach().to(torch.float64)
    if x64.shape != r64.shape:
        raise AssertionError(f"shape mismatch: {tuple(x64.shape)} vs reference {tuple(r64.shape)}")
    if x64.numel() == 0:
        return 0.0
    num = (x64 - r64).abs().max().item()
    den = r64.abs().max().item()
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def lse_err(lse: torch.Tensor, ref_lse: torch.Tensor) -> float:
    """Max relative error of an LSE; -inf entries (empty rows) must match exactly and are skipped."""
    l64, r64 = lse.detach().to(torch.float64), ref_lse.detach().to(torch.float64)
    assert_finite(l64, "lse", allow_neg_inf=True)
    empty_ref, empty = r64 == float("-inf"), l64 == float("-inf")
    if not torch.equal(empty_ref, empty):
        raise AssertionError(f"lse empty-row pattern differs: {int(empty.sum())} rows at -inf, reference "
                             f"has {int(empty_ref.sum())}")
    if bool(empty_ref.all()):
        return 0.0
    keep = ~empty_ref
    return ((l64[keep] - r64[keep]).abs() / r64[keep].abs().clamp_min(1.0)).max().item()


def saturating_qkv(b: int, sq: int, sk: int, hq: int, hkv: int, d: int, dtype: torch.dtype,
                   softcap: Optional[float], scale: Optional[float] = None, requires_grad: bool = True,
                   dv: Optional[int] = None, device="cpu", spread: float = 4.0
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Random q [b, sq, hq, d], k [b, sk, hkv, d], v [b, sk, hkv, dv] in `dtype` whose scaled logits
    s = scale * q.k have standard deviation about `spread * softcap`, so |s| > 2 * softcap on a large
    share of entries (about 60% for spread 4). softcap None: logits of std ~ `spread`.

    Returns (q, k, v, saturated_fraction) where the fraction is measured in float64 on the actual
    (rounded) inputs; 0.0 when softcap is None. Tensors are leaves (requires_grad as asked).
    """
    scale = d ** -0.5 if scale is None else scale
    target = spread * (softcap if softcap else 1.0)
    # s = scale * sum_d q_d k_d with q_d ~ N(0, a^2), k_d ~ N(0, a^2): std = scale * sqrt(d) * a^2
    a = math.sqrt(target / (scale * math.sqrt(d)))
    q = (torch.randn(b, sq, hq, d, dtype=torch.float64) * a).to(device=device, dtype=dtype)
    k = (torch.randn(b, sk, hkv, d, dtype=torch.float64) * a).to(device=device, dtype=dtype)
    v = torch.randn(b, sk, hkv, dv or d, dtype=torch.float64).to(device=device, dtype=dtype)
    frac = saturated_fraction(q, k, softcap, scale) if softcap else 0.0
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    return q, k, v, frac


def saturated_fraction(q: torch.Tensor, k: torch.Tensor, softcap: float, scale: Optional[float] = None,
                       factor: float = 2.0) -> float:
    """Share of (query, key, head) scores with |scale * q.k| > factor * softcap (float64)."""
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    if q.numel() == 0 or k.numel() == 0:
        return 0.0
    qd = q.detach().to(torch.float64).transpose(1, 2)
    kd = k.detach().to(torch.float64).transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
    s = torch.matmul(qd, kd.transpose(-1, -2)) * scale
    return (s.abs() > factor * softcap).double().mean().item()


def bottom_right_positions(sq: int, sk: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q_pos, k_pos) for reference_attention that reproduce the kernels' bottom-right alignment
    when Sq != Sk: query i sits at global position i + (Sk - Sq)."""
    return torch.arange(sq) + (sk - sq), torch.arange(sk)


def reference_with_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *,
                         softcap: Optional[float] = None, causal: bool = False, window=None,
                         scale: Optional[float] = None, dlse: Optional[torch.Tensor] = None,
                         bottom_right: bool = True, q_pos=None, k_pos=None,
                         out_used: Optional[torch.Tensor] = None, cu_seqlens=None,
                         sinks: Optional[torch.Tensor] = None):
    """Float64 autograd reference: (out, lse, (dq, dk, dv)) for loss = <out, dout> (+ <lse, dlse>).

    Inputs are the (possibly 16-bit) tensors the kernel saw; they are upcast exactly. With
    bottom_right (default) and no explicit positions, queries are aligned to the end of the keys.
    Gradients of entries that see no key are 0 (masked entries never receive gradient).

    out_used: the (rounded) output the kernel's backward was given. A backward computes
    D_i = rowsum(dO_i * O_i) - dLSE_i; using a rounded O shifts D by rowsum(dO * (O_used - O)),
    which is exactly the gradient of an extra LSE term. With out_used, the reference returns the
    exact gradient of that shifted loss ("rounding-aware"), so the comparison isolates the
    kernel's own arithmetic from the unavoidable rounding of O.

    cu_seqlens: packed documents (as reference_attention takes them; positions then count from
    each document's start, and bottom_right does not apply).

    sinks [Hq]: attention sinks (reference_attention); the gradients are then (dq, dk, dv,
    dsinks), dsinks the float64 gradient of the sinks."""
    sq, sk = q.shape[1], k.shape[1]
    if q_pos is None and k_pos is None and bottom_right and cu_seqlens is None:
        q_pos, k_pos = bottom_right_positions(sq, sk)
    leaves = [x.detach().to(torch.float64).requires_grad_(True)
              for x in (q, k, v) + (() if sinks is None else (sinks,))]
    with torch.enable_grad():
        out, lse = reference_attention(*leaves[:3], softcap=softcap, causal=causal, window=window,
                                       scale=scale, q_pos=q_pos, k_pos=k_pos, cu_seqlens=cu_seqlens,
                                       sinks=None if sinks is None else leaves[3])
        dout64 = dout.detach().to(torch.float64)
        loss = (out * dout64).sum()
        eff = None if dlse is None else dlse.detach().to(torch.float64)
        if out_used is not None:
            shift = ((out_used.detach().to(torch.float64) - out.detach()) * dout64).sum(-1).transpose(1, 2)
            eff = -shift if eff is None else eff - shift
        if eff is not None:
            finite = lse != float("-inf")
            loss = loss + torch.where(finite, lse * eff, torch.zeros_like(lse)).sum()
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    grads = tuple(torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves))
    return out.detach(), lse.detach(), grads


def check_against_reference(out: torch.Tensor, grads: Optional[Sequence[Optional[torch.Tensor]]],
                            ref_out: torch.Tensor, ref_grads: Optional[Sequence[torch.Tensor]],
                            dtype: torch.dtype, *, lse: Optional[torch.Tensor] = None,
                            ref_lse: Optional[torch.Tensor] = None, label: str = "",
                            tol_scale: float = 1.0, exact_grads: Optional[Sequence[torch.Tensor]] = None,
                            ) -> Dict[str, float]:
    """Compare a result with the float64 reference. Fails (AssertionError) on any NaN/inf (LSE may be
    -inf exactly where the reference's is) or on a max relative error above TOLERANCES[dtype]
    (times tol_scale). `ref_grads` are checked against the 'grad' tolerance (pass the
    rounding-aware reference for 16-bit inputs, see reference_with_grads(out_used=...)); optional
    `exact_grads` (the plain float64 gradients) against 'grad_exact', reported as dq_exact etc.
    Returns {'out': err, 'lse': err, 'dq': err, ..., 'dq_exact': err, ...} for what was given."""
    where = f" [{label}]" if label else ""
    errs: Dict[str, float] = {}
    assert_finite(out, "out" + where)
    assert_finite(ref_out, "reference out" + where)
    errs["out"] = rel_err(out, ref_out)
    if lse is not None and ref_lse is not None:
        errs["lse"] = lse_err(lse, ref_lse)
    if grads is not None and ref_grads is not None:
        for name, g, rg in zip(GRAD_NAMES + ("dsinks",), grads, ref_grads):
            if g is None:
                raise AssertionError(f"{name} is None (gradient lost){where}")
            assert_finite(g, name + where)
            assert_finite(rg, "reference " + name + where)
            errs[name] = rel_err(g, rg)
        if exact_grads is not None:
            for name, g, rg in zip(GRAD_NAMES + ("dsinks",), grads, exact_grads):
                assert_finite(rg, "exact reference " + name + where)
                errs[name + "_exact"] = rel_err(g, rg)
    bad = []
    for name, err in errs.items():
        kind = name if name in ("out", "lse") else ("grad_exact" if name.endswith("_exact") else "grad")
        tol = TOLERANCES[dtype][kind] * tol_scale
        if not err <= tol:
            bad.append(f"{name} rel err {err:.3g} > tol {tol:.3g}")
    if bad:
        raise AssertionError(f"mismatch vs float64 reference ({str(dtype).replace('torch.', '')}){where}: "
                             + "; ".join(bad))
    return errs


def assert_cap_matters(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softcap: float,
                       dtype: torch.dtype, causal: bool = False, window=None,
                       scale: Optional[float] = None, out: Optional[torch.Tensor] = None,
                       factor: float = 10.0, bottom_right: bool = True, q_pos=None, k_pos=None
                       ) -> float:
    """Negative control: the uncapped reference must differ from the capped one by more than
    `factor` times the output tolerance of `dtype`, so a kernel that silently dropped the cap would
    fail the comparison. If `out` (a capped result) is given, also check that comparing it with the
    uncapped reference fails. Returns the capped-vs-uncapped relative error."""
    sq, sk = q.shape[1], k.shape[1]
    if q_pos is None and k_pos is None and bottom_right:
        q_pos, k_pos = bottom_right_positions(sq, sk)
    kw = dict(causal=causal, window=window, scale=scale, q_pos=q_pos, k_pos=k_pos)
    with torch.no_grad():
        capped, _ = reference_attention(q.detach(), k.detach(), v.detach(), softcap=softcap, **kw)
        uncapped, _ = reference_attention(q.detach(), k.detach(), v.detach(), softcap=None, **kw)
    assert_finite(capped, "capped reference")
    assert_finite(uncapped, "uncapped reference")
    diff = rel_err(uncapped, capped)
    tol = TOLERANCES[dtype]["out"]
    if not diff > factor * tol:
        raise AssertionError(f"the cap does not matter enough for this test: uncapped vs capped rel diff "
                             f"{diff:.3g} <= {factor} x tol {tol:.3g}; scale the inputs up")
    if out is not None:
        try:
            check_against_reference(out, None, uncapped, None, dtype)
        except AssertionError:
            pass
        else:
            raise AssertionError("a capped output passed the comparison with the UNCAPPED reference; "
                                 "the test cannot detect a dropped cap")
    return diff


def check_result(out: torch.Tensor, lse: Optional[torch.Tensor], grads, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, dout: torch.Tensor, *, dtype: Optional[torch.dtype] = None,
                 dlse: Optional[torch.Tensor] = None, label: str = "", **ref_kwargs) -> Dict[str, float]:
    """One-call comparison of (out, lse, (dq, dk, dv)) with both float64 references: the exact one
    (out, lse, and dq_exact/dk_exact/dv_exact at 'grad_exact') and the rounding-aware one for the
    gradients (at 'grad', using `out` as the O the backward saw). ref_kwargs go to
    reference_with_grads (softcap, causal, window, scale, q_pos, k_pos, bottom_right)."""
    dtype = dtype or q.dtype
    ref_out, ref_lse, exact = reference_with_grads(q, k, v, dout, dlse=dlse, **ref_kwargs)
    aware = None
    if grads is not None:
        _, _, aware = reference_with_grads(q, k, v, dout, dlse=dlse, out_used=out, **ref_kwargs)
    return check_against_reference(out, grads, ref_out, aware, dtype, lse=lse, ref_lse=ref_lse,
                                   label=label, exact_grads=exact if grads is not None else None)
