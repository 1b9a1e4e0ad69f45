"""Autocast on CUDA (bf16 and fp16 regions): every CUDA kernel, one device and under CP (ranks
sharing one GPU through gloo), gives the same forward bitwise and the same gradients (within
run-to-run atomics of the flash-attn/flex backward) inside and outside `torch.autocast`, within
tolerance of the float64 reference, with a cap-dropped control. The CPU cases are in
tests/test_autocast.py and tests_dist/test_robustness.py.

Marked `gpu`: skipped without CUDA, and each kernel's cases without that kernel."""
import os
import sys

import pytest
import torch
from markers import with_kernels

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests_dist"))
from harness import run_ranks  # noqa: E402

import cp_softcap as cps  # noqa: E402
from cp_softcap.testing import (TOLERANCES, check_against_reference, rel_err,  # noqa: E402
                                reference_with_grads, saturating_qkv)

pytestmark = pytest.mark.gpu


def _run(attend, q, k, v, dout):
    q, k, v = (t.detach().clone().cuda().requires_grad_(True) for t in (q, k, v))
    out = attend(q, k, v)
    out.backward(dout.cuda())
    return [t.detach().cpu() for t in (out, q.grad, k.grad, v.grad)]


def _compare(inside, plain, q, k, v, dout, dtype, softcap, label, shard=lambda t: t, out_used=None):
    assert all(a.dtype == dtype for a in inside), [a.dtype for a in inside]
    assert torch.equal(inside[0], plain[0]), f"{label}: forward differs under autocast"
    for a, b in zip(inside[1:], plain[1:]):
        assert rel_err(a, b) <= TOLERANCES[dtype]["grad"], f"{label}: gradients differ under autocast"
    _, _, ref_grads = reference_with_grads(q, k, v, dout, softcap=softcap, causal=True,
                                           bottom_right=False, out_used=out_used)
    ref_out, _, exact = reference_with_grads(q, k, v, dout, softcap=softcap, causal=True,
                                             bottom_right=False)
    check_against_reference(inside[0], inside[1:], shard(ref_out), [shard(g) for g in ref_grads],
                            dtype, label=label, tol_scale=2.0, exact_grads=[shard(g) for g in exact])
    nocap, _, _ = reference_with_grads(q, k, v, dout, causal=True, bottom_right=False)
    assert rel_err(inside[0], shard(nocap)) > 10 * TOLERANCES[dtype]["out"], "cap-dropped control"


@pytest.mark.parametrize("region", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["in-bf16", "in-fp16", "in-fp32"])
@pytest.mark.parametrize("backend", with_kernels(["fa4", "flex", "fa2", "torch"]))
def test_one_device_same_inside_and_outside_autocast(backend, dtype, region):
    torch.manual_seed(0)
    cap = 30.0
    q, k, v, _ = saturating_qkv(1, 256, 256, 4, 2, 128, dtype, cap, requires_grad=False)
    dout = torch.randn(q.shape, dtype=torch.float64).to(dtype)
    attend = lambda a, b, c: cps.attention(a, b, c, softcap=cap, backend=backend)  # noqa: E731
    try:
        plain = _run(attend, q, k, v, dout)
    except ValueError as e:
        pytest.skip(f"{backend} cannot serve {dtype} here: {e}")
    with torch.autocast("cuda", dtype=region):
        inside = _run(attend, q, k, v, dout)
    # One device: the backward takes D = rowsum(dO * O) from the kernel's own O, which every
    # flash kernel and flex return in the input dtype (the rounding-aware reference); the torch
    # kernel keeps O in float32, for which the plain reference is the exact one.
    _compare(inside, plain, q, k, v, dout, dtype, cap, f"{backend} {dtype} in {region}",
             out_used=None if backend == "torch" else inside[0])


def _cp_worker(rank, world, comm, region):
    import torch.distributed as dist
    from cp_softcap.sharding import shard
    torch.manual_seed(7)
    cap, dtype = 30.0, torch.bfloat16
    q, k, v, _ = saturating_qkv(1, 256 * world, 256 * world, 4, 2, 128, dtype, cap, requires_grad=False)
    dout = torch.randn(q.shape, dtype=torch.float64).to(dtype)
    local = [shard(t, world, rank) for t in (q, k, v, dout)]
    attend = lambda a, b, c: cps.cp_attention(a, b, c, dist.group.WORLD, softcap=cap, comm=comm)  # noqa: E731
    plain = _run(attend, *local)
    with torch.autocast("cuda", dtype=region):
        inside = _run(attend, *local)
    _compare(inside, plain, q, k, v, dout, dtype, cap, f"rank {rank} {comm} in {region}",
             shard=lambda t: shard(t, world, rank))
    return "ok"


@pytest.mark.parametrize("region", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("comm", ["ring", "all_gather", "a2a"])
def test_cp_same_inside_and_outside_autocast(comm, region):
    assert run_ranks(_cp_worker, 2, comm, region, timeout=300.0) == ["ok", "ok"]
