"""`fa2`: FlashAttention-2 (`flash_attn.flash_attn_interface`, flash-attn 2.6.2 - 2.8.x).

Written against the documented low-level functions. The CPU tests run it on a stand-in module of
each signature family; the GPU tests run it where flash-attn 2 is installed.

Signature families, told apart by PARAMETER NAMES (never version strings):
  "split"  (2.7+, custom ops): _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal,
           window_size_left, window_size_right, softcap, alibi_slopes, return_softmax)
           -> (out, softmax_lse, S_dmask, rng_state)
           _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p,
           softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
           deterministic, rng_state=None) -> softmax_d
  "tuple"  (2.6.x): `window_size` is one (left, right) tuple; forward returns 8 values
           (lse is the 6th); backward returns (dq, dk, dv, softmax_d).
Both write dq/dk/dv IN PLACE: they are always pre-allocated here (None would lose the gradient).
softcap in backward exists only since 2.6.2 (2.6.0/2.6.1 backward has no `softcap` parameter and
silently computes uncapped gradients): its absence is a probe rejection when a cap is trained.
Empty rows: forward LSE is +inf -> mapped to -inf for the contract; backward gets -inf -> +inf
back (FA2 computes exp(s - lse), and exp(-inf - (+inf)) = 0 where exp(-inf - (-inf)) is NaN).
Any cap <= 0 is "off" in FA2; we pass 0.0 for off.

Packed documents (segments=, more than one segment): `_flash_attn_varlen_forward/backward`, in
the same two families (window_size_left/right or window_size; the 2.6 varlen forward also takes
block_table). The B rows (all sharing the segments) become one [B * S, H, D] token stream whose
cu_seqlens_q/k repeat the segments at offsets b * Sq / b * Sk (int32 device tensors, cached per
geometry); max_seqlen_q/k is the longest segment. The varlen LSE [H, B * Sq] becomes the
contract's [B, H, Sq] and back; +inf/-inf as above. The window is applied per segment,
bottom-right aligned: the contract's segment rule.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..spec import Window
from ._common import (VarlenCache, common_cuda_reason, cuda_arch, fa2_lse, fa_backward_empty,
                      fa_forward_empty, fa_window, missing_params, softcap_value, tokens,
                      try_import, varlen_lse_in)
from .base import Capabilities, Kernel

_MODULE = "flash_attn.flash_attn_interface"
_COMMON = ("dropout_p", "softmax_scale", "causal", "alibi_slopes")
INSTALL_HINT = "install flash-attn >= 2.6.2 (pip install flash-attn --no-build-isolation)"


def signature_family(fwd, bwd) -> tuple:
    """('split' | 'tuple', None) or (None, reason) from the functions' parameter names."""
    if not missing_params(fwd, _COMMON + ("window_size_left", "window_size_right", "softcap")):
        family = "split"
    elif not missing_params(fwd, _COMMON + ("window_size", "softcap")):
        family = "tuple"
    else:
        return None, ("flash_attn._flash_attn_forward has neither the 2.6 (window_size, softcap) "
                      "nor the 2.7+ (window_size_left/right, softcap) parameters: flash-attn < 2.6 "
                      f"has no softcap; {INSTALL_HINT}")
    win = ("window_size_left", "window_size_right") if family == "split" else ("window_size",)
    miss = missing_params(bwd, ("dq", "dk", "dv", "deterministic") + _COMMON[:3] + win)
    if miss:
        return None, f"flash_attn._flash_attn_backward lacks parameters {miss}; {INSTALL_HINT}"
    return family, None


_VARLEN = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softcap")


def varlen_reason(mod, family: str) -> Optional[str]:
    """None if the module's varlen functions take what packed calls pass, else why not."""
    fwd = getattr(mod, "_flash_attn_varlen_forward", None)
    bwd = getattr(mod, "_flash_attn_varlen_backward", None)
    if fwd is None or bwd is None:
        return f"this flash-attn has no _flash_attn_varlen_forward/backward; {INSTALL_HINT}"
    win = ("window_size_left", "window_size_right") if family == "split" else ("window_size",)
    miss = missing_params(fwd, _VARLEN + win) + missing_params(bwd, _VARLEN + win + ("dq",))
    if miss:
        return f"this flash-attn's varlen functions lack parameters {sorted(set(miss))}; {INSTALL_HINT}"
    return None


