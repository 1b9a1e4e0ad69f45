"""Side by side: cps.cp_attention against PyTorch's own context parallelism, on the same tokens.

    torchrun --nproc-per-node N benchmarks/torch_cp.py [--local-seqs 8192 32768] [--comms ring all_gather auto]
    torchrun --nproc-per-node N benchmarks/torch_cp.py --sdpa-backends flash cudnn --rotate allgather alltoall
    python benchmarks/torch_cp.py --dry-run     # CPU, gloo, 2 ranks started here (or torchrun's), tiny float32

Causal attention, Gemma2-9B heads (16 query / 8 KV, D 256), bf16, --local-seqs tokens per GPU
(global S = N x that), two cases:
  no softcap: torch.distributed.tensor.experimental.context_parallel(mesh, buffers=...,
      buffer_seq_dims=...) around F.scaled_dot_product_attention(..., is_causal=True): torch shards
      the buffers in place with its head-tail load balancer (chunks r and 2N-1-r, the same tokens
      as cps's zigzag shards: checked), for each --rotate method and each --sdpa-backends backend,
      against cps.cp_attention(..., softcap=0) for each --comms.
  softcap 50: torch's FlexAttention CP (the _ContextParallel FLEX style with
      _context_parallel_shard and its CP block mask: K/V all-gathered, then flex_attention with a
      `cap * tanh(score / cap)` score_mod, compiled on GPU), against cps.cp_attention(..., softcap=50).
      torch's flex CP has no alltoall rotation and no ring; where it cannot run, the error is recorded.
GQA: torch's SDPA CP runs with enable_gqa=True (8 KV heads) and with the KV heads repeated to 16
("kv_heads": 16); cps runs both ways too. Flex takes GQA natively (enable_gqa=True).
Times: fwd (no autograd) and fwd+bwd, per rank the median of do_bench, then the max over ranks.
ratio = time of torch's fastest variant of the same case and shape / this cps time (>1: cps is
faster). max_abs_diff: torch's unsharded output (its context_parallel_unshard) against cps's
(sharding.gather), both from the same inputs, so the two compute the same thing.
Writes benchmarks/results/torch_cp_N<N>[_tag].json and .png on rank 0 (a dry run: into $OUT or a
new temporary folder, never into the tracked results). On CPU, torch's SDPA CP has no kernel
(it dispatches only the CUDA flash / efficient / cuDNN SDPA ops) and flex has no backward: the
dry run records those errors and runs everything else.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cp_softcap as cps                                           # noqa: E402
from cp_softcap.sharding import gather, shard                      # noqa: E402
from benchmarks._util import (OUT_DIR_HELP, bar_plot, bench_ms, launch_ranks, out_dir_for,  # noqa: E402
                              save, table)

CASES = (("no_softcap", 0.0), ("softcap", None))   # None: --softcap


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}" if str(e).strip() else type(e).__name__


def _timed(fwd: Callable[[], object], fwd_bwd: Callable[[], object], rep_ms: int) -> Dict:
    """fwd and fwd+bwd medians on this rank; an exception becomes the record's error."""
    out = dict(fwd_ms=None, fwd_bwd_ms=None, error=None)
    for key, fn in (("fwd_ms", fwd), ("fwd_bwd_ms", fwd_bwd)):
        try:
            out[key] = bench_ms(fn, rep_ms=rep_ms)
        except Exception as e:              # torch's CP on CPU, a backend that rejects the shape
            out["error"] = (out["error"] + "; " if out["error"] else "") + f"{key[:-3]}: {_err(e)}"
    return out


