"""Run a workers module's two parts without torchrun: `reference(OUT_DIR)` in one process and
`cp_runs(OUT_DIR)` on 4 gloo ranks with torchrun's environment, all started together.

    python tests_dist/fork_launch.py sft_workers OUT_DIR [--no-slow]
    python tests_dist/fork_launch.py hf_trainer_workers OUT_DIR

--no-slow calls `cp_runs(OUT_DIR, slow=False)`, which leaves out the runs that only tests marked
`slow` read, for a pytest run that does not select those tests (the default run's
-m 'not slow'); only a module that has such runs takes it.

This process imports the module (torch, transformers, TRL, the library, the example) and
torch.compile's machinery once, then forks the reference and the ranks from itself: under
torchrun each of the 5 processes paid those imports itself (~4-5 s of CPU each, and ~3 s more in
each rank's first compile), a large share of these runs on CI's 2 cores. Exits 1 with the first
failing process's traceback when any fails or the deadline passes.
"""
from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the checkout: benchmarks.ranks

WORLD = 4
DEADLINE_S = 400.0           # below gemma2_launch's hang guard, so this process reports first
# imported here once, inherited by every fork (each optional: a test skips without its package)
PRELOAD = ("transformers", "transformers.trainer", "accelerate", "datasets", "trl",
           "cp_softcap.integrations.hf_trainer", "cp_softcap.integrations.trl_sft",
           "torch._dynamo", "torch._inductor.compile_fx")


def _rank(rank: int, world: int, module: str, out_dir: str, slow: bool) -> None:
    # what torchrun sets: TrainingArguments / accelerate read it (the process group exists)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    # only a workers module with runs that only `slow` tests read takes slow=
    importlib.import_module(module).cp_runs(out_dir, **({} if slow else {"slow": False}))


def _reference(module: str, out_dir: str) -> None:
    try:
        importlib.import_module(module).reference(out_dir)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)


def main(module: str, out_dir: str, slow: bool = True) -> int:
    import torch

    from benchmarks.ranks import failure_text, spawn_ranks
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    importlib.import_module(module)
    torch.set_num_threads(1)
    start = time.monotonic()
    ctx = mp.get_context("fork")
    ref = ctx.Process(target=_reference, args=(module, out_dir))
    ref.start()
    env = {"TOKENIZERS_PARALLELISM": "false"}
    out, running = spawn_ranks(_rank, WORLD, (module, out_dir, slow), ctx=ctx, deadline_s=DEADLINE_S,
                               env=env, pg_timeout=120)
    bad = sorted(r for r, (status, _) in out.items() if status != "ok")
    ref.join(timeout=0 if bad or running else max(0.0, start + DEADLINE_S - time.monotonic()))
    if ref.is_alive():
        ref.kill()
        ref.join()
    sys.stdout.flush()
    if bad:
        print(f"{module}: rank {bad[0]} of {WORLD} failed:\n{failure_text(out[bad[0]])}", file=sys.stderr)
        return 1
    if running:
        print(f"{module}: ranks {running} did not finish within {DEADLINE_S:.0f} s", file=sys.stderr)
        return 1
    if ref.exitcode != 0:
        print(f"{module}: the reference process exited with {ref.exitcode} (its traceback is above)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[3:] not in ([], ["--no-slow"]):
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2], slow=sys.argv[3:] != ["--no-slow"]))
