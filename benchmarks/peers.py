"""Peers side by side: cps.cp_attention next to ring-flash-attention, yunchang and PyTorch's
context_parallel, on the same tokens: who is exact (against float64), who drops the softcap or
the window, and who is faster, by ratio, in one run.

    python benchmarks/peers.py                       # one GPU: world size 1 for every system
    torchrun --nproc-per-node N benchmarks/peers.py  # N GPUs, NCCL: one JSON and one plot
    python benchmarks/peers.py --dry-run             # CPU, 2 gloo ranks, tiny float32, our torch
                                                     # kernel; peers recorded as not runnable

Cases: Gemma2-9B heads (16 query / 8 KV, D 256) and 27B heads (32 / 16, D 128); --local-seqs
tokens per GPU (8K and 32K; global S = N x that); layouts causal, window (--window 4095, 0) and
packed (four documents of S/2, S/4, S/8, S/8 tokens, causal); softcap 0 and --softcap (50).
Systems (a system's method names its configuration):
  cps        cps.cp_attention with each comm (ring, all_gather, a2a, auto; a2a+p2p/A with
             --a2a-size), kernel chosen by the selector ("auto") and forced to fa2 (the peers'
             kernel). At N = 1 every comm is the same single-device call: run once.
  rfa        ring_flash_attn.zigzag_ring_flash_attn_func (zigzag shards, the same tokens as
             ours); packed: zigzag_ring_flash_attn_varlen_func (every document zigzag-split
             over the ranks, so each length must divide by 2N). It has no softcap argument: a
             softcap case runs it uncapped and records that.
  yunchang   LongContextAttention(ring_impl_type="zigzag", attn_type=AttnType.FA) after
             set_seq_parallel_pg(ulysses, ring): pure Ulysses, pure ring and one hybrid split
             where N allows; shards from its zigzag_extract_local rule. No packed entry point.
  torch_cp   PyTorch context_parallel: SDPA (flash, cuDNN) without softcap and causal only;
             FlexAttention CP (benchmarks/torch_cp.py's module, tanh score_mod, causal or
             window mask_mod) for every cap. No packed case here.
Exactness: at --check-seq global tokens (same heads; saturating inputs: with a cap the logits'
std is 4 x the cap, so dropping it shows), every system's unsharded output and dq/dk/dv against
float64 attention of the same inputs; "exact" when every relative error (max |x - ref| /
max |ref|) is within cp_softcap.testing.checks.tolerance of the input dtype. With 16-bit inputs
the gradients must be within 'grad' of the plain reference or of the rounding-aware one (D from
the system's own rounded output, as flash-attn computes it; errors *_aware), and within
'grad_exact' of the plain one (gross errors). cap_effect /
window_effect: how far the float64 result moves when the cap / window is dropped (what a system
that drops it shows as error).
Timing: at the full shapes, random inputs, fwd+bwd median (do_bench), max over ranks;
ratio = this time / the fastest cps time of the same case (> 1: cps is faster).
What a system cannot do is recorded with the reason (status "cannot"), a missing package as
"not installed", an exception as "error"; nothing is left out silently.
Writes benchmarks/results/peers_N<N>[_tag].json and .png (a dry run: $OUT or a temporary
folder). --flash-attn-standin MODULE:CLASS runs the peers' code on CPU over a flash-attn stand-in
(an object with flash-attn 2's split functions; the tests pass the torch kernel with flash-attn
2's window rules) to check this harness's calls without a GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import sys
import types
import warnings
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cp_softcap as cps                                           # noqa: E402
from cp_softcap.sharding import shard                              # noqa: E402
from cp_softcap.testing.checks import rel_err, reference_with_grads, saturating_qkv, tolerance  # noqa: E402
from benchmarks._util import OUT_DIR_HELP, bar_plot, bench_ms, launch_ranks, out_dir_for, save, table  # noqa: E402

HEADS = {"9B": (16, 8, 256), "27B": (32, 16, 128)}
LAYOUTS = ("causal", "window", "packed")
NO_SOFTCAP_RFA = ("ring_flash_attn's zigzag functions take no softcap argument and pin flash-attn's "
                  "softcap to 0.0 (utils.get_default_args): run uncapped")
WINDOW_RFA = ("window_size is passed unchanged to every chunk pair's flash-attn call, in "
              "block-local positions")


def _err(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def documents(s: int) -> List[int]:
    """Boundaries of the packed case: documents of S/2, S/4, S/8, S/8 tokens."""
    return [0, s // 2, 3 * s // 4, 7 * s // 8, s]


class System:
    """One configuration of one system for one case: take(full [B, S, H, D]) -> this rank's
    shard; call(q, k, v) -> this rank's output shard (differentiable). status None: runnable;
    else ("cannot" | "not installed" | "error", reason). note: what it does differently.
    context: a context manager factory that forward AND backward run inside (PyTorch's CP
    patches SDPA only while its context is open)."""

    def __init__(self, system: str, method: str, take=None, call=None, status=None, note=None,
                 context=contextlib.nullcontext):
        self.system, self.method, self.take, self.call = system, method, take, call
        self.status, self.note, self.context = status, note, context


# ------------------------------------------------------------------------------ the systems

def _cps_systems(a, case, world, rank, group) -> List[System]:
    cu = documents(case["S"]) if case["layout"] == "packed" else None
    take = lambda x: shard(x, world, rank, cu_seqlens=cu)  # noqa: E731
    comms = ["auto"] if world == 1 else list(a.comms) + [f"a2a+p2p/{s}" for s in a.a2a_size]
    out = []
    for backend in a.cps_backends:
        for label in comms:
            comm, grp = label.split("/")[0], group
            if comm == "a2a+p2p":
                size = int(label.split("/")[1])
                if world % size or size in (1, world):
                    out.append(System("cps", f"{label} {backend}", status=(
                        "cannot", f"a2a size {size} must divide N={world} and lie strictly between 1 and N")))
                    continue
                grp = a.hybrid_groups[size]

            def call(q, k, v, comm=comm, grp=grp, backend=backend):
                return cps.cp_attention(q, k, v, grp, softcap=case["softcap"] or None, causal=True,
                                        window=case["window"], comm=comm, backend=backend,
                                        cu_seqlens=cu)
            note = "single device (every comm is the same call at N=1)" if world == 1 else None
            out.append(System("cps", f"{label} {backend}", take, call, note=note))
    return out


def _importable(module: str) -> bool:
    try:
        return module in sys.modules or importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:         # a parent package is missing
        return False


def _missing(module: str, cuda: bool, standin: bool) -> Optional[tuple]:
    if not _importable(module):
        return ("not installed", f"{module} is not importable (pip install -e '.[peers]' on a GPU "
                                 f"machine; without an index: docs/gpu.md)")
    if not cuda and not standin:
        return ("not runnable here", "calls flash-attn 2's CUDA kernels; no GPU in this run")
    if not _importable("flash_attn.flash_attn_interface"):   # flash-attn 4 alone is not enough
        return ("not installed", f"{module} runs on flash-attn 2, which is not importable")
    return None


def _rfa_systems(a, case, world, rank, group, cuda) -> List[System]:
    miss = _missing("ring_flash_attn", cuda, a.flash_attn_standin)
    method = "zigzag_varlen" if case["layout"] == "packed" else "zigzag"
    if miss:
        return [System("rfa", method, status=miss)]
    rfa, notes = _import_rfa()
    if case["softcap"]:
        notes.append(NO_SOFTCAP_RFA)
    window = (-1, -1) if case["window"] is None else case["window"]
    if case["window"] is not None and world > 1:
        notes.append(WINDOW_RFA)
    note = "; ".join(notes) or None
    if case["layout"] != "packed":
        take = lambda x: shard(x, world, rank)  # noqa: E731  (zigzag: chunks r and 2N-1-r)

        def call(q, k, v):
            return rfa.zigzag_ring_flash_attn_func(q, k, v, causal=True, window_size=window, group=group)
        return [System("rfa", method, take, call, note=note)]
    cu = documents(case["S"])
    if any((e - b) % (2 * world) for b, e in zip(cu, cu[1:])):
        return [System("rfa", method, status=("cannot", f"every document length must divide by 2N={2 * world}"))]

    def take(x):                        # each document's chunks r and 2N-1-r, documents in order
        parts = []
        for b, e in zip(cu, cu[1:]):
            chunks = x[:, b:e].chunk(2 * world, dim=1)
            parts += [chunks[rank], chunks[2 * world - 1 - rank]]
        return torch.cat(parts, dim=1)
    local_cu = torch.tensor([c // world for c in cu], dtype=torch.int32, device=a.device)
    max_len = max(e - b for b, e in zip(cu, cu[1:])) // world

    def call(q, k, v):
        out = rfa.zigzag_ring_flash_attn_varlen_func(q[0], k[0], v[0], local_cu, max_len, causal=True,
                                                     window_size=window, group=group)
        return out[None]
    return [System("rfa", method, take, call, note=note)]


def _import_rfa():
    """ring_flash_attn and notes. Its package __init__ also imports its HF adapter, which fails
    with transformers releases that dropped is_flash_attn_greater_or_equal_2_10; the attention
    modules do not need it, so they are then loaded without the package __init__."""
    if "ring_flash_attn" in sys.modules:
        return sys.modules["ring_flash_attn"], []
    try:
        return importlib.import_module("ring_flash_attn"), []
    except ImportError as e:
        if "transformers" not in str(e):
            raise
        spec = importlib.util.find_spec("ring_flash_attn")
        pkg = types.ModuleType("ring_flash_attn")
        pkg.__path__, pkg.__spec__ = list(spec.submodule_search_locations), spec
        sys.modules["ring_flash_attn"] = pkg
        for name in ("zigzag_ring_flash_attn", "zigzag_ring_flash_attn_varlen"):
            mod = importlib.import_module(f"ring_flash_attn.{name}")
            setattr(pkg, f"{name}_func", getattr(mod, f"{name}_func"))
        return pkg, [f"package __init__ failed ({_err(e)[:90]}); its zigzag modules loaded directly"]


def _yunchang_degrees(world: int, hq: int, hkv: int) -> List[tuple]:
    """(ulysses, ring) splits: pure Ulysses, pure ring, and one hybrid in between."""
    degrees = [(world, 1), (1, world)]
    mid = max((u for u in (2, 4, 8) if world % u == 0 and 1 < u < world), default=None)
    if mid:
        degrees.append((mid, world // mid))
    return list(dict.fromkeys(degrees))


def _yunchang_systems(a, case, world, rank, group, cuda) -> List[System]:
    hq, hkv, _ = case["heads"]
    degrees = _yunchang_degrees(world, hq, hkv)
    names = [f"ulysses{u}xring{r}" for u, r in degrees]
    miss = _missing("yunchang", cuda, a.flash_attn_standin)
    if miss:
        return [System("yunchang", n, status=miss) for n in names]
    if case["layout"] == "packed":
        return [System("yunchang", n, status=("cannot", "LongContextAttention takes no cu_seqlens "
                                              "(its varlen ring files are not wired into it)"))
                for n in names]
    from yunchang import LongContextAttention, set_seq_parallel_pg
    from yunchang.globals import PROCESS_GROUP
    from yunchang.kernels import AttnType
    out = []
    for (u, r), name in zip(degrees, names):
        if hq % u or hkv % u:
            out.append(System("yunchang", name, status=(
                "cannot", f"Ulysses degree {u} must divide the query ({hq}) and KV ({hkv}) heads")))
            continue
        if (u, r) not in a.yunchang_groups:            # collective: every rank builds them, once
            set_seq_parallel_pg(u, r, rank, world)
            a.yunchang_groups[(u, r)] = (PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG)
        PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG = a.yunchang_groups[(u, r)]
        attn = LongContextAttention(ring_impl_type="zigzag", attn_type=AttnType.FA)
        ring_rank = dist.get_rank(PROCESS_GROUP.RING_PG)
        u_rank = dist.get_rank(PROCESS_GROUP.ULYSSES_PG)

        def take(x, r=r, u=u, ring_rank=ring_rank, u_rank=u_rank):   # yunchang's zigzag_extract_local
            chunks = x.chunk(2 * r, dim=1)
            return torch.cat([chunks[ring_rank], chunks[2 * r - 1 - ring_rank]], dim=1).chunk(u, dim=1)[u_rank]

        def call(q, k, v, attn=attn):
            return attn(q, k, v, causal=True, window_size=(-1, -1) if case["window"] is None else case["window"],
                        softcap=float(case["softcap"]))
        note = WINDOW_RFA + " (its ring part)" if case["window"] is not None and r > 1 else None
        out.append(System("yunchang", name, take, call, note=note))
    return out


def _torch_systems(a, case, world, rank, cuda) -> List[System]:
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    if case["layout"] == "packed":
        return [System("torch_cp", "flex", status=("not run", "packed documents need its per-document "
                                                   "load balancer and a document mask_mod: not wired in "
                                                   "this harness"))]
    if not cuda:
        return [System("torch_cp", m, status=("not runnable here", why)) for m, why in
                [(f"sdpa-{b}", "its SDPA CP dispatches only the CUDA SDPA kernels") for b in a.sdpa_backends]
                + [("flex", "its flex has no CPU backward")]]
    mesh = a.mesh or init_device_mesh(a.device.type, (world,))
    a.mesh = mesh
    out = []
    for backend in a.sdpa_backends:
        method = f"sdpa-{backend}"
        if case["softcap"]:
            out.append(System("torch_cp", method, status=("cannot", "SDPA has no softcap")))
            continue
        if case["window"] is not None:
            out.append(System("torch_cp", method, status=("cannot", "SDPA's CP takes is_causal only, "
                                                          "no window")))
            continue

        def call(q, k, v):
            rep = q.shape[2] // k.shape[2]      # K/V heads repeated: its CP ring has no GQA path
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)))
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).transpose(1, 2)

        @contextlib.contextmanager
        def context(backend=backend):
            from torch.distributed.tensor.experimental import context_parallel
            from torch.nn.attention import SDPBackend, sdpa_kernel
            kernel = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                      "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]
            # context_parallel needs at least one buffer to shard (it reads the sequence length and
            # sets up its load balancer from it); q/k/v arrive sharded, so it gets the positions
            pos = torch.arange(case["S"], device=a.device)[None]
            with context_parallel(mesh, buffers=[pos], buffer_seq_dims=[1], no_restore_buffers={pos}), \
                    sdpa_kernel(kernel):
                yield
        # its head-tail load balancer holds chunks r and 2N-1-r: our zigzag shard
        out.append(System("torch_cp", method, lambda x: shard(x, world, rank), call,
                          note="K/V heads repeated to the query heads", context=context))
    out.append(_torch_flex(a, case, world, rank, mesh, cuda))
    return out


def _torch_flex(a, case, world, rank, mesh, cuda) -> System:
    from torch.distributed.tensor.experimental._attention import (
        _ContextParallel, _context_parallel_shard, _HeadTailLoadBalancer)
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.attention.flex_attention import create_block_mask
    from benchmarks.torch_cp import _FlexAttention
    s, left = case["S"], (case["window"] or (None, 0))[0]
    try:
        lb = _HeadTailLoadBalancer(s, world, a.device)

        def mask(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) if left is None else (q_idx >= kv_idx) & (q_idx - kv_idx <= left)
        block = create_block_mask(mask, 1, 1, s, s, device=a.device, _compile=cuda)
        block = _context_parallel_shard(mesh, [block], [2], load_balancer=lb)[0]
        attn = parallelize_module(_FlexAttention(case["softcap"], cuda), mesh,
                                  _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX))
    except Exception as e:              # flex CP missing from this torch, or rejects the shape
        return System("torch_cp", "flex", status=("error", _err(e)))

    def take(x):
        return _context_parallel_shard(mesh, [x.transpose(1, 2).contiguous()], [2], load_balancer=lb)[0].transpose(1, 2)

    def call(q, k, v):
        return attn(*(t.transpose(1, 2) for t in (q, k, v)), block).transpose(1, 2)
    return System("torch_cp", "flex", take, call, note="K/V all-gathered (its flex CP has no ring)")


def systems_for(a, case, world, rank, group, cuda) -> List[System]:
    out = []
    for name, build in (("cps", lambda: _cps_systems(a, case, world, rank, group)),
                        ("rfa", lambda: _rfa_systems(a, case, world, rank, group, cuda)),
                        ("yunchang", lambda: _yunchang_systems(a, case, world, rank, group, cuda)),
                        ("torch_cp", lambda: _torch_systems(a, case, world, rank, cuda))):
        if name not in a.systems:
            continue
        try:
            out += build()
        except Exception as e:          # an API this version of the peer lacks: recorded
            out.append(System(name, "setup", status=("error", _err(e))))
    return out


# ------------------------------------------------------------------------------ exactness, timing

def unshard_by_positions(local: torch.Tensor, pos: torch.Tensor, s: int, group) -> torch.Tensor:
    """Every rank's shard [B, n, ...] with the global positions [n] of its tokens -> [B, S, ...]."""
    world = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(world)]
    where = [torch.empty_like(pos) for _ in range(world)]
    dist.all_gather(parts, local.contiguous(), group=group)
    dist.all_gather(where, pos.contiguous(), group=group)
    full = local.new_zeros((local.shape[0], s) + tuple(local.shape[2:]))
    for p, w in zip(parts, where):
        full[:, w] = p
    return full


