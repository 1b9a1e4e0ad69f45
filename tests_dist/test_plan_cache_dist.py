"""The raw-call plan cache (plan._CALLS) under CP: a warm call is never run on a plan that the
full planning would refuse."""
import torch

from harness import run_ranks


def _destroyed_worker(rank, world):
    import torch.distributed as dist
    import cp_softcap as cps
    attn = cps.CPAttention(dist.group.WORLD, softcap=30.0, comm="ring")
    q, k, v = (torch.randn(1, 8, 2, 8, requires_grad=True) for _ in range(3))
    attn(q, k, v).sum().backward()          # warm: the raw-call cache holds this call's plan
    attn(q, k, v).sum().backward()
    dist.destroy_process_group()
    try:
        attn(q, k, v)
    except RuntimeError as e:
        return str(e)
    return "ran"


def test_warm_call_after_destroy_process_group_fails_as_a_cold_one():
    """After destroy_process_group() a warm call raises the library's error (as the first call
    of that signature would), not whatever the destroyed group does when used; also on a group
    of one rank, whose plan is a one-device plan."""
    for world in (2, 1):
        for message in run_ranks(_destroyed_worker, world):
            assert "torch.distributed is not initialised" in message, (world, message)


def _freed_worker(rank, world):
    import gc
    import weakref
    import torch.distributed as dist
    import cp_softcap as cps
    group = dist.new_group(list(range(world)))
    a2a, ring = cps.make_hybrid_groups(group, 2)
    refs = [weakref.ref(g) for g in (group, a2a, ring)]
    q, k, v = (torch.randn(1, 16, 4, 8, requires_grad=True) for _ in range(3))
    for comm, g in (("ring", group), ("all_gather", group), ("a2a", group), ("auto", group),
                    ("a2a+p2p", (a2a, ring))):
        for _ in range(2):                  # cold, then warm (the raw-call cache)
            cps.cp_attention(q, k, v, g, softcap=30.0, comm=comm).sum().backward()
    cps.cp_attention(q, k, v, group, softcap=30.0, cu_seqlens=[0, 5, 16 * world]).sum().backward()
    for g in (a2a, ring, group):
        dist.destroy_process_group(g)
    del g, group, a2a, ring
    gc.collect()
    return [r() is None for r in refs]


def test_groups_are_freed_once_the_user_drops_them():
    """The plan caches hold their groups weakly: a group that ran CP calls of every comm type
    (cold and warm, packed too) is freed once destroyed and dropped. A group kept alive by the
    caches leaked, and with gloo its late destruction at interpreter exit could abort the
    process after a successful run."""
    for freed in run_ranks(_freed_worker, 4):
        assert freed == [True, True, True], freed


def _backward_after_destroy_worker(rank, world):
    import gc
    import torch.distributed as dist
    import cp_softcap as cps
    group = dist.new_group(list(range(world)))
    q, k, v = (torch.randn(1, 8, 2, 8, requires_grad=True) for _ in range(3))
    out = cps.cp_attention(q, k, v, group, softcap=30.0, comm="ring")
    dist.destroy_process_group(group)
    del group
    gc.collect()
    try:
        out.sum().backward()
    except RuntimeError as e:
        return str(e)
    return "ran"


def test_backward_after_its_group_is_gone_says_so():
    for message in run_ranks(_backward_after_destroy_worker, 2):
        assert "process group of this attention call no longer exists" in message, message
