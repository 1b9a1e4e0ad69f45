"""Peak memory of a piece of work, on CPU or GPU, to check the memory plan against.

On GPU: torch.cuda.max_memory_allocated. On CPU there is no allocator counter, so the work runs
under torch.profiler with memory profiling and the peak is the largest running sum of the
allocations and frees it records (tensor memory only: the Python interpreter and libraries are
not counted), on top of `base`, the tensor bytes alive before the work started.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of distinct storages among `tensors` (views of one storage count once)."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _cpu_peak_delta(fn: Callable[[], object]) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    allocs = []

    def visit(node):
        if str(node.tag).endswith("Allocation"):
            allocs.append((node.start_time_ns, node.extra_fields.alloc_size))
        for child in node.children:
            visit(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        visit(root)
    now = peak = 0
    for _, size in sorted(allocs, key=lambda a: a[0]):
        now += size
        peak = max(peak, now)
    return peak


def peak_bytes(fn: Callable[[], object], device: torch.device, base: int = 0) -> int:
    """Peak tensor bytes while fn() runs: `base` (bytes alive before) + the largest growth."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    return base + _cpu_peak_delta(fn)
