"""Attention sinks under CP (cp_attention(..., sinks=)) for every comm type at cp 2 and 4 (gloo,
float64) against the float64 reference of full attention with a sink column: sinks that
dominate some heads' rows (+10, +12 against saturated logits of at most a few units),
saturating caps, windows, GQA / MQA, packed documents (with padding rows). Every rank's output
and q/k/v gradients match its shard of the reference; its sink gradient is the sum over its
own rows (checked per rank), and the ranks' sum is the reference's sink gradient. Negative
controls on the same data: the sink dropped, and the sink applied per KV chunk (once per
owner rank's keys, then merged), both fail the comparison. One spawn per cp runs everything."""
import pytest
import torch

from harness import run_ranks

COMMS = ("ring", "all_gather", "a2a", "a2a+p2p")
TOL = 1e-9
SINKS = (10.0, -2.0, 12.0, 0.5)          # heads 0 and 2: the sink dominates their rows


def _cases(cp: int):
    """(options, cu_seqlens or None, user stream length S). Zigzag S = 2 * cp * 4 tokens."""
    s = 8 * cp
    cu = [0, 3, 4, 4 + 5 * cp, 6 * cp + 3]            # the tail past cu[-1] is padding
    return [
        (dict(softcap=2.0, causal=True, hq=4, hkv=2), None, s),
        (dict(softcap=5.0, causal=True, window=(3, 0), hq=4, hkv=2), None, s),
        (dict(softcap=1.0, causal=False, window=(5, 2), hq=4, hkv=1), None, s),
        (dict(softcap=30.0, causal=True, window=(4, 0), hq=4, hkv=2), cu, s),
    ]


def _per_chunk_reference(q, k, v, sinks, opts, cp):
    """The WRONG result a CP scheme gives if it applied the sink to each rank's KV chunk before
    the merge: one sink per owner of keys instead of one per row (zigzag layout)."""
    from cp_softcap.merge import merge
    from cp_softcap.testing import masked_attention
    from cp_softcap.testing.reference import visible_mask
    s = q.shape[1]
    owner = torch.arange(2 * cp).repeat_interleave(s // (2 * cp))
    owner = torch.where(owner < cp, owner, 2 * cp - 1 - owner)
    visible = visible_mask(s, s, causal=opts["causal"], window=opts.get("window") or (None, None))
    parts = [masked_attention(q, k, v, visible & (owner == o)[None, :], softcap=opts["softcap"],
                              sinks=sinks) for o in range(cp)]
    return merge(parts, torch.float64)[0]


def _check_case(i, comm, group, cp, rank, opts, cu, s):
    import cp_softcap as cps
    from cp_softcap.sharding import packed_len, shard
    from cp_softcap.testing import (assert_finite, check_against_reference, reference_with_grads,
                                    saturating_qkv)
    torch.manual_seed(700 + i)
    n = s if cu is None else packed_len(s, cp)
    q, k, v, _ = saturating_qkv(2, n, n, opts["hq"], opts["hkv"], 8, torch.float64,
                                opts["softcap"], requires_grad=False)
    sinks = torch.tensor(SINKS, dtype=torch.float64)
    dout = torch.randn(q.shape, dtype=torch.float64)
    kw = dict(softcap=opts["softcap"], causal=opts["causal"], window=opts.get("window"))
    ref_out, ref_lse, ref_grads = reference_with_grads(q, k, v, dout, bottom_right=False,
                                                       cu_seqlens=cu, sinks=sinks, **kw)
    sh = (lambda t: shard(t, cp, rank)) if cu is None else (lambda t: shard(t, cp, rank, cu_seqlens=cu))
    local = [sh(t).requires_grad_() for t in (q, k, v)]
    sl = sinks.clone().requires_grad_()
    docs = {} if cu is None else {"cu_seqlens": cu}
    out = cps.cp_attention(*local, group, comm=comm, sinks=sl, **docs, **kw)
    out.backward(sh(dout))
    label = f"rank {rank} {comm} case {i}"
    errs = check_against_reference(out, [t.grad for t in local], sh(ref_out),
                                   [sh(g) for g in ref_grads[:3]], torch.float64,
                                   label=label, tol_scale=TOL / 1e-11)
    # this rank's sink gradient: minus the sum over ITS rows of exp(s - L') * rowsum(dO * O')
    rows = torch.exp(sinks.view(1, -1, 1) - ref_lse) * (dout * ref_out).sum(-1).transpose(1, 2)
    mine = -sh(rows.transpose(1, 2)).sum(dim=(0, 1))
    assert_finite(sl.grad, "dsinks " + label)
    err = ((sl.grad - mine).abs().max() / mine.abs().max()).item()
    if not err <= TOL:
        raise AssertionError(f"{label}: dsinks {sl.grad.tolist()} vs this rank's rows {mine.tolist()}")
    errs["dsinks_rank"] = err
    # negative controls on the same data: no sink, and (zigzag) the sink applied per chunk
    with torch.no_grad():
        dropped = cps.cp_attention(*local, group, comm=comm, **docs, **kw)
    wrong = [("dropped", dropped)]
    if cu is None:
        wrong.append(("per chunk", sh(_per_chunk_reference(q, k, v, sinks, kw, cp))))
    for what, bad in wrong:
        try:
            check_against_reference(bad, None, sh(ref_out), None, torch.float64, tol_scale=1e3)
        except AssertionError:
            continue
        raise AssertionError(f"{label}: the sink {what} passed the comparison")
    return errs, sl.grad.tolist(), ref_grads[3].tolist()     # no tensors through the queue


def _worker(rank, world):
    import torch.distributed as dist
    import cp_softcap as cps
    hybrid = cps.make_hybrid_groups(None, 2)
    results = {}
    for comm in COMMS:
        group = hybrid if comm == "a2a+p2p" else dist.group.WORLD
        for i, (opts, cu, s) in enumerate(_cases(world)):
            results[(comm, i)] = _check_case(i, comm, group, world, rank, opts, cu, s)
    # the ranks compare the sinks' presence (AttnSpec.sinks): one rank without them fails everywhere
    q = torch.randn(1, 4 * world, 4, 8, dtype=torch.float64)
    sinks = torch.zeros(4, dtype=torch.float64) if rank == 0 else None
    try:
        cps.cp_attention(q, q, q, dist.group.WORLD, sinks=sinks)
    except ValueError as e:
        if "sinks" not in str(e):
            raise AssertionError(f"unclear message: {e}")
    else:
        raise AssertionError("sinks on rank 0 only did not raise")
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_sinks_every_comm_matches_reference(world):
    results = run_ranks(_worker, world, timeout=240)
    for key in results[0]:
        total = sum(torch.tensor(r[key][1], dtype=torch.float64) for r in results)
        ref = torch.tensor(results[0][key][2], dtype=torch.float64)
        err = ((total - ref).abs().max() / ref.abs().max()).item()
        assert err <= TOL, (key, total.tolist(), ref.tolist())
    worst = max(max(r[key][0].values()) for r in results for key in r)
    print(f"cp={world}: worst max-relative error {worst:.3g}")
