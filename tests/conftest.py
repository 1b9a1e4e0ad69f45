import functools
import os
import zlib

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one intra-op thread per xdist worker: `-n 2` on 2 cores with 2 threads each oversubscribes
    # (measured: twice the CPU time for the same tests)
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """Fresh random inputs per case (a different seed per test id), reproducible across runs."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield


# ---- GPU tests: one rule for the markers `gpu`, `fa4`, `fa2`, `flex`, `nccl`, `multi_gpu(n)`
# (registered in pyproject.toml; tests/markers.py marks kernel parameters). A test whose GPU,
# GPU count, NCCL or kernel is missing here is skipped with the reason, so `pytest -m gpu` runs
# everything this machine can and says why the rest did not run.

KERNEL_MARKS = ("fa4", "fa2", "flex")
GPU_MARKS = ("gpu", "nccl", "multi_gpu") + KERNEL_MARKS


@functools.lru_cache(maxsize=None)
def _kernel_reason(name, spec_items):
    """The kernel's own probe on a CUDA bf16 spec (softcap, GQA, backward; a marker's keywords,
    e.g. documents=True, override the defaults): None if it can run here, else why not."""
    from cp_softcap.kernels import get_kernel
    from cp_softcap.spec import make_spec
    spec = dict(head_dim=128, num_heads=4, num_kv_heads=2, dtype=torch.bfloat16,
                device_type="cuda", softcap=30.0, causal=True)
    spec.update(spec_items)
    try:
        return get_kernel(name).probe(make_spec(**spec))
    except Exception as e:          # a probe that raises cannot run the kernel either
        return f"probe failed: {type(e).__name__}: {e}"


def gpu_skip_reason(item):
    """Why `item` cannot run on this machine under its GPU markers, or None."""
    names = {m.name for m in item.iter_markers()}
    if not names & set(GPU_MARKS):
        return None
    if not torch.cuda.is_available():
        return "needs a CUDA GPU: torch.cuda.is_available() is False here"
    have = torch.cuda.device_count()
    for mark in item.iter_markers("multi_gpu"):
        need = mark.args[0] if mark.args else 2
        if have < need:
            return f"needs {need} GPUs (one rank per GPU), this machine has {have}"
    if "nccl" in names:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_nccl_available()):
            return "needs NCCL, which this torch build does not have"
    for name in KERNEL_MARKS:
        for mark in item.iter_markers(name):
            reason = _kernel_reason(name, tuple(sorted(mark.kwargs.items())))
            if reason:
                return f"{name}: {reason}"
    return None


def pytest_runtest_setup(item):
    reason = gpu_skip_reason(item)
    if reason:
        pytest.skip(reason)
