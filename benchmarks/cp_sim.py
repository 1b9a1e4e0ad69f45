"""One GPU simulates rank 0's zigzag ring work (no communication): its chunk-pair kernel calls,
LSE merges and backward, for cp = 2, 4, 8 at S = 32K and 128K.

    python benchmarks/cp_sim.py                  # H200, Gemma2-9B heads (16/8, D=256), softcap 50
    python benchmarks/cp_sim.py --dry-run        # CPU, tiny shapes, checks the script only

ratio = per-rank time * cp / full-attention time (1.0 = perfect; communication not included).
Rank 0 holds chunks 0 and 2cp-1 (chunk C = S/(2cp)); its ring steps are:
    step 0          local Q [2C] x local KV [2C], bottom-right causal
    steps 1..cp-1   Q second half [C] x remote KV [2C], full (all sources are later ranks)
Forward merges each partial into one float32 accumulator (fused Triton merge on CUDA, eager
with --merge eager); backward calls each pair's kernel backward with the final merged (O, LSE),
accumulates dQ in float32 and adds each dK/dV partial into a float32 buffer (what the key owner
does). Writes benchmarks/results/cp_sim.json and cp_sim.png.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cp_softcap.kernels import get_kernel                           # noqa: E402
from cp_softcap.merge import merge_into                             # noqa: E402
from cp_softcap.spec import make_spec                               # noqa: E402
from cp_softcap.selector import select                              # noqa: E402
from benchmarks._util import RESULTS, bar_plot, bench_ms, save, table  # noqa: E402


class Rank0:
    """Buffers and the step functions for rank 0 of a zigzag ring of size cp."""

    def __init__(self, kernel, s, cp, hq, hkv, d, dtype, dev, softcap, prepared=False):
        self.kernel, self.cp, self.softcap, self.scale = kernel, cp, softcap, d ** -0.5
        self.prepared = prepared
        self.c = s // (2 * cp)
        L = 2 * self.c
        mk = lambda h: torch.randn(1, L, h, d, device=dev, dtype=dtype)   # noqa: E731
        self.q, self.k, self.v = mk(hq), mk(hkv), mk(hkv)
        self.kr, self.vr = mk(hkv), mk(hkv)          # a remote rank's K/V (same cost each step)
        self.dout = mk(hq)
        self.dk_acc = torch.zeros(1, L, hkv, d, device=dev, dtype=torch.float32)
        self.dv_acc = torch.zeros_like(self.dk_acc)

    def forward(self, merge=True):
        kern, kw, c = self.kernel, dict(scale=self.scale, softcap=self.softcap), self.c
        out, lse = kern.forward(self.q, self.k, self.v, window=(None, 0), **kw)
        acc_o, acc_l = out.float(), lse.clone()
        for _ in range(1, self.cp):
            o, l = kern.forward(self.q[:, c:], self.kr, self.vr, window=(None, None), **kw)
            if merge:
                merge_into(acc_o[:, c:], acc_l[:, :, c:], o, l)
        return acc_o, acc_l

    def forward_backward(self, merge=True):
        kern, kw, c = self.kernel, dict(scale=self.scale, softcap=self.softcap), self.c
        out, lse = self.forward(merge)
        dout, dlse = self.dout, None
        if self.prepared and hasattr(kern, "prepare_backward"):
            dout, out, dlse = kern.prepare_backward(dout, out, None, self.q.dtype)
        sl = (lambda t: t[:, :, c:]) if dlse is not None else (lambda t: None)  # noqa: E731
        dq, dk, dv = kern.backward(dout, self.q, self.k, self.v, out, lse, window=(None, 0),
                                   dlse=dlse, **kw)
        for _ in range(1, self.cp):
            gq, gk, gv = kern.backward(dout[:, c:], self.q[:, c:], self.kr, self.vr,
                                       out[:, c:], lse[:, :, c:], window=(None, None),
                                       dlse=sl(dlse), **kw)
            dq[:, c:] += gq
            self.dk_acc += gk
            self.dv_acc += gv
        return dq


def graphed(fn):
    """Capture fn() into a CUDA graph (after two warm-up calls on a side stream); returns replay.
    Shows the ring's GPU work without per-call Python/launch overhead."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def host_ms(fn, n: int = 10) -> float:
    """Host-side milliseconds per fn() call (issue time, no sync inside the loop)."""
    import time
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (t1 - t0) * 1e3 / n


