"""Run benchmark suites: `python -m benchmarks SUITE [SUITE ...] [--quick | --dry-run] [--out DIR]`.

    python -m benchmarks --list                  # suites, their steps and what each measures
    python -m benchmarks kernels cp_sim --quick  # the figures RESULTS.md's summary quotes, in minutes
    python -m benchmarks all                     # every suite, full size (hours on one GPU)
    python -m benchmarks all --dry-run           # CPU: every step at tiny shapes (a check, CI)

Suites and steps: benchmarks/suites.py. Each step runs in its own process (torchrun over every
GPU for the multi-GPU steps), with a time limit; a step that fails or runs out of time is
reported and the others still run (the exit status is 1 if any failed). A GPU step without a
GPU, or with fewer GPUs than it needs, is skipped with the reason.

Records (benchmarks/_util.py's format, each with its plot) go to --out: by default
benchmarks/results/ for full and quick runs, and $OUT or a new temporary folder for dry runs.
A GPU step's records are named <name>_<card> (e.g. kernels_h100.json), a quick run's
<name>[_<card>]_quick, so runs on different cards and quick runs never overwrite each other.
The run itself is recorded as run_<suites>[_<card>][_quick|_dry].json there: every step's
command, exit status, seconds and records.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.suites import SUITES, Step  # noqa: E402


def _gpus() -> Tuple[int, Optional[str]]:
    import torch
    if not torch.cuda.is_available():
        return 0, None
    from benchmarks._util import card
    name = torch.cuda.get_device_name()
    return torch.cuda.device_count(), (card(name) or "gpu").lower()


def why_not(step: Step, mode: str, gpus: int) -> Optional[str]:
    """Why `step` does not run in `mode` on a machine with `gpus` GPUs, or None."""
    if step.args(mode) is None:
        return f"not part of a {mode} run"
    if mode == "dry" or step.gpus == 0:
        return None
    if gpus == 0:
        return "needs a CUDA GPU: torch.cuda.is_available() is False here"
    if gpus < step.min_gpus:
        return f"needs {step.min_gpus} GPUs (one rank per GPU), this machine has {gpus}"
    return None


def command(step: Step, mode: str, gpus: int, out_dir: str) -> List[str]:
    args = [*step.args(mode), "--out-dir", out_dir]
    if step.gpus == "all" and gpus >= 2 and mode != "dry":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={gpus}", "-m", step.module, *args]
    return [sys.executable, "-m", step.module, *args]


def _run_subprocess(cmd: List[str], timeout: int) -> int:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"--- time limit of {timeout} s reached: stopping the step", flush=True)
        os.killpg(proc.pid, signal.SIGKILL)      # the step's own process group: torchrun's ranks too
        proc.wait()
        return 124


def _run_in_process(step: Step, args: List[str]) -> int:
    """The step's main() in this process (dry runs in the tests: no interpreter start per step)."""
    saved, environ = sys.argv, dict(os.environ)        # steps may set variables (the allocator's)
    sys.argv = [step.module, *args]
    try:
        main = importlib.import_module(step.module).main
        rc = main(args) if inspect.signature(main).parameters else main()
        return rc if isinstance(rc, int) else 0          # some mains return their records
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        sys.argv = saved
        os.environ.clear()
        os.environ.update(environ)


def suffix(step: Step, mode: str, card: Optional[str]) -> str:
    if mode == "dry":
        return ""
    return (f"_{card}" if step.gpus != 0 and card else "") + ("_quick" if mode == "quick" else "")


def collect(tmp: str, out_dir: str, end: str) -> List[str]:
    """Move the step's records and plots into out_dir, each renamed <stem><end>.<ext>."""
    moved = []
    for name in sorted(os.listdir(tmp)):
        stem, ext = os.path.splitext(name)
        if ext not in (".json", ".png") or not os.path.isfile(os.path.join(tmp, name)):
            continue
        target = os.path.join(out_dir, stem + end + ext)
        shutil.move(os.path.join(tmp, name), target)
        moved.append(os.path.relpath(target, out_dir))
    return moved


