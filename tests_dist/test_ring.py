"""Ring CP against the float64 reference of full attention (gloo on CPU)."""
import pytest
import torch

from cases import run_case
from harness import run_ranks

F32, BF16 = torch.float32, torch.bfloat16


def cases_for(cp: int):
    c = 8 if cp <= 4 else 4                  # tokens per chunk; S = 2 * cp * c
    s = 2 * cp * c
    base = dict(b=2, s=s, hq=4, hkv=2, d=16, dtype=F32)
    out = []
    for cap in (1.0, 5.0, 30.0, 50.0):
        out.append({**base, "softcap": cap, "causal": True})
    out += [
        {**base, "softcap": 5.0, "causal": False},
        {**base, "softcap": 30.0, "causal": True, "window": (c // 2 - 1, 0)},     # narrower than a chunk
        {**base, "softcap": 5.0, "causal": True, "window": (c + 3, 0)},           # crosses chunks
        {**base, "softcap": 5.0, "causal": False, "window": (c + 1, c // 2)},     # two-sided
        {**base, "softcap": 50.0, "causal": True, "scale": 0.05},
        {**base, "softcap": None, "causal": True, "hkv": 4},
        {**base, "softcap": 50.0, "causal": True, "dtype": BF16},
        {**base, "softcap": 5.0, "causal": True, "window": (c + 3, 0), "dtype": BF16},
        {**base, "softcap": 5.0, "causal": True, "hq": 4, "hkv": 1, "b": 1},
    ]
    return out


def _worker(rank, world, comm):
    return [run_case(case, seed=1000 + i, comm=comm) for i, case in enumerate(cases_for(world))]


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_ring_matches_float64_reference(world):
    results = run_ranks(_worker, world, "ring", timeout=240)
    worst = max(max(v for k, v in e.items() if k != "saturated") for r in results for e in r)
    print(f"cp={world}: worst max-relative error over all cases/ranks = {worst:.3g}")


def _determinism_worker(rank, world):
    import cp_softcap as cps
    from cp_softcap.sharding import shard
    outs = []
    for _ in range(2):
        torch.manual_seed(7)
        q, k, v = (torch.randn(1, 32, 4, 16) * 3 for _ in range(3))
        ql, kl, vl = (shard(t, world, rank).requires_grad_() for t in (q, k, v))
        out = cps.cp_attention(ql, kl, vl, torch.distributed.group.WORLD, softcap=5.0, window=(5, 0))
        out.sum().backward()
        outs.append([out.detach(), ql.grad, kl.grad, vl.grad])
    for a, b in zip(*outs):
        if not torch.equal(a, b):
            raise AssertionError("two identical runs differ bitwise")


def test_ring_is_deterministic():
    run_ranks(_determinism_worker, 4)
