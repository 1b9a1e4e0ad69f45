"""Shared helpers for the benchmarks: timing, FLOP convention, JSON + PNG output.

FLOPs (causal forward): 4 * B * Hq * S^2 * D / 2; backward = 2.5 x forward (fwd+bwd = 3.5 x).
Timing: triton.testing.do_bench (median, CUDA events) after an explicit warm-up call (JIT).
On CPU (--dry-run) a wall-clock median stands in so scripts can be checked without a GPU.
Multi-rank CPU benchmarks (comm_bytes, ring_cpu) start their gloo ranks with launch_ranks.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.plots import RESULTS, bar_plot, case_plot, plot_json  # noqa: E402,F401 (re-exported)
OUT_DIR_HELP = ("folder for the JSON and PNG (default: benchmarks/results/; a dry run: $OUT, "
                "else a new temporary folder)")


def out_dir_for(requested: Optional[str], dry: bool) -> str:
    """Where a run writes its JSON and PNG: --out-dir when given; a dry run (CPU, tiny shapes:
    a check of the script, not a measurement) goes to $OUT or a fresh temporary folder, so it
    never overwrites the tracked figures in benchmarks/results/; a real run goes there."""
    if requested:
        return requested
    if not dry:
        return RESULTS
    if os.environ.get("OUT"):
        return os.environ["OUT"]
    return tempfile.mkdtemp(prefix="cp_softcap_dry_run_")


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


def report(stem: str, records: List[Dict], meta: Dict, rows: List[List[str]], out_dir: str,
           tag: Optional[str] = None) -> str:
    """A benchmark's output: save(<stem>[_<tag>]), its plot next to the JSON, the table of rows
    and the JSON's path printed; returns that path."""
    path = save(stem + (f"_{tag}" if tag else ""), records, meta, out_dir)
    plot_json(path)
    print(table(rows))
    print(f"wrote {path}")
    return path


def table(rows: List[List[str]]) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows)


# --------------------------------------------------------------------------- gloo ranks on CPU

def launch_ranks(fn: Callable, world: int, args: Sequence = (), env: Optional[Mapping[str, str]] = None,
                 timeout: float = 900.0, *, pg_timeout: float = 600.0, pin_cores: bool = False,
                 poll_s: float = 1.0) -> List:
    """Run fn(rank, world, *args) on `world` spawned processes joined by gloo (file rendezvous in
    a fresh temporary directory, one thread each; rank r pinned to core r % ncores with
    pin_cores) and return the ranks' return values, in rank order. fn must be picklable (a
    module-level function) and so must args and the values it returns.

    env is put into os.environ around the spawn (restored afterwards), so the children have it
    from exec: malloc (MALLOC_*) and OpenMP read theirs at process start, not later.
    pg_timeout is the process group's timeout (s); timeout is the whole launch's deadline (s).

    Raises RuntimeError, after every process is gone (joined, or killed): with the traceback of
    the lowest rank that raised; for a rank that exited without reporting, with its exit code or
    signal; or when ranks are still running after `timeout` seconds, naming them.
    The process handling is tests_dist/ranks.py's spawn_ranks (shared with the tests)."""
    from tests_dist.ranks import failure_text, spawn_ranks
    env = dict(env or {})
    out, running = spawn_ranks(fn, world, args, ctx="spawn", deadline_s=timeout, env=env,
                               env_at_start=True, pg_timeout=pg_timeout, pin_cores=pin_cores,
                               poll_s=poll_s, grace_s=10.0)
    failed = sorted(r for r, (status, _) in out.items() if status != "ok")
    if failed:
        r, others = failed[0], failed[1:]
        raise RuntimeError(f"{fn.__name__}: rank {r} of {world} failed"
                           + (f" (ranks {others} failed too)" if others else "")
                           + f":\n{failure_text(out[r])}")
    if running:
        knob = env.get("CP_SOFTCAP_TIMEOUT", os.environ.get("CP_SOFTCAP_TIMEOUT", "(unset)"))
        raise RuntimeError(
            f"{fn.__name__}: ranks {running} of {world} did not finish within "
            f"timeout={timeout}s (process-group timeout {pg_timeout}s, "
            f"CP_SOFTCAP_TIMEOUT={knob}); ranks {sorted(out)} had reported")
    return [out[r][1] for r in range(world)]
