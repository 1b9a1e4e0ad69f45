"""Packed documents under CP on ONE GPU: 2 and 4 ranks share the GPU through gloo (CUDA tensors
staged through host memory), with the GPU kernels that serve segments= (fa4 and fa2 where
installed, flex, the torch kernel), every comm type, against the float64 reference of block-diagonal
document attention (saturating softcap, causal and a window smaller than the documents), with
a negative control (boundaries dropped must fail).

Marked `gpu`: skipped without CUDA, each kernel's cases without that kernel, the NCCL cases
without enough GPUs. Uses tests_dist/harness.py (forkserver ranks, hard timeout).
"""
import os
import sys

import pytest
import torch
from markers import with_kernels

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests_dist"))
from harness import run_ranks  # noqa: E402
from packed_cp_check import worker  # noqa: E402

pytestmark = pytest.mark.gpu


def _skip_unless(backend, dtype):
    from cp_softcap.kernels import get_kernel
    from cp_softcap.spec import make_spec
    spec = make_spec(head_dim=128, num_heads=4, num_kv_heads=2, dtype=dtype, device_type="cuda",
                     softcap=30.0, causal=True, cp_size=2, documents=True)
    kernel = get_kernel(backend)
    reason = kernel.probe(spec) or (None if kernel.caps.segments else "no segments= support")
    if reason:
        pytest.skip(f"{backend}: {reason}")


@pytest.mark.parametrize("backend,dtype,world,comms,window", with_kernels([
    ("flex", torch.bfloat16, 2, ("ring", "all_gather", "a2a", "auto"), None),
    ("flex", torch.bfloat16, 4, ("ring", "a2a+p2p"), (100, 0)),
    ("fa2", torch.bfloat16, 2, ("ring", "all_gather", "a2a", "auto"), None),
    ("fa2", torch.bfloat16, 4, ("ring", "a2a+p2p"), (100, 0)),
    ("fa4", torch.bfloat16, 2, ("ring", "all_gather", "a2a", "auto"), None),
    ("fa4", torch.bfloat16, 4, ("ring", "a2a+p2p"), (100, 0)),
    ("torch", torch.float32, 2, ("ring", "all_gather", "a2a"), (100, 0)),
], documents=True))
def test_packed_cp_on_one_gpu(backend, dtype, world, comms, window):
    _skip_unless(backend, dtype)
    reports = run_ranks(worker, world, backend, dtype, comms, window, "cuda", timeout=500)
    for comm in comms:
        worst = max(max(v for k, v in r[comm].items() if k != "dropped") for r in reports)
        dropped = max(r[comm]["dropped"] for r in reports)
        print(f"{backend} cp={world} {comm} window={window}: worst rel err {worst:.3g}, "
              f"boundaries dropped: {dropped:.3g}")
        assert dropped > 0.1, f"{backend} {comm}: the boundaries-dropped control is too weak"


@pytest.mark.parametrize("backend", with_kernels(["fa4", "fa2", "flex"], documents=True))
@pytest.mark.parametrize("world,comms,window", [
    pytest.param(2, ("ring", "all_gather", "a2a", "auto"), None, marks=pytest.mark.multi_gpu(2)),
    pytest.param(4, ("ring", "all_gather", "a2a", "a2a+p2p", "auto"), (100, 0),
                 marks=pytest.mark.multi_gpu(4)),
])
@pytest.mark.nccl
def test_packed_cp_over_nccl(backend, world, comms, window):
    """Rank r on GPU r over NCCL (the production transport), packed documents, every comm type."""
    _skip_unless(backend, torch.bfloat16)
    reports = run_ranks(worker, world, backend, torch.bfloat16, comms, window, "cuda", timeout=400,
                        backend="nccl")
    for comm in comms:
        dropped = max(r[comm]["dropped"] for r in reports)
        print(f"{backend} nccl cp={world} {comm} window={window}: boundaries dropped {dropped:.3g}")
        assert dropped > 0.1, f"{backend} {comm}: the boundaries-dropped control is too weak"
