"""One GPU simulates one rank's zigzag ring work (no communication): exactly the kernel calls,
LSE merges and backward the ring makes (same layout plan, same functions), for cp = 2, 4, 8 at
S = 32K and 128K, for several CP_SOFTCAP_RING_BLOCK_KEYS values.

    python benchmarks/cp_sim.py                  # H200, Gemma2-9B heads (16/8, D=256), softcap 50
    python benchmarks/cp_sim.py --window 4095    # Gemma2's local layers
    python benchmarks/cp_sim.py --dry-run        # CPU, tiny shapes, checks the script only
    python benchmarks/cp_sim.py --packed longtail --seqs 131072 --cps 8 --kernel fa2

ratio = per-rank time * cp / full-attention time (1.0 = perfect; communication not included).
The rank's calls come from cp_softcap.layout (plan_step for the self step, ring_blocks +
block_plan for the received blocks: calls over the same rows whose keys lie back to back in the
block buffer coalesced into one call, fully visible or, under a window, globally contiguous)
and run through cp_softcap.cp.ring.forward_calls / backward_calls, on random K/V blocks of the
sizes the ring would receive. Backward: prepare_backward once, each
call's kernel backward with the final merged (O, LSE), float32 dQ, per-block dK/dV partials in
the dtype the ring returns them (ring.return_dtype), plus the adds of the partials other ranks
would return. Writes benchmarks/results/cp_sim[_tag].json and .png (a dry run: into $OUT or a new
temporary folder, never into the tracked results).

--packed MIX: a packed stream of documents (MIX = longtail: lengths 16..32K log-uniform,
short: 64..2K, or single: one document; benchmarks/packing_balance.mix, seed 0, so the same
streams as that benchmark). --chunks-per-rank M ... adds the library's layout with M chunks per
rank (fewer, longer calls against a more even balance); --both-layers balances the layouts for
causal and windowed layers at once, as Gemma2's training does.
Every rank of the ring is simulated (the busiest rank sets the step time): its self call
(doc_geometry.step_calls) and one block per ring step (doc_geometry.block_plan, one step per
block), run through forward_calls / backward_calls with the kernel's segments=. ideal = the
full packed attention on one device (doc_geometry.stream_calls, same kernel) / cp; the reported
ratio is busiest-rank time / ideal. Two layouts:
  packed  cp_softcap.documents.packed_layout (the library's chunks, assigned by area)
  zigzag  whole-stream zigzag chunks (rank r holds chunks r and 2cp-1-r) as a PackedLayout, so
          its calls are the SAME document-masked kernel calls (doc_geometry handles any chunk
          ownership): a correct packed computation, only the balance differs. Running zigzag's
          unpacked chunk-pair calls instead would time attention across document boundaries,
          i.e. a different (wrong) result, so it is not a valid comparison.
The area ratio of each layout (PackedLayout.imbalance, as packing_balance reports) is recorded
next to the timed ratio. Backward: the dK/dV partials of received blocks are accumulated in the
gradient dtype and not added at their owner (the adds are small next to the kernel work).
--packed needs a kernel that serves segments= (fa4, fa2, flex, torch). Writes
cp_sim_packed_<mix>[_tag].json.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cp_softcap.cp.ring import backward_calls, forward_calls, return_dtype  # noqa: E402
from cp_softcap.kernels import get_kernel                           # noqa: E402
from cp_softcap.kernels.base import grad_dtype                      # noqa: E402
from cp_softcap.layout import (PairCall, block_exclusive, block_plan, key_range, plan_step,  # noqa: E402
                               ring_blocks)
from cp_softcap.merge import GradAccumulator, new_accumulator       # noqa: E402
from cp_softcap.spec import make_spec                               # noqa: E402
from cp_softcap.selector import select                              # noqa: E402
from benchmarks._util import OUT_DIR_HELP, out_dir_for, bench_ms, report, save, table  # noqa: E402
from benchmarks.plots import plot_json  # noqa: E402
from cp_softcap import doc_geometry as dgeo                         # noqa: E402

PACKED_MIXES = {"longtail": "long-tail", "short": "short", "single": "single"}   # -> packing_balance kind


class _RingRankSim:
    """One rank's ring work on random tensors: its self call plus its received blocks, each
    blocks entry (K block, V block, calls, dK/dV partials other ranks return for our keys, their
    key ranges, dtype of the partials this rank sends back). No communication."""

    def __init__(self, kernel, local_len, hq, hkv, d, dtype, dev, softcap):
        self.kernel, self.softcap, self.scale = kernel, softcap, d ** -0.5
        self._rand = lambda n, h: torch.randn(1, n, h, d, device=dev, dtype=dtype)   # noqa: E731
        L = local_len
        self.q, self.k, self.v, self.dout = (self._rand(L, hq), self._rand(L, hkv),
                                             self._rand(L, hkv), self._rand(L, hq))
        self.blocks = []

    def _add_block(self, n, calls, back, sent_dtype):
        """One received block: random K/V of n keys and its calls; `back` [((k0, k1), dtype)]:
        the dK/dV partials the peers return for those ranges of our keys, in the dtype each
        sender's block returns (ring.return_dtype; one random tensor stands for both dK and dV,
        timing only); sent_dtype: the dtype of the partials this rank sends back."""
        hkv, d = self.k.shape[2], self.k.shape[3]
        self.blocks.append((self._rand(n, hkv), self._rand(n, hkv), calls,
                            [torch.randn(1, k1 - k0, hkv, d, device=self.k.device).to(dt)
                             for (k0, k1), dt in back],
                            [kr for kr, _ in back], sent_dtype))

    @property
    def calls(self) -> int:
        """Kernel calls per forward."""
        return len(self.self_calls) + sum(len(b[2]) for b in self.blocks)

    def forward(self):
        kw = (self.kernel, self.scale, self.softcap)
        acc_o, acc_l = new_accumulator(self.q.shape, self.v.shape[-1], grad_dtype(self.q.dtype),
                                       self.q.device)
        forward_calls(self.q, self.k, self.v, self.self_calls, *kw, acc_o, acc_l)
        for kb, vb, calls, *_ in self.blocks:
            forward_calls(self.q, kb, vb, calls, *kw, acc_o, acc_l)
        return acc_o, acc_l

    def forward_backward(self):
        """dQ, dK, dV in the gradient dtype."""
        kw = (self.kernel, self.scale, self.softcap)
        out, lse = self.forward()
        gdt = grad_dtype(self.q.dtype)
        dout, out, dlse = self.kernel.prepare_backward(self.dout, out, None, self.q.dtype)
        dq, dk, dv = (GradAccumulator(t.shape, gdt, self.q.device)
                      for t in (self.q, self.k, self.v))
        side = getattr(self, "side", None)
        if side is not None:
            # the self call's backward on a second stream into its own sums, beside the blocks'
            mine = [GradAccumulator(t.shape, gdt, self.q.device) for t in (self.q, self.k, self.v)]
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                backward_calls(dout, self.q, self.k, self.v, out, lse, dlse, self.self_calls, *kw,
                               *mine)
                mine = [m.result() for m in mine]
        else:
            backward_calls(dout, self.q, self.k, self.v, out, lse, dlse, self.self_calls, *kw,
                           dq, dk, dv)
        for kb, vb, calls, returned, ranges, sent_dtype in self.blocks:
            gk, gv = (GradAccumulator(t.shape, sent_dtype, kb.device) for t in (kb, vb))
            backward_calls(dout, self.q, kb, vb, out, lse, dlse, calls, *kw, dq, gk, gv)
            gk.result(), gv.result()        # what ring_backward sends back to the key owners
            for g, (k0, k1) in zip(returned, ranges):
                dk.add(k0, k1, g)
                dv.add(k0, k1, g)
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
            for acc, m in zip((dq, dk, dv), mine):
                acc.add(0, m.shape[1], m)
        return tuple(a.result() for a in (dq, dk, dv))


class RankSim(_RingRankSim):
    """One rank of a zigzag ring of size cp, doing exactly the ring's kernel calls and merges
    (layout.ring_blocks / block_plan, ring.forward_calls / backward_calls) on random K/V blocks
    of the shapes the ring would receive. No communication."""

    def __init__(self, kernel, s, cp, hq, hkv, d, dtype, dev, softcap, window, keys, rank=0):
        self.window = window
        self.c = chunk = s // (2 * cp)
        L = 2 * chunk
        super().__init__(kernel, L, hq, hkv, d, dtype, dev, softcap)
        self.self_calls = plan_step(cp, rank, rank, chunk, window)
        for steps in ring_blocks(cp, L, keys):
            slots, calls = block_plan(cp, rank, chunk, window, steps)
            n = sum(sl.k1 - sl.k0 for sl in slots)
            rdt = lambda r: return_dtype(kernel.partial_dtype(dtype), grad_dtype(dtype),  # noqa: E731
                                         block_exclusive(cp, r, chunk, window, steps))
            peers = [(rank + st) % cp for st in steps]
            back = [(kr, rdt(p)) for kr, p in ((key_range(cp, p, rank, chunk, window), p)
                                              for p in peers) if kr is not None]
            self._add_block(n, calls, back, rdt(rank))

    def forward_backward(self):
        """dQ, dK, dV in the inputs' dtype, as ring_backward returns them."""
        grads = super().forward_backward()
        return tuple(g.to(t.dtype) for g, t in zip(grads, (self.q, self.k, self.v)))


