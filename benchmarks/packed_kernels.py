"""Packed documents on one GPU: `cps.attention(cu_seqlens=)` with each kernel that serves
segments (fa4, fa2, flex), next to cuDNN SDPA (no softcap) on a dense causal call of the same
visible area, in one run.

    python -m benchmarks.packed_kernels              # GPU: 128K streams, 9B and 27B heads
    python -m benchmarks.packed_kernels --dry-run    # CPU, tiny shapes, torch kernel only

Streams: benchmarks/packing_balance.mix (seed 0), the same as the packing and cp_sim benchmarks:
"long-tail" (document lengths 16..32K, log-uniform) and "short" (64..2K). Causal, softcap 50.
TFLOP/s are of the VISIBLE area only (the (query, key) pairs attention computes):
    area = sum over documents of n (n + 1) / 2 ;  forward FLOPs = 4 * Hq * D * area ;
    forward + backward = 3.5 x forward.
The baseline is one dense causal cuDNN call whose length S has about the same area
(S = sqrt(2 * area), rounded to 128), rated by the same formula on its own area, so
"% cuDNN" compares rates, not times. The rows "fa4-kernel" and "fa4-kernel-nocap" are FA4's own
varlen function on the same documents without the library, with the library's softcap and
without any: a gap to cuDNN splits into the document structure's share (nocap), the softcap's
and the library's. The rows "cudnn-varlen" and "flash-varlen" are PyTorch's own varlen kernels
(SDPA on nested tensors, no cap) on the same documents: what the best uncapped kernels reach on
this document structure. The row "library-only" runs the library with a kernel that does no
work (FreeKernel): the library's own time per call. The rows "fa4-call" and
"fa4-call-expanded-bwd" time the library's FA4 kernel as one varlen call with its GQA backward
as it is and on K/V repeated to the query heads (expanded_backward_call). Writes packed_kernels[_tag].json and .png.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cp_softcap as cps                                              # noqa: E402
from cp_softcap.doc_geometry import stream_calls                      # noqa: E402
from cp_softcap.kernels.torch_kernel import TorchKernel               # noqa: E402
from cp_softcap.selector import rejection                             # noqa: E402
from cp_softcap.spec import make_spec                                 # noqa: E402
from benchmarks._util import OUT_DIR_HELP, bar_plot, bench_ms, out_dir_for, report  # noqa: E402
from benchmarks.kernels import MODELS, cudnn_baseline                 # noqa: E402
from benchmarks.packing_balance import mix                            # noqa: E402

MIXES = ("long-tail", "short")
RAW = {"fa4-kernel": True, "fa4-kernel-nocap": False}     # FA4 alone: with --softcap or none
NJT = ("cudnn-varlen", "flash-varlen")      # PyTorch's own varlen kernels (no cap), via SDPA
# the library's FA4 kernel as one varlen call: its backward on the KV heads, or on K/V repeated
# to the query heads with dK/dV summed over each group (expanded_backward_call)
EXPANDED = {"fa4-call": False, "fa4-call-expanded-bwd": True}
FREE = "library-only"                       # the library's time around the calls, kernel excluded


class FreeKernel(TorchKernel):
    """Returns at once what a flash kernel returns (out and gradients in the input dtype, LSE
    float32), values unset: timing through it leaves the library's own time (planning, the
    calls' row and key slices, output and gradient buffers, casts)."""
    name = "free"
    caps = dataclasses.replace(TorchKernel.caps, grads_in_input_dtype=True,
                               notes=("timing stand-in: no math",))

    def forward(self, q, k, v, *, scale, softcap, window, segments=None):
        b, s, h, _ = q.shape
        return (torch.empty(b, s, h, v.shape[-1], dtype=q.dtype, device=q.device),
                torch.empty(b, h, s, dtype=torch.float32, device=q.device))

    def backward(self, dout, q, k, v, out, lse, *, scale, softcap, window, dlse=None, segments=None):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def visible_area(cu: List[int]) -> int:
    """(query, key) pairs of causal attention within each document: the area of the calls the
    library makes for the stream."""
    return sum(c.area() for c in stream_calls(tuple(cu), cu[-1], (None, 0)))


def packed_call(name, q, k, v, cu, softcap, backward: bool):
    qg, kg, vg = (t.detach().requires_grad_(backward) for t in (q, k, v))
    dout = torch.randn_like(q)

    def run():
        out = cps.attention(qg, kg, vg, softcap=softcap, causal=True, cu_seqlens=cu, backend=name)
        if backward:
            out.backward(dout)
        return out
    return run


