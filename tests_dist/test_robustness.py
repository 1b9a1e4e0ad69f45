"""Robustness under CP (gloo, CPU, world 2): autocast, double backward, a stalled peer at every
op of every comm type, a rank that skips a backward, divergent calls, a bad input only one rank
has. Every multi-process case runs under a hard deadline and ends in seconds: the waits are
bounded by a small CP_SOFTCAP_TIMEOUT, set after the warm-up calls."""
from __future__ import annotations

import os
import time

import pytest
import torch

from harness import _CTX
from benchmarks.ranks import spawn_ranks

TIMEOUT_S = 1.0
STALL_TIMEOUT_S = 1.0
WARM_TIMEOUT_S = 30.0       # before a worker arms the short timeout: rank start-up and first calls


def arm(seconds=TIMEOUT_S):
    """The short CP_SOFTCAP_TIMEOUT (read at call time) for the calls that follow, after a
    barrier: on a loaded machine one rank can start or warm up later than the other by more
    than the short timeout, which would fail a warm-up call instead of the measured one."""
    import torch.distributed as dist
    dist.barrier()
    os.environ["CP_SOFTCAP_TIMEOUT"] = str(seconds)


def spawn(fn, world, *args, deadline_s=90.0, timeout_s=WARM_TIMEOUT_S):
    """{rank: ("ok", value) | ("error", traceback) | ("exit", code)}; a rank that raises or dies
    is an outcome to check, not a test failure. Every process is gone on return."""
    out, running = spawn_ranks(fn, world, args, ctx=_CTX, deadline_s=deadline_s, pg_timeout=60.0,
                               env={"CP_SOFTCAP_TIMEOUT": str(timeout_s)}, poll_s=0.2,
                               stop_on_failure=False, grace_s=0.0)
    if running:
        pytest.fail(f"ranks {running} neither finished nor failed within {deadline_s}s: {out}")
    return out


def _timed(call):
    """(elapsed s, 'Type: message' or None)."""
    t0 = time.monotonic()
    try:
        call()
    except Exception as e:   # noqa: BLE001  (what the user would see)
        return time.monotonic() - t0, f"{type(e).__name__}: {e}"
    return time.monotonic() - t0, None


def _inputs(rank, cp, dtype, softcap, seed, s=32):
    """(global q, k, v, dout) identical on every rank, and this rank's shards."""
    from cp_softcap.sharding import shard
    from cp_softcap.testing import saturating_qkv
    torch.manual_seed(seed)
    q, k, v, _ = saturating_qkv(1, s, s, 4, 2, 16, dtype, softcap, requires_grad=False)
    dout = torch.randn(q.shape, dtype=torch.float64).to(dtype)
    return (q, k, v, dout), tuple(shard(t, cp, rank) for t in (q, k, v, dout))


def _groups(comm):
    import torch.distributed as dist
    import cp_softcap as cps
    return cps.make_hybrid_groups(None, 1) if comm == "a2a+p2p" else dist.group.WORLD


COMMS = ("ring", "all_gather", "a2a", "a2a+p2p")


# ------------------------------------------------------------------ autocast

