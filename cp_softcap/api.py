"""`attention`: the single-device, differentiable entry point. Same selector and kernel
contract as the CP paths."""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from .export import export_attention, is_exporting, refuse_cp
from .selector import select
from .spec import AttnSpec, check_qkv, make_spec


class _KernelAttention(torch.autograd.Function):
    """One kernel call; softcap, scale and window live in ctx for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, kernel, scale, softcap, window):
        out, lse = kernel.forward(q, k, v, scale=scale, softcap=softcap, window=window)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel, ctx.scale, ctx.softcap, ctx.window = kernel, scale, softcap, window
        # An unused output's gradient arrives as None (not zeros): an unused LSE costs nothing
        # and needs no host sync to detect.
        ctx.set_materialize_grads(False)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros(out.shape, dtype=q.dtype, device=q.device)
        # one call, nothing to accumulate: the kernel's own dtype, cast once (a no-op for the
        # flash-attn family, whose gradients already have the inputs' dtype)
        dq, dk, dv = ctx.kernel.backward(dout.contiguous(), q, k, v, out, lse, scale=ctx.scale,
                                         softcap=ctx.softcap, window=ctx.window, dlse=dlse)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def spec_for(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softcap, causal, window, scale,
             cp_size: int = 1, comm: str = "ring", return_lse: bool = False) -> AttnSpec:
    needs_backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    refuse_cp(cp_size)     # every CP entry point builds its spec here, before any collective
    if isinstance(cp_size, int) and not isinstance(cp_size, bool) and cp_size < 1:
        import torch.distributed as dist   # get_world_size(group) is -1 on a rank outside `group`
        me = dist.get_rank() if dist.is_available() and dist.is_initialized() else "?"
        raise ValueError(f"global rank {me} is not a member of the process group passed as the CP "
                         f"group (its size seen from here is {cp_size}); pass the CP group this rank "
                         "belongs to (e.g. mesh['cp'] of a DeviceMesh) or None for one device")
    return make_spec(head_dim=q.shape[-1], head_dim_v=v.shape[-1], num_heads=q.shape[2],
                     num_kv_heads=k.shape[2], dtype=q.dtype, device_type=q.device.type,
                     softcap=softcap, causal=causal, window=window, scale=scale,
                     needs_backward=needs_backward, cp_size=cp_size, comm=comm,
                     return_lse=return_lse)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softcap: Optional[float] = None,
              causal: bool = False, window=None, scale: Optional[float] = None,
              backend: str = "auto", return_lse: bool = False
              ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Softcapped attention on one device.

    q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] (Hq % Hkv == 0; GQA is not expanded).
    softcap: None/0.0 = off, else z = softcap * tanh(scale * q.k / softcap) before masking.
    window: (left, right) or None; query i sees key j iff i - left <= j <= i + right, with queries
    aligned to the END of the keys when Sq != Sk (flash-attn's bottom-right convention).
    causal=True forces right = 0. Returns out [B, Sq, Hq, Dv] in q's dtype, and with
    return_lse=True also lse [B, Hq, Sq] (float32; -inf for rows that see no key), differentiable.
    """
    check_qkv(q, k, v)
    spec = spec_for(q, k, v, softcap=softcap, causal=causal, window=window, scale=scale,
                    return_lse=return_lse)
    if is_exporting():     # torch.onnx.export / torch.export: the torch kernel's math, plain ops
        if backend not in ("auto", "torch"):
            raise ValueError(f"backend={backend!r} cannot be exported; export traces the 'torch' "
                             "kernel's math (cp_softcap.export): pass backend='auto' or 'torch'")
        out, lse = export_attention(q, k, v, scale=spec.scale, softcap=spec.softcap, window=spec.window)
        return (out, lse) if return_lse else out
    kernel = select(spec, backend).kernel
    out, lse = _KernelAttention.apply(q, k, v, kernel, spec.scale, spec.softcap, spec.window)
    return (out, lse) if return_lse else out
