"""The pure-PyTorch kernel against the float64 autograd reference, through the kernel contract
(forward -> (out, lse), backward(dout, ..., out, lse, dlse) -> (dq, dk, dv)).

Inputs are scaled so tanh saturates (|s| > 2*cap on >40% of entries); blocks are much smaller than
the sequences so the blocked online softmax, block skipping and block edges are all exercised.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from cp_softcap.kernels import get_kernel
from cp_softcap.kernels.torch_kernel import TorchKernel
from cp_softcap.testing import assert_cap_matters, assert_finite, check_result, saturating_qkv

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
CAPS = [1.0, 5.0, 30.0, 50.0]
SMALL_BLOCKS = TorchKernel(block_q=16, block_k=24)

# (b, sq, sk, hq, hkv, d, window, causal) -- window in the kernels' bottom-right convention
GEOMETRIES = [
    (2, 48, 48, 4, 2, 32, (None, None), False),   # full, GQA 2
    (1, 40, 72, 4, 1, 16, (None, 0), True),       # causal, Sq < Sk, MQA
    (2, 72, 40, 2, 2, 32, (None, 0), True),       # causal, Sq > Sk: 32 empty leading rows
    (1, 64, 64, 6, 3, 16, (7, 0), True),          # sliding causal window (Gemma2 local style)
    (2, 33, 65, 4, 2, 16, (3, 5), False),         # two-sided window, shifted (Sq < Sk)
    (1, 65, 33, 4, 4, 16, (10, 2), False),        # shifted two-sided, Sq > Sk: empty rows
    (1, 50, 50, 2, 1, 16, (1, 1), False),         # tridiagonal (3 keys per row)
    (1, 30, 90, 4, 2, 16, (20, None), False),     # left-bounded only; early keys unseen
    (1, 90, 30, 4, 2, 16, (None, 4), False),      # right-bounded only
    (1, 64, 64, 2, 1, 16, (40, 0), True),         # window wider than a block: block skipping
]
GEOM_IDS = [f"b{g[0]}_q{g[1]}_k{g[2]}_h{g[3]}-{g[4]}_d{g[5]}_w{g[6][0]}-{g[6][1]}" for g in GEOMETRIES]
# every dtype x every geometry, with the cap rotating so each dtype meets every cap 2-3 times and
# each geometry meets every cap across the dtypes (the full product adds time, not coverage)
CASES = [pytest.param(dt, CAPS[(di + gi) % len(CAPS)], g,
                      id=f"{str(dt).replace('torch.', '')}-cap{CAPS[(di + gi) % len(CAPS)]:g}-{gid}")
         for di, dt in enumerate(DTYPES) for gi, (g, gid) in enumerate(zip(GEOMETRIES, GEOM_IDS))]


def _run(kernel, q, k, v, dout, *, scale, softcap, window, dlse=None):
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    out, lse = kernel.forward(qd, kd, vd, scale=scale, softcap=softcap, window=window)
    grads = kernel.backward(dout, qd, kd, vd, out, lse, scale=scale, softcap=softcap, window=window,
                            dlse=dlse)
    return out, lse, grads


@pytest.mark.parametrize("dtype,softcap,geom", CASES)
def test_forward_backward_match_reference(dtype, softcap, geom):
    b, sq, sk, hq, hkv, d, window, causal = geom
    q, k, v, frac = saturating_qkv(b, sq, sk, hq, hkv, d, dtype, softcap)
    assert frac > 0.4, f"inputs do not saturate tanh: only {frac:.2f} of |s| > 2*cap"
    dout = torch.randn(b, sq, hq, d, dtype=torch.float64).to(dtype)
    scale = d ** -0.5
    out, lse, grads = _run(SMALL_BLOCKS, q, k, v, dout, scale=scale, softcap=softcap, window=window)
    # contract: shapes, dtypes, layout
    assert out.shape == (b, sq, hq, d) and out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)  # unrounded accumulator (contract allows it)
    assert lse.shape == (b, hq, sq) and lse.is_contiguous()
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == acc
    check_result(out, lse, grads, q, k, v, dout, dtype=dtype, softcap=softcap, window=window)
    # negative control: the same comparison against an uncapped reference must fail
    assert_cap_matters(q, k, v, softcap=softcap, dtype=dtype, window=window, out=out)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_no_softcap_matches_reference(dtype):
    q, k, v, _ = saturating_qkv(2, 40, 56, 4, 2, 16, dtype, None, spread=3.0)
    dout = torch.randn(2, 40, 4, 16).to(dtype)
    out, lse, grads = _run(SMALL_BLOCKS, q, k, v, dout, scale=0.25, softcap=None, window=(None, 0))
    check_result(out, lse, grads, q, k, v, dout, dtype=dtype, scale=0.25, causal=True)


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_custom_scale(softcap):
    q, k, v, _ = saturating_qkv(1, 30, 30, 2, 1, 16, torch.float64, softcap, scale=0.7)
    dout = torch.randn(1, 30, 2, 16, dtype=torch.float64)
    out, lse, grads = _run(SMALL_BLOCKS, q, k, v, dout, scale=0.7, softcap=softcap, window=(None, None))
    check_result(out, lse, grads, q, k, v, dout, dtype=torch.float64, scale=0.7, softcap=softcap)


def test_head_dim_v_differs():
    q, k, _, _ = saturating_qkv(1, 24, 40, 4, 2, 16, torch.float32, 5.0)
    v = torch.randn(1, 40, 2, 8)
    dout = torch.randn(1, 24, 4, 8)
    out, lse, grads = _run(SMALL_BLOCKS, q, k, v, dout, scale=0.25, softcap=5.0, window=(None, 0))
    assert out.shape == (1, 24, 4, 8) and grads[2].shape == v.shape
    check_result(out, lse, grads, q, k, v, dout, dtype=torch.float32, scale=0.25, softcap=5.0, causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("window", [(None, None), (None, 0), (4, 3)])
def test_dlse_path(dtype, window):
    """backward(dlse=...) equals the gradient of <out, dout> + <lse, dlse> (ring/flex need it)."""
    q, k, v, _ = saturating_qkv(2, 44, 52, 4, 2, 16, dtype, 5.0)
    dout = torch.randn(2, 44, 4, 16).to(dtype)
    dlse = torch.randn(2, 4, 44, dtype=torch.float32 if dtype != torch.float64 else torch.float64)
    out, lse, grads = _run(SMALL_BLOCKS, q, k, v, dout, scale=0.25, softcap=5.0, window=window, dlse=dlse)
    check_result(out, lse, grads, q, k, v, dout, dtype=dtype, scale=0.25, softcap=5.0, window=window, dlse=dlse)
    # and the dlse term really changes dq/dk (so the test is not vacuous)
    _, _, plain = _run(SMALL_BLOCKS, q, k, v, dout, scale=0.25, softcap=5.0, window=window)
    assert (plain[0] - grads[0]).abs().max() > 1e-2 * grads[0].abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_empty_rows_exact(dtype):
    """Rows that see no key: out exactly 0, lse exactly -inf, zero dq; keys no row sees get zero
    dk/dv; no NaN anywhere, even with a non-zero dlse on the empty rows."""
    b, sq, sk, hq, hkv, d = 1, 40, 24, 4, 2, 16
    q, k, v, _ = saturating_qkv(b, sq, sk, hq, hkv, d, dtype, 30.0)
    dout = torch.randn(b, sq, hq, d).to(dtype)
    dlse = torch.randn(b, hq, sq)
    # window (2, 0) with Sq > Sk: query i sits at i - 16; rows 0..15 see nothing
    out, lse, (dq, dk, dv) = _run(SMALL_BLOCKS, q, k, v, dout, scale=0.25, softcap=30.0, window=(2, 0),
                                  dlse=dlse)
    empty = sq - sk
    for t, name in ((out, "out"), (dq, "dq"), (dk, "dk"), (dv, "dv")):
        assert_finite(t, name)
    assert_finite(lse, "lse", allow_neg_inf=True)
    assert torch.all(out[:, :empty] == 0)
    assert torch.all(lse[:, :, :empty] == float("-inf"))
    assert torch.all(torch.isfinite(lse[:, :, empty:]))
    assert torch.all(dq[:, :empty] == 0)
    check_result(out, lse, (dq, dk, dv), q, k, v, dout, dtype=dtype, softcap=30.0, window=(2, 0), scale=0.25, dlse=dlse)


def test_keys_seen_by_no_query_get_zero_grad():
    q, k, v, _ = saturating_qkv(1, 20, 60, 2, 1, 16, torch.float32, 5.0)
    dout = torch.randn(1, 20, 2, 16)
    # diagonal window, Sq < Sk: query i sees only key i + 40; keys 0..39 are never seen
    out, lse, (dq, dk, dv) = _run(SMALL_BLOCKS, q, k, v, dout, scale=0.25, softcap=5.0, window=(0, 0))
    assert torch.all(dk[:, :40] == 0) and torch.all(dv[:, :40] == 0)
    assert torch.all(dv[:, 40:].abs().sum(-1) > 0)


@pytest.mark.parametrize("sq,sk", [(0, 16), (16, 0), (0, 0)])
def test_zero_length(sq, sk):
    q = torch.randn(2, sq, 4, 16)
    k, v = torch.randn(2, sk, 2, 16), torch.randn(2, sk, 2, 16)
    dout = torch.randn(2, sq, 4, 16)
    out, lse, (dq, dk, dv) = _run(SMALL_BLOCKS, q, k, v, dout, scale=0.25, softcap=5.0, window=(None, 0))
    assert out.shape == (2, sq, 4, 16) and lse.shape == (2, 4, sq)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for t in (out, dq, dk, dv):
        assert torch.all(t == 0)


@pytest.mark.parametrize("blocks", [(1024, 1024), (16, 16), (7, 5), (3, 64), (64, 4)])
def test_block_sizes_agree(blocks):
    """Any blocking (incl. tiny blocks that do not divide the sequence) gives the same result."""
    kernel = TorchKernel(block_q=blocks[0], block_k=blocks[1])
    q, k, v, _ = saturating_qkv(1, 37, 53, 4, 2, 16, torch.float64, 5.0)
    dout = torch.randn(1, 37, 4, 16, dtype=torch.float64)
    window = (9, 2)
    out, lse, grads = _run(kernel, q, k, v, dout, scale=0.25, softcap=5.0, window=window)
    check_result(out, lse, grads, q, k, v, dout, dtype=torch.float64, scale=0.25, softcap=5.0, window=window)


def test_block_shrinking_respects_max_block_elems():
    kernel = TorchKernel(block_q=1024, block_k=1024, max_block_elems=2 * 4 * 32 * 32)
    bq, bk = kernel._blocks(2, 4, 500, 700)
    assert 2 * 4 * bq * bk <= kernel.max_block_elems
    assert TorchKernel()._blocks(1, 1, 100, 100) == (100, 100)   # short sequences: one block
    # the shrink loop terminates at 16 even when that exceeds the budget
    assert TorchKernel(max_block_elems=1)._blocks(4, 8, 300, 300) == (16, 16)
    q, k, v, _ = saturating_qkv(2, 100, 120, 4, 2, 16, torch.float32, 50.0)
    dout = torch.randn(2, 100, 4, 16)
    out, lse, grads = _run(kernel, q, k, v, dout, scale=0.25, softcap=50.0, window=(None, 0))
    check_result(out, lse, grads, q, k, v, dout, dtype=torch.float32, scale=0.25, softcap=50.0, causal=True)


def test_registered_kernel_is_torch_kernel():
    kern = get_kernel("torch")
    assert isinstance(kern, TorchKernel) and kern.caps.softcap and kern.caps.dlse


_MEMORY_SCRIPT = textwrap.dedent("""
    import sys, torch
    from cp_softcap.kernels.torch_kernel import TorchKernel
    torch.set_num_threads(1)

    def rss(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(field)

    def peak_of(fn):
        before = rss("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:   # reset the RSS high-water mark
            f.write("5")
        r = fn()
        return rss("VmHWM") - before, r

    S, HQ = int(sys.argv[1]), 2
    q = torch.randn(1, S, HQ, 16); k = torch.randn(1, S, 1, 16); v = torch.randn(1, S, 1, 16)
    full = HQ * S * S * 4                               # one float32 score matrix of the whole call
    ctrl, _ = peak_of(lambda: torch.ones(HQ, S, S))     # positive control: the probe sees it
    print("full", full, "control", ctrl)
    for block in map(int, sys.argv[2:]):
        kern = TorchKernel(block_q=block, block_k=block)
        kern.forward(q[:, :64], k[:, :64], v[:, :64], scale=0.25, softcap=5.0, window=(None, 0))
        fwd, (out, lse) = peak_of(lambda: kern.forward(q, k, v, scale=0.25, softcap=5.0, window=(None, 0)))
        dout = torch.randn_like(out)
        bwd, grads = peak_of(lambda: kern.backward(dout, q, k, v, out, lse, scale=0.25, softcap=5.0,
                                                   window=(None, 0)))
        ok = all(bool(torch.isfinite(t).all()) for t in (out, *grads))
        print("block", block, HQ * block * block * 4, fwd, bwd, int(ok))
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc RSS counters")
def test_bounded_memory_4096():
    """A 4096 x 4096 call (2 heads; the full float32 score matrix would be 128 MiB) with 512- and
    256-blocks: the peak RSS growth of forward and of backward stays within 12 score blocks plus
    the O(S) accumulators, far below the full matrix, and shrinks with the block. Measured in a
    fresh process with glibc's mmap threshold at 64 KiB so freed temporaries leave RSS at once
    (RSS then tracks live allocations, not allocator caching)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    res = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, "4096", "512", "256"], capture_output=True,
                         text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr
    lines = [ln.split() for ln in res.stdout.splitlines()]
    full, ctrl = int(lines[0][1]), int(lines[0][3])
    mib = 2 ** 20
    assert ctrl >= 0.9 * full, f"RSS probe is blind: allocating {full / mib:.0f} MiB showed {ctrl / mib:.0f} MiB"
    peaks = {}
    for _, block, block_bytes, fwd, bwd, ok in lines[1:]:
        block_bytes, fwd, bwd = int(block_bytes), int(fwd), int(bwd)
        assert ok == "1", f"non-finite output or gradient (block {block})"
        bound = 12 * block_bytes + 4 * mib      # score-sized temporaries + O(S) out/lse/grad buffers
        for what, peak in (("forward", fwd), ("backward", bwd)):
            assert peak < bound, f"{what} peak {peak / mib:.1f} MiB > {bound / mib:.1f} MiB (block {block})"
            assert peak < full / 4, f"{what} peak {peak / mib:.1f} MiB vs full matrix {full / mib:.0f} MiB"
        peaks[int(block)] = max(fwd, bwd)
    assert peaks[256] < peaks[512], f"peak does not shrink with the block: {peaks}"
