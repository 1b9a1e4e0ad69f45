"""No hangs (gloo, CPU, world 2): a rank that stalls or dies inside a CP collective makes the
other rank fail with a clear error within CP_SOFTCAP_TIMEOUT, naming the operation and the rank
(the detection time is measured and printed); ranks that call with a different sequence length,
head count, softcap, window, comm type, dtype or causal flag fail on every rank with a message
naming the field and every rank's value, also when the mismatch appears after earlier identical
calls (the signature is checked only on the first call; later drift becomes a timeout error).

Every test runs its ranks in child processes under a hard deadline and kills all of them at the
end, whatever happened; a rank that is meant to die SIGKILLs itself."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from benchmarks.ranks import spawn_ranks
from harness import _CTX

TIMEOUT_S = 3.0                  # CP_SOFTCAP_TIMEOUT for these tests (default 120 s)
ENV = {"CP_SOFTCAP_TIMEOUT": str(TIMEOUT_S)}


def spawn(fn, world, *args, deadline_s=60.0, env=ENV):
    """Run fn(rank, world, *args) on `world` processes. Unlike harness.run_ranks, a rank dying or
    raising is an outcome, not a failure: returns {rank: ("ok", value) | ("error", traceback) |
    ("exit", exitcode)}. Every process is killed before returning."""
    out, running = spawn_ranks(fn, world, args, ctx=_CTX, deadline_s=deadline_s, env=env,
                               pg_timeout=60.0, poll_s=0.2, stop_on_failure=False, grace_s=0.0)
    if running:
        pytest.fail(f"ranks {running} neither finished nor failed within {deadline_s}s: a hang; "
                    f"outcomes so far: {out}")
    return out


def _qkv(s_local=8, hq=4, hkv=2, d=8, dtype=torch.float32, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, s_local, hq, d, generator=g).to(dtype)
    k = torch.randn(1, s_local, hkv, d, generator=g).to(dtype)
    v = torch.randn(1, s_local, hkv, d, generator=g).to(dtype)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def _timed(call):
    """(elapsed s, exception message or None)."""
    t0 = time.monotonic()
    try:
        call()
    except Exception as e:   # noqa: BLE001  (we report what the user would see)
        return time.monotonic() - t0, f"{type(e).__name__}: {e}"
    return time.monotonic() - t0, None


# ------------------------------------------------------------------ stalled or dead rank

def _stall_worker(rank, world, where):
    import cp_softcap as cps
    q, k, v = _qkv(seed=rank)
    cps.cp_attention(q, k, v, _world(), softcap=5.0).sum().backward()  # warm-up
    import torch.distributed as dist
    dist.barrier()                    # both ranks start the measured call together
    victim = world - 1
    if where == "first_call":         # a fresh signature: the check itself waits for the peer
        q, k, v = _qkv(s_local=12, seed=rank)
    if rank == victim:
        if where == "backward":
            out = cps.cp_attention(q, k, v, _world(), softcap=5.0)
        time.sleep(TIMEOUT_S + 1.5)   # stalls: never enters (or finishes) the collective
        return "stalled"
    if where == "backward":
        out = cps.cp_attention(q, k, v, _world(), softcap=5.0)
        return _timed(lambda: out.sum().backward())
    return _timed(lambda: cps.cp_attention(q, k, v, _world(), softcap=5.0))


def _world():
    import torch.distributed as dist
    return dist.group.WORLD


def _die_worker(rank, world):
    """The victim SIGKILLs itself inside the ring backward, after its first kernel backward: its
    K/V for the next step is posted, and the peer waits for the dK/dV the victim never sends."""
    import cp_softcap as cps
    from cp_softcap.kernels import get_kernel
    q, k, v = _qkv(seed=rank)
    cps.cp_attention(q, k, v, _world(), softcap=5.0).sum().backward()   # warm-up (and signature)
    if rank == world - 1:
        kernel = get_kernel("torch")
        real = kernel.backward

        def dying_backward(*a, **kw):
            result = real(*a, **kw)
            os.kill(os.getpid(), signal.SIGKILL)
            return result
        kernel.backward = dying_backward
    return _timed(lambda: cps.cp_attention(q, k, v, _world(), softcap=5.0).sum().backward())


def _check_detected(outcome, op, rank=0, limit=TIMEOUT_S):
    status, value = outcome
    assert status == "ok", f"rank {rank} itself crashed instead of reporting an error:\n{value}"
    elapsed, msg = value
    assert msg is not None, f"rank {rank} finished although its peer stalled ({elapsed:.1f}s)"
    assert "RuntimeError" in msg and op in msg and f"CP rank {rank}" in msg, msg
    assert "CP_SOFTCAP_TIMEOUT" in msg, msg            # the message names the knob
    assert elapsed < limit + 5.0, f"detection took {elapsed:.1f}s (timeout {limit}s): {msg}"
    return elapsed


@pytest.mark.timeout(90)
@pytest.mark.parametrize("where,op", [("forward", "ring.fwd.kv"), ("backward", "ring.bwd"),
                                      ("first_call", "the CP call-signature check")])
def test_stalled_rank_is_detected_within_timeout(where, op):
    out = spawn(_stall_worker, 2, where)
    assert out[1] == ("ok", "stalled"), out[1]
    elapsed = _check_detected(out[0], op)
    assert elapsed > TIMEOUT_S - 0.5, f"gave up after {elapsed:.2f}s, before the {TIMEOUT_S}s timeout"
    print(f"stall in {where}: detected on rank 0 after {elapsed:.2f}s (CP_SOFTCAP_TIMEOUT={TIMEOUT_S})")


@pytest.mark.timeout(90)
def test_rank_dying_inside_ring_is_detected():
    out = spawn(_die_worker, 2)
    assert out[1] == ("exit", -signal.SIGKILL), out[1]
    elapsed = _check_detected(out[0], "ring.bwd")
    print(f"rank killed inside the ring backward: detected on rank 0 after {elapsed:.2f}s")


# ------------------------------------------------------------------ mismatched calls

BASE = dict(s_local=8, hq=4, hkv=2, dtype=torch.float32)
MISMATCHES = [   # (name, field named in the message, per-rank call options for rank 1)
    ("seq_len", "local seq len", dict(s_local=4), {}),   # s_local: added to rank 0's
    ("q_heads", "query heads", dict(hq=2), {}),
    ("kv_heads", "kv heads", dict(hkv=4), {}),
    ("dtype", "dtype", dict(dtype=torch.float64), {}),
    ("softcap", "softcap", {}, dict(softcap=50.0)),
    ("softcap_off", "softcap", {}, dict(softcap=None)),
    ("window", "window left", {}, dict(window=(5, 0))),
    ("causal", "causal", {}, dict(causal=False)),
    ("comm", "comm", {}, dict(comm="all_gather")),
]


def _mismatch_worker(rank, world, cases, drift):
    import cp_softcap as cps
    report = []
    for i, (name, field, shape1, opts1) in enumerate(cases):
        shape = {**BASE, "s_local": BASE["s_local"] + 2 * (i + 1)}      # a fresh signature per case
        opts = dict(softcap=5.0, causal=True, window=None, comm="ring")
        if drift:   # identical first calls, so every signature is cached; then rank 1 drifts
            cps.cp_attention(*_qkv(**shape, seed=rank), _world(), **opts)
        if rank == 1:
            shape = {**shape, **shape1, "s_local": shape["s_local"] + shape1.get("s_local", 0)}
            opts = {**opts, **opts1}
        elapsed, msg = _timed(lambda: cps.cp_attention(*_qkv(**shape, seed=rank), _world(), **opts))
        report.append((name, field, elapsed, msg))
        if drift and msg is not None:
            break   # after a timeout the ranks are out of step; one drift case per process group
    return report


@pytest.mark.timeout(60)
def test_mismatched_calls_fail_on_every_rank_with_the_values():
    out = spawn(_mismatch_worker, 2, MISMATCHES, False)
    for rank in (0, 1):
        status, report = out[rank]
        assert status == "ok", report
        assert len(report) == len(MISMATCHES)
        for name, field, elapsed, msg in report:
            assert msg is not None, f"{name}: rank {rank} did not raise"
            assert msg.startswith("ValueError") and f"{field} differs" in msg, (name, msg)
            assert "rank 0:" in msg and "rank 1:" in msg, (name, msg)
            assert elapsed < TIMEOUT_S, f"{name}: rank {rank} needed {elapsed:.1f}s"


def _env_mismatch_worker(rank, world, name, value, backend):
    """Same call on both ranks, but rank 0 has `name`=`value` in its environment (as a node
    with other packages or another launch script would)."""
    import cp_softcap as cps
    if rank == 0:
        os.environ[name] = value
    return _timed(lambda: cps.cp_attention(*_qkv(**BASE, seed=rank), _world(), softcap=None,
                                           backend=backend if rank == 1 else "auto"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name,value,backend,want", [
    ("CP_SOFTCAP_BACKEND", "torch", "auto", "selected kernel differs (rank 0: torch, rank 1: sdpa)"),
    ("CP_SOFTCAP_RING_BLOCK_KEYS", "0", "auto", "ring block keys differs (rank 0: 0, rank 1: 32768)"),
    ("CP_SOFTCAP_RING_BLOCK_KEYS", "lots", "auto",
     "ring block keys differs (rank 0: invalid CP_SOFTCAP_RING_BLOCK_KEYS, rank 1: 32768)"),
    ("UNUSED", "", "fa2", "selected kernel differs (rank 0: sdpa, rank 1: none"),   # fa2 absent on CPU
], ids=["kernel", "block-keys", "block-keys-invalid", "forced-backend-unavailable"])
def test_ranks_that_differ_in_kernel_or_block_size_fail_with_both_values(name, value, backend, want):
    """The kernel's gradient dtype and the ring's block size shape the ring's messages (and the
    kernel steers comm='auto'); a rank whose selection fails must not leave the others waiting:
    every rank fails at once, naming every rank's value."""
    out = spawn(_env_mismatch_worker, 2, name, value, backend)
    for rank in (0, 1):
        status, (elapsed, msg) = out[rank]
        assert status == "ok" and msg is not None, out[rank]
        assert msg.startswith("ValueError") and want in msg, msg
        assert elapsed < TIMEOUT_S, f"rank {rank} needed {elapsed:.1f}s"


