"""Liger Kernel's fused Triton kernels for the pieces of Gemma2 outside attention (--fused).

Four pieces, each called exactly as liger_kernel 0.8.5 defines it, each a drop-in for model.py's
pure-PyTorch piece with the same math:

  RMSNorm    x * rsqrt(mean(x^2) + eps) * (1 + w) in float32, cast back (offset 1, "gemma" casting)
  GEGLU      gelu_tanh(gate) * up
  RoPE       q, k rotated in place by cos/sin (the rotate-half form model.apply_rope uses)
  loss       the LM head fused with cross-entropy and the final softcap, summed in float32

--fused auto (the default) uses them on CUDA when liger_kernel imports, and the PyTorch pieces
otherwise (CPU, CI, no liger). With --compile, auto keeps only the fused loss (outside every
compiled graph): inductor fuses the norm, GEGLU and RoPE itself. --fused liger insists (a clear
error where it cannot run), --fused torch never uses them. Install: pip install "cp-softcap[gpu]".
"""
from __future__ import annotations

from typing import Optional

import torch

CHOICES = ("auto", "liger", "torch")
PIECES = ("rms_norm", "geglu", "rope", "loss")
INSTALL = 'pip install "cp-softcap[gpu]" (liger-kernel)'


def liger_problem() -> Optional[str]:
    """None when liger_kernel's ops import here, else why not (one line)."""
    try:
        import liger_kernel.ops  # noqa: F401
    except Exception as e:       # ImportError, or triton failing to load on this machine
        return f"liger_kernel does not import here ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return None


def choose(fused: str, device_type: str, compile: bool = False) -> tuple:
    """The pieces that run on Liger's kernels (a subset of PIECES; () = all PyTorch).
    Raises ValueError, naming the fix, when --fused liger cannot be honoured."""
    if fused not in CHOICES:
        raise ValueError(f"--fused {fused!r}: choose one of {', '.join(CHOICES)}")
    if fused == "torch":
        return ()
    if device_type != "cuda":
        if fused == "liger":
            raise ValueError(f"--fused liger runs Triton GPU kernels, but this run is on {device_type}; "
                             "use --fused auto or torch")
        return ()
    problem = liger_problem()
    if problem:
        if fused == "liger":
            raise ValueError(f"--fused liger: {problem}; {INSTALL}, or use --fused auto or torch")
        return ()
    if compile and fused == "auto":
        return ("loss",)
    return PIECES


def planned(fused: str, device_type: str, compile: bool = False) -> tuple:
    """The pieces the memory plan counts as fused, by Liger or by inductor: all under --compile
    or --fused liger, none with --fused torch, and for auto what this machine would pick (Liger
    on CUDA when it imports), without the checks a run makes (--plan needs only shapes)."""
    if compile or fused == "liger":
        return PIECES
    return () if fused == "torch" else choose("auto", device_type)


def apply(model, pieces) -> None:
    """Switch the model's modules to Liger's kernels for `pieces` (from choose())."""
    unknown = set(pieces) - set(PIECES)
    if unknown:
        raise ValueError(f"unknown fused pieces {sorted(unknown)}; choose from {PIECES}")
    from .model import MLP, Attention, RMSNorm
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.liger = "rms_norm" in pieces
        elif isinstance(m, MLP):
            m.liger = "geglu" in pieces
        elif isinstance(m, Attention):
            m.liger = "rope" in pieces
    model.liger_loss = "loss" in pieces


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from liger_kernel.ops import LigerRMSNormFunction
    # offset 1: Gemma's (1 + w); "gemma" casting: all in float32, cast back to x's dtype;
    # not in place (x is the residual stream, still needed)
    return LigerRMSNormFunction.apply(x, weight, eps, 1.0, "gemma", False)


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    from liger_kernel.ops import LigerGELUMulFunction
    return LigerGELUMulFunction.apply(gate, up)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [B, S, Hq, D], k [B, S, Hkv, D], cos/sin [B or 1, S, D] -> roped q, k (same layout).
    Liger takes heads before tokens and works on the [B, S, H, D] storage in place."""
    from liger_kernel.ops import LigerRopeFunction
    q, k = LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q.transpose(1, 2), k.transpose(1, 2)


SLICE_BYTES = 1 << 30      # Liger's logits slice (in the matmul dtype): at most 1 GiB by default


def liger_chunk_mem_const(tokens: int, vocab: int, hidden: int, itemsize: int,
                          chunk: Optional[int] = None) -> int:
    """Liger's `chunk_mem_const` for slices of at most `chunk` tokens (default: SLICE_BYTES of
    logits), rounded down to a power of two as Liger's own slicing rounds; never smaller than
    Liger's default slices.

    Liger slices next_pow2(ceil(tokens / ceil(vocab / (c * hidden)))) tokens at a time for
    constant c (1 by default: 128-token slices at Gemma2's 256K vocabulary). Each slice adds its
    share into the float32 [vocab, hidden] gradient of the tied embedding, a pass over 2.4 GB
    that is bandwidth-bound at 128 tokens; measured on an H100 (2b, 8K tokens) those passes took
    a quarter of the step. A larger c means fewer, compute-bound passes."""
    target = chunk if chunk is not None else SLICE_BYTES // (itemsize * vocab)
    target = 1 << max(0, int(target).bit_length() - 1)       # a power of two, <= target
    slices = -(-tokens // target)
    return max(1, vocab // (hidden * slices))


def softcap_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                              cap: Optional[float], chunk: Optional[int] = None) -> torch.Tensor:
    """loss.softcap_cross_entropy_sum on Liger's fused linear cross-entropy: the float32 sum over
    labels != -100 of cross-entropy(cap * tanh(hidden @ weight.T / cap)); no logits kept.

    chunk: tokens per slice (default: 1 GiB of logits in the matmul dtype). Under autocast,
    hidden and the tied embedding enter in the autocast dtype, cast once here: Liger multiplies
    by weight.t(), a view, which autocast casts again for every slice (its cache skips views;
    on an H100 that was 85 ms of a 600 ms step at 8K tokens). The LM head's share of the
    embedding gradient is then summed over the slices in float32 and returned rounded once to
    the autocast dtype, as any linear layer's weight gradient under autocast."""
    from liger_kernel.ops import LigerFusedLinearCrossEntropyFunction

    from .loss import autocast_dtype
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} must share "
                         "their leading (token) dimensions")
    dt = autocast_dtype(hidden)
    if dt is not None:
        hidden, weight = hidden.to(dt), weight.to(dt)
    h = hidden.reshape(-1, hidden.shape[-1])
    c = liger_chunk_mem_const(h.shape[0], weight.shape[0], weight.shape[1], weight.element_size(), chunk)
    # accum_dtype float32: the slices' gradient sum is float32 (Liger rounds it to weight's dtype)
    loss = LigerFusedLinearCrossEntropyFunction.apply(
        h, weight, labels.reshape(-1), None, None, -100, 0.0, 0.0,
        "sum", cap, False, torch.float32, False, False, False, None, None, c)[0]
    return loss.float()
