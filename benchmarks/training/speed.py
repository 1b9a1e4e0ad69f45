"""Step time of train.py's training step with each Liger piece on and off, on one model, and a
torch.profiler table of the top kernels: which fused kernels win, and where the time goes.

    python -m benchmarks.training.speed --config 2b --seq-len 8192 --batch-size 1 --out-dir DIR

Takes train.py's flags (--fused is ignored: every variant is tried). One model is built; for
each variant (all four Liger pieces; each piece on PyTorch with the other three on Liger; all
PyTorch) it runs --warm untimed steps, then --steps timed ones, and records the median step
time, tokens/s, MFU (flops.py) and torch.cuda.max_memory_allocated over the variant's steps (or
the out-of-memory error of a variant that does not fit; the others still run). Then it profiles
two steps of the first variant that fits (what --fused auto picks) and prints the kernels with the
most GPU time (--profile-table writes the table to a file; --trace the Chrome trace, and prints
where the GPU waited between kernels, gaps.py). On CPU the Liger variants are skipped (Liger's
kernels are GPU-only). Writes speed[_TAG].json (benchmarks/_util.py's record format) with
--out-dir.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]      # the repository and its example

from gemma2.allocator import expandable_segments  # noqa: E402

expandable_segments()           # before torch is imported (allocator.py says why)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.training import gaps  # noqa: E402
from gemma2 import flags, fused, metrics, parallel, train  # noqa: E402


def _extra(argv):
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--warm", type=int, default=2, help="untimed steps per variant")
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant (median)")
    p.add_argument("--variants", type=int, default=None, help="time only the first N variants")
    p.add_argument("--no-profile", action="store_true", help="skip the profiled steps")
    p.add_argument("--out-dir", help="write speed[_TAG].json here (rank 0)")
    p.add_argument("--tag", default="", help="suffix of the output name")
    p.add_argument("--profile-table", help="write the profiler's top-kernel table here")
    p.add_argument("--top", type=int, default=25, help="rows of the top-kernel table")
    p.add_argument("--trace", help="write the profiled steps' Chrome trace here (.json or .json.gz) "
                   "and print where the GPU waited (gaps.py)")
    return p.parse_known_args(argv)


def variants(device_type: str, compile: bool = False):
    """(name, Liger pieces) of each timed variant: all of Liger's pieces (the default on CUDA),
    then each piece in turn on PyTorch with the others on Liger (so a row's difference from the
    first is that one piece's cost, not mixed with a slower piece elsewhere), then all PyTorch.
    With --compile: what --fused auto picks there (Liger's loss only, inductor fusing the rest),
    then all four Liger pieces, then none."""
    if device_type != "cuda" or fused.liger_problem():
        return [("torch", ())]
    if compile:
        return [("compile, liger loss", fused.choose("auto", device_type, compile=True)),
                ("compile, liger", fused.PIECES), ("compile, torch", ())]
    return ([("liger", fused.PIECES)]
            + [(f"torch {p}", tuple(x for x in fused.PIECES if x != p)) for p in fused.PIECES]
            + [("torch", ())])


def main(argv=None) -> None:
    extra, rest = _extra(sys.argv[1:] if argv is None else argv)
    args, cfg, world = flags.parse(rest + ["--fused", "torch"], __doc__)
    d = parallel.init(args.cp, args.device)
    model, opt, tokens = train.build(args, cfg, d)
    dtype = getattr(torch, flags.compute_dtype(args))
    autocast = torch.autocast(d.device.type, dtype=dtype, enabled=dtype != torch.float32)
    cuda = d.device.type == "cuda"
    tok = args.batch_size * args.seq_len / d.cp
    step = 0
    lines = []
    for name, pieces in variants(d.device.type, args.compile)[:extra.variants]:
        fused.apply(model, pieces)
        times = []
        if cuda:
            torch.cuda.reset_peak_memory_stats(d.device)
        oom = None
        try:
            for i in range(extra.warm + extra.steps):
                t0 = time.perf_counter()
                loss, _, _, flops = train.train_step(model, opt, tokens, step, args, cfg, d, autocast)
                if cuda:
                    torch.cuda.synchronize(d.device)
                if i >= extra.warm:
                    times.append(time.perf_counter() - t0)
                step += 1
        except torch.OutOfMemoryError as e:
            # A variant that does not fit is a result too; the others still run.
            oom = str(e).split(". ")[0]
        if oom is not None:
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.empty_cache()
            rec = {"variant": name, "liger": list(pieces), "flags": " ".join(rest), "error": oom}
        else:
            s = statistics.median(times)
            rec = {"variant": name, "liger": list(pieces), "flags": " ".join(rest), "step_s": s,
                   "tokens_per_s": tok / s, "tflops": tok * flops / s / 1e12,
                   "mfu": tok * flops / s / metrics.PEAK_FLOPS if cuda else None,
                   "memory_gib": metrics.peak_memory_gib(d.device),
                   "alloc_retries": metrics.alloc_retries(d.device), "loss": loss}
        lines.append(rec)
        print(json.dumps(rec), flush=True)
    if extra.out_dir and d.rank == 0:
        from benchmarks._util import save
        meta = dict(flags=" ".join(rest), warm=extra.warm, steps=extra.steps,
                    peak_flops=metrics.PEAK_FLOPS if cuda else None,
                    timing="median wall time of the timed steps (synchronized)")
        print("wrote", save("speed" + (f"_{extra.tag}" if extra.tag else ""), lines, meta,
                            extra.out_dir), flush=True)
    fit = [r for r in lines if "error" not in r]
    if not fit or extra.no_profile:
        print("no variant fits: no profile" if not fit else "no profile (--no-profile)", flush=True)
        dist.destroy_process_group()
        return
    prof_rec = fit[0]                                # the first that fits: --fused auto's pick
    fused.apply(model, tuple(prof_rec["liger"]))
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(2):
            train.train_step(model, opt, tokens, step, args, cfg, d, autocast)
            step += 1
        if cuda:
            torch.cuda.synchronize(d.device)
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=extra.top, max_name_column_width=70)
    head = f"top kernels by {key}, 2 steps, variant {prof_rec['variant']}, {' '.join(rest)}\n"
    print(head + table, flush=True)
    if extra.profile_table and d.rank == 0:
        with open(extra.profile_table, "w") as f:
            f.write(head + table)
    if extra.trace and d.rank == 0:
        prof.export_chrome_trace(extra.trace)
        print(gaps.render(gaps.gaps(gaps.load(extra.trace))), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
