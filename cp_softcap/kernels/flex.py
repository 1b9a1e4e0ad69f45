"""`flex`: torch.nn.attention.flex_attention (compiled with torch.compile on CUDA).

softcap  -> score_mod `cap * tanh(score / cap)` (flex passes the already scaled score). The cap is
            a compile-time constant: one compile per distinct cap value (as with FA4).
window   -> a block mask built once per chunk-pair geometry (Sq, Sk, left, right, device) and
            cached. The mask_mod reads its offsets (shift = Sk - Sq, left, right) from 0-d int
            tensors, so a new geometry builds a new block mask but never recompiles the kernel.
segments -> (packed documents) a mask_mod over per-token segment ids and positions
            (base.segment_ids): same segment and the window per segment. One BlockMask per
            (segments, window, Sq, Sk, device), cached in a bounded FIFO.
GQA      -> enable_gqa=True (K/V not expanded).
Layout   -> flex wants [B, H, S, D]; we transpose views at the edge (no copies).

Backward: flex has no public "backward from a given (out, lse)". The ring needs gradients under
the FINAL merged (O, LSE) of each row. With this chunk's own (o_c, lse_c) and w = exp(lse_c - LSE):
    P_final = w * P_c,   so  dV = P_c^T (w dO),
    dS = P_c * w * (dO.v - D),  D = rowsum(dO * O) - dLSE
which is the chunk's own autograd backward with dout' = w * dO and
    dlse' = rowsum(dout' * o_c) - w * D.
So backward recomputes the chunk forward under autograd (cost: one extra forward) and calls
torch.autograd.grad with (dout', dlse'). Exact; rows with lse_c = -inf get w = 0.
CPU: eager forward works; backward on CPU raises in flex itself, so caps.backward_devices={'cuda'}.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from ..spec import Window
from ._common import empty_result, try_import, zero_grads
from .base import Capabilities, Kernel, check_segments, grad_dtype, segment_ids

_NEG_INF = float("-inf")


def _row_weight(lse_c: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """w = exp(lse_c - lse), 0 where the chunk row is empty (or the final row is empty)."""
    w = torch.exp(lse_c - lse)
    return torch.where((lse_c == _NEG_INF) | (lse == _NEG_INF), torch.zeros_like(w), w)


def reweighted_grads_inputs(dout, out_c, lse_c, out, lse, dlse):
    """(dout', dlse') that turn the chunk's own backward into the final-(O, LSE) backward.

    dout [B,Sq,H,D], out_c/out [B,Sq,H,D], lse_c/lse/dlse [B,H,Sq]. Returns dout' in dout's
    dtype ([B,Sq,H,D]) and dlse' float32 (float64 for float64) [B,H,Sq]. Pure tensor math (unit-tested on CPU)."""
    acc = grad_dtype(dout.dtype)
    w = _row_weight(lse_c.to(acc), lse.to(acc))                     # [B, H, Sq]
    w_bs = w.transpose(1, 2).unsqueeze(-1)                           # [B, Sq, H, 1]
    dout_p = (dout.to(acc) * w_bs).to(dout.dtype)
    d_final = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)   # [B, H, Sq]
    if dlse is not None:
        d_final = d_final - dlse.to(acc)
    d_own = (dout_p.to(acc) * out_c.to(acc)).sum(-1).transpose(1, 2)
    return dout_p, (d_own - w * d_final).contiguous()


