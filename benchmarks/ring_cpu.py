"""Ring CP on CPU with the `torch` kernel: framework overhead and forward peak memory (issue 3).

    python benchmarks/ring_cpu.py            # full run (cp 2 and 4, local 256 and 1024 tokens)
    python benchmarks/ring_cpu.py --quick    # cp 2 and 4, local 256 tokens, < 60 s; writes into
                                             # $OUT or a new temporary folder

Each cp size is one launch of cp processes (gloo, file rendezvous, one thread per rank, rank r
pinned to core r % ncores). Only public entry points are used: cps.cp_attention for the ring,
cp_softcap.layout (needs, plan_step; block_plan / ring_blocks when present) for the
geometry, cp_softcap.kernels.get_kernel("torch") for the kernel and cp_softcap.merge for merges.

Time. Every rep: barrier, ring call (cp_attention, comm="ring", softcap 50, causal), barrier,
then the reference kernel calls alone on the same rank at the same moment on every rank (so a
4-ranks-on-2-cores run is equally contended in both). Two references:
  per-step: for every source rank the queries see (layout.needs), the calls layout.plan_step
            plans for (rank, src), on local slices of the right shapes;
  as-ring:  the calls the ring actually makes (layout.block_plan per ring block, coalesced
            calls included) on buffers of the block's shape; only when layout has block_plan.
overhead = (ring - reference) / reference, per rank, median over reps of the paired ratio.
Steps = sum(needs[rank]) (the self step included); time per step = time / steps.
Breakdown of the ring call (wrappers installed only around the ring call, ~1 us each): time in
kernel.forward/backward, in the ring module's merge_into, in Exchange.wait (exposed comm), in
plan_for (the call's plan: a cache lookup after the first call); "other" = the rest (buffers, posting sends, autograd,
Python). Wrappers whose target does not exist are skipped (reported as null).

Memory (forward, inputs without grad), a separate launch with MALLOC_MMAP_THRESHOLD_ fixed so
every allocation > 64 KiB is its own mmap and free returns it to the OS:
  alloc peak: torch.profiler(profile_memory=True) records every CPU-allocator allocation and
              free on the calling thread; peak of the running sum during the call = bytes
              allocated above the state before the call (what the issue means by peak);
  rss peak:   VmHWM - VmRSS with the HWM reset (/proc/self/clear_refs 5) just before the call;
              a cross-check that also sees non-torch memory (gloo, malloc metadata).
The kernel's working set is the largest alloc peak of any one of the ring's calls, each
measured alone. Model: accumulator (out [B,S,Hq,Dv] + lse [B,Hq,S], float32) + 2 K/V buffers (2 x one rank's
K+V) + the kernel's own working set (the largest call's alloc peak measured alone, and the
torch_kernel docstring's formula 5*B*Hq*bq*bk*4 + B*Hq*Sq*(Dv+1)*4 next to it).
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._util import OUT_DIR_HELP, launch_ranks, out_dir_for, save, table  # noqa: E402
from benchmarks.plots import plot_json  # noqa: E402

HQ, HKV, D, B, CAP = 8, 4, 64, 1, 50.0
WINDOW = (None, 0)   # causal, as normalize_window(None, causal=True) gives


# ----------------------------------------------------------------------------- geometry

def _ring_calls(cp, rank, chunk):
    """[(n_keys_of_buffer, calls)] the ring makes, from layout.block_plan; None if the layout
    has no block API (the pre-coalescing ring: one plan_step per step)."""
    from cp_softcap import layout
    from cp_softcap.settings import ring_block_keys
    if not all(hasattr(layout, n) for n in ("block_plan", "ring_blocks")):
        return None
    out = [(2 * chunk, tuple(layout.plan_step(cp, rank, rank, chunk, WINDOW)))]
    for steps in layout.ring_blocks(cp, 2 * chunk, ring_block_keys()):
        slots, calls = layout.block_plan(cp, rank, chunk, WINDOW, tuple(steps))
        out.append((sum(s.k1 - s.k0 for s in slots), tuple(calls)))
    return out


def _step_calls(cp, rank, chunk):
    from cp_softcap.layout import needs, plan_step
    need = needs(cp, chunk, WINDOW)
    return [(2 * chunk, tuple(plan_step(cp, rank, src, chunk, WINDOW)))
            for src in range(cp) if need[rank][src]]


def _local_inputs(shapes, seed):
    """Yield (s_local, modes, chunk, q, k, v) for each (s_local, modes) of shapes: this rank's
    random local Q/K/V of s_local tokens (two chunks of `chunk`), from a generator seeded `seed`."""
    import torch
    for s_local, modes in shapes:
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(B, s_local, HQ, D, generator=g)
        k = torch.randn(B, s_local, HKV, D, generator=g)
        v = torch.randn(B, s_local, HKV, D, generator=g)
        yield s_local, modes, s_local // 2, q, k, v


def _call_buffers(k, v, groups):
    """[(call, K buffer, V buffer)] for every call of every group, in order; each group's buffers
    hold its key count (the self group's are the local K/V, the others random)."""
    import torch
    out = []
    for i, (n, calls) in enumerate(groups):
        kb, vb = ((k, v) if i == 0 and n == k.shape[1]
                  else (torch.randn(B, n, HKV, D), torch.randn(B, n, HKV, D)))
        out += [(c, kb, vb) for c in calls]
    return out


def _sliced(q, calls):
    """Yield (call, q, k, v) with each call's slices of q and of its K/V buffers (_call_buffers),
    slicing as it goes: inside the timed loops, as the ring slices per call."""
    for c, kb, vb in calls:
        yield c, q[:, c.q0:c.q1], kb[:, c.k0:c.k1], vb[:, c.k0:c.k1]


# ----------------------------------------------------------------------------- workers

def _barrier():
    import torch.distributed as dist
    dist.barrier()


def _forward(kernel, c, qs, ks, vs, scale):
    """The kernel class's forward (never a _Probe wrapper) for one call."""
    return type(kernel).forward(kernel, qs, ks, vs, scale=scale, softcap=CAP, window=c.window)


def _kernels_alone(kernel, q, calls, scale, backward, keep=None):
    """Run the calls of _call_buffers on the kernel alone (forward, + backward if asked)."""
    import torch
    for c, qs, ks, vs in _sliced(q, calls):
        out, lse = _forward(kernel, c, qs, ks, vs, scale)
        if keep is not None:
            keep.append((c, out, lse))
        if backward:
            type(kernel).backward(kernel, torch.ones_like(out), qs, ks, vs, out, lse, scale=scale,
                                  softcap=CAP, window=c.window)


class _Probe:
    """Time wrappers around the ring's collaborators, installed only during the ring call."""

    def __init__(self, kernel):
        self.kernel, self.t, self.n, self.saved = kernel, defaultdict(float), defaultdict(int), []
        self.present = {}

    def _wrap(self, owner, name, key, instance=False):
        orig = getattr(owner, name, None)
        self.present[key] = self.present.get(key, False) or orig is not None
        if orig is None:
            return
        t, n = self.t, self.n

        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                t[key] += time.perf_counter() - t0
                n[key] += 1
        setattr(owner, name, wrapper)
        self.saved.append((owner, name, None if instance else orig))

    def __enter__(self):
        import cp_softcap.transport as transport
        self.t.clear()
        self.n.clear()
        self._wrap(self.kernel, "forward", "kernel", instance=True)
        self._wrap(self.kernel, "backward", "kernel", instance=True)
        try:
            import cp_softcap.cp.ring as ring_mod
            self._wrap(ring_mod, "merge_into", "merge")
        except ImportError:
            self.present["merge"] = False
        self._wrap(getattr(transport, "Exchange", None), "wait", "comm_wait")
        import cp_softcap.api as api
        self._wrap(api, "plan_for", "checks")
        return self

    def __exit__(self, *exc):
        for owner, name, orig in reversed(self.saved):
            if orig is None:
                delattr(owner, name)
            else:
                setattr(owner, name, orig)
        self.saved.clear()

    def snapshot(self, total):
        keys = ("kernel", "merge", "comm_wait", "checks")
        d = {k: (self.t[k] * 1e3 if self.present.get(k) else None) for k in keys}
        d["other"] = total * 1e3 - sum(x for x in d.values() if x)
        d["kernel_calls"] = self.n["kernel"]
        return d


def _time_worker(rank, cp, shapes, reps):
    import torch
    import torch.distributed as dist
    import cp_softcap as cps
    from cp_softcap.kernels import get_kernel
    from cp_softcap.layout import needs
    from cp_softcap.merge import merge_into, new_accumulator
    from cp_softcap.kernels.base import grad_dtype
    kernel = get_kernel("torch")
    scale = 1.0 / math.sqrt(D)
    records = []
    for s_local, modes, chunk, q, k, v in _local_inputs(shapes, 1000 + rank):
        steps = sum(needs(cp, chunk, WINDOW)[rank])
        refs = {"per_step": _call_buffers(k, v, _step_calls(cp, rank, chunk))}
        ring_groups = _ring_calls(cp, rank, chunk)
        if ring_groups is not None:
            refs["as_ring"] = _call_buffers(k, v, ring_groups)
        for mode in modes:
            bwd = mode == "fwd+bwd"
            n_rep = reps[(s_local, mode)]
            ring_t, ref_t, parts = [], defaultdict(list), []
            for rep in range(n_rep + 1):            # rep 0: warm-up, not recorded
                qq, kk, vv = (x.detach().requires_grad_(bwd) for x in (q, k, v))
                probe = _Probe(kernel)
                _barrier()
                t0 = time.perf_counter()
                with probe:
                    out = cps.cp_attention(qq, kk, vv, dist.group.WORLD, softcap=CAP,
                                           causal=True, comm="ring", backend="torch")
                    if bwd:
                        out.backward(torch.ones_like(out))
                dt = time.perf_counter() - t0
                del out, qq, kk, vv
                br = probe.snapshot(dt)
                if cp > 1 and steps > 1 and br["kernel_calls"] < 2:
                    raise RuntimeError(f"the ring made {br['kernel_calls']} kernel call(s) for "
                                       f"{steps} steps: not the CP path?")
                for name, calls in refs.items():
                    _barrier()
                    t0 = time.perf_counter()
                    _kernels_alone(kernel, q, calls, scale, bwd)
                    ref_t[name].append(time.perf_counter() - t0)
                if rep:
                    ring_t.append(dt)
                    parts.append(br)
                else:
                    for name in ref_t:
                        ref_t[name].clear()
            rec = {"cp": cp, "rank": rank, "s_local": s_local, "s_global": s_local * cp,
                   "mode": mode, "reps": n_rep, "steps": steps,
                   "ring_ms": statistics.median(ring_t) * 1e3,
                   "ring_ms_all": [x * 1e3 for x in ring_t],
                   "breakdown_ms": {kk_: (statistics.median([p[kk_] for p in parts])
                                          if parts[0][kk_] is not None else None)
                                    for kk_ in parts[0]}}
            for name, ts in ref_t.items():
                rec[f"{name}_ms"] = statistics.median(ts) * 1e3
                rec[f"{name}_calls"] = len(refs[name])
                rec[f"overhead_vs_{name}"] = statistics.median(
                    [(r - a) / a for r, a in zip(ring_t, ts)])
            kin = rec["breakdown_ms"]["kernel"]
            rec["overhead_vs_in_ring_kernel"] = (rec["ring_ms"] - kin) / kin if kin else None
            rec["ring_ms_per_step"] = rec["ring_ms"] / steps
            rec["per_step_ms_per_step"] = rec["per_step_ms"] / steps
            if not bwd:
                # merge + accumulator alone, on the reference partials (component timing)
                keep = []
                _kernels_alone(kernel, q, refs.get("as_ring", refs["per_step"]), scale, False, keep)
                mts = []
                for _ in range(max(3, n_rep)):
                    t0 = time.perf_counter()
                    ao, al = new_accumulator(q.shape, D, grad_dtype(q.dtype), q.device)
                    for c, o, lse in keep:
                        merge_into(ao[:, c.q0:c.q1], al[:, :, c.q0:c.q1], o, lse)
                    mts.append(time.perf_counter() - t0)
                rec["merge_alone_ms"] = statistics.median(mts) * 1e3
                rec["raw_comm_ms"] = _raw_comm(rank, cp, k, v, chunk)
            records.append(rec)
    return records


def _raw_comm(rank, cp, k, v, chunk):
    """Un-overlapped gloo time to move one step's K/V (the key range each peer needs),
    all ranks at once, summed over the steps this rank receives: what comm would cost exposed."""
    import torch
    import torch.distributed as dist
    from cp_softcap.layout import needs, plan_step
    need = needs(cp, chunk, WINDOW)

    def key_rng(qr, kr):
        calls = plan_step(cp, qr, kr, chunk, WINDOW)
        return (min(c.k0 for c in calls), max(c.k1 for c in calls)) if calls else None

    total = []
    for _ in range(3):
        t_sum = 0.0
        for s in range(1, cp):
            src, dst = (rank - s) % cp, (rank + s) % cp
            ops = []
            kr = key_rng(dst, rank)
            if kr is not None:
                buf = torch.cat([k[:, kr[0]:kr[1]].reshape(-1), v[:, kr[0]:kr[1]].reshape(-1)])
                ops.append(dist.P2POp(dist.isend, buf, dst))
            kr = key_rng(rank, src)
            if kr is not None and need[rank][src]:
                n = (kr[1] - kr[0]) * HKV * D * 2 * B
                ops.append(dist.P2POp(dist.irecv, torch.empty(n), src))
            _barrier()
            t0 = time.perf_counter()
            if ops:
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
            t_sum += time.perf_counter() - t0
        total.append(t_sum)
    return statistics.median(total) * 1e3


def _alloc_peak(fn):
    """(result, peak bytes) of fn() above the allocator state before it (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        res = fn()
    evs = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    run = peak = 0
    for e in sorted(evs, key=lambda e: e.start_ns()):
        run += e.nbytes()
        peak = max(peak, run)
    return res, peak


def _status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


def _rss_peak(fn):
    """(result, VmHWM - VmRSS in bytes across fn()), or (result, None) if HWM cannot be reset."""
    import gc
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return fn(), None
    base = _status_kb("VmRSS")
    res = fn()
    return res, (_status_kb("VmHWM") - base) * 1024


def _kernel_formula(kernel, sq, sk):
    bq, bk = min(getattr(kernel, "block_q", 1024), sq), min(getattr(kernel, "block_k", 1024), sk)
    lim = getattr(kernel, "max_block_elems", 1 << 23)
    while B * HQ * bq * bk > lim and (bq > 16 or bk > 16):
        if bk >= bq:
            bk = max(16, bk // 2)
        else:
            bq = max(16, bq // 2)
    return 5 * B * HQ * bq * bk * 4 + B * HQ * sq * (D + 1) * 4


def _mem_worker(rank, cp, shapes, reps):
    import torch.distributed as dist
    import cp_softcap as cps
    from cp_softcap.kernels import get_kernel
    kernel = get_kernel("torch")
    scale = 1.0 / math.sqrt(D)
    records = []
    for s_local, _, chunk, q, k, v in _local_inputs(shapes, 2000 + rank):
        ring = lambda: cps.cp_attention(q, k, v, dist.group.WORLD, softcap=CAP,  # noqa: E731
                                        causal=True, comm="ring", backend="torch")
        ring()                                               # warm-up (plans, signature, gloo)
        _barrier()
        _, alloc = _alloc_peak(ring)
        _barrier()
        _, rss = _rss_peak(ring)
        # the kernel's working set: its largest call (as the ring makes them), measured alone
        groups = _ring_calls(cp, rank, chunk) or _step_calls(cp, rank, chunk)
        kpeak, kform, largest = 0, 0, None
        for c, qs, ks, vs in _sliced(q, _call_buffers(k, v, groups)):
            _, pk = _alloc_peak(lambda: _forward(kernel, c, qs, ks, vs, scale))  # noqa: B023
            kform = max(kform, _kernel_formula(kernel, c.q1 - c.q0, c.k1 - c.k0))
            if pk > kpeak:
                kpeak, largest = pk, c
        c = largest
        acc = B * s_local * HQ * D * 4 + B * HQ * s_local * 4
        kv = B * s_local * HKV * 2 * D * 4
        remote = [n for n, _ in groups[1:]]
        records.append({
            "cp": cp, "rank": rank, "s_local": s_local, "alloc_peak": alloc, "rss_peak": rss,
            "acc_bytes": acc, "kv_buffer_bytes": kv,
            "kernel_peak_alone": kpeak,
            "kernel_formula": kform,
            "largest_call": [c.q1 - c.q0, c.k1 - c.k0, list(c.window)],
            "ring_block_keys": remote,
            "ring_block_bytes_max2": sum(sorted(remote, reverse=True)[:2]) * HKV * 2 * D * 4 * B,
            "model_issue": acc + 2 * kv + kpeak})
    return records


def launch(fn, world, args, env, timeout=900.0):
    """Every record fn returns, over the ranks of one launch (rank r pinned to core r % ncores)."""
    per_rank = launch_ranks(fn, world, args, env=env, timeout=timeout, pg_timeout=600,
                            pin_cores=True, fresh=True)     # malloc's settings from exec
    return [rec for recs in per_rank for rec in recs]


# ----------------------------------------------------------------------------- main

def _mib(x):
    return "n/a" if x is None else f"{x / 2**20:.1f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="local 256 tokens only, fewer reps")
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--name", default="ring_cpu")
    ap.add_argument("--out-dir", default=None, help=OUT_DIR_HELP.replace("a dry run", "--quick"))
    args = ap.parse_args()
    args.out_dir = out_dir_for(args.out_dir, dry=args.quick)
    if args.quick:
        shapes = [(256, ("fwd", "fwd+bwd"))]
        reps = {(256, "fwd"): 3, (256, "fwd+bwd"): 2}
    else:
        shapes = [(256, ("fwd", "fwd+bwd")), (1024, ("fwd", "fwd+bwd"))]
        reps = {(256, "fwd"): 7, (256, "fwd+bwd"): 5, (1024, "fwd"): 5, (1024, "fwd+bwd"): 3}
    env = {"CP_SOFTCAP_TIMEOUT": "600", "OMP_NUM_THREADS": "1"}
    mem_env = {**env, "MALLOC_MMAP_THRESHOLD_": "65536"}
    t_start = time.time()
    timing, memory = [], []
    for cp in args.cp:
        t0 = time.time()
        timing += launch(_time_worker, cp, (shapes, reps), env)
        memory += launch(_mem_worker, cp, (shapes, reps), mem_env)
        print(f"cp={cp}: {time.time() - t0:.0f} s", flush=True)

    import torch
    meta = {"what": "ring framework overhead + forward peak memory, torch kernel, CPU gloo",
            "B": B, "Hq": HQ, "Hkv": HKV, "D": D, "dtype": "float32", "softcap": CAP,
            "causal": True, "threads_per_rank": 1, "cores": os.cpu_count(),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "torch": torch.__version__, "quick": args.quick,
            "CP_SOFTCAP_RING_BLOCK_KEYS": os.environ.get("CP_SOFTCAP_RING_BLOCK_KEYS"),
            "wall_s": round(time.time() - t_start, 1)}
    try:
        import subprocess
        meta["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    except Exception:
        pass
    path = save(args.name, timing + memory, meta, args.out_dir)

    pct = lambda x: "n/a" if x is None else f"{100 * x:+.1f}%"  # noqa: E731
    rows = [["cp", "S_loc", "mode", "rank", "steps", "ring ms", "per-step ref ms", "ovh",
             "as-ring ref ms", "ovh", "ovh vs in-ring kernel",
             "kernel|merge|wait|checks|other ms"]]
    for r in timing:
        b = r["breakdown_ms"]
        f = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
        rows.append([r["cp"], r["s_local"], r["mode"], r["rank"], r["steps"], f"{r['ring_ms']:.1f}",
                     f"{r['per_step_ms']:.1f}", pct(r["overhead_vs_per_step"]),
                     f(r.get("as_ring_ms")), pct(r.get("overhead_vs_as_ring")),
                     pct(r["overhead_vs_in_ring_kernel"]),
                     "|".join(f(b[x]) for x in ("kernel", "merge", "comm_wait", "checks", "other"))])
    print(table(rows))
    rows = [["cp", "S_loc", "rank", "alloc peak MiB", "rss peak MiB", "acc", "1 K/V buf",
             "kernel alone", "kernel formula", "model acc+2KV+kernel"]]
    for m in memory:
        rows.append([m["cp"], m["s_local"], m["rank"], _mib(m["alloc_peak"]), _mib(m["rss_peak"]),
                     _mib(m["acc_bytes"]), _mib(m["kv_buffer_bytes"]), _mib(m["kernel_peak_alone"]),
                     _mib(m["kernel_formula"]), _mib(m["model_issue"])])
    print(table(rows))

    plot_json(path)
    print(f"wrote {path} (+ .png) in {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
