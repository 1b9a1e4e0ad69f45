"""AttnSpec: the validated description of one attention call.

Everything user-supplied is checked here, once, at the public boundary. The rest of the
library trusts an AttnSpec. No `assert` is used for user input (python -O strips asserts).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

Window = Tuple[Optional[int], Optional[int]]
COMM_TYPES = ("ring", "all_gather", "a2a", "a2a+p2p", "auto")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def normalize_softcap(softcap) -> Optional[float]:
    """None or 0.0 -> None (off); positive finite float -> float; anything else raises."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be None or a positive float, got {softcap!r} "
                        f"of type {type(softcap).__name__}")
    softcap = float(softcap)
    if softcap == 0.0:
        return None
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be None, 0.0 (off) or a positive finite float, got {softcap!r}; "
                         "Gemma2 uses 50.0 inside attention")
    return softcap


def check_comm(comm) -> None:
    """The one check of a comm= value."""
    if comm not in COMM_TYPES:
        raise ValueError(f"comm must be one of {COMM_TYPES}, got {comm!r}")


def check_gqa(num_heads: int, num_kv_heads: int, at: str = "") -> None:
    """Grouped-query attention needs Hq % Hkv == 0 (and at least one KV head)."""
    if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}{at}; "
                         "GQA needs Hq % Hkv == 0")


def fits_zigzag(seq_len: int, cp: int) -> bool:
    """Whether the zigzag layout can split a global sequence of seq_len tokens over cp ranks:
    2*cp equal, non-empty chunks (the one place this rule lives; callers word their own fix)."""
    return seq_len > 0 and seq_len % (2 * cp) == 0


def check_zigzag_length(seq_len: int, cp: int, *, what: str = "sequence length", where: str = "") -> None:
    """The zigzag layout splits a global sequence into 2*cp equal, non-empty chunks."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp must be a positive int, got {cp!r}")
    if not fits_zigzag(seq_len, cp):
        at = f" on {where}" if where else ""
        raise ValueError(f"{what} {seq_len}{at} is not a positive multiple of 2*cp={2 * cp}; "
                         f"pad with cp_softcap.sharding.pad_to_multiple(x, {2 * cp}) "
                         "(and mask the padded labels), or use comm='a2a' with heads divisible by cp")


def check_local_shards(q: torch.Tensor, k: torch.Tensor, cp: int, where: str) -> None:
    """q, k, v are one rank's zigzag shards: the same length, two equal non-empty chunks."""
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"local q has {q.shape[1]} tokens but k/v have {k.shape[1]} on {where}; "
                         "context-parallel attention needs q, k, v sharded the same way "
                         "(cp_softcap.sharding.shard on each)")
    if q.shape[1] == 0 or q.shape[1] % 2 != 0:
        raise ValueError(f"local sequence length {q.shape[1]} on {where} is not a positive even "
                         f"number: the global length must be a multiple of 2*cp={2 * cp}; pad with "
                         f"cp_softcap.sharding.pad_to_multiple(x, {2 * cp}) before sharding")


def normalize_scale(scale, head_dim: int) -> float:
    if scale is None:
        return head_dim ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be None or a positive float, got {scale!r}")
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite float, got {scale!r}; "
                         f"leave it None for head_dim**-0.5 = {head_dim ** -0.5:.6g}")
    return scale


def normalize_window(window, causal: bool) -> Window:
    """Return (left, right) with None for an unbounded side; causal forces right = 0.

    Key j is visible from query i iff i - left <= j <= i + right (global positions).
    Accepts None, a (left, right) pair, or flash-attn's (-1, -1) convention for unbounded.
    """
    if window is None:
        left, right = None, None
    else:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise ValueError(f"window must be None or a (left, right) pair of non-negative ints "
                             f"(None = unbounded side), got {window!r}; Gemma2 local layers use (4095, 0)")
        sides = []
        for name, side in zip(("left", "right"), window):
            if side is None or (isinstance(side, int) and not isinstance(side, bool) and side == -1):
                sides.append(None)
            elif isinstance(side, int) and not isinstance(side, bool) and side >= 0:
                sides.append(int(side))
            else:
                raise ValueError(f"window {name} side must be a non-negative int or None (unbounded), "
                                 f"got {side!r} in window={window!r}")
        left, right = sides
    if causal:
        if right not in (None, 0):
            raise ValueError(f"causal=True with window right side {right}: causal attention sees no "
                             "future keys; pass window=(left, 0) or causal=False")
        right = 0
    return (left, right)


CAUSAL_ALIGNS = ("bottom_right",)