def reference(q, k, v, dout, case, softcap, window, out_used=None):
    """float64 out and dq/dk/dv of full attention, one KV head (and its query heads) at a time.

    out_used: a system's own (16-bit) output; the gradients are then the rounding-aware ones
    (reference_with_grads: D from that rounded O, as a flash kernel's backward computes it)."""
    hq, hkv = q.shape[2], k.shape[2]
    rep = hq // hkv
    cu = documents(q.shape[1]) if case["layout"] == "packed" else None
    outs, grads = [], [[], [], []]
    for g in range(hkv):
        heads = slice(g * rep, (g + 1) * rep)
        o, _, gs = reference_with_grads(
            q[:, :, heads], k[:, :, g:g + 1], v[:, :, g:g + 1], dout[:, :, heads],
            softcap=softcap or None, causal=True, window=window or (None, None),
            scale=q.shape[-1] ** -0.5, cu_seqlens=cu,
            out_used=None if out_used is None else out_used[:, :, heads])
        outs.append(o)
        for acc, t in zip(grads, gs):
            acc.append(t)
    return torch.cat(outs, 2), tuple(torch.cat(gs, 2) for gs in grads)


def check_inputs(case, s, dtype, device):
    g = torch.random.fork_rng(devices=[])
    with g:
        torch.manual_seed(1234)
        hq, hkv, d = case["heads"]
        q, k, v, _ = saturating_qkv(1, s, s, hq, hkv, d, dtype, case["softcap"] or None,
                                    requires_grad=False, device=device)
        dout = torch.randn(1, s, hq, d, dtype=torch.float64).to(device, dtype)
    return q, k, v, dout


