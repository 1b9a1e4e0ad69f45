"""`fa3`: FlashAttention-3 (module `flash_attn_interface`, dist flash_attn_3; Hopper only).

Opt-in and single-device only: the selector requires CP_SOFTCAP_FA3=1 (RULES row) and
caps.cp=False keeps it out of every context-parallel path: FA3's context-parallel path cannot
carry the softcap.

At least four incompatible Python signatures shipped under one version string, so the adapter
binds by PARAMETER NAMES: every parameter without a default that we do not set is passed as None
(cu_seqlens, seqused, max_seqlen, page tables, rotary, descales...), the window is passed as
`window_size=(l, r)` or `window_size_left/right` according to what the function takes, and
dq/dk/dv are pre-allocated. Some builds compile softcap out (FLASHATTENTION_DISABLE_SOFTCAP):
the probe runs a tiny softcap forward+backward against float32 math and fails closed.
Empty rows: LSE -inf (+inf when seqlen_k == 0); both normalised to -inf.
"""
from __future__ import annotations

import inspect
import math
from typing import Dict, Optional

import torch

from ..spec import Window
from ._common import (common_cuda_reason, cuda_arch, fa2_lse, fa_backward_empty, fa_forward_empty,
                      fa_window, missing_params, softcap_value, try_import)
from .base import Capabilities, Kernel, refuse_segments

_MODULE = "flash_attn_interface"
INSTALL_HINT = "build flash-attention's hopper/ package (dist flash_attn_3) for sm90"


