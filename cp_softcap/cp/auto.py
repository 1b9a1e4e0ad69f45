"""comm="auto": pick the communication scheme with the fewest bytes sent per rank (forward +
backward, the busiest rank), from the call's shapes. Ties go to ring (its transfers overlap
compute step by step), then all_gather, then a2a. Every choice can be overridden with comm=.

Model (n = S/cp local tokens, e = element bytes, gradients travel in float32):
  ring:       per source rank whose keys this rank's queries see (all cp-1 without a window,
              few with a sliding window): fwd K+V; bwd K+V again and float32 dK+dV back.
  all_gather: fwd (cp-1) x local K+V; bwd the same re-gather + float32 reduce-scatter of dK+dV.
  a2a:        (cp-1)/cp of q, k, v, out forward; dout, float32 dq, dk, dv backward, with KV
              heads replicated when Hkv % cp != 0. Needs Hq % cp == 0.
These are the same quantities comm.counting() measures (benchmarks/comm_bytes.py).
"""
from __future__ import annotations

from typing import Dict

from ..layout import needs
from ..spec import AttnSpec
from .ulysses import kv_head_index


def bytes_per_rank(spec: AttnSpec, seq_len: int, batch: int = 1) -> Dict[str, float]:
    cp = spec.cp_size
    n = seq_len // cp
    e = {2: 2, 4: 4, 8: 8}.get(spec.dtype.itemsize, 2)
    g = 8 if e == 8 else 4
    d, dv, hq, hkv = spec.head_dim, spec.head_dim_v, spec.num_heads, spec.num_kv_heads
    kv_tokens = batch * n * hkv * (d + dv)
    sources = max(sum(row) - 1 for row in needs(cp, n // 2, spec.window))
    out = {
        "ring": sources * kv_tokens * (e + e + g),
        "all_gather": (cp - 1) * kv_tokens * (e + e + g),
    }
    if hq % cp == 0:
        frac = (cp - 1) / cp
        kv_heads_sent = sum(len(i) for i in kv_head_index(hq, hkv, cp))  # replicas included
        kv_eff = batch * n * kv_heads_sent * (d + dv)
        q_tok = batch * n * hq * d
        o_tok = batch * n * hq * dv
        out["a2a"] = frac * ((q_tok + o_tok + kv_eff) * e + (o_tok * e) + (q_tok + kv_eff) * g)
    return out


def choose_comm(spec: AttnSpec, seq_len: int, batch: int = 1) -> str:
    costs = bytes_per_rank(spec, seq_len, batch)
    order = ("ring", "all_gather", "a2a")
    return min((n for n in order if n in costs), key=lambda n: (costs[n], order.index(n)))


def describe_comm_choice(spec: AttnSpec, seq_len: int, batch: int = 1) -> str:
    costs = bytes_per_rank(spec, seq_len, batch)
    chosen = choose_comm(spec, seq_len, batch)
    lines = [f"comm='auto' at S={seq_len}, cp={spec.cp_size}: bytes sent per rank per layer (fwd+bwd)"]
    for name in ("ring", "all_gather", "a2a"):
        if name in costs:
            mark = "CHOSEN" if name == chosen else ""
            lines.append(f"  {name:<11} {costs[name] / 2**20:12.1f} MiB {mark}")
        else:
            lines.append(f"  {name:<11} {'-':>12}     ({spec.num_heads} query heads not divisible by cp={spec.cp_size})")
    return "\n".join(lines)
