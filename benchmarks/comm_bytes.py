"""Bytes sent per rank per attention layer, forward and backward, counted by the comm layer.

    python benchmarks/comm_bytes.py            # Gemma2-9B shapes, S = 32K and 128K, cp = 8 (CPU, gloo)
    python benchmarks/comm_bytes.py --quick    # tiny shapes, causal only: checks the script;
                                               # writes into $OUT or a new temporary folder

Spawns 8 gloo ranks on CPU (file rendezvous, one thread each), builds Gemma2-9B attention
shards (B = 1, Hq = 16, Hkv = 8, D = 256, bf16, softcap 50) for causal and window (4095, 0) and
runs `cps.cp_attention` forward and backward for comm = ring, all_gather, a2a and a2a+p2p (inner
a2a groups of 2 and 4 from `cps.make_hybrid_groups`), each pass under its own
`cp_softcap.transport.counting()`. Every rank returns its ByteCounter.sent (bytes per op name); the
table shows the busiest rank (largest fwd+bwd) and the mean over ranks, next to the analytical
`cp_softcap.comm_model.bytes_per_rank` (the busiest rank's total; a2a+p2p via a2a_size=), and
checks every op of every rank, fwd and bwd, against `cp_softcap.comm_model.sent_per_rank`.

STAND-IN KERNEL. Real softcapped attention at these shapes takes hours on 2 CPU cores, and the
bytes a CP scheme sends do not depend on tensor values; of the kernel they depend only on the
dtype of its dK/dV partials (kernel.partial_dtype: the ring returns an exclusive block's dK/dV
in it, bf16 from the flash-attn family). So this benchmark passes backend= a shape-correct
stand-in kernel that follows kernels/base.py: forward returns
out [B, Sq, Hq, Dv] in the input dtype and a contiguous float32 LSE [B, Hq, Sq] of zeros;
backward returns float32 zero gradients of q/k/v's shapes (out and grads are broadcast zero
views, to save memory), so its partials are float32 like the torch kernel's and the model gets
partial_bytes=4 (the stand-in's partial_dtype). The output says so, and the JSON records it.

HEAD-DIM SCALING. With 8 ranks in 23 GB, all_gather at 128K with D = 256 does not fit (each rank
materialises the gathered K/V and float32 dK/dV for all 128K tokens). Every message is linear in
the head dim (q, k, v, out, dout and their gradients all end in D = Dv), so 128K is measured at
D = 256 / f (f = 8 by default) and multiplied by f exactly. Head count is NOT scaled: a2a replicates
KV heads when Hkv % cp != 0, so halving the heads would change what is sent. The scaling is
verified on 32K, measured at both D = 256 and D = 256 / f: every op of every rank must match
exactly, else the script fails.

Writes benchmarks/results/comm_bytes.json and comm_bytes.png (--quick: into $OUT or a new temporary
folder, never into the tracked results).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._util import OUT_DIR_HELP, launch_ranks, out_dir_for, save, table  # noqa: E402
from benchmarks.plots import plot_json  # noqa: E402

MiB = 2 ** 20
HQ, HKV, D_REAL, CP = 16, 8, 256, 8
SOFTCAP = 50.0
WINDOWS = {"causal": None, "(4095, 0)": (4095, 0)}
COMMS = (("ring", "ring", None), ("all_gather", "all_gather", None), ("a2a", "a2a", None),
         ("a2a+p2p a2a=2 ring=4", "a2a+p2p", 2), ("a2a+p2p a2a=4 ring=2", "a2a+p2p", 4))
STANDIN_NOTE = ("kernel was a shape-correct STAND-IN (zeros out/LSE/grads, kernels/base.py contract), "
                "not real attention: real softcapped attention at these shapes is far too slow on "
                "2 CPU cores, and bytes sent depend only on shapes/dtypes/window/cp and the kernel's "
                "dK/dV partial dtype (float32 here, as the torch kernel; a flash-attn kernel returns "
                "exclusive ring blocks' dK/dV in bf16), not on values")


# --------------------------------------------------------------------------- stand-in kernel

def _make_standin():
    from cp_softcap.kernels.base import Capabilities, Kernel, grad_dtype

    class StandInKernel(Kernel):
        """Shape-correct, value-free kernel (benchmark only): zeros of the contract's shapes."""
        name = "standin"
        caps = Capabilities(softcap=True, window=True, gqa=True,
                            dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
                            devices=frozenset({"cpu", "cuda"}), backward_devices=frozenset({"cpu", "cuda"}),
                            notes=("benchmarks/comm_bytes.py stand-in: no attention math",))

        def __init__(self):
            self.calls = {"forward": 0, "backward": 0}

        def forward(self, q, k, v, *, scale, softcap, window):
            self.calls["forward"] += 1
            b, sq, hq, _ = q.shape
            out = torch.zeros((), dtype=q.dtype, device=q.device).expand(b, sq, hq, v.shape[-1])
            lse = torch.zeros((b, hq, sq), dtype=torch.float32, device=q.device)   # finite, contiguous
            return out, lse

        def backward(self, dout, q, k, v, out, lse, *, scale, softcap, window, dlse=None):
            self.calls["backward"] += 1
            z = torch.zeros((), dtype=grad_dtype(q.dtype), device=q.device)
            return z.expand(q.shape), z.expand(k.shape), z.expand(v.shape)

    return StandInKernel()


