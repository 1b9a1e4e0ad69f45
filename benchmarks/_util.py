"""The benchmarks' shared harness: timing, the FLOP convention, the record format, where records
go, gloo ranks on CPU. Every benchmark writes through `save` / `report`, so every record in
benchmarks/results/ has the same shape:

    {"meta": {<the benchmark's own settings>, "device": "<GPU name> (torch X)" | "cpu (...)",
              "argv": [...], "env": {...}},          # env: see environment()
     "records": [{...}, ...]}

Timing (`bench_ms`): one untimed call first (JIT, compilation, autotuning), then on a GPU the
median of triton.testing.do_bench (CUDA events around each repetition, the L2 cache flushed
between them) over `rep_ms`; on CPU (dry runs) the wall-clock median of three calls, which checks
a script, not a speed.
FLOPs (causal forward): 4 * B * Hq * S^2 * D / 2; backward = 2.5 x forward (fwd+bwd = 3.5 x).
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.plots import RESULTS, bar_plot, case_plot, plot_json  # noqa: E402,F401 (re-exported)
OUT_DIR_HELP = ("folder for the JSON and PNG (default: benchmarks/results/; a dry run: $OUT, "
                "else a new temporary folder)")
# versions recorded with every result (distribution names; absent ones are left out)
PACKAGES = ("triton", "flash-attn-4", "flash-attn", "nvidia-cutlass-dsl", "liger-kernel",
            "transformers", "ring-flash-attn", "yunchang")


def out_dir_for(requested: Optional[str], dry: bool) -> str:
    """Where a run writes its JSON and PNG: --out-dir when given; a dry run (CPU, tiny shapes:
    a check of the script, not a measurement) goes to $OUT or a fresh temporary folder, so it
    never overwrites the tracked records in benchmarks/results/; a real run goes there."""
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
    return f"cpu (torch {torch.__version__})"


def card(name: str) -> Optional[str]:
    """The card's short name as results name it ("H100", "H200", ...), from the device name."""
    for short in ("H200", "H100", "B200", "A100", "L40S", "L4"):
        if short in name:
            return short
    return None


def _git(*args: str) -> Optional[str]:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> Dict:
    """What a result was measured on: the device and card, GPU count, torch / CUDA / kernel
    package versions, the repository's git revision (and whether the tree had changes), the date
    (UTC) and the host's Python and processor."""
    from importlib import metadata
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    env = {"device": name, "card": card(name),
           "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "python": platform.python_version(), "machine": platform.machine(),
           "cpus": os.cpu_count(),
           "git": _git("rev-parse", "HEAD"), "git_dirty": bool(_git("status", "--porcelain", "-uno")),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    for pkg in PACKAGES:
        try:
            env[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return env


def save(name: str, records: List[Dict], meta: Dict, out_dir: str = RESULTS) -> str:
    """Write <out_dir>/<name>.json in the record format above; returns its path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    blob = {"meta": {**meta, "device": device_name(), "argv": sys.argv, "env": environment()},
            "records": records}
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
                 fresh: bool = False) -> List:
    """Run fn(rank, world, *args) on `world` processes joined by gloo (file rendezvous in a fresh
    temporary directory, one thread each; rank r pinned to core r % ncores with pin_cores) and
    return the ranks' return values, in rank order. fn, args and the values it returns must
    pickle.

    The ranks fork from a server process that imported torch and the library once (8 ranks
    importing torch each cost ~20 s of a 2-core machine). fresh=True spawns each rank as a new
    interpreter instead, with env in os.environ while they start: malloc (MALLOC_*) and OpenMP
    read theirs at process start, which a forked rank has long passed. Otherwise env is set in
    each rank before fn runs. pg_timeout is the process group's timeout (s); timeout is the whole
    launch's deadline (s).

    Raises RuntimeError, after every process is gone: with the traceback of the first rank that
    raised, the exit code of a rank that died without reporting, or the ranks still running
    after `timeout` seconds."""
    from benchmarks.ranks import failure_text, forkserver, spawn_ranks
    ctx = "spawn" if fresh else forkserver("torch", "torch.distributed", "cp_softcap")
    out, running = spawn_ranks(fn, world, args, ctx=ctx, deadline_s=timeout,
                               env=env, env_at_start=fresh, pg_timeout=pg_timeout,
                               pin_cores=pin_cores, poll_s=1.0)
    failed = sorted(r for r, (status, _) in out.items() if status != "ok")
    if failed:
        raise RuntimeError(f"{fn.__name__}: rank {failed[0]} of {world} failed:\n"
                           f"{failure_text(out[failed[0]])}")
    if running:
        raise RuntimeError(f"{fn.__name__}: ranks {running} of {world} "
                           f"did not finish within timeout={timeout}s (process-group timeout "
                           f"{pg_timeout}s); ranks {sorted(out)} had reported")
    return [out[r][1] for r in range(world)]
