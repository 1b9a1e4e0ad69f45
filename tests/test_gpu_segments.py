"""GPU: kernels with document segments (segments=) against the float64 reference, on CUDA:
the torch kernel, flex's compiled forward AND backward (CPU covers flex's forward only), and
fa2's real varlen functions where flash-attn 2 is installed. Skipped without CUDA."""
import pytest
import torch

from cp_softcap.kernels import get_kernel
from cp_softcap.kernels.flex import FlexKernel
from cp_softcap.kernels.torch_kernel import TorchKernel
from segment_checks import SEGMENT_CASES, SEGMENT_IDS, check_segmented

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CAPS = [50.0, 1.0, 30.0, 5.0]
DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("ci", range(len(SEGMENT_CASES)), ids=SEGMENT_IDS)
def test_torch_kernel_segments_cuda(ci):
    cu_q, cu_k, window, _ = SEGMENT_CASES[ci]
    check_segmented(TorchKernel(block_q=16, block_k=24), (cu_q, cu_k), window, softcap=CAPS[ci % 4],
                    dtype=torch.float32, device="cuda")


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("ci", range(len(SEGMENT_CASES)), ids=SEGMENT_IDS)
def test_flex_segments_cuda(ci, dtype):
    cu_q, cu_k, window, _ = SEGMENT_CASES[ci]
    check_segmented(FlexKernel(), (cu_q, cu_k), window, softcap=CAPS[ci % 4], dtype=dtype,
                    hkv=1 + ci % 2, device="cuda")


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("ci", range(len(SEGMENT_CASES)), ids=SEGMENT_IDS)
def test_fa2_varlen_cuda(ci, dtype):
    fa2 = get_kernel("fa2")
    if fa2._interface() is None:
        pytest.skip(fa2._reason)
    cu_q, cu_k, window, _ = SEGMENT_CASES[ci]
    check_segmented(fa2, (cu_q, cu_k), window, softcap=CAPS[ci % 4], dtype=dtype, hkv=1 + ci % 2,
                    device="cuda")