def run_local(sysm: System, full):
    """Forward + backward of one system on this rank's shards: local out, dq, dk, dv."""
    q, k, v, dout = (sysm.take(t).contiguous() for t in full)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with sysm.context():
        out = sysm.call(q, k, v)
        out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def exactness(sysm: System, full, refs, case, group, dtype) -> Dict:
    """Relative errors of out/dq/dk/dv against float64 (on every rank; computed on rank 0)."""
    s = full[0].shape[1]
    pos = sysm.take(torch.arange(s, device=full[0].device)[None, :, None, None].expand(1, s, 1, 1))[0, :, 0, 0]
    local = run_local(sysm, full)
    gathered = [unshard_by_positions(t.to(full[0].dtype), pos, s, group) for t in local]
    if refs is None:
        return {}
    names = ("out", "dq", "dk", "dv")
    errs = {n: rel_err(x, r) for n, x, r in zip(names, gathered, (refs[0], *refs[1]))}
    if dtype in (torch.float16, torch.bfloat16):
        aware = reference(*full, case, case["softcap"], case["window"], out_used=gathered[0])[1]
        errs.update({n + "_aware": rel_err(x, r) for n, x, r in zip(names[1:], gathered[1:], aware)})
    tol = max(tolerance(dtype, "out"), tolerance(dtype, "grad"))
    return dict(err=errs, tol=tol, exact=verdict(errs, dtype))


