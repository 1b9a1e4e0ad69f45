"""Small helpers shared by the GPU adapters (fa2, fa3, fa4, flex, sdpa). Pure logic: everything
here runs (and is unit-tested) on CPU.

LSE normalisation (every adapter returns lse [B, H, Sq] float32, contiguous, -inf for empty rows):
    fa2_lse(lse)              flash-attn 2 marks empty rows with +inf -> -inf
    padded_lse(lse, sq)       mem-efficient SDPA pads the last dim to a multiple of 32 -> slice
    cudnn_lse(lse)            cuDNN SDPA returns [B, H, L, 1] -> [B, H, L]
"""
from __future__ import annotations

import importlib
import inspect
from typing import Callable, Dict, Iterable, NamedTuple, Optional, Tuple

import torch

from ..spec import Window
from .base import check_segments


def fa2_lse(lse: torch.Tensor) -> torch.Tensor:
    """[B, H, S] (or varlen [H, total]) with +inf for empty rows -> float32 contiguous, -inf there."""
    lse = lse.float()
    return torch.where(lse == float("inf"), torch.full_like(lse, float("-inf")), lse).contiguous()


def padded_lse(lse: torch.Tensor, sq: int) -> torch.Tensor:
    """Efficient-attention LSE [B, H, ceil32(Sq)] -> [B, H, Sq] float32 contiguous."""
    if lse.shape[-1] < sq:
        raise ValueError(f"LSE last dim {lse.shape[-1]} is shorter than Sq={sq}; not an "
                         "efficient-attention LSE")
    return lse[..., :sq].float().contiguous()


def cudnn_lse(lse: torch.Tensor) -> torch.Tensor:
    """cuDNN SDPA LSE [B, H, L, 1] (or already [B, H, L]) -> [B, H, L] float32 contiguous."""
    if lse.dim() == 4:
        lse = lse.squeeze(-1)
    return lse.float().contiguous()


def missing_params(fn: Callable, names: Iterable[str]) -> Tuple[str, ...]:
    """Names from `names` that `fn`'s signature lacks (empty tuple: all present). torch custom
    ops (torch.library.custom_op, flash-attn >= 2.7) are unwrapped to their Python function."""
    fn = getattr(fn, "_init_fn", fn)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return tuple(names)
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return ()
    return tuple(n for n in names if n not in params)


def try_import(module: str):
    """(module, None) or (None, 'reason') without raising."""
    try:
        return importlib.import_module(module), None
    except Exception as e:  # ImportError, but also CUDA/driver errors raised at import
        return None, f"{type(e).__name__}: {e}"


def cuda_arch(device=None) -> Optional[int]:
    """Compute capability as major*10+minor (90 for H100/H200), or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def common_cuda_reason(spec, name: str) -> Optional[str]:
    """Reasons shared by CUDA-only kernels: wrong device, or no CUDA here."""
    if spec.device_type != "cuda":
        return f"{name} runs on CUDA only (spec device is {spec.device_type})"
    if not torch.cuda.is_available():
        return f"{name} needs CUDA, and torch.cuda.is_available() is False here"
    return None


def fa_window(window: Window) -> Tuple[int, int]:
    """Contract window (None = unbounded) -> flash-attn 2/3 ints (-1 = unbounded)."""
    left, right = window
    return (-1 if left is None else int(left)), (-1 if right is None else int(right))


def softcap_value(softcap: Optional[float]) -> float:
    """flash-attn kernels take 0.0 for 'off' (never a negative sentinel: FA4 applies any non-zero cap)."""
    return 0.0 if softcap is None else float(softcap)


def empty_result(q: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """out = 0 [B, Sq, Hq, Dv] in q's dtype and lse = -inf [B, Hq, Sq] float32 (no visible key)."""
    b, sq, hq, _ = q.shape
    out = torch.zeros(b, sq, hq, v.shape[-1], dtype=q.dtype, device=q.device)
    return out, torch.full((b, hq, sq), float("-inf"), dtype=torch.float32, device=q.device)


def zero_grads(q, k, v):
    """float32 zeros shaped like q, k, v (backward of a pair with no visible key)."""
    return tuple(torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))


def fa_forward_empty(kernel, q, k, v):
    """The start of a flash-attn 2/3 forward: the empty result when q or k has no token (no
    call to make), else None once the kernel's module is loaded (RuntimeError with the reason
    it is not)."""
    if q.shape[1] == 0 or k.shape[1] == 0:
        return empty_result(q, v)
    if kernel._interface() is None:
        raise RuntimeError(kernel._reason)
    return None


def fa_backward_empty(kernel, q, k, v, dlse):
    """The start of a flash-attn 2/3 backward: ValueError for an LSE gradient (they take none),
    zero (dq, dk, dv) when q or k has no token, else None once the module is loaded."""
    if dlse is not None:
        raise ValueError(f"{kernel.name} has no LSE gradient; the selector should not pick it "
                         "when the returned LSE is differentiated")
    if q.shape[1] == 0 or k.shape[1] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if kernel._interface() is None:
        raise RuntimeError(kernel._reason)
    return None


class Varlen(NamedTuple):
    """A segmented call's B rows joined into one token stream, for flash-attn's varlen entry
    points: int32 cu_seqlens on the device (the segments repeated at offsets b * Sq / b * Sk)
    and the longest segment on each side."""
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


class VarlenCache:
    """Varlen tensors per (segments, batch, device), built once per geometry (a packed layout
    repeats the same few geometries every step) and bounded so a changing stream cannot grow it."""

    def __init__(self, size: int = 256):
        self._size = size
        self._cache: Dict[tuple, Varlen] = {}

    def for_call(self, segments, q: torch.Tensor, k: torch.Tensor, kernel: str) -> Optional[Varlen]:
        """The varlen tensors of a call q [B, Sq, ...] x k [B, Sk, ...] with several segments
        (checked against Sq and Sk, ValueError naming `kernel` otherwise); None for no segments
        or one (the ordinary call)."""
        segs = check_segments(segments, q.shape[1], k.shape[1], kernel)
        if segs is None or segs.single():
            return None
        return self.get(segs, q.shape[0], q.device)

    def get(self, segs, batch: int, device) -> Varlen:
        key = (tuple(segs), batch, str(device))
        if key not in self._cache:
            if len(self._cache) >= self._size:
                self._cache.pop(next(iter(self._cache)))
            rows = range(batch)
            cu = [torch.tensor([b * c[-1] + x for b in rows for x in c[:-1]] + [batch * c[-1]],
                               dtype=torch.int32, device=device) for c in segs]
            self._cache[key] = Varlen(cu[0], cu[1],
                                      max(b - a for a, b in zip(segs[0], segs[0][1:])),
                                      max(b - a for a, b in zip(segs[1], segs[1][1:])))
        return self._cache[key]


def tokens(x: torch.Tensor) -> torch.Tensor:
    """[B, S, H, D] -> [B * S, H, D] (a view when the rows are adjacent in memory)."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def varlen_lse_in(lse: torch.Tensor) -> torch.Tensor:
    """Contract LSE (or dLSE) [B, H, Sq] -> flash-attn varlen [H, B * Sq] float32 contiguous."""
    return lse.float().transpose(0, 1).reshape(lse.shape[1], -1).contiguous()
