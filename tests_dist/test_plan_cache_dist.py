"""The raw-call plan cache (plan_cache.CALLS) under CP: a warm call is never run on a plan that the
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


def _hf_group_worker(rank, world, mesh_pair):
    import gc
    import weakref
    import numpy as np
    import torch.distributed as dist
    import cp_softcap as cps
    from cp_softcap.integrations.hf import cp_softcap_attention, use_cp_group
    group = dist.new_group(list(range(world)))
    if mesh_pair:
        a2a, ring = cps.make_hybrid_groups(group, 2)
        refs, comm, arg = [weakref.ref(g) for g in (a2a, ring)], "a2a+p2p", (a2a, ring)
    else:
        refs, comm, arg = [weakref.ref(group)], "ring", group
    use_cp_group(arg, comm=comm)
    s = 8 * world
    pos = cps.sharding.positions(s, world, rank, cu_seqlens=[0, 5, s])[None]
    shard = lambda t: cps.sharding.shard(t.transpose(1, 2), world, rank, cu_seqlens=[0, 5, s])  # noqa: E731
    q, k, v = (shard(torch.randn(1, 4, s, 8)).transpose(1, 2).requires_grad_() for _ in range(3))
    for _ in range(2):      # a new, equal NumPy array each call with the same position_ids
        cu = np.array([0, 5, s])
        out, _ = cp_softcap_attention(None, q, k, v, softcap=30.0, position_ids=pos, cu_seqlens=cu)
        out.sum().backward()
    for g in ([a2a, ring] if mesh_pair else []) + [group]:
        dist.destroy_process_group(g)
    del g, group, arg, out
    if mesh_pair:
        del a2a, ring
    gc.collect()
    freed = [r() is None for r in refs]
    try:
        cp_softcap_attention(None, q, k, v, softcap=30.0, position_ids=pos)
        message = "ran"
    except RuntimeError as e:
        message = str(e)
    use_cp_group(None)
    return freed, message


def test_hf_use_cp_group_does_not_keep_the_group_alive():
    """use_cp_group holds the group (or the a2a+p2p pair) weakly: destroyed and dropped, it is
    freed, and a later attention call says the configured group is gone instead of running on
    one device. The calls also pass NumPy cu_seqlens with reused position_ids (the position
    check must not compare arrays by truth value)."""
    for mesh_pair in (False, True):
        for freed, message in run_ranks(_hf_group_worker, 4, mesh_pair):
            assert all(freed), (mesh_pair, freed)
            assert "set by cp_softcap.integrations.hf.use_cp_group no longer exists" in message, message


def _growing_worker(rank, world):
    import torch.distributed as dist
    import cp_softcap as cps
    from cp_softcap import plan_cache
    plan_cache.MAX_CALL_PLANS = 8             # the bound, made small for the test
    for n in range(1, 21):                  # a local length that changes every call
        q = torch.randn(1, 2 * n, 2, 8)
        cps.cp_attention(q, q, q, dist.group.WORLD, softcap=30.0, comm="ring")
    return len(plan_cache.PLANS[dist.group.WORLD]), len(plan_cache.CALLS[dist.group.WORLD])


def test_plan_caches_stay_bounded_under_cp_when_shapes_keep_changing():
    for plans, calls in run_ranks(_growing_worker, 2):
        assert plans <= 8 and calls <= 8, (plans, calls)


def _non_member_worker(rank, world):
    import torch.distributed as dist
    from cp_softcap.integrations.hf import use_cp_group
    group = dist.new_group([0])
    try:
        use_cp_group(group)
    except ValueError as e:
        return str(e)
    finally:
        use_cp_group(None)
    return "accepted"


def test_hf_use_cp_group_refuses_a_group_this_rank_is_not_in():
    messages = run_ranks(_non_member_worker, 2)
    assert messages[0] == "accepted" and "is not a member of the process group" in messages[1], messages