def grad_err(errs: Dict[str, float]) -> float:
    """The gradients' largest error against the closer of the two references: all of dq/dk/dv
    against the plain one, or all against the rounding-aware one (errs *_aware, 16-bit inputs).
    A backward computes D = rowsum(dO * O) either from the rounded O it returned (flash-attn's
    way) or from the unrounded one (cps's torch kernel, fa4 inside a ring)."""
    grads = ("dq", "dk", "dv")
    err = max(errs[n] for n in grads)
    if all(n + "_aware" in errs for n in grads):
        err = min(err, max(errs[n + "_aware"] for n in grads))
    return err


def verdict(errs: Dict[str, float], dtype) -> bool:
    """Exact: out within 'out', the gradients within 'grad' of the closer reference (grad_err);
    with 16-bit inputs also within 'grad_exact' (gross errors only) of the plain reference."""
    ok = errs["out"] <= tolerance(dtype, "out") and grad_err(errs) <= tolerance(dtype, "grad")
    if dtype in (torch.float16, torch.bfloat16):
        ok = ok and all(errs[n] <= tolerance(dtype, "grad_exact") for n in ("dq", "dk", "dv"))
    return ok


def _max_over_ranks(ms: Optional[float], device) -> Optional[float]:
    t = torch.tensor([float("inf") if ms is None else ms], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return None if t.item() == float("inf") else t.item()


def timed(sysm: System, full, rep_ms: int) -> float:
    q, k, v, dout = (sysm.take(t).contiguous() for t in full)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))

    def step():
        with sysm.context():
            sysm.call(q, k, v).backward(dout)
    return bench_ms(step, rep_ms=rep_ms)


