"""README's memory-plan table: train.py --plan's peak per rank for Gemma2 2b/9b/27b at 8K to 1M
tokens on 8 and 64 GPUs (cp = all ranks, batch 1, bf16 autocast, ring, the PyTorch pieces:
--fused torch, the same on every machine), with and without AC and FSDP2. Each cell is one
`train.py --plan` run (in this process).

    python examples/gemma2/plan_table.py [--device-mem-gib 139] [--ac selective]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gemma2 import train  # noqa: E402

VARIANTS = (("none", []), ("AC", ["--ac", "{ac}"]), ("FSDP", ["--fsdp"]),
            ("FSDP+AC", ["--fsdp", "--ac", "{ac}"]))


def plan_peak(argv) -> float:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        train.main(["--plan", *argv])
    return float(re.search(r"peak = .* ([\d.]+) GiB", out.getvalue()).group(1))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device-mem-gib", type=float, default=139.0, help="H200: about 139 GiB usable")
    p.add_argument("--ac", default="full", choices=("full", "selective"))
    args = p.parse_args(argv)
    head = " | ".join(f"{n} GPUs {v}" for n in (8, 64) for v, _ in VARIANTS)
    print(f"| model | seq | {head} |")
    print("|---|---|" + "---|" * (2 * len(VARIANTS)))
    for model in ("2b", "9b", "27b"):
        for seq in (8192, 32768, 131072, 524288, 1048576):
            cells = []
            for world in (8, 64):
                for _, extra in VARIANTS:
                    gib = plan_peak(["--config", model, "--seq-len", str(seq), "--world-size", str(world),
                                     "--batch-size", "1", "--dtype", "bfloat16", "--fused", "torch",
                                     "--device-mem-gib", str(args.device_mem_gib),
                                     *[e.format(ac=args.ac) for e in extra]])
                    cells.append(f"{gib:.0f}" + ("" if gib <= args.device_mem_gib else " ✗"))
            label = f"{seq // 2**20}M" if seq >= 2**20 else f"{seq // 1024}K"
            print(f"| {model} | {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
