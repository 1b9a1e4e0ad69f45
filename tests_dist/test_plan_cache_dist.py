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
