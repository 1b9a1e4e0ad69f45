"""The kernel contract's segments= (packed documents): helpers, and the torch kernel against
the float64 reference with document masks (tests/segment_checks.py)."""
import pytest
import torch

from cp_softcap.doc_geometry import DocCall, stream_calls
from cp_softcap.kernels.base import Segments, check_segments, segment_ids
from cp_softcap.kernels.torch_kernel import TorchKernel, segment_block_visible
from segment_checks import SEGMENT_CASES, SEGMENT_IDS, call_mask, check_segmented, inputs, run_kernel

SMALL_BLOCKS = TorchKernel(block_q=16, block_k=24)
CAPS = [1.0, 5.0, 30.0, 50.0]


@pytest.mark.parametrize("case", SEGMENT_CASES, ids=SEGMENT_IDS)
def test_segment_ids_match_doc_call(case):
    cu_q, cu_k, window, _ = case
    call = DocCall(0, cu_q[-1], 0, cu_k[-1], window, cu_q, cu_k)
    for mine, theirs in zip(segment_ids(Segments(cu_q, cu_k)), call.token_ids()):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("case", SEGMENT_CASES, ids=SEGMENT_IDS)
def test_block_skip_is_exact(case):
    cu_q, cu_k, window, _ = case
    mask = call_mask((cu_q, cu_k), window)
    for q0 in range(0, cu_q[-1], 5):
        for k0 in range(0, cu_k[-1], 7):
            q1, k1 = min(q0 + 5, cu_q[-1]), min(k0 + 7, cu_k[-1])
            want = bool(mask[q0:q1, k0:k1].any())
            assert segment_block_visible(Segments(cu_q, cu_k), window, q0, q1, k0, k1) == want


@pytest.mark.parametrize("bad,match", [
    (((0, 8), (0, 4, 8)), "row ranges"), (((1, 8), (0, 8)), "cu_q"), (((0, 8), (0, 9)), "cu_k"),
    (((0, 6, 4, 8), (0, 2, 4, 8)), "never decreasing"), ((3, 4), "pair of int sequences")])
def test_bad_segments_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        check_segments(bad, 8, 8, "torch")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("ci", range(len(SEGMENT_CASES)), ids=SEGMENT_IDS)
def test_torch_kernel_segments(ci, dtype):
    cu_q, cu_k, window, _ = SEGMENT_CASES[ci]
    softcap = CAPS[ci % len(CAPS)]
    hq, hkv = (4, 2) if ci % 2 else (3, 1)          # GQA and MQA
    check_segmented(SMALL_BLOCKS, (cu_q, cu_k), window, softcap=softcap, dtype=dtype, hq=hq, hkv=hkv,
                    b=1 + ci % 2)


def test_torch_kernel_segments_bf16_no_softcap():
    cu_q, cu_k, window, _ = SEGMENT_CASES[1]
    check_segmented(SMALL_BLOCKS, (cu_q, cu_k), window, softcap=None, dtype=torch.bfloat16)


@pytest.mark.parametrize("window", [(None, 0), (6, 0), (None, None)])
def test_one_segment_is_the_unsegmented_call_bitwise(window):
    q, k, v, dout, _ = inputs(((0, 40), (0, 56)), 4, 2, 16, torch.float32, 5.0)
    kw = dict(scale=0.25, softcap=5.0, window=window)
    plain = run_kernel(SMALL_BLOCKS, q, k, v, dout, segments=None, **kw)
    one = run_kernel(SMALL_BLOCKS, q, k, v, dout, segments=((0, 40), (0, 56)), **kw)
    for a, b in zip((plain[0], plain[1], *plain[2]), (one[0], one[1], *one[2])):
        assert torch.equal(a, b)


def test_stream_calls_of_a_packed_stream():
    """DocCalls of a packed stream (one call per fused group, padding tail in no call) through
    the kernel: every call matches the reference of its own mask."""
    cu, seq_len = (0, 1, 9, 40, 41, 70), 76
    for window in ((None, 0), (4, 0)):
        calls = stream_calls(cu, seq_len, window)
        assert any(c.segments > 1 for c in calls)
        for c in calls:
            if c.segments > 1:
                check_segmented(SMALL_BLOCKS, (c.cu_q, c.cu_k), c.window, softcap=30.0,
                                dtype=torch.float64)


def test_selector_routes_packed_calls_to_segment_kernels():
    from cp_softcap.selector import clear_cache, select
    from cp_softcap.spec import make_spec
    clear_cache()
    spec = make_spec(head_dim=16, num_heads=4, num_kv_heads=2, dtype=torch.float32,
                     device_type="cpu", softcap=None, causal=True, documents=True)
    sel = select(spec)
    assert sel.name == "torch" and "packed-documents" in spec.describe()
    assert "no variable-length path" in sel.rejected["sdpa"]
    with pytest.raises(ValueError, match="cannot separate packed documents"):
        select(spec, backend="sdpa")
    # without documents, sdpa (no softcap) stays first on CPU
    assert select(make_spec(head_dim=16, num_heads=4, num_kv_heads=2, dtype=torch.float32,
                            device_type="cpu", causal=True)).name == "sdpa"


def test_which_kernels_serve_segments():
    from cp_softcap.kernels import KERNEL_NAMES, get_kernel
    serving = {n for n in KERNEL_NAMES if get_kernel(n).caps.segments}
    assert serving == {"torch", "flex", "fa2", "fa4"}
    q = torch.randn(1, 4, 2, 8)
    for name in sorted(set(KERNEL_NAMES) - serving):
        kern = get_kernel(name)
        for call in (lambda: kern.forward(q, q, q, scale=1.0, softcap=None, window=(None, 0),
                                          segments=((0, 2, 4), (0, 2, 4))),
                     lambda: kern.backward(q, q, q, q, q, torch.zeros(1, 2, 4), scale=1.0, softcap=None,
                                           window=(None, 0), segments=((0, 2, 4), (0, 2, 4)))):
            with pytest.raises(ValueError, match="cannot separate packed documents"):
                call()