class PackedRankSim(_RingRankSim):
    """Rank `rank` of a ring over a PackedLayout: self call plus the ring's blocks (consecutive
    steps coalesced as the library does for `keys` = CP_SOFTCAP_RING_BLOCK_KEYS,
    layout.ring_blocks; doc_geometry.block_plan), with random K/V buffers of the received sizes.
    No communication. As the ring does, each block's dK/dV partials are summed in the dtype the
    rank sends them back in (ring.return_dtype), and the partials the peers return for this
    rank's keys (the ranges doc_geometry.send_ranges gave them) are added into its dK/dV."""

    def __init__(self, kernel, layout, window, hq, hkv, d, dtype, dev, softcap, rank, keys):
        super().__init__(kernel, layout.local_len, hq, hkv, d, dtype, dev, softcap)
        self.self_calls = dgeo.step_calls(layout, rank, rank, window)
        rdt = lambda r, steps: return_dtype(kernel.partial_dtype(dtype), grad_dtype(dtype),  # noqa: E731
                                            dgeo.block_exclusive(layout, r, window, steps))
        for steps in ring_blocks(layout.cp, layout.local_len, keys):
            slots, calls = dgeo.block_plan(layout, rank, window, steps)
            n = sum(sl.size for sl in slots)
            # the peers that received our keys in these steps return their partials for them
            back = [((k0, k1), rdt(p, steps)) for p in ((rank + st) % layout.cp for st in steps)
                    for k0, k1 in dgeo.send_ranges(layout, p, rank, window)]
            if calls or back:
                self._add_block(n, calls, back, rdt(rank, steps))