def _max_over_ranks(rec: Dict, dev: torch.device) -> Dict:
    """Times -> max over ranks; a time any rank could not take -> None on every rank."""
    vals = [rec[k] if rec[k] is not None else float("inf") for k in ("fwd_ms", "fwd_bwd_ms")]
    t = torch.tensor(vals, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    rec["fwd_ms"], rec["fwd_bwd_ms"] = (v if v != float("inf") else None for v in t.tolist())
    return rec


class _FlexAttention(nn.Module):
    """flex_attention with a tanh softcap score_mod: the module torch's FLEX CP style wraps."""

    def __init__(self, cap: float, compiled: bool):
        super().__init__()
        from torch.nn.attention.flex_attention import flex_attention
        if compiled:
            # one compile per shape and cap: past dynamo's limit (8 per code object) it falls back
            # to eager flex silently, which materialises the scores (128 GiB at 27B heads, 32K)
            from cp_softcap.kernels.flex import _raise_recompile_limit
            _raise_recompile_limit(64)
        self.flex = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention
        # one score_mod for every call: a new closure per call could make dynamo recompile
        self.score_mod = (lambda s, b, h, q_idx, kv_idx: cap * torch.tanh(s / cap)) if cap else None  # noqa: E731

    def forward(self, q, k, v, block_mask):
        return self.flex(q, k, v, score_mod=self.score_mod, block_mask=block_mask,
                         enable_gqa=k.shape[1] != q.shape[1])


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _torch_sdpa(full: List[torch.Tensor], mesh, backend: str, rotate: str, gqa: bool, rep_ms: int):
    """torch's SDPA CP on buffers [B, H, S, D] it shards in place: (timings, local output or None,
    this rank's query shard as torch cut it)."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.nn.attention import SDPBackend, sdpa_kernel
    set_rotate_method(rotate)
    bufs = [t.transpose(1, 2).contiguous() for t in full]
    kernel = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION, "default": None}[backend]
    kw = dict(is_causal=True, enable_gqa=True) if gqa else dict(is_causal=True)
    out = None
    with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2] * 4, no_restore_buffers=set(bufs)):
        q, k, v, dout = bufs
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

        def fwd():
            with torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, **kw)   # looked up here: CP patches it

        def fwd_bwd():
            F.scaled_dot_product_attention(qg, kg, vg, **kw).backward(dout)

        with sdpa_kernel(kernel) if kernel is not None else contextlib.nullcontext():
            rec = _timed(fwd, fwd_bwd, rep_ms)
            if rec["fwd_ms"] is not None:
                out = fwd()
    return rec, out, bufs[0]


def _torch_flex(full: List[torch.Tensor], mesh, cap: float, compiled: bool, rep_ms: int):
    """torch's FlexAttention CP: (timings, local output [B, H, S/N, D], load balancer)."""
    # the module every torch release with CP has had (since 2.9 a re-export of _context_parallel)
    from torch.distributed.tensor.experimental._attention import (
        _ContextParallel, _context_parallel_shard, _HeadTailLoadBalancer)
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.attention.flex_attention import create_block_mask
    if not compiled:
        _quiet_eager_flex()
    s = full[0].shape[1]
    dev = full[0].device
    lb = _HeadTailLoadBalancer(s, mesh.size(), dev)
    # the global causal mask, built blockwise (compiled) on GPU: a dense S x S mask would not fit
    global_mask = create_block_mask(_causal, 1, 1, s, s, device=dev, _compile=compiled)
    q, k, v, dout, block_mask = _context_parallel_shard(
        mesh, [t.transpose(1, 2).contiguous() for t in full] + [global_mask], [2] * 5, load_balancer=lb)
    attn = parallelize_module(_FlexAttention(cap, compiled), mesh,
                              _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX))
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def fwd():
        with torch.no_grad():
            return attn(q, k, v, block_mask)

    def fwd_bwd():
        attn(qg, kg, vg, block_mask).backward(dout)

    rec = _timed(fwd, fwd_bwd, rep_ms)
    return rec, (fwd() if rec["fwd_ms"] is not None else None), lb


