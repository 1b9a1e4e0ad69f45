"""`torch`: the pure-PyTorch kernel.

Its output stays in the float32 (float64) accumulation dtype: callers cast once, the CP merge
gets unrounded partials, and the backward's D = rowsum(dO * O) uses the unrounded O (with a
16-bit O, near one-hot softcapped rows lose their gradient: measured dq error 0.14 vs 0.003).
 Runs everywhere (CPU included), any float dtype, with
softcap, windows, causal, GQA and empty rows, forward and backward (with dLSE).

Memory is bounded by blocking: queries in blocks of `block_q`, keys in blocks of `block_k`, with
an online softmax. Peak extra memory of one call is about
    5 * B * Hq * block_q * block_k * 4 bytes   (score-sized temporaries)
  + B * Hq * Sq * (Dv + 1) * 4 bytes          (float32 output and LSE accumulators)
  + in backward, float32 dQ/dK/dV of the inputs' size.
Blocks are shrunk automatically so one score block holds at most `max_block_elems` entries
(default 2**23, i.e. 32 MiB per temporary), so a 32K x 32K call never builds a 32K x 32K matrix.
Blocks that the window hides entirely are skipped. K/V are not expanded for GQA: query heads
are viewed as [Hkv, group] and broadcast against the shared K/V head.

Packed documents (segments=, see base.py): the same blocks, with a document mask built per block
from per-token segment ids and positions (O(Sq + Sk) integers per call, nothing quadratic);
blocks where no row sees a key of its own segment are skipped on the host. One segment is the
unsegmented code path.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import Optional, Tuple

import torch

from ..spec import Window
from .base import (Capabilities, Kernel, Segments, check_segments, grad_dtype, segment_ids,
                   visible_mask)

_NEG_INF = float("-inf")


# ------------------------------------------------------- block masks

def block_visible(sq: int, sk: int, window: Window, q0: int, q1: int, k0: int, k1: int) -> bool:
    """Whether any key in [k0, k1) is visible from any row in [q0, q1) (cheap block skip)."""
    left, right = window
    shift = sk - sq
    if right is not None and k0 > (q1 - 1) + shift + right:
        return False
    if left is not None and k1 - 1 < q0 + shift - left:
        return False
    return True


def segment_block_visible(segments: Segments, window: Window, q0: int, q1: int, k0: int, k1: int
                          ) -> bool:
    """Whether any row in [q0, q1) sees any key in [k0, k1) (exact, host integers only)."""
    cu_q, cu_k = segments
    # only segments whose rows meet [q0, q1) and whose keys meet [k0, k1)
    first = max(bisect_right(cu_q, q0), bisect_right(cu_k, k0)) - 1
    for s in range(first, min(bisect_left(cu_q, q1), bisect_left(cu_k, k1))):
        a, b = max(q0, cu_q[s]), min(q1, cu_q[s + 1])
        c, d = max(k0, cu_k[s]), min(k1, cu_k[s + 1])
        if a < b and c < d and block_visible(cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s], window,
                                             a - cu_q[s], b - cu_q[s], c - cu_k[s], d - cu_k[s]):
            return True
    return False


def _heads_view(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """[B, S, H, D] -> [B, Hkv, G, S, D] (a view)."""
    b, s, h, d = x.shape
    return x.reshape(b, s, hkv, h // hkv, d).permute(0, 2, 3, 1, 4)


def _heads_unview(x: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, G, S, D] -> [B, S, Hkv*G, D]."""
    b, hkv, g, s, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(b, s, hkv * g, d)