def packed_full(kernel, cu, seq_len, window, hq, hkv, d, dtype, dev, softcap, backward):
    """The whole packed stream on one device: stream_calls through the same kernel."""
    q = torch.randn(1, seq_len, hq, d, device=dev, dtype=dtype)
    k = torch.randn(1, seq_len, hkv, d, device=dev, dtype=dtype)
    v = torch.randn(1, seq_len, hkv, d, device=dev, dtype=dtype)
    dout, calls, kw = torch.randn_like(q), dgeo.stream_calls(cu, seq_len, window), (kernel, d ** -0.5, softcap)

    def run():
        acc_o, acc_l = new_accumulator(q.shape, v.shape[-1], grad_dtype(dtype), q.device)
        forward_calls(q, k, v, calls, *kw, acc_o, acc_l)
        if backward:
            g, o, dl = kernel.prepare_backward(dout, acc_o, None, dtype)
            acc = [GradAccumulator(t.shape, grad_dtype(dtype), q.device) for t in (q, k, v)]
            backward_calls(g, q, k, v, o, acc_l, dl, calls, *kw, *acc)
            [a.result() for a in acc]
    return run


def profile_packed(a, kernel, lay, window, rank, mode, hq, hkv, d, dtype, dev) -> dict:
    """The busiest rank's device time by kernel next to the full packed call's, and its host
    time: where the rank's time beyond full / cp goes (kernel rate, merges, copies, launches)."""
    sim = PackedRankSim(kernel, lay, window, hq, hkv, d, dtype, dev, a.softcap, rank, a.packed_keys)
    fn = sim.forward if mode == "fwd" else sim.forward_backward
    full_fn = packed_full(kernel, lay.cu_seqlens, lay.seq_len, window, hq, hkv, d, dtype, dev,
                          a.softcap, mode == "fwd+bwd")
    out = dict(profile_rank=rank, profile=profile_top(fn), profile_full=profile_top(full_fn),
               rank_host_ms=host_ms(fn))
    for who, prof in (("rank", out["profile"]), ("full", out["profile_full"])):
        print(f"--- packed {mode}, {who}{' ' + str(rank) if who == 'rank' else ''}: busy "
              f"{prof['busy_ms']:.3f} ms" + (f", host {out['rank_host_ms']:.3f} ms" if who == "rank" else ""))
        for t in prof["top"]:
            print(f"  {t['ms']:8.3f} ms  x{t['calls']:<5g} {t['name']}")
    return out


