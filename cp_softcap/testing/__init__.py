"""cp_softcap.testing: check attention results against a float64 reference (like torch.testing).

For anyone validating a kernel, a CP setup or a cluster: the same helpers the library's own
tests use.

    from cp_softcap.testing import check_against_reference, reference_with_grads, saturating_qkv
    q, k, v, frac = saturating_qkv(1, 64, 64, 4, 2, 32, torch.bfloat16, softcap=50.0)
    ref_out, ref_lse, ref_grads = reference_with_grads(q, k, v, dout, softcap=50.0, causal=True)
    errs = check_against_reference(out, (dq, dk, dv), ref_out, ref_grads, torch.bfloat16)

reference_attention      float64 attention of the full sequence (softcap, causal, window, GQA,
                         global positions, packed documents via cu_seqlens=), differentiable;
                         materialises the score matrix
reference_with_grads     its output, LSE and gradients for a given dout
masked_attention         float64 attention under any bool [Sq, Sk] visibility mask
saturating_qkv           inputs whose scores saturate tanh (|s| well above 2 * cap on many entries)
check_against_reference  max-normalised errors vs the reference, within TOLERANCES per dtype;
                         raises on NaN/inf or a larger error
assert_cap_matters       negative control: the same call without the cap must fail the check
check_result             forward + backward of one kernel call against the reference
"""
from .checks import (GRAD_NAMES, TOLERANCES, assert_cap_matters, assert_finite,
                     bottom_right_positions, check_against_reference, check_result, lse_err,
                     reference_with_grads, rel_err, saturated_fraction, saturating_qkv, tolerance)
from .reference import masked_attention, reference_attention

__all__ = ["GRAD_NAMES", "TOLERANCES", "assert_cap_matters", "assert_finite", "bottom_right_positions",
           "check_against_reference", "check_result", "lse_err", "masked_attention",
           "reference_attention", "reference_with_grads", "rel_err", "saturated_fraction",
           "saturating_qkv", "tolerance"]