def check_causal_align(causal_align) -> None:
    """The one check of a causal_align= value: None (lengths must then be equal wherever a mask
    relates query and key positions) or 'bottom_right', the only alignment the kernels have."""
    if causal_align is None or (isinstance(causal_align, str) and causal_align in CAUSAL_ALIGNS):
        return
    if causal_align == "top_left":
        raise ValueError(
            "causal_align='top_left' (SDPA's is_causal convention) is not implemented: every kernel "
            "aligns the last query with the last key. For Sk > Sq, top-left causal attention "
            "equals the square call on the first Sq keys: attention(q, k[:, :Sq], v[:, :Sq]); "
            "else pass causal_align='bottom_right' if that is the alignment you mean")
    raise ValueError(f"causal_align must be None or one of {CAUSAL_ALIGNS}, got {causal_align!r}")


def unaligned(q, k, causal, window, causal_align) -> bool:
    """True when a call must say how its queries align with its keys and did not: q and k/v
    differ in length along dim 1 and a causal mask or a window relates their positions.
    Inputs that are not 4-D tensors, or options that are invalid, answer False: the plan
    refuses those with their own message."""
    if causal_align is not None:
        return False
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == 4
            and k.dim() == 4) or q.shape[1] == k.shape[1] or 0 in (q.shape[1], k.shape[1]):
        return False            # no query, or no key: every row is empty under any alignment
    if causal is True:
        return True
    if causal is not False:
        return False
    try:
        return normalize_window(window, False) != (None, None)
    except ValueError:
        return False


def mask_is_empty(mask) -> bool:
    """The one rule for HF attention masks: None, or a 2-D all-ones mask (a tokenizer's), masks
    nothing and is accepted; any other mask (padding zeros, a dense 4-D mask) changes attention
    in a way cp_softcap does not implement and is refused by the callers."""
    return mask is None or (isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool(mask.bool().all()))


def padding_mask_error(shape) -> ValueError:
    """The refusal of a 2-D attention mask with zeros (HF's padding mask)."""
    return ValueError(
        f"attn_implementation='cp_softcap' got a 2-D attention_mask {tuple(shape)} with padding "
        "(zeros); it cannot apply padding masks. Drop attention_mask: with causal attention, right "
        "padding needs no mask as long as the padded labels are -100; or pack sequences without pads.")


def different_boundaries_error() -> ValueError:
    """The refusal of HF's cu_seq_lens_k when it differs from cu_seq_lens_q."""
    return ValueError("attn_implementation='cp_softcap' got cu_seq_lens_q != cu_seq_lens_k: packed "
                      "documents need queries and keys over the same stream")


def alignment_error(q, k, causal: bool, window) -> ValueError:
    """The refusal of an unaligned call (see unaligned), with the reason and the fix."""
    sq, sk = q.shape[1], k.shape[1]
    mask = "causal=True" if causal is True else f"window={window!r}"
    return ValueError(
        f"q has {sq} tokens and k/v have {sk} (dim 1; inputs are [batch, seq, heads, head_dim]) "
        f"with {mask}: which keys a query sees depends on how the two sequences are aligned, and "
        "conventions differ (flash-attn aligns the last query with the last key, SDPA's is_causal "
        "the first with the first). Say it: causal_align='bottom_right' (query i sits at key "
        f"position i {'-' if sq > sk else '+'} {abs(sk - sq)}, as in a decode step over a KV "
        "cache; the one alignment implemented). If q/k/v are [batch, heads, seq, head_dim] (SDPA's layout), pass "
        "q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2) instead.")


def _below(value, low: int) -> bool:
    """True unless `value` is an integer (int, numpy or torch integer, SymInt) >= low."""
    if isinstance(value, (bool, float)):
        return True
    try:
        return int(value) < low
    except (TypeError, ValueError):
        return True


@dataclass(frozen=True)
class AttnSpec:
    """One attention call, validated. Hashable: the selector caches on it."""
    head_dim: int
    head_dim_v: int
    num_heads: int
    num_kv_heads: int
    dtype: torch.dtype
    device_type: str
    scale: float
    softcap: Optional[float] = None
    causal: bool = False
    window: Window = (None, None)
    dropout: float = 0.0
    needs_backward: bool = True
    cp_size: int = 1
    comm: str = "ring"
    return_lse: bool = False
    deterministic: bool = False
    documents: bool = False         # packed documents: kernels get segments= (caps.segments)
    sinks: bool = False             # learned attention sinks (sinks.py): their presence, not values

    @property
    def gqa(self) -> bool:
        return self.num_heads != self.num_kv_heads

    @property
    def has_window(self) -> bool:
        """A bounded side other than plain causal's right = 0."""
        left, right = self.window
        return left is not None or (right is not None and not (self.causal and right == 0))

    def describe(self) -> str:
        return (f"softcap={self.softcap} causal={self.causal} window={self.window} "
                f"heads={self.num_heads}/{self.num_kv_heads} head_dim={self.head_dim} "
                f"dtype={str(self.dtype).replace('torch.', '')} device={self.device_type} "
                f"cp={self.cp_size} comm={self.comm}" + (" packed-documents" if self.documents else "")
                + (" sinks" if self.sinks else ""))