def run_packed(a, kernel, name, hq, hkv, d, dtype, dev) -> int:
    """--packed: every rank of the packed and the zigzag layout vs the full packed attention.
    The ring's blocks coalesce steps as the library would here (CP_SOFTCAP_RING_BLOCK_KEYS)."""
    from cp_softcap.settings import ring_block_keys
    a.packed_keys = ring_block_keys()
    from benchmarks.packing_balance import fixed_layout, mix
    from cp_softcap.documents import packed_layout
    window = (a.window, 0)
    records, rows = [], [["S", "docs", "cp", "layout", "area ratio", "mode", "max calls",
                          "busiest ms", "full ms", "ratio"]]
    for s in a.seqs:
        cu = tuple(mix(PACKED_MIXES[a.packed], s, 0))
        for cp in a.cps:
            # --both-layers: balanced for Gemma2's two layer kinds at once, as its training does
            kinds = dict(layer_windows=[None, window]) if a.both_layers else dict(window=window)
            layouts = {"packed": packed_layout(cu, s, cp, **kinds),
                       "zigzag": fixed_layout(cu, s, cp, chunks=tuple((r, 2 * cp - 1 - r)
                                                                     for r in range(cp)),
                                              window=window)}
            for m in a.chunks_per_rank:
                layouts[f"packed m={m}"] = packed_layout(cu, s, cp, chunks_per_rank=m, **kinds)
            for lname, lay in layouts.items():
                full = {m: bench_ms(packed_full(kernel, lay.cu_seqlens, lay.seq_len, window, hq,
                                                hkv, d, dtype, dev, a.softcap, m == "fwd+bwd"),
                                    rep_ms=a.rep_ms) for m in ("fwd", "fwd+bwd")}
                per = {m: [] for m in full}
                calls = []
                for r in range(cp):
                    sim = PackedRankSim(kernel, lay, window, hq, hkv, d, dtype, dev, a.softcap, r,
                                        a.packed_keys)
                    calls.append(sim.calls)
                    for m in full:
                        per[m].append(bench_ms(sim.forward if m == "fwd" else sim.forward_backward,
                                               rep_ms=a.rep_ms))
                    del sim
                    if dev == "cuda":
                        torch.cuda.empty_cache()
                for m in full:
                    busiest = max(per[m])
                    ratio = busiest * cp / full[m]
                    records.append(dict(S=s, seq_len=lay.seq_len, docs=len(cu) - 1, cp=cp,
                                        mix=a.packed, layout=lname, mode=m, kernel=name,
                                        window=a.window, area_ratio=lay.imbalance,
                                        chunks_per_rank=lay.chunks_per_rank, calls=calls,
                                        rank_ms=per[m], busiest_ms=busiest, full_ms=full[m],
                                        ideal_ms=full[m] / cp, ratio=ratio))
                    if a.profile and lname == "packed":
                        records[-1].update(profile_packed(a, kernel, lay, window, per[m].index(busiest),
                                                          m, hq, hkv, d, dtype, dev))
                    rows.append([s, len(cu) - 1, cp, lname, f"{lay.imbalance:.3f}", m, max(calls),
                                 f"{busiest:.3f}", f"{full[m]:.3f}", f"{ratio:.3f}"])
    meta = dict(kernel=name, heads=[hq, hkv, d], softcap=a.softcap, dtype=str(dtype), batch=1,
                window=a.window, mix=a.packed, seed=0, block_keys=a.packed_keys,
                ratio="busiest rank time / (full packed attention time / cp), same kernel, "
                      "no communication")
    stem = f"cp_sim_packed_{a.packed}" + (f"_{a.tag}" if a.tag else "")
    path = save(stem, records, meta, a.out_dir)
    try:
        plot_json(path)
    except Exception as e:          # the plot helper knows the unpacked records; JSON is the result
        print(f"plot skipped: {type(e).__name__}: {e}")
    print(table(rows))
    print(f"wrote {path}")
    return 0


