"""comm="auto": pick the communication scheme with the fewest bytes sent per rank (forward +
backward, the busiest rank), from the call's shapes. Ties go to ring (its transfers overlap
compute step by step), then all_gather, then a2a. Every choice can be overridden with comm=.

comm="auto" gets ONE process group, so it chooses only among the single-group schemes ring,
all_gather and a2a. a2a+p2p needs a group pair (make_hybrid_groups); bytes_per_rank and
describe_comm_choice model it when given a2a_size=, but auto never picks it.

Model: the bytes each rank SENDS, per op name exactly as transport.counting() records them (point-to-
point messages as sent, collectives at their algorithmic volume, (ranks - 1) pieces per rank).
n = S/cp local tokens (two zigzag chunks of c = n/2), B batch, e = input element bytes,
g = gradient bytes (float32; float64 for float64 inputs), kv = B * Hkv * (D + Dv) per token,
p = the kernel's dK/dV partial bytes (partial_bytes=: kernel.partial_dtype(dtype).itemsize, e for
the flash-attn family (caps.grads_in_input_dtype), g for the torch kernel; default g).
  ring (cp/ring.py; send_keys(r) = sum over receivers q != r of |key_range(cp, q, r, c, window)|;
        blocks = layout.ring_blocks(cp, n, block_keys), block_keys= defaulting to
        settings.ring_block_keys() (CP_SOFTCAP_RING_BLOCK_KEYS)):
      ring.fwd.kv   send_keys(r) * kv * e      K/V of the keys each receiver's queries see
      ring.bwd.kv   send_keys(r) * kv * e      backward re-sends the same K/V (nothing S-sized kept)
      ring.bwd.dkv  sum over blocks of keys(r, block) * kv * (p if layout.block_exclusive(cp, r,
                    c, window, block) else g): dK/dV of the keys it received (the slots of
                    layout.block_plan), back to their owners; an exclusive block's keys are each
                    one kernel partial, sent in the kernel's dtype and widened by the owner.
      Causal: an earlier rank's second chunk is never visible, so sends to later ranks are c keys,
      not 2c; every rank's total is the same when 2e == g (bf16 inputs, float32 dK/dV; with bf16
      partials later ranks send more). Window (L, 0): about L keys per visible source.
      Causal zigzag blocks are always exclusive; with a window two calls (the rank's two query
      chunks) can read the same keys, and then that rank's whole block returns float32.
  all_gather (cp/all_gather.py): fwd (cp-1) * n * kv * e (two half-shard gathers); bwd the same
      re-gather + (cp-1) * n * kv * g (float32 reduce-scatter of dK/dV). Window-independent.
  a2a (cp/a2a.py; needs Hq % cp == 0; h = Hq/cp, hk = KV heads per rank with
      replicas, kv_head_index): (cp-1) * B * c2 with c2 = n tokens per destination:
      fwd q (h*D*e), k (hk*D*e), v (hk*Dv*e), out (h*Dv*e); bwd dout (h*Dv*e), dq (h*D*p),
      dk (hk*D*p), dv (hk*Dv*p) with p = the kernel's partial bytes (one kernel call per head:
      its gradient travels in the kernel's dtype).
      Inside a2a+p2p the gradients are the outer ring's float32 sums: p = g there.
  a2a+p2p with a2a_size a (cp/a2a_p2p.py; CP rank = ring_rank * a + a2a_rank):
      the a2a terms above on the inner group (cp -> a, same n), plus the ring terms of the outer
      ring: cp/a ranks, chunk a*c (blocks of ring_blocks(cp/a, a*n, block_keys)), Hq/a query and
      hk KV heads per rank; busiest rank total.
Packed documents (documents= a PackedLayout, calls.py): the ring terms use the document
geometry (doc_geometry.send_ranges per receiver; block_plan slots and block_exclusive per block;
for a2a+p2p the ring's members are the a2a groups); all_gather and a2a move every token (n is
the layout's local_len), so their terms are unchanged.
bytes_per_rank is the busiest rank's TOTAL (max over ranks of fwd + bwd), not per-op maxima.
sent_per_rank gives every rank's per-op bytes; benchmarks/comm_bytes.py checks both against
transport.counting() at Gemma2-9B shapes.
"""
from __future__ import annotations

