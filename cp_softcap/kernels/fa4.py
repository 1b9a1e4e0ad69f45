"""`fa4`: FlashAttention-4 (package flash-attn-4, module `flash_attn.cute`, CuTe DSL, JIT).

Forward and backward with softcap, bottom-right windows, GQA (unexpanded), and an LSE gradient,
on sm90 (H100/H200) and sm100/sm110/sm120. Layout is the contract's [B, S, H, D]: no copies.

Calls the low-level `_flash_attn_fwd` / `_flash_attn_bwd` with KEYWORD arguments only (their
positional order differs from flash-attn 2). softcap off is passed as 0.0: FA4 applies any
non-zero cap, even a negative one, so a sentinel would silently cap. On sm90 the cap is applied
through our own score_mod (fa4_softcap.py: no per-score division, scale folded into the cap);
`FA4Kernel(softcap_impl="builtin")` uses FA4's `softcap=` instead.

JIT compile: the first call for each distinct (dtype, head dim, causal/window kind, GQA packing,
softcap VALUE, ...) compiles CuTe kernels (~6 s measured on H200 for forward; backward compiles
separately). The softcap value is hashed into the compile key, so every distinct cap compiles
new kernels; they are cached in-process (and by FA4's own on-disk cache when enabled). Warm up
once per cap before timing.

Backward with a float32 `out` (the CP merge's accumulator): FA4 needs O in the input dtype, and
D = rowsum(dO * O) from a rounded O loses the gradient of near one-hot softcapped rows; the
adapter corrects D exactly through FA4's dLSE input (exact_d_dlse), at one cheap row reduction.

Packed documents (segments=, more than one segment): FA4's varlen form of the same two functions
(cu_seqlens_q/k, max_seqlen_q/k; one [B * S, H, D] token stream, the segments repeated per batch
row as for flash-attn 2), with the same score_mod softcap, window (bottom-right aligned per
segment) and GQA. The varlen LSE (and dLSE) is [H, B * Sq]; the contract's [B, H, Sq] is
converted at this edge only. A row whose segment has no key gets out 0, LSE -inf.

Fully visible calls at head dim 97-128 on sm90 are passed as windowed calls whose right bound
passes every key (tile_window): the same attention on FA4's faster windowed backward tiles.

Probe (fail closed): CUDA present; package importable; arch 8.x has no backward; sm100/sm110 with
head dim 256 + softcap is rejected (its dedicated hd256 backward asserts softcap == 0, and has
no dLSE); the functions must accept every keyword this adapter passes.
"""
from __future__ import annotations

import warnings
from typing import Dict, Optional, Tuple

import torch

from ..spec import Window
from ._common import (VarlenCache, common_cuda_reason, cuda_arch, empty_result, fa2_lse,
                      missing_params, tokens, try_import, varlen_lse_in)
from .base import Capabilities, Kernel
from .fa4_softcap import IMPLS, softcap_kwargs

_MODULE = "flash_attn.cute.interface"
_FWD_KW = ("softmax_scale", "causal", "softcap", "window_size_left", "window_size_right",
           "return_lse", "score_mod")
_BWD_KW = ("softmax_scale", "causal", "softcap", "window_size_left", "window_size_right",
           "deterministic", "dlse", "score_mod", "score_mod_bwd", "dq", "dk", "dv")
_VARLEN_KW = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
INSTALL_HINT = "install flash-attn-4 (pip install 'cp-softcap[fa4]')"
# flash-attn-4 4.0.0b36's CuTe DSL warns at each kernel compile that the score_mod's AuxData
# argument cannot be a JIT argument (a line of several hundred characters per forward and
# backward variant, in every training log) and passes it as a runtime object; the kernels it
# compiles are the ones the GPU tests check against float64. Silenced once FA4 is bound.
AUX_DATA_WARNING = r"Argument aux_data \(position \d+\) cannot be converted to a JitArgument"


def fa4_rejection(arch: Optional[int], spec) -> Optional[str]:
    """Arch/feature rules of FA4 as a pure function (unit-tested on CPU). arch = major*10+minor."""
    if arch is None:
        return "no CUDA device"
    if arch // 10 not in (8, 9, 10, 11, 12):
        return f"compute capability {arch / 10:.1f} is not supported by flash-attn-4 (8.x-12.x)"
    if spec.needs_backward and arch // 10 == 8:
        return "flash-attn-4 has no backward on sm8x; use flex or fa2 for training there"
    if arch // 10 in (10, 11) and 256 in (spec.head_dim, spec.head_dim_v):
        if spec.softcap is not None and spec.needs_backward:
            return (f"sm{arch} head dim 256 backward in flash-attn-4 asserts softcap == 0 "
                    f"(softcap={spec.softcap} requested); use flex")
        if spec.return_lse and spec.needs_backward:
            return f"sm{arch} head dim 256 backward in flash-attn-4 has no dLSE"
    if spec.deterministic and spec.needs_backward and arch // 10 == 12:
        return "flash-attn-4 has no deterministic backward on sm12x"
    return None