def varlen_lse(lse: torch.Tensor, b: int, sq: int) -> torch.Tensor:
    """flash-attn varlen LSE [H, b * sq] (+inf for empty rows) -> contract [b, H, sq]."""
    if lse.dim() != 2 or lse.shape[1] != b * sq:
        raise RuntimeError(f"flash-attn varlen LSE has shape {tuple(lse.shape)}, expected "
                           f"[heads, {b * sq}] (flash-attn >= 2.6.2 returns it unpadded); {INSTALL_HINT}")
    return fa2_lse(lse.view(lse.shape[0], b, sq).transpose(0, 1))


def backward_has_softcap(bwd) -> bool:
    """flash-attn >= 2.6.2: the backward takes softcap (earlier ones drop it silently)."""
    return not missing_params(bwd, ("softcap",))


class FA2Kernel(Kernel):
    name = "fa2"
    caps = Capabilities(
        softcap=True, window=True, gqa=True,
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        devices=frozenset({"cuda"}), backward_devices=frozenset({"cuda"}),
        max_head_dim=256, head_dim_multiple=8, cp=True, dlse=False, deterministic_backward=True,
        grads_in_input_dtype=True, segments=True,
        notes=("flash-attn >= 2.6.2 (softcap backward); LSE +inf for empty rows normalised",
               "packed documents through the varlen functions (batch rows joined)"))

    def __init__(self, module=None):
        self._mod, self._family, self._reason = None, None, None
        self._loaded = False
        self._varlen = VarlenCache()
        if module is not None:            # tests inject a stand-in module
            self._bind(module)

    def _bind(self, mod):
        self._loaded = True
        family, reason = signature_family(mod._flash_attn_forward, mod._flash_attn_backward)
        self._mod, self._family, self._reason = (mod, family, None) if family else (None, None, reason)

    def _interface(self):
        if not self._loaded:
            mod, reason = try_import(_MODULE)
            if mod is None:
                self._loaded, self._reason = True, f"flash-attn 2 not importable ({reason}); {INSTALL_HINT}"
            else:
                self._bind(mod)
        return self._mod

    def probe(self, spec) -> Optional[str]:
        reason = common_cuda_reason(spec, "fa2")
        if reason:
            return reason
        if spec.head_dim_v != spec.head_dim:
            return (f"v head dim {spec.head_dim_v} != q/k head dim {spec.head_dim}: flash-attn 2 "
                    "needs one head size")
        arch = cuda_arch()
        if arch < 80:
            return f"flash-attn 2 needs sm80+, this GPU is sm{arch}"
        if self._interface() is None:
            return self._reason
        if spec.softcap is not None and spec.needs_backward and not backward_has_softcap(
                self._mod._flash_attn_backward):
            return ("this flash-attn's backward has no softcap parameter (< 2.6.2): its softcap "
                    f"gradients are silently wrong; {INSTALL_HINT}")
        if spec.documents:
            return varlen_reason(self._mod, self._family)
        return None

    def _win_kwargs(self, window: Window) -> dict:
        left, right = fa_window(window)
        if self._family == "split":
            return {"window_size_left": left, "window_size_right": right}
        return {"window_size": (left, right)}

    def _packed(self, segments, q, k):
        """(cu_q, cu_k, max_q, max_k) over the B rows joined, for a call with several
        segments; None otherwise."""
        packed = self._varlen.for_call(segments, q, k, "fa2")
        if packed is not None and varlen_reason(self._mod, self._family):
            raise RuntimeError(varlen_reason(self._mod, self._family))
        return packed

    def _varlen_forward(self, q, k, v, packed, scale, cap, window):
        cu_q, cu_k, max_q, max_k = packed
        fwd = self._mod._flash_attn_varlen_forward
        b, sq = q.shape[:2]
        qs, ks, vs = (tokens(t) for t in (q, k, v))
        if self._family == "split":      # custom ops since 2.7: positional, documented order
            left, right = fa_window(window)
            res = fwd(qs, ks, vs, cu_q, cu_k, max_q, max_k, 0.0, scale, False, left, right, cap,
                      None, False)
        else:
            extra = {} if missing_params(fwd, ("block_table",)) else {"block_table": None}
            res = fwd(qs, ks, vs, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale,
                      causal=False, softcap=cap, alibi_slopes=None, return_softmax=False,
                      **self._win_kwargs(window), **extra)
        out, lse = (res[0], res[1]) if len(res) == 4 else (res[0], res[5])
        return out.view(b, sq, *out.shape[1:]), varlen_lse(lse, b, sq)

    def forward(self, q, k, v, *, scale: float, softcap: Optional[float], window: Window,
                segments=None):
        """q [B,Sq,Hq,D], k/v [B,Sk,Hkv,D] -> out [B,Sq,Hq,Dv], lse [B,Hq,Sq] fp32 (-inf empty)."""
        empty = fa_forward_empty(self, q, k, v)
        if empty is not None:
            return empty
        cap = softcap_value(softcap)
        packed = self._packed(segments, q, k)
        if packed is not None:
            return self._varlen_forward(q, k, v, packed, scale, cap, window)
        if self._family == "split":      # custom ops since 2.7: positional, documented order
            left, right = fa_window(window)
            res = self._mod._flash_attn_forward(q, k, v, 0.0, scale, False, left, right, cap,
                                                None, False)
        else:
            res = self._mod._flash_attn_forward(
                q, k, v, dropout_p=0.0, softmax_scale=scale, causal=False, softcap=cap,
                alibi_slopes=None, return_softmax=False, **self._win_kwargs(window))
        out, lse = (res[0], res[1]) if len(res) == 4 else (res[0], res[5])
        return out, fa2_lse(lse)

    def backward(self, dout, q, k, v, out, lse, *, scale: float, softcap: Optional[float],
                        window: Window, dlse: Optional[torch.Tensor] = None, segments=None):
        """(dq, dk, dv) in the input dtype given the final merged out/lse; FA2 has no dlse."""
        empty = fa_backward_empty(self, q, k, v, dlse)
        if empty is not None:
            return empty
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        lse_in = lse.float()
        lse_in = torch.where(lse_in == float("-inf"), torch.full_like(lse_in, float("inf")),
                             lse_in).contiguous()
        if not backward_has_softcap(self._mod._flash_attn_backward) and softcap is not None:
            raise RuntimeError("this flash-attn backward ignores softcap (< 2.6.2); refusing to "
                               f"return wrong gradients; {INSTALL_HINT}")
        det = torch.are_deterministic_algorithms_enabled()
        dout, out = dout.to(q.dtype).contiguous(), out.to(q.dtype).contiguous()
        packed = self._packed(segments, q, k)
        if packed is not None:
            return self._varlen_backward(dout, q, k, v, out, lse_in, packed, scale, softcap,
                                         window, det)
        if self._family == "split":
            left, right = fa_window(window)
            self._mod._flash_attn_backward(dout, q, k, v, out, lse_in, dq, dk, dv, 0.0, scale,
                                           False, left, right, softcap_value(softcap), None, det,
                                           None)
        else:
            kw = dict(dropout_p=0.0, softmax_scale=scale, causal=False, alibi_slopes=None,
                      deterministic=det, rng_state=None, **self._win_kwargs(window))
            if backward_has_softcap(self._mod._flash_attn_backward):
                kw["softcap"] = softcap_value(softcap)
            self._mod._flash_attn_backward(dout, q, k, v, out, lse_in, dq, dk, dv, **kw)
        return dq, dk, dv

    def _varlen_backward(self, dout, q, k, v, out, lse_in, packed, scale, softcap, window, det):
        """Packed backward: lse_in [B, H, Sq] (+inf for empty rows) goes in as [H, B * Sq];
        gradients are written into [B, S, H, D] buffers through [B * S, H, D] views and returned
        whole (not as views), so the caller's sum adopts them without a copy."""
        cu_q, cu_k, max_q, max_k = packed
        qs, ks, vs = (tokens(t) for t in (q, k, v))
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
        bwd = self._mod._flash_attn_varlen_backward
        lse_t = varlen_lse_in(lse_in)
        args = (tokens(dout), qs, ks, vs, tokens(out), lse_t, tokens(dq), tokens(dk), tokens(dv),
                cu_q, cu_k, max_q, max_k)
        if self._family == "split":
            left, right = fa_window(window)
            bwd(*args, 0.0, scale, False, left, right, softcap_value(softcap), None, det, None)
        else:
            bwd(*args, dropout_p=0.0, softmax_scale=scale, causal=False, softcap=softcap_value(softcap),
                alibi_slopes=None, deterministic=det, rng_state=None, **self._win_kwargs(window))
        return dq, dk, dv