def _autocast_worker(rank, world):
    """Every comm type, bf16 and float32 inputs, saturating caps: out and grads inside CPU bf16
    autocast are bitwise those outside, and within tolerance of the float64 reference."""
    import cp_softcap as cps
    from cp_softcap.sharding import shard
    from cp_softcap.testing import TOLERANCES, check_against_reference, reference_with_grads, rel_err
    report = []
    for comm in COMMS:
        group = _groups(comm)
        for dtype, cap in ((torch.bfloat16, 50.0), (torch.float32, 2.0)):
            (q, k, v, dout), (ql, kl, vl, dl) = _inputs(rank, world, dtype, cap, seed=len(report))

            def run():
                a, b, c = (t.clone().requires_grad_(True) for t in (ql, kl, vl))
                out = cps.cp_attention(a, b, c, group, softcap=cap, comm=comm)
                out.backward(dl)
                return out, a.grad, b.grad, c.grad

            plain = run()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                inside = run()
            same = all(torch.equal(x, y) and x.dtype == dtype for x, y in zip(inside, plain))
            ref_out, _, ref_grads = reference_with_grads(q, k, v, dout, softcap=cap, causal=True,
                                                         bottom_right=False)
            check_against_reference(inside[0], inside[1:], shard(ref_out, world, rank),
                                    [shard(g, world, rank) for g in ref_grads], dtype,
                                    label=f"{comm} {dtype} rank {rank}")
            nocap, _, _ = reference_with_grads(q, k, v, dout, softcap=None, causal=True,
                                               bottom_right=False)
            dropped = rel_err(inside[0], shard(nocap, world, rank))
            assert dropped > 10 * TOLERANCES[dtype]["out"], f"cap-dropped control too weak: {dropped}"
            report.append((comm, str(dtype), same))
    return report


@pytest.mark.timeout(120)
def test_every_comm_type_same_inside_and_outside_autocast():
    out = spawn(_autocast_worker, 2)
    for rank in (0, 1):
        status, report = out[rank]
        assert status == "ok", report
        assert len(report) == 2 * len(COMMS) and all(same for *_, same in report), report


# ------------------------------------------------------------------ double backward

def _double_backward_worker(rank, world, comm):
    """A gradient penalty under CP: every way of taking gradients with create_graph=True (all
    of q, k, v; only k, the way torch.autograd.grad(loss, [k]) would skip a lazy error node)
    raises the double-backward error on every rank at once, before any message; the group
    still works after it."""
    import cp_softcap as cps
    group = _groups(comm)
    _, (ql, kl, vl, dl) = _inputs(rank, world, torch.float32, 5.0, seed=3)
    q, k, v = (t.clone().requires_grad_(True) for t in (ql, kl, vl))
    (cps.cp_attention(q, k, v, group, softcap=5.0, comm=comm) * dl).sum().backward()   # warm-up
    arm()
    report = []
    for wrt in ((q, k, v), (k,)):
        loss = (cps.cp_attention(q, k, v, group, softcap=5.0, comm=comm) * dl).sum()
        report.append(_timed(lambda: torch.autograd.grad(loss, wrt, create_graph=True)))
    after = cps.cp_attention(q, k, v, group, softcap=5.0, comm=comm)    # the group still works
    after.sum().backward()
    return report, bool(torch.isfinite(after).all() and torch.isfinite(q.grad).all())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("comm", COMMS)
def test_double_backward_raises_on_every_rank(comm):
    out = spawn(_double_backward_worker, 2, comm)
    for rank in (0, 1):
        status, value = out[rank]
        assert status == "ok", value
        report, still_works = value
        for elapsed, msg in report:
            assert msg and msg.startswith("RuntimeError") and "double backward through context-parallel" in msg, msg
            assert elapsed < TIMEOUT_S, (elapsed, msg)
        assert still_works


# ------------------------------------------------------------------ a stalled peer at every op

OPS = {
    "ring": ["ring.fwd.kv", "ring.bwd.kv", "ring.bwd.dkv"],
    "all_gather": ["the CP per-call check (forward)", "all_gather.fwd.kv",
                   "the CP per-call check (backward)", "all_gather.bwd.kv", "all_gather.bwd.dkv"],
    "a2a": ["the CP per-call check (forward)", "a2a.fwd.q", "a2a.fwd.k", "a2a.fwd.v", "a2a.fwd.out",
            "the CP per-call check (backward)", "a2a.bwd.dout", "a2a.bwd.dq", "a2a.bwd.dk", "a2a.bwd.dv"],
}


class _Stall(Exception):
    pass


