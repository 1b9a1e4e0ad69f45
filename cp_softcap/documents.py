"""Packed documents: validated boundaries and the packed layout (which global tokens each rank holds).

Documents are given by GLOBAL boundaries `cu_seqlens = [0, e1, ..., T_docs]`: document d holds
tokens [cu[d], cu[d+1]). Query i sees key j iff both are in the same document and the usual
window rule holds in global positions (i - left <= j <= i + right; causal: right = 0). Tokens
from T_docs to the end of the stream are padding: outside every document.

The layout (docs/packing.md): the stream, padded at its end to `padded_len`, is cut into
cp * m equal chunks; every rank holds m of them, in global order. Chunks go to ranks by a
deterministic solver that balances attention AREA (visible (q, k) pairs of a chunk's queries),
not tokens, for causal attention or for every kind of layer window at once: greedy by area with
equal counts, then pairwise swaps that lower the busiest rank. No document is padded. For one
causal document and m = 2 the solver returns exactly the zigzag layout (chunks r and
2cp-1-r). m is the smallest of CHUNK_CHOICES whose busiest/mean area is within GOOD_ENOUGH,
else the best of them: more chunks balance better but cost more kernel calls and messages
(benchmarks/packing_balance.py measures both).

Everything here is integer arithmetic on the host, identical on every rank, cached per
(boundaries, length, cp, layer windows).
"""
from __future__ import annotations

import hashlib
import sys
from array import array
from bisect import bisect_right
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional, Sequence, Tuple

import torch

from .memo import TensorMemo
from .spec import Window, normalize_window

CHUNK_CHOICES = (2, 4, 8, 16)           # chunks per rank the layout may use
PAD_MULTIPLE_PER_RANK = max(CHUNK_CHOICES)
GOOD_ENOUGH = 1.03                      # busiest/mean area at which more chunks stop paying


def _where(rank) -> str:
    return "" if rank is None else f" on rank {rank}"


def check_cu_seqlens(cu_seqlens, seq_len: Optional[int] = None, *, rank=None) -> Tuple[int, ...]:
    """Validate document boundaries; return them as a tuple of Python ints.

    cu_seqlens: 1-D integer tensor (or NumPy array) or list of ints [0, e1, ..., T_docs], strictly increasing
    (zero-length documents are rejected: drop repeated boundaries), T_docs <= seq_len when given.
    Raises ValueError (TypeError for a non-integer type) naming the value and the fix.
    """
    at = _where(rank)
    if type(cu_seqlens).__module__ == "numpy":          # a NumPy array: as a tensor
        cu_seqlens = torch.as_tensor(cu_seqlens)
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens must be 1-D [num_docs + 1], got shape {tuple(cu_seqlens.shape)}{at}; "
                             "pass one stream's boundaries, e.g. torch.tensor([0, 5, 12])")
        if cu_seqlens.dtype == torch.bool or cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
            raise TypeError(f"cu_seqlens must hold integers, got dtype {cu_seqlens.dtype}{at}; "
                            "convert with .to(torch.int64)")
        if cu_seqlens.device.type == "meta":
            raise ValueError(f"cu_seqlens is a meta tensor (no values){at}; pass the real boundaries "
                             "(a list of ints or a CPU tensor)")
        values = cu_seqlens.tolist()
    elif isinstance(cu_seqlens, (list, tuple)):
        values = []
        for i, v in enumerate(cu_seqlens):
            if isinstance(v, bool) or not hasattr(v, "__index__"):
                raise TypeError(f"cu_seqlens[{i}] = {v!r} is not an int{at}; "
                                "cu_seqlens must be integer token offsets [0, e1, ..., T_docs]")
            values.append(int(v.__index__()))
    else:
        raise TypeError(f"cu_seqlens must be a 1-D integer tensor or a list of ints, got "
                        f"{type(cu_seqlens).__name__}{at}")
    if len(values) < 2:
        raise ValueError(f"cu_seqlens={values} has fewer than 2 entries{at}; it needs [0, e1, ..., T_docs] "
                         "with at least one document, e.g. [0, seq_len] for a single document")
    if values[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {values[0]} (cu_seqlens={_short(values)}){at}; "
                         "boundaries are global token offsets of the whole stream")
    for d in range(len(values) - 1):
        if values[d + 1] <= values[d]:
            fix = ("documents must have at least one token: drop repeated boundaries "
                   "(torch.unique_consecutive)" if values[d + 1] == values[d] else
                   "boundaries are cumulative token offsets, e.g. [0] + running sum of the document "
                   "lengths (torch.cumsum)")
            what = "zero-length document" if values[d + 1] == values[d] else "decreasing boundary"
            raise ValueError(f"cu_seqlens is not strictly increasing: cu_seqlens[{d}] = {values[d]}, "
                             f"cu_seqlens[{d + 1}] = {values[d + 1]} ({what}){at}; {fix}")
    if seq_len is not None and values[-1] > seq_len:
        raise ValueError(f"cu_seqlens ends at {values[-1]}, past the stream length {seq_len}{at}; the last "
                         "boundary is the end of the last document and must be <= the sequence length")
    return tuple(values)