class AllGatherRankSim:
    """One rank of the all-gather comm (cp_softcap.cp.all_gather) on random tensors, its work
    shaped three ways (no communication; K/V already gathered in two halves as there):
      two      what the library runs: one kernel call per local query chunk over its visible
               key prefix (a range straddling the halves concatenated), in one stream;
      streams  the same two calls, the first chunk's on a second CUDA stream, so that one
               call's tail runs beside the other's work;
      one      both chunks as ONE varlen call (two segments, causal bottom-right per segment)
               over a buffer holding both key prefixes back to back (a copy of both)."""

    def __init__(self, kernel, s, cp, rank, hq, hkv, d, dtype, dev, softcap, window, how):
        from cp_softcap.kernels.base import Segments
        from cp_softcap.cp.all_gather import _chunk_calls
        self.kernel, self.how, self.kw = kernel, how, dict(scale=d ** -0.5, softcap=softcap)
        c = s // (2 * cp)
        rnd = lambda n, h: torch.randn(1, n, h, d, device=dev, dtype=dtype)   # noqa: E731
        self.q, self.dout = rnd(2 * c, hq), rnd(2 * c, hq)
        self.halves = [(rnd(s // 2, hkv), rnd(s // 2, hkv)) for _ in range(2)]
        self.mid, self.total = s // 2, s
        self.calls = [(row + q0, row + q1, k0, k1, w) for row, call in _chunk_calls(cp, rank, c, window)
                      if call is not None for q0, q1, k0, k1, w in (call,)]
        if how == "one":
            wins = {tuple(w) for *_, w in self.calls}
            if len(self.calls) != 2 or len(wins) != 1:
                raise ValueError(f"one varlen call needs both chunks with one local window, got "
                                 f"{self.calls}")
            n = [k1 - k0 for _, _, k0, k1, _ in self.calls]
            self.segments = Segments((0, self.calls[0][1] - self.calls[0][0],
                                      self.calls[1][1] - self.calls[1][0] + self.calls[0][1]
                                      - self.calls[0][0]), (0, n[0], n[0] + n[1]))
            self.window = self.calls[0][4]
        self.side = torch.cuda.Stream() if dev == "cuda" and how == "streams" else None

    def _keys(self, k0, k1):
        from cp_softcap.cp.all_gather import key_range
        return key_range(self.halves.__getitem__, self.mid, k0, k1)

    def _one_buffer(self):
        parts = [self._keys(k0, k1) for _, _, k0, k1, _ in self.calls]
        return torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1)

    def forward(self):
        kern, q = self.kernel, self.q
        if self.how == "one":
            ks, vs = self._one_buffer()
            return kern.forward(q, ks, vs, window=self.window, segments=self.segments, **self.kw)
        res = []
        for i, (q0, q1, k0, k1, w) in enumerate(self.calls):
            ks, vs = self._keys(k0, k1)
            if self.side is not None and i == 0:
                self.side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.side):
                    res.append(kern.forward(q[:, q0:q1], ks, vs, window=w, **self.kw))
            else:
                res.append(kern.forward(q[:, q0:q1], ks, vs, window=w, **self.kw))
        if self.side is not None:
            torch.cuda.current_stream().wait_stream(self.side)
        out = torch.cat([r[0] for r in res], dim=1)
        return out, torch.cat([r[1] for r in res], dim=2)

    def forward_backward(self):
        kern, q, kw = self.kernel, self.q, self.kw
        out, lse = self.forward()
        dout, out, dlse = kern.prepare_backward(self.dout, out, None, q.dtype)
        gdt = grad_dtype(q.dtype)
        shape = (1, self.total) + tuple(self.halves[0][0].shape[2:])
        dk, dv = GradAccumulator(shape, gdt, q.device), GradAccumulator(shape, gdt, q.device)
        if self.how == "one":
            ks, vs = self._one_buffer()
            gq, gk, gv = kern.backward(dout, q, ks, vs, out, lse, window=self.window, dlse=dlse,
                                       segments=self.segments, **kw)
            off = 0
            for _, _, k0, k1, _ in self.calls:
                dk.add(k0, k1, gk[:, off:off + k1 - k0])
                dv.add(k0, k1, gv[:, off:off + k1 - k0])
                off += k1 - k0
            return gq, dk.result(), dv.result()
        dq = GradAccumulator(q.shape, kern.partial_dtype(q.dtype), q.device)
        parts = []
        for i, (q0, q1, k0, k1, w) in enumerate(self.calls):
            ks, vs = self._keys(k0, k1)
            args = (dout[:, q0:q1], q[:, q0:q1], ks, vs, out[:, q0:q1], lse[:, :, q0:q1])
            if self.side is not None and i == 0:
                self.side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.side):
                    parts.append(kern.backward(*args, window=w, dlse=None, **kw))
            else:
                parts.append(kern.backward(*args, window=w, dlse=None, **kw))
        if self.side is not None:
            torch.cuda.current_stream().wait_stream(self.side)
        for (q0, q1, k0, k1, _), (gq, gk, gv) in zip(self.calls, parts):
            dq.add(q0, q1, gq)
            dk.add(k0, k1, gk)
            dv.add(k0, k1, gv)
        return dq.result(), dk.result(), dv.result()


