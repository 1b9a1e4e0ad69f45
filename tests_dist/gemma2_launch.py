"""Launch torchrun (python -m torch.distributed.run) as a subprocess for the gemma2 tests: a free
port from the OS, one thread per rank, a hard timeout, torchrun and every worker killed at the
end (tests_dist/proctree.py: its own session, each worker's session, orphans found by a tag in
their environment), and the failing rank's output in the assertion message."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from typing import List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import proctree  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "gemma2", "train.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CP_SOFTCAP_TIMEOUT="60")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _failing_rank_output(out: str) -> str:
    """torchrun --tee prefixes each line with [default<rank>]; show the ranks that raised."""
    bad = sorted(set(re.findall(r"\[default(\d+)\]:Traceback", out)))
    if not bad:
        return out[-6000:]
    parts = []
    for r in bad[:2]:
        lines = [ln for ln in out.splitlines() if ln.startswith(f"[default{r}]:")]
        parts.append(f"--- rank {r} ---\n" + "\n".join(lines[-80:]))
    return "\n".join(parts)


def torchrun_args(nproc: int, *, nnodes: int = 1, endpoint: Optional[str] = None,
                  rdzv_id: str = "gemma2-test") -> List[str]:
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--tee", "3"]
    if nnodes == 1:
        return args + ["--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    return args + ["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                   "--rdzv-id", rdzv_id]


def start(cmd: Sequence[str], cwd: str = ROOT) -> subprocess.Popen:
    """Start `cmd` in its own session, marked for proctree.kill_tree; output to a temp file."""
    log = tempfile.TemporaryFile(mode="w+")
    p = proctree.start(cmd, cwd=cwd, env=_env(), stdout=log, text=True)
    p.log = log
    return p


def _read(p: subprocess.Popen) -> str:
    p.log.seek(0)
    return p.log.read()


def finish(procs: Sequence[subprocess.Popen], timeout: float, what: str) -> List[str]:
    """Wait for every process (shared deadline). When one fails or time runs out, kill all of
    them and fail with the failing rank's output. Returns each process's combined output."""
    import pytest

    deadline = time.monotonic() + timeout
    failed = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None or all(c == 0 for c in codes) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:       # also when pytest-timeout or Ctrl-C interrupts the wait
        timed_out = failed is None and not all(p.poll() == 0 for p in procs)
        for p in procs:
            proctree.kill_tree(p)
    outs = [_read(p) for p in procs]
    for p in procs:
        p.log.close()
    if failed is not None:
        pytest.fail(f"{what}: process {failed} exited with {procs[failed].returncode}\n"
                    f"{_failing_rank_output(outs[failed])}", pytrace=False)
    if timed_out:
        pytest.fail(f"{what}: timed out after {timeout:.0f}s; all processes killed\n"
                    + "\n".join(o[-3000:] for o in outs), pytrace=False)
    return outs


def run(nproc: int, script: str, args: Sequence[str], timeout: float, what: str) -> str:
    """One torchrun of `script args` on `nproc` local ranks; returns its output."""
    p = start(torchrun_args(nproc) + [script, *args])
    return finish([p], timeout, what)[0]


def reference_and_cp(workers: str, out: str, what: str, *, slow: bool = True):
    """The workers module's reference(out, slow) in one process and its cp_runs(out, slow) on 4
    gloo ranks with torchrun's environment, forked together by tests_dist/fork_launch.py after one
    import of everything; each run writes <name>.json and <name>.pt into `out`. slow=False leaves
    out the runs only `slow`-marked tests read. Returns (the output of all of them, loader(out))."""
    module = os.path.splitext(os.path.basename(workers))[0]
    launch = start([sys.executable, os.path.join(ROOT, "tests_dist", "fork_launch.py"), module, out]
                   + ([] if slow else ["--no-slow"]))
    # a hang guard, not a speed check: some runs also compile a model (torch_compile=True)
    return finish([launch], timeout=420, what=what)[0], loader(out)


def loader(out: str):
    """load(name) -> (json, tensors) of the <name>.json and <name>.pt a run wrote into `out`."""
    import json

    import torch

    def load(name):
        with open(os.path.join(out, name + ".json")) as f:
            return json.load(f), torch.load(os.path.join(out, name + ".pt"))
    return load


def rel(a, b) -> float:
    """max |a - b| / max |b| in float64; inf when either holds a NaN or inf."""
    import torch

    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf")
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
