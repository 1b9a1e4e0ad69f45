"""Shared helpers for the benchmarks: timing, FLOP convention, JSON + PNG output.

FLOPs (causal forward): 4 * B * Hq * S^2 * D / 2; backward = 2.5 x forward (fwd+bwd = 3.5 x).
Timing: triton.testing.do_bench (median, CUDA events) after an explicit warm-up call (JIT).
On CPU (--dry-run) a wall-clock median stands in so scripts can be checked without a GPU.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def causal_fwd_flops(b: int, hq: int, s: int, d: int) -> float:
    return 4.0 * b * hq * s * s * d / 2


def bench_ms(fn: Callable[[], object], warmup_ms: int = 50, rep_ms: int = 200) -> float:
    """Median milliseconds of fn() (after one untimed call for JIT/compile)."""
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def device_name() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    return f"cpu (torch {torch.__version__}, dry run)"


def save(name: str, records: List[Dict], meta: Dict, out_dir: str = RESULTS) -> str:
    """Write <out_dir>/<name>.json; returns its path. Also copies to $OUT when set."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    blob = {"meta": {**meta, "device": device_name(), "argv": sys.argv}, "records": records}
    with open(path, "w") as f:
        json.dump(blob, f, indent=1)
    return path


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


def table(rows: List[List[str]]) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows)