def run(suites: List[str], mode: str, out_dir: str, only: Optional[List[str]] = None,
        in_process: bool = False) -> Tuple[int, List[Dict]]:
    gpus, card = (0, None) if mode == "dry" else _gpus()
    os.makedirs(out_dir, exist_ok=True)
    steps = []
    for suite in suites:
        for step in SUITES[suite]:
            if not only or step.name in only or f"{suite}.{step.name}" in only:
                steps.append((suite, step))
    results, failed = [], 0
    for suite, step in steps:
        label = f"{suite}.{step.name}"
        reason = why_not(step, mode, gpus)
        if reason:
            print(f"=== {label}: skipped: {reason}", flush=True)
            results.append(dict(step=label, status="skipped", reason=reason))
            continue
        with tempfile.TemporaryDirectory(prefix="cp_softcap_bench_") as tmp:
            cmd = command(step, mode, gpus, tmp)
            shown = " ".join(cmd[1:] if cmd[0] == sys.executable else cmd)
            print(f"=== {label}: {shown}", flush=True)
            t0 = time.monotonic()
            if in_process and cmd[1:3] == ["-m", step.module]:
                rc = _run_in_process(step, cmd[3:])
            else:
                rc = _run_subprocess(cmd, step.timeout_s[mode])
            seconds = time.monotonic() - t0
            records = collect(tmp, out_dir, suffix(step, mode, card))
        status = "ok" if rc == 0 else "timeout" if rc == 124 else "failed"
        failed += status != "ok"
        print(f"=== {label}: {status} in {seconds:.0f} s; records: {', '.join(records) or 'none'}",
              flush=True)
        results.append(dict(step=label, status=status, rc=rc, seconds=round(seconds, 1),
                            command=shown, records=records))
    return failed, results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0],
                                epilog="suites: " + ", ".join(SUITES) + ", all")
    p.add_argument("suites", nargs="*", help="suite names, or all")
    p.add_argument("--quick", action="store_true", help="the summary's figures only (minutes)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: checks every step")
    p.add_argument("--out", help="folder for the records (default: benchmarks/results/; a dry "
                                 "run: $OUT or a new temporary folder)")
    p.add_argument("--only", nargs="+", help="run only these steps (name or suite.name)")
    p.add_argument("--list", action="store_true", help="list the suites and their steps")
    p.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.list or not a.suites:
        for suite, steps in SUITES.items():
            print(suite)
            for s in steps:
                where = {0: "CPU", 1: "1 GPU"}.get(s.gpus, f"every GPU (>= {s.min_gpus})")
                quick = "" if s.quick is not None else ", not in --quick"
                print(f"  {s.name:16s} {where}{quick}: {s.about}")
        return 0 if a.list else 2
    if a.quick and a.dry_run:
        p.error("--quick and --dry-run exclude each other")
    names = list(SUITES) if "all" in a.suites else a.suites
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        p.error(f"unknown suite(s) {unknown}; choose from {list(SUITES)} or all")
    mode = "dry" if a.dry_run else "quick" if a.quick else "full"
    from benchmarks._util import RESULTS, out_dir_for, save
    out_dir = a.out or (out_dir_for(None, dry=True) if mode == "dry" else RESULTS)
    failed, results = run(names, mode, out_dir, a.only, a.in_process)
    gpus, card = (0, None) if mode == "dry" else _gpus()
    name = "run_" + "_".join(names if "all" not in a.suites else ["all"]) + (f"_{card}" if card else "")
    name += {"full": "", "quick": "_quick", "dry": "_dry"}[mode]
    path = save(name, results, dict(suites=names, mode=mode), out_dir)
    print(f"\n{len(results)} steps: {sum(r['status'] == 'ok' for r in results)} ok, "
          f"{sum(r['status'] == 'skipped' for r in results)} skipped, {failed} failed; "
          f"records in {out_dir}; this run: {os.path.basename(path)}")
    for r in results:
        if r["status"] not in ("ok",):
            print(f"  {r['step']}: {r['status']}" + (f" ({r['reason']})" if "reason" in r else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