# --------------------------------------------------------------------------- one rank

def _rank_main(rank, world, configs):
    """One gloo rank (started by launch_ranks): every config's fwd/bwd bytes sent by this rank."""
    import torch.distributed as dist
    import cp_softcap as cps
    from cp_softcap.transport import counting
    kernel = _make_standin()
    hybrid = {a: cps.make_hybrid_groups(dist.group.WORLD, a) for a in (2, 4)}   # collective
    out_rows = []
    for cfg in configs:
        s, d, window, comm, a2a = cfg["S"], cfg["D"], cfg["window"], cfg["comm"], cfg["a2a"]
        n = s // world
        g = torch.Generator().manual_seed(1000 + rank)
        q = torch.randn(1, n, HQ, d, generator=g).to(torch.bfloat16).requires_grad_()
        k = torch.randn(1, n, HKV, d, generator=g).to(torch.bfloat16).requires_grad_()
        v = torch.randn(1, n, HKV, d, generator=g).to(torch.bfloat16).requires_grad_()
        group = hybrid[a2a] if comm == "a2a+p2p" else dist.group.WORLD
        before = dict(kernel.calls)
        dist.barrier()
        t0 = time.perf_counter()
        with counting() as fwd:
            out = cps.cp_attention(q, k, v, group, softcap=SOFTCAP, causal=True, window=window,
                                   scale=D_REAL ** -0.5, comm=comm, backend=kernel)
        t1 = time.perf_counter()
        dout = torch.randn(out.shape, generator=g).to(out.dtype)
        with counting() as bwd:
            out.backward(dout)
        t2 = time.perf_counter()
        assert out.shape == (1, n, HQ, d) and out.dtype == torch.bfloat16, out.shape
        assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
        calls = {p: kernel.calls[p] - before[p] for p in kernel.calls}
        out_rows.append({"fwd": dict(fwd.sent), "bwd": dict(bwd.sent), "kernel_calls": calls,
                         "fwd_s": t1 - t0, "bwd_s": t2 - t1})
        del q, k, v, out, dout, fwd, bwd
        gc.collect()
    dist.barrier()
    return {"rows": out_rows}


def run_ranks(configs, world=CP, timeout=3000.0):
    """Every rank's {"rows"} from _rank_main on `world` gloo ranks (CPU)."""
    env = {"CP_SOFTCAP_TIMEOUT": os.environ.get("CP_SOFTCAP_TIMEOUT", "900")}
    return launch_ranks(_rank_main, world, (configs,), env=env, timeout=timeout, pg_timeout=900)


# --------------------------------------------------------------------------- analytical model

def _spec(cp, hq=HQ, hkv=HKV, window=None, comm="ring"):
    from cp_softcap.spec import make_spec
    return make_spec(head_dim=D_REAL, num_heads=hq, num_kv_heads=hkv, dtype=torch.bfloat16,
                     device_type="cpu", softcap=SOFTCAP, causal=True, window=window,
                     scale=D_REAL ** -0.5, cp_size=cp, comm=comm)


def partial_bytes():
    """The stand-in's dK/dV partial element bytes (kernel.partial_dtype, bf16 inputs): what
    the plan gives the model for the selected kernel. 4: float32, as the torch kernel."""
    return _make_standin().partial_dtype(torch.bfloat16).itemsize