def _standin_kernels_worker(rank, world):
    """Each rank passes its own kernel instance, both the torch kernel's math under names that
    are in no list of the library: first under different names (must fail on both ranks), then
    under the same name (must run, equal to the reference)."""
    import cp_softcap as cps
    from cp_softcap.kernels.torch_kernel import TorchKernel

    class StandIn(TorchKernel):
        def __init__(self, name):
            super().__init__()
            self.name = name

    differ = _timed(lambda: cps.cp_attention(*_qkv(seed=rank), _world(), softcap=5.0,
                                             backend=StandIn(f"standin_{'ab'[rank]}")))
    same = cps.cp_attention(*_qkv(seed=rank), _world(), softcap=5.0, backend=StandIn("standin_c"))
    torch_out = cps.cp_attention(*_qkv(seed=rank), _world(), softcap=5.0, backend="torch")
    return differ, torch.equal(same, torch_out)


@pytest.mark.timeout(60)
def test_two_kernels_outside_every_list_are_told_apart():
    """The cross-rank check compares the selected kernel by its name, whatever it is (a kernel
    name missing from a list must not encode the same on both ranks)."""
    out = spawn(_standin_kernels_worker, 2)
    for rank in (0, 1):
        status, value = out[rank]
        assert status == "ok", value
        (elapsed, msg), same_as_torch = value
        assert msg is not None and msg.startswith("ValueError"), msg
        assert "selected kernel differs (rank 0: standin_a, rank 1: standin_b)" in msg, msg
        assert elapsed < TIMEOUT_S and same_as_torch


