"""Starting the examples' ranks: under torchrun (RANK set: this process is one rank) or, without
it, `nproc` CPU processes spawned here that meet through a file in a temporary folder. CPU
only (gloo); nothing here is part of cp_softcap."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cp_softcap.sharding import fits_zigzag
from gemma2.extras import RankZeroParser   # usage errors printed once, by rank 0


def cp_size(world: int, dp: int, seq_len: int) -> int:
    """cp = world / dp, checked: dp divides the world and 2 * cp divides the sequence length."""
    if dp < 1 or world % dp:
        raise ValueError(f"--dp {dp} does not divide the number of ranks {world}")
    cp = world // dp
    if not fits_zigzag(seq_len, cp):
        ok = [c for c in range(1, seq_len // 2 + 1) if fits_zigzag(seq_len, c)]
        raise ValueError(f"{world} ranks with --dp {dp} give cp {cp}, but this example's sequence "
                         f"length {seq_len} needs 2 * cp to divide it; use cp in {ok}")
    return cp


def parse_args(doc: str, argv, nproc: int, *, dp: Optional[int] = None, seq_len: int = 0,
               check: Optional[Callable[[int], None]] = None) -> argparse.Namespace:
    """--nproc (and --dp when dp is given), checked before any process starts: at least one
    rank to spawn, dp dividing the ranks with 2 * cp dividing seq_len, and check(world) (raises
    ValueError) for what the example itself needs. world: torchrun's WORLD_SIZE, else --nproc."""
    p = RankZeroParser(description=doc.split("\n")[0])
    p.add_argument("--nproc", type=int, default=nproc,
                   help=f"ranks to spawn when not under torchrun (default {nproc})")
    if dp is not None:
        p.add_argument("--dp", type=int, default=dp,
                       help=f"data-parallel size; cp = ranks / dp (default {dp})")
    a = p.parse_args(argv)
    if "RANK" in os.environ:
        world = int(os.environ.get("WORLD_SIZE", 1))
    elif a.nproc < 1:
        p.error(f"--nproc must be >= 1 (the ranks to spawn), got {a.nproc}")
    else:
        world = a.nproc
    try:
        if dp is not None:
            cp_size(world, a.dp, seq_len)
        if check is not None:
            check(world)
    except ValueError as e:
        p.error(str(e))
    return a


def parse_dp_args(doc: str, argv, nproc: int, dp: int, seq_len: int) -> argparse.Namespace:
    """--nproc and --dp; a split that does not fit is a usage error before any process starts."""
    return parse_args(doc, argv, nproc, dp=dp, seq_len=seq_len)


def _spawned(rank: int, world: int, init_file: str, run_rank, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        code = run_rank(*args)
    finally:
        dist.destroy_process_group()
    if code:
        sys.exit(code)


def run_ranks(run_rank, nproc: int, *args) -> int:
    """run_rank(*args) on every rank (it returns 0 when its checks pass); 0 when every rank
    returned 0, else non-zero. Under torchrun this process is one rank and returns its own code;
    otherwise nproc ranks are spawned here (run_rank must be a module-level function)."""
    if "RANK" in os.environ:
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        try:
            return run_rank(*args)
        finally:
            dist.destroy_process_group()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.spawn(_spawned, args=(nproc, os.path.join(tmp, "rendezvous"), run_rank, args), nprocs=nproc)
        except mp.ProcessRaisedException as e:
            print(e, file=sys.stderr)
            return 1
        except mp.ProcessExitedException as e:
            print(f"a rank failed: {e}", file=sys.stderr)
            return 1
    return 0
