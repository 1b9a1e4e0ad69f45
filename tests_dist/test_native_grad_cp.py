"""Ring, all_gather and a2a backward with a kernel whose gradient partials come in bf16 (like the
flash-attn family, caps.grads_in_input_dtype), on CPU: GradAccumulator must widen them while adding, and
the result must still match the float64 reference of full attention (gloo on CPU)."""
import pytest
import torch

from cases import native_standin, run_case
from harness import run_ranks

CAPS = (1.0, 30.0)   # saturating_qkv scales the logits to ~4x the cap: tanh saturates for both


def _worker(rank, world, comm):
    from cp_softcap import merge
    kernel = native_standin()
    bf16_adds, real_add = [0], merge.GradAccumulator.add

    def add(self, lo, hi, grad):        # count the 16-bit partials the accumulator widens
        bf16_adds[0] += grad.dtype == torch.bfloat16
        real_add(self, lo, hi, grad)
    merge.GradAccumulator.add = add

    base = dict(b=2, s=2 * world * 8, hq=4, hkv=2, d=16, dtype=torch.bfloat16, causal=True)
    # (10, 0) at 8-token chunks: at cp 4 two ranks' blocks are exclusive (bf16 returns) and two
    # are not (float32 returns), so owners receive both dtypes in one block
    cases = [{**base, "softcap": cap} for cap in CAPS] + [{**base, "softcap": 30.0, "window": (10, 0)}]
    errs = [run_case(case, seed=3000 + i, comm=comm, backend=kernel) for i, case in enumerate(cases)]
    calls = kernel.calls
    # ring / all_gather: every kernel partial reached an accumulator in bf16; the ring's owners
    # also add the bf16 dK/dV partials returned by causal (exclusive) blocks, all_gather
    # reduce-scatters float32. a2a sends the bf16 gradients through the all-to-all (its bytes
    # are checked in test_comm_model_dist.py) and uses no accumulator.
    returned = bf16_adds[0] - 3 * calls
    want = {"ring": returned > 0, "all_gather": returned == 0, "a2a": bf16_adds[0] == 0}[comm]
    assert calls > 0 and want, (calls, bf16_adds[0])
    return errs


@pytest.mark.parametrize("comm,world", [("ring", 2), ("ring", 4), ("all_gather", 2),
                                        ("all_gather", 4), ("a2a", 2), ("a2a", 4)])
def test_bf16_partials_match_float64_reference(comm, world):
    results = run_ranks(_worker, world, comm, timeout=120)
    for i, cap in enumerate(CAPS + (30.0,)):
        worst = {k: max(r[i][k] for r in results) for k in results[0][i]}
        print(f"{comm} cp={world} cap={cap}: " + " ".join(f"{k}={v:.3g}" for k, v in worst.items()))


def _bitwise_worker(rank, world):
    """The ring's gradients with bf16 dK/dV returns vs the same run forced to return float32."""
    import os

    import torch.distributed as dist

    import cp_softcap as cps
    from cp_softcap.cp import ring
    from cp_softcap.sharding import shard
    kernel = native_standin()
    exact_return, bf16_blocks = ring.return_dtype, [0]

    def counted(*args):
        dt = exact_return(*args)
        bf16_blocks[0] += dt == torch.bfloat16
        return dt
    same = []
    for i, (causal, window) in enumerate([(True, None), (True, (10, 0)), (False, (7, 3))]):
        for keys in ("0", str(1 << 20)):
            os.environ["CP_SOFTCAP_RING_BLOCK_KEYS"] = keys
            torch.manual_seed(i)
            q, dout = (torch.randn(2, 16 * world, 4, 16).to(torch.bfloat16) for _ in range(2))
            k, v = (torch.randn(2, 16 * world, 2, 16).to(torch.bfloat16) for _ in range(2))
            grads = []
            for returns in (counted, lambda partial, acc, *_: acc):
                ring.return_dtype = returns
                local = [shard(t, world, rank).requires_grad_() for t in (q, k, v)]
                out = cps.cp_attention(*local, dist.group.WORLD, backend=kernel, softcap=30.0,
                                       causal=causal, window=window)
                out.backward(shard(dout, world, rank))
                grads.append([t.grad for t in local])
            same.append(all(torch.equal(a, b) for a, b in zip(*grads)))
    return same, bf16_blocks[0]


def test_bf16_returns_are_bitwise_the_float32_returns():
    """What the ring's docstring claims: returning an exclusive block's bf16 partial and widening
    it at the owner gives exactly the sums of sending a float32 copy (ring, cp 4, causal and
    windowed, one step per block and one block of all steps)."""
    for same, bf16_blocks in run_ranks(_bitwise_worker, 4, timeout=120):
        assert all(same) and bf16_blocks > 0, (same, bf16_blocks)
