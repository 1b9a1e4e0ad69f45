"""The per-chunk kernel contract.

Every kernel (one file each in this package) subclasses `Kernel` and implements:

    forward(q, k, v, *, scale, softcap, window) -> (out, lse)
        q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D]   (Hq % Hkv == 0, GQA not expanded)
        out [B, Sq, Hq, Dv] in the input dtype, or float32/float64 (the accumulation dtype) for
        kernels that have it unrounded (torch): callers cast once; lse [B, Hq, Sq] float32
        natural log, contiguous, -inf for a row that sees no key.
    backward(dout, q, k, v, out, lse, *, scale, softcap, window, dlse=None) -> (dq, dk, dv)
        out/lse are the FINAL merged values of the whole row (exact for ring attention: see
        docs/kernels.md); out may be float32 (the CP merge's accumulator): adapters whose kernel
        needs the input dtype cast it, pure-PyTorch paths use it as is for a more exact
        D = rowsum(dO * O). Gradients come in the kernel's own dtype, `partial_dtype(q.dtype)`:
        the input dtype for kernels that compute them there (flash-attn), the accumulation dtype
        (float32; float64 for float64) otherwise. Callers that sum several partials widen while
        adding (cp/grad_accum.py); a single call casts once.
    partial_dtype(dtype) -> dtype of backward's gradients for inputs of `dtype`
        (from caps.grads_in_input_dtype). The CP algorithms size their gradient messages by it.
    prepare_backward(dout, out, dlse, dtype) -> (dout, out, dlse)      [optional]
        Called once per backward by callers that run many chunk-pair backwards on the same rows
        (ring, all_gather); row slices of the results stay valid for row slices of the inputs.
        fa4 uses it to cast the float32 O and correct D once instead of per chunk pair, which
        was measured to matter on the GPU (benchmarks/RESULTS.md). Default: unchanged.

`softcap` is None (off) or a positive float applied as cap * tanh(s / cap) to the scaled score.
`window` is (left, right) in the chunk's own coordinates, flash-attn style (bottom-right aligned):
local query i sees local key j iff  i + (Sk - Sq) - left <= j <= i + (Sk - Sq) + right,
with None for an unbounded side. (None, 0) is bottom-right causal; (None, None) is full.
Callers (see cp_softcap.layout) trim chunk pairs so both sides are >= 0 or None.

Kernels never import torch.distributed or the layers above them (merge, cp, plan).
Capabilities and probes feed the selector table.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch

from ..spec import AttnSpec, Window, grad_dtype

FULL: Window = (None, None)
CAUSAL: Window = (None, 0)


@dataclass(frozen=True)
class Capabilities:
    """What a kernel can serve. The selector rejects any spec that needs more."""
    softcap: bool
    window: bool
    gqa: bool
    dtypes: frozenset
    devices: frozenset                      # "cpu", "cuda"
    backward_devices: frozenset             # devices where backward exists
    max_head_dim: int = 1 << 30
    head_dim_multiple: int = 1
    cp: bool = True                         # may serve chunk pairs under context parallelism
    dlse: bool = False                      # backward accepts a gradient of the LSE
    deterministic_backward: bool = True
    grads_in_input_dtype: bool = False      # backward returns the input dtype (flash-attn family)
    notes: Tuple[str, ...] = field(default_factory=tuple)


class Kernel:
    """Base class: subclasses set `name`, `caps`, and implement forward/backward/probe."""
    name: str = "?"
    caps: Capabilities

    def probe(self, spec: AttnSpec) -> Optional[str]:
        """None if this kernel can run `spec` here (package importable, arch ok, probe call ok);
        otherwise the reason it cannot. Must be cheap after the first call (cache it)."""
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                softcap: Optional[float], window: Window) -> Tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, *, scale: float, softcap: Optional[float],
                 window: Window, dlse: Optional[torch.Tensor] = None
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def partial_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """dtype of backward()'s gradients for inputs of `dtype`."""
        return dtype if self.caps.grads_in_input_dtype else grad_dtype(dtype)

    def prepare_backward(self, dout: torch.Tensor, out: torch.Tensor,
                         dlse: Optional[torch.Tensor], dtype: torch.dtype):
        """Once per backward over many chunk pairs of the same rows: (dout, out, dlse) in the
        form backward() takes without per-call conversion. Default: unchanged."""
        return dout, out, dlse


def visible_mask(sq: int, sk: int, window: Window, device, q_start: int = 0, k_start: int = 0,
                 q_len: Optional[int] = None, k_len: Optional[int] = None) -> Optional[torch.Tensor]:
    """Boolean [q_len, k_len] mask (True = visible) for rows q_start.. and keys k_start.. of an
    Sq x Sk chunk pair under the bottom-right aligned `window`; None when everything is visible."""
    left, right = window
    q_len = sq - q_start if q_len is None else q_len
    k_len = sk - k_start if k_len is None else k_len
    if left is None and right is None:
        return None
    shift = sk - sq
    i = torch.arange(q_start, q_start + q_len, device=device).unsqueeze(1) + shift
    j = torch.arange(k_start, k_start + k_len, device=device).unsqueeze(0)
    mask = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if left is not None:
        mask &= j >= i - left
    if right is not None:
        mask &= j <= i + right
    return mask


def block_visible(sq: int, sk: int, window: Window, q0: int, q1: int, k0: int, k1: int) -> bool:
    """Whether any key in [k0, k1) is visible from any row in [q0, q1) (cheap block skip)."""
    left, right = window
    shift = sk - sq
    if right is not None and k0 > (q1 - 1) + shift + right:
        return False
    if left is not None and k1 - 1 < q0 + shift - left:
        return False
    return True
