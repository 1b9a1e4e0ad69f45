"""Where the GPU waits: idle gaps between kernels in a torch.profiler Chrome trace.

    python -m benchmarks.training.gaps TRACE.json[.gz] [--top 15] [--json out.json]

A step can be slower than the sum of its kernels when the GPU runs out of queued work: a
host sync (`.item()`, a blocking copy), or host code slower than the kernels it launches.
speed.py --trace writes the trace of its profiled steps; this reads the GPU's kernels, copies
and memsets, merges their busy intervals, and lists the longest idle gaps with the kernel
before and after each and the host ops running when the gap began (the innermost last; ops of the autograd thread
and the main thread are listed together).
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
from typing import Dict, List

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "user_annotation", "python_function")


def load(path: str) -> Dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def gaps(trace: Dict, top: int = 15, min_us: float = 20.0) -> Dict:
    """Busy and idle time of the GPU between its first and last event, and the `top` longest
    idle gaps of at least `min_us` (microseconds), each with its neighbours and host context."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS),
                 key=lambda e: e["ts"])
    host = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in HOST_CATS),
                  key=lambda e: e["ts"])
    if not gpu:
        return {"span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "busy_fraction": None, "gaps": [],
                "idle_in_gaps_us": 0.0}
    found: List[Dict] = []
    busy, end, prev = 0.0, gpu[0]["ts"], gpu[0]
    start = gpu[0]["ts"]
    for e in gpu:
        if e["ts"] > end:
            if e["ts"] - end >= min_us:
                found.append({"gap_us": e["ts"] - end, "at_us": end - start, "before": prev["name"],
                              "after": e["name"], "t0": end})
        else:
            busy -= min(end, e["ts"] + e["dur"]) - e["ts"]       # overlap counted once
        busy += e["dur"]
        if e["ts"] + e["dur"] >= end:
            end, prev = e["ts"] + e["dur"], e
    span = end - start
    found.sort(key=lambda g: -g["gap_us"])
    starts = [h["ts"] for h in host]
    for g in found[:top]:
        i = bisect.bisect_right(starts, g["t0"])
        g["host"] = [h["name"] for h in host[:i] if h["ts"] + h.get("dur", 0) >= g["t0"]][-4:]
    return {"span_us": span, "busy_us": busy, "idle_us": span - busy,
            "busy_fraction": busy / span if span else None,
            "gaps": [{k: v for k, v in g.items() if k != "t0"} for g in found[:top]],
            "idle_in_gaps_us": sum(g["gap_us"] for g in found)}


def render(summary: Dict) -> str:
    if summary["busy_fraction"] is None:
        return "no GPU events in the trace"
    lines = [f"GPU busy {summary['busy_us'] / 1e3:.1f} ms of {summary['span_us'] / 1e3:.1f} ms "
             f"({100 * summary['busy_fraction']:.1f} %), idle {summary['idle_us'] / 1e3:.1f} ms, "
             f"{summary['idle_in_gaps_us'] / 1e3:.1f} ms of it in gaps long enough to list",
             "gap ms  at ms    before -> after | host ops when it began (innermost last)"]
    for g in summary["gaps"]:
        lines.append(f"{g['gap_us'] / 1e3:6.2f}  {g['at_us'] / 1e3:7.1f}  {g['before'][:40]} -> "
                     f"{g['after'][:40]} | {' / '.join(n[:40] for n in g['host'])}")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="Chrome trace from torch.profiler (.json or .json.gz)")
    p.add_argument("--top", type=int, default=15, help="gaps to list")
    p.add_argument("--min-us", type=float, default=20.0, help="shortest gap counted as one")
    p.add_argument("--json", help="write the summary here")
    args = p.parse_args(argv)
    summary = gaps(load(args.trace), args.top, args.min_us)
    print(render(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
