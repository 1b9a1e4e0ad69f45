"""flex with document segments: the real flex_attention forward on CPU (float64 and float32)
against the float64 reference, and the backward's plumbing (block mask per segments, final-LSE
reweighting) on CPU through a dense, differentiable stand-in for flex_attention that applies
the BlockMask's own mask_mod and the kernel's score_mod."""
import warnings

import pytest
import torch

from cp_softcap.kernels.base import Segments
from cp_softcap.kernels.flex import FlexKernel
from segment_checks import SEGMENT_CASES, SEGMENT_IDS, check_segmented

CAPS = [50.0, 1.0, 30.0, 5.0]
CPU = torch.device("cpu")


def dense_flex(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False, **_):
    """flex_attention's math on [B, H, S, D] with every (q, k) pair materialised: differentiable
    on CPU; empty rows give out 0 and lse -inf without NaN gradients."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    qi, ki = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None, :]
    if score_mod is not None:
        s = score_mod(s, 0, 0, qi, ki)
    vis = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool)
    if block_mask is not None:
        vis = block_mask.mask_mod(0, 0, qi, ki).expand_as(vis)
    empty = ~vis.any(-1)
    s = s.masked_fill(~vis, float("-inf")).masked_fill(empty[:, None], 0.0)
    lse = torch.logsumexp(s, -1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)).masked_fill(~vis, 0.0), v)
    return out, lse.masked_fill(empty, float("-inf"))


class DenseFlex(FlexKernel):
    def _fn(self, device):
        self._load()
        return dense_flex


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # "flex without torch.compile" on CPU
        yield


# float64 on every case; float32 (flex's production dtype family) on two (CPU flex is slow)
FORWARD_CASES = ([(ci, torch.float64) for ci in range(len(SEGMENT_CASES))]
                 + [(0, torch.float32), (3, torch.float32)])


@pytest.mark.parametrize("ci,dtype", FORWARD_CASES,
                         ids=[f"{SEGMENT_IDS[ci]}-{str(dt)[6:]}" for ci, dt in FORWARD_CASES])
def test_flex_forward_segments_on_cpu(ci, dtype):
    cu_q, cu_k, window, _ = SEGMENT_CASES[ci]
    # the kernel returns a float32 LSE (its contract) whatever the input dtype
    check_segmented(FlexKernel(), (cu_q, cu_k), window, softcap=CAPS[ci % 4], dtype=dtype,
                    hq=4, hkv=1 + ci % 2 * 3, backward=False, tols={"lse": 5e-5})


@pytest.mark.parametrize("ci", [0, 1, 2, 4], ids=[SEGMENT_IDS[i] for i in (0, 1, 2, 4)])
def test_flex_backward_plumbing_segments(ci):
    cu_q, cu_k, window, _ = SEGMENT_CASES[ci]
    # the kernel returns float32 gradients and LSE (its contract) whatever the input dtype
    check_segmented(DenseFlex(), (cu_q, cu_k), window, softcap=CAPS[ci % 4], dtype=torch.float64,
                    tols={"lse": 5e-5, "dq": 1e-5, "dk": 1e-5, "dv": 1e-5})


def test_block_masks_cached_per_geometry():
    fk = FlexKernel()
    a = fk.block_mask(20, 20, (None, 0), CPU, Segments((0, 4, 20), (0, 4, 20)))
    assert fk.block_mask(20, 20, (None, 0), CPU, ((0, 4, 20), (0, 4, 20))) is a
    assert fk.block_mask(20, 20, (None, 0), CPU, ((0, 5, 20), (0, 5, 20))) is not a
    # one segment is the unsegmented mask; no window and no documents needs no mask
    assert fk.block_mask(20, 20, (None, 0), CPU, ((0, 20), (0, 20))) is fk.block_mask(20, 20, (None, 0), CPU)
    assert fk.block_mask(20, 20, (None, None), CPU, ((0, 20), (0, 20))) is None
    with pytest.raises(ValueError, match="cu_k"):
        fk.block_mask(20, 20, (None, 0), CPU, ((0, 4, 20), (0, 4, 21)))


def test_flex_forces_the_main_kernel_below_128_rows():
    """Inductor's decoding kernel (chosen below 128 query rows) cannot compile grouped heads whose
    rows exceed its tile: the adapter forces the main kernel there, and a caller's options win."""
    from cp_softcap.kernels.flex import MAIN_KERNEL, FlexKernel
    k = FlexKernel()
    assert k._options(127) == MAIN_KERNEL and k._options(1) == MAIN_KERNEL
    assert k._options(128) is None and k._options(4096) is None
    own = {"BLOCK_M": 64}
    assert FlexKernel(kernel_options=own)._options(60) is own
    assert FlexKernel(kernel_options={})._options(60) == {}