class _BlockMasks:
    """Which (row block, key block) pairs compute, and their visibility masks: the window alone,
    or the window per document segment."""

    def __init__(self, sq: int, sk: int, window: Window, segments, device):
        self.sq, self.sk, self.window, self.device = sq, sk, window, device
        segs = None if segments is None else check_segments(segments, sq, sk, "torch")
        self.segs = None if segs is None or segs.single() else segs
        if self.segs is not None:
            self.ids = segment_ids(self.segs, device)

    def block(self, q0: int, q1: int, k0: int, k1: int):
        """(skip, mask): skip when no row of the block sees a key of it; mask None = all visible."""
        if self.segs is None:
            if not block_visible(self.sq, self.sk, self.window, q0, q1, k0, k1):
                return True, None
            return False, visible_mask(self.sq, self.sk, self.window, self.device, q0, k0,
                                       q1 - q0, k1 - k0)
        if not segment_block_visible(self.segs, self.window, q0, q1, k0, k1):
            return True, None
        q_seg, q_pos, k_seg, k_pos = self.ids
        left, right = self.window
        mask = q_seg[q0:q1, None] == k_seg[None, k0:k1]
        if left is not None:
            mask &= k_pos[None, k0:k1] >= q_pos[q0:q1, None] - left
        if right is not None:
            mask &= k_pos[None, k0:k1] <= q_pos[q0:q1, None] + right
        return False, mask