def exact_d_dlse(dout: torch.Tensor, out32: torch.Tensor, out_k: torch.Tensor,
                 dlse: Optional[torch.Tensor]) -> torch.Tensor:
    """dLSE to pass so that FA4's D = rowsum(dO * O_k) - dLSE' (O_k = O rounded to bf16/fp16)
    equals the exact D = rowsum(dO * O) - dLSE of the unrounded float32 O the caller has:
        dLSE' = dLSE - rowsum(dO * (O - O_k)).
    (With a 16-bit O, near one-hot softcapped rows lose their gradient to rounding in D.) This
    recovers what casting a merge of several calls' partials loses; a row that one call serves
    has the kernel's own 16-bit O as its merged O, as on one device.
    dout/out [B, S, H, D] -> [B, H, S] float32."""
    # (float32 - 16-bit) promotes to float32 in one pass: no separate float32 copies of O_k, dO
    corr = ((out32.float() - out_k) * dout).sum(-1, dtype=torch.float32).transpose(1, 2)
    return (-corr if dlse is None else dlse.float() - corr).contiguous()


def tile_window(window: Window, arch: Optional[int], head_dim: int, sq: int, sk: int) -> Window:
    """The window FA4 is called with. On sm90 a fully visible call at head dim 97-128 goes as a
    windowed call whose right bound passes every key (max(sq, sk) covers the bottom-right
    offset of any segment): the same attention on FA4's windowed tiles. flash-attn-4 4.0.0b36's
    `_tile_size_bwd_sm90` tiles non-causal backwards at these head dims with 80 query rows and a
    swapped dQ product, causal or windowed ones with 64 rows; measured on an H100 for 2048 x
    28672, 32/16 heads, D 128: backward 460 against 256 TFLOP/s, forward (same tile config)
    563 against 517 (benchmarks/RESULTS.md). Other head dims get the same backward tiles either
    way, or (256) a full-visibility backward within 6 % of the causal rate: unchanged."""
    if window == (None, None) and arch is not None and arch // 10 == 9 and 96 < head_dim <= 128:
        return (None, max(sq, sk))
    return window


