"""comm_model.py's byte model == what the transport counts (transport.counting()) on real gloo ranks:
every op of every rank, forward and backward, for ring (causal, windows narrower than / crossing
a chunk, two-sided, no mask; one step per block and default blocks), all_gather, a2a (with KV
heads replicated) and a2a+p2p. Tiny shapes, the real kernels. NATIVE_CASES run the same with a
native-gradient stand-in (bf16 dK/dV partials, as the flash-attn family returns them): the
ring returns exclusive blocks' dK/dV in bf16, modelled with partial_bytes=2."""
import pytest
import torch

from cases import native_standin
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


NATIVE_CASES = [
    # at cp 4, chunk 8, window (C + 3, 0) ranks 2 and 3 have a non-exclusive source (float32
    # dK/dV for that block), (C + 1, C // 2) makes most sources non-exclusive; float32 inputs
    # give float32 partials even from a native-gradient kernel
    ("ring", None, True, None, 4, 2, torch.bfloat16),
    ("ring", None, True, (C + 3, 0), 4, 2, torch.bfloat16),
    ("ring", None, False, (C + 1, C // 2), 4, 2, torch.bfloat16),
    ("ring", None, False, None, 4, 1, torch.bfloat16),
    ("ring", None, True, None, 4, 2, torch.float32),
    ("all_gather", None, True, (C + 3, 0), 4, 2, torch.bfloat16),
    ("a2a", None, True, None, 8, 2, torch.bfloat16),
    ("a2a+p2p", 2, True, None, 4, 2, torch.bfloat16),
    ("a2a+p2p", 2, True, (C + 3, 0), 4, 1, torch.bfloat16),
]


def _worker(rank, world, cases, native):
    import torch.distributed as dist
    import cp_softcap as cps
    from cp_softcap.transport import counting
    backend = "auto"
    if native:
        backend = kernel = native_standin()
    hybrid = cps.make_hybrid_groups(None, 2)
    out = []
    for i, (comm, a2a, causal, window, hq, hkv, dtype) in enumerate(cases):
        g = torch.Generator().manual_seed(100 * i + rank)
        n = 2 * C
        q, k, v = (torch.randn(2, n, h, 8, generator=g).to(dtype).requires_grad_() for h in (hq, hkv, hkv))
        with counting() as fwd:
            o = cps.cp_attention(q, k, v, hybrid if comm == "a2a+p2p" else dist.group.WORLD,
                                 softcap=5.0, causal=causal, window=window, comm=comm, backend=backend)
        with counting() as bwd:
            o.backward(torch.randn(o.shape, generator=g).to(o.dtype))
        out.append({"fwd": dict(fwd.sent), "bwd": dict(bwd.sent)})
    if native:
        assert type(kernel).calls > 0, "the native-gradient stand-in was not used"
    return out


@pytest.mark.parametrize("block_keys", ["0", "16384"])
@pytest.mark.parametrize("native", [False, True], ids=["float32_partials", "native_partials"])
def test_model_equals_counted_bytes(block_keys, native):
    from cp_softcap.comm_model import bytes_per_rank, sent_per_rank
    from cp_softcap.spec import make_spec
    cases = NATIVE_CASES if native else CASES
    measured = run_ranks(_worker, CP, cases, native, env={"CP_SOFTCAP_RING_BLOCK_KEYS": block_keys})
    for i, (comm, a2a, causal, window, hq, hkv, dtype) in enumerate(cases):
        spec = make_spec(head_dim=8, num_heads=hq, num_kv_heads=hkv, dtype=dtype, device_type="cpu",
                         softcap=5.0, causal=causal, window=window, cp_size=CP, comm=comm)
        # what the plan passes to choose_comm: None = gradient bytes (the torch kernel); the
        # native stand-in's partials have the input dtype (Kernel.partial_dtype)
        kw = dict(partial_bytes=dtype.itemsize if native else None,
                  block_keys=int(block_keys))
        model = sent_per_rank(spec, 2 * CP * C, comm, batch=2, a2a_size=a2a, **kw)
        for r in range(CP):
            got = measured[r][i]
            want = {ph: {op: b for op, b in model[r].items() if f".{ph}." in op} for ph in ("fwd", "bwd")}
            assert got == want, f"{cases[i]} rank {r}: counted {got} != model {want}"
        busiest = max(sum(m[i]["fwd"].values()) + sum(m[i]["bwd"].values()) for m in measured)
        assert bytes_per_rank(spec, 2 * CP * C, batch=2, a2a_size=a2a, **kw)[comm] == busiest
