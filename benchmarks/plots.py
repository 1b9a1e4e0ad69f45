"""Every benchmark plot, drawn from the JSON it shows. One definition per benchmark, used both by
the benchmark scripts (right after they write their JSON) and to redraw them all:

    python benchmarks/plots.py                      # every benchmarks/results/*.json -> its .png
    python benchmarks/plots.py path/to/x.json ...   # just these

The kind of plot follows from the file name: kernels*, fa4_softcap*, cp_sim*, cp_multi*,
comm_bytes*, ring_cpu* are drawn here; results named after another benchmark script that
defines `plot(blob, png)` (e.g. packing_balance) are drawn by that function.
"""
from __future__ import annotations

import glob
import importlib
import json
import os
import statistics
import sys
from typing import Callable, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def bar_plot(path: str, labels: List[str], series: Dict[str, List[float]], ylabel: str,
             title: str, hline: float = None) -> None:
    """Grouped bar chart -> PNG (skipped with a note if matplotlib is missing)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib missing: no plot {path}")
        return
    fig, ax = plt.subplots(figsize=(max(6, len(labels) * 1.1), 4))
    n = max(1, len(series))
    width = 0.8 / n
    for i, (name, vals) in enumerate(series.items()):
        xs = [x + i * width - 0.4 + width / 2 for x in range(len(labels))]
        ax.bar(xs, [v if v == v else 0 for v in vals], width, label=name)
    if hline is not None:
        ax.axhline(hline, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def case_plot(path: str, records: List[Dict], series_of: Callable[[Dict], str], ylabel: str,
              title: str) -> None:
    """bar_plot of records' "tflops", one bar group per (model, S, mode) and one series per
    series_of(record); records without "tflops" are left out."""
    case = lambda r: f"{r['model']} {r['S'] // 1024}K {r['mode']}"   # noqa: E731
    ok = [r for r in records if "tflops" in r]
    labels = sorted({case(r) for r in ok})
    series: Dict[str, Dict[str, float]] = {}
    for r in ok:
        series.setdefault(series_of(r), {})[case(r)] = r["tflops"]
    bar_plot(path, labels, {n: [v.get(lbl, float("nan")) for lbl in labels] for n, v in series.items()},
             ylabel, title)


def _kernels(blob: Dict, png: str) -> None:
    name = lambda r: r["kernel"] + ("" if r["kernel"].startswith("cudnn") else f" cap={r['softcap']}")  # noqa: E731
    case_plot(png, blob["records"], name, "TFLOP/s", f"causal attention, bf16, B=1, {blob['meta']['device']}")


def _fa4_softcap(blob: Dict, png: str) -> None:
    cap = blob["meta"].get("softcap")
    case_plot(png, blob["records"], lambda r: r["kernel"], "TFLOP/s",
              f"FA4 softcap {cap}: builtin vs score_mod vs cuDNN (no cap), causal bf16 B=1")


def _cp_sim(blob: Dict, png: str) -> None:
    records, meta = [r for r in blob["records"] if "ratio" in r], blob["meta"]
    if not records:
        return
    label = lambda r: f"{r['S'] // 1024}K cp{r['cp']} {r['mode']}"  # noqa: E731
    labels = list(dict.fromkeys(label(r) for r in records))
    keys = list(dict.fromkeys(r.get("block_keys") for r in records))
    series = {f"block keys {kk}": [next((r["ratio"] for r in records
                                         if r.get("block_keys") == kk and label(r) == t), float("nan"))
                                   for t in labels] for kk in keys}
    hq, hkv, d = meta.get("heads", ["?"] * 3)
    window = meta.get("window")
    bar_plot(png, labels, series, "rank time * cp / full",
             f"zigzag ring rank {meta.get('rank', 0)}, {meta.get('kernel')}, heads {hq}/{hkv} D={d}, "
             f"softcap {meta.get('softcap')}" + (f", window {window}" if window is not None else ""),
             hline=1.0)


def _cp_multi(blob: Dict, png: str) -> None:
    records, meta = blob["records"], blob["meta"]
    bar_plot(png, [f"{r['S'] // 1024}K {r['comm']}" for r in records],
             {"ratio": [r["ratio"] if r["ratio"] is not None else float("nan") for r in records]},
             "time / ideal", f"cp_attention fwd+bwd, N={meta.get('world')}, softcap {meta.get('softcap')}",
             hline=1.0)


def _comm_bytes(blob: Dict, png: str) -> None:
    records = blob["records"]
    labels = [f"{r['S'] // 1024}K {'win' if r['window'] != 'causal' else 'causal'} "
              f"{r['comm'].replace('a2a+p2p ', 'hyb ')}" for r in records]
    bar_plot(png, labels, {"measured busiest fwd+bwd": [r["busiest_total_MiB"] for r in records],
                           "measured mean": [r["mean_total_MiB"] for r in records],
                           "analytical (bytes_per_rank)": [r["analytical_total_MiB"] or float("nan")
                                                           for r in records]},
             "MiB sent per rank per layer",
             "Gemma2-9B attention, cp=8, fwd+bwd (stand-in kernel, float32 dK/dV partials)")


def _ring_cpu(blob: Dict, png: str) -> None:
    meta = blob["meta"]
    timing = [r for r in blob["records"] if "ring_ms" in r]
    memory = [r for r in blob["records"] if "alloc_peak" in r]
    labels, s_time, s_mem = [], [], []
    for cp, s_local, mode in dict.fromkeys((r["cp"], r["s_local"], r["mode"]) for r in timing):
        rs = [r for r in timing if (r["cp"], r["s_local"], r["mode"]) == (cp, s_local, mode)]
        key = "overhead_vs_as_ring" if "overhead_vs_as_ring" in rs[0] else "overhead_vs_per_step"
        labels.append(f"cp{cp} S{s_local} {mode}")
        s_time.append(1 + statistics.median(r[key] for r in rs))
        ms = [m for m in memory if (m["cp"], m["s_local"]) == (cp, s_local)]
        s_mem.append(statistics.median(m["alloc_peak"] / m["model_issue"] for m in ms)
                     if mode == "fwd" and ms else float("nan"))
    bar_plot(png, labels, {"ring time / kernels-alone time (median rank)": s_time,
                           "fwd alloc peak / model (acc + 2 K/V + kernel)": s_mem},
             "ratio", f"ring on CPU, torch kernel, B{meta['B']} Hq{meta['Hq']} Hkv{meta['Hkv']} "
             f"D{meta['D']} fp32, 1 thread/rank", hline=1.0)


def _speed(blob: Dict, png: str) -> None:
    ok = [r for r in blob["records"] if "tokens_per_s" in r]
    bar_plot(png, [r["variant"] for r in ok], {"tokens/s": [r["tokens_per_s"] for r in ok]},
             "tokens/s", f"the example's step per Liger variant: {blob['meta'].get('flags', '')}")


def _sinks_cost(blob: Dict, png: str) -> None:
    ok = [r for r in blob["records"] if "ratio" in r]
    labels = list(dict.fromkeys(f"{r['kernel']} {r['layer']} {r['S'] // 1024}K" for r in ok))
    series = {m: [next((r["ratio"] for r in ok if r["mode"] == m and
                        f"{r['kernel']} {r['layer']} {r['S'] // 1024}K" == lbl), float("nan"))
                   for lbl in labels] for m in ("fwd", "fwd+bwd")}
    bar_plot(png, labels, series, "time with sinks / without", "attention sinks' cost", hline=1.0)


PLOTS: Dict[str, Callable[[Dict, str], None]] = {
    "kernels": _kernels, "fa4_softcap": _fa4_softcap, "cp_sim": _cp_sim, "cp_multi": _cp_multi,
    "comm_bytes": _comm_bytes, "ring_cpu": _ring_cpu, "speed": _speed, "sinks_cost": _sinks_cost}


def _script_plot(stem: str) -> Optional[Callable[[Dict, str], None]]:
    """The `plot(blob, png)` of the benchmark script a result is named after (stem = the script's
    name, optionally followed by _tag), if it defines one."""
    here = os.path.dirname(os.path.abspath(__file__))
    names = [os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(here, "*.py"))]
    for name in sorted((n for n in names if not n.startswith("_") and n != "plots"), key=len, reverse=True):
        if stem == name or stem.startswith(name + "_"):
            return getattr(importlib.import_module(f"benchmarks.{name}"), "plot", None)
    return None


def plot_json(path: str, png: Optional[str] = None) -> Optional[str]:
    """Draw the plot of one benchmark JSON next to it (or at `png`); returns the PNG path, or
    None for a file of no known kind or without plottable records (e.g. a profile)."""
    stem = os.path.splitext(os.path.basename(path))[0]
    kind = next((k for k in sorted(PLOTS, key=len, reverse=True) if stem.startswith(k)), None)
    draw = PLOTS[kind] if kind is not None else _script_plot(stem)
    if draw is None:
        return None
    with open(path) as f:
        blob = json.load(f)
    png = png or os.path.splitext(path)[0] + ".png"
    draw(blob, png)
    return png


def main(argv: List[str]) -> int:
    paths = argv or sorted(glob.glob(os.path.join(RESULTS, "*.json")))
    for path in paths:
        png = plot_json(path)
        print(f"{path} -> {png}" if png else f"{path}: no plot")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
