"""Softcap for FA4 as our own score_mod: no division per score, scale folded into the cap.

FA4 implements `softcap=c` as a generic score_mod, `c * tanh(s_scaled / c)`, where `/ c` is an
IEEE f32 division per score (a MUFU reciprocal plus Newton steps) on top of the kernel's own
`s * softmax_scale`. That is a third MUFU op next to tanh and exp2, which is what limits a
softcapped kernel at head dim 128. Here the kernel's scale multiply does the whole argument:
softmax_scale = scale / c, score_mod(u) = c * tanh(u), score_mod_bwd = grad * c * (1 - tanh(u)^2)
(FA4 multiplies the backward's dS by softmax_scale afterwards, so dS/ds = scale * (1 - tanh^2)).
The LSE FA4 returns is of the post-mod scores, so it is unchanged.

Used on sm90 only (measured there); elsewhere the adapter passes FA4's own `softcap=`.
One pair of functions per cap value (cached), so FA4's compile cache, keyed by the function's
source and captured values, compiles once per cap as before.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, Optional, Tuple

IMPLS = ("score_mod", "builtin")


@functools.lru_cache(maxsize=None)
def softcap_mods(cap: float) -> Tuple[Callable, Callable]:
    """(score_mod, score_mod_bwd) for FA4 with the scale folded in (see module docstring)."""
    import cutlass.cute as cute

    cap = float(cap)

    @cute.jit
    def softcap_fwd(u, batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return cap * cute.math.tanh(u, fastmath=True)

    @cute.jit
    def softcap_bwd(grad, u, batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        t = cute.math.tanh(u, fastmath=True)
        return grad * (cap - cap * t * t)

    return softcap_fwd, softcap_bwd


def softcap_kwargs(impl: str, arch: Optional[int], scale: float, softcap: Optional[float],
                   backward: bool, mods: Callable = softcap_mods) -> Dict:
    """Keyword arguments for FA4's _flash_attn_fwd (backward=False) or _flash_attn_bwd that
    apply `softcap` (None = off) at `scale`. FA4 takes softcap 0.0 for off, never a sentinel."""
    if impl not in IMPLS:
        raise ValueError(f"fa4 softcap_impl={impl!r}; expected one of {IMPLS}")
    if softcap is None:
        return dict(softmax_scale=scale, softcap=0.0)
    if impl == "builtin" or arch is None or arch // 10 != 9:
        return dict(softmax_scale=scale, softcap=float(softcap))
    fwd, bwd = mods(float(softcap))
    kw = dict(softmax_scale=scale / softcap, softcap=0.0, score_mod=fwd)
    if backward:
        kw["score_mod_bwd"] = bwd
    return kw
