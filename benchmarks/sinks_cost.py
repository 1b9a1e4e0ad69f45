"""What attention sinks cost: `cps.attention(..., sinks=)` against the same call without them,
at gpt-oss's attention shape (64 query heads of dim 64, 8 KV heads; its sliding layers' window
of 128 keys and its full causal layers), per kernel, forward and forward+backward.

    python benchmarks/sinks_cost.py            # GPU: fa4, fa2, flex; S = 8K and 32K
    python benchmarks/sinks_cost.py --dry-run  # CPU: checks the script only (torch kernel)

The sinks are applied after the kernel (one elementwise pass over the output and LSE, and
the sink-gradient reduction in the backward), so the cost is a fixed per-token amount: the
ratio falls with the attention's own work (more for full causal layers than for windowed ones).
Writes benchmarks/results/sinks_cost.json and .png (a dry run: into $OUT or a temporary folder).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cp_softcap as cps                                                          # noqa: E402
from benchmarks._util import OUT_DIR_HELP, bench_ms, out_dir_for, report          # noqa: E402

GPT_OSS = (64, 8, 64)                  # query heads, KV heads, head dim
LAYERS = {"sliding": (127, 0), "full": None}


def _call(q, k, v, sinks, backend, window, bwd):
    dout = torch.randn_like(q)

    def run():
        out = cps.attention(q, k, v, sinks=sinks, backend=backend, causal=True, window=window)
        if bwd:
            out.backward(dout)
    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--backends", nargs="+", default=["fa4", "fa2", "flex"])
    p.add_argument("--rep-ms", type=int, default=200)
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args(argv)
    dry = a.dry_run or not torch.cuda.is_available()
    a.out_dir = out_dir_for(a.out_dir, dry=dry)
    dev, dtype = ("cpu", torch.float32) if dry else ("cuda", torch.bfloat16)
    hq, hkv, d = (8, 2, 16) if dry else GPT_OSS
    if dry:
        a.seqs, a.rep_ms, a.backends = [256], 10, ["torch"]
    records, rows = [], [["kernel", "layer", "S", "mode", "ms no sinks", "ms sinks", "ratio"]]
    for backend in a.backends:
        for s in a.seqs:
            q, k, v = (torch.randn(1, s, h, d, device=dev, dtype=dtype, requires_grad=True)
                       for h in (hq, hkv, hkv))
            sinks = torch.randn(hq, device=dev, dtype=torch.float32, requires_grad=True)
            for layer, window in LAYERS.items():
                for mode, bwd in (("fwd", False), ("fwd+bwd", True)):
                    ctx = torch.enable_grad() if bwd else torch.no_grad()
                    with ctx:
                        try:
                            base = bench_ms(_call(q, k, v, None, backend, window, bwd), rep_ms=a.rep_ms)
                            with_s = bench_ms(_call(q, k, v, sinks, backend, window, bwd),
                                              rep_ms=a.rep_ms)
                        except (RuntimeError, ValueError, ImportError) as e:
                            records.append(dict(kernel=backend, layer=layer, S=s, mode=mode,
                                                error=f"{type(e).__name__}: {e}"[:300]))
                            rows.append([backend, layer, s, mode, "error", str(e)[:40], ""])
                            continue
                    records.append(dict(kernel=backend, layer=layer, S=s, mode=mode,
                                        ms_without=base, ms_with=with_s, ratio=with_s / base))
                    rows.append([backend, layer, s, mode, f"{base:.3f}", f"{with_s:.3f}",
                                 f"{with_s / base:.3f}"])
            del q, k, v, sinks
    meta = dict(dtype=str(dtype), batch=1, causal=True, heads=(hq, hkv, d), layers=LAYERS,
                timing="do_bench median; ratio = with sinks / without, same run")
    report("sinks_cost", records, meta, rows, a.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