def full_attention(kernel, s, hq, hkv, d, dtype, dev, softcap, backward):
    q = torch.randn(1, s, hq, d, device=dev, dtype=dtype)
    k = torch.randn(1, s, hkv, d, device=dev, dtype=dtype)
    v = torch.randn(1, s, hkv, d, device=dev, dtype=dtype)
    dout, kw = torch.randn_like(q), dict(scale=d ** -0.5, softcap=softcap, window=(None, 0))

    def run():
        out, lse = kernel.forward(q, k, v, **kw)
        if backward:
            kernel.backward(dout, q, k, v, out, lse, **kw)
    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--cps", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--heads", type=int, nargs=3, default=[16, 8, 256], metavar=("HQ", "HKV", "D"))
    p.add_argument("--softcap", type=float, default=50.0)
    p.add_argument("--kernel", default="auto", help="fa4 | flex | ... | auto (selector)")
    p.add_argument("--merges", nargs="+", default=["fused", "eager"])
    p.add_argument("--rep-ms", type=int, default=300)
    p.add_argument("--out-dir", default=RESULTS)
    p.add_argument("--graph", action="store_true",
                   help="also time a CUDA-graph replay of rank 0's work (no host overhead)")
    p.add_argument("--tag", default="", help="suffix of the output files: cp_sim_<tag>.json")
    p.add_argument("--prepared", action="store_true",
                   help="cast the float32 O and correct D once per backward (prepare_backward), "
                        "not once per chunk pair")
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    hq, hkv, d = a.heads
    if a.dry_run or dev == "cpu":
        a.seqs, a.cps, (hq, hkv, d), a.rep_ms = [512], [2, 4], (4, 2, 32), 10
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    spec = make_spec(head_dim=d, num_heads=hq, num_kv_heads=hkv, dtype=dtype, device_type=dev,
                     softcap=a.softcap, causal=True, cp_size=max(a.cps))
    name = select(spec, a.kernel).name if dev == "cuda" or a.kernel != "auto" else "torch"
    kernel = get_kernel(name)
    records, rows = [], [["S", "cp", "merge", "mode", "rank0 ms", "host ms", "full ms", "ratio",
                          "no-merge ratio", "graph ratio"]]
    for s in a.seqs:
        full = {m: bench_ms(full_attention(kernel, s, hq, hkv, d, dtype, dev, a.softcap, m == "fwd+bwd"),
                            rep_ms=a.rep_ms) for m in ("fwd", "fwd+bwd")}
        for cp in a.cps:
            r0 = Rank0(kernel, s, cp, hq, hkv, d, dtype, dev, a.softcap, a.prepared)
            for merge in a.merges:
                os.environ["CP_SOFTCAP_FUSED_MERGE"] = "1" if merge == "fused" else "0"
                for mode in ("fwd", "fwd+bwd"):
                    fn = r0.forward if mode == "fwd" else r0.forward_backward
                    ms = bench_ms(fn, rep_ms=a.rep_ms)
                    ms_nomerge = bench_ms(lambda: fn(merge=False), rep_ms=a.rep_ms)
                    ratio, ratio_nm = ms * cp / full[mode], ms_nomerge * cp / full[mode]
                    rec = dict(S=s, cp=cp, merge=merge, mode=mode, kernel=name,
                               rank0_ms=ms, rank0_no_merge_ms=ms_nomerge, full_ms=full[mode],
                               ratio=ratio, ratio_without_merge=ratio_nm, rank0_host_ms=host_ms(fn))
                    g_txt = ""
                    if a.graph and dev == "cuda":
                        try:
                            ms_g = bench_ms(graphed(fn), rep_ms=a.rep_ms)
                            rec.update(rank0_graph_ms=ms_g, ratio_graph=ms_g * cp / full[mode])
                            g_txt = f"{ms_g * cp / full[mode]:.3f}"
                        except Exception as e:
                            rec["graph_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                            g_txt = "ERR"
                    records.append(rec)
                    rows.append([s, cp, merge, mode, f"{ms:.3f}", f"{rec['rank0_host_ms']:.3f}",
                                 f"{full[mode]:.3f}", f"{ratio:.3f}", f"{ratio_nm:.3f}", g_txt])
            del r0
            if dev == "cuda":
                torch.cuda.empty_cache()
    os.environ.pop("CP_SOFTCAP_FUSED_MERGE", None)
    meta = dict(prepared_backward=a.prepared, kernel=name, heads=[hq, hkv, d], softcap=a.softcap, dtype=str(dtype), batch=1,
                ratio="rank0 time * cp / full causal attention time (same kernel), no communication")
    stem = "cp_sim" + (f"_{a.tag}" if a.tag else "")
    path = save(stem, records, meta, a.out_dir)
    labels = [f"{r['S'] // 1024}K cp{r['cp']} {r['mode']}" for r in records if r["merge"] == a.merges[0]]
    series = {m: [r["ratio"] for r in records if r["merge"] == m] for m in a.merges}
    if a.graph:
        series.update({f"{m} (CUDA graph)": [r.get("ratio_graph", float("nan")) for r in records
                                             if r["merge"] == m] for m in a.merges})
    bar_plot(os.path.join(a.out_dir, stem + ".png"), labels, series, "rank0 time * cp / full",
             f"zigzag ring rank 0, {name}, heads {hq}/{hkv} D={d}, softcap {a.softcap}", hline=1.0)
    print(table(rows))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