def model_total(comm, a2a, s, window):
    """(bytes, how): the busiest rank's fwd+bwd total from cp_softcap.comm_model.bytes_per_rank
    (a2a+p2p through its a2a_size= entry)."""
    from cp_softcap.comm_model import bytes_per_rank
    costs = bytes_per_rank(_spec(CP, window=window, comm=comm), s, a2a_size=a2a,
                           partial_bytes=partial_bytes())
    return costs.get(comm), "bytes_per_rank" + (f"(a2a_size={a2a})['a2a+p2p']" if a2a else f"[{comm!r}]")


def model_ops(comm, a2a, s, window):
    """Every rank's modelled bytes per op (cp_softcap.comm_model.sent_per_rank), as
    {"fwd": {op: bytes}, "bwd": {...}} per rank, split by the op names' .fwd./.bwd."""
    from cp_softcap.comm_model import sent_per_rank
    per = sent_per_rank(_spec(CP, window=window, comm=comm), s, comm, a2a_size=a2a,
                        partial_bytes=partial_bytes())
    return [{ph: {op: b for op, b in ops.items() if f".{ph}." in op} for ph in ("fwd", "bwd")}
            for ops in per]


# --------------------------------------------------------------------------- main

def _code_version():
    """HEAD commit and whether cp_softcap/ differs from it (the measured code)."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "cp_softcap"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"
    return head + (" + uncommitted changes in cp_softcap/: " + dirty.replace("\n", "; ") if dirty else "")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="tiny S, causal only (at S <= 4096 the window (4095, 0) is causal anyway): "
                         "checks the script")
    ap.add_argument("--scale", type=int, default=8, help="head-dim divisor f for the 128K runs")
    ap.add_argument("--out-dir", default=None, help=OUT_DIR_HELP.replace("a dry run", "--quick"))
    a = ap.parse_args()
    a.out_dir = out_dir_for(a.out_dir, dry=a.quick)
    seqs = (1024, 4096) if a.quick else (32768, 131072)
    s_small, s_big = seqs
    f = a.scale
    d_small = D_REAL // f
    configs = []
    windows = {"causal": WINDOWS["causal"]} if a.quick else WINDOWS
    for wname, window in windows.items():
        for label, comm, inner in COMMS:
            for s, d in ((s_small, D_REAL), (s_small, d_small), (s_big, d_small)):
                configs.append({"label": label, "comm": comm, "a2a": inner, "S": s, "D": d,
                                "window": window, "window_name": wname})
    print(f"comm_bytes: {len(configs)} runs on {CP} gloo ranks (CPU, one thread each)")
    print(f"NOTE: {STANDIN_NOTE}.")
    print(f"NOTE: S={s_big} measured at head dim D={d_small} and scaled x{f} (bytes are linear in D; "
          f"verified at S={s_small}, measured at D={D_REAL} and D={d_small}).")
    t0 = time.time()
    per_rank = run_ranks(configs)
    wall = time.time() - t0
    print(f"ranks done in {wall:.0f}s; stand-in kernel passed as backend=")
    print(f"measured code: {_code_version()}")

    def rows_of(i):
        return [pr["rows"][i] for pr in per_rank]

    # exact-scaling check on the small S: D_REAL measured == f x D_small measured, every op, every rank
    by_key = {(c["label"], c["window_name"], c["S"], c["D"]): i for i, c in enumerate(configs)}
    scaling = []
    for (label, wname, s, d), i in by_key.items():
        if s != s_small or d != D_REAL:
            continue
        j = by_key[(label, wname, s, d_small)]
        for r, (x, y) in enumerate(zip(rows_of(i), rows_of(j))):
            for phase in ("fwd", "bwd"):
                ops = set(x[phase]) | set(y[phase])
                bad = {op: (x[phase].get(op, 0), f * y[phase].get(op, 0)) for op in ops
                       if x[phase].get(op, 0) != f * y[phase].get(op, 0)}
                if bad:
                    scaling.append(f"{label} {wname} rank {r} {phase}: {bad}")
    if scaling:
        raise SystemExit("head-dim scaling is NOT exact:\n" + "\n".join(scaling))
    print(f"head-dim scaling verified exact at S={s_small}: D={D_REAL} bytes == {f} x D={d_small} bytes, "
          "every op of every rank, fwd and bwd")

    records, trows, mismatches = [], [], []
    trows.append(["S", "window", "comm", "busiest fwd", "bwd", "total", "mean total",
                  "analytical", "ratio", "every op/rank", "ranks (fwd+bwd MiB)"])
    for i, c in enumerate(configs):
        if not ((c["S"] == s_small and c["D"] == D_REAL) or c["S"] == s_big):
            continue
        mult = D_REAL // c["D"]
        rr = rows_of(i)
        for x in rr:
            assert x["kernel_calls"]["forward"] + x["kernel_calls"]["backward"] >= 0
        fwd = [mult * sum(x["fwd"].values()) for x in rr]
        bwd = [mult * sum(x["bwd"].values()) for x in rr]
        tot = [a_ + b_ for a_, b_ in zip(fwd, bwd)]
        busy = max(range(CP), key=lambda r: tot[r])
        ops = sorted({op for x in rr for ph in ("fwd", "bwd") for op in x[ph]})
        op_max = {op: mult * max(x["fwd"].get(op, 0) + x["bwd"].get(op, 0) for x in rr) for op in ops}
        op_mean = {op: mult * sum(x["fwd"].get(op, 0) + x["bwd"].get(op, 0) for x in rr) / CP for op in ops}
        op_busy = {op: mult * (rr[busy]["fwd"].get(op, 0) + rr[busy]["bwd"].get(op, 0)) for op in ops}
        model, how = model_total(c["comm"], c["a2a"], c["S"], c["window"])
        per_model = model_ops(c["comm"], c["a2a"], c["S"], c["window"])
        split = {op: b for ph in ("fwd", "bwd") for op, b in per_model[busy][ph].items()}
        # every op of every rank, each phase: measured (scaled to D=256) vs sent_per_rank
        op_diffs = []
        for r, (x, m) in enumerate(zip(rr, per_model)):
            for ph in ("fwd", "bwd"):
                for op in sorted(set(x[ph]) | set(m[ph])):
                    got, want = mult * x[ph].get(op, 0), m[ph].get(op, 0)
                    if got != want:
                        op_diffs.append({"rank": r, "phase": ph, "op": op, "measured_MiB": got / MiB,
                                         "model_MiB": want / MiB})
        exact = not op_diffs
        ratio = tot[busy] / model if model else float("nan")
        diffs = {}
        if model is not None and (abs(tot[busy] - model) > 0.5 or not exact):
            for op in sorted(set(ops) | set(split)):
                b_, m_, e_ = op_busy.get(op, 0), op_max.get(op, 0), split.get(op, 0)
                if abs(b_ - e_) > 0.5:
                    diffs[op] = {"busiest_rank_MiB": b_ / MiB, "max_over_ranks_MiB": m_ / MiB,
                                 "mean_MiB": op_mean.get(op, 0) / MiB, "model_MiB": e_ / MiB,
                                 "delta_busiest_MiB": (b_ - e_) / MiB}
            mismatches.append((c, tot[busy], model, diffs, op_diffs))
        mism_rec = {op: dd for op, dd in diffs.items()}
        calls = [x["kernel_calls"] for x in rr]
        records.append({
            "S": c["S"], "window": c["window_name"], "comm": c["label"], "comm_arg": c["comm"],
            "a2a_size": c["a2a"], "measured_head_dim": c["D"], "scale_to_D256": mult,
            "busiest_rank": busy, "busiest_fwd_MiB": fwd[busy] / MiB, "busiest_bwd_MiB": bwd[busy] / MiB,
            "busiest_total_MiB": tot[busy] / MiB, "max_fwd_MiB": max(fwd) / MiB, "max_bwd_MiB": max(bwd) / MiB,
            "mean_fwd_MiB": sum(fwd) / CP / MiB, "mean_bwd_MiB": sum(bwd) / CP / MiB,
            "mean_total_MiB": sum(tot) / CP / MiB, "per_rank_total_MiB": [t / MiB for t in tot],
            "analytical_total_MiB": None if model is None else model / MiB, "analytical_source": how,
            "ratio_busiest_over_analytical": ratio,
            "analytical_ops_busiest_rank_MiB": {k_: v_ / MiB for k_, v_ in split.items()},
            "model_matches_every_op_of_every_rank": exact,
            "ops_per_rank_differing_from_model": op_diffs,
            "ops_differing_from_model_MiB": mism_rec,
            "ops_busiest_rank_MiB": {k_: v_ / MiB for k_, v_ in op_busy.items()},
            "ops_max_over_ranks_MiB": {k_: v_ / MiB for k_, v_ in op_max.items()},
            "ops_mean_MiB": {k_: v_ / MiB for k_, v_ in op_mean.items()},
            "per_rank_sent_bytes_as_measured": [{"fwd": x["fwd"], "bwd": x["bwd"]} for x in rr],
            "standin_kernel_calls_per_rank": calls,
            "seconds_fwd_bwd_rank0": [rr[0]["fwd_s"], rr[0]["bwd_s"]],
        })
        trows.append([f"{c['S'] // 1024}K", c["window_name"], c["label"], f"{fwd[busy] / MiB:.1f}",
                      f"{bwd[busy] / MiB:.1f}", f"{tot[busy] / MiB:.1f}", f"{sum(tot) / CP / MiB:.1f}",
                      "-" if model is None else f"{model / MiB:.1f}", f"{ratio:.3f}",
                      "exact" if exact else f"{len(op_diffs)} differ",
                      " ".join(f"{t / MiB:.0f}" for t in tot)])
    print()
    print("MiB sent per rank per layer (Gemma2-9B: B=1, Hq=16, Hkv=8, D=256, bf16, grads fp32), cp=8")
    print("busiest = rank with the largest fwd+bwd; analytical = bytes_per_rank (busiest rank model)")
    print(table(trows))
    if mismatches:
        print("\nmeasured (busiest rank) != analytical:")
        for c, meas, model, diffs, op_diffs in mismatches:
            print(f"  {c['S'] // 1024}K {c['window_name']} {c['label']}: measured {meas / MiB:.1f} MiB, "
                  f"model {model / MiB:.1f} MiB ({(meas - model) / MiB:+.1f})"
                  + f"; {len(op_diffs)} (rank, phase, op) entries differ from sent_per_rank")
            for op, dd in diffs.items():
                print(f"      {op:<14} busiest rank {dd['busiest_rank_MiB']:8.1f}  max over ranks "
                      f"{dd['max_over_ranks_MiB']:8.1f}  mean {dd['mean_MiB']:8.1f}  model {dd['model_MiB']:8.1f}"
                      f"  (busiest - model {dd['delta_busiest_MiB']:+8.1f} MiB)")
    else:
        print("\nmeasured == analytical for every row: the busiest rank's total, and every op of every "
              "rank (fwd and bwd) against sent_per_rank")
    meta = {"what": "bytes sent per rank per attention layer (forward, backward), counted by "
                    "cp_softcap.transport.counting() around cps.cp_attention forward and .backward()",
            "host": "CPU only, 8 gloo ranks (one process, one thread each), file rendezvous",
            "shapes": {"B": 1, "Hq": HQ, "Hkv": HKV, "D": D_REAL, "dtype": "bfloat16", "softcap": SOFTCAP,
                       "cp": CP, "S": list(seqs)},
            "kernel": "STAND-IN", "kernel_note": STANDIN_NOTE, "kernel_passed_as": "backend=",
            "kernel_partial_bytes": partial_bytes(),
            "scaling": (f"S={s_big} measured at D={d_small}, bytes x{f}; exactness verified at S={s_small} "
                        f"(D={D_REAL} vs D={d_small}, every op of every rank)"),
            "busiest": "rank with the largest fwd+bwd total; ops_max_over_ranks is per op",
            "analytical": ("cp_softcap.comm_model.bytes_per_rank (busiest rank's total; a2a+p2p via a2a_size=) "
                           "and sent_per_rank (every op of every rank, checked exactly), with "
                           "partial_bytes= the stand-in's partial dtype bytes"),
            "quick": a.quick, "wall_s": wall, "code_version": _code_version(),
            "CP_SOFTCAP_RING_BLOCK_KEYS": os.environ.get("CP_SOFTCAP_RING_BLOCK_KEYS", "(unset: default)")}
    path = save("comm_bytes" + ("_quick" if a.quick else ""), records, meta, a.out_dir)
    png = plot_json(path)
    print(f"\nwrote {path} and {png}")


if __name__ == "__main__":
    main()