# ------------------------------------------------------------------------------ the run

def cases(a) -> List[Dict]:
    out = []
    for model in a.models:
        for layout in a.layouts:
            for cap in (0.0, a.softcap):
                out.append(dict(model=model, heads=HEADS[model] if not a.heads else tuple(a.heads),
                                layout=layout, softcap=cap,
                                window=(a.window, 0) if layout == "window" else None))
    return out


def _record_base(case, world, sysm: System) -> Dict:
    hq, hkv, d = case["heads"]
    return dict(model=case["model"], heads=[hq, hkv, d], layout=case["layout"], softcap=case["softcap"],
                window=case["window"], N=world, system=sysm.system, method=sysm.method,
                status=sysm.status[0] if sysm.status else "ok",
                reason=sysm.status[1] if sysm.status else None, note=sysm.note)


def run(a, rank: int, world: int, cuda: bool) -> Optional[Dict]:
    """Every case on this rank (the process group is up). Rank 0 writes the JSON after each case
    (meta "complete": false until the last) and returns the blob with its "path"."""
    dev = a.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    group = dist.group.WORLD
    a.mesh, a.yunchang_groups = None, {}
    a.hybrid_groups = {s: cps.make_hybrid_groups(group, s) for s in a.a2a_size
                       if world % s == 0 and 1 < s < world}
    # the stand-in runs bf16 as flash-attn does: in float32 the peers' `dq = dq_buffer.to(float32)`
    # aliases the buffer the next kernel call overwrites
    dtype = torch.bfloat16 if cuda or a.flash_attn_standin else torch.float32
    if a.flash_attn_standin:
        install_flash_attn_standin(a.flash_attn_standin)
    records: List[Dict] = []
    for case in cases(a):
        s_check = a.check_seq
        ck = dict(case, S=s_check)
        full = check_inputs(ck, s_check, dtype, dev)
        refs = ref_nocap = ref_nowin = None
        if rank == 0:
            refs = reference(*full, ck, case["softcap"], case["window"])
            if case["softcap"]:
                ref_nocap = reference(*full, ck, 0.0, case["window"])[0]
            if case["window"] is not None:
                ref_nowin = reference(*full, ck, case["softcap"], None)[0]
        effects = dict(cap_effect=rel_err(ref_nocap, refs[0]) if ref_nocap is not None else None,
                       window_effect=rel_err(ref_nowin, refs[0]) if ref_nowin is not None else None)
        del ref_nocap, ref_nowin
        check_systems = systems_for(a, ck, world, rank, group, cuda)
        case_recs = []
        for sysm in check_systems:
            rec = dict(_record_base(case, world, sysm), check_S=s_check, **effects)
            if sysm.status is None:
                try:
                    rec.update(exactness(sysm, full, refs, ck, group, dtype))
                except Exception as e:
                    rec.update(status="error", reason=f"check: {_err(e)}")
            case_recs.append(rec)
        del full, refs
        for s_local in a.local_seqs:
            s = s_local * world
            tc = dict(case, S=s)
            g = torch.Generator(device="cpu").manual_seed(0)
            hq, hkv, d = case["heads"]
            full = [torch.randn(1, s, h, d, generator=g).to(dev, dtype) for h in (hq, hkv, hkv, hq)]
            for sysm, crec in zip(systems_for(a, tc, world, rank, group, cuda), case_recs):
                rec = dict(crec, S=s, S_local=s_local, fwd_bwd_ms=None)
                if sysm.status is None and crec["status"] == "ok":
                    ms, err = None, None
                    try:
                        ms = timed(sysm, full, a.rep_ms)
                    except Exception as e:
                        err = _err(e)
                    rec["fwd_bwd_ms"] = _max_over_ranks(ms, dev)
                    if err:
                        rec.update(status="error", reason=f"timing: {err}")
                records.append(rec)
            del full
            if cuda:
                torch.cuda.empty_cache()
        _ratios(records)
        if rank == 0:     # after each case: a run cut short by a time limit keeps what it measured
            save(_stem(a, world), records, _meta(a, world, dev, dtype, complete=False), a.out_dir)
    if rank != 0:
        return None
    blob = dict(records=records, meta=_meta(a, world, dev, dtype, complete=True))
    blob["path"] = save(_stem(a, world), records, blob["meta"], a.out_dir)
    return blob