def fa4_raw_call(q, k, v, cu, softcap, backward: bool):
    """FA4's own varlen function with no library in between, with the softcap as the library
    applies it (softcap_kwargs) or without one (softcap None): the rate this document structure
    allows the kernel (its per-document tiles and launches), to tell the library's share of a
    gap to cuDNN from the kernel's."""
    from flash_attn.cute.interface import flash_attn_varlen_func

    from cp_softcap.kernels._common import cuda_arch
    from cp_softcap.kernels.fa4_softcap import softcap_kwargs
    cu_t = torch.tensor(cu, dtype=torch.int32, device=q.device)
    longest = max(b - a for a, b in zip(cu, cu[1:]))
    qg, kg, vg = (t[0].detach().requires_grad_(backward) for t in (q, k, v))
    dout = torch.randn_like(qg)
    kw = softcap_kwargs("score_mod", cuda_arch(q.device), q.shape[-1] ** -0.5, softcap, backward)

    def run():
        out = flash_attn_varlen_func(qg, kg, vg, cu_seqlens_q=cu_t, cu_seqlens_k=cu_t,
                                     max_seqlen_q=longest, max_seqlen_k=longest, causal=True, **kw)
        out = out[0] if isinstance(out, tuple) else out
        if backward:
            out.backward(dout)
        return out
    return run


def expanded_backward_call(q, k, v, cu, softcap, backward: bool, expand: bool, kernel=None):
    """The library's FA4 kernel (kernels/fa4.py) on the stream as one varlen call, forward on
    the KV heads (FA4 packs a group's query heads into one tile), backward on them too or, with
    expand, on K/V repeated to the query heads, dK/dV then summed over each group. Under GQA
    FA4's backward sums dK/dV across a group's heads in float32 accumulators (zeroed, added to
    by every head's CTA, converted at the end): passes over every key token that weigh most on
    short documents (the tile model's "memory" share). Expanded, it writes each head's dK/dV
    directly, for the price of a copy of K/V and a sum over the group: which wins is measured.
    kernel: the FA4 kernel (a stand-in for the CPU test). run() returns out, or (dq, dk, dv)."""
    from cp_softcap.kernels import get_kernel
    from cp_softcap.kernels.base import Segments
    kern, rep = kernel or get_kernel("fa4"), q.shape[2] // k.shape[2]
    kw = dict(scale=q.shape[-1] ** -0.5, softcap=softcap, window=(None, 0),
              segments=Segments(tuple(cu), tuple(cu)))
    dout = torch.randn_like(q)

    def run():
        out, lse = kern.forward(q, k, v, **kw)
        if not backward:
            return out
        if not expand:
            return kern.backward(dout, q, k, v, out, lse, **kw)
        kr, vr = (t.repeat_interleave(rep, dim=2) for t in (k, v))
        dq, dk, dv = kern.backward(dout, q, kr, vr, out, lse, **kw)
        return dq, *(g.view(*k.shape[:3], rep, -1).sum(3) for g in (dk, dv))
    return run


