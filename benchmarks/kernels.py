"""Kernel benchmark: TFLOP/s of each softcap kernel at Gemma2 shapes next to cuDNN SDPA without
softcap in the same run, the framework overhead of cps.attention over the raw kernel call, FA4's
two softcap implementations, and flex attention called directly (its Triton and its FA4/CuTe
backends).

    python -m benchmarks.kernels                 # GPU: 9B (16/8 heads, D=256) and 27B (32/16,
                                                 # D=128), S = 8K and 32K, causal, bf16, B=1
    python -m benchmarks.kernels --kernels fa4 fa4-builtin --caps 50
    python -m benchmarks.kernels --dry-run       # CPU: tiny shapes, checks the script only

Kernels (--kernels, or --pairs kernel:cap):
  fa4 flex sdpa fa2 fa3 torch   the library's adapters (what the ring calls per chunk pair):
                                forward then backward; also timed through cps.attention
                                ("cps ovh": its time over the raw call)
  fa4-builtin, fa4-score_mod    the fa4 adapter forced to FA4's own `softcap=` or to the adapter's
                                score_mod (the default on sm90), with their largest relative
                                difference from the default fa4 adapter (out, lse, dq, dk, dv)
  flex-triton, flex-flash       flex_attention compiled with a tanh score_mod, on its Triton and
                                its FLASH (FA4's CuTe) backend; checked against float64 first (out,
                                dq, dk, dv at S=1024), and timed only if exact
cuDNN baseline: F.scaled_dot_product_attention restricted to the cuDNN backend (K/V expanded for
GQA before timing), no softcap, fwd+bwd through autograd. FLOPs and timing: benchmarks/_util.py.
Writes kernels[_TAG].json and .png (a dry run: into $OUT or a new temporary folder).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cp_softcap as cps                                              # noqa: E402
from cp_softcap.kernels import KERNEL_NAMES, get_kernel               # noqa: E402
from cp_softcap.spec import make_spec                                 # noqa: E402
from benchmarks._util import OUT_DIR_HELP, out_dir_for, bench_ms, causal_fwd_flops, report  # noqa: E402

MODELS = {"9B": (16, 8, 256), "27B": (32, 16, 128)}
DRY_MODELS = {"9B": (4, 2, 64), "27B": (4, 4, 32)}
FA4_IMPLS = ("fa4-builtin", "fa4-score_mod")
FLEX_DIRECT = {"flex-triton": "TRITON", "flex-flash": "FLASH"}
CAUSAL = (None, 0)


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
        out, lse = kernel.forward(q, k, v, scale=scale, softcap=softcap, window=CAUSAL)
        if backward:
            kernel.backward(dout, q, k, v, out, lse, scale=scale, softcap=softcap, window=CAUSAL)
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


def adapter(name: str):
    """The kernel object behind a benchmark kernel name (FA4 variants: the fa4 adapter with that
    softcap implementation)."""
    if name in FA4_IMPLS:
        from cp_softcap.kernels.fa4 import FA4Kernel
        return FA4Kernel(softcap_impl=name.split("-", 1)[1])
    return get_kernel(name)


def max_rel_diff(kern, ref, q, k, v, cap) -> float:
    """max |a - b| / max |b| over out, lse, dq, dk, dv of kernel `kern` against kernel `ref`."""
    scale, dout, res = q.shape[-1] ** -0.5, torch.randn_like(q), []
    for kn in (kern, ref):
        out, lse = kn.forward(q, k, v, scale=scale, softcap=cap, window=CAUSAL)
        grads = kn.backward(dout, q, k, v, out, lse, scale=scale, softcap=cap, window=CAUSAL)
        res.append([out.float(), lse] + [g.float() for g in grads])
    return max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(*res))


# ---- flex_attention called directly (not through the adapter)

def flex_fn(backend: str, cap, s: int, device: str):
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
        out = compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                       score_mod=softcap if cap else None, block_mask=mask, enable_gqa=True,
                       kernel_options=opts)
        return out.transpose(1, 2)
    return run


def flex_check(run, device, dtype, cap=50.0, s=1024) -> str:
    """'' if exact vs float64 within bf16 tolerances (saturating logits), else what failed."""
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


def flex_verdicts(names, dev, dtype, cap) -> dict:
    """Each direct flex variant's check against float64 ('exact' or what failed)."""
    verdict = {}
    for name in names:
        if dev != "cuda":
            verdict[name] = "needs CUDA"
            continue
        try:
            verdict[name] = flex_check(flex_fn(FLEX_DIRECT[name], cap, 1024, dev), dev, dtype,
                                       cap) or "exact"
        except Exception as e:              # report, do not time
            verdict[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print(f"{name}: {verdict[name]}")
    return verdict


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--kernels", nargs="+", default=["fa4", "flex", "sdpa", "fa2", "fa3"],
                   choices=list(KERNEL_NAMES) + list(FA4_IMPLS) + list(FLEX_DIRECT))
    p.add_argument("--caps", type=float, nargs="+", default=[50.0, 0.0], help="0 = off")
    p.add_argument("--pairs", nargs="+", default=None,
                   help="kernel:cap pairs instead of kernels x caps, e.g. fa4:50 fa4:0 flex:50 sdpa:0")
    p.add_argument("--rep-ms", type=int, default=200)
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    p.add_argument("--tag", default="", help="suffix of the output files: kernels_<tag>.json")
    p.add_argument("--no-baseline", action="store_true", help="skip the cuDNN F.sdpa rows")
    p.add_argument("--no-cps", action="store_true", help="skip the cps.attention timings")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, torch kernel")
    a = p.parse_args(argv)
    dry = a.dry_run or not torch.cuda.is_available()
    dev = "cpu" if dry else "cuda"
    a.out_dir = out_dir_for(a.out_dir, dry=dry)
    models = DRY_MODELS if dry else MODELS
    if dry:
        a.seqs, a.rep_ms = [256], 10
        if a.pairs is None and a.kernels == p.get_default("kernels"):
            a.kernels = ["torch", "sdpa"]
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    pairs = ([(x.split(":")[0], float(x.split(":")[1])) for x in a.pairs] if a.pairs
             else [(n, c) for n in a.kernels for c in a.caps])
    verdict = flex_verdicts(sorted({n for n, c in pairs if n in FLEX_DIRECT}), dev, dtype,
                            max([c for n, c in pairs if n in FLEX_DIRECT] or [50.0]) or 50.0)
    records, rows = [], [["model", "S", "kernel", "cap", "mode", "ms", "TFLOP/s", "% cuDNN", "cps ovh"]]
    for model in a.models:
        hq, hkv, d = models[model]
        for s in a.seqs:
            q = torch.randn(1, s, hq, d, device=dev, dtype=dtype)
            k = torch.randn(1, s, hkv, d, device=dev, dtype=dtype)
            v = torch.randn(1, s, hkv, d, device=dev, dtype=dtype)
            fwd_flops = causal_fwd_flops(1, hq, s, d)
            base = {}
            for mode, bwd in (("fwd", False), ("fwd+bwd", True)):
                ms = bench_ms(cudnn_baseline(q, k, v, bwd), rep_ms=a.rep_ms)
                base[mode] = (fwd_flops * (3.5 if bwd else 1.0)) / ms / 1e9
                if not a.no_baseline:
                    records.append(dict(model=model, S=s, kernel="cudnn-sdpa (F.sdpa)", softcap=None,
                                        mode=mode, ms=ms, tflops=base[mode]))
                    rows.append([model, s, "cudnn F.sdpa", "-", mode, f"{ms:.2f}", f"{base[mode]:.0f}", "100", ""])
            for name, cap in pairs:
                softcap = cap or None
                diff = None
                for mode, bwd in (("fwd", False), ("fwd+bwd", True)):
                    rec = dict(model=model, S=s, kernel=name, softcap=softcap, mode=mode)
                    if name in FLEX_DIRECT:
                        if verdict[name] != "exact":
                            records.append(dict(rec, skipped=verdict[name]))
                            continue
                        make, cps_make = (lambda bwd: flex_timing(
                            flex_fn(FLEX_DIRECT[name], softcap, s, dev), q, k, v, bwd)), None
                    else:
                        spec = make_spec(head_dim=d, num_heads=hq, num_kv_heads=hkv, dtype=dtype,
                                         device_type=dev, softcap=softcap, causal=True,
                                         needs_backward=bwd)
                        from cp_softcap.selector import rejection
                        reason = rejection(name.split("-")[0], spec)
                        if reason:
                            records.append(dict(rec, skipped=reason))
                            continue
                        kern = adapter(name)
                        make = lambda bwd, kern=kern: raw_kernel(kern, q, k, v, softcap, bwd)  # noqa: E731
                        cps_make = (None if a.no_cps or name in FA4_IMPLS else
                                    (lambda bwd: via_cps(name, q, k, v, softcap, bwd)))
                    try:
                        if name in FA4_IMPLS and diff is None:
                            diff = max_rel_diff(kern, get_kernel("fa4"), q, k, v, softcap)
                        ms = bench_ms(make(bwd), rep_ms=a.rep_ms)
                        ms_cps = bench_ms(cps_make(bwd), rep_ms=a.rep_ms) if cps_make else None
                    except Exception as e:    # report, keep benchmarking the rest
                        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                        records.append(dict(rec, error=msg))
                        rows.append([model, s, name, cap, mode, "ERR", msg[:40], "", ""])
                        continue
                    tf = (fwd_flops * (3.5 if bwd else 1.0)) / ms / 1e9
                    rec.update(ms=ms, tflops=tf, pct_of_cudnn=100 * tf / base[mode],
                               cudnn_tflops_same_run=base[mode])
                    if ms_cps is not None:
                        rec.update(cps_ms=ms_cps, cps_overhead=ms_cps / ms - 1)
                    if diff is not None:
                        rec.update(max_rel_diff_vs_fa4=diff)
                    records.append(rec)
                    rows.append([model, s, name, cap, mode, f"{ms:.2f}", f"{tf:.0f}",
                                 f"{100 * tf / base[mode]:.0f}",
                                 f"{100 * (ms_cps / ms - 1):+.1f}%" if ms_cps is not None else ""])
            del q, k, v
            if dev == "cuda":
                torch.cuda.empty_cache()
    meta = dict(dtype=str(dtype), batch=1, causal=True, models={m: models[m] for m in a.models},
                flex_checks=verdict, flops="causal fwd 4*B*Hq*S^2*D/2; fwd+bwd 3.5x",
                timing="do_bench median")
    report("kernels", records, meta, rows, a.out_dir, a.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
