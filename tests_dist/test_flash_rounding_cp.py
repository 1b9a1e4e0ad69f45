"""The packed-CP check of tests/test_gpu_packed_cp.py (skipped without CUDA) on CPU/gloo, with a
stand-in that rounds as the bf16 flash kernels do (flash_standin.py): bf16 forward O, P and dS
rounded to bf16, per-call gradients in bf16.

Claim checked, per comm type: such a kernel meets 2x the bf16 'grad' tolerance against the
rounding-aware reference (float64 gradients of the loss with the returned O used in
D = rowsum(dO * O), as the GPU test holds fa4/flex to), and fails the bf16 'grad' tolerance
against the plain float64 gradients (negative control: the stand-in really rounds; the GPU test
saw dq/dk ~0.03 there). The boundaries-dropped control of the GPU test must fail by > 0.1.
"""
import torch

from harness import run_ranks

DOCS = [1, 39, 560, 5, 295, 90]      # the GPU test's documents: cp 2 splits the 560-token one
HEAD_DIM = 128                       # as the GPU test (32 keeps the effect: plain 0.016, aware 0.007)


def _worker(rank, world, comms, window):
    import torch.distributed as dist

    import cp_softcap as cps
    from cp_softcap.sharding import packed_len, shard, unshard
    from cp_softcap.testing import check_against_reference, reference_with_grads, rel_err, saturating_qkv
    from flash_standin import FlashStandIn
    dtype = torch.bfloat16
    cu = [0]
    for n in DOCS:
        cu.append(cu[-1] + n)
    s, cap = cu[-1] + 14, 30.0
    n = packed_len(s, world)
    torch.manual_seed(4321)
    q, k, v, _ = saturating_qkv(1, n, n, 4, 2, HEAD_DIM, dtype, cap, requires_grad=False)
    dout = torch.randn(q.shape, dtype=torch.float64).to(dtype)

    def reference(bounds, out_used=None):      # out_used: rounding-aware (see reference_with_grads)
        out, _, grads = reference_with_grads(q, k, v, dout, softcap=cap, causal=True, window=window,
                                             cu_seqlens=bounds, out_used=out_used)
        return out, grads
    ref_out, ref_grads = reference(cu)
    dropped, _ = reference([0, cu[-1]])
    hybrid = cps.make_hybrid_groups(None, 2) if "a2a+p2p" in comms else None
    kernel = FlashStandIn()
    report = {}
    for comm in comms:
        group = hybrid if comm == "a2a+p2p" else dist.group.WORLD
        local = [shard(t[:, :s], world, rank, cu_seqlens=cu).requires_grad_() for t in (q, k, v)]
        out = cps.cp_attention(*local, group, comm=comm, backend=kernel, softcap=cap, causal=True,
                               window=window, cu_seqlens=cu)
        out.backward(shard(dout[:, :s], world, rank, cu_seqlens=cu))
        grads = [t.grad for t in local]
        outs = [torch.empty(out.shape, dtype=torch.float32) for _ in range(world)]
        dist.all_gather(outs, out.detach().float())
        _, aware = reference(cu, out_used=unshard(outs, cu_seqlens=cu))
        # raises on NaN/inf, or on an aware error above 2x the bf16 'grad' tolerance
        errs = check_against_reference(out.detach(), grads, shard(ref_out, world, rank, cu_seqlens=cu),
                                       [shard(g, world, rank, cu_seqlens=cu) for g in aware], dtype,
                                       label=f"rank {rank} {comm} {window}", tol_scale=2.0,
                                       exact_grads=[shard(g, world, rank, cu_seqlens=cu) for g in ref_grads])
        errs["dropped"] = rel_err(out.detach(), shard(dropped, world, rank, cu_seqlens=cu))
        report[comm] = errs
    return report


def _check(world, comms, window):
    from cp_softcap.testing import TOLERANCES
    tol = TOLERANCES[torch.bfloat16]["grad"]
    reports = run_ranks(_worker, world, comms, window, timeout=240)
    for comm in comms:
        w = {key: max(r[comm][key] for r in reports) for key in reports[0][comm]}
        aware = max(w[g] for g in ("dq", "dk", "dv"))
        plain = max(w[g + "_exact"] for g in ("dq", "dk", "dv"))
        print(f"cp {world} {comm} window {window}: aware {aware:.4f} plain {plain:.4f} "
              f"out {w['out']:.4f} dropped {w['dropped']:.3g}")
        assert aware <= 2 * tol, (comm, w)          # check_against_reference already raised
        # every comm type, not only the ring: this is also what shows the stand-in served the call
        assert plain > tol, f"{comm}: plain-reference error {plain:.4f} <= {tol}: the stand-in does not round"
        assert w["dropped"] > 0.1, f"{comm}: the boundaries-dropped control is too weak ({w})"


def test_flash_rounding_packed_cp2():
    _check(2, ("ring", "all_gather", "a2a"), None)


def test_flash_rounding_packed_cp4_window():
    _check(4, ("ring", "a2a+p2p"), (100, 0))
