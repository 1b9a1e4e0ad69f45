"""Kernel benchmark: TFLOP/s of every available kernel at Gemma2 shapes, next to cuDNN SDPA
without softcap in the same run, plus the framework overhead of cps.attention over the raw kernel.

    python benchmarks/kernels.py                 # H200: 9B (16/8 heads, D=256) and 27B (32/16,
                                                 # D=128), S = 8K and 32K, causal, bf16, B=1
    python benchmarks/kernels.py --dry-run       # CPU: tiny shapes, checks the script only

Writes benchmarks/results/kernels.json and kernels.png (a dry run: into $OUT or a new temporary
folder). Conventions: causal forward FLOPs 4*B*Hq*S^2*D/2, fwd+bwd = 3.5x forward; median of triton.testing.do_bench after a warm-up.
Raw kernel fwd+bwd = adapter forward then adapter backward (what the ring calls per pair);
cuDNN baseline = F.scaled_dot_product_attention restricted to the cuDNN backend (K/V expanded
for GQA before timing), fwd+bwd through autograd.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cp_softcap as cps                                              # noqa: E402
from cp_softcap.kernels import get_kernel                             # noqa: E402
from cp_softcap.spec import make_spec                                 # noqa: E402
from benchmarks._util import OUT_DIR_HELP, out_dir_for, bench_ms, causal_fwd_flops, report  # noqa: E402

MODELS = {"9B": (16, 8, 256), "27B": (32, 16, 128)}


def cudnn_baseline(q, k, v, backward: bool):
    """F.sdpa with the cuDNN backend, no softcap, causal; K/V pre-expanded for GQA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    g = q.shape[2] // k.shape[2]
    qt = q.transpose(1, 2).detach().requires_grad_(backward)
    kt = k.repeat_interleave(g, 2).transpose(1, 2).detach().requires_grad_(backward)
    vt = v.repeat_interleave(g, 2).transpose(1, 2).detach().requires_grad_(backward)
    dout = torch.randn_like(qt)
    backend = SDPBackend.CUDNN_ATTENTION if q.is_cuda else SDPBackend.MATH

    def run():
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        if backward:
            out.backward(dout)
        return out
    return run


def raw_kernel(kernel, q, k, v, softcap, backward: bool):
    scale = q.shape[-1] ** -0.5
    dout = torch.randn_like(q)

    def run():
        out, lse = kernel.forward(q, k, v, scale=scale, softcap=softcap, window=(None, 0))
        if backward:
            kernel.backward(dout, q, k, v, out, lse, scale=scale, softcap=softcap, window=(None, 0))
        return out
    return run


def via_cps(name, q, k, v, softcap, backward: bool):
    qg, kg, vg = (t.detach().requires_grad_(backward) for t in (q, k, v))
    dout = torch.randn_like(q)

    def run():
        out = cps.attention(qg, kg, vg, softcap=softcap, causal=True, backend=name)
        if backward:
            out.backward(dout)
        return out
    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--kernels", nargs="+", default=["fa4", "flex", "sdpa", "fa2", "fa3"])
    p.add_argument("--caps", type=float, nargs="+", default=[50.0, 0.0], help="0 = off")
    p.add_argument("--pairs", nargs="+", default=None,
                   help="kernel:cap pairs instead of kernels x caps, e.g. fa4:50 fa4:0 flex:50 sdpa:0")
    p.add_argument("--rep-ms", type=int, default=200)
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    p.add_argument("--tag", default="", help="suffix of the output files: kernels_<tag>.json")
    p.add_argument("--no-baseline", action="store_true", help="skip the cuDNN F.sdpa rows")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, torch kernel")
    a = p.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a.out_dir = out_dir_for(a.out_dir, dry=a.dry_run or dev == "cpu")
    if a.dry_run or dev == "cpu":
        a.seqs, a.kernels, a.rep_ms, a.pairs = [256], ["torch", "sdpa"], 10, None
        MODELS.update({"9B": (4, 2, 64), "27B": (4, 4, 32)})
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    records, rows = [], [["model", "S", "kernel", "cap", "mode", "ms", "TFLOP/s", "% cuDNN", "cps ovh"]]
    for model in a.models:
        hq, hkv, d = MODELS[model]
        for s in a.seqs:
            q = torch.randn(1, s, hq, d, device=dev, dtype=dtype)
            k = torch.randn(1, s, hkv, d, device=dev, dtype=dtype)
            v = torch.randn(1, s, hkv, d, device=dev, dtype=dtype)
            fwd_flops = causal_fwd_flops(1, hq, s, d)
            base = {}
            for mode, bwd in (("fwd", False), ("fwd+bwd", True)):
                ms = bench_ms(cudnn_baseline(q, k, v, bwd), rep_ms=a.rep_ms)
                del_rows = a.no_baseline
                base[mode] = (fwd_flops * (3.5 if bwd else 1.0)) / ms / 1e9
                if not del_rows:
                    records.append(dict(model=model, S=s, kernel="cudnn-sdpa (F.sdpa)", softcap=None,
                                        mode=mode, ms=ms, tflops=base[mode]))
                    rows.append([model, s, "cudnn F.sdpa", "-", mode, f"{ms:.2f}", f"{base[mode]:.0f}", "100", ""])
            pairs = ([(x.split(":")[0], float(x.split(":")[1])) for x in a.pairs] if a.pairs
                     else [(n, c) for n in a.kernels for c in a.caps])
            for name, cap in pairs:
                if True:
                    softcap = cap or None
                    for mode, bwd in (("fwd", False), ("fwd+bwd", True)):
                        spec = make_spec(head_dim=d, num_heads=hq, num_kv_heads=hkv, dtype=dtype,
                                         device_type=dev, softcap=softcap, causal=True,
                                         needs_backward=bwd)
                        from cp_softcap.selector import rejection
                        reason = rejection(name, spec)
                        if reason:
                            records.append(dict(model=model, S=s, kernel=name, softcap=softcap,
                                                mode=mode, skipped=reason))
                            continue
                        kern = get_kernel(name)
                        try:
                            ms = bench_ms(raw_kernel(kern, q, k, v, softcap, bwd), rep_ms=a.rep_ms)
                            ms_cps = bench_ms(via_cps(name, q, k, v, softcap, bwd), rep_ms=a.rep_ms)
                        except Exception as e:    # report, keep benchmarking the rest
                            msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                            records.append(dict(model=model, S=s, kernel=name, softcap=softcap,
                                                mode=mode, error=msg))
                            rows.append([model, s, name, cap, mode, "ERR", msg[:40], "", ""])
                            continue
                        tf = (fwd_flops * (3.5 if bwd else 1.0)) / ms / 1e9
                        ovh = ms_cps / ms - 1
                        records.append(dict(model=model, S=s, kernel=name, softcap=softcap, mode=mode,
                                            ms=ms, tflops=tf, pct_of_cudnn=100 * tf / base[mode],
                                            cudnn_tflops_same_run=base[mode],
                                            cps_ms=ms_cps, cps_overhead=ovh))
                        rows.append([model, s, name, cap, mode, f"{ms:.2f}", f"{tf:.0f}",
                                     f"{100 * tf / base[mode]:.0f}", f"{100 * ovh:+.1f}%"])
            del q, k, v
            if dev == "cuda":
                torch.cuda.empty_cache()
    meta = dict(dtype=str(dtype), batch=1, causal=True, models={m: MODELS[m] for m in a.models},
                flops="causal fwd 4*B*Hq*S^2*D/2; fwd+bwd 3.5x", timing="do_bench median")
    report("kernels", records, meta, rows, a.out_dir, a.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