def _ratios(records: List[Dict]) -> None:
    """ratio = time / the fastest exact cps time of the same case and S (> 1: cps is faster)."""
    key = lambda r: (r["model"], r["layout"], r["softcap"], r["S"])  # noqa: E731
    best: Dict = {}
    for r in records:
        if r["system"] == "cps" and r.get("fwd_bwd_ms") and r.get("exact"):
            best[key(r)] = min(best.get(key(r), float("inf")), r["fwd_bwd_ms"])
    for r in records:
        b = best.get(key(r))
        r["ratio"] = r["fwd_bwd_ms"] / b if b and r.get("fwd_bwd_ms") else None


def _stem(a, world: int) -> str:
    return f"peers_N{world}" + (f"_{a.tag}" if a.tag else "")


def _versions() -> Dict:
    out = {"torch": torch.__version__}
    for m in ("flash_attn", "ring_flash_attn", "yunchang"):
        try:
            out[m] = getattr(importlib.import_module(m), "__version__", "installed")
        except Exception as e:
            out[m] = f"not importable ({type(e).__name__})"
    return out


def _meta(a, world, dev, dtype, complete: bool) -> Dict:
    return dict(complete=complete, world=world, dtype=str(dtype),
                backend="nccl" if dev.type == "cuda" else "gloo", versions=_versions(),
                local_seqs=a.local_seqs, check_seq=a.check_seq, softcap=a.softcap, window=a.window,
                flash_attn_standin=a.flash_attn_standin,
                exact=("every relative error (max |x - ref| / max |ref|) of out, dq, dk, dv against "
                       "float64 full attention of the same inputs within cp_softcap.testing.checks."
                       "tolerance(dtype); 16-bit inputs: dq/dk/dv within 'grad' of the plain or of "
                       "the rounding-aware reference (D from the system's own rounded output; "
                       "err *_aware) and within 'grad_exact' of the plain one; inputs saturate the "
                       "cap (logit std 4 x cap)"),
                ratio="fwd+bwd time (max over ranks) / the fastest exact cps time of the same case",
                packed="documents of S/2, S/4, S/8, S/8 tokens, causal")


