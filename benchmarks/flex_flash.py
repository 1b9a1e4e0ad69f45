"""FlexAttention's FlashAttention-4 (CuTe) backend with a softcap score_mod, next to plain flex
(Triton), the fa4 adapter and cuDNN SDPA without softcap, at Gemma2 shapes, causal, bf16.

    python benchmarks/flex_flash.py            # GPU with flash-attn-4 installed
    python benchmarks/flex_flash.py --dry-run  # CPU: checks the script only (tiny, no timing claims)

First checks each flex variant against a float64 reference (out, dq, dk, dv at S = 1024, cap 50,
saturating logits); a variant that errors or is inexact is reported and not timed. Writes
benchmarks/results/flex_flash.json and .png (a dry run: into $OUT or a new temporary folder).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._util import (bench_ms, case_plot, causal_fwd_flops, out_dir_for,  # noqa: E402
                              save, table)
from benchmarks.kernels import MODELS, cudnn_baseline, raw_kernel  # noqa: E402
from cp_softcap.kernels import get_kernel  # noqa: E402


def flex_fn(backend: str, cap: float, s: int, device: str):
    """Compiled flex_attention with a tanh softcap score_mod and a causal block mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def softcap(score, b, h, qi, ki):
        return cap * torch.tanh(score / cap)

    def causal(b, h, qi, ki):
        return qi >= ki
    mask = create_block_mask(causal, None, None, s, s, device=device)
    opts = {"BACKEND": backend} if backend != "TRITON" else None
    compiled = torch.compile(flex_attention, dynamic=False)

    def run(q, k, v):                       # q [B, S, H, D] -> [B, S, H, D]
        out = compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=softcap,
                       block_mask=mask, enable_gqa=True, kernel_options=opts)
        return out.transpose(1, 2)
    return run


def check(run, device, dtype, cap=50.0, s=1024) -> str:
    """'' if exact vs float64 within bf16 tolerances, else what failed."""
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(1, s, 4, 128, generator=g) * 3).to(device, dtype).requires_grad_()
    k = (torch.randn(1, s, 2, 128, generator=g) * 3).to(device, dtype).requires_grad_()
    v = torch.randn(1, s, 2, 128, generator=g).to(device, dtype).requires_grad_()
    dout = torch.randn(1, s, 4, 128, generator=g).to(device, dtype)
    out = run(q, k, v)
    out.backward(dout)
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    kk, vv = (t.repeat_interleave(2, 2) for t in (k64, v64))
    sc = torch.einsum("bqhd,bkhd->bhqk", q64, kk) * 128 ** -0.5
    capped = cap * torch.tanh(sc / cap)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    ref = torch.einsum("bhqk,bkhd->bqhd", capped.masked_fill(~causal, float("-inf")).softmax(-1), vv)
    ref.backward(dout.double().cpu())
    frac = ((sc.abs() > 2 * cap) & causal).float().sum() / causal.sum()
    errs = []
    for name, got, want, tol in (("out", out, ref, 2e-2), ("dq", q.grad, q64.grad, 5e-2),
                                 ("dk", k.grad, k64.grad, 5e-2), ("dv", v.grad, v64.grad, 5e-2)):
        got = got.detach().double().cpu()
        if not torch.isfinite(got).all():
            errs.append(f"{name} not finite")
            continue
        rel = ((got - want).abs().max() / want.abs().max()).item()
        if rel > tol:
            errs.append(f"{name} rel err {rel:.3g} > {tol}")
    if frac < 0.3:
        errs.append(f"inputs do not saturate tanh ({frac:.2f})")
    return "; ".join(errs)


def flex_timing(run, q, k, v, backward: bool):
    qg, kg, vg = (t.detach().requires_grad_(backward) for t in (q, k, v))
    dout = torch.randn_like(q)

    def step():
        out = run(qg, kg, vg)
        if backward:
            out.backward(dout)
        return out
    return step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--models", nargs="+", default=["9B", "27B"])
    p.add_argument("--cap", type=float, default=50.0)
    p.add_argument("--rep-ms", type=int, default=150)
    p.add_argument("--out-dir", default=None, help="default: benchmarks/results (dry run: $OUT or a temp dir)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton-free check")
    a = p.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() and not a.dry_run else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    out_dir = out_dir_for(a.out_dir, a.dry_run or dev == "cpu")
    backends = ["TRITON", "FLASH"] if dev == "cuda" else []
    verdict = {}
    for b in backends:
        try:
            verdict[b] = check(flex_fn(b, a.cap, 1024, dev), dev, dtype, a.cap) or "exact"
        except Exception as e:              # report, do not time
            verdict[b] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print(f"flex {b}: {verdict[b]}")
    if dev == "cpu":
        a.seqs, a.models = [256], ["9B"]
    records, rows = [], [["model", "S", "impl", "mode", "ms", "TFLOP/s", "% cuDNN"]]
    fa4 = get_kernel("fa4")
    for model in a.models:
        hq, hkv, d = MODELS[model]
        for s in a.seqs:
            q, k, v = (torch.randn(1, s, h, d, device=dev, dtype=dtype) for h in (hq, hkv, hkv))
            flops = causal_fwd_flops(1, hq, s, d)
            impls = {"cudnn (no cap)": lambda bwd: cudnn_baseline(q, k, v, bwd)}
            if dev == "cuda":
                impls["fa4 adapter"] = lambda bwd: raw_kernel(fa4, q, k, v, a.cap, bwd)
            for b in backends:
                if verdict[b] == "exact":
                    impls[f"flex {b}"] = (lambda bwd, b=b: flex_timing(flex_fn(b, a.cap, s, dev),
                                                                       q, k, v, bwd))
            base = {}
            for name, make in impls.items():
                for mode, bwd in (("fwd", False), ("fwd+bwd", True)):
                    try:
                        ms = bench_ms(make(bwd), rep_ms=a.rep_ms)
                    except Exception as e:
                        records.append(dict(model=model, S=s, impl=name, mode=mode,
                                            error=f"{type(e).__name__}: {str(e)[:200]}"))
                        continue
                    tf = flops * (3.5 if bwd else 1.0) / ms / 1e9
                    base.setdefault(mode, tf)
                    records.append(dict(model=model, S=s, impl=name, mode=mode, ms=ms, tflops=tf,
                                        pct_of_cudnn=100 * tf / base[mode]))
                    rows.append([model, s, name, mode, f"{ms:.2f}", f"{tf:.0f}",
                                 f"{100 * tf / base[mode]:.0f}"])
            del q, k, v
    meta = dict(dtype=str(dtype), causal=True, softcap=a.cap, check=verdict,
                flops="causal fwd 4*B*Hq*S^2*D/2; fwd+bwd 3.5x", timing="do_bench median")
    path = save("flex_flash", records, meta, out_dir)
    case_plot(os.path.join(out_dir, "flex_flash.png"), records, lambda r: r["impl"], "TFLOP/s",
              f"flex FA4 backend vs flex Triton vs fa4 adapter, softcap {a.cap}, bf16, B=1")
    print(table(rows))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
