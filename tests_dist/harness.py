"""Run a function on `world_size` processes with gloo on CPU, for tests.

Each call gets its own rendezvous file (parallel pytest-xdist workers never collide), workers
use one thread each, and the parent enforces a hard timeout: on expiry or on any rank's failure
every worker is killed and the failing rank's traceback is raised. Workers start from a
forkserver that has torch imported once, so each spawn costs milliseconds, not an import.
The process handling is benchmarks/ranks.spawn_ranks, shared with the benchmarks.
"""
from __future__ import annotations

import torch

from benchmarks.ranks import failure_text, forkserver, spawn_ranks

# Besides torch and the library: the HF integration (it imports transformers, ~2.5 s of CPU per
# rank) and torch.compile's machinery (the first compile in a fresh process spends ~3 s importing
# it). Many ranks need one or the other; on CI's 2 cores those imports were a large share of the
# distributed tests' time. A module that fails to import is skipped by the forkserver.
# Not on a CUDA machine: importing torch.compile's machinery there initialises CUDA in the
# forkserver, and its forked ranks then cannot use the GPU ("Cannot re-initialize CUDA in
# forked subprocess"; seen on an H100).
_CTX = forkserver("torch", "torch.distributed", "cp_softcap", *(
    () if torch.cuda.is_available() else
    ("cp_softcap.integrations.hf", "torch._dynamo", "torch._inductor.compile_fx")))


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0, env=None, backend: str = "gloo"):
    """Run fn(rank, world_size, *args) on each rank; return the list of per-rank return values.
    Raises AssertionError with the first failing rank's traceback, or on timeout.
    backend="nccl": rank r on GPU r (needs world_size GPUs)."""
    env = {"CP_SOFTCAP_TIMEOUT": "30", **(env or {})}
    out, running = spawn_ranks(fn, world_size, args, ctx=_CTX, deadline_s=timeout, env=env,
                               pg_timeout=60.0, backend=backend)
    failed = sorted(r for r, (status, _) in out.items() if status != "ok")
    if failed:
        raise AssertionError(f"rank {failed[0]} of {world_size} failed:\n"
                             f"{failure_text(out[failed[0]])}")
    if running:
        raise AssertionError(f"ranks {running} did not finish within {timeout}s; "
                             f"ranks {sorted(out)} had reported")
    return [out[r][1] for r in range(world_size)]
