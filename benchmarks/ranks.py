"""Run fn(rank, world, *args) on `world` local processes joined by gloo, and say what each did.

The one spawn / rendezvous / poll / deadline / kill loop behind every multi-process run of the
repository: the benchmarks' CPU ranks (_util.launch_ranks: a failure is a RuntimeError) and the
tests' (tests_dist/harness.run_ranks: an AssertionError; test_no_hangs: a rank that raises or
dies is an outcome to check). They differ only in how they start processes and what they make
of the outcomes, so those are parameters here and the callers are thin wrappers. Not public
API.

    outcomes, running = spawn_ranks(fn, 2, (x,), ctx="spawn", deadline_s=60)
    # outcomes: {rank: ("ok", value) | ("error", traceback text) | ("exit", exit code)}
    # running: ranks with no outcome when collection stopped (deadline, or a failure); killed
"""
from __future__ import annotations

import contextlib
import os
import queue
import signal
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch.multiprocessing as mp

Outcome = Tuple[str, object]
_PRELOAD: List[str] = []


def forkserver(*modules: str):
    """This process's forkserver context, preloading every module any caller asked for.

    multiprocessing keeps one forkserver per process, started at its first fork with the preload
    list set last and this process's sys.path at that moment; the tests' harness and the
    benchmarks' launcher share it when a test runs a benchmark in-process, so each adds its
    modules here instead of replacing the other's list."""
    for name in modules:
        if name not in _PRELOAD:
            _PRELOAD.append(name)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


def exit_text(code: int) -> str:
    """A process's exit code in words: 'exit code 3', 'killed by SIGKILL, exit code -9 (...)'."""
    if code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    hint = " (out of memory? the OOM killer sends SIGKILL)" if -code == signal.SIGKILL else ""
    return f"killed by {name}, exit code {code}{hint}"


def failure_text(outcome: Outcome) -> str:
    """What went wrong in a non-"ok" outcome: the traceback, or how the process exited."""
    status, value = outcome
    return value if status == "error" else f"process exited without a report: {exit_text(value)}"


def _rank_entry(fn, rank, world, init_file, results, args, env, pg_timeout, pin_cores, backend):
    """One rank: env into os.environ, one thread (pinned to core rank % ncores with pin_cores),
    the process group (gloo; or nccl with GPU `rank` as this rank's device) via the rendezvous
    file, fn(rank, world, *args); puts (rank, "ok", value) or (rank, "error", traceback), then
    leaves the process group."""
    import torch
    import torch.distributed as dist
    os.environ.update(env)
    torch.set_num_threads(1)
    if pin_cores:       # before init_process_group, so gloo's threads inherit the pinning
        try:
            cores = sorted(os.sched_getaffinity(0))
            os.sched_setaffinity(0, {cores[rank % len(cores)]})
        except (AttributeError, OSError):
            pass
    try:
        device = None
        if backend == "nccl":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=pg_timeout),
                                device_id=device)
        results.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:   # report everything: assertion failures, KeyboardInterrupt, SystemExit
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def spawn_ranks(fn: Callable, world: int, args: Sequence = (), *, ctx="spawn", deadline_s: float,
                env: Optional[Mapping[str, str]] = None, env_at_start: bool = False,
                pg_timeout: float = 60.0, pin_cores: bool = False, backend: str = "gloo",
                poll_s: float = 0.5,
                stop_on_failure: bool = True, grace_s: float = 5.0
                ) -> Tuple[Dict[int, Outcome], List[int]]:
    """Start fn(rank, world, *args) on `world` processes of `ctx` (a multiprocessing context
    or start-method name; fn, args and return values must pickle), each with a fresh file
    rendezvous, and collect every rank's outcome until all have one, or (stop_on_failure) one
    is not "ok", or deadline_s passes. A rank that exits without a report gets ("exit", code),
    after the queue is drained once more (its report may still be in the pipe).

    env is put into each rank's os.environ before anything else runs there (a forkserver's
    children inherit the server's environment, not ours). env_at_start also sets it in this
    process's os.environ while the processes start (restored after): a spawned child then has it
    from exec, which malloc (MALLOC_*) and OpenMP need. pg_timeout: the process group's timeout.
    backend: "gloo" (CPU, or several ranks sharing a GPU) or "nccl" (rank r on GPU r).

    Before returning, every process is gone: when all reported "ok" each may exit by itself
    within grace_s (together); otherwise they get at most 0.5 s; the rest are killed.
    Returns (outcomes, ranks without one: still running at the deadline or when a failure
    stopped the collection)."""
    ctx = mp.get_context(ctx) if isinstance(ctx, str) else ctx
    env = dict(env or {})
    out: Dict[int, Outcome] = {}

    def take(item):
        rank, status, value = item
        out[rank] = (status, value)

    def all_ok():
        return all(status == "ok" for status, _ in out.values())

    with tempfile.TemporaryDirectory() as tmp:
        results = ctx.Queue()
        procs = [ctx.Process(target=_rank_entry, daemon=True,
                             args=(fn, r, world, os.path.join(tmp, "rdzv"), results, tuple(args),
                                   env, pg_timeout, pin_cores, backend))
                 for r in range(world)]
        try:
            with _environ(env if env_at_start else {}):
                for p in procs:
                    p.start()
            end = time.monotonic() + deadline_s
            while len(out) < world and (all_ok() or not stop_on_failure) and time.monotonic() < end:
                try:
                    take(results.get(timeout=poll_s))
                    continue
                except queue.Empty:
                    pass
                gone = [r for r, p in enumerate(procs) if r not in out and p.exitcode is not None]
                if gone:
                    time.sleep(poll_s)      # a last report may still be in the queue's pipe
                    try:
                        while True:
                            take(results.get_nowait())
                    except queue.Empty:
                        pass
                    for r in gone:
                        out.setdefault(r, ("exit", procs[r].exitcode))
        finally:
            wait = grace_s if len(out) == world and all_ok() else min(grace_s, 0.5)
            stop = time.monotonic() + wait
            for p in procs:
                if p.is_alive():
                    p.join(timeout=max(0.0, stop - time.monotonic()))
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
    return out, [r for r in range(world) if r not in out]


@contextlib.contextmanager
def _environ(env: Mapping[str, str]):
    """os.environ with env set, restored on exit."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old