def make_spec(*, head_dim: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype,
              device_type: str, softcap=None, causal: bool = False, window=None, scale=None,
              dropout: float = 0.0, needs_backward: bool = True, cp_size: int = 1,
              comm: str = "ring", head_dim_v: Optional[int] = None,
              return_lse: bool = False, documents: bool = False, sinks: bool = False) -> AttnSpec:
    """Validate user-facing options and build an AttnSpec. Raises ValueError/TypeError."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    head_dim_v = head_dim if head_dim_v is None else head_dim_v   # not `or`: 0 must not become D
    for name, value in (("head_dim", head_dim), ("head_dim_v", head_dim_v)):
        if _below(value, 1):
            raise ValueError(f"{name}={value!r}: the head dim must be a positive int (the last dim of "
                             "q/k for head_dim, of v for head_dim_v)")
    if _below(num_heads, 0):
        raise ValueError(f"num_heads={num_heads!r} must be a non-negative int")
    if dtype not in _DTYPES:
        raise TypeError(f"dtype {dtype} is not supported; use float16, bfloat16, float32 or float64")
    check_gqa(num_heads, num_kv_heads)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not (0.0 <= dropout < 1.0):
        raise ValueError(f"dropout must be a float in [0, 1), got {dropout!r}")
    softcap = normalize_softcap(softcap)
    if softcap is not None and dropout > 0:
        raise ValueError(f"softcap={softcap} with dropout={dropout} is not supported (flash-attn refuses "
                         "it and the softcap gradient would be wrong); set dropout=0.0")
    if dropout > 0:
        raise ValueError(f"attention dropout={dropout} is not supported by cp_softcap (its kernels are "
                         "exact and deterministic); set dropout=0.0 and regularise elsewhere")
    check_comm(comm)
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    return AttnSpec(head_dim=int(head_dim), head_dim_v=int(head_dim_v),
                    num_heads=int(num_heads), num_kv_heads=int(num_kv_heads), dtype=dtype,
                    device_type=device_type, scale=normalize_scale(scale, head_dim), softcap=softcap,
                    causal=causal, window=normalize_window(window, causal), dropout=float(dropout),
                    needs_backward=bool(needs_backward), cp_size=cp_size, comm=comm,
                    return_lse=bool(return_lse), documents=bool(documents), sinks=bool(sinks),
                    deterministic=torch.are_deterministic_algorithms_enabled())


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, where: str = "") -> None:
    """Shape/dtype/device checks for [B, S, H, D] inputs. `where` names the rank in messages."""
    at = f" on {where}" if where else ""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}{at}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, seq, heads, head_dim], got shape "
                             f"{tuple(t.shape)}{at}; for [batch, heads, seq, head_dim] use .transpose(1, 2)")
        if not (t.is_floating_point()):
            raise TypeError(f"{name} must be a floating tensor, got {t.dtype}{at}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}{at}; cast them")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}{at}")
    if q.shape[0] != k.shape[0] or k.shape[0] != v.shape[0]:
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}{at}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v sequence lengths differ: {k.shape[1]} vs {v.shape[1]}{at}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v head counts differ: {k.shape[2]} vs {v.shape[2]}{at}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k head dims differ: {q.shape[3]} vs {k.shape[3]}{at}")
    check_gqa(q.shape[2], k.shape[2], at)


def check_sinks(sinks, q: torch.Tensor, *, where: str = "") -> None:
    """Attention sinks (one learned logit per query head, e.g. gpt-oss's `s_aux`): a floating
    tensor [Hq] on q's device with finite values. Reading the values is a host sync on CUDA."""
    at = f" on {where}" if where else ""
    fix = (f"pass one logit per query head, a floating tensor of shape [{q.shape[2]}] on "
           f"{q.device} (e.g. the attention module's `sinks` parameter), or sinks=None")
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor or None, got {type(sinks).__name__}{at}; {fix}")
    if not sinks.is_floating_point():
        raise ValueError(f"sinks must be a floating tensor, got dtype {sinks.dtype}{at}; {fix}")
    if tuple(sinks.shape) != (q.shape[2],):
        raise ValueError(f"sinks has shape {tuple(sinks.shape)} but q has {q.shape[2]} query heads"
                         f"{at}; {fix}")
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}{at}; {fix}")
    if not bool(torch.isfinite(sinks.detach()).all()):
        raise ValueError(f"sinks has non-finite values {sinks.detach().cpu().tolist()}{at}; a sink "
                         "is a finite logit (+inf would zero every output, NaN poison it); "
                         "pass sinks=None for no sink")
