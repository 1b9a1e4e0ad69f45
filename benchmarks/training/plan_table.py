"""The memory-plan table of examples/gemma2/README.md: train.py --plan's peak per rank for Gemma2 2b/9b/27b at 8K to 1M
tokens on 8 and 64 GPUs (cp = all ranks, batch 1, bf16 autocast, ring, the PyTorch pieces:
--fused torch, the same on every machine), with and without AC and FSDP2. Each cell is one
`train.py --plan` run (in this process).

    python -m benchmarks.training.plan_table [--device-mem-gib 139] [--ac selective] [--out-dir DIR]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]      # the repository and its example

from gemma2 import train  # noqa: E402

VARIANTS = (("none", []), ("AC", ["--ac", "{ac}"]), ("FSDP", ["--fsdp"]),
            ("FSDP+AC", ["--fsdp", "--ac", "{ac}"]))


def plan_peak(argv) -> float:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        train.main(["--plan", *argv])
    return float(re.search(r"peak = .* ([\d.]+) GiB", out.getvalue()).group(1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device-mem-gib", type=float, default=139.0, help="H200: about 139 GiB usable")
    p.add_argument("--ac", default="full", choices=("full", "selective"))
    p.add_argument("--models", nargs="+", default=["2b", "9b", "27b"])
    p.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768, 131072, 524288, 1048576])
    p.add_argument("--out-dir", help="also write plan_table.json (benchmarks/_util.py's format) here")
    p.add_argument("--dry-run", action="store_true", help="one model and length (a check)")
    args = p.parse_args(argv)
    if args.dry_run:
        args.models, args.seqs = args.models[:1], args.seqs[:1]
    head = " | ".join(f"{n} GPUs {v}" for n in (8, 64) for v, _ in VARIANTS)
    print(f"| model | seq | {head} |")
    print("|---|---|" + "---|" * (2 * len(VARIANTS)))
    records = []
    for model in args.models:
        for seq in args.seqs:
            cells = []
            for world in (8, 64):
                for variant, extra in VARIANTS:
                    gib = plan_peak(["--config", model, "--seq-len", str(seq), "--world-size", str(world),
                                     "--batch-size", "1", "--dtype", "bfloat16", "--fused", "torch",
                                     "--device-mem-gib", str(args.device_mem_gib),
                                     *[e.format(ac=args.ac) for e in extra]])
                    cells.append(f"{gib:.0f}" + ("" if gib <= args.device_mem_gib else " ✗"))
                    records.append(dict(model=model, seq=seq, world=world, variant=variant,
                                        peak_gib=gib, fits=gib <= args.device_mem_gib))
            label = f"{seq // 2**20}M" if seq >= 2**20 else f"{seq // 1024}K"
            print(f"| {model} | {label} | " + " | ".join(cells) + " |")
    if args.out_dir:
        from benchmarks._util import save
        print("wrote", save("plan_table", records, dict(device_mem_gib=args.device_mem_gib,
                                                        ac=args.ac, plan="train.py --plan"),
                            args.out_dir))
    return 0

if __name__ == "__main__":
    main()