def _stall_at(op):
    """Make this process stop (raise _Stall) where it would enter `op`: its peer never sees it."""
    from cp_softcap import transport
    from cp_softcap.cp import guard
    real_count, real_bytes, real_check = transport.count, transport.count_bytes, guard.check_agreement

    def count(name, *a):
        if name == op:
            raise _Stall(op)
        return real_count(name, *a)

    def count_bytes(name, *a):
        if name == op:
            raise _Stall(op)
        return real_bytes(name, *a)

    def check(group, fields, device, what, **kw):
        if what == op:
            raise _Stall(op)
        return real_check(group, fields, device, what, **kw)

    transport.count, transport.count_bytes, guard.check_agreement = count, count_bytes, check
    return lambda: setattr(transport, "count", real_count) or setattr(transport, "count_bytes", real_bytes) \
        or setattr(guard, "check_agreement", real_check)


def _stall_worker(rank, world, comm, ops):
    """For each op: a fresh group, a warm-up call, then rank 1 stalls at `op` for longer than
    the timeout while rank 0 runs forward and backward. Rank 0's outcome per op."""
    import torch.distributed as dist
    import cp_softcap as cps
    report = []
    for op in ops:
        os.environ["CP_SOFTCAP_TIMEOUT"] = str(WARM_TIMEOUT_S)
        group = dist.new_group([0, 1])
        _, (ql, kl, vl, dl) = _inputs(rank, world, torch.float32, 5.0, seed=1, s=16)
        q, k, v = (t.clone().requires_grad_(True) for t in (ql, kl, vl))
        cps.cp_attention(q, k, v, group, softcap=5.0, comm=comm).backward(dl)    # warm-up
        arm(STALL_TIMEOUT_S)
        if rank == 1:
            restore = _stall_at(op)
            try:
                cps.cp_attention(q, k, v, group, softcap=5.0, comm=comm).backward(dl)
                report.append((op, "no stall"))
            except _Stall:
                time.sleep(STALL_TIMEOUT_S + 0.5)
                report.append((op, "stalled"))
            finally:
                restore()
        else:
            report.append((op, _timed(lambda: cps.cp_attention(q, k, v, group, softcap=5.0,
                                                                comm=comm).backward(dl))))
    return report


@pytest.mark.timeout(120)
@pytest.mark.parametrize("comm", sorted(OPS))
def test_stalled_peer_at_every_op_is_detected_within_timeout(comm):
    out = spawn(_stall_worker, 2, comm, OPS[comm])
    status, stalled = out[1]
    assert status == "ok" and all(s == "stalled" for _, s in stalled), stalled
    status, report = out[0]
    assert status == "ok", report
    for op, (elapsed, msg) in report:
        assert msg is not None, f"{op}: rank 0 finished although its peer stalled"
        assert op in msg and "CP rank 0" in msg and "CP_SOFTCAP_TIMEOUT" in msg, (op, msg)
        assert STALL_TIMEOUT_S - 0.2 < elapsed < STALL_TIMEOUT_S + 2.0, f"{op}: {elapsed:.1f}s: {msg}"


# ------------------------------------------------------------------ a rank skips a backward

def _skip_batch_worker(rank, world, comm):
    """Rank 1 raises after the forward (a "skip this batch" handler catches it) and goes on to
    the next forward while rank 0 runs the backward. Both must fail with a clear error, in
    bounded time, and a fresh group must then work (the recovery docs/failures.md describes)."""
    import torch.distributed as dist
    import cp_softcap as cps
    group = _groups(comm)
    _, (ql, kl, vl, dl) = _inputs(rank, world, torch.float32, 5.0, seed=5, s=16)
    q, k, v = (t.clone().requires_grad_(True) for t in (ql, kl, vl))
    cps.cp_attention(q, k, v, group, softcap=5.0, comm=comm).backward(dl)     # warm-up
    arm()
    out = cps.cp_attention(q, k, v, group, softcap=5.0, comm=comm)
    if rank == 1:
        result = _timed(lambda: cps.cp_attention(q, k, v, group, softcap=5.0, comm=comm))
    else:
        result = _timed(lambda: out.backward(dl))
    os.environ["CP_SOFTCAP_TIMEOUT"] = str(WARM_TIMEOUT_S)
    time.sleep(TIMEOUT_S + 0.5)        # both have failed: start the recovery together
    fresh = dist.new_group([0, 1]) if comm != "a2a+p2p" else cps.make_hybrid_groups(None, 1)
    q.grad = None
    cps.cp_attention(q, k, v, fresh, softcap=5.0, comm=comm).backward(dl)
    return result, bool(torch.isfinite(q.grad).all())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("comm", COMMS)
