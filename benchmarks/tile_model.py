"""A MODEL, not a measurement: where FA4's time goes on the call shapes that run below the
long-call rate (a ring rank's short calls, packed short documents), fitted to H100 records.

    python benchmarks/tile_model.py            # fit on the H100 records, write tile_model.json
    python benchmarks/tile_model.py --dry-run  # the same arithmetic into $OUT or a temp folder

FA4 (flash-attn-4 4.0.0b36) on sm90, as its interface.py sets it up for these calls: one CTA
per tile, handed to whichever SM frees up, in the scheduler's order (varlen: document after
document; dense causal: longest first). Tile sizes (_tile_size_fwd_sm90 / _tile_size_bwd_sm90):
head dim 256: forward 128 x 80 (query rows x keys), backward 64 x 48; head dim 128: forward
128 x 128, backward 64 x 128 (its causal or local tile: the library passes a fully visible
call at this head dim as a windowed one, kernels/fa4.tile_window). The forward packs the query
heads of a KV group into the tile's rows (pack_gqa, FA4's default for GQA: 128 rows = 64 tokens
of both heads); the backward runs one query head per CTA (FA4 has no pack_gqa in backward).
  forward   CTA = (query tile, KV head); it loops over the key tiles its rows can see
  backward  CTA = (key tile, query head); it loops over the query tiles that can see its keys
A CTA costs (loop + beta) tile steps: beta is its fixed cost (prologue, epilogue, pipeline fill
and drain) in steps. A call's time = alpha x makespan of its CTAs over 132 SMs (one CTA per SM
at these tile sizes) + for the backward its memory passes at --hbm-gbs (FA4's pre- and
post-processing over every token: O and dO read, the float32 dQ accumulator and, under GQA, the
float32 dK/dV accumulators written, read and converted). alpha (ms per step) and beta are
fitted per head shape and direction to the H100 records (least squares on relative error):
  9B heads   packed_kernels_9b_h100.json: FA4's varlen function alone on the long-tail and
             short-document 128K streams (two shapes: an exact fit, no check)
  27B heads  cp_sim_percall_27b.json: a ring rank's calls timed alone, 32K cp 8 (self causal
             4096, 2048 x 28672 full, the same as a local call) and the full 32K causal call
             (four shapes: the fit's residuals say how far the model holds)
Each case's time then splits into: useful work (the visible pairs' steps), steps wasted on
tile edges (masked parts of computed tiles), CTA fixed cost, idle SMs at the end (the tail),
and the backward's memory passes. The what-ifs (documents sorted longest first, no CTA fixed
cost, no memory passes) say which of these a change could recover.

Writes <out>/tile_model.json (benchmarks/results/ for a real run).
"""
from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import sys
from typing import Dict, List, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._util import OUT_DIR_HELP, RESULTS, out_dir_for, save, table   # noqa: E402
from benchmarks.packing_balance import mix                                    # noqa: E402

SMS = 132                               # H100 SXM
HEADS = {"9B": (16, 8, 256), "27B": (32, 16, 128)}
# (rows, keys) per tile: forward, backward
TILES = {256: ((128, 80), (64, 48)), 128: ((128, 128), (64, 128))}