class FA4Kernel(Kernel):
    name = "fa4"
    caps = Capabilities(
        softcap=True, window=True, gqa=True,
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        devices=frozenset({"cuda"}), backward_devices=frozenset({"cuda"}),
        max_head_dim=256, head_dim_multiple=8, cp=True, dlse=True, deterministic_backward=True,
        grads_in_input_dtype=True, segments=True,
        notes=("JIT: first call per distinct softcap value compiles (~seconds)",
               "gradients are computed and returned in the input dtype",
               "packed documents through FA4's varlen (cu_seqlens) entry points"))

    def __init__(self, softcap_impl: str = "score_mod", module=None):
        """softcap_impl: "score_mod" (ours, sm90; see fa4_softcap.py) or "builtin" (FA4's softcap=).
        module: a stand-in for `flash_attn.cute.interface` (tests)."""
        if softcap_impl not in IMPLS:
            raise ValueError(f"FA4Kernel(softcap_impl={softcap_impl!r}); expected one of {IMPLS}")
        self.softcap_impl = softcap_impl
        self._mod = None
        self._import_reason: Optional[str] = None
        self._imported = False
        self._probe_cache: Dict[tuple, Optional[str]] = {}
        self._varlen = VarlenCache()
        if module is not None:
            self._bind(module)

    def _interface(self):
        if not self._imported:
            self._imported = True
            mod, reason = try_import(_MODULE)
            if mod is None:
                self._import_reason = f"flash-attn-4 not importable ({reason}); {INSTALL_HINT}"
            else:
                self._bind(mod)
        return self._mod

    def _bind(self, mod) -> None:
        self._imported = True
        missing = (missing_params(mod._flash_attn_fwd, _FWD_KW + _VARLEN_KW)
                   + missing_params(mod._flash_attn_bwd, _BWD_KW + _VARLEN_KW))
        if missing:
            self._import_reason = (f"flash-attn-4 found but its _flash_attn_fwd/_bwd lack keywords "
                                   f"{sorted(set(missing))}; this adapter is written for 4.0.0b36")
        else:
            self._mod = mod
            warnings.filterwarnings("ignore", message=AUX_DATA_WARNING, category=UserWarning)

    def probe(self, spec) -> Optional[str]:
        reason = common_cuda_reason(spec, "fa4")
        if reason:
            return reason
        arch = cuda_arch()
        key = (arch, spec.head_dim, spec.head_dim_v, spec.softcap is not None, spec.needs_backward,
               spec.return_lse, spec.deterministic)
        if key not in self._probe_cache:
            reason = fa4_rejection(arch, spec)
            if reason is None and self._interface() is None:
                reason = self._import_reason
            self._probe_cache[key] = reason
        return self._probe_cache[key]

    def forward(self, q, k, v, *, scale: float, softcap: Optional[float], window: Window,
                segments=None) -> Tuple[torch.Tensor, torch.Tensor]:
        """q [B,Sq,Hq,D], k/v [B,Sk,Hkv,D] -> out [B,Sq,Hq,Dv] (q.dtype), lse [B,Hq,Sq] fp32."""
        if q.shape[1] == 0 or k.shape[1] == 0:
            return empty_result(q, v)
        mod = self._loaded()
        arch = cuda_arch(q.device)
        left, right = tile_window(window, arch, q.shape[-1], q.shape[1], k.shape[1])
        kw = dict(causal=False, window_size_left=left, window_size_right=right, return_lse=True,
                  **softcap_kwargs(self.softcap_impl, arch, scale, softcap, backward=False))
        packed = self._varlen.for_call(segments, q, k, "fa4")
        if packed is None:
            res = mod._flash_attn_fwd(q, k, v, **kw)
            return res[0], res[1]
        b, sq, hq = q.shape[:3]
        res = mod._flash_attn_fwd(tokens(q), tokens(k), tokens(v), cu_seqlens_q=packed.cu_q,
                                  cu_seqlens_k=packed.cu_k, max_seqlen_q=packed.max_q,
                                  max_seqlen_k=packed.max_k, **kw)
        # [H, B * Sq] -> [B, H, Sq]; a segment without keys is marked -inf (+inf mapped, if any)
        return res[0].view(b, sq, hq, -1), fa2_lse(res[1].view(hq, b, sq).transpose(0, 1))

    def _loaded(self):
        mod = self._interface()
        if mod is None:
            raise RuntimeError(self._import_reason)
        return mod

    def prepare_backward(self, dout, out, dlse, dtype):
        """Once per row set, for callers that run many chunk-pair backwards on the same rows
        (the ring): (dout, out, dlse) in the kernel's form, so each backward call skips the
        cast of the float32 O and the D correction. dout/out [B,S,H,D], dlse [B,H,S] or None.
        Row slices of the results stay valid for row slices of the inputs."""
        out_k, dout_k = out.to(dtype), dout.to(dtype)
        if out.dtype != dtype:
            dlse = exact_d_dlse(dout_k, out, out_k, dlse)
        return dout_k, out_k, dlse

    def backward(self, dout, q, k, v, out, lse, *, scale: float, softcap: Optional[float],
                        window: Window, dlse: Optional[torch.Tensor] = None, segments=None):
        """Gradients (input dtype) of this chunk pair given the FINAL merged out/lse of its rows."""
        if q.shape[1] == 0 or k.shape[1] == 0:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        mod = self._loaded()
        arch = cuda_arch(q.device)
        left, right = tile_window(window, arch, q.shape[-1], q.shape[1], k.shape[1])
        out_k, dout_k = out.to(q.dtype), dout.to(q.dtype)
        if out.dtype != q.dtype:
            dlse = exact_d_dlse(dout_k, out, out_k, dlse)
        kw = dict(causal=False, window_size_left=left, window_size_right=right,
                  deterministic=torch.are_deterministic_algorithms_enabled(),
                  **softcap_kwargs(self.softcap_impl, arch, scale, softcap, backward=True))
        packed = self._varlen.for_call(segments, q, k, "fa4")
        if packed is None:
            return tuple(mod._flash_attn_bwd(
                q, k, v, out_k, dout_k, lse.float().contiguous(),
                dlse=None if dlse is None else dlse.float().contiguous(), **kw)[:3])
        # the kernel writes [B, S, H, D] buffers of ours through [B * S, H, D] views: returned
        # whole (not as views of its [B * S, H, D] outputs), the caller's sum adopts them
        # instead of copying each gradient (merge.GradAccumulator)
        dq, dk, dv = (torch.empty(t.shape, dtype=q.dtype, device=q.device) for t in (q, k, v))
        mod._flash_attn_bwd(
            tokens(q), tokens(k), tokens(v), tokens(out_k), tokens(dout_k), varlen_lse_in(lse),
            cu_seqlens_q=packed.cu_q, cu_seqlens_k=packed.cu_k, max_seqlen_q=packed.max_q,
            max_seqlen_k=packed.max_k, dlse=None if dlse is None else varlen_lse_in(dlse),
            dq=tokens(dq), dk=tokens(dk), dv=tokens(dv), **kw)
        return dq, dk, dv
