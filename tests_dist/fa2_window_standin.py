"""A flash-attn 2 stand-in (split family, plain and varlen) for CPU CP runs that reproduces what
flash-attn does to the window before its kernels run (csrc flash_api.cpp: mha_fwd / mha_bwd /
their varlen forms, set_params_fprop / set_params_dgrad):

    if left >= seqlen_k: left = -1;   if right >= seqlen_k: right = -1
    if left < 0 and right >= 0: left = seqlen_k
    if left >= 0 and right < 0: right = seqlen_k        <- an unbounded right side is NOT kept

seqlen_k is the call's key length (max_seqlen_k for varlen). With the left side bounded, "right
unbounded" becomes right = seqlen_k, which under bottom-right alignment hides keys from the
first rows when a (segment's) rows outnumber keys + 1. Math: the torch kernel; gradients are
written into the caller's buffers in the input dtype, out returned in the input dtype, as
flash-attn does."""
import dataclasses

import torch

from cp_softcap.kernels.base import Segments
from cp_softcap.kernels.fa2 import FA2Kernel
from cp_softcap.kernels.torch_kernel import TorchKernel

INF = float("inf")
_TK = TorchKernel()


def fa_effective_window(left: int, right: int, seqlen_k: int):
    """flash-attn 2's window substitution -> contract window (None = unbounded)."""
    if left >= seqlen_k:
        left = -1
    if right >= seqlen_k:
        right = -1
    if left < 0 and right >= 0:
        left = seqlen_k
    if left >= 0 and right < 0:
        right = seqlen_k
    return (None if left < 0 else left, None if right < 0 else right)


def _fwd(q, k, v, scale, window, cap, segments=None):
    out, lse = _TK.forward(q, k, v, scale=scale, softcap=cap or None, window=window, segments=segments)
    return out.to(q.dtype), torch.where(lse == -INF, torch.full_like(lse, INF), lse)


def _bwd(dout, q, k, v, out, lse, dq, dk, dv, scale, window, cap, segments=None):
    lse = torch.where(lse == INF, torch.full_like(lse, -INF), lse)
    g = _TK.backward(dout, q, k, v, out, lse, scale=scale, softcap=cap or None, window=window,
                     segments=segments)
    for dst, src in zip((dq, dk, dv), g):
        dst.copy_(src)


def _segs(cu_q, cu_k):
    return Segments(tuple(cu_q.tolist()), tuple(cu_k.tolist()))


class _Module:
    @staticmethod
    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                            window_size_right, softcap, alibi_slopes, return_softmax):
        w = fa_effective_window(window_size_left, window_size_right, k.shape[1])
        out, lse = _fwd(q, k, v, softmax_scale, w, softcap)
        return out, lse, None, None

    @staticmethod
    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                             causal, window_size_left, window_size_right, softcap, alibi_slopes,
                             deterministic, rng_state=None):
        w = fa_effective_window(window_size_left, window_size_right, k.shape[1])
        _bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, w, softcap)

    @staticmethod
    def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                   dropout_p, softmax_scale, causal, window_size_left=-1,
                                   window_size_right=-1, softcap=0.0, alibi_slopes=None,
                                   return_softmax=False, block_table=None, leftpad_k=None,
                                   seqused_k=None, zero_tensors=False):
        w = fa_effective_window(window_size_left, window_size_right, max_seqlen_k)
        out, lse = _fwd(q[None], k[None], v[None], softmax_scale, w, softcap,
                        _segs(cu_seqlens_q, cu_seqlens_k))
        return out[0], lse[0], None, None

    @staticmethod
    def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                                    cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                    softmax_scale, causal, window_size_left, window_size_right,
                                    softcap, alibi_slopes, deterministic, rng_state=None,
                                    zero_tensors=False):
        w = fa_effective_window(window_size_left, window_size_right, max_seqlen_k)
        g = [torch.empty_like(t)[None] for t in (dq, dk, dv)]
        _bwd(dout[None], q[None], k[None], v[None], out[None], softmax_lse[None], *g,
             softmax_scale, w, softcap, _segs(cu_seqlens_q, cu_seqlens_k))
        for dst, src in zip((dq, dk, dv), g):
            dst.copy_(src[0])


class CPUFA2(FA2Kernel):
    """The fa2 adapter over the stand-in, allowed on CPU (the probe needs CUDA)."""
    caps = dataclasses.replace(FA2Kernel.caps, devices=frozenset({"cpu", "cuda"}),
                               backward_devices=frozenset({"cpu", "cuda"}))

    def probe(self, spec):
        return None


def fa2_standin_kernel() -> CPUFA2:
    return CPUFA2(module=_Module())