class Call:
    """One kernel call: `segments` of (query tokens, keys >= queries, causal) with bottom-right
    causal alignment (a query sees the keys up to its own position + keys - queries), or full."""

    def __init__(self, name: str, segments: Sequence[Tuple[int, int, bool]], varlen: bool):
        self.name, self.segments, self.varlen = name, list(segments), varlen

    def area(self) -> int:
        """Visible (query token, key) pairs."""
        return sum(sq * sk - (sq * (sq - 1) // 2 if causal else 0) for sq, sk, causal in self.segments)

    def tokens(self) -> Tuple[int, int]:
        return sum(s[0] for s in self.segments), sum(s[1] for s in self.segments)


def _visible_keys(row_end: int, sq: int, sk: int, causal: bool) -> int:
    """Keys visible to query rows [.., row_end) of a segment (bottom-right causal)."""
    return min(sk, row_end + sk - sq) if causal else sk


def forward_ctas(call: Call, hq: int, hkv: int, d: int) -> List[int]:
    """Loop length (key tiles) of each forward CTA, in the scheduler's order."""
    tm, tn = TILES[d][0]
    tok = tm // (hq // hkv)                         # pack_gqa: tokens per tile of rows
    loops = []
    for sq, sk, causal in call.segments:
        per_head = [math.ceil(_visible_keys(min(sq, (i + 1) * tok), sq, sk, causal) / tn)
                    for i in range(math.ceil(sq / tok))]
        if not call.varlen:
            per_head.sort(reverse=True)             # dense causal: longest tiles first (LPT)
        loops += per_head * hkv
    return loops


def backward_ctas(call: Call, hq: int, d: int) -> List[int]:
    """Loop length (query tiles) of each backward CTA, in the scheduler's order."""
    loops = []
    tm, tn = TILES[d][1]
    for sq, sk, causal in call.segments:
        per_head = []
        for j in range(math.ceil(sk / tn)):
            first_row = max(0, j * tn - (sk - sq)) if causal else 0   # first query seeing key tile j
            per_head.append(max(0, math.ceil(sq / tm) - first_row // tm))
        if not call.varlen:
            per_head.sort(reverse=True)
        loops += per_head * hq
    return loops


def makespan(loops: Sequence[int], beta: float, sms: int = SMS) -> float:
    """Greedy list scheduling in order (a CTA starts on the first SM that frees up), in steps."""
    free = [0.0] * sms
    for n in loops:
        t = heapq.heappop(free)
        heapq.heappush(free, t + n + beta)
    return max(free)


def memory_ms(call: Call, hq: int, hkv: int, d: int, gbs: float) -> float:
    """The backward's passes over every token, at gbs GB/s: preprocess reads O and dO (bf16) and
    writes the float32 dQ accumulator, postprocess reads it and writes dQ; under GQA the float32
    dK/dV accumulators are zeroed, read and written back as bf16."""
    rows, keys = call.tokens()
    per_row = hq * d * (2 + 2 + 4 + 4 + 2)
    per_key = 2 * hkv * d * (4 + 4 + 2) if hq > hkv else 0
    return (rows * per_row + keys * per_key) / (gbs * 1e6)


def shapes(call: Call, hq: int, hkv: int, d: int, mode: str) -> Dict:
    loops = forward_ctas(call, hq, hkv, d) if mode == "fwd" else backward_ctas(call, hq, d)
    tm, tn = TILES[d][0] if mode == "fwd" else TILES[d][1]
    useful = call.area() * hq / (tm * tn)           # steps the visible pairs fill exactly
    return dict(loops=loops, ctas=len(loops), steps=sum(loops), useful_steps=useful,
                mean_loop=sum(loops) / max(1, len(loops)))


def predict(call, hq, hkv, d, mode, alpha, beta, gbs, sms=SMS) -> Dict:
    s = shapes(call, hq, hkv, d, mode)
    span = makespan(s["loops"], beta, sms)
    mem = memory_ms(call, hq, hkv, d, gbs) if mode == "bwd" else 0.0
    ms = alpha * span + mem
    busy = s["steps"] + beta * s["ctas"]
    parts = dict(useful=alpha * s["useful_steps"] / sms, edges=alpha * (s["steps"] - s["useful_steps"]) / sms,
                 cta_fixed=alpha * beta * s["ctas"] / sms, tail=alpha * (span - busy / sms), memory=mem)
    return dict(ms=ms, ctas=s["ctas"], mean_loop=s["mean_loop"],
                share={k: v / ms for k, v in parts.items()})


def fit(cases, hq, hkv, d, mode, gbs) -> Tuple[float, float]:
    """alpha, beta minimising the squared relative errors over cases [(call, measured_ms)]."""
    best = None
    for beta in [b / 4 for b in range(0, 81)]:          # 0 .. 20 steps
        spans = [(makespan(shapes(c, hq, hkv, d, mode)["loops"], beta),
                  memory_ms(c, hq, hkv, d, gbs) if mode == "bwd" else 0.0, ms) for c, ms in cases]
        # relative error r_i = (alpha * span_i + mem_i) / ms_i - 1: least squares in alpha
        num = sum(sp / ms * (1 - mem / ms) for sp, mem, ms in spans)
        den = sum((sp / ms) ** 2 for sp, _, ms in spans)
        alpha = num / den
        err = sum(((alpha * sp + mem) / ms - 1) ** 2 for sp, mem, ms in spans)
        if best is None or err < best[0]:
            best = (err, alpha, beta)
    return best[1], best[2]


def packed_call(kind: str, total: int, order: str = "stream") -> Call:
    cu = mix(kind, total, 0)
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    if order == "longest first":
        lengths.sort(reverse=True)
    return Call(f"packed {kind}" + ("" if order == "stream" else f", {order}"),
                [(n, n, True) for n in lengths], varlen=True)


def ring_rank(s: int, cp: int, rank: int = 0) -> Tuple[List[Call], Call]:
    """A causal zigzag ring rank's kernel calls at one ring block (cp_softcap.layout: its self
    call, then its block's calls over the received keys), and the same work as ONE varlen call:
    each local query chunk over its whole visible key range, the rank's own keys last
    (bottom-right causal), as the all-gather comm's rows see them."""
    from cp_softcap.layout import block_plan, plan_step, ring_blocks
    c = s // (2 * cp)
    pairs = list(plan_step(cp, rank, rank, c, (None, 0)))
    for steps in ring_blocks(cp, 2 * c, s):
        pairs += block_plan(cp, rank, c, (None, 0), steps)[1]
    calls = [Call(f"{p.q1 - p.q0} x {p.k1 - p.k0}", [(p.q1 - p.q0, p.k1 - p.k0, p.window == (None, 0))],
                  varlen=False) for p in pairs]
    chunks = (rank, 2 * cp - 1 - rank)             # global chunks of the two local query chunks
    one = Call("one varlen call", [(c, (g + 1) * c, True) for g in chunks], varlen=True)
    return calls, one


def _records(name: str) -> List[Dict]:
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)["records"]


def measured_9b() -> List[Tuple[Call, Dict[str, float]]]:
    """FA4's varlen function alone (kernel 'fa4-kernel') on the 128K streams, H100."""
    out = []
    recs = _records("packed_kernels_9b_h100.json")
    for kind in ("long-tail", "short"):
        ms = {r["mode"]: r["ms"] for r in recs if r["mix"] == kind and r["kernel"] == "fa4-kernel"}
        out.append((packed_call(kind, 131072), dict(fwd=ms["fwd"], bwd=ms["fwd+bwd"] - ms["fwd"])))
    return out


def measured_27b() -> List[Tuple[Call, Dict[str, float]]]:
    """A 32K cp 8 ring rank's calls timed alone and the full causal call, H100."""
    calls = next(r["calls"] for r in _records("cp_sim_percall_27b.json") if r["mode"] == "per-call")
    out = []
    for c in calls:
        if c["where"].endswith("in pieces"):
            continue                    # several calls back to back, not one call
        causal = c["window"] == [None, 0]      # else fully visible (a right bound past the keys)
        call = Call(c["where"], [(c["rows"], c["keys"], causal)], varlen=False)
        out.append((call, dict(fwd=c["fwd_ms"], bwd=c["bwd_ms"])))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hbm-gbs", type=float, default=3000.0,
                   help="memory bandwidth of the backward's passes, GB/s (H100 HBM3: 3350 peak)")
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    p.add_argument("--dry-run", action="store_true",
                   help="the same arithmetic, written to $OUT or a temporary folder")
    a = p.parse_args(argv)
    records, rows = [], [["heads", "call", "mode", "measured ms", "model ms", "CTAs", "loop",
                          "useful", "edges", "CTA fixed", "tail", "memory"]]
    fitted = {}
    for model, measured in (("9B", measured_9b()), ("27B", measured_27b())):
        hq, hkv, d = HEADS[model]
        for mode in ("fwd", "bwd"):
            cases = [(c, ms[mode]) for c, ms in measured]
            alpha, beta = fit(cases, hq, hkv, d, mode, a.hbm_gbs)
            fitted[(model, mode)] = (alpha, beta)
            for call, ms in cases:
                pr = predict(call, hq, hkv, d, mode, alpha, beta, a.hbm_gbs)
                records.append(dict(model=model, call=call.name, mode=mode, measured_ms=ms,
                                    model_ms=pr["ms"], rel_err=pr["ms"] / ms - 1, ctas=pr["ctas"],
                                    mean_loop=pr["mean_loop"], alpha_ms=alpha, beta_steps=beta,
                                    kind="fit", **{f"share_{k}": v for k, v in pr["share"].items()}))
                rows.append([model, call.name, mode, f"{ms:.3f}", f"{pr['ms']:.3f}", pr["ctas"],
                             f"{pr['mean_loop']:.1f}"] + [f"{v:.0%}" for v in pr["share"].values()])
    # what-ifs on the 9B short-document stream: what each change could recover
    hq, hkv, d = HEADS["9B"]
    base = packed_call("short", 131072)
    variants = [("as measured", base, None), ("documents longest first", packed_call("short", 131072, "longest first"), None),
                ("no CTA fixed cost", base, "beta0"), ("no memory passes", base, "mem0")]
    for label, call, change in variants:
        total = 0.0
        for mode in ("fwd", "bwd"):
            alpha, beta = fitted[("9B", mode)]
            pr = predict(call, hq, hkv, d, mode, alpha, 0.0 if change == "beta0" else beta,
                         math.inf if change == "mem0" else a.hbm_gbs)
            total += pr["ms"]
        records.append(dict(model="9B", call="packed short", mode="fwd+bwd", what_if=label,
                            model_ms=total, kind="what-if"))
        rows.append(["9B", f"short: {label}", "fwd+bwd", "", f"{total:.3f}", "", "", "", "", "", "", ""])
    # a 32K cp 8 ring rank: its calls as the library makes them, and as one varlen call,
    # rank time x cp / the full causal call (both predicted); cp_sim measured the first (27B)
    for model in ("9B", "27B"):
        hq, hkv, d = HEADS[model]
        calls, one = ring_rank(32768, 8)
        full = Call("full", [(32768, 32768, True)], varlen=False)
        for label, shape in (("library calls", calls), ("one varlen call", [one])):
            pred = {}
            for mode in ("fwd", "bwd"):
                alpha, beta = fitted[(model, mode)]
                rank_ms = sum(predict(c, hq, hkv, d, mode, alpha, beta, a.hbm_gbs)["ms"] for c in shape)
                pred[mode] = (rank_ms, predict(full, hq, hkv, d, mode, alpha, beta, a.hbm_gbs)["ms"])
            ratio = {"fwd": pred["fwd"][0] * 8 / pred["fwd"][1],
                     "fwd+bwd": (pred["fwd"][0] + pred["bwd"][0]) * 8 / (pred["fwd"][1] + pred["bwd"][1])}
            for mode, r in ratio.items():
                records.append(dict(model=model, call=f"ring rank 32K cp 8: {label}", mode=mode,
                                    ratio=r, kind="ring rank"))
            rows.append([model, f"ring rank 32K cp 8: {label}", "ratio", "", f"{ratio['fwd']:.3f} / "
                         f"{ratio['fwd+bwd']:.3f}", "", "", "", "", "", "", ""])
    # measured, no model: the 27B rank's time outside its kernel calls (merges, accumulators,
    # casts, the adds of returned partials) = cp_sim's rank time - its calls timed alone
    recs = _records("cp_sim_percall_27b.json")
    rank_ms = next(r["rank_ms"] for r in recs if r["mode"] == "fwd+bwd")
    calls = next(r["calls"] for r in recs if r["mode"] == "per-call")
    kernels = sum(c["fwd_ms"] + c["bwd_ms"] for c in calls if c["where"] in ("self", "block 0"))
    records.append(dict(model="27B", call="ring rank 32K cp 8", mode="fwd+bwd", kind="measured split",
                        rank_ms=rank_ms, kernel_calls_ms=kernels, other_ms=rank_ms - kernels,
                        other_share=(rank_ms - kernels) / rank_ms))
    rows.append(["27B", "ring rank 32K cp 8: outside the kernels", "fwd+bwd", f"{rank_ms:.3f}",
                 f"{rank_ms - kernels:.3f}", "", "", "", "", "", "", ""])
    meta = dict(sms=SMS, hbm_gbs=a.hbm_gbs, tiles={str(k): v for k, v in TILES.items()},
                kernel="flash-attn-4 4.0.0b36 on sm90 (tile sizes from its interface.py)",
                inputs=["packed_kernels_9b_h100.json", "cp_sim_percall_27b.json"],
                note="a model fitted to H100 records, not a measurement")
    path = save("tile_model", records, meta, out_dir_for(a.out_dir, a.dry_run))
    print(table(rows))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
