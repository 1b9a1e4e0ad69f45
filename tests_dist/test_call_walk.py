"""The walk of one warm call (docs/layers.md): the library files a warm
CPAttention(comm="ring") forward and backward runs through on two gloo ranks, counted with
sys.setprofile. A new file on this path (a decision taken again per call, a return trip up
the layers) fails here and has to be argued in docs/layers.md."""
import torch

from harness import run_ranks

WARM_RING_WALK = {"api.py", "spec.py", "plan.py", "plan_cache.py", "export.py", "cp/guard.py",
                  "cp/ring.py", "calls.py", "kernels/torch_kernel.py", "kernels/base.py",
                  "merge.py", "transport.py"}


def _walk_worker(rank, world):
    import os
    import sys
    import threading
    import torch.distributed as dist
    import cp_softcap as cps
    attn = cps.CPAttention(dist.group.WORLD, softcap=30.0, comm="ring", backend="torch")
    q, k, v = (torch.randn(1, 64, 4, 16, requires_grad=True) for _ in range(3))
    for _ in range(2):                          # cold, then warm
        attn(q, k, v).sum().backward()
    root, files = os.path.dirname(cps.__file__), set()

    def profile(frame, event, arg):
        path = frame.f_code.co_filename
        if event == "call" and path.startswith(root):
            files.add(os.path.relpath(path, root).replace(os.sep, "/"))
    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        attn(q, k, v).sum().backward()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return files


def test_a_warm_ring_call_walks_the_documented_files():
    for files in run_ranks(_walk_worker, 2):
        assert files == WARM_RING_WALK, (f"new on the walk: {sorted(files - WARM_RING_WALK)}; "
                                         f"gone from it: {sorted(WARM_RING_WALK - files)}")
