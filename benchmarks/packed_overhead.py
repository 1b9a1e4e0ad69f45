"""The library's own time around a packed one-device call: `cps.attention(cu_seqlens=)` with a
kernel that does no work, so what is timed is everything but the kernel.

    python benchmarks/packed_overhead.py               # CPU: 8K and 32K streams; GPU: 32K, 128K
    python benchmarks/packed_overhead.py --dry-run     # CPU, one tiny stream

The stand-in kernel (`FreeKernel`) answers every call at once with fresh tensors of the shapes
and dtypes a flash kernel returns (out and gradients in bf16, LSE float32), values unset. What
remains is the library's: planning (a cache lookup when warm), the calls' row and key slices,
output and gradient buffers, casts. Streams: benchmarks/packing_balance.mix (seed 0), causal,
softcap 50, bf16, 9B heads at half width (8 query / 4 KV heads, D 128) so that 32K fits a small
CPU. Each figure is the median of `bench_ms`. Writes packed_overhead[_tag].json and .png.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Dict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cp_softcap as cps                                              # noqa: E402
from cp_softcap.kernels.torch_kernel import TorchKernel               # noqa: E402
from benchmarks._util import OUT_DIR_HELP, bar_plot, bench_ms, device_name, out_dir_for, report  # noqa: E402
from benchmarks.packing_balance import mix                            # noqa: E402

HEADS = (8, 4, 128)


class FreeKernel(TorchKernel):
    """Returns at once what a bf16 flash kernel returns, uncomputed (a timing stand-in only)."""
    name = "free"
    caps = dataclasses.replace(TorchKernel.caps, dtypes=frozenset({torch.bfloat16}),
                               grads_in_input_dtype=True, notes=("timing stand-in: no math",))

    def forward(self, q, k, v, *, scale, softcap, window, segments=None):
        b, s, h, _ = q.shape
        return (torch.empty(b, s, h, v.shape[-1], dtype=q.dtype, device=q.device),
                torch.empty(b, h, s, dtype=torch.float32, device=q.device))

    def backward(self, dout, q, k, v, out, lse, *, scale, softcap, window, dlse=None, segments=None):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def call(q, k, v, cu, backward: bool, kernel):
    qg, kg, vg = (t.detach().requires_grad_(backward) for t in (q, k, v))
    dout = torch.ones_like(q)

    def run():
        out = cps.attention(qg, kg, vg, softcap=50.0, cu_seqlens=cu, backend=kernel)
        if backward:
            out.backward(dout)
    return run


def plot(blob: Dict, png: str) -> None:
    recs = blob["records"]
    labels = sorted({f"{r['total'] // 1024}K {r['mix']}" for r in recs})
    series = {m: [next((r["ms"] for r in recs if r["mode"] == m and
                        f"{r['total'] // 1024}K {r['mix']}" == lbl), float("nan")) for lbl in labels]
              for m in ("fwd", "fwd+bwd")}
    bar_plot(png, labels, series, "ms per call (kernel excluded)",
             f"library time around a packed call, {blob['meta']['device']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--totals", nargs="+", type=int, default=None,
                   help="stream lengths (default: 8192 32768 on CPU, 32768 131072 on a GPU)")
    p.add_argument("--rep-ms", type=int, default=300)
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    p.add_argument("--tag", default="")
    p.add_argument("--dry-run", action="store_true", help="CPU, one 2048-token stream")
    a = p.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() and not a.dry_run else "cpu"
    totals = a.totals or ([32768, 131072] if dev == "cuda" else [8192, 32768])
    if a.dry_run:
        totals, a.rep_ms = [2048], 20
    a.out_dir = out_dir_for(a.out_dir, dry=a.dry_run)
    hq, hkv, d = HEADS
    kernel, records = FreeKernel(), []
    rows = [["tokens", "mix", "documents", "mode", "ms"]]
    for total in totals:
        q = torch.randn(1, total, hq, d, device=dev, dtype=torch.bfloat16)
        k, v = (torch.randn(1, total, hkv, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
        for kind in ("long-tail", "short"):
            cu = mix(kind, total, 0)
            for mode, bwd in (("fwd", False), ("fwd+bwd", True)):
                ms = bench_ms(call(q, k, v, cu, bwd, kernel), rep_ms=a.rep_ms)
                records.append(dict(total=total, mix=kind, docs=len(cu) - 1, mode=mode, ms=ms))
                rows.append([total, kind, len(cu) - 1, mode, f"{ms:.2f}"])
    meta = dict(heads=HEADS, dtype="bfloat16", softcap=50.0, causal=True, seed=0,
                device=device_name() if dev == "cuda" else "cpu", threads=torch.get_num_threads(),
                torch=torch.__version__, kernel="FreeKernel (no math: the library's time only)")
    report("packed_overhead", records, meta, rows, a.out_dir, a.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
