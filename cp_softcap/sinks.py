"""Attention sinks: one learned logit per query head that joins every query's softmax
denominator and attends to nothing (gpt-oss's `s_aux`; "attention sinks" of StreamingLLM).

Row i of head h, with the ordinary attention's (out O, lse L) over its visible keys (softcap,
window and documents as always), gets one more column of logit s_h (neither scaled nor
softcapped) and value 0:

    L' = logaddexp(L, s_h)          O' = O * exp(L - L') = O * sigmoid(L - s_h)

A row that sees no key (L = -inf) ends with O' = 0, L' = s_h. Under context parallelism L is the
row's FINAL merged LSE: the sink counts once per query, after the chunks' merge (applying it to
every chunk would count it once per chunk).

Backward (exact, in the accumulation dtype): the kernels' usual backward given the FINAL
(O', L') of each row is the exact gradient of q, k, v with the sink column included (P'_ij =
exp(z_ij - L') are the true probabilities; the sink's value is zero, so it adds nothing to dV
and dP, and D' = rowsum(dO * O') - dL' already covers it; docs/kernels.md "ring backward"). The
sink's own gradient is that column's dZ summed over the rows:

    d s_h = - sum_{b, i} exp(s_h - L'_{b,h,i}) * D'_{b,h,i}

Each rank returns the sum over ITS OWN query rows (its sequence shard; for the all-to-all
schemes the per-row terms travel back to the rows' owners first), so the sum over the CP group
is the sink's gradient: the data-parallel / CP gradient reduction of parameters (DDP, FSDP,
a manual all_reduce) sums it across ranks like every other parameter's.

This module holds that math; the one-device calls (cps.attention(..., sinks=)) are in
packed_local.py, the CP autograd functions in cp/sinks.py. The kernels never see a sink.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .merge import clean_lse


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor,
                acc: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """(O', L') in `acc` (float32, float64 for float64 inputs) from the final (out [B, S, H, Dv],
    lse [B, H, S]) of the rows and sinks [H] (the heads of `out`). Empty rows (LSE -inf, or
    flash-attn 2's +inf) give O' = 0, L' = sink. Not differentiable by autograd (the callers'
    backward computes the gradients)."""
    s = sinks.detach().to(acc).view(1, -1, 1)
    lse = clean_lse(lse.to(acc))
    total = torch.logaddexp(lse, s)                             # finite: s is finite
    weight = torch.exp(lse - total)                             # 0 where lse = -inf
    return out.to(acc) * weight.transpose(1, 2).unsqueeze(-1), total


def sink_rows(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor,
              dlse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per row, exp(s_h - L') * D' with D' = rowsum(dO * O') - dL', [B, H, S] in out's dtype (the
    accumulation dtype: `out`/`lse` are apply_sinks' O', L'). The sink's gradient is minus the
    sum of these over the rows."""
    acc = out.dtype
    d = (dout.to(acc) * out).sum(-1).transpose(1, 2)
    if dlse is not None:
        d = d - dlse.to(acc)
    return torch.exp(sinks.detach().to(acc).view(1, -1, 1) - lse) * d


def sink_grad(rows: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The sink's gradient [H] in sinks' dtype from sink_rows' terms [B, H, S]."""
    return (-rows.sum(dim=(0, 2))).to(sinks.dtype)
