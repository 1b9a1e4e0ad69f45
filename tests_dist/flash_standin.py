"""A CPU stand-in of a bf16 flash-attention kernel (FA4 / flex on the GPU), for CP tests.

It does the torch kernel's math but rounds where flash kernels round:
  forward   scores and softmax statistics in float32; P is rounded to bf16 before P @ V, and
            O is returned in bf16 (every flash kernel returns its forward O in the input dtype);
  backward  dO in bf16, D = rowsum(dO * O) in float32 from the O the caller passes (for a
            float32 merged O that is what fa4 gets by casting O to bf16 and restoring the
            difference through dLSE, kernels/fa4.py exact_d_dlse); P is rounded to bf16 for
            dV = P^T dO and dS to bf16 for dQ = dS K and dK = dS^T Q; gradients come back in bf16
            (caps.grads_in_input_dtype, as flash-attn).

Why: the GPU tests of packed CP (tests/test_gpu_packed_cp.py) failed in bf16 against the plain
float64 gradients because a row that one kernel call serves has the kernel's bf16 O as its merged
O, and D inherits that rounding (on a row with two visible keys under a saturating softcap this
alone moves dq/dk by ~0.03). This kernel reproduces that on CPU so the rounding-aware reference
of those tests can be checked in CI. Not a real kernel: one block per call, no memory bound.
"""
import dataclasses

import torch

from cp_softcap.kernels.torch_kernel import TorchKernel, _BlockMasks

NEG_INF = float("-inf")


def _r16(x: torch.Tensor) -> torch.Tensor:
    """Round a float32 tensor to bf16 and back (keeps float32 for the next matmul)."""
    return x.to(torch.bfloat16).float()


class FlashStandIn(TorchKernel):
    name = "flash_standin"
    caps = dataclasses.replace(TorchKernel.caps, dtypes=frozenset({torch.bfloat16}),
                               grads_in_input_dtype=True, notes=("CPU stand-in, tests only",))

    def _setup(self, q, k, window, segments):
        """float32 q [B,Hq,Sq,D], k expanded to Hq heads, and (skip, mask) of the whole call."""
        g = q.shape[2] // k.shape[2]
        skip, mask = _BlockMasks(q.shape[1], k.shape[1], window, segments, q.device).block(
            0, q.shape[1], 0, k.shape[1])
        skip = skip or q.shape[1] == 0 or k.shape[1] == 0
        qh = q.float().transpose(1, 2)
        kh = k.float().repeat_interleave(g, dim=2).transpose(1, 2)
        return g, skip, mask, qh, kh

    def forward(self, q, k, v, *, scale, softcap, window, segments=None):
        b, sq, hq, _ = q.shape
        g, skip, mask, qh, kh = self._setup(q, k, window, segments)
        if skip:
            return (torch.zeros(b, sq, hq, v.shape[3], dtype=q.dtype),
                    torch.full((b, hq, sq), NEG_INF, dtype=torch.float32))
        vh = v.float().repeat_interleave(g, dim=2).transpose(1, 2)
        z, _ = self._scores(qh, kh, scale, softcap, mask)
        m = z.amax(-1, keepdim=True)
        m = torch.where(m == NEG_INF, torch.zeros_like(m), m)     # rows that see no key
        p = torch.exp(z - m)
        l = p.sum(-1, keepdim=True)
        o = torch.matmul(_r16(p), vh) / torch.where(l == 0, torch.ones_like(l), l)
        lse = torch.where(l == 0, torch.full_like(l, NEG_INF), m + torch.log(l)).squeeze(-1)
        return o.transpose(1, 2).to(q.dtype), lse.contiguous()

    def backward(self, dout, q, k, v, out, lse, *, scale, softcap, window, dlse=None, segments=None):
        b, sq, hq, d = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        g, skip, mask, qh, kh = self._setup(q, k, window, segments)
        if skip:
            return tuple(torch.zeros(t.shape, dtype=q.dtype) for t in (q, k, v))
        vh = v.float().repeat_interleave(g, dim=2).transpose(1, 2)
        doh = dout.to(q.dtype).float().transpose(1, 2)
        delta = (doh * out.float().transpose(1, 2)).sum(-1)
        if dlse is not None:
            delta = delta - dlse.float()
        lse_safe = torch.where(lse == NEG_INF, torch.full_like(lse, float("inf")), lse.float())
        z, t = self._scores(qh, kh, scale, softcap, mask)
        p = torch.exp(z - lse_safe.unsqueeze(-1))                 # rows with lse -inf: p = 0
        ds = p * (torch.matmul(doh, vh.transpose(-1, -2)) - delta.unsqueeze(-1))
        if t is not None:
            ds = ds * (1 - t * t)
        ds = _r16(ds)
        dq = torch.matmul(ds, kh) * scale
        dk = torch.matmul(ds.transpose(-1, -2), qh) * scale
        dv = torch.matmul(_r16(p).transpose(-1, -2), doh)
        dk, dv = (x.reshape(b, hkv, g, sk, -1).sum(2) for x in (dk, dv))   # GQA: sum the group
        return tuple(x.transpose(1, 2).to(q.dtype).contiguous() for x in (dq, dk, dv))
