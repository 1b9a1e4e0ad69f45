"""cp/auto.py's byte model == what the comm layer counts (comm.counting()) on real gloo ranks:
every op of every rank, forward and backward, for ring (causal, windows narrower than / crossing
a chunk, two-sided, no mask; one step per block and default blocks), all_gather, a2a (with KV
heads replicated) and a2a+p2p. Tiny shapes, the real kernels."""
import pytest
import torch

from harness import run_ranks

CP = 4
C = 8                         # tokens per zigzag chunk; S = 2 * CP * C
CASES = [
    # (comm, a2a_size, causal, window, hq, hkv, dtype)
    ("ring", None, True, None, 4, 2, torch.bfloat16),
    ("ring", None, True, (C // 2 - 1, 0), 4, 2, torch.float32),
    ("ring", None, True, (C + 3, 0), 4, 2, torch.bfloat16),
    ("ring", None, False, (C + 1, C // 2), 4, 2, torch.float32),
    ("ring", None, False, None, 4, 1, torch.float32),
    ("all_gather", None, True, (C + 3, 0), 4, 2, torch.bfloat16),
    ("a2a", None, True, None, 8, 2, torch.bfloat16),          # 2 KV heads over 4 ranks: replicated
    ("a2a+p2p", 2, True, None, 4, 2, torch.bfloat16),
    ("a2a+p2p", 2, True, (C + 3, 0), 4, 1, torch.float32),
]


def _worker(rank, world):
    import torch.distributed as dist
    import cp_softcap as cps
    from cp_softcap.comm import counting
    hybrid = cps.make_hybrid_groups(None, 2)
    out = []
    for i, (comm, a2a, causal, window, hq, hkv, dtype) in enumerate(CASES):
        g = torch.Generator().manual_seed(100 * i + rank)
        n = 2 * C
        q, k, v = (torch.randn(2, n, h, 8, generator=g).to(dtype).requires_grad_() for h in (hq, hkv, hkv))
        with counting() as fwd:
            o = cps.cp_attention(q, k, v, hybrid if comm == "a2a+p2p" else dist.group.WORLD,
                                 softcap=5.0, causal=causal, window=window, comm=comm)
        with counting() as bwd:
            o.backward(torch.randn(o.shape, generator=g).to(o.dtype))
        out.append({"fwd": dict(fwd.sent), "bwd": dict(bwd.sent)})
    return out


@pytest.mark.parametrize("block_keys", ["0", "16384"])
def test_model_equals_counted_bytes(block_keys):
    from cp_softcap.cp.auto import bytes_per_rank, sent_per_rank
    from cp_softcap.spec import make_spec
    measured = run_ranks(_worker, CP, env={"CP_SOFTCAP_RING_BLOCK_KEYS": block_keys})
    for i, (comm, a2a, causal, window, hq, hkv, dtype) in enumerate(CASES):
        spec = make_spec(head_dim=8, num_heads=hq, num_kv_heads=hkv, dtype=dtype, device_type="cpu",
                         softcap=5.0, causal=causal, window=window, cp_size=CP, comm=comm)
        model = sent_per_rank(spec, 2 * CP * C, comm, batch=2, a2a_size=a2a)
        for r in range(CP):
            got = measured[r][i]
            want = {ph: {op: b for op, b in model[r].items() if f".{ph}." in op} for ph in ("fwd", "bwd")}
            assert got == want, f"{CASES[i]} rank {r}: counted {got} != model {want}"
        busiest = max(sum(m[i]["fwd"].values()) + sum(m[i]["bwd"].values()) for m in measured)
        assert bytes_per_rank(spec, 2 * CP * C, batch=2, a2a_size=a2a)[comm] == busiest
