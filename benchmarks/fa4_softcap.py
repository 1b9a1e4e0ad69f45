"""FA4 softcap implementations side by side: FA4's own `softcap=` against the adapter's
score_mod (cp_softcap/kernels/fa4_softcap.py), at Gemma2 shapes, next to cuDNN SDPA without
softcap in the same run, plus how far the two implementations' results are apart.

    python benchmarks/fa4_softcap.py            # H200: 9B / 27B heads, S = 8K and 32K, cap 50
    python benchmarks/fa4_softcap.py --dry-run  # CPU: checks the script only (torch kernel)

Writes benchmarks/results/fa4_softcap.json and .png (a dry run: into $OUT or a new temporary
folder). Same conventions as kernels.py.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cp_softcap.kernels import get_kernel                              # noqa: E402
from benchmarks._util import OUT_DIR_HELP, out_dir_for, bench_ms, causal_fwd_flops, report  # noqa: E402
from benchmarks.kernels import MODELS, cudnn_baseline, raw_kernel     # noqa: E402


def impls(dry: bool):
    if dry:
        return {"torch": get_kernel("torch")}
    from cp_softcap.kernels.fa4 import FA4Kernel
    return {f"fa4 {impl}": FA4Kernel(softcap_impl=impl) for impl in ("builtin", "score_mod")}


def max_rel_diff(kernels, q, k, v, cap):
    """max |a - b| / max |a| over out and dq/dk/dv between the first kernel and each other."""
    scale, dout, res = q.shape[-1] ** -0.5, torch.randn_like(q), []
    for kern in kernels.values():
        out, lse = kern.forward(q, k, v, scale=scale, softcap=cap, window=(None, 0))
        grads = kern.backward(dout, q, k, v, out, lse, scale=scale, softcap=cap, window=(None, 0))
        res.append([out.float(), lse] + list(grads))
    ref = res[0]
    return [max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(r, ref))
            for r in res[1:]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--softcap", type=float, default=50.0)
    p.add_argument("--rep-ms", type=int, default=200)
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args(argv)
    dry = a.dry_run or not torch.cuda.is_available()
    a.out_dir = out_dir_for(a.out_dir, dry=dry)
    dev, dtype = ("cpu", torch.float32) if dry else ("cuda", torch.bfloat16)
    if dry:
        a.seqs, a.rep_ms = [256], 10
        MODELS.update({"9B": (4, 2, 64), "27B": (4, 4, 32)})
    kernels = impls(dry)
    records, rows = [], [["model", "S", "kernel", "mode", "ms", "TFLOP/s", "% cuDNN", "diff vs 1st"]]
    for model in a.models:
        hq, hkv, d = MODELS[model]
        for s in a.seqs:
            q, k, v = (torch.randn(1, s, h, d, device=dev, dtype=dtype) for h in (hq, hkv, hkv))
            diffs = [0.0] + max_rel_diff(kernels, q, k, v, a.softcap)
            flops = causal_fwd_flops(1, hq, s, d)
            for mode, bwd in (("fwd", False), ("fwd+bwd", True)):
                mult = 3.5 if bwd else 1.0
                base_ms = bench_ms(cudnn_baseline(q, k, v, bwd), rep_ms=a.rep_ms)
                base = flops * mult / base_ms / 1e9
                records.append(dict(model=model, S=s, kernel="cudnn-sdpa (F.sdpa)", softcap=None,
                                    mode=mode, ms=base_ms, tflops=base))
                rows.append([model, s, "cudnn F.sdpa", mode, f"{base_ms:.2f}", f"{base:.0f}", "100", ""])
                for (name, kern), diff in zip(kernels.items(), diffs):
                    ms = bench_ms(raw_kernel(kern, q, k, v, a.softcap, bwd), rep_ms=a.rep_ms)
                    tf = flops * mult / ms / 1e9
                    records.append(dict(model=model, S=s, kernel=name, softcap=a.softcap, mode=mode,
                                        ms=ms, tflops=tf, pct_of_cudnn=100 * tf / base,
                                        max_rel_diff_vs_first=diff))
                    rows.append([model, s, name, mode, f"{ms:.2f}", f"{tf:.0f}",
                                 f"{100 * tf / base:.0f}", f"{diff:.1e}"])
            del q, k, v
    meta = dict(dtype=str(dtype), batch=1, causal=True, softcap=a.softcap,
                models={m: MODELS[m] for m in a.models},
                flops="causal fwd 4*B*Hq*S^2*D/2; fwd+bwd 3.5x", timing="do_bench median")
    report("fa4_softcap", records, meta, rows, a.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