class TorchKernel(Kernel):
    name = "torch"
    caps = Capabilities(
        softcap=True, window=True, gqa=True,
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
        devices=frozenset({"cpu", "cuda"}), backward_devices=frozenset({"cpu", "cuda"}),
        cp=True, dlse=True, deterministic_backward=True, segments=True,
        notes=("reference-grade; blocked online softmax, bounded memory",))

    def __init__(self, block_q: int = 1024, block_k: int = 1024, max_block_elems: int = 1 << 23):
        self.block_q, self.block_k, self.max_block_elems = block_q, block_k, max_block_elems

    def _blocks(self, b: int, hq: int, sq: int, sk: int) -> Tuple[int, int]:
        bq, bk = min(self.block_q, max(sq, 1)), min(self.block_k, max(sk, 1))
        while b * hq * bq * bk > self.max_block_elems and (bq > 16 or bk > 16):
            if bk >= bq:
                bk = max(16, bk // 2)
            else:
                bq = max(16, bq // 2)
        return bq, bk

    def _scores(self, qb, kb, scale, softcap, mask):
        """Return (z, t): capped + masked scores, and tanh values (None without softcap)."""
        s = torch.matmul(qb, kb.transpose(-1, -2)).mul_(scale)
        t = None
        if softcap is not None:
            t = torch.tanh(s.div_(softcap))
            z = t * softcap
        else:
            z = s
        if mask is not None:
            z = z.masked_fill(~mask, _NEG_INF)
        return z, t

    def forward(self, q, k, v, *, scale: float, softcap: Optional[float], window: Window,
                segments=None):
        b, sq, hq, _ = q.shape
        sk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
        masks = _BlockMasks(sq, sk, window, segments, q.device)
        acc = grad_dtype(q.dtype)
        qh, kh, vh = _heads_view(q, hkv), k.permute(0, 2, 1, 3).unsqueeze(2), v.permute(0, 2, 1, 3).unsqueeze(2)
        g = hq // hkv
        out = torch.zeros(b, hkv, g, sq, dv, dtype=acc, device=q.device)
        lse = torch.full((b, hkv, g, sq), _NEG_INF, dtype=acc, device=q.device)
        bq, bk = self._blocks(b, hq, sq, sk)
        for q0 in range(0, sq, bq):
            q1 = min(q0 + bq, sq)
            qb = qh[:, :, :, q0:q1].to(acc)
            m = torch.full((b, hkv, g, q1 - q0), _NEG_INF, dtype=acc, device=q.device)
            l = torch.zeros_like(m)
            o = torch.zeros(b, hkv, g, q1 - q0, dv, dtype=acc, device=q.device)
            for k0 in range(0, sk, bk):
                k1 = min(k0 + bk, sk)
                skip, mask = masks.block(q0, q1, k0, k1)
                if skip:
                    continue
                z, _ = self._scores(qb, kh[:, :, :, k0:k1].to(acc), scale, softcap, mask)
                m_new = torch.maximum(m, z.amax(-1))
                m_safe = torch.where(m_new == _NEG_INF, torch.zeros_like(m_new), m_new)
                alpha = torch.exp(m - m_safe)
                p = torch.exp(z - m_safe.unsqueeze(-1))
                l = l * alpha + p.sum(-1)
                o = o * alpha.unsqueeze(-1) + torch.matmul(p, vh[:, :, :, k0:k1].to(acc))
                m = m_new
            empty = l == 0
            lse[:, :, :, q0:q1] = torch.where(empty, torch.full_like(m, _NEG_INF), m + torch.log(l))
            out[:, :, :, q0:q1] = o / torch.where(empty, torch.ones_like(l), l).unsqueeze(-1)
        lse_out = lse.reshape(b, hq, sq)
        if acc == torch.float32:
            lse_out = lse_out.contiguous()
        return _heads_unview(out), lse_out

    def backward(self, dout, q, k, v, out, lse, *, scale: float, softcap: Optional[float],
                 window: Window, dlse: Optional[torch.Tensor] = None, segments=None):
        b, sq, hq, d = q.shape
        sk, hkv = k.shape[1], k.shape[2]
        masks = _BlockMasks(sq, sk, window, segments, q.device)
        g = hq // hkv
        acc = grad_dtype(q.dtype)
        qh = _heads_view(q, hkv)
        doh, oh = _heads_view(dout, hkv), _heads_view(out, hkv)
        kh, vh = k.permute(0, 2, 1, 3).unsqueeze(2), v.permute(0, 2, 1, 3).unsqueeze(2)
        lse_h = lse.reshape(b, hkv, g, sq).to(acc)
        lse_safe = torch.where(lse_h == _NEG_INF, torch.full_like(lse_h, float("inf")), lse_h)
        delta = (doh.to(acc) * oh.to(acc)).sum(-1)
        if dlse is not None:
            delta = delta - dlse.reshape(b, hkv, g, sq).to(acc)
        dq = torch.zeros(b, hkv, g, sq, d, dtype=acc, device=q.device)
        dk = torch.zeros(b, hkv, sk, d, dtype=acc, device=q.device)
        dv = torch.zeros(b, hkv, sk, v.shape[3], dtype=acc, device=q.device)
        bq, bk = self._blocks(b, hq, sq, sk)
        for q0 in range(0, sq, bq):
            q1 = min(q0 + bq, sq)
            qb, dob = qh[:, :, :, q0:q1].to(acc), doh[:, :, :, q0:q1].to(acc)
            lb, db = lse_safe[:, :, :, q0:q1].unsqueeze(-1), delta[:, :, :, q0:q1].unsqueeze(-1)
            for k0 in range(0, sk, bk):
                k1 = min(k0 + bk, sk)
                skip, mask = masks.block(q0, q1, k0, k1)
                if skip:
                    continue
                kb, vb = kh[:, :, :, k0:k1].to(acc), vh[:, :, :, k0:k1].to(acc)
                z, t = self._scores(qb, kb, scale, softcap, mask)
                p = torch.exp(z - lb)                       # rows with lse=-inf use +inf -> p = 0
                dv[:, :, k0:k1] += torch.matmul(p.transpose(-1, -2), dob).sum(2)
                ds = p * (torch.matmul(dob, vb.transpose(-1, -2)) - db)
                if t is not None:
                    ds = ds * (1 - t * t)
                dq[:, :, :, q0:q1] += torch.matmul(ds, kb.squeeze(2).unsqueeze(2)) * scale
                dk[:, :, k0:k1] += (torch.matmul(ds.transpose(-1, -2), qb) * scale).sum(2)
        return _heads_unview(dq), dk.permute(0, 2, 1, 3), dv.permute(0, 2, 1, 3)
