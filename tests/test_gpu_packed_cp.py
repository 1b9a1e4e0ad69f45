"""Packed documents under CP on ONE GPU: 2 and 4 ranks share the GPU through gloo (CUDA tensors
staged through host memory), with the GPU kernels that serve segments= (fa4 and fa2 where
installed, flex, the torch kernel), every comm type, against the float64 reference of block-diagonal
document attention (saturating softcap, causal and a window smaller than the documents), with
a negative control (boundaries dropped must fail).

Skipped without CUDA. Uses tests_dist/harness.py (forkserver ranks, hard timeout).
"""
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("CUDA not available: GPU CP tests run on the device machine (scripts/gpu_check.sh)",
                allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests_dist"))
from harness import run_ranks  # noqa: E402

pytestmark = pytest.mark.cuda

DOCS = [1, 39, 560, 5, 295, 90]         # a rank's share is 512 at cp 2: the 560-token document crosses


def _worker(rank, world, backend, dtype, comms, window):
    import torch.distributed as dist

    import cp_softcap as cps
    from cp_softcap.sharding import packed_len, shard, unshard
    from cp_softcap.testing import check_against_reference, reference_with_grads, rel_err, saturating_qkv
    cu = [0]
    for n in DOCS:
        cu.append(cu[-1] + n)
    s, cap = cu[-1] + 14, 30.0
    n = packed_len(s, world)
    torch.manual_seed(4321)
    q, k, v, _ = saturating_qkv(1, n, n, 4, 2, 128, dtype, cap, requires_grad=False)
    dout = torch.randn(q.shape, dtype=torch.float64).to(dtype)

    def reference(bounds, out_used=None):      # out_used: rounding-aware (see reference_with_grads)
        out, _, grads = reference_with_grads(q, k, v, dout, softcap=cap, causal=True, window=window,
                                             cu_seqlens=bounds, out_used=out_used)
        return out, grads
    ref_out, ref_grads = reference(cu)
    dropped, _ = reference([0, cu[-1]])
    hybrid = cps.make_hybrid_groups(None, 2) if "a2a+p2p" in comms else None
    report = {}
    for comm in comms:
        group = hybrid if comm == "a2a+p2p" else dist.group.WORLD
        local = [shard(t[:, :s], world, rank, cu_seqlens=cu).cuda().requires_grad_() for t in (q, k, v)]
        out = cps.cp_attention(*local, group, comm=comm, backend=backend, softcap=cap, causal=True,
                               window=window, cu_seqlens=cu)
        out.backward(shard(dout[:, :s], world, rank, cu_seqlens=cu).cuda())
        grads = [t.grad.cpu() for t in local]
        # Every flash kernel returns its forward O in bf16, so the merged O of a row that one
        # call serves (every row of a short document) is already rounded, and the backward's
        # D = rowsum(dO * O) uses it (fa4's dLSE correction only undoes the float32 merge's cast).
        # On a row with 2 visible keys under the saturating cap that alone gives dq/dk 0.030/0.035
        # against the exact gradients (measured on CPU with a stand-in that rounds as the kernels
        # do; rounding P, dS and the per-call gradients adds at most 0.005). So the gradients are
        # held to the rounding-aware reference (O = the returned out), and to the exact one at
        # 'grad_exact' for gross errors.
        outs = [torch.empty(out.shape, dtype=torch.float32) for _ in range(world)]
        dist.all_gather(outs, out.detach().cpu().float())
        _, aware = reference(cu, out_used=unshard(outs, cu_seqlens=cu))
        errs = check_against_reference(out.detach().cpu(), grads, shard(ref_out, world, rank, cu_seqlens=cu),
                                       [shard(g, world, rank, cu_seqlens=cu) for g in aware], dtype,
                                       label=f"rank {rank} {backend} {comm} {window}", tol_scale=2.0,
                                       exact_grads=[shard(g, world, rank, cu_seqlens=cu) for g in ref_grads])
        errs["dropped"] = rel_err(out.detach().cpu(), shard(dropped, world, rank, cu_seqlens=cu))
        report[comm] = errs
    return report


def _skip_unless(backend, dtype):
    from cp_softcap.kernels import get_kernel
    from cp_softcap.spec import make_spec
    spec = make_spec(head_dim=128, num_heads=4, num_kv_heads=2, dtype=dtype, device_type="cuda",
                     softcap=30.0, causal=True, cp_size=2, documents=True)
    kernel = get_kernel(backend)
    reason = kernel.probe(spec) or (None if kernel.caps.segments else "no segments= support")
    if reason:
        pytest.skip(f"{backend}: {reason}")


@pytest.mark.parametrize("backend,dtype,world,comms,window", [
    ("flex", torch.bfloat16, 2, ("ring", "all_gather", "a2a", "auto"), None),
    ("flex", torch.bfloat16, 4, ("ring", "a2a+p2p"), (100, 0)),
    ("fa2", torch.bfloat16, 2, ("ring", "all_gather", "a2a", "auto"), None),
    ("fa2", torch.bfloat16, 4, ("ring", "a2a+p2p"), (100, 0)),
    ("fa4", torch.bfloat16, 2, ("ring", "all_gather", "a2a", "auto"), None),
    ("fa4", torch.bfloat16, 4, ("ring", "a2a+p2p"), (100, 0)),
    ("torch", torch.float32, 2, ("ring", "all_gather", "a2a"), (100, 0)),
])
def test_packed_cp_on_one_gpu(backend, dtype, world, comms, window):
    _skip_unless(backend, dtype)
    reports = run_ranks(_worker, world, backend, dtype, comms, window, timeout=500)
    for comm in comms:
        worst = max(max(v for k, v in r[comm].items() if k != "dropped") for r in reports)
        dropped = max(r[comm]["dropped"] for r in reports)
        print(f"{backend} cp={world} {comm} window={window}: worst rel err {worst:.3g}, "
              f"boundaries dropped: {dropped:.3g}")
        assert dropped > 0.1, f"{backend} {comm}: the boundaries-dropped control is too weak"


@pytest.mark.parametrize("backend", ["fa4", "fa2", "flex"])
@pytest.mark.parametrize("world,comms,window", [
    (2, ("ring", "all_gather", "a2a", "auto"), None),
    (4, ("ring", "all_gather", "a2a", "a2a+p2p", "auto"), (100, 0)),
])
def test_packed_cp_over_nccl(backend, world, comms, window):
    """Rank r on GPU r over NCCL (the production transport), packed documents, every comm type."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs for one rank per GPU, have {torch.cuda.device_count()}")
    _skip_unless(backend, torch.bfloat16)
    reports = run_ranks(_worker, world, backend, torch.bfloat16, comms, window, timeout=400,
                        backend="nccl")
    for comm in comms:
        dropped = max(r[comm]["dropped"] for r in reports)
        print(f"{backend} nccl cp={world} {comm} window={window}: boundaries dropped {dropped:.3g}")
        assert dropped > 0.1, f"{backend} {comm}: the boundaries-dropped control is too weak"
