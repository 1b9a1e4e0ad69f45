"""A MODEL, not a measurement: predicted fwd+bwd attention time per layer for ring, all_gather,
a2a, a2a+p2p and auto on N = 8-128 GPUs, from one-GPU kernel times and the library's own byte
model. It answers "which comm, at what scale, and where does communication stop hiding under
compute" until it is measured on several GPUs.

    python benchmarks/scaling_model.py                     # kernel times from cp_sim's H200 JSON
    python benchmarks/scaling_model.py --kernel-times results/cp_sim_x.json [...]   # a fresh run
    python benchmarks/scaling_model.py --quick              # a few rows: checks the script

Compute. A ring rank's kernel calls cost f x area / rate: area = each call's visible (query,
key) pairs (the calls the library makes: layout / doc_geometry through calls.py), rate = the
full-attention pairs per ms of cp_sim's one-GPU full_ms (same heads and mode; log-linear in S
between measured S, held beyond), f = cp_sim's measured ring-rank time / its pairs' time at the
same local length S/cp (short calls, merges, adds; held at the nearest measured S/cp outside
4K-32K, so the model is OPTIMISTIC for shorter shards: S/N of 256-2K at 32K on 16-128 GPUs).
27B heads have no windowed cp_sim run: their causal values scaled as 9B's window/causal.
all_gather's calls take f too; a2a's one whole-sequence call per rank takes f = 1. Packed: area
of same-document pairs, all_gather's busiest rank = mean x the layout's imbalance. Backward =
fwd+bwd - fwd.
Bytes. cp_softcap.comm_model.sent_per_rank (the model comm="auto" uses, equal to counted bytes),
bf16 inputs, dK/dV partials in bf16 (flash-attn family); the ring's per-block split comes from
the same geometry (calls.py) and is checked to sum to the byte model.
Links. 8 GPUs per node over NVLink, --nvlink-gbs GB/s per GPU per direction; between nodes
--ib-gbs GB/s per GPU (400 Gb/s NIC) per direction; a message to a peer in the node goes at the
NVLink rate, one outside at the NIC rate, both at once; --latency-us per message. Collectives
(all_gather, reduce-scatter, all-to-all) at the same per-GPU rates, bytes split by where the
peers are (NCCL's rings over nodes are bound by the NIC: all_gather's bytes go at the NIC rate
once N > 8).
Overlap, as the code schedules it. ring (cp/ring.py): one communication stream and one compute
stream, each in issue order: forward kv(0) | self calls; then kv(i+1) is posted as block i's
calls run (two blocks in flight). Backward kv(0) | self; per block: kv(i+1), block i's calls,
dkv(i) (after those calls), the adds of dkv(i-1). all_gather (cp/all_gather.py): the second
half gather overlaps the first chunk's calls; the backward's re-gather and float32
reduce-scatter do not overlap. a2a: nothing overlaps (all-to-all, one whole-sequence call per
rank, all-to-all). a2a+p2p: a2a inside the node (groups of 8), the outer ring over nodes as
the ring above on its members (all bytes at the NIC rate).
ideal = full-attention time of one GPU / N; "exposed" = modelled time - compute time of the
busiest rank (communication that did not hide). auto_pick = choose_comm (fewest bytes);
auto_right = whether that pick is the fastest single-group comm by this model.
Writes benchmarks/results/scaling_model.json and .png (--quick: $OUT or a temporary folder).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Dict, List, Optional, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cp_softcap import calls as geo                              # noqa: E402
from cp_softcap.comm_model import choose_comm, sent_per_rank           # noqa: E402
from cp_softcap.layout import ring_blocks                          # noqa: E402
from cp_softcap.spec import make_spec                              # noqa: E402
from benchmarks._util import OUT_DIR_HELP, RESULTS, bar_plot, out_dir_for, save, table  # noqa: E402

HEADS = {"9B": (16, 8, 256), "27B": (32, 16, 128)}
GPUS_PER_NODE = 8
BLOCK_KEYS = 32768                       # CP_SOFTCAP_RING_BLOCK_KEYS default
DEFAULT_TIMES = ("cp_sim_native.json", "cp_sim_native_27b.json", "cp_sim_native_window.json")
MIB = 2 ** 20


# ------------------------------------------------------------------------------ compute

def area(sq: int, sk: int, window) -> int:
    """Visible pairs of one bottom-right aligned call (PairCall.area without the Python loop)."""
    left, right = window
    i = torch.arange(sq, dtype=torch.int64) + (sk - sq)
    lo = torch.zeros_like(i) if left is None else (i - left).clamp(min=0)
    hi = torch.full_like(i, sk - 1) if right is None else (i + right).clamp(max=sk - 1)
    return int((hi - lo + 1).clamp(min=0).sum())


def call_area(c) -> int:
    cu_q, cu_k = getattr(c, "cu_q", None), getattr(c, "cu_k", None)
    if cu_q is None:
        return area(c.q1 - c.q0, c.k1 - c.k0, c.window)
    return sum(area(cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s], c.window) for s in range(len(cu_q) - 1))


class KernelTimes:
    """Rates (pairs per ms) per (model, windowed, mode) and S, from cp_sim's full_ms; and the
    ring-rank factor f = measured rank_ms / (its calls' pairs / rate) per local length S/cp, from
    cp_sim's simulated ranks: what short calls, merges and adds cost on top of the pairs."""

    def __init__(self, blobs: Sequence[Dict]):
        self.full: Dict = {}            # (model, windowed, mode) -> {S: pairs per ms}
        fits: Dict = {}
        self.sources, self.device = [], set()
        for blob in blobs:
            meta = blob["meta"]
            model = next((m for m, h in HEADS.items() if list(h) == list(meta["heads"])), None)
            if model is None:
                continue
            self.sources.append(meta.get("argv"))
            self.device.add(meta.get("device"))
            for r in blob["records"]:
                if "full_ms" not in r or "rank_ms" not in r or r.get("layout") or r.get("mix"):
                    continue
                w = None if r.get("window") is None else (r["window"], 0)
                key = (model, w is not None, r["mode"])
                self.full.setdefault(key, {})[r["S"]] = area(r["S"], r["S"], w or (None, 0)) / r["full_ms"]
                fits.setdefault(key, []).append((r, w))
        self.factors: Dict = {}         # (model, windowed, mode) -> {S/cp: f}, median over records
        for key, recs in fits.items():
            per: Dict[int, List[float]] = {}
            for r, w in recs:
                pairs = sum(rank_area(r["S"], r["cp"], r.get("rank", 0), w or (None, 0),
                                      r.get("block_keys", BLOCK_KEYS)))
                per.setdefault(r["S"] // r["cp"], []).append(r["rank_ms"] / (pairs / self.rate(*key, r["S"])))
            self.factors[key] = {n: sorted(v)[len(v) // 2] for n, v in per.items()}

    def rate(self, model: str, windowed: bool, mode: str, s: int) -> float:
        return self._lookup(self.full, model, windowed, mode, s)

    def factor(self, model: str, windowed: bool, mode: str, n_local: int) -> float:
        """Ring-rank factor at this local length (held at the nearest measured one outside)."""
        return self._lookup(self.factors, model, windowed, mode, n_local)

    def _lookup(self, tables, model, windowed, mode, x):
        key = (model, windowed, mode)
        if key in tables:
            return _nearest(tables[key], x)
        if windowed and (model, False, mode) in tables:     # no windowed run for these heads: the
            base = next((k for k in tables if k[1] and k[2] == mode), None)    # causal value, scaled
            if base is not None and (base[0], False, mode) in tables:          # as a measured model's
                return (_nearest(tables[(model, False, mode)], x) * _nearest(tables[base], x)
                        / _nearest(tables[(base[0], False, mode)], x))
        raise KeyError(f"no kernel times for {model} {'window' if windowed else 'causal'} {mode}: "
                       f"pass cp_sim JSON with these heads (--kernel-times)")

    def ms(self, areas: Sequence[int], model: str, windowed: bool, mode: str, s: int,
           n_local: Optional[int] = None) -> float:
        """Time of calls of these areas; n_local: a ring rank's S/cp (None: full-length calls)."""
        f = 1.0 if n_local is None else self.factor(model, windowed, mode, n_local)
        return f * sum(areas) / self.rate(model, windowed, mode, s)


def _nearest(table_: Dict[int, float], s: int) -> float:
    """Rate at S: log-linear between measured S, the end values beyond them."""
    xs = sorted(table_)
    if s <= xs[0]:
        return table_[xs[0]]
    if s >= xs[-1]:
        return table_[xs[-1]]
    for a, b in zip(xs, xs[1:]):
        if a <= s <= b:
            t = math.log(s / a) / math.log(b / a)
            return table_[a] * (1 - t) + table_[b] * t
    raise AssertionError


def rank_area(s: int, cp: int, rank: int, window, block_keys: int) -> List[int]:
    """Areas of every kernel call of one zigzag ring rank (self calls, then each block's)."""
    seq = geo.RingView(cp, rank, s // (2 * cp), window)
    out = [call_area(c) for c in geo.self_calls(seq)]
    for steps in ring_blocks(cp, s // cp, block_keys):
        out += [call_area(c) for c in geo.block(seq, steps)[1]]
    return out


def load_kernel_times(paths: Optional[Sequence[str]]) -> KernelTimes:
    paths = list(paths) if paths else [os.path.join(RESULTS, p) for p in DEFAULT_TIMES]
    blobs = []
    for p in paths:
        try:
            with open(p) as f:
                blobs.append(json.load(f))
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"--kernel-times: cannot read {p} ({e}); pass cp_sim JSON files "
                             f"(benchmarks/cp_sim.py output)")
    return KernelTimes(blobs)


# ------------------------------------------------------------------------------ links and streams

class Links:
    def __init__(self, nvlink_gbs: float, ib_gbs: float, latency_us: float):
        self.nv, self.ib, self.lat = nvlink_gbs * 1e6, ib_gbs * 1e6, latency_us / 1e3   # bytes / ms, ms

    def p2p_ms(self, rank: int, peer_bytes: Dict[int, int]) -> float:
        """Messages of one rank to / from peers at once: in-node ones over NVLink, others over the NIC."""
        if not peer_bytes:
            return 0.0
        node = rank // GPUS_PER_NODE
        near = sum(b for p, b in peer_bytes.items() if p // GPUS_PER_NODE == node)
        far = sum(b for p, b in peer_bytes.items() if p // GPUS_PER_NODE != node)
        return max(near / self.nv, far / self.ib) + self.lat

    def collective_ms(self, nbytes: int, ranks: int) -> float:
        """A collective whose rank sends nbytes to (ranks - 1) peers in equal pieces."""
        if ranks <= 1 or nbytes == 0:
            return 0.0
        if ranks <= GPUS_PER_NODE:
            return nbytes / self.nv + self.lat * math.log2(ranks)
        far = nbytes * (ranks - GPUS_PER_NODE) / (ranks - 1)
        return max((nbytes - far) / self.nv, far / self.ib) + self.lat * math.log2(ranks)

    def ring_collective_ms(self, nbytes: int, ranks: int) -> float:
        """all_gather / reduce-scatter: NCCL's ring is bound by its slowest hop (the NIC over nodes)."""
        if ranks <= 1 or nbytes == 0:
            return 0.0
        return nbytes / (self.nv if ranks <= GPUS_PER_NODE else self.ib) + self.lat * (ranks - 1)


def two_streams(ops: List[tuple]) -> tuple:
    """ops in host issue order: (name, stream "comm" | "compute", ms, deps). FIFO streams; an op
    starts when its stream is free and its deps are done. -> (end time, compute busy time)."""
    free = {"comm": 0.0, "compute": 0.0}
    done: Dict[str, float] = {}
    busy = 0.0
    for name, stream, ms, deps in ops:
        start = max([free[stream]] + [done[d] for d in deps])
        done[name] = free[stream] = start + ms
        if stream == "compute":
            busy += ms
    return max(free.values()), busy


# ------------------------------------------------------------------------------ the comm types

def ring_rank_ms(seq, s, kt: KernelTimes, links: Links, model, windowed, kv_e, kv_p, kv_g, members,
                 heads_frac: float = 1.0):
    """fwd and bwd (end, compute) of ring member seq.rank, as ring.py issues its work.
    members[m] = the global rank of ring member m (for where its messages go); heads_frac = the
    share of the query heads this ring computes (a2a+p2p's outer ring)."""
    me = seq.rank
    n_loc = sum(b - a for a, b in _own(seq))
    fwd = lambda calls: heads_frac * kt.ms([call_area(c) for c in calls], model, windowed, "fwd", s, n_loc)  # noqa: E731
    bwd = lambda calls: (heads_frac * kt.ms([call_area(c) for c in calls], model, windowed, "fwd+bwd", s, n_loc)  # noqa: E731
                         - fwd(calls))
    blocks = ring_blocks(seq.size, sum(b - a for a, b in _own(seq)), BLOCK_KEYS) if seq.size > 1 else ()
    kv_msgs, dkv_msgs, block_calls = [], [], []
    for steps in blocks:
        slots, calls = geo.block(seq, steps)
        peer: Dict[int, int] = {}
        for st in steps:                                     # what we send ...
            dst = (me + st) % seq.size
            n = sum(b - a for a, b in geo.send_ranges(seq, dst))
            peer[members[dst]] = peer.get(members[dst], 0) + n * kv_e
        recv = {members[sl.src]: sl.size * kv_e for sl in slots}    # ... and receive, at once
        kv_msgs.append(max(links.p2p_ms(members[me], peer), links.p2p_ms(members[me], recv)))
        per_key = kv_p if geo.exclusive(seq, me, steps) else kv_g
        dkv_msgs.append(links.p2p_ms(members[me], {members[sl.src]: sl.size * per_key for sl in slots}))
        block_calls.append(calls)
    self_calls = geo.self_calls(seq)
    f = [("kv0", "comm", kv_msgs[0], ())] if blocks else []
    f.append(("self", "compute", fwd(self_calls), ()))
    for i, calls in enumerate(block_calls):
        if i + 1 < len(blocks):
            f.append((f"kv{i + 1}", "comm", kv_msgs[i + 1], ()))
        f.append((f"c{i}", "compute", fwd(calls), (f"kv{i}",)))
    b = [("kv0", "comm", kv_msgs[0], ())] if blocks else []
    b.append(("self", "compute", bwd(self_calls), ()))
    for i, calls in enumerate(block_calls):
        if i + 1 < len(blocks):
            b.append((f"kv{i + 1}", "comm", kv_msgs[i + 1], ()))
        b.append((f"c{i}", "compute", bwd(calls), (f"kv{i}",)))
        b.append((f"d{i}", "comm", dkv_msgs[i], (f"c{i}",)))
    if blocks:
        b.append(("add", "compute", 0.0, (f"d{len(blocks) - 1}",)))
    return two_streams(f), two_streams(b)


def _own(seq):
    return ((0, 2 * seq.chunk),) if seq.documents is None else ((0, seq.documents.local_len),)


def predict(model: str, n: int, s: int, layout: str, kt: KernelTimes, links: Links, mix_cu=None) -> List[Dict]:
    """One record per comm type at (model, N, S, layout)."""
    hq, hkv, d = HEADS[model]
    window = (4095, 0) if layout == "window" else (None, 0)
    windowed = layout == "window"
    spec = make_spec(head_dim=d, num_heads=hq, num_kv_heads=hkv, dtype=torch.bfloat16, device_type="cuda",
                     softcap=50.0, causal=True, window=window if windowed else None, cp_size=n)
    docs = None
    if mix_cu is not None:
        from cp_softcap.documents import packed_layout
        docs = packed_layout(tuple(mix_cu), s, n, window=None)
    e, g, p = 2, 4, 2
    kv = hkv * 2 * d
    full = {m: kt.ms([_full_area(s, window, mix_cu)], model, windowed, m, s) for m in ("fwd", "fwd+bwd")}
    ideal = full["fwd+bwd"] / n
    kw = dict(partial_bytes=p, block_keys=BLOCK_KEYS, documents=docs)
    base = dict(model=model, N=n, S=s, layout=layout, ideal_ms=ideal, full_ms=full["fwd+bwd"])
    out = []
    # ring: every rank simulated, the busiest sets the layer time
    per = sent_per_rank(spec, s, "ring", **kw)
    worst = None
    ring = geo.ring_members(n) if docs is not None else ()
    for r in range(n):
        seq = geo.RingView(n, r, s // (2 * n), window, docs, ring)
        (fe, fc), (be, bc) = ring_rank_ms(seq, s, kt, links, model, windowed, kv * e, kv * p, kv * g, list(range(n)))
        if worst is None or fe + be > worst[0]:
            worst = (fe + be, fc + bc, r)
    out.append(dict(base, comm="ring", ms=worst[0], compute_ms=worst[1], busiest_rank=worst[2],
                    MiB=max(sum(o.values()) for o in per) / MIB))
    # all_gather
    n_loc = s // n
    ag_bytes = (n - 1) * n_loc * kv * e
    t_ag = links.ring_collective_ms(ag_bytes, n)
    t_rs = links.ring_collective_ms((n - 1) * n_loc * kv * g, n)
    n_loc = s // n
    if docs is None:
        busiest = max(_gathered_area(s, n, r, window) for r in range(n))
    else:                           # the packed layout balances area: the busiest rank's share
        busiest = _full_area(s, window, mix_cu) / n * docs.imbalance
    comp_f, comp_fb = (kt.ms([busiest], model, windowed, m, s, n_loc) for m in ("fwd", "fwd+bwd"))
    fwd = t_ag / 2 + max(t_ag / 2, comp_f / 2) + comp_f / 2     # first chunk's calls under the second gather
    bwd = t_ag + (comp_fb - comp_f) + t_rs
    out.append(dict(base, comm="all_gather", ms=fwd + bwd, compute_ms=comp_fb,
                    MiB=max(sum(o.values()) for o in sent_per_rank(spec, s, "all_gather", **kw)) / MIB))
    # a2a: heads split, one whole-sequence call per rank
    per = sent_per_rank(spec, s, "a2a", **kw)
    if per is None:
        out.append(dict(base, comm="a2a", ms=None, reason=f"{hq} query heads not divisible by N={n}"))
    else:
        ops = per[0]
        comp = full["fwd+bwd"] / n               # one whole-sequence call per rank
        t = sum(links.collective_ms(v, n) for v in ops.values())
        out.append(dict(base, comm="a2a", ms=t + comp, compute_ms=comp, MiB=sum(ops.values()) / MIB))
    # a2a+p2p: a2a inside the node, ring over nodes
    a = min(GPUS_PER_NODE, n)
    per = sent_per_rank(spec, s, "a2a+p2p", a2a_size=a, **kw) if n > a else None
    if per is None:
        out.append(dict(base, comm="a2a+p2p", ms=None, reason="N fits one node: plain a2a" if n <= a
                        else f"{hq} query heads not divisible by {a}"))
    else:
        ops = per[0]
        t_a2a = sum(links.collective_ms(v, a) for k, v in ops.items() if k.startswith("a2a."))
        outer = n // a
        hspec = (hq // a, _kv_heads(hq, hkv, a), d)
        scale = hspec[0] / hq                       # compute of this rank's heads
        kv_o = hspec[1] * 2 * d
        ring_o = geo.ring_members(n, a) if docs is not None else ()
        worst = None
        for o in range(outer):
            seq = geo.RingView(outer, o, a * (s // n) // 2, window, docs, ring_o)
            (fe, fc), (be, bc) = ring_rank_ms(seq, s, kt, links, model, windowed, kv_o * e, kv_o * p, kv_o * g,
                                              [m * a for m in range(outer)], heads_frac=scale)
            if worst is None or fe + be > worst[0]:
                worst = (fe + be, fc + bc)
        out.append(dict(base, comm="a2a+p2p", a2a_size=a, ms=t_a2a + worst[0], compute_ms=worst[1],
                        MiB=max(sum(o.values()) for o in per) / MIB))
    pick = choose_comm(spec, s, partial_bytes=p, block_keys=BLOCK_KEYS, documents=docs)
    single = [r for r in out if r["comm"] in ("ring", "all_gather", "a2a") and r.get("ms")]
    best = min(single, key=lambda r: r["ms"])
    for r in out:
        if r.get("ms"):
            r.update(ratio=r["ms"] / ideal, exposed_ms=max(0.0, r["ms"] - r["compute_ms"]),
                     hidden=r["ms"] - r["compute_ms"] <= 0.05 * r["compute_ms"])
    chosen = next(r for r in out if r["comm"] == pick)
    out.append(dict(base, comm="auto", pick=pick, ms=chosen["ms"], ratio=chosen["ratio"],
                    compute_ms=chosen["compute_ms"], exposed_ms=chosen["exposed_ms"], MiB=chosen["MiB"],
                    best_single=best["comm"], auto_right=pick == best["comm"],
                    auto_loss=chosen["ms"] / best["ms"]))
    return out


def _kv_heads(hq: int, hkv: int, a: int) -> int:
    from cp_softcap.heads import kv_head_index
    return len(kv_head_index(hq, hkv, a)[0])


def _full_area(s, window, cu) -> int:
    if cu is None:
        return area(s, s, window)
    return sum(area(e - b, e - b, window) for b, e in zip(cu, cu[1:]))


def _gathered_area(s, n, r, window) -> int:
    """all_gather: a rank's queries against every key it sees (zigzag chunks r and 2n-1-r)."""
    c = s // (2 * n)
    return sum(area(c, ch * c + c, window) for ch in (r, 2 * n - 1 - r))   # rows see keys 0..end


# ------------------------------------------------------------------------------ output

def plot(blob: Dict, png: str) -> None:
    recs = [r for r in blob["records"] if r.get("ratio") and r["comm"] != "auto" and r["layout"] != "packed-long-tail"]
    if not recs:
        return
    pick = [r for r in recs if r["model"] == "9B" and r["fabric"] == "ib" and r["S"] in (131072, 1048576)]
    recs = pick or recs
    labels = list(dict.fromkeys(f"{r['layout'][:6]} {r['S'] // 1024}K N{r['N']}" for r in recs))
    comms = list(dict.fromkeys(r["comm"] for r in recs))
    series = {c: [next((r["ratio"] for r in recs if r["comm"] == c and
                        f"{r['layout'][:6]} {r['S'] // 1024}K N{r['N']}" == lbl), float("nan"))
                   for lbl in labels] for c in comms}
    bar_plot(png, labels, series, "modelled time / ideal",
             "MODEL (not measured): 9B heads, fwd+bwd per layer, NVLink in node + 400 Gb/s per GPU", hline=1.0)


def run(a) -> Dict:
    kt = load_kernel_times(a.kernel_times)
    links = Links(a.nvlink_gbs, a.ib_gbs, a.latency_us)
    from benchmarks.packing_balance import mix
    records = []
    for model in a.models:
        for n in a.ns:
            for s in a.seqs:
                if s % (16 * n):
                    continue
                for layout in a.layouts:
                    cu = mix("long-tail", s, 0) if layout == "packed-long-tail" else None
                    if cu is not None and s > a.max_packed_seq:
                        continue
                    for r in predict(model, n, s, layout if cu is None else "causal", kt, links, cu):
                        r.update(layout=layout, fabric="nvlink" if n <= GPUS_PER_NODE else "ib")
                        records.append(r)
    meta = dict(model_not_measured=True, kernel_times=kt.sources, kernel_device=sorted(kt.device),
                ring_rank_factor={" ".join(map(str, k)): {str(n): round(f, 4) for n, f in sorted(v.items())}
                                  for k, v in kt.factors.items()},
                assumptions=__doc__.split("Compute.")[1].split("Writes")[0].strip().replace("\n", " "),
                nvlink_gbs=a.nvlink_gbs, ib_gbs=a.ib_gbs, latency_us=a.latency_us, gpus_per_node=GPUS_PER_NODE,
                block_keys=BLOCK_KEYS, softcap=50.0, dtype="bf16, dK/dV partials bf16",
                packed="long-tail mix of benchmarks/packing_balance.py (seed 0), library's packed layout")
    return dict(records=records, meta=meta)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["9B", "27B"], choices=sorted(HEADS))
    p.add_argument("--ns", type=int, nargs="+", default=[8, 16, 64, 128])
    p.add_argument("--seqs", type=int, nargs="+", default=[32768, 131072, 262144, 1048576])
    p.add_argument("--layouts", nargs="+", default=["causal", "window", "packed-long-tail"],
                   choices=["causal", "window", "packed-long-tail"])
    p.add_argument("--max-packed-seq", type=int, default=262144, help="packed mixes up to this S (layout planning time)")
    p.add_argument("--kernel-times", nargs="+", default=None, help="cp_sim JSON files (default: the H200 runs in benchmarks/results)")
    p.add_argument("--nvlink-gbs", type=float, default=370.0, help="NVLink GB/s per GPU per direction, effective")
    p.add_argument("--ib-gbs", type=float, default=45.0, help="GB/s per GPU per direction between nodes (400 Gb/s NIC, ~90 %%)")
    p.add_argument("--latency-us", type=float, default=10.0)
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    p.add_argument("--quick", action="store_true", help="a few rows (checks the script)")
    a = p.parse_args(argv)
    for name in ("nvlink_gbs", "ib_gbs"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(a, name)}")
    bad = [n for n in a.ns if n < 2]
    if bad:
        p.error(f"--ns: {bad} must be >= 2 GPUs")
    if a.quick:
        a.models, a.ns, a.seqs, a.layouts = ["9B"], [8, 16], [32768], ["causal", "window"]
    a.out_dir = out_dir_for(a.out_dir, dry=a.quick)
    blob = run(a)
    path = save("scaling_model", blob["records"], blob["meta"], a.out_dir)
    from benchmarks.plots import plot_json
    plot_json(path)
    rows = [["model", "layout", "S", "N", "comm", "MiB/rank", "ms", "ideal ms", "ratio", "exposed ms", "note"]]
    f = lambda x, k=2: "-" if x is None else f"{x:.{k}f}"  # noqa: E731
    for r in blob["records"]:
        note = (f"pick {r['pick']}, best {r['best_single']}" + ("" if r["auto_right"] else f" (x{r['auto_loss']:.2f})")
                if r["comm"] == "auto" else r.get("reason", ""))
        rows.append([r["model"], r["layout"], r["S"], r["N"], r["comm"], f(r.get("MiB"), 0), f(r.get("ms")),
                     f(r["ideal_ms"]), f(r.get("ratio"), 3), f(r.get("exposed_ms")), note])
    print(table(rows))
    print(f"MODEL, not measured. wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