def bind_kwargs(fn, given: Dict[str, object], window: Window,
                optional: tuple = ("deterministic",)) -> Dict[str, object]:
    """Keyword arguments for `fn`: `given` (names in `optional` dropped if fn lacks them), the
    window in the form fn takes, and None for every other parameter without a default.
    Raises TypeError naming what is missing."""
    fn = getattr(fn, "_init_fn", fn)
    params = inspect.signature(fn).parameters
    left, right = fa_window(window)
    kw = {n: x for n, x in given.items() if n in params or n not in optional}
    if "window_size_left" in params:
        kw.update(window_size_left=left, window_size_right=right)
    elif "window_size" in params:
        kw["window_size"] = (left, right)
    else:
        raise TypeError(f"{getattr(fn, '__name__', fn)} takes no window_size parameter")
    unknown = [n for n in kw if n not in params]
    if unknown:
        raise TypeError(f"{getattr(fn, '__name__', fn)} lacks parameters {unknown}")
    for name, p in params.items():
        if name not in kw and p.default is inspect.Parameter.empty and p.kind in (
                inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            kw[name] = None
    return kw


class FA3Kernel(Kernel):
    name = "fa3"
    caps = Capabilities(
        softcap=True, window=True, gqa=True,
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        devices=frozenset({"cuda"}), backward_devices=frozenset({"cuda"}),
        max_head_dim=256, head_dim_multiple=8, cp=False, dlse=False, deterministic_backward=True,
        grads_in_input_dtype=True,
        notes=("opt-in: CP_SOFTCAP_FA3=1; never under context parallelism",))

    def __init__(self, module=None):
        self._mod, self._reason, self._loaded = None, None, False
        self._selftests: Dict[tuple, Optional[str]] = {}
        if module is not None:
            self._mod, self._loaded = module, True

    def _interface(self):
        if not self._loaded:
            self._loaded = True
            mod, reason = try_import(_MODULE)
            if mod is None:
                self._reason = f"FA3 not importable ({reason}); {INSTALL_HINT}"
            else:
                miss = (missing_params(mod._flash_attn_forward, ("q", "k", "v", "softmax_scale", "causal", "softcap"))
                        + missing_params(mod._flash_attn_backward, ("dq", "dk", "dv", "softmax_scale", "softcap")))
                if miss:
                    self._reason = f"FA3 found but its low-level functions lack {miss}; {INSTALL_HINT}"
                else:
                    self._mod = mod
        return self._mod

    def probe(self, spec) -> Optional[str]:
        reason = common_cuda_reason(spec, "fa3")
        if reason:
            return reason
        arch = cuda_arch()
        if arch // 10 != 9:
            return f"FA3 runs on Hopper (sm90) only; this GPU is sm{arch}"
        if self._interface() is None:
            return self._reason
        key = (spec.dtype, spec.head_dim, spec.head_dim_v, spec.softcap is not None)
        if key not in self._selftests:
            self._selftests[key] = self._selftest(*key)
        return self._selftests[key]

    def _selftest(self, dtype, d, dv, capped) -> Optional[str]:
        """Tiny forward+backward against float32 math with saturating logits."""
        try:
            dev = torch.device("cuda")
            cap = 2.0 if capped else None
            q = (torch.randn(1, 128, 2, d, device=dev) * 2).to(dtype)
            k = (torch.randn(1, 128, 1, d, device=dev) * 2).to(dtype)
            v = torch.randn(1, 128, 1, dv, device=dev).to(dtype)
            scale = 1 / math.sqrt(d)
            out, lse = self.forward(q, k, v, scale=scale, softcap=cap, window=(None, 0))
            s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float().expand(-1, -1, 2, -1)) * scale
            if cap:
                s = cap * torch.tanh(s / cap)
            s = s.masked_fill(torch.ones(128, 128, dtype=torch.bool, device=dev).triu(1), float("-inf"))
            ref = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v.float().expand(-1, -1, 2, -1))
            err = ((out.float() - ref).norm() / ref.norm()).item()
            if not err < 2e-2:
                return (f"FA3 self-test with softcap={cap} is wrong (rel err {err:.2e}): this build "
                        "may have softcap compiled out (FLASHATTENTION_DISABLE_SOFTCAP)")
            grads = self.backward(torch.randn_like(out), q, k, v, out, lse, scale=scale,
                                  softcap=cap, window=(None, 0))
            if not all(torch.isfinite(g).all() for g in grads):
                return "FA3 backward self-test produced NaN/inf"
            return None
        except Exception as e:
            return f"FA3 self-test failed ({type(e).__name__}: {str(e).splitlines()[0][:160]})"

    def forward(self, q, k, v, *, scale: float, softcap: Optional[float], window: Window,
                segments=None):
        """q [B,Sq,Hq,D], k/v [B,Sk,Hkv,D] -> out [B,Sq,Hq,Dv], lse [B,Hq,Sq] fp32."""
        refuse_segments(self, segments)
        empty = fa_forward_empty(self, q, k, v)
        if empty is not None:
            return empty
        fn = self._mod._flash_attn_forward
        res = fn(**bind_kwargs(fn, dict(q=q, k=k, v=v, softmax_scale=scale, causal=False,
                                        softcap=softcap_value(softcap)), window))
        return res[0], fa2_lse(res[1])

    def backward(self, dout, q, k, v, out, lse, *, scale: float, softcap: Optional[float],
                        window: Window, dlse: Optional[torch.Tensor] = None, segments=None):
        """(dq, dk, dv) in the input dtype given the final out/lse (no dLSE in FA3)."""
        refuse_segments(self, segments)
        empty = fa_backward_empty(self, q, k, v, dlse)
        if empty is not None:
            return empty
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        fn = self._mod._flash_attn_backward
        fn(**bind_kwargs(fn, dict(dout=dout.to(q.dtype).contiguous(), q=q, k=k, v=v,
                                  out=out.to(q.dtype).contiguous(),
                                  softmax_lse=lse.float().contiguous(), dq=dq, dk=dk, dv=dv,
                                  softmax_scale=scale, causal=False,
                                  softcap=softcap_value(softcap),
                                  deterministic=torch.are_deterministic_algorithms_enabled()),
                   window))
        return dq, dk, dv