def _raise_recompile_limit(n: int) -> None:
    """Each chunk-pair shape and softcap value is one compile of flex_attention; dynamo's default
    limit (8 per code object) would silently fall back to eager (materialising the score matrix)."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < n:
            setattr(cfg, name, n)


def geometry_mask_mod(sq: int, sk: int, window: Window, device):
    """mask_mod for one chunk-pair geometry: a closure over 0-d int tensors (shift = Sk - Sq,
    left, right), so dynamo guards on tensor metadata, not values: no recompile per geometry."""
    left, right = window
    big = sq + sk + 1                           # an unbounded side never binds
    shift = torch.tensor(sk - sq, device=device)
    lo = torch.tensor(big if left is None else left, device=device)
    hi = torch.tensor(big if right is None else right, device=device)

    def window_mask(b, h, q_idx, kv_idx):
        i = q_idx + shift
        return (kv_idx >= i - lo) & (kv_idx <= i + hi)
    return window_mask


MAIN_KERNEL = {"FORCE_USE_FLEX_ATTENTION": True}


def segment_mask_mod(segments, window: Window, device):
    """mask_mod for a call split into document segments (kernel contract, base.py): row q sees
    key k iff same segment and the window holds between k and q's position in key coordinates."""
    q_seg, q_pos, k_seg, _ = segment_ids(segments, device)
    left, right = window
    big = segments.cu_q[-1] + segments.cu_k[-1] + 1         # an unbounded side never binds
    lo = torch.tensor(big if left is None else left, device=device)
    hi = torch.tensor(big if right is None else right, device=device)

    def document_mask(b, h, q_idx, kv_idx):
        p = q_pos[q_idx]
        return (q_seg[q_idx] == k_seg[kv_idx]) & (kv_idx >= p - lo) & (kv_idx <= p + hi)
    return document_mask