# ------------------------------------------------------------------------------ flash-attn stand-in

def install_flash_attn_standin(spec: str) -> None:
    """A CPU `flash_attn` package whose split functions are those of `spec` ("module:Class", an
    object with flash-attn 2's _flash_attn_forward/_backward and their varlen forms): lets the
    peers' Python run on gloo."""
    import importlib
    module, cls = spec.split(":")
    impl = getattr(importlib.import_module(module), cls)()
    pkg = types.ModuleType("flash_attn")
    pkg.__version__ = "2.8.3"
    pkg.__path__ = []
    iface = types.ModuleType("flash_attn.flash_attn_interface")
    for name in ("_flash_attn_forward", "_flash_attn_backward", "_flash_attn_varlen_forward",
                 "_flash_attn_varlen_backward"):
        setattr(iface, name, _causal_as_window(getattr(impl, name)))

    def flash_attn_func(*args, **kwargs):
        raise NotImplementedError("flash_attn_func is not part of the stand-in")
    pkg.flash_attn_func = iface.flash_attn_func = flash_attn_func
    pkg.flash_attn_interface = iface
    sys.modules["flash_attn"], sys.modules["flash_attn.flash_attn_interface"] = pkg, iface


def _causal_as_window(fn):
    """The stand-in reads only the window; flash-attn turns causal into a right side of 0. The
    wrapper keeps fn's signature and defaults (the peers read them with inspect)."""
    import functools
    import inspect
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        if bound.arguments["causal"]:
            bound.arguments["window_size_right"] = 0
        return fn(*bound.args, **bound.kwargs)
    wrapped.__signature__ = sig
    return wrapped


# ------------------------------------------------------------------------------ output

def rows_of(records: List[Dict]) -> List[List[str]]:
    rows = [["model", "layout", "cap", "S/N", "system", "method", "status", "exact", "max err",
             "fwd+bwd ms", "ratio", "reason / note"]]
    f = lambda x, n=2: "-" if x is None else f"{x:.{n}f}"  # noqa: E731
    for r in records:
        err = max(r["err"]["out"], grad_err(r["err"])) if r.get("err") else None
        rows.append([r["model"], r["layout"], f(r["softcap"], 0), r["S_local"], r["system"], r["method"],
                     r["status"], "-" if r.get("exact") is None else ("yes" if r["exact"] else "NO"),
                     "-" if err is None else f"{err:.1e}", f(r.get("fwd_bwd_ms")), f(r.get("ratio"), 3),
                     (r.get("reason") or r.get("note") or "")[:60]])
    return rows


