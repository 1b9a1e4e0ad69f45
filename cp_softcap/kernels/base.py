"""The per-chunk kernel contract.

Every kernel (one file each in this package) subclasses `Kernel` and implements:

    forward(q, k, v, *, scale, softcap, window, segments=None) -> (out, lse)
        q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D]   (Hq % Hkv == 0, GQA not expanded)
        out [B, Sq, Hq, Dv] in the input dtype, or float32/float64 (the accumulation dtype) for
        kernels that have it unrounded (torch): callers cast once; lse [B, Hq, Sq] float32
        natural log, contiguous, -inf for a row that sees no key.
    backward(dout, q, k, v, out, lse, *, scale, softcap, window, dlse=None, segments=None)
        -> (dq, dk, dv)
        out/lse are the FINAL merged values of the whole row (exact for ring attention: see
        docs/kernels.md); out may be float32 (the CP merge's accumulator): adapters whose kernel
        needs the input dtype cast it, pure-PyTorch paths use it as is for a more exact
        D = rowsum(dO * O). Gradients come in the kernel's own dtype, `partial_dtype(q.dtype)`:
        the input dtype for kernels that compute them there (flash-attn), the accumulation dtype
        (`grad_dtype(q.dtype)`) otherwise. Callers that sum several partials widen while
        adding (merge.GradAccumulator); a single call casts once.
    partial_dtype(dtype) -> dtype of backward's gradients for inputs of `dtype`
        (from caps.grads_in_input_dtype). The CP algorithms size their gradient messages by it.
    prepare_backward(dout, out, dlse, dtype) -> (dout, out, dlse)      [optional]
        Called once per backward by callers that run many chunk-pair backwards on the same rows
        (ring, all_gather); row slices of the results stay valid for row slices of the inputs.
        fa4 uses it to cast the float32 O and correct D once instead of per chunk pair, which
        was measured to matter on the GPU (benchmarks/RESULTS.md). Default: unchanged.

`segments` (packed documents) is None, or `Segments(cu_q, cu_k)` (a plain pair of int tuples
works too): the call's rows and keys split into documents. Segment s is rows [cu_q[s], cu_q[s+1])
and keys [cu_k[s], cu_k[s+1]) of this call's q and k (relative to the call, as DocCall.cu_q /
DocCall.cu_k of cp_softcap.doc_geometry: `Segments(call.cu_q, call.cu_k)`). cu_q runs from 0 to Sq
and cu_k from 0 to Sk (every row and key belongs to a segment); a segment may be empty on either
side. A row sees only keys of its own segment, under `window` bottom-right aligned PER SEGMENT
(flash-attn varlen semantics with cu_seqlens_q = cu_q, cu_seqlens_k = cu_k). A row that sees no
key: out 0, LSE -inf, zero gradients, never NaN. The same segments apply to every batch row
(a varlen kernel joins the rows into one token stream, the segments repeated per row). One segment
(cu_q = (0, Sq), cu_k = (0, Sk)) is exactly the unsegmented call. Only kernels with
`caps.segments` receive segments (the selector fails closed on `spec.documents`); the others
raise ValueError for a segments value other than None. Kernel subclasses written without the
keyword keep working as long as callers pass `segments=` only when it is not None.

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
from typing import NamedTuple, Optional, Tuple

import torch

from ..spec import AttnSpec, Window

FULL: Window = (None, None)
CAUSAL: Window = (None, 0)


def grad_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype for inputs of `dtype`: float64 stays float64, everything else
    float32. Kernels accumulate in it and the CP algorithms sum partials in it (Plan.grad_dtype)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class Segments(NamedTuple):
    """Document segments of one kernel call (see the module docstring): `Segments(call.cu_q,
    call.cu_k)` from a DocCall. A NamedTuple, so a plain (cu_q, cu_k) pair means the same."""
    cu_q: Tuple[int, ...]
    cu_k: Tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.cu_q) - 1

    def single(self) -> bool:
        """One segment: the call is an ordinary chunk-pair call."""
        return len(self.cu_q) == 2


def check_segments(segments, sq: int, sk: int, kernel: str) -> Optional[Segments]:
    """None, or `segments` as Segments of int tuples after checking it covers Sq rows and Sk
    keys; ValueError naming what is wrong otherwise (a caller bug, never silently masked)."""
    if segments is None:
        return None
    try:
        cu_q, cu_k = (tuple(int(x) for x in side) for side in segments)
    except (TypeError, ValueError):
        raise ValueError(f"{kernel}: segments must be None or a (cu_q, cu_k) pair of int sequences, "
                         f"got {segments!r}") from None
    for name, cu, n in (("cu_q", cu_q, sq), ("cu_k", cu_k, sk)):
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != n or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"{kernel}: segments.{name}={cu} must rise from 0 to {n} (the call's "
                             f"{'rows' if name == 'cu_q' else 'keys'}), never decreasing")
    if len(cu_q) != len(cu_k):
        raise ValueError(f"{kernel}: segments have {len(cu_q) - 1} row ranges but {len(cu_k) - 1} "
                         f"key ranges (cu_q={cu_q}, cu_k={cu_k}); one of each per document")
    return Segments(cu_q, cu_k)


def refuse_segments(kernel: "Kernel", segments) -> None:
    """For kernels without caps.segments: packed calls must never reach them."""
    if segments is not None:
        raise ValueError(f"kernel {kernel.name!r} cannot separate packed documents (segments=); "
                         "the selector routes packed calls to a kernel with that capability")


def segment_ids(segments: Segments, device=None):
    """Per row and per key: (q_seg [Sq], q_pos [Sq], k_seg [Sk], k_pos [Sk]) int64. Row i sees
    key j iff q_seg[i] == k_seg[j] and q_pos[i] - left <= k_pos[j] <= q_pos[i] + right: positions
    are in the call's key coordinates, each segment's rows aligned to the END of its keys."""
    cu_q, cu_k = segments
    lens_q = torch.tensor([b - a for a, b in zip(cu_q, cu_q[1:])], dtype=torch.int64)
    lens_k = torch.tensor([b - a for a, b in zip(cu_k, cu_k[1:])], dtype=torch.int64)
    seg = torch.arange(len(cu_q) - 1, dtype=torch.int64)
    q_seg = torch.repeat_interleave(seg, lens_q)
    k_seg = torch.repeat_interleave(seg, lens_k)
    # row r of segment s sits at key position cu_k[s+1] - (len_q[s] - r)
    shift = torch.tensor(cu_k[1:], dtype=torch.int64) - lens_q - torch.tensor(cu_q[:-1], dtype=torch.int64)
    q_pos = torch.arange(cu_q[-1], dtype=torch.int64) + shift[q_seg]
    k_pos = torch.arange(cu_k[-1], dtype=torch.int64)
    return tuple(t.to(device) for t in (q_seg, q_pos, k_seg, k_pos))


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
    segments: bool = False                  # serves packed documents (forward/backward segments=)
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
                softcap: Optional[float], window: Window, segments: Optional["Segments"] = None
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, *, scale: float, softcap: Optional[float],
                 window: Window, dlse: Optional[torch.Tensor] = None,
                 segments: Optional["Segments"] = None
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
