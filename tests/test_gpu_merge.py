"""Fused Triton merge (cp_softcap.merge_fused) against the eager float32 merge.

Marked `gpu` (skipped without CUDA); with TRITON_INTERPRET=1 it runs on CPU too (the kernel
interpreted), unmarked, when triton is importable.
"""
import os

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton not installed (CPU build of torch)")
INTERP = os.environ.get("TRITON_INTERPRET") == "1"

from cp_softcap import merge as eager                  # noqa: E402
from cp_softcap.merge_fused import merge_into_fused    # noqa: E402

pytestmark = [] if INTERP and not torch.cuda.is_available() else pytest.mark.gpu
DEV = "cuda" if torch.cuda.is_available() else "cpu"
INF = float("inf")


def _eager(acc_o, acc_l, out, lse):
    o, l = acc_o.clone(), acc_l.clone()
    lse = eager.clean_lse(lse)
    total = torch.logaddexp(l, lse)
    w_a = torch.where(l == -INF, torch.zeros_like(l), torch.exp(l - total)).transpose(1, 2).unsqueeze(-1)
    w_n = torch.where(lse == -INF, torch.zeros_like(l), torch.exp(lse - total)).transpose(1, 2).unsqueeze(-1)
    return torch.nan_to_num(o * w_a) + out.float() * w_n, torch.where(torch.isnan(total), -INF, total)


@pytest.mark.parametrize("d", [64, 128, 256, 72])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_merge_matches_eager_on_views_with_empty_rows(d, dtype):
    b, s, h = 2, 96, 4
    big_o = torch.randn(b, 2 * s, h, d, device=DEV)
    big_l = torch.randn(b, h, 2 * s, device=DEV)
    acc_o, acc_l = big_o[:, s:], big_l[:, :, s:]                 # row-slice views
    out = torch.randn(b, s, h, d, device=DEV).to(dtype)
    lse = torch.randn(b, h, s, device=DEV) * 5
    lse[0, 0, :7] = -INF                                          # empty new partial
    acc_l[0, 1, 3:9] = -INF                                       # empty accumulator rows ...
    acc_o[0, 3:9, 1] = float("nan")                               # ... whose content must not leak
    lse[0, 2, 10:12], acc_l[0, 2, 10:12] = -INF, -INF             # empty in both
    lse[1, 3, 0] = INF                                            # flash-attn 2's empty marker
    want_o, want_l = _eager(acc_o, acc_l, out, lse)
    merge_into_fused(acc_o, acc_l, out, lse)
    assert not torch.isnan(acc_o).any() and not torch.isnan(acc_l).any()
    assert torch.equal(acc_l == -INF, want_l == -INF)
    assert (acc_l - want_l).nan_to_num(0).abs().max() < 1e-5
    assert (acc_o - want_o).abs().max() < 1e-5
    assert (acc_o[0, 10:12, 2] == 0).all()
    assert torch.equal(big_o[:, :s], big_o[:, :s])                 # untouched half stays


@pytest.mark.gpu
def test_merge_into_dispatches_to_fused_for_cuda():
    acc_o, acc_l = eager.new_accumulator((1, 64, 2, 32), 32, torch.float32, "cuda")
    parts = [(torch.randn(1, 64, 2, 32, device="cuda"), torch.randn(1, 2, 64, device="cuda"))
             for _ in range(3)]
    for o, l in parts:
        eager.merge_into(acc_o, acc_l, o, l)
    os.environ["CP_SOFTCAP_FUSED_MERGE"] = "0"
    try:
        ref_o, ref_l = eager.merge(parts)
    finally:
        del os.environ["CP_SOFTCAP_FUSED_MERGE"]
    assert (acc_o - ref_o).abs().max() < 1e-5 and (acc_l - ref_l).abs().max() < 1e-5