from typing import Dict, List, Optional

from . import calls as geo
from .heads import heads_divide, kv_head_index
from .layout import ring_blocks
from .settings import ring_block_keys
from .spec import AttnSpec, Window, check_zigzag_length

SINGLE_GROUP = ("ring", "all_gather", "a2a")      # what comm="auto" chooses among, tie order


def _sizes(spec: AttnSpec):
    e = {2: 2, 4: 4, 8: 8}.get(spec.dtype.itemsize, 2)
    return e, (8 if e == 8 else 4)


def _local_len(spec: AttnSpec, seq_len: int) -> int:
    check_zigzag_length(seq_len, spec.cp_size)
    return seq_len // spec.cp_size


def _keys(ranges) -> int:
    return sum(b - a for a, b in ranges)


def _partial_bytes(partial_bytes: Optional[int], g: int) -> int:
    if partial_bytes is None:
        return g
    if isinstance(partial_bytes, bool) or not isinstance(partial_bytes, int) or partial_bytes <= 0:
        raise ValueError(f"partial_bytes must be a positive int (the kernel's dK/dV partial element "
                         f"bytes, kernel.partial_dtype(dtype).itemsize), got {partial_bytes!r}")
    return partial_bytes


def _ring(cp: int, chunk: int, window: Window, kv_e: int, kv_g: int, kv_p: int,
          block_keys: Optional[int], documents=None, ring=()) -> List[Dict[str, int]]:
    """Per ring rank: bytes sent per op. kv_e / kv_g / kv_p: bytes of one key's K+V in the input
    / gradient / kernel partial dtype (all heads, whole batch). block_keys: as ring.py's
    settings.ring_block_keys() (None: read the setting, as the ring does). documents / ring: the
    packed layout and the ring's members (calls.py), whose geometry the ring runs on."""
    if block_keys is None:
        # with partials of the gradient's size the grouping into blocks changes no byte count,
        # so the environment is read only when it matters (as the ring reads it)
        block_keys = ring_block_keys() if kv_p != kv_g else 0
    blocks = ring_blocks(cp, 2 * chunk, block_keys)
    out = []
    for r in range(cp):
        seq = geo.RingView(cp, r, chunk, window, documents, ring)
        send = sum(_keys(geo.send_ranges(seq, q)) for q in range(cp) if q != r)
        dkv = 0
        for steps in blocks:
            slots, _ = geo.block(seq, steps)
            per_key = kv_p if geo.exclusive(seq, r, steps) else kv_g
            dkv += sum(s.size for s in slots) * per_key
        ops = {"ring.fwd.kv": send * kv_e, "ring.bwd.kv": send * kv_e, "ring.bwd.dkv": dkv}
        out.append({k: v for k, v in ops.items() if v})
    return out


def _a2a(spec: AttnSpec, ranks: int, n: int, batch: int, g: int) -> Dict[str, int]:
    """Bytes every rank of an all-to-all group of `ranks` sends (n local tokens per rank);
    g = bytes of the gradients it returns."""
    e, _ = _sizes(spec)
    d, dv = spec.head_dim, spec.head_dim_v
    h = spec.num_heads // ranks
    hk = len(kv_head_index(spec.num_heads, spec.num_kv_heads, ranks)[0])   # replicas included
    piece = (ranks - 1) * batch * n
    return {"a2a.fwd.q": piece * h * d * e, "a2a.fwd.k": piece * hk * d * e,
            "a2a.fwd.v": piece * hk * dv * e, "a2a.fwd.out": piece * h * dv * e,
            "a2a.bwd.dout": piece * h * dv * e, "a2a.bwd.dq": piece * h * d * g,
            "a2a.bwd.dk": piece * hk * d * g, "a2a.bwd.dv": piece * hk * dv * g}