def run_all_gather(a, kernel, name, hq, hkv, d, dtype, dev) -> int:
    """--all-gather: the all-gather rank's work shaped as AllGatherRankSim's variants, each
    against the full causal call (same kernel, same run): ratio = rank time * cp / full."""
    window = (a.window, 0)
    records, rows = [], [["S", "cp", "rank", "shape", "mode", "rank ms", "full ms", "ratio"]]
    for s in a.seqs:
        full = {m: bench_ms(full_attention(kernel, s, hq, hkv, d, dtype, dev, a.softcap, window,
                                           m == "fwd+bwd"), rep_ms=a.rep_ms)
                for m in ("fwd", "fwd+bwd")}
        for cp in a.cps:
            for how in ("two", "streams", "one"):
                try:
                    sim = AllGatherRankSim(kernel, s, cp, a.rank % cp, hq, hkv, d, dtype, dev,
                                           a.softcap, window, how)
                    for mode in ("fwd", "fwd+bwd"):
                        ms = bench_ms(sim.forward if mode == "fwd" else sim.forward_backward,
                                      rep_ms=a.rep_ms)
                        records.append(dict(S=s, cp=cp, rank=a.rank % cp, shape=how, mode=mode,
                                            kernel=name, window=a.window, rank_ms=ms,
                                            full_ms=full[mode], ratio=ms * cp / full[mode]))
                        rows.append([s, cp, a.rank % cp, how, mode, f"{ms:.3f}",
                                     f"{full[mode]:.3f}", f"{ms * cp / full[mode]:.3f}"])
                    del sim
                except (RuntimeError, ValueError, NotImplementedError) as e:
                    records.append(dict(S=s, cp=cp, shape=how, kernel=name,
                                        error=f"{type(e).__name__}: {str(e)[:300]}"))
                    rows.append([s, cp, a.rank % cp, how, "error", str(e)[:50], "", ""])
                if dev == "cuda":
                    torch.cuda.empty_cache()
    meta = dict(kernel=name, heads=[hq, hkv, d], softcap=a.softcap, dtype=str(dtype), batch=1,
                window=a.window, comm="all_gather",
                ratio="rank time * cp / full causal attention time (same kernel), no communication")
    path = save("cp_sim_all_gather" + (f"_{a.tag}" if a.tag else ""), records, meta, a.out_dir)
    print(table(rows))
    print(f"wrote {path}")
    return 0