def _both_force_fa2_worker(rank, world):
    import cp_softcap as cps
    return _timed(lambda: cps.cp_attention(*_qkv(**BASE, seed=rank), _world(), backend="fa2"))


@pytest.mark.timeout(60)
def test_the_same_local_failure_on_every_rank_is_raised_on_every_rank():
    """All ranks agree (each forced fa2, which CPU cannot run): the signatures match and each
    rank raises its own selection error, at once."""
    out = spawn(_both_force_fa2_worker, 2)
    for rank in (0, 1):
        status, (elapsed, msg) = out[rank]
        assert status == "ok" and msg is not None, out[rank]
        assert msg.startswith("ValueError: backend 'fa2' cannot serve this call"), msg
        assert elapsed < TIMEOUT_S, f"rank {rank} needed {elapsed:.1f}s"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", [MISMATCHES[0], MISMATCHES[4]], ids=["seq_len", "softcap"])
def test_mismatch_after_identical_calls_times_out_with_a_message(case):
    """The signature is exchanged only on a (group, signature)'s first call. A rank whose call
    changes later (here: after identical warm-up calls) is caught by the collective timeout on
    every rank, with a message naming the op: slower than the first-call check, never a hang."""
    out = spawn(_mismatch_worker, 2, [case], True)
    for rank in (0, 1):
        status, report = out[rank]
        assert status == "ok", report
        (name, field, elapsed, msg), = report
        assert msg is not None, f"rank {rank} did not fail"
        assert ("differs" in msg) or ("timed out" in msg and f"CP rank {rank}" in msg), msg
        assert elapsed < TIMEOUT_S + 5.0, f"rank {rank} needed {elapsed:.1f}s: {msg}"
        print(f"drift {name}: rank {rank} failed after {elapsed:.2f}s: {msg[:160]}")


