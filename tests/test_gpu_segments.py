"""GPU: kernels with document segments (segments=) against the float64 reference, on CUDA:
the torch kernel, flex's compiled forward AND backward (CPU covers flex's forward only), and
fa2's and fa4's real varlen functions where they are installed. Marked `gpu`: skipped without
CUDA, and each kernel's cases without that kernel."""
import pytest
import torch
from markers import with_kernels

from cp_softcap.kernels import get_kernel
from cp_softcap.kernels.flex import FlexKernel
from cp_softcap.kernels.torch_kernel import TorchKernel
from segment_checks import SEGMENT_CASES, SEGMENT_IDS, check_segmented

pytestmark = pytest.mark.gpu
CAPS = [50.0, 1.0, 30.0, 5.0]
DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("ci", range(len(SEGMENT_CASES)), ids=SEGMENT_IDS)
def test_torch_kernel_segments_cuda(ci):
    cu_q, cu_k, window, _ = SEGMENT_CASES[ci]
    check_segmented(TorchKernel(block_q=16, block_k=24), (cu_q, cu_k), window, softcap=CAPS[ci % 4],
                    dtype=torch.float32, device="cuda")


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("ci", range(len(SEGMENT_CASES)), ids=SEGMENT_IDS)
@pytest.mark.flex
def test_flex_segments_cuda(ci, dtype):
    cu_q, cu_k, window, _ = SEGMENT_CASES[ci]
    check_segmented(FlexKernel(), (cu_q, cu_k), window, softcap=CAPS[ci % 4], dtype=dtype,
                    hkv=1 + ci % 2, device="cuda")


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("ci", range(len(SEGMENT_CASES)), ids=SEGMENT_IDS)
@pytest.mark.fa2(documents=True)
def test_fa2_varlen_cuda(ci, dtype):
    fa2 = get_kernel("fa2")
    if fa2._interface() is None:
        pytest.skip(fa2._reason)
    cu_q, cu_k, window, _ = SEGMENT_CASES[ci]
    check_segmented(fa2, (cu_q, cu_k), window, softcap=CAPS[ci % 4], dtype=dtype, hkv=1 + ci % 2,
                    device="cuda")


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("ci", range(len(SEGMENT_CASES)), ids=SEGMENT_IDS)
@pytest.mark.fa4
def test_fa4_varlen_cuda(ci, dtype, d):
    """FA4's varlen entry points with our score_mod softcap (sm90) or its own (elsewhere):
    every segment case (length-1 documents, empty segments, windows narrower and wider than the
    documents, rows that see nothing), GQA, head dims 64/128/256, with the negative control."""
    fa4 = get_kernel("fa4")
    if fa4._interface() is None:
        pytest.skip(fa4._import_reason)
    cu_q, cu_k, window, _ = SEGMENT_CASES[ci]
    check_segmented(fa4, (cu_q, cu_k), window, softcap=CAPS[ci % 4], dtype=dtype, hq=4,
                    hkv=1 + ci % 2, d=d, b=1 + (ci + d // 64) % 2, device="cuda")


@pytest.mark.parametrize("heads", [(16, 8, 256), (32, 16, 128)], ids=["9B", "27B"])
@pytest.mark.parametrize("window", [(None, 0), (63, 0), (4095, 0), (None, None)],
                         ids=["causal", "w63", "w4095", "full"])
@pytest.mark.fa4
def test_fa4_varlen_gemma2_heads_long_documents(heads, window):
    """Gemma2 head shapes, documents spanning many kernel tiles next to length-1 ones, a window
    narrower (63) and wider (4095) than most documents, softcap 50 (saturating); fully visible
    documents too (a ring's received blocks: at head dim 128 fa4 runs them on windowed tiles)."""
    fa4 = get_kernel("fa4")
    if fa4._interface() is None:
        pytest.skip(fa4._import_reason)
    hq, hkv, d = heads
    cu = (0, 1, 700, 701, 2000, 2001, 2300, 3000)
    check_segmented(fa4, (cu, cu), window, softcap=50.0, dtype=torch.bfloat16, hq=hq, hkv=hkv, d=d,
                    device="cuda")


@pytest.mark.fa4
def test_fa4_varlen_many_segments_and_deterministic():
    """More than 256 sequences in one varlen call (FA4 switches to another scheduler there: a
    packed run's diagonal call holds all its documents), batch 2, length-1 and empty segments;
    then the same call under deterministic algorithms twice: bitwise equal gradients."""
    import random
    fa4 = get_kernel("fa4")
    if fa4._interface() is None:
        pytest.skip(fa4._import_reason)
    rng = random.Random(7)
    cu = [0]
    for i in range(160):
        cu.append(cu[-1] + (0 if i % 37 == 5 else 1 if i % 5 == 0 else rng.randint(2, 40)))
    cu = tuple(cu)
    check_segmented(fa4, (cu, cu), (15, 0), softcap=30.0, dtype=torch.bfloat16, hq=8, hkv=2, d=128,
                    b=2, device="cuda")
    from segment_checks import inputs, run_kernel
    q, k, v, dout, _ = inputs((cu, cu), 8, 2, 128, torch.bfloat16, 30.0, b=2, device="cuda")
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = [run_kernel(fa4, q, k, v, dout, scale=128 ** -0.5, softcap=30.0, window=(15, 0),
                           segments=(cu, cu))[2] for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(prev)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("backend", with_kernels(["fa4", "fa2", "flex", "auto"], documents=True))
def test_packed_attention_cuda(backend):
    """cps.attention(cu_seqlens=) on CUDA in bf16: documents of length 1, shorter and longer than
    a kernel tile, a window, a padding tail; float64 reference of the whole stream."""
    import cp_softcap as cps
    from cp_softcap.testing import reference_attention, rel_err, saturating_qkv, tolerance
    if backend == "fa2" and get_kernel("fa2")._interface() is None:
        pytest.skip(get_kernel("fa2")._reason)
    if backend == "fa4" and get_kernel("fa4")._interface() is None:
        pytest.skip(get_kernel("fa4")._import_reason)
    cu, t = [0, 1, 40, 300, 301, 700], 760
    q, k, v, _ = saturating_qkv(1, t, t, 8, 2, 128, torch.bfloat16, 50.0, device="cuda")
    dout = torch.randn(1, t, 8, 128, device="cuda", dtype=torch.bfloat16)
    out = cps.attention(q, k, v, softcap=50.0, window=(127, 0), cu_seqlens=cu, backend=backend)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [x.detach().cpu().double().requires_grad_() for x in (q, k, v)]
    ref, _ = reference_attention(*leaves, cu_seqlens=cu, softcap=50.0, causal=True, window=(127, 0))
    ref_grads = torch.autograd.grad(ref, leaves, dout.cpu().double())
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    assert rel_err(out.cpu(), ref) <= tolerance(torch.bfloat16, "out")
    for g, r in zip(grads, ref_grads):
        assert rel_err(g.cpu(), r) <= tolerance(torch.bfloat16, "grad_exact")
    assert bool((out[:, 700:] == 0).all()) and all(bool((g[:, 700:] == 0).all()) for g in grads[:1])