def _short(values) -> str:
    return str(values) if len(values) <= 8 else f"[{values[0]}, {values[1]}, ..., {values[-1]}] ({len(values)} entries)"


def cu_hash(cu: Sequence[int]) -> int:
    """A cheap stable 63-bit hash of validated boundaries (same value in every process), for the
    cross-rank signature: ranks compare this instead of sending the whole tensor."""
    values = array("q", cu)                   # int64, the machine's byte order
    if sys.byteorder == "big":
        values.byteswap()                     # the hash is of little-endian bytes everywhere
    data = values.tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def padded_len(seq_len: int, cp: int) -> int:
    """The stream length the packed layout uses: seq_len rounded up to a multiple of
    cp * PAD_MULTIPLE_PER_RANK (cp = 1: seq_len itself). The added tokens are padding: at the
    END of the stream, outside every document (fewer than 16 * cp tokens)."""
    if cp == 1:
        return seq_len
    step = cp * PAD_MULTIPLE_PER_RANK
    return -(-seq_len // step) * step


def _below(n: torch.Tensor, cap: Optional[int]) -> torch.Tensor:
    """sum of min(p, cap) for p in 0..n-1, elementwise over int64 n (cap None: unbounded)."""
    n = n.clamp_min(0)
    tri = n * (n - 1) // 2
    if cap is None:
        return tri
    return torch.where(n <= cap + 1, tri, cap * (cap + 1) // 2 + (n - cap - 1) * cap)


def _doc_prefix(length: torch.Tensor, n: torch.Tensor, window: Window) -> torch.Tensor:
    """Visible keys summed over the first n queries of a document of `length` tokens: query p
    sees min(p, left) keys before it, min(length-1-p, right) after it, and itself."""
    left, right = window
    return _below(n, left) + _below(length, right) - _below(length - n, right) + n


def chunk_areas(cu: Tuple[int, ...], seq_len: int, num_chunks: int, window: Window) -> Tuple[int, ...]:
    """Visible (q, k) pairs of each of num_chunks equal chunks' queries: closed form per
    (document, chunk) piece, over all pieces at once in exact int64 arithmetic."""
    chunk = seq_len // num_chunks
    bounds = torch.tensor(cu, dtype=torch.int64)
    starts, ends = bounds[:-1], bounds[1:]
    first = starts // chunk
    pieces = (ends - 1) // chunk - first + 1              # chunks each document touches
    doc = torch.repeat_interleave(torch.arange(len(starts)), pieces)
    within = torch.arange(len(doc)) - (torch.cumsum(pieces, 0) - pieces)[doc]
    c = first[doc] + within
    start, end = starts[doc], ends[doc]
    lo = torch.maximum(start, c * chunk) - start
    hi = torch.minimum(end, (c + 1) * chunk) - start
    area = _doc_prefix(end - start, hi, window) - _doc_prefix(end - start, lo, window)
    return tuple(torch.zeros(num_chunks, dtype=torch.int64).index_add_(0, c, area).tolist())


def assign_chunks(areas, cp: int) -> Tuple[Tuple[int, ...], ...]:
    """Chunks -> cp ranks with len(chunks) // cp chunks each, ascending per rank.

    areas: each chunk's area (a sequence of ints), or one such sequence per layer window to
    balance them all at once (every layer synchronises the ranks, so each kind of layer needs
    its own balance). Each window's loads are compared as a fraction of its total, in exact
    integers (load_w * prod of the other totals).

    Greedy: chunks by decreasing (scaled) area summed over windows (ties: higher index first),
    each to the rank with room whose worst load after taking it is lowest (ties: lowest rank).
    Then swaps: while exchanging one chunk of the busiest (rank, window) with a chunk of another
    rank lowers both ranks' worst load below the busiest load, do the best such swap. For one
    window this is "least loaded rank first" and "swap a bigger chunk for a smaller one"."""
    per_window = [list(areas)] if areas and isinstance(areas[0], int) else [list(a) for a in areas]
    if len(per_window) == 1:
        return _assign_one(per_window[0], cp)
    totals = [max(1, sum(a)) for a in per_window]
    scale = [_product(t for v, t in enumerate(totals) if v != w) for w in range(len(totals))]
    vec = [tuple(a[c] * scale[w] for w, a in enumerate(per_window)) for c in range(len(per_window[0]))]
    m = len(vec) // cp
    load, held = [[0] * len(totals) for _ in range(cp)], [[] for _ in range(cp)]

    def add(r, c, sign=1):
        load[r] = [x + sign * y for x, y in zip(load[r], vec[c])]

    for c in sorted(range(len(vec)), key=lambda i: (-sum(vec[i]), -i)):
        r = min((r for r in range(cp) if len(held[r]) < m),
                key=lambda r: (max(x + y for x, y in zip(load[r], vec[c])), r))
        held[r].append(c)
        add(r, c)
    for _ in range(4 * len(vec)):
        b = max(range(cp), key=lambda r: (max(load[r]), -r))
        top, best = max(load[b]), None
        bound = top                     # a swap must bring both ranks' worst load below this
        for x in held[b]:
            rest_b = [lb - vx for lb, vx in zip(load[b], vec[x])]
            for r in range(cp):
                if r == b:
                    continue
                plus_r = [lr + vx for lr, vx in zip(load[r], vec[x])]
                for y in held[r]:
                    worst = _worst_after_swap(rest_b, plus_r, vec[y], bound)
                    if worst is not None:
                        best, bound = (worst, x, r, y), worst
        if best is None:
            break
        _, x, r, y = best
        held[b][held[b].index(x)] = y
        held[r][held[r].index(y)] = x
        add(b, x, -1), add(b, y), add(r, y, -1), add(r, x)
    return tuple(tuple(sorted(h)) for h in held)


def _worst_after_swap(rest_b, plus_r, vy, bound):
    """max over windows of (rest_b + vy) and (plus_r - vy), or None as soon as one reaches
    `bound` (the swap is then no better than the best so far)."""
    worst = None
    for a, c, v in zip(rest_b, plus_r, vy):
        t, u = a + v, c - v
        if t >= bound or u >= bound:
            return None
        m = t if t > u else u
        if worst is None or m > worst:
            worst = m
    return worst


def _assign_one(areas, cp: int) -> Tuple[Tuple[int, ...], ...]:
    """assign_chunks for one window, on plain ints (the common case, about 10x faster)."""
    m = len(areas) // cp
    load, held = [0] * cp, [[] for _ in range(cp)]
    for c in sorted(range(len(areas)), key=lambda i: (-areas[i], -i)):
        r = min((r for r in range(cp) if len(held[r]) < m), key=lambda r: (load[r], r))
        held[r].append(c)
        load[r] += areas[c]
    for _ in range(4 * len(areas)):
        b = max(range(cp), key=lambda r: (load[r], -r))
        best = None
        for x in held[b]:
            for r in range(cp):
                if r == b:
                    continue
                for y in held[r]:
                    delta = areas[x] - areas[y]
                    worst = max(load[b] - delta, load[r] + delta)
                    if delta > 0 and worst < load[b] and (best is None or worst < best[0]):
                        best = (worst, x, r, y, delta)
        if best is None:
            break
        _, x, r, y, delta = best
        held[b][held[b].index(x)] = y
        held[r][held[r].index(y)] = x
        load[b] -= delta
        load[r] += delta
    return tuple(tuple(sorted(h)) for h in held)


def _product(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


@dataclass(frozen=True, eq=False)
class PackedLayout:
    """Which global tokens each rank holds for one packed stream. Small, frozen, hashable.

    cu_seqlens: validated boundaries; seq_len: padded stream length (padded_len of the user's);
    cp: ranks; windows: the layer windows the balance was computed for (causal: ((None, 0),));
    chunk: tokens per chunk; chunks[r]: global chunk indices of rank r, ascending (rank r's
    local tokens are these chunks concatenated); rank_area[w][r]: visible (q, k) pairs of rank
    r's queries under windows[w]. `compiled_form` holds cu_seqlens followed by the chunks per
    rank as one CPU int64 tensor: what a compiled model hands the library's operator (its
    values are data to torch.compile, where a tuple or an int would be constants that
    recompile)."""
    cu_seqlens: Tuple[int, ...]
    seq_len: int
    cp: int
    windows: Tuple[Window, ...]
    chunk: int
    chunks: Tuple[Tuple[int, ...], ...]
    rank_area: Tuple[Tuple[int, ...], ...]
    signature: int = field(default=0)
    compiled_form: Optional[torch.Tensor] = field(default=None, repr=False)

    def __post_init__(self):
        key = (cu_hash(self.cu_seqlens), self.seq_len, self.cp, self.windows, self.chunk, self.chunks)
        object.__setattr__(self, "signature", cu_hash(list(_flatten(key))))
        object.__setattr__(self, "compiled_form", torch.tensor(
            self.cu_seqlens + (len(self.chunks[0]),), dtype=torch.int64))

    def __hash__(self) -> int:
        return self.signature

    def __eq__(self, other) -> bool:
        return (isinstance(other, PackedLayout) and self.signature == other.signature
                and (self.seq_len, self.cp, self.windows, self.chunks, self.cu_seqlens)
                == (other.seq_len, other.cp, other.windows, other.chunks, other.cu_seqlens))

    @property
    def chunks_per_rank(self) -> int:
        return len(self.chunks[0])

    @property
    def local_len(self) -> int:
        return self.seq_len // self.cp

    @property
    def num_docs(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def padding(self) -> int:
        """Tokens after the last document (the user's tail padding plus the library's)."""
        return self.seq_len - self.cu_seqlens[-1]

    @property
    def imbalances(self) -> Tuple[float, ...]:
        """Per window: busiest rank's area over the mean (1.0 = perfect, and when no area)."""
        return tuple(max(a) * self.cp / sum(a) if sum(a) else 1.0 for a in self.rank_area)

    @property
    def imbalance(self) -> float:
        """The worst of `imbalances`."""
        return max(self.imbalances)

    def runs(self, rank: int) -> Tuple[Tuple[int, int, int], ...]:
        """Rank's tokens as maximal global runs (g0, g1, local0): global [g0, g1) sits at local
        [local0, local0 + g1 - g0). Local order is global order."""
        return _runs(self.chunks[_check_rank(rank, self.cp)], self.chunk)

    def index(self, rank: int, device=None) -> torch.Tensor:
        """int64 [local_len]: global position of each of rank's local tokens."""
        parts = [torch.arange(g0, g1, device=device) for g0, g1, _ in self.runs(rank)]
        return torch.cat(parts)

    def stream_index(self, device=None) -> torch.Tensor:
        """int64 [seq_len]: global position of each token of all ranks' shards concatenated in
        rank order (what a sequence all-to-all delivers). With idx = stream_index():
        y[:, idx] = x puts such a tensor x in global order; x = y[:, idx] takes it back."""
        return torch.cat([self.index(r, device) for r in range(self.cp)])

    def doc_ids(self, rank: int, device=None) -> torch.Tensor:
        """int64 [local_len]: document index of each local token, -1 for padding."""
        return doc_ids(self.cu_seqlens, self.index(rank, device))

    def positions(self, rank: int, device=None) -> torch.Tensor:
        """int64 [local_len]: document-relative position of each local token (RoPE); 0 for padding."""
        return doc_positions(self.cu_seqlens, self.index(rank, device))


def _flatten(obj):
    if isinstance(obj, tuple):
        for o in obj:
            yield from _flatten(o)
    else:
        yield -1 if obj is None else int(obj)


def _check_rank(rank: int, cp: int) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < cp:
        raise ValueError(f"rank {rank!r} is outside the CP group of size {cp}")
    return rank


def _runs(chunks: Tuple[int, ...], chunk: int) -> Tuple[Tuple[int, int, int], ...]:
    out, local = [], 0
    for c in chunks:
        g0, g1 = c * chunk, (c + 1) * chunk
        if out and out[-1][1] == g0:
            out[-1] = (out[-1][0], g1, out[-1][2])
        else:
            out.append((g0, g1, local))
        local += chunk
    return tuple(out)


def doc_ids(cu: Sequence[int], pos: torch.Tensor) -> torch.Tensor:
    """Document index of global positions `pos` (any int tensor), -1 at or past cu[-1]."""
    bounds = torch.tensor(cu, dtype=torch.int64, device=pos.device)
    ids = torch.searchsorted(bounds, pos.to(torch.int64), right=True) - 1
    return torch.where(pos.to(torch.int64) >= cu[-1], torch.full_like(ids, -1), ids)


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """Where packed documents start in rows of position_ids [R, S] (bool [R, S]): the first token
    of a row and every token whose position does not grow by 1 from the one before (the
    padding-free layout HF collators emit, positions restarting at each document)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    return starts


_FROM_POSITIONS = TensorMemo()


def boundaries_from_positions(position_ids: torch.Tensor, rows: int) -> Optional[Tuple[int, ...]]:
    """The documents of `rows` batch rows joined into one stream, from the resets of
    position_ids ([1 or rows, S], or [S]; document_starts: a new document at every row and
    wherever the position does not grow by 1): boundaries (0, ..., rows * S), or None when no
    row restarts (an ordinary batch, attended row by row). Read once per forward, not per
    layer (memo.TensorMemo)."""
    return _FROM_POSITIONS.get(position_ids, rows, lambda: _from_positions(position_ids, rows))


def _from_positions(position_ids: torch.Tensor, rows: int) -> Optional[Tuple[int, ...]]:
    pos = position_ids.reshape(-1, position_ids.shape[-1])
    starts = document_starts(pos)
    if not bool(starts[:, 1:].any()):
        return None
    sq = pos.shape[-1]
    starts = starts.expand(rows, sq).reshape(-1)
    return tuple(starts.nonzero().flatten().tolist()) + (rows * sq,)


def doc_positions(cu: Sequence[int], pos: torch.Tensor) -> torch.Tensor:
    """Document-relative positions of global positions `pos`; 0 for padding."""
    ids = doc_ids(cu, pos)
    bounds = torch.tensor(cu, dtype=torch.int64, device=pos.device)
    rel = pos.to(torch.int64) - bounds[ids.clamp(min=0)]
    return torch.where(ids < 0, torch.zeros_like(rel), rel)


def doc_of(cu: Tuple[int, ...], t: int) -> int:
    """Document index of global token t, or -1 for padding."""
    return -1 if t >= cu[-1] else bisect_right(cu, t) - 1


def packed_layout(cu_seqlens, seq_len: int, cp: int, *, causal: bool = True, window=None,
                  layer_windows: Optional[Sequence] = None, rank=None,
                  chunks_per_rank: Optional[int] = None) -> PackedLayout:
    """The packed layout of a stream of `seq_len` tokens (>= the last boundary) over `cp` ranks,
    balanced for causal (default) or full attention with `window`; or, with layer_windows (e.g.
    [None, (4095, 0)] for Gemma2's global and local layers), for every listed window at once,
    each normalised with `causal`. chunks_per_rank: one of CHUNK_CHOICES instead of the
    smallest within GOOD_ENOUGH (fewer chunks: fewer, longer kernel calls per rank and a less
    even balance). Cached."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp must be a positive int, got {cp!r}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    cu = check_cu_seqlens(cu_seqlens, seq_len, rank=rank)
    if layer_windows is None:
        layer_windows = [window]
    elif window is not None or not isinstance(layer_windows, (list, tuple)) or not layer_windows:
        raise ValueError(f"layer_windows={layer_windows!r} (with window={window!r}): pass either one "
                         "window, or a non-empty list of every layer kind's window, not both")
    windows = tuple(dict.fromkeys(normalize_window(w, causal) for w in layer_windows))
    choices = (1,) if cp == 1 else CHUNK_CHOICES
    if chunks_per_rank is not None:
        if chunks_per_rank not in choices or isinstance(chunks_per_rank, bool):
            raise ValueError(f"chunks_per_rank={chunks_per_rank!r} with cp={cp}: choose one of "
                             f"{choices} (or None for the library's choice)")
        choices = (chunks_per_rank,)
    return _layout(cu, padded_len(seq_len, cp), cp, windows, choices)


@lru_cache(maxsize=64)
def _layout(cu: Tuple[int, ...], seq_len: int, cp: int, windows: Tuple[Window, ...],
            choices: Tuple[int, ...]) -> PackedLayout:
    best = None
    for m in choices:
        areas = [chunk_areas(cu, seq_len, cp * m, w) for w in windows]
        chunks = assign_chunks(areas, cp)
        load = tuple(tuple(sum(a[c] for c in held) for held in chunks) for a in areas)
        layout = PackedLayout(cu, seq_len, cp, windows, seq_len // (cp * m), chunks, load)
        if layout.imbalance <= GOOD_ENOUGH:
            return layout
        if best is None or layout.imbalance < best.imbalance:
            best = layout
    return best
