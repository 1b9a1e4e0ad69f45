"""GPU markers: the one skip rule (gpu_skip_reason, applied by tests/conftest.py) and kernel marks
for parametrized GPU tests: a parameter naming fa4, fa2 or flex carries that
kernel's marker, so `pytest -m fa4` selects its cases and tests/conftest.py skips them with the
kernel probe's reason where the kernel cannot run. Test ids stay those of the plain values."""
import functools

import pytest
import torch

KERNEL_MARKS = ("fa4", "fa2", "flex")


def kernel_marks(name, **spec):
    return [getattr(pytest.mark, name)(**spec)] if name in KERNEL_MARKS else []


def with_kernels(values, **spec):
    """parametrize values with each kernel's marker: a value is a kernel name, or a tuple whose
    first item is one (`("fa4", 2)`); `spec` goes to the marker (e.g. documents=True)."""
    out = []
    for v in values:
        name = v[0] if isinstance(v, tuple) else v
        args = v if isinstance(v, tuple) else (v,)
        out.append(pytest.param(*args, marks=kernel_marks(name, **spec)))
    return out


# ---- GPU tests: one rule for the markers `gpu`, `fa4`, `fa2`, `flex`, `nccl`, `multi_gpu(n)`
# (registered in pyproject.toml; tests/markers.py marks kernel parameters). A test whose GPU,
# GPU count, NCCL or kernel is missing here is skipped with the reason, so `pytest -m gpu` runs
# everything this machine can and says why the rest did not run.

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