class FlexKernel(Kernel):
    name = "flex"
    caps = Capabilities(
        softcap=True, window=True, gqa=True,
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        devices=frozenset({"cpu", "cuda"}), backward_devices=frozenset({"cuda"}),
        max_head_dim=256, cp=True, dlse=True, deterministic_backward=False, segments=True,
        notes=("torch.compile on CUDA: one compile per distinct softcap value and shape",
               "backward recomputes the chunk forward (exact final-LSE reweighting)"))

    def __init__(self, compile_on_cuda: bool = True, kernel_options: Optional[dict] = None):
        """kernel_options: passed to flex_attention as is, for every call (then calls with fewer
        than 128 rows are the caller's to configure); None: MAIN_KERNEL for those calls, flex's
        defaults otherwise (see _options)."""
        self.compile_on_cuda = compile_on_cuda
        self.kernel_options = kernel_options
        self._flex = None
        self._compiled = None
        self._reason: Optional[str] = None
        self._masks: Dict[tuple, object] = {}          # geometry -> BlockMask (bounded, FIFO)
        self._lse_kw: dict = {}
        self._score_mods: Dict[Optional[float], object] = {}

    def _load(self):
        if self._flex is None and self._reason is None:
            mod, reason = try_import("torch.nn.attention.flex_attention")
            if mod is None:
                self._reason = f"torch.nn.attention.flex_attention not importable ({reason}); needs torch >= 2.5"
            else:
                self._flex, self._create_block_mask = mod.flex_attention, mod.create_block_mask
                import inspect                              # return_lse (measured path) while
                params = inspect.signature(mod.flex_attention).parameters   # it exists, else
                aux = getattr(mod, "AuxRequest", None)                       # return_aux
                self._lse_kw = ({"return_lse": True} if "return_lse" in params or aux is None
                                else {"return_aux": aux(lse=True)})
        return self._flex

    def probe(self, spec) -> Optional[str]:
        if self._load() is None:
            return self._reason
        if spec.device_type == "cuda" and not torch.cuda.is_available():
            return "flex on cuda needs CUDA, and torch.cuda.is_available() is False here"
        if spec.device_type == "cuda":
            try:
                import triton  # noqa: F401  (the compiled CUDA path is Triton)
            except Exception as e:
                return f"flex on cuda needs triton for torch.compile ({type(e).__name__}: {e})"
        return None

    def _fn(self, device: torch.device):
        if device.type == "cuda" and self.compile_on_cuda:
            if self._compiled is None:
                _raise_recompile_limit(64)
                self._compiled = torch.compile(self._load(), dynamic=False)
            return self._compiled
        return self._load()

    def _score_mod(self, softcap: Optional[float]):
        if softcap is None:
            return None
        if softcap not in self._score_mods:
            cap = float(softcap)

            def softcap_mod(score, b, h, q_idx, kv_idx):
                return cap * torch.tanh(score / cap)
            self._score_mods[softcap] = softcap_mod
        return self._score_mods[softcap]

    def block_mask(self, sq: int, sk: int, window: Window, device, segments=None):
        """Cached BlockMask for an Sq x Sk pair under the bottom-right `window`, per document
        segment when `segments` has more than one (None = everything visible)."""
        segs = check_segments(segments, sq, sk, "flex")
        if segs is not None and segs.single():
            segs = None
        if window == (None, None) and segs is None:
            return None
        key = (sq, sk, window, str(device), segs)
        if key not in self._masks:
            if len(self._masks) >= 256:
                self._masks.pop(next(iter(self._masks)))
            self._load()
            mod = (geometry_mask_mod(sq, sk, window, device) if segs is None
                   else segment_mask_mod(segs, window, device))
            self._masks[key] = self._create_block_mask(mod, None, None, sq, sk, device=device,
                                                       _compile=device.type == "cuda")
        return self._masks[key]

    def _options(self, sq: int) -> Optional[dict]:
        """Inductor picks its decoding kernel for fewer than 128 query rows; with grouped query
        heads it packs the group's rows into one tile, and when they exceed it no configuration
        compiles (NoValidChoicesError, seen on an H200: 60 and 33 rows, 4 query heads on one KV
        head). Training calls that short are document pieces and block edges: the main kernel
        serves them, so it is forced there."""
        if self.kernel_options is not None:
            return self.kernel_options
        return MAIN_KERNEL if sq < 128 else None

    def _call(self, q, k, v, scale, softcap, window, segments=None):
        """[B,S,H,D] in -> (out [B,Sq,Hq,Dv], lse [B,Hq,Sq] fp32), differentiable on CUDA."""
        sq, sk = q.shape[1], k.shape[1]
        fn = self._fn(q.device)
        out, lse = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                      score_mod=self._score_mod(softcap),
                      block_mask=self.block_mask(sq, sk, window, q.device, segments), scale=scale,
                      enable_gqa=q.shape[2] != k.shape[2], kernel_options=self._options(sq),
                      **self._lse_kw)
        if not isinstance(lse, torch.Tensor):
            lse = lse.lse                                   # AuxOutput
        return out.transpose(1, 2), lse

    def forward(self, q, k, v, *, scale: float, softcap: Optional[float], window: Window,
                segments=None) -> Tuple[torch.Tensor, torch.Tensor]:
        if q.shape[1] == 0 or k.shape[1] == 0:
            return empty_result(q, v)
        with torch.no_grad():
            out, lse = self._call(q, k, v, scale, softcap, window, segments)
        return out, lse.float().contiguous()

    def backward(self, dout, q, k, v, out, lse, *, scale: float, softcap: Optional[float],
                 window: Window, dlse: Optional[torch.Tensor] = None, segments=None):
        """float32 (dq, dk, dv) under the final merged (out, lse); recomputes the chunk forward."""
        if q.shape[1] == 0 or k.shape[1] == 0:
            return zero_grads(q, k, v)
        if q.device.type != "cuda" and self._fn(q.device) is self._load():
            raise NotImplementedError("flex has no CPU backward; the selector uses the torch "
                                      "kernel there (caps.backward_devices={'cuda'})")
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        with torch.enable_grad():
            out_c, lse_c = self._call(qg, kg, vg, scale, softcap, window, segments)
            dout_p, dlse_p = reweighted_grads_inputs(dout, out_c.detach(), lse_c.detach(), out,
                                                     lse, dlse)
            dq, dk, dv = torch.autograd.grad((out_c, lse_c), (qg, kg, vg),
                                             (dout_p.to(out_c.dtype), dlse_p))
        return dq.float(), dk.float(), dv.float()
