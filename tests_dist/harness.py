"""Run a function on `world_size` processes with gloo on CPU, for tests.

Each call gets its own rendezvous file (parallel pytest-xdist workers never collide), workers
use one thread each, and the parent enforces a hard timeout: on expiry or on any rank's failure
every worker is killed and the failing rank's traceback is raised. Workers start from a
forkserver that has torch imported once, so each spawn costs milliseconds, not an import.
"""
from __future__ import annotations

import os
import queue
import tempfile
import time
import traceback
from datetime import timedelta

import torch.multiprocessing as mp

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed", "cp_softcap"])


def _entry(fn, rank, world_size, init_file, results, args, env):
    import torch
    import torch.distributed as dist
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=60))
        value = fn(rank, world_size, *args)
        results.put((rank, "ok", value))
    except BaseException:  # report everything, including assertion failures
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0, env=None):
    """Run fn(rank, world_size, *args) on each rank; return the list of per-rank return values.
    Raises AssertionError with the first failing rank's traceback, or on timeout."""
    env = {"CP_SOFTCAP_TIMEOUT": "30", **(env or {})}
    with tempfile.TemporaryDirectory() as tmp:
        results = _CTX.Queue()
        procs = [_CTX.Process(target=_entry, args=(fn, r, world_size, os.path.join(tmp, "rdzv"),
                                                   results, args, env), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        got, errors = {}, {}
        deadline = time.monotonic() + timeout
        try:
            while len(got) + len(errors) < world_size and not errors:
                try:
                    rank, status, value = results.get(timeout=0.5)
                    (got if status == "ok" else errors)[rank] = value
                    continue
                except queue.Empty:
                    pass
                for r, p in enumerate(procs):   # a rank that died without reporting
                    if r not in got and r not in errors and p.exitcode not in (None, 0):
                        time.sleep(0.5)
                        if results.empty():
                            errors[r] = f"process exited with code {p.exitcode} without a report"
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(got) - set(errors))
                    raise AssertionError(f"ranks {missing} did not finish within {timeout}s; "
                                         f"errors so far: {errors}")
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 0.5)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
        if errors:
            rank = min(errors)
            raise AssertionError(f"rank {rank} of {world_size} failed:\n{errors[rank]}")
        return [got[r] for r in range(world_size)]