def test_rank_skipping_a_backward_fails_both_ranks_clearly(comm):
    out = spawn(_skip_batch_worker, 2, comm)
    for rank in (0, 1):
        status, value = out[rank]
        assert status == "ok", f"rank {rank}: {value}"     # no abort: both report
        (elapsed, msg), recovered = value
        assert msg is not None, f"rank {rank} did not fail"
        if comm in ("ring", "a2a+p2p"):    # tagged messages never match: the timeout names the call
            want = "backward of call 2" if rank == 0 else "forward of call 3"
            assert msg.startswith("RuntimeError") and want in msg and "skipped" in msg, msg
            assert elapsed < TIMEOUT_S + 2.0, (elapsed, msg)
        else:                              # the per-call check: at once, every rank's value
            assert msg.startswith("ValueError") and \
                "call differs (rank 0: backward of call 2, rank 1: forward of call 3)" in msg, msg
            assert elapsed < TIMEOUT_S, (elapsed, msg)
        assert recovered


# ------------------------------------------------------------------ divergent calls, by default

def _diverge_worker(rank, world, comm):
    """Both ranks have used softcap 5 and 50 before; then rank 0 calls with 5, rank 1 with 50."""
    import cp_softcap as cps
    group = _groups(comm)
    _, (ql, kl, vl, _) = _inputs(rank, world, torch.float32, 5.0, seed=6, s=16)
    for cap in (5.0, 50.0):
        cps.cp_attention(ql, kl, vl, group, softcap=cap, comm=comm)
    arm()
    return _timed(lambda: cps.cp_attention(ql, kl, vl, group, softcap=5.0 if rank == 0 else 50.0,
                                           comm=comm))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("comm", ["ring", "all_gather"])
def test_divergence_into_seen_signatures_is_caught_by_default(comm):
    out = spawn(_diverge_worker, 2, comm)
    for rank in (0, 1):
        status, value = out[rank]
        assert status == "ok", value
        elapsed, msg = value
        assert msg is not None, f"rank {rank} ran a divergent call silently"
        if comm == "ring":
            assert msg.startswith("RuntimeError") and "forward of call 3" in msg and "different call" in msg, msg
            assert elapsed < TIMEOUT_S + 2.0
        else:
            assert msg.startswith("ValueError") and "softcap differs (rank 0: 5.0, rank 1: 50.0)" in msg, msg
            assert elapsed < TIMEOUT_S


# ------------------------------------------------------------------ a bad input on one rank

def _one_rank_bad_worker(rank, world):
    import torch.distributed as dist
    import cp_softcap as cps
    _, (ql, kl, vl, _) = _inputs(rank, world, torch.float32, 5.0, seed=7, s=16)
    if rank == 1:
        kl = kl.double()
    return _timed(lambda: cps.cp_attention(ql, kl, vl, dist.group.WORLD, softcap=5.0))


@pytest.mark.timeout(60)
def test_bad_input_on_one_rank_fails_every_rank_at_once():
    out = spawn(_one_rank_bad_worker, 2)
    (s0, (t0, m0)), (s1, (t1, m1)) = out[0], out[1]
    assert s0 == s1 == "ok"
    assert m0 and m0.startswith("ValueError") and "inputs differs (rank 0: valid, rank 1: invalid on CP rank 1" in m0, m0
    assert "must share one dtype" in m0, m0
    assert m1 and m1.startswith("TypeError") and "CP rank 1" in m1, m1
    assert max(t0, t1) < 5.0, (t0, t1)
