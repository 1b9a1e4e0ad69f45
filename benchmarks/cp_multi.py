"""Real context parallelism: cps.cp_attention under torchrun with NCCL, one GPU per rank.

    torchrun --nproc-per-node N benchmarks/cp_multi.py [--seqs 32768 131072] [--comms ring all_gather a2a auto]
    torchrun --nproc-per-node 8 benchmarks/cp_multi.py --a2a-size 2 4     # adds a2a+p2p (groups of 2, 4)
    torchrun --nproc-per-node 8 benchmarks/cp_multi.py --window 4095      # Gemma2's local layers
    python benchmarks/cp_multi.py --dry-run       # CPU, gloo, world size 1: checks the script

For each S and comm: fwd+bwd time of cps.cp_attention on the local zigzag shards (max over ranks,
median of do_bench), softcap 50, Gemma2-9B heads (16/8, D=256) by default, against the ideal
= single-GPU full attention (cps.attention, measured on rank 0 alone) / N.
ratio = cp time / ideal (1.0 = perfect). N = 1 runs the single-device path (group of size 1).
Writes benchmarks/results/cp_multi_N<N>[_tag].json and .png on rank 0 (a dry run: into $OUT
or a new temporary folder, never into the tracked results).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cp_softcap as cps                                           # noqa: E402
from cp_softcap.sharding import shard                              # noqa: E402
from benchmarks._util import OUT_DIR_HELP, out_dir_for, bench_ms, report  # noqa: E402


def fwd_bwd(fn, q, k, v, dout):
    def run():
        out = fn(q, k, v)
        out.backward(dout)
    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--comms", nargs="+", default=["ring", "all_gather", "a2a", "auto"])
    p.add_argument("--a2a-size", type=int, nargs="*", default=[],
                   help="also run comm='a2a+p2p' with a2a groups of these sizes (each divides N)")
    p.add_argument("--window", type=int, default=None, help="sliding window left size (causal)")
    p.add_argument("--heads", type=int, nargs=3, default=[16, 8, 256], metavar=("HQ", "HKV", "D"))
    p.add_argument("--softcap", type=float, default=50.0)
    p.add_argument("--rep-ms", type=int, default=300)
    p.add_argument("--tag", default="", help="suffix of the output files: cp_multi_N<N>_<tag>.json")
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.dry_run
    a.out_dir = out_dir_for(a.out_dir, dry=not cuda)
    if "RANK" not in os.environ:                     # plain python: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    hq, hkv, d = a.heads
    if not cuda:
        a.seqs, (hq, hkv, d), a.rep_ms = [256 * world], (4, 2, 32), 10
    window = None if a.window is None else (a.window, 0)
    runs = [(c, dist.group.WORLD) for c in a.comms]            # (label, group)
    for size in a.a2a_size:                                   # collective: every rank builds them
        runs.append((f"a2a+p2p/{size}", cps.make_hybrid_groups(None, size)))
    dtype = torch.bfloat16 if cuda else torch.float32
    records, rows = [], [["S", "N", "comm", "cp ms", "ideal ms", "ratio"]]
    for s in a.seqs:
        g = torch.Generator(device="cpu").manual_seed(0)
        full = [torch.randn(1, s, h, d, generator=g).to(dev, dtype) for h in (hq, hkv, hkv, hq)]
        ideal = None
        if rank == 0:
            qf, kf, vf = (t.clone().requires_grad_() for t in full[:3])
            single = lambda q, k, v: cps.attention(q, k, v, softcap=a.softcap, causal=True,  # noqa: E731
                                                   window=window)
            ideal = bench_ms(fwd_bwd(single, qf, kf, vf, full[3]), rep_ms=a.rep_ms) / world
            del qf, kf, vf
        ideal_t = torch.tensor([ideal or 0.0], device=dev)
        dist.broadcast(ideal_t, 0)
        local = [shard(t, world, rank).contiguous() for t in full]
        del full
        for label, group in runs:
            comm = label.split("/")[0]
            q, k, v = (t.clone().requires_grad_() for t in local[:3])
            fn = lambda q, k, v, c=comm, g=group: cps.cp_attention(  # noqa: E731
                q, k, v, g, softcap=a.softcap, causal=True, window=window, comm=c)
            try:
                ms = bench_ms(fwd_bwd(fn, q, k, v, local[3]), rep_ms=a.rep_ms)
                err = ""
            except Exception as e:           # e.g. a2a needs heads divisible by N
                ms, err = float("nan"), f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            t = torch.tensor([ms], device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            ms = t.item()
            ratio = ms / ideal_t.item()
            records.append(dict(S=s, N=world, comm=label, ms=ms, ideal_ms=ideal_t.item(), ratio=ratio,
                                error=err or None))
            rows.append([s, world, label, f"{ms:.2f}" if not err else "ERR " + err[:40],
                         f"{ideal_t.item():.2f}", f"{ratio:.3f}"])
    if rank == 0:
        meta = dict(world=world, heads=[hq, hkv, d], softcap=a.softcap, dtype=str(dtype), window=window,
                    backend="nccl" if cuda else "gloo",
                    ratio="max-over-ranks fwd+bwd time / (single-GPU full attention / N)")
        report(f"cp_multi_N{world}", records, meta, rows, a.out_dir, a.tag)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