def _seen_both_worker(rank, world):
    """Both ranks have used both signatures before; then they diverge into them."""
    import cp_softcap as cps
    for s in (8, 12):
        cps.cp_attention(*_qkv(s_local=s, seed=rank), _world(), softcap=5.0)
    for cap in (5.0, 50.0):
        cps.cp_attention(*_qkv(seed=rank), _world(), softcap=cap)
    softcap = _timed(lambda: cps.cp_attention(*_qkv(seed=rank), _world(), softcap=5.0 if rank == 0 else 50.0))
    seq = _timed(lambda: cps.cp_attention(*_qkv(s_local=8 if rank == 0 else 12, seed=rank), _world(), softcap=5.0))
    return softcap, seq


@pytest.mark.timeout(60)
def test_divergence_into_seen_signatures_with_check_every_call():
    """With CP_SOFTCAP_CHECK_EVERY_CALL=1 ranks that diverge into signatures they have each used
    before fail on every rank at once with the values. (Without it the ring's tagged messages
    never match and both ranks fail after the timeout, naming the call; the collective
    algorithms on gloo check every call anyway: tests_dist/test_robustness.py.)"""
    out = spawn(_seen_both_worker, 2, env={**ENV, "CP_SOFTCAP_CHECK_EVERY_CALL": "1"})
    for rank in (0, 1):
        status, value = out[rank]
        assert status == "ok", value
        (t1, m1), (t2, m2) = value
        assert m1 and m1.startswith("ValueError") and "softcap differs (rank 0: 5.0, rank 1: 50.0)" in m1, m1
        assert m2 and m2.startswith("ValueError") and "local seq len differs (rank 0: 8, rank 1: 12)" in m2, m2
        assert max(t1, t2) < TIMEOUT_S
