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


# The cases that exercise different block geometry: causal (half-size messages, coalesced),
# non-causal (full steps coalesced), windows narrower than a chunk / crossing chunks / two-sided
# (windowed calls between coalesced ones, skipped steps), and bf16 with a window.
BLOCK_SUBSET = (2, 4, 5, 6, 7, 11)


def _worker(rank, world, comm, subset=None):
    from cp_softcap.layout import ring_blocks
    from cp_softcap.settings import ring_block_keys
    blocks = ring_blocks(world, cases_for(world)[0]["s"] // world, ring_block_keys())
    return blocks, [run_case(case, seed=1000 + i, comm=comm) for i, case in enumerate(cases_for(world))
                    if subset is None or i in subset]


def _block_keys(world: int, steps: int) -> str:
    """CP_SOFTCAP_RING_BLOCK_KEYS giving blocks of `steps` ring steps on this test's shapes."""
    return str(steps * cases_for(world)[0]["s"] // world)


# (CP_SOFTCAP_RING_BLOCK_KEYS or None for the default, world, expected ring blocks, cases).
# Default (every case): these shapes are far below settings.DEFAULT_RING_BLOCK_KEYS, so all steps form
# one block and fully visible steps run as one call over concatenated keys.
# "0" and "1" key: one step per block (cp 2 is that under any setting), so block i+1's K/V and
# block i's dK/dV are in flight while block i computes. 2 steps: multi-step blocks AND several
# blocks (the last one short). These run BLOCK_SUBSET only ("1": its windowed cases only).
BLOCKINGS = [(None, w, (tuple(range(1, w)),) if w > 1 else (), None) for w in (1, 2, 4, 8)] + [
    ("0", 4, ((1,), (2,), (3,)), BLOCK_SUBSET),
    ("1", 4, ((1,), (2,), (3,)), (5, 7)),
    (_block_keys(4, 2), 4, ((1, 2), (3,)), BLOCK_SUBSET),
    (_block_keys(8, 2), 8, ((1, 2), (3, 4), (5, 6), (7,)), BLOCK_SUBSET),
]


@pytest.mark.parametrize("keys,world,blocks,subset", BLOCKINGS,
                         ids=[f"cp{w}-keys{k or 'default'}" for k, w, _, _ in BLOCKINGS])
def test_ring_matches_float64_reference(keys, world, blocks, subset):
    # "" is the default (settings.DEFAULT_RING_BLOCK_KEYS), also when the caller's shell exports another value
    env = {"CP_SOFTCAP_RING_BLOCK_KEYS": "" if keys is None else keys}
    results = run_ranks(_worker, world, "ring", subset, timeout=240, env=env)
    for got, _ in results:               # the env reached the ring: the blocks it used
        assert got == blocks, (got, blocks)
    worst = max(max(v for k, v in e.items() if k != "saturated") for _, r in results for e in r)
    print(f"cp={world} keys={keys or 'default'}: worst max-relative error over all cases/ranks = {worst:.3g}")


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
