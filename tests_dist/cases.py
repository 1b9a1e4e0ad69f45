"""Shared case runner for the CP tests: build global inputs (identical on every rank: same
seed), compute the float64 reference of FULL attention, shard, run cp_attention, compare this
rank's shard of the output and of every gradient."""
from __future__ import annotations

import torch
import torch.distributed as dist

import cp_softcap as cps
from cp_softcap.sharding import shard
from cp_softcap.testing import (TOLERANCES, check_against_reference, reference_with_grads,
                                rel_err, saturating_qkv)


def run_case(case: dict, seed: int, group=None, comm: str = "ring", backend: str = "auto"):
    """case keys: b, s, hq, hkv, d, dtype, softcap, causal, window, scale. Returns error dict."""
    group = group or dist.group.WORLD
    if comm == "a2a+p2p":   # (a2a, ring) groups built from consecutive ranks of WORLD
        cp, rank = dist.get_world_size(), dist.get_rank()
    else:
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(seed)
    dtype, cap = case["dtype"], case.get("softcap")
    q, k, v, frac = saturating_qkv(case["b"], case["s"], case["s"], case["hq"], case["hkv"],
                                   case["d"], dtype, cap, scale=case.get("scale"), requires_grad=False)
    dout = torch.randn(q.shape[:-1] + (v.shape[-1],), dtype=torch.float64).to(dtype)
    opts = dict(softcap=cap, causal=case["causal"], window=case.get("window"), scale=case.get("scale"))
    ref_out, _, ref_grads = reference_with_grads(q, k, v, dout, bottom_right=False, **opts)
    ql, kl, vl = (shard(t, cp, rank).requires_grad_() for t in (q, k, v))
    out = cps.cp_attention(ql, kl, vl, group, comm=comm, backend=backend, **opts)
    out.backward(shard(dout, cp, rank))
    errs = check_against_reference(
        out, (ql.grad, kl.grad, vl.grad), shard(ref_out, cp, rank),
        [shard(g, cp, rank) for g in ref_grads], dtype, label=f"rank {rank} {case}")
    if cap:  # negative control: the same output must NOT match the uncapped reference
        nocap, _, _ = reference_with_grads(q, k, v, dout, bottom_right=False,
                                           **{**opts, "softcap": None})
        dropped = rel_err(out, shard(nocap, cp, rank))
        if not dropped > 10 * TOLERANCES[dtype]["out"]:
            raise AssertionError(f"cap-dropped check too weak on rank {rank}: {dropped:.3g} {case}")
        errs["saturated"] = frac
    return errs


def native_standin():
    """A kernel to pass as backend=: the torch kernel's math with its gradients rounded to the
    input dtype (caps.grads_in_input_dtype, as the flash-attn family returns them), counting its
    backward calls."""
    import dataclasses

    from cp_softcap.kernels.torch_kernel import TorchKernel

    class NativeBF16Torch(TorchKernel):
        caps = dataclasses.replace(TorchKernel.caps, grads_in_input_dtype=True)
        calls = 0

        def backward(self, dout, q, k, v, out, lse, **kw):
            type(self).calls += 1
            grads = TorchKernel.backward(self, dout, q, k, v, out, lse, **kw)
            return tuple(g.to(x.dtype) for g, x in zip(grads, (q, k, v)))

    return NativeBF16Torch()