def _cps(local: List[torch.Tensor], group, cap: float, comm: str, rep_ms: int):
    q, k, v, dout = local
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    call = lambda q, k, v: cps.cp_attention(q, k, v, group, softcap=cap, causal=True, comm=comm)  # noqa: E731

    def fwd():
        with torch.no_grad():
            return call(q, k, v)

    def fwd_bwd():
        call(qg, kg, vg).backward(dout)

    rec = _timed(fwd, fwd_bwd, rep_ms)
    return rec, (fwd() if rec["fwd_ms"] is not None else None)


def run(a: argparse.Namespace, rank: int, world: int, cuda: bool) -> Optional[Dict]:
    """Every case and shape on this rank (the process group is up). Rank 0 writes the JSON after
    each case (meta "complete": false until the last) and returns the blob with its "path"."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(dev.type, (world,))
    group = dist.group.WORLD
    hq, hkv, d = a.heads
    dtype = torch.bfloat16 if cuda else torch.float32
    records: List[Dict] = []
    shards_match = []
    for s_local in a.local_seqs:
        s = s_local * world
        g = torch.Generator(device=dev).manual_seed(0)          # same inputs on every rank
        base = [torch.randn(1, s, h, d, generator=g, device=dev, dtype=dtype) for h in (hq, hkv, hkv, hq)]
        kv_opts = [hkv] + ([hq] if hkv != hq else [])
        inputs = {h: base if h == hkv else [base[0], *(t.repeat_interleave(hq // hkv, dim=2) for t in base[1:3]),
                                             base[3]] for h in kv_opts}
        for case, cap in CASES:
            cap = a.softcap if cap is None else cap
            common = dict(case=case, softcap=cap, S=s, S_local=s_local, N=world)
            ref = None                                       # cps's unsharded output, first comm, GQA
            cps_recs = []
            for h in kv_opts:
                local = [shard(t, world, rank).contiguous() for t in inputs[h]]
                for comm in a.comms:
                    rec, out = _cps(local, group, cap, comm, a.rep_ms)
                    if out is not None and ref is None:
                        ref = gather(out, group).float()
                    cps_recs.append(_max_over_ranks(dict(common, system="cps", method=comm, kv_heads=h, **rec), dev))
                del local
            torch_recs = []
            if case == "no_softcap":
                variants = [(b, r, gqa) for b in a.sdpa_backends for r in a.rotate for gqa in (True, False)
                            if gqa or hkv != hq]
                for backend, rotate, gqa in variants:
                    h = hkv if gqa else hq
                    try:
                        rec, out, q_local = _torch_sdpa(inputs[h], mesh, backend, rotate, gqa, a.rep_ms)
                    except Exception as e:                  # e.g. an API missing from this torch
                        rec, out, q_local = dict(fwd_ms=None, fwd_bwd_ms=None, error=_err(e)), None, None
                    if q_local is not None and not shards_match:
                        mine = shard(inputs[h][0], world, rank).transpose(1, 2)
                        shards_match.append(bool(torch.equal(q_local, mine)))
                    diff = None
                    if out is not None and ref is not None:
                        full_out = context_parallel_unshard(mesh, [out], [2])[0]
                        diff = (full_out.transpose(1, 2).float() - ref).abs().max().item()
                    torch_recs.append(_max_over_ranks(dict(
                        common, system="torch_cp", method=f"sdpa-{backend}/{rotate}", kv_heads=h,
                        enable_gqa=gqa, max_abs_diff=diff, **rec), dev))
            else:
                try:
                    rec, out, lb = _torch_flex(inputs[hkv], mesh, cap, cuda, a.rep_ms)
                except Exception as e:          # flex CP missing from this torch, or rejects the shape
                    rec, out, lb = dict(fwd_ms=None, fwd_bwd_ms=None, error=_err(e)), None, None
                diff = None
                if out is not None and ref is not None:
                    full_out = context_parallel_unshard(mesh, [out], [2], load_balancer=lb)[0]
                    diff = (full_out.transpose(1, 2).float() - ref).abs().max().item()
                torch_recs.append(_max_over_ranks(dict(
                    common, system="torch_cp", method="flex/allgather", kv_heads=hkv, enable_gqa=True,
                    max_abs_diff=diff, **rec), dev))
            for key in ("fwd", "fwd_bwd"):              # ratio against torch's fastest variant
                done = [r for r in torch_recs if r[f"{key}_ms"] is not None]
                best = min(done, key=lambda r: r[f"{key}_ms"]) if done else None
                for r in cps_recs:
                    ok = best is not None and r[f"{key}_ms"]
                    r[f"torch_best_{key}"] = f"{best['method']} kv{best['kv_heads']}" if best else None
                    r[f"ratio_{key}"] = best[f"{key}_ms"] / r[f"{key}_ms"] if ok else None
            records += torch_recs + cps_recs
            del ref
            if rank == 0:     # after each case: a run cut short by a time limit keeps what it measured
                save(_stem(a, world), records, _meta(a, world, dev, dtype, shards_match, complete=False),
                     a.out_dir)
        del base, inputs
    if rank != 0:
        return None
    blob = dict(records=records, meta=_meta(a, world, dev, dtype, shards_match, complete=True))
    blob["path"] = save(_stem(a, world), blob["records"], blob["meta"], a.out_dir)
    return blob


def _stem(a: argparse.Namespace, world: int) -> str:
    return f"torch_cp_N{world}" + (f"_{a.tag}" if a.tag else "")


def _meta(a: argparse.Namespace, world: int, dev: torch.device, dtype: torch.dtype, shards_match: List[bool],
          complete: bool) -> Dict:
    hq, hkv, d = a.heads
    kernels = {}
    for case, cap in CASES:
        cap = a.softcap if cap is None else cap
        try:
            kernels[case] = cps.select(cps.make_spec(
                head_dim=d, num_heads=hq, num_kv_heads=hkv, dtype=dtype, device_type=dev.type,
                softcap=cap, causal=True, cp_size=world)).name
        except Exception as e:
            kernels[case] = _err(e)
    meta = dict(complete=complete, cps_kernel=kernels, world=world, heads=[hq, hkv, d], softcap=a.softcap,
                dtype=str(dtype), causal=True, backend="nccl" if dev.type == "cuda" else "gloo",
                torch_version=torch.__version__,
                local_seqs=a.local_seqs, comms=a.comms, sdpa_backends=a.sdpa_backends, rotate=a.rotate,
                shards_match=all(shards_match) if shards_match else None,
                gqa=(f"torch's SDPA CP runs with enable_gqa=True (kv_heads {hkv}) and with the K/V heads "
                     f"repeated (kv_heads {hq}); cps runs both; torch's flex CP takes GQA natively"),
                softcap_in_torch=("SDPA has no softcap (no score_mod), so torch's SDPA CP serves only the "
                                  "no-softcap case; the softcap case uses torch's flex CP"),
                sdpa_cp_kernels=("torch's SDPA CP dispatches only the CUDA flash / efficient / cuDNN SDPA ops: "
                                 "on CPU it raises NotImplementedError (recorded)"),
                flex=("torch's flex CP: _ContextParallel FLEX style + _context_parallel_shard, K/V "
                      "all-gathered (no alltoall, no ring), flex_attention compiled on GPU, eager on CPU"),
                ratio="torch's fastest variant (same case and S) / this cps time, max-over-ranks medians",
                max_abs_diff="torch's unsharded output vs cps's (first comm, GQA), same inputs")
    return meta


def _rank(rank: int, world: int, a: argparse.Namespace) -> Optional[Dict]:
    return run(a, rank, world, cuda=False)


def _quiet_eager_flex() -> None:
    """On CPU flex runs eagerly on purpose (tiny shapes): drop its advice to compile it."""
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")


def plot(blob: Dict, png: str) -> None:
    """torch's time / cps's time for every cps record, fwd and fwd+bwd (1.0: equal)."""
    recs = [r for r in blob["records"] if r["system"] == "cps"]
    meta = blob["meta"]
    cases = {"no_softcap": "no cap", "softcap": f"cap {meta.get('softcap')}"}
    labels = [f"{r['S_local'] // 1024 or r['S_local']}{'K' if r['S_local'] >= 1024 else ''} "
              f"{cases.get(r['case'], r['case'])} {r['method']} kv{r['kv_heads']}" for r in recs]
    nan = float("nan")
    series = {k: [r.get(f"ratio_{k}") if r.get(f"ratio_{k}") is not None else nan for r in recs]
              for k in ("fwd", "fwd_bwd")}
    bar_plot(png, labels, {"fwd": series["fwd"], "fwd+bwd": series["fwd_bwd"]},
             "torch CP time / cps time",
             f"vs torch context_parallel, N={meta.get('world')}, heads {meta.get('heads')}, "
             f"{meta.get('dtype')}", hline=1.0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--local-seqs", type=int, nargs="+", default=[8192, 32768],
                   help="tokens per GPU; the global sequence is N times this")
    p.add_argument("--comms", nargs="+", default=["ring", "all_gather", "auto"])
    p.add_argument("--sdpa-backends", nargs="+", default=["flash", "cudnn"],
                   choices=["flash", "cudnn", "efficient", "default"])
    p.add_argument("--rotate", nargs="+", default=["allgather", "alltoall"], choices=["allgather", "alltoall"])
    p.add_argument("--heads", type=int, nargs=3, default=[16, 8, 256], metavar=("HQ", "HKV", "D"))
    p.add_argument("--softcap", type=float, default=50.0)
    p.add_argument("--rep-ms", type=int, default=200)
    p.add_argument("--tag", default="", help="suffix of the output files: torch_cp_N<N>_<tag>.json")
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args(argv)
    hq, hkv, _ = a.heads
    if hq % hkv:
        p.error(f"--heads: {hq} query heads are not a multiple of {hkv} KV heads; use e.g. 16 8 256")
    cuda = torch.cuda.is_available() and not a.dry_run
    a.out_dir = out_dir_for(a.out_dir, dry=not cuda)
    if not cuda:          # tiny float32 shapes; torch's flex CP block mask needs S_local % 128 == 0
        a.local_seqs, a.heads, a.rep_ms = [128], [4, 2, 32], 10
        a.sdpa_backends = ["default"]
    if "RANK" in os.environ:                                  # under torchrun
        dist.init_process_group("nccl" if cuda else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        blob = run(a, rank, world, cuda)
        dist.destroy_process_group()
    elif cuda:
        p.error("on GPUs, start it with torchrun --nproc-per-node N (one GPU per rank)")
    else:
        world = 2
        blob = launch_ranks(_rank, world, (a,), timeout=300, pg_timeout=120)[0]
    if blob is None:
        return 0
    path = blob["path"]
    from benchmarks.plots import plot_json
    plot_json(path)
    rows = [["S/N", "case", "system", "method", "kv", "fwd ms", "fwd+bwd ms", "ratio fwd", "ratio f+b",
             "diff", "error"]]
    f = lambda x, n=2: "-" if x is None else f"{x:.{n}f}"  # noqa: E731
    for r in blob["records"]:
        rows.append([r["S_local"], r["case"], r["system"], r["method"], r["kv_heads"], f(r["fwd_ms"]),
                     f(r["fwd_bwd_ms"]), f(r.get("ratio_fwd"), 3), f(r.get("ratio_fwd_bwd"), 3),
                     "-" if r.get("max_abs_diff") is None else f"{r['max_abs_diff']:.1e}",
                     (r["error"] or "")[:70]])
    print(table(rows))
    print(f"shards match: {blob['meta']['shards_match']}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