def plot(blob: Dict, png: str) -> None:
    """time / fastest exact cps time per system (hatched-free: inexact runs drawn at 0)."""
    recs = [r for r in blob["records"] if r.get("ratio") is not None]
    meta = blob["meta"]
    if not recs:
        return
    case = lambda r: f"{r['model']} {r['layout']} cap{r['softcap']:g} {r['S_local'] // 1024 or r['S_local']}"  # noqa: E731
    labels = list(dict.fromkeys(case(r) for r in recs))
    names = list(dict.fromkeys(f"{r['system']} {r['method']}" for r in recs))
    series = {n: [next((r["ratio"] if r.get("exact") else 0.0 for r in recs
                        if f"{r['system']} {r['method']}" == n and case(r) == lbl), float("nan"))
                  for lbl in labels] for n in names}
    bar_plot(png, labels, series, "fwd+bwd time / fastest exact cps",
             f"peers, N={meta.get('world')}, {meta.get('dtype')} (0: not exact)", hline=1.0)


def _rank(rank: int, world: int, a) -> Optional[Dict]:
    return run(a, rank, world, cuda=False)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["9B", "27B"], choices=sorted(HEADS))
    p.add_argument("--heads", type=int, nargs=3, default=None, metavar=("HQ", "HKV", "D"),
                   help="override the models' heads (one shape)")
    p.add_argument("--local-seqs", type=int, nargs="+", default=[8192, 32768], help="tokens per GPU")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    p.add_argument("--window", type=int, default=4095, help="left size of the window layout")
    p.add_argument("--softcap", type=float, default=50.0)
    p.add_argument("--check-seq", type=int, default=8192,
                   help="global tokens of the float64 exactness check (a multiple of 16 x N)")
    p.add_argument("--systems", nargs="+", default=["cps", "rfa", "yunchang", "torch_cp"],
                   choices=["cps", "rfa", "yunchang", "torch_cp"])
    p.add_argument("--comms", nargs="+", default=["ring", "all_gather", "a2a", "auto"])
    p.add_argument("--a2a-size", type=int, nargs="*", default=[], help="also a2a+p2p with these group sizes")
    p.add_argument("--cps-backends", nargs="+", default=["auto", "fa2"],
                   help="kernels for cps (fa2: the peers' kernel)")
    p.add_argument("--sdpa-backends", nargs="+", default=["flash", "cudnn"], choices=["flash", "cudnn", "efficient"])
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument("--flash-attn-standin", metavar="MODULE:CLASS",
                   help="CPU only: run the peers over this stand-in of flash-attn 2 (checks the calls)")
    p.add_argument("--tag", default="", help="suffix of the output files: peers_N<N>_<tag>.json")
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.dry_run
    if a.flash_attn_standin and cuda:
        p.error("--flash-attn-standin replaces flash-attn by a CPU stand-in: use it with --dry-run or without a GPU")
    for n, v in (("--local-seqs", min(a.local_seqs)), ("--check-seq", a.check_seq), ("--rep-ms", a.rep_ms)):
        if v < 1:
            p.error(f"{n} must be positive, got {v}")
    a.out_dir = out_dir_for(a.out_dir, dry=not cuda)
    if not cuda:              # tiny float32 shapes, our torch kernel
        a.models, a.heads, a.local_seqs, a.check_seq, a.rep_ms = ["9B"], [4, 2, 32], [128], 256, 5
        a.window, a.cps_backends, a.sdpa_backends = 47, ["auto"], ["flash"]
    if a.heads and a.heads[0] % a.heads[1]:
        p.error(f"--heads: {a.heads[0]} query heads are not a multiple of {a.heads[1]} KV heads; e.g. 16 8 256")
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    if "RANK" in os.environ:                                  # under torchrun
        dist.init_process_group("nccl" if cuda else "gloo")
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        world = dist.get_world_size()
        if a.check_seq % (16 * world) or any(s % 16 for s in a.local_seqs):
            p.error(f"--check-seq {a.check_seq} must be a multiple of 16 x N = {16 * world} and "
                    f"--local-seqs multiples of 16 (zigzag and packed shards)")
        blob = run(a, dist.get_rank(), world, cuda)
        dist.destroy_process_group()
    elif cuda:                # one GPU: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29531"))
        dist.init_process_group("nccl")
        torch.cuda.set_device(0)
        blob = run(a, 0, 1, cuda)
        dist.destroy_process_group()
    else:
        blob = launch_ranks(_rank, 2, (a,), timeout=300, pg_timeout=120)[0]
    if blob is None:
        return 0
    from benchmarks.plots import plot_json
    plot_json(blob["path"])
    print(table(rows_of(blob["records"])))
    print(f"wrote {blob['path']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