def graphed(fn):
    """Capture fn() into a CUDA graph (after two warm-up calls on a side stream); returns replay.
    Shows the ring's GPU work without per-call Python/launch overhead."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def host_ms(fn, n: int = 10) -> float:
    """Host-side milliseconds per fn() call (issue time, no sync inside the loop)."""
    import time
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (t1 - t0) * 1e3 / n


def profile_top(fn, n: int = 3, top: int = 10) -> dict:
    """Device time per fn() call by kernel (torch.profiler), busiest first: where the rank's
    time goes. busy_ms = summed kernel time, to compare with the wall time of one call."""
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available()
    fn()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            fn()
        if cuda:
            torch.cuda.synchronize()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    kernels = sorted(((getattr(e, attr) / n / 1e3, e.count / n, e.key[:100])
                      for e in prof.key_averages() if getattr(e, attr) > 0), reverse=True)
    return dict(busy_ms=sum(k[0] for k in kernels),
                top=[dict(ms=ms, calls=c, name=name) for ms, c, name in kernels[:top]])


def full_attention(kernel, s, hq, hkv, d, dtype, dev, softcap, window, backward):
    q = torch.randn(1, s, hq, d, device=dev, dtype=dtype)
    k = torch.randn(1, s, hkv, d, device=dev, dtype=dtype)
    v = torch.randn(1, s, hkv, d, device=dev, dtype=dtype)
    dout, kw = torch.randn_like(q), dict(scale=d ** -0.5, softcap=softcap, window=window)

    def run():
        out, lse = kernel.forward(q, k, v, **kw)
        if backward:
            kernel.backward(dout, q, k, v, out, lse, **kw)
    return run


PIECE_KEYS = 4096


def per_call(sim, kernel, s, hq, d, softcap, window, rep_ms) -> list:
    """Each of the rank's kernel calls timed alone (forward, and forward + backward with the
    final O/LSE of its rows), as TFLOP/s of its visible area, next to the full causal call: which
    call shapes run below the full-length rate."""
    from benchmarks._util import causal_fwd_flops
    q, kw = sim.q, dict(scale=d ** -0.5, softcap=softcap)
    out = []
    calls = [("self", sim.k, sim.v, c) for c in sim.self_calls]
    calls += [(f"block {i}", kb, vb, c) for i, (kb, vb, cs, *_) in enumerate(sim.blocks) for c in cs]
    full_q = torch.randn(1, s, hq, d, device=q.device, dtype=q.dtype)
    full_k = torch.randn(1, s, sim.k.shape[2], d, device=q.device, dtype=q.dtype)
    calls.append(("full", full_k, full_k, PairCall(0, s, 0, s, window)))
    # A fully visible call once more with a right bound past its last key: the same attention, but
    # flash-attn-4 then takes its windowed ("local") backward tiles; at head dim 128 on sm90 its
    # non-causal backward uses other tiles (80 query rows, dQ swapAB). Which is faster?
    calls += [(f"{w} as local", kb, vb, PairCall(c.q0, c.q1, c.k0, c.k1,
                                                (None, max(c.q1 - c.q0, c.k1 - c.k0))))
              for w, kb, vb, c in calls if tuple(c.window) == (None, None)]
    # ... and its backward as key pieces of PIECE_KEYS run one after the other (with the rows'
    # final O/LSE, as the ring runs blocks): in one call every key block's CTA adds into the same
    # dQ rows in the same order; if that contention is what slows it, pieces are faster.
    calls += [(f"{w} in pieces", kb, vb, c) for w, kb, vb, c in calls
              if tuple(c.window) == (None, None) and c.k1 - c.k0 >= 2 * PIECE_KEYS]
    for where, kb, vb, c in calls:
        qs = full_q if where == "full" else q[:, c.q0:c.q1]
        ks, vs = kb[:, c.k0:c.k1], vb[:, c.k0:c.k1]
        res = kernel.forward(qs, ks, vs, window=c.window, **kw)
        dout = torch.randn_like(qs)
        area = (causal_fwd_flops(1, hq, s, d) / (4.0 * hq * d) if where == "full"
                else c.area())
        flops = 4.0 * hq * d * area
        fwd = bench_ms(lambda: kernel.forward(qs, ks, vs, window=c.window, **kw), rep_ms=rep_ms)
        pieces = ([(a, min(a + PIECE_KEYS, c.k1 - c.k0)) for a in range(0, c.k1 - c.k0, PIECE_KEYS)]
                  if where.endswith(" in pieces") else [(0, c.k1 - c.k0)])
        bwd = bench_ms(lambda: [kernel.backward(dout, qs, ks[:, a:b], vs[:, a:b], res[0], res[1],
                                                window=c.window, **kw) for a, b in pieces],
                       rep_ms=rep_ms)
        out.append(dict(where=where, rows=c.q1 - c.q0, keys=c.k1 - c.k0, window=list(c.window),
                        area=area, fwd_ms=fwd, bwd_ms=bwd, fwd_tflops=flops / fwd / 1e9,
                        bwd_tflops=2.5 * flops / bwd / 1e9))
        r = out[-1]
        print(f"  {where:<18} {r['rows']:>6} x {r['keys']:<6} window {str(c.window):<14} "
              f"fwd {fwd:7.3f} ms {r['fwd_tflops']:5.0f} TF/s   bwd {bwd:7.3f} ms {r['bwd_tflops']:5.0f} TF/s")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--cps", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--block-keys", type=int, nargs="+", default=[0, 16384, 32768],
                   help="CP_SOFTCAP_RING_BLOCK_KEYS values to compare (0 = one step per call)")
    p.add_argument("--heads", type=int, nargs=3, default=[16, 8, 256], metavar=("HQ", "HKV", "D"))
    p.add_argument("--softcap", type=float, default=50.0)
    p.add_argument("--window", type=int, default=None, help="sliding window left size (causal)")
    p.add_argument("--rank", type=int, default=0, help="which ring rank to simulate")
    p.add_argument("--kernel", default="auto", help="fa4 | flex | ... | auto (selector)")
    p.add_argument("--rep-ms", type=int, default=300)
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    p.add_argument("--graph", action="store_true",
                   help="also time a CUDA-graph replay of the rank's work (no host overhead)")
    p.add_argument("--profile", action="store_true",
                   help="also record device time by kernel (torch.profiler) per row")
    p.add_argument("--tag", default="", help="suffix of the output files: cp_sim_<tag>.json")
    p.add_argument("--chunks-per-rank", type=int, nargs="*", default=[],
                   help="--packed: also the library's layout with these chunks per rank")
    p.add_argument("--both-layers", action="store_true",
                   help="--packed: layouts balanced for causal and --window layers at once")
    p.add_argument("--packed", choices=sorted(PACKED_MIXES), default=None,
                   help="simulate a packed stream of this document-length mix (every rank)")
    p.add_argument("--per-call", action="store_true",
                   help="also time each of the rank's kernel calls alone (TFLOP/s per call shape)")
    p.add_argument("--streams", action="store_true",
                   help="also time the rank with its self call's backward on a second CUDA stream")
    p.add_argument("--all-gather", action="store_true",
                   help="the all-gather rank's work as two calls, two streams, or one varlen call")
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    hq, hkv, d = a.heads
    a.out_dir = out_dir_for(a.out_dir, dry=a.dry_run or dev == "cpu")
    if a.dry_run or dev == "cpu":
        a.seqs, a.cps, (hq, hkv, d), a.rep_ms = [512], [2, 4], (4, 2, 32), 10
        a.block_keys = [0, 256]
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    window = (a.window, 0)
    spec = make_spec(head_dim=d, num_heads=hq, num_kv_heads=hkv, dtype=dtype, device_type=dev,
                     softcap=a.softcap, causal=True, window=window, cp_size=max(a.cps))
    name = select(spec, a.kernel).name if dev == "cuda" or a.kernel != "auto" else "torch"
    kernel = get_kernel(name)
    if a.packed:
        return run_packed(a, kernel, name, hq, hkv, d, dtype, dev)
    if a.all_gather:
        return run_all_gather(a, kernel, name, hq, hkv, d, dtype, dev)
    records, rows = [], [["S", "cp", "block keys", "calls", "mode", "rank ms", "host ms",
                          "full ms", "ratio", "graph ratio"]]
    for s in a.seqs:
        full = {m: bench_ms(full_attention(kernel, s, hq, hkv, d, dtype, dev, a.softcap, window,
                                           m == "fwd+bwd"), rep_ms=a.rep_ms)
                for m in ("fwd", "fwd+bwd")}
        for cp in a.cps:
            for keys in a.block_keys:
                sim = RankSim(kernel, s, cp, hq, hkv, d, dtype, dev, a.softcap, window, keys,
                              a.rank % cp)
                for mode in ("fwd", "fwd+bwd"):
                    fn = sim.forward if mode == "fwd" else sim.forward_backward
                    ms = bench_ms(fn, rep_ms=a.rep_ms)
                    ratio = ms * cp / full[mode]
                    rec = dict(S=s, cp=cp, block_keys=keys, calls=sim.calls, mode=mode,
                               kernel=name, rank=a.rank % cp, window=a.window, rank_ms=ms,
                               full_ms=full[mode], ratio=ratio, rank_host_ms=host_ms(fn))
                    g_txt = ""
                    if a.graph and dev == "cuda":
                        try:
                            ms_g = bench_ms(graphed(fn), rep_ms=a.rep_ms)
                            rec.update(rank_graph_ms=ms_g, ratio_graph=ms_g * cp / full[mode])
                            g_txt = f"{ms_g * cp / full[mode]:.3f}"
                        except Exception as e:
                            rec["graph_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                            g_txt = "ERR"
                    if a.profile:
                        rec["profile"] = prof = profile_top(fn)
                        print(f"--- S={s} cp={cp} keys={keys} {mode}: busy {prof['busy_ms']:.3f} ms"
                              f" of {ms:.3f} ms")
                        for t in prof["top"]:
                            print(f"  {t['ms']:8.3f} ms  x{t['calls']:<5g} {t['name']}")
                    if a.streams and dev == "cuda" and mode == "fwd+bwd":
                        sim.side = torch.cuda.Stream()
                        ms_s = bench_ms(fn, rep_ms=a.rep_ms)
                        sim.side = None
                        rec.update(rank_streams_ms=ms_s, ratio_streams=ms_s * cp / full[mode])
                        g_txt += f" streams {ms_s * cp / full[mode]:.3f}"
                    records.append(rec)
                    rows.append([s, cp, keys, sim.calls, mode, f"{ms:.3f}",
                                 f"{rec['rank_host_ms']:.3f}", f"{full[mode]:.3f}",
                                 f"{ratio:.3f}", g_txt])
                if a.per_call:
                    print(f"--- per call: S={s} cp={cp} keys={keys} rank {a.rank % cp}")
                    records.append(dict(S=s, cp=cp, block_keys=keys, mode="per-call", kernel=name,
                                        calls=per_call(sim, kernel, s, hq, d, a.softcap, window,
                                                       a.rep_ms)))
                del sim
                if dev == "cuda":
                    torch.cuda.empty_cache()
    meta = dict(kernel=name, heads=[hq, hkv, d], softcap=a.softcap, dtype=str(dtype), batch=1,
                window=a.window, rank=a.rank,
                ratio="rank time * cp / full causal attention time (same kernel), no communication")
    report("cp_sim", records, meta, rows, a.out_dir, a.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