def _hybrid(spec: AttnSpec, n: int, batch: int, a2a_size: Optional[int], p: int,
            block_keys: Optional[int], documents=None) -> Optional[List[Dict[str, int]]]:
    """a2a+p2p: the a2a terms on the inner group (float32 gradients: the outer ring's sums) plus
    the outer ring's terms for this rank's heads, per CP rank."""
    cp = spec.cp_size
    if a2a_size is None or a2a_size < 1 or cp % a2a_size:
        raise ValueError(f"a2a+p2p needs an a2a_size that divides cp={cp}, got {a2a_size}")
    if not heads_divide(spec.num_heads, a2a_size):
        return None
    e, g = _sizes(spec)
    inner = {k: v for k, v in _a2a(spec, a2a_size, n, batch, g).items() if v}
    hk = len(kv_head_index(spec.num_heads, spec.num_kv_heads, a2a_size)[0])
    kv_outer = batch * hk * (spec.head_dim + spec.head_dim_v)
    ring = geo.ring_members(cp, a2a_size) if documents is not None else ()
    outer = _ring(cp // a2a_size, a2a_size * n // 2, spec.window, kv_outer * e, kv_outer * g,
                  kv_outer * p, block_keys, documents, ring)
    return [{**inner, **outer[r // a2a_size]} for r in range(cp)]


def sent_per_rank(spec: AttnSpec, seq_len: int, comm: str, batch: int = 1,
                  a2a_size: Optional[int] = None, *, partial_bytes: Optional[int] = None,
                  block_keys: Optional[int] = None, documents=None) -> Optional[List[Dict[str, int]]]:
    """Modelled bytes each CP rank sends in one layer's forward + backward, per op name (the
    names transport.counting() records). None where the scheme cannot run these heads (a2a needs
    Hq % group size == 0). comm="a2a+p2p" needs a2a_size (dividing cp).

    partial_bytes: element bytes of the kernel's dK/dV partials,
    kernel.partial_dtype(spec.dtype).itemsize (2 for bf16/fp16 inputs on the flash-attn family);
    None = gradient bytes (float32, float64 for float64), as for the torch kernel. It changes
    ring.bwd.dkv (ring and a2a+p2p's outer ring), for blocks where layout.block_exclusive, and
    a2a's dq/dk/dv (plain a2a only).
    block_keys: the ring's block size in keys (CP_SOFTCAP_RING_BLOCK_KEYS); None = read it from
    the setting as the ring does (settings.ring_block_keys()). Used only when partial_bytes differs
    from the gradient bytes.
    documents: the call's PackedLayout (packed documents; seq_len is then layout.seq_len): the
    ring's bytes follow the document geometry (only same-document visible keys travel);
    all_gather and a2a move every token whatever the documents."""
    cp = spec.cp_size
    n = _local_len(spec, seq_len)
    e, g = _sizes(spec)
    p = _partial_bytes(partial_bytes, g)
    kv = batch * spec.num_kv_heads * (spec.head_dim + spec.head_dim_v)
    if documents is not None and documents.seq_len != seq_len:
        raise ValueError(f"seq_len={seq_len} but the packed layout has {documents.seq_len} tokens")
    if comm == "ring":
        ring = geo.ring_members(cp) if documents is not None else ()
        return _ring(cp, n // 2, spec.window, kv * e, kv * g, kv * p, block_keys, documents, ring)
    if comm == "all_gather":
        ops = {"all_gather.fwd.kv": (cp - 1) * n * kv * e, "all_gather.bwd.kv": (cp - 1) * n * kv * e,
               "all_gather.bwd.dkv": (cp - 1) * n * kv * g}
        return [{k: v for k, v in ops.items() if v} for _ in range(cp)]
    if comm == "a2a":
        if not heads_divide(spec.num_heads, cp):
            return None
        ops = {k: v for k, v in _a2a(spec, cp, n, batch, p).items() if v}
        return [dict(ops) for _ in range(cp)]
    if comm == "a2a+p2p":
        return _hybrid(spec, n, batch, a2a_size, p, block_keys, documents)
    raise ValueError(f"no byte model for comm={comm!r}; one of {SINGLE_GROUP + ('a2a+p2p',)}")


def bytes_per_rank(spec: AttnSpec, seq_len: int, batch: int = 1,
                   a2a_size: Optional[int] = None, *, partial_bytes: Optional[int] = None,
                   block_keys: Optional[int] = None, documents=None) -> Dict[str, int]:
    """Busiest rank's total bytes sent (fwd + bwd) per scheme: "ring", "all_gather", "a2a" (when
    Hq % cp == 0) and, with a2a_size given, "a2a+p2p" (when Hq % a2a_size == 0).
    partial_bytes, block_keys, documents: as sent_per_rank."""
    out = {}
    for comm in SINGLE_GROUP + (("a2a+p2p",) if a2a_size is not None else ()):
        per = sent_per_rank(spec, seq_len, comm, batch, a2a_size, partial_bytes=partial_bytes,
                            block_keys=block_keys, documents=documents)
        if per is not None:
            out[comm] = max(sum(ops.values()) for ops in per)
    return out


def choose_comm(spec: AttnSpec, seq_len: int, batch: int = 1, *,
                partial_bytes: Optional[int] = None, block_keys: Optional[int] = None,
                documents=None) -> str:
    """The single-group scheme (ring, all_gather, a2a) with the fewest bytes on the busiest rank.
    partial_bytes: the selected kernel's kernel.partial_dtype(spec.dtype).itemsize (None: the
    gradient bytes); block_keys, documents: as sent_per_rank."""
    costs = bytes_per_rank(spec, seq_len, batch, partial_bytes=partial_bytes, block_keys=block_keys,
                           documents=documents)
    return min((n for n in SINGLE_GROUP if n in costs), key=lambda n: (costs[n], SINGLE_GROUP.index(n)))


def describe_comm_choice(spec: AttnSpec, seq_len: int, batch: int = 1,
                         a2a_size: Optional[int] = None, *, partial_bytes: Optional[int] = None,
                         block_keys: Optional[int] = None, documents=None) -> str:
    """choose_comm's table (partial_bytes, block_keys, documents: as sent_per_rank)."""
    kw = dict(partial_bytes=partial_bytes, block_keys=block_keys, documents=documents)
    costs = bytes_per_rank(spec, seq_len, batch, a2a_size, **kw)
    chosen = choose_comm(spec, seq_len, batch, **kw)
    lines = [f"comm='auto' at S={seq_len}, cp={spec.cp_size}: bytes sent per rank per layer "
             "(fwd+bwd, busiest rank)"]
    if partial_bytes is not None and partial_bytes != _sizes(spec)[1]:
        lines[0] += f"; ring dK/dV partials of {partial_bytes} B per element where exclusive"
    for name in SINGLE_GROUP:
        if name in costs:
            mark = "CHOSEN" if name == chosen else ""
            lines.append(f"  {name:<11} {costs[name] / 2**20:12.1f} MiB {mark}")
        else:
            lines.append(f"  {name:<11} {'-':>12}     ({spec.num_heads} query heads not divisible by cp={spec.cp_size})")
    if a2a_size is not None:
        label = f"a2a+p2p/{a2a_size}"
        note = f"(a2a groups of {a2a_size}, ring of {spec.cp_size // a2a_size}; not an auto candidate: needs a group pair)"
        if "a2a+p2p" in costs:
            lines.append(f"  {label:<11} {costs['a2a+p2p'] / 2**20:12.1f} MiB {note}")
        else:
            lines.append(f"  {label:<11} {'-':>12}     ({spec.num_heads} query heads not divisible by {a2a_size})")
    return "\n".join(lines)
