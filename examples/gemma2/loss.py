"""Cross-entropy over the tied embedding with Gemma2's final softcap, a slice of tokens at a time.

The full path, `cross_entropy(cap * tanh(h @ W.T / cap), labels)`, holds float32 logits
[tokens, vocab] (16 GiB at 16K tokens and Gemma2's 256,000-token vocabulary) plus their gradient.
`softcap_cross_entropy_sum` computes the same sum with at most `chunk` tokens' logits alive at
once. The loss is a sum that only a backward consumes, so each slice's logits turn into that
slice's dh and its share of dW in the forward, right after its loss (as Liger's fused linear
cross-entropy does): one logits matmul per slice instead of a second one in backward, which
only scales the kept gradients by the incoming one. Gradients are computed only for inputs that
require them, and only with grad mode on. Sums and the dW accumulator are float32 whatever the
input dtype, and dW leaves the Function in float32, unrounded (autograd casts it to the weight's
dtype); under autocast the matmuls run in the autocast dtype.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

IGNORE = -100
CHUNK_BYTES = 256 << 20     # default: one slice's float32 logits take at most 256 MiB


def default_chunk(vocab: int) -> int:
    """Tokens per slice so that one slice's float32 logits fit CHUNK_BYTES."""
    return max(1, CHUNK_BYTES // (4 * vocab))


def _slice_eager(z: torch.Tensor, lab: torch.Tensor, cap: Optional[float], grads: bool):
    """One slice's loss sum (float32, 0-d) and, with grads, d(loss)/dz in z's dtype (else None).
    z = h @ W.T [n, V] in the matmul dtype. Eager PyTorch ops, in place where they can be: at
    most three float32 slices alive."""
    dt = z.dtype
    z = z.float()
    t = None
    if cap is not None:
        t = z.div_(cap).tanh_()                               # in place: one buffer fewer
        z = t * cap if grads else t.mul_(cap)                 # the gradient needs t itself
    lse = torch.logsumexp(z, dim=1)
    safe, valid = lab.clamp_min(0)[:, None], lab != IGNORE
    part = ((lse - z.gather(1, safe)[:, 0]) * valid).sum()
    if not grads:
        return part, None
    dz = z.sub_(lse[:, None]).exp_()                          # softmax = d(lse - z[label]) / dz
    del z
    # -1 at each label; ignored rows (label clamped to 0) get a zero row scale below, so no
    # host sync picks the valid rows out
    dz.scatter_add_(1, safe, dz.new_full((dz.shape[0], 1), -1.0))
    scale = valid.float()[:, None]
    if t is None:
        return part, dz.mul_(scale).to(dt)
    t.square_().sub_(1.0).mul_(scale.neg_())                  # through cap * tanh(x / cap):
    return part, dz.mul_(t).to(dt)                            # (1 - t^2) * scale


def _slice_fused(z: torch.Tensor, lab: torch.Tensor, cap: Optional[float], grads: bool):
    """_slice_eager's math written for inductor, which fuses it into a few kernels that read z
    in its own dtype and write dz once (torch.compile'd below; run eagerly it would hold several
    float32 slices). Labels must be -100 or in [0, V): unlike the eager gather, nothing here
    checks the range."""
    zf = z.float()
    t = torch.tanh(zf / cap) if cap is not None else None
    zc = zf if t is None else t * cap
    lse = torch.logsumexp(zc, dim=1)
    safe, valid = lab.clamp_min(0), lab != IGNORE
    hit = torch.arange(zc.shape[1], device=zc.device)[None, :] == safe[:, None]
    part = ((lse - torch.where(hit, zc, 0.0).sum(dim=1)) * valid).sum()
    if not grads:
        return part, None
    dz = (torch.exp(zc - lse[:, None]) - hit.float()) * valid.float()[:, None]
    if t is not None:
        dz = dz * (1.0 - t * t)
    return part, dz.to(z.dtype)


_COMPILED = []


def _slice_compiled():
    """_slice_fused under torch.compile, made on first use (importing the compiler is not free).
    dynamic=True: one graph serves every slice length and cap, so a shorter last slice or a
    second model does not use up dynamo's recompile limit (past it, dynamo would silently run
    the function uncompiled, holding more memory than _slice_eager)."""
    if not _COMPILED:
        _COMPILED.append(torch.compile(_slice_fused, dynamic=True))
    return _COMPILED[0]


def _slices(n: int, chunk: int):
    return ((s, min(s + chunk, n)) for s in range(0, n, chunk))


@functools.lru_cache(maxsize=None)
def _gemm_adds_into_float32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch adds a 16-bit GEMM's float32 result into a float32 tensor on `device`
    (addmm with out_dtype, torch >= 2.8 on CUDA): tried once on tiny tensors, since the overload
    can exist and still refuse a float32 accumulator."""
    if not hasattr(torch.ops.aten.addmm, "dtype_out"):
        return False
    a = torch.ones(2, 2, dtype=dtype, device=device)
    acc = torch.ones(2, 2, dtype=torch.float32, device=device)
    try:
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
    except (RuntimeError, NotImplementedError):
        return False
    return bool((acc == 3).all())


def _add_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b into the float32 `acc`, with no temporary of acc's size. 16-bit operands on
    CUDA stay 16-bit and the GEMM adds its float32 result into acc itself (a float32 matmul there
    runs at a fraction of the tensor cores' rate, and a separate add is two more passes over
    acc); elsewhere float32 operands (CPU has no 16-bit GEMM with a float32 output)."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and _gemm_adds_into_float32(a.device, a.dtype):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:       # addmm with out=, not addmm_: the same in-place GEMM, and FLOP counters see it
        torch.addmm(acc, a.float(), b.float(), out=acc)


class _SoftcapCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, labels, cap, chunk, need_dh, need_dw, compiled):
        # the dtypes are the Function's own (h's for the matmuls, float32 sums and dW), with or
        # without an autocast region around the call, which would recast the float32 GEMM
        with torch.autocast(h.device.type, enabled=False):
            return _SoftcapCE._forward(ctx, h, w, labels, cap, chunk, need_dh, need_dw, compiled)

    @staticmethod
    def _forward(ctx, h, w, labels, cap, chunk, need_dh, need_dw, compiled):
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        wh = w.to(h.dtype)                  # h's dtype (the autocast dtype): once, not per slice
        dh = torch.empty_like(h) if need_dh else None
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_dw else None
        one_slice = _slice_compiled() if compiled else _slice_eager
        for s, e in _slices(h.shape[0], chunk):
            # the logits go straight in, unnamed here: the eager slice drops them once widened
            part, dz = one_slice(torch.nn.functional.linear(h[s:e], wh), labels[s:e], cap,
                                 need_dh or need_dw)
            total += part
            if dh is not None:
                dh[s:e] = dz @ wh
            if dw is not None:
                _add_mm(dw, dz.t(), h[s:e])
            del part, dz                # before the next slice's logits exist
        ctx.save_for_backward(dh, dw)      # either may be None
        ctx.used = False
        return total

    @staticmethod
    def backward(ctx, grad_total):
        if torch.is_grad_enabled() and any(ctx.needs_input_grad[:2]):
            raise RuntimeError(
                "softcap_cross_entropy_sum: its gradients are computed in its forward and cannot be "
                "differentiated again (create_graph=True, e.g. a gradient penalty); compute that "
                "loss with the full logits instead")
        if ctx.used:
            raise RuntimeError(
                "softcap_cross_entropy_sum: a second backward through one loss (retain_graph=True); "
                "its gradients were kept from the forward and scaled in place by the first: "
                "compute the loss again for each backward")
        ctx.used = True
        dh, dw = ctx.saved_tensors
        g = grad_total.float()          # in place: the buffers are this loss's alone
        return (None if dh is None else dh.mul_(g), None if dw is None else dw.mul_(g),
                None, None, None, None, None, None)


def softcap_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                              cap: Optional[float], chunk: Optional[int] = None,
                              compiled: bool = False) -> torch.Tensor:
    """Sum over labels != -100 of cross-entropy(cap * tanh(hidden @ weight.T / cap), labels), float32.

    hidden [..., H], weight [V, H] (the tied embedding), labels [...] (same leading shape).
    cap None: plain logits. chunk: tokens per slice (default: 256 MiB of float32 logits).
    compiled: each slice's elementwise work (cap, log-sum-exp, softmax gradient) as kernels
    torch.compile fuses (needs a working inductor backend; compiled once, at the first call, for
    every slice length) instead of eager in-place ops.

    With grad mode on, the gradients of the inputs that require them are computed here, in the
    forward, and kept until the backward: a float32 [V, H] dW (2.4 GB at Gemma2's vocabulary)
    lives as long as the returned loss. So evaluate under torch.no_grad(), log loss.item() rather
    than the loss, and call backward once per loss (a second backward, or create_graph=True,
    raises)."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} must share "
                         "their leading (token) dimensions")
    chunk = default_chunk(weight.shape[0]) if chunk is None else chunk
    if chunk < 1:
        raise ValueError(f"loss chunk must be >= 1 token, got {chunk}")
    dt = autocast_dtype(hidden)
    if dt is not None:
        # the slices' matmuls run in the autocast dtype inside the Function, which turns autocast
        # off; it casts the embedding itself, once, and returns its gradient in float32
        hidden = hidden.to(dt)
    grads = torch.is_grad_enabled()
    return _SoftcapCE.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1),
                            cap, chunk, grads and hidden.requires_grad, grads and weight.requires_grad,
                            compiled)


def autocast_dtype(t: torch.Tensor) -> Optional[torch.dtype]:
    """The autocast dtype on t's device; None where autocast is off."""
    dev = t.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