def njt_call(q, k, v, cu, backend: str, backward: bool, causal: bool = True):
    """PyTorch SDPA on nested (jagged) tensors of the same documents with one backend: cuDNN's
    or flash-attn 2's varlen kernel as PyTorch ships it, causal, no softcap (SDPA has none) and
    the KV heads repeated to the query heads beforehand (not timed). What the best kernels
    without a cap reach on this document structure: the fair ceiling for the packed rows.
    backend: "cudnn" | "flash" | "math" (PyTorch's math backend takes no causal nested call:
    with causal=False it is the CPU check of this function's layout)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    chosen = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
              "math": SDPBackend.MATH}[backend]
    offsets = torch.tensor(cu, dtype=torch.int64, device=q.device)
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    rep = q.shape[2] // k.shape[2]
    leaves = [t[0, :cu[-1]].repeat_interleave(rep if t is not q else 1, dim=1).detach()
              .requires_grad_(backward) for t in (q, k, v)]
    dout = torch.randn_like(leaves[0])

    def run():
        qn, kn, vn = (torch.nested.nested_tensor_from_jagged(x, offsets, min_seqlen=min(lengths),
                                                             max_seqlen=max(lengths)).transpose(1, 2)
                      for x in leaves)
        with sdpa_kernel([chosen]):
            out = F.scaled_dot_product_attention(qn, kn, vn, is_causal=causal).transpose(1, 2).values()
        if backward:
            out.backward(dout)
        return out
    return run


def plot(blob: Dict, png: str) -> None:
    ok = [r for r in blob["records"] if "pct_of_cudnn" in r]
    case = lambda r: f"{r['model']} {r['mix']} {r['mode']}"      # noqa: E731
    labels = sorted({case(r) for r in ok})
    series: Dict[str, Dict[str, float]] = {}
    for r in ok:
        series.setdefault(r["kernel"], {})[case(r)] = r["pct_of_cudnn"]
    bar_plot(png, labels, {n: [v.get(lbl, float("nan")) for lbl in labels] for n, v in series.items()},
             "% of cuDNN's rate (dense causal, no cap)",
             f"packed cps.attention, softcap {blob['meta']['softcap']}, {blob['meta']['device']}",
             hline=85.0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--total", type=int, default=131072, help="tokens in the packed stream")
    p.add_argument("--mixes", nargs="+", default=list(MIXES), choices=MIXES)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--kernels", nargs="+", default=["fa4", *RAW, *EXPANDED, *NJT, "fa2", "flex", FREE],
                   help=f"library backends; {' / '.join(RAW)}: FA4's varlen function alone, "
                        f"with the library's softcap or none; {' / '.join(EXPANDED)}: the library's "
                        "FA4 kernel as one call, its GQA backward as it is or on K/V repeated to "
                        f"the query heads; {' / '.join(NJT)}: PyTorch SDPA's "
                        f"varlen kernels on nested tensors (no cap); {FREE}: the library with a "
                        "kernel that does no work (its own time per call)")
    p.add_argument("--softcap", type=float, default=50.0)
    p.add_argument("--rep-ms", type=int, default=150)
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    p.add_argument("--tag", default="")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, torch kernel")
    a = p.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() and not a.dry_run else "cpu"
    a.out_dir = out_dir_for(a.out_dir, dry=dev == "cpu")
    models = dict(MODELS)
    if dev == "cpu":
        a.total, a.kernels, a.rep_ms, a.models = 2048, ["torch", FREE], 10, a.models[:1]
        models = {"9B": (4, 2, 32), "27B": (4, 4, 16)}
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    records, rows = [], [["model", "mix", "docs", "kernel", "mode", "ms", "TFLOP/s", "% cuDNN"]]
    for model in a.models:
        hq, hkv, d = models[model]
        for kind in a.mixes:
            cu = mix(kind, a.total, 0)
            area = visible_area(cu)
            s_eq = max(128, round(math.sqrt(2 * area) / 128) * 128)
            q = torch.randn(1, a.total, hq, d, device=dev, dtype=dtype)
            k = torch.randn(1, a.total, hkv, d, device=dev, dtype=dtype)
            v = torch.randn(1, a.total, hkv, d, device=dev, dtype=dtype)
            base = {}
            for mode, bwd in (("fwd", False), ("fwd+bwd", True)):
                factor = 3.5 if bwd else 1.0
                ms = bench_ms(cudnn_baseline(q[:, :s_eq], k[:, :s_eq], v[:, :s_eq], bwd), rep_ms=a.rep_ms)
                base[mode] = factor * 4.0 * hq * d * s_eq * s_eq / 2 / ms / 1e9
                records.append(dict(model=model, mix=kind, docs=len(cu) - 1, kernel="cudnn dense causal",
                                    mode=mode, S=s_eq, ms=ms, tflops=base[mode]))
                rows.append([model, kind, f"dense S={s_eq}", "cudnn", mode, f"{ms:.2f}",
                             f"{base[mode]:.0f}", "100"])
                for name in a.kernels:
                    spec = make_spec(head_dim=d, num_heads=hq, num_kv_heads=hkv, dtype=dtype,
                                     device_type=dev, softcap=a.softcap, causal=True,
                                     needs_backward=bwd, documents=True)
                    rec = dict(model=model, mix=kind, docs=len(cu) - 1, kernel=name, mode=mode,
                               total=a.total, area=area, softcap=a.softcap)
                    reason = (None if name in NJT or name == FREE else
                              rejection("fa4" if name in RAW or name in EXPANDED else name, spec))
                    if reason:
                        records.append({**rec, "skipped": reason})
                        rows.append([model, kind, len(cu) - 1, name, mode, "skip", reason[:40], ""])
                        continue
                    try:
                        if name in RAW:
                            call = fa4_raw_call(q, k, v, cu, a.softcap if RAW[name] else None, bwd)
                        elif name in EXPANDED:
                            call = expanded_backward_call(q, k, v, cu, a.softcap, bwd, EXPANDED[name])
                        elif name in NJT:
                            call = njt_call(q, k, v, cu, name.split("-")[0], bwd)
                            ref = cps.attention(q, k, v, causal=True, cu_seqlens=cu)[0, :cu[-1]]
                            rec["max_abs_vs_library_nocap"] = (call().float() - ref.float()).abs().max().item()
                        else:
                            backend = FreeKernel() if name == FREE else name
                            call = packed_call(backend, q, k, v, cu, a.softcap, bwd)
                        ms = bench_ms(call, rep_ms=a.rep_ms)
                    except Exception as e:          # report it, keep measuring the others
                        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                        records.append({**rec, "error": msg})
                        rows.append([model, kind, len(cu) - 1, name, mode, "ERR", msg[:40], ""])
                        continue
                    if name == FREE:                # no math: its time is the figure
                        records.append({**rec, "ms": ms})
                        rows.append([model, kind, len(cu) - 1, name, mode, f"{ms:.2f}", "", ""])
                        continue
                    tf = factor * 4.0 * hq * d * area / ms / 1e9
                    records.append({**rec, "ms": ms, "tflops": tf, "pct_of_cudnn": 100 * tf / base[mode]})
                    rows.append([model, kind, len(cu) - 1, name, mode, f"{ms:.2f}", f"{tf:.0f}",
                                 f"{100 * tf / base[mode]:.0f}"])
            del q, k, v
            if dev == "cuda":
                torch.cuda.empty_cache()
    meta = dict(total=a.total, softcap=a.softcap, dtype=str(dtype), batch=1, causal=True, seed=0,
                flops="4 * Hq * D * visible area (fwd), x3.5 fwd+bwd; cuDNN on a dense causal call "
                      "of about the same area, no softcap")
    report("packed_kernels", records, meta, rows, a.out_dir, a.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
