"""Load balance of packed documents under context parallelism: busiest rank's attention area over
the mean, per layout, for realistic document-length mixes. Host arithmetic only (no kernels).

    python benchmarks/packing_balance.py             # 128K stream, cp 2/4/8/16, 3 seeds per mix
    python benchmarks/packing_balance.py --dry-run   # 8K stream, cp 2/4, 1 seed: checks the script

Area = visible (query, key) pairs of a rank's queries: same document, causal (and the window
when given), i.e. the work a rank does whatever the comm type; the busiest rank sets the step
time. Layouts:
  packed      cp_softcap.documents.packed_layout (the library's): cp*m equal chunks assigned by
              area, m chosen by the library; also each fixed m of CHUNK_CHOICES, to show what
              more chunks buy (balance) and cost (kernel calls, messages)
  zigzag      whole-stream zigzag (2cp chunks, rank r holds r and 2cp-1-r), no per-document padding
  head-tail   per-document zigzag (TransformerEngine / torch's per-document load balancer): every
              document padded to a multiple of 2cp and split into 2cp chunks; its padding % is
              the tokens it adds (padding computes nothing here, so its area ratio is optimistic)
  contiguous  cp equal contiguous pieces
Padding % = tokens a layout adds / stream tokens. Calls / messages / K/V tokens received: per
rank per forward for a ring over that layout (doc_geometry.step_calls / send_ranges), the
busiest rank's count; the per-document head-tail layout is not expressible as equal chunks, so
it has none. The layout is balanced for causal attention; the same shards also serve Gemma2's
sliding-window layers, whose balance (window (4095, 0)) is reported separately, next to a
layout balanced for both layer kinds at once (packed_layout(..., layer_windows=[None, (4095, 0)])).

Mixes (seeded): long-tail (log-uniform lengths 16..32K), short (uniform 64..2K), a single
document, and long-tail filling 97 % of the stream (3 % tail padding).

Writes <out>/packing_balance.json and packing_balance.png (benchmarks/results/ for a real run).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._util import OUT_DIR_HELP, bar_plot, out_dir_for, save, table  # noqa: E402
from cp_softcap.doc_geometry import send_ranges, step_calls  # noqa: E402
from cp_softcap.documents import (CHUNK_CHOICES, PackedLayout, assign_chunks, chunk_areas,  # noqa: E402
                                  packed_layout, padded_len)

CAUSAL = (None, 0)
LOCAL = (4095, 0)           # Gemma2's sliding-window layers, run on the causal-balanced layout


def mix(kind: str, total: int, seed: int):
    rng = random.Random(f"{kind}-{seed}")
    if kind == "single":
        return [0, total]
    end = int(total * 0.97) if kind == "long-tail+pad" else total
    cu = [0]
    while cu[-1] < end:
        if kind == "short":
            n = rng.randint(64, 2048)
        else:
            n = int(2 ** rng.uniform(4, 15))
        cu.append(min(end, cu[-1] + n))
    return cu


def ratio(loads) -> float:
    total = sum(loads)
    return max(loads) * len(loads) / total if total else 1.0


def fixed_layout(cu, total, cp, chunks_per_rank=None, chunks=None, window=CAUSAL) -> PackedLayout:
    """A PackedLayout with given chunks (zigzag / contiguous), or the solver at a fixed m."""
    n = padded_len(total, cp) if chunks is None else -(-total // (len(chunks) * len(chunks[0]))) * (
        len(chunks) * len(chunks[0]))
    if chunks is None:
        chunks = assign_chunks(chunk_areas(tuple(cu), n, cp * chunks_per_rank, window), cp)
    num = len(chunks) * len(chunks[0])
    chunk = n // num
    areas = chunk_areas(tuple(cu), n, num, window)
    load = tuple(sum(areas[c] for c in h) for h in chunks)
    return PackedLayout(tuple(cu), n, cp, (window,), chunk, chunks, (load,))


def ring_counts(layout: PackedLayout, window=CAUSAL):
    """(busiest rank's kernel calls, messages received, K/V tokens received as a fraction of
    the stream) for one ring forward."""
    calls, msgs, keys = [], [], []
    for rq in range(layout.cp):
        calls.append(sum(len(step_calls(layout, rq, rk, window)) for rk in range(layout.cp)))
        sent = [send_ranges(layout, rq, rk, window) for rk in range(layout.cp) if rk != rq]
        msgs.append(sum(1 for r in sent if r))
        keys.append(sum(b - a for r in sent for a, b in r))
    return max(calls), max(msgs), max(keys) / layout.seq_len


def window_ratio(layout: PackedLayout, window) -> float:
    """busiest/mean area of `layout` (balanced for causal) on a sliding-window layer."""
    areas = chunk_areas(layout.cu_seqlens, layout.seq_len, layout.cp * layout.chunks_per_rank, window)
    return ratio([sum(areas[c] for c in h) for h in layout.chunks])


def head_tail(cu, cp):
    """(busiest/mean area, padding tokens) of per-document zigzag with per-document padding."""
    load, pad = [0] * cp, 0
    for a, b in zip(cu, cu[1:]):
        n = b - a
        padded = -(-n // (2 * cp)) * 2 * cp
        pad += padded - n
        c = padded // (2 * cp)
        for r in range(cp):
            for j in (r, 2 * cp - 1 - r):          # causal area of real tokens at positions p: p + 1
                lo, hi = j * c, min((j + 1) * c, n)
                if hi > lo:
                    load[r] += (hi * (hi + 1) - lo * (lo + 1)) // 2
    return ratio(load), pad


def measure(kind, total, cp, seed, with_counts=True):
    cu = mix(kind, total, seed)
    rec = {"mix": kind, "cp": cp, "seed": seed, "tokens": total, "docs": len(cu) - 1,
           "doc_tokens": cu[-1]}
    t0 = time.perf_counter()
    ours = packed_layout(cu, total, cp)
    rec["layout_ms"] = (time.perf_counter() - t0) * 1e3
    rec["packed"] = ours.imbalance
    rec["packed_m"] = ours.chunks_per_rank
    rec["packed_pad_pct"] = 100.0 * (ours.seq_len - total) / total
    rec["packed_w4095"] = window_ratio(ours, LOCAL)
    joint = packed_layout(cu, total, cp, layer_windows=[CAUSAL, LOCAL])
    rec["joint"], rec["joint_w4095"] = joint.imbalances
    rec["joint_m"] = joint.chunks_per_rank
    if with_counts:
        rec["packed_calls"], rec["packed_msgs"], rec["packed_keys"] = ring_counts(ours)
        rec["packed_w4095_calls"], _, rec["packed_w4095_keys"] = ring_counts(ours, LOCAL)
    for m in CHUNK_CHOICES:
        lay = fixed_layout(cu, total, cp, chunks_per_rank=m)
        rec[f"packed_m{m}"] = lay.imbalance
        if with_counts:
            rec[f"packed_m{m}_calls"], rec[f"packed_m{m}_msgs"], _ = ring_counts(lay)
    zig = fixed_layout(cu, total, cp, chunks=tuple((r, 2 * cp - 1 - r) for r in range(cp)))
    rec["zigzag"] = zig.imbalance
    rec["zigzag_pad_pct"] = 100.0 * (zig.seq_len - total) / total
    cont = fixed_layout(cu, total, cp, chunks=tuple((r,) for r in range(cp)))
    rec["contiguous"] = cont.imbalance
    rec["zigzag_w4095"] = window_ratio(zig, LOCAL)
    if with_counts:
        rec["zigzag_calls"], rec["zigzag_msgs"], rec["zigzag_keys"] = ring_counts(zig)
        rec["contiguous_calls"], rec["contiguous_msgs"], _ = ring_counts(cont)
    rec["head_tail"], pad = head_tail(cu, cp)
    rec["head_tail_pad_pct"] = 100.0 * pad / total
    return rec


def summarize(records):
    """One row per (mix, cp): worst over seeds of each ratio, max of counts and padding."""
    rows = {}
    for r in records:
        key = (r["mix"], r["cp"])
        row = rows.setdefault(key, dict(r))
        for name, val in r.items():
            if isinstance(val, (int, float)) and name not in ("cp", "seed", "tokens"):
                row[name] = max(row[name], val)
    return [rows[k] for k in sorted(rows, key=lambda k: (k[0], k[1]))]


def plot(blob, png: str) -> None:
    """Bar chart of the busiest/mean area per (mix, cp) and layout, from the JSON's rows."""
    rows = blob["meta"]["rows"]
    labels = [f"{r['mix']} cp{r['cp']}" for r in rows]
    series = {name: [min(r[key], 4.0) for r in rows] for name, key in
              (("packed (library)", "packed"), ("zigzag", "zigzag"), ("per-doc head-tail", "head_tail"),
               ("contiguous", "contiguous"))}
    bar_plot(png, labels, series, "busiest rank area / mean (clipped at 4)",
             f"packed documents, {blob['meta']['tokens'] // 1024}K tokens, causal: load balance",
             hline=1.10)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny stream (8K), cp 2/4, one seed")
    ap.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    ap.add_argument("--seeds", type=int, default=None)
    args = ap.parse_args(argv)
    total = 8192 if args.dry_run else 131072
    cps = (2, 4) if args.dry_run else (2, 4, 8, 16)
    seeds = args.seeds or (1 if args.dry_run else 3)
    mixes = ("long-tail", "short", "single", "long-tail+pad")
    records = []
    for kind in mixes:
        for cp in cps:
            for seed in range(1 if kind == "single" else seeds):
                records.append(measure(kind, total, cp, seed))
    rows = summarize(records)
    head = ["mix", "cp", "docs", "packed (m)", "zigzag", "head-tail (pad %)", "contiguous",
            "packed pad %", "calls packed/zigzag", "msgs packed/zigzag"]
    lines = [head] + [[r["mix"], r["cp"], r["docs"], f"{r['packed']:.3f} ({r['packed_m']})",
                       f"{r['zigzag']:.3f}", f"{r['head_tail']:.3f} ({r['head_tail_pad_pct']:.2f})",
                       f"{r['contiguous']:.3f}", f"{r['packed_pad_pct']:.3f}",
                       f"{r['packed_calls']}/{r['zigzag_calls']}", f"{r['packed_msgs']}/{r['zigzag_msgs']}"]
                      for r in rows]
    print(f"busiest rank's attention area / mean (worst of {seeds} seeds), {total} tokens, causal")
    print(table(lines))
    mlines = [["mix", "cp"] + [f"m={m}: ratio, calls, msgs" for m in CHUNK_CHOICES]] + [
        [r["mix"], r["cp"]] + [f"{r[f'packed_m{m}']:.3f}, {r[f'packed_m{m}_calls']}, {r[f'packed_m{m}_msgs']}"
                               for m in CHUNK_CHOICES] for r in rows]
    wlines = [["mix", "cp", "window 4095: packed", "zigzag", "joint causal / 4095 (m)",
               "K/V received causal: packed", "zigzag", "window 4095: packed", "calls w4095"]] + [
        [r["mix"], r["cp"], f"{r['packed_w4095']:.3f}", f"{r['zigzag_w4095']:.3f}",
         f"{r['joint']:.3f} / {r['joint_w4095']:.3f} ({r['joint_m']})",
         f"{r['packed_keys']:.3f}", f"{r['zigzag_keys']:.3f}", f"{r['packed_w4095_keys']:.3f}",
         r["packed_w4095_calls"]] for r in rows]
    print("\nsliding-window layers (4095, 0) on the same layouts (busiest/mean), and the busiest rank's "
          "K/V tokens received per ring forward (fraction of the stream)")
    print(table(wlines))
    print("\nfixed chunks per rank m (busiest/mean, busiest rank's calls and messages per ring forward)")
    print(table(mlines))
    out = out_dir_for(args.out_dir, args.dry_run)
    meta = {"tokens": total, "cps": list(cps), "seeds": seeds, "window": "causal",
            "dry_run": args.dry_run, "summary": "worst over seeds per (mix, cp)"}
    path = save("packing_balance", records, {**meta, "rows": rows}, out_dir=out)
    with open(path) as f:
        plot(json.load(f), os.path.join(out, "packing_balance.png"))
    print(f"\nwrote {path}")
    worst = max(r["packed"] for r in rows)
    if not math.isfinite(worst):
        raise SystemExit("non-finite balance ratio")
    return rows


if __name__ == "__main__":
    main()
