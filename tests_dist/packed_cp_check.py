"""One rank of the packed-documents CP check, shared by tests/test_gpu_packed_cp.py (the GPU
kernels, ranks sharing one GPU or one per GPU) and tests_dist/test_flash_rounding_cp.py (a CPU
stand-in that rounds as they do): every comm type against the float64 reference of
block-diagonal document attention, saturating softcap, causal (and a window smaller than the
documents), with a boundaries-dropped control.

Every flash kernel returns its forward O in bf16, so the merged O of a row that one call serves
(every row of a short document) is already rounded, and the backward's D = rowsum(dO * O) uses
it (fa4's dLSE correction only undoes the float32 merge's cast). On a row with 2 visible keys
under the saturating cap that alone gives dq/dk 0.030/0.035 against the exact gradients
(measured on CPU with the stand-in; rounding P, dS and the per-call gradients adds at most
0.005). So the gradients are held to the rounding-aware reference (O = the returned out), at 2x
the single-kernel tolerance, and to the exact one at 'grad_exact' for gross errors. The shift is
exact for rows one call serves; on rows merged from several calls the backward uses the float32
merged O, so there the reference adds the final bf16 rounding the kernel never saw (well within
the tolerance: measured with the stand-in, dq/dk 0.0024/0.0043 against 0.016).
"""
import torch

DOCS = [1, 39, 560, 5, 295, 90]         # a rank's share is 512 at cp 2: the 560-token document crosses
STANDIN = "flash-standin"               # backend name for tests_dist/flash_standin.FlashStandIn


def worker(rank, world, backend, dtype, comms, window, device="cpu"):
    """-> {comm: {"out", "dq", "dk", "dv", "dq_exact", ..., "dropped": max rel errors}}; raises
    on NaN/inf or an error above tolerance (check_against_reference)."""
    import torch.distributed as dist

    import cp_softcap as cps
    from cp_softcap.sharding import packed_len, shard, unshard
    from cp_softcap.testing import check_against_reference, reference_with_grads, rel_err, saturating_qkv
    if backend == STANDIN:
        from flash_standin import FlashStandIn
        backend = FlashStandIn()
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

    def here(t):
        return shard(t, world, rank, cu_seqlens=cu)
    ref_out, ref_grads = reference(cu)
    dropped, _ = reference([0, cu[-1]])
    hybrid = cps.make_hybrid_groups(None, 2) if "a2a+p2p" in comms else None
    report = {}
    for comm in comms:
        group = hybrid if comm == "a2a+p2p" else dist.group.WORLD
        local = [here(t[:, :s]).to(device).requires_grad_() for t in (q, k, v)]
        out = cps.cp_attention(*local, group, comm=comm, backend=backend, softcap=cap, causal=True,
                               window=window, cu_seqlens=cu)
        out.backward(here(dout[:, :s]).to(device))
        # every rank's out, gathered where the group's backend works (NCCL: on the GPU)
        outs = [torch.empty(out.shape, dtype=torch.float32, device=out.device) for _ in range(world)]
        dist.all_gather(outs, out.detach().float())
        _, aware = reference(cu, out_used=unshard([o.cpu() for o in outs], cu_seqlens=cu))
        out, grads = out.detach().cpu(), [t.grad.cpu() for t in local]
        name = backend if isinstance(backend, str) else backend.name
        errs = check_against_reference(out, grads, here(ref_out), [here(g) for g in aware], dtype,
                                       label=f"rank {rank} {name} {comm} {window}", tol_scale=2.0,
                                       exact_grads=[here(g) for g in ref_grads])
        errs["dropped"] = rel_err(out, here(dropped))
        report[comm] = errs
    return report
