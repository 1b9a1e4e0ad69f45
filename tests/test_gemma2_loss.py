"""examples/gemma2/loss.py: the chunked softcapped cross-entropy equals a float64 full-logits
reference (loss, dh, dW) within float32 rounding with saturating final logits (most |logits| far
above 2 * cap), for slices that do not divide the tokens and with ignored labels; it fails without
the cap (negative control); NaN/inf never pass; and its measured peak memory is a fraction of
the full path's."""
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from gemma2.loss import softcap_cross_entropy_sum  # noqa: E402
from benchmarks.training.measure import peak_bytes  # noqa: E402

pytestmark = pytest.mark.timeout(120)


class Matmuls(TorchDispatchMode):
    """Records the operand dtypes of every mm/addmm (the backward's too, unlike a function mode)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            mats = args[:2] if func.overloadpacket is torch.ops.aten.mm else args[1:3]
            self.seen.append(tuple(a.dtype for a in mats))
        return func(*args, **(kwargs or {}))


def inputs(n=300, hidden=32, vocab=500, scale=100.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * scale / hidden ** 0.5
    lab = torch.randint(0, vocab, (n,), generator=g)
    lab[::5] = -100
    return h, w, lab


def reference(h, w, lab, cap):
    """float64, full logits."""
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    z = hd @ wd.T
    z = z if cap is None else cap * torch.tanh(z / cap)
    loss = F.cross_entropy(z, lab, ignore_index=-100, reduction="sum")
    loss.backward()
    return loss.detach(), hd.grad, wd.grad, (hd @ wd.T).detach()


def chunked(h, w, lab, cap, chunk):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = softcap_cross_entropy_sum(h, w, lab, cap, chunk)
    loss.backward()
    for t in (loss, h.grad, w.grad):
        assert torch.isfinite(t).all()
    return loss.detach(), h.grad, w.grad


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("cap,chunk", [(30.0, 64), (30.0, 7), (3.0, 128), (None, 50)])
def test_equals_float64_full_logits(cap, chunk):
    h, w, lab = inputs()
    ref_loss, ref_dh, ref_dw, raw = reference(h, w, lab, cap)
    if cap is not None:        # the cap saturates: many raw logits are far beyond 2 * cap
        assert (raw.abs() > 2 * cap).float().mean() > (0.2 if cap == 30.0 else 0.5)
    loss, dh, dw = chunked(h, w, lab, cap, chunk)
    assert abs(loss.double() - ref_loss) / ref_loss < 1e-6
    assert rel(dh, ref_dh) < 1e-5 and rel(dw, ref_dw) < 1e-5


def test_negative_control_without_cap():
    h, w, lab = inputs()
    ref_loss, ref_dh, _, _ = reference(h, w, lab, 30.0)
    loss, dh, _ = chunked(h, w, lab, None, 64)
    assert abs(loss.double() - ref_loss) / ref_loss > 1e-2 and rel(dh, ref_dh) > 1e-2


def test_gradients_follow_the_incoming_gradient_and_only_what_needs_them():
    """The gradients, computed in the forward, are scaled by the gradient that reaches the loss
    (a mean, a gradient-accumulation factor); a frozen embedding gets no dW matmul, no grad mode
    none at all; a second backward through one loss, or a double backward, fails instead of
    giving a wrong gradient."""
    h, w, lab = inputs()
    ref_loss, ref_dh, ref_dw, _ = reference(h, w, lab, 30.0)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    (softcap_cross_entropy_sum(hh, ww, lab, 30.0, 64) * 0.25).backward()
    assert rel(hh.grad * 4, ref_dh) < 1e-5 and rel(ww.grad * 4, ref_dw) < 1e-5

    hh = h.clone().requires_grad_()
    with Matmuls() as mm:
        loss = softcap_cross_entropy_sum(hh, w, lab, 30.0, 64)     # w frozen: logits and dh
    loss.backward()
    assert len(mm.seen) == 2 * 5 and rel(hh.grad, ref_dh) < 1e-5
    with Matmuls() as mm, torch.no_grad():
        loss = softcap_cross_entropy_sum(h.requires_grad_(), w.requires_grad_(), lab, 30.0, 64)
    assert len(mm.seen) == 5 and abs(loss.double() - ref_loss) / ref_loss < 1e-6    # logits only

    hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = softcap_cross_entropy_sum(hh, ww, lab, 30.0, 64)
    loss.backward(retain_graph=True)
    kept = ww.grad.clone()
    with pytest.raises(RuntimeError, match="second backward through one loss"):
        loss.backward()
    assert torch.equal(ww.grad, kept)                  # the first backward's gradient untouched
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):   # no version check
        loss = softcap_cross_entropy_sum(hh, ww, lab, 30.0, 64)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward through one loss"):
        loss.backward()
    # a second-order term (a gradient penalty) would be silently missing: refused
    loss = softcap_cross_entropy_sum(hh, ww, lab, 30.0, 64)
    with pytest.raises(RuntimeError, match="create_graph"):
        torch.autograd.grad(loss, hh, create_graph=True)


def test_batch_shape_and_bad_inputs():
    h, w, lab = inputs(n=60)
    flat = softcap_cross_entropy_sum(h, w, lab, 30.0, 16)
    assert torch.equal(softcap_cross_entropy_sum(h.view(3, 20, -1), w, lab.view(3, 20), 30.0, 16), flat)
    with pytest.raises(ValueError, match="leading"):
        softcap_cross_entropy_sum(h, w, lab[:-1], 30.0)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        softcap_cross_entropy_sum(h, w, lab, 30.0, 0)
    h[3, 0] = float("nan")
    assert not torch.isfinite(softcap_cross_entropy_sum(h, w, lab, 30.0, 16))


def test_peak_memory_is_a_slice_not_the_vocabulary():
    """1024 tokens x 8000 vocab: full float32 logits are 31 MiB; 64-token slices use ~2 MiB each."""
    h, w, lab = inputs(n=1024, hidden=32, vocab=8000)
    h.requires_grad_(), w.requires_grad_()

    def full():
        z = 30.0 * torch.tanh(F.linear(h, w) / 30.0)
        F.cross_entropy(z, lab, reduction="sum").backward()

    cpu = torch.device("cpu")
    full_peak = peak_bytes(full, cpu)
    h.grad = w.grad = None
    chunk_peak = peak_bytes(lambda: softcap_cross_entropy_sum(h, w, lab, 30.0, 64).backward(), cpu)
    logits = 1024 * 8000 * 4
    assert full_peak > 3 * logits and chunk_peak < logits / 2, (full_peak, chunk_peak)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_under_autocast_the_matmuls_run_in_its_dtype_forward_and_backward(device):
    """Under bf16 autocast the loss takes hidden and the embedding in bf16, cast once, and its
    gradient matmuls run in bf16 too (on CUDA the dW matmul too, into a float32 output), also
    with backward called inside the region; the result stays within bf16 rounding of the float64
    reference with a saturating cap, the gradients come back in the parameters' float32, and
    dropping the cap is caught."""
    h, w, lab = inputs()
    ref_loss, ref_dh, ref_dw, _ = reference(h, w, lab, 30.0)
    h, w = h.to(device).requires_grad_(), w.to(device).requires_grad_()
    lab = lab.to(device)
    with Matmuls() as mm:
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = softcap_cross_entropy_sum(h, w, lab, 30.0, 64)
            loss.backward()                # inside the region: the Function's dtypes still hold
    # logits and dh in bf16 (5 slices each), no logits recomputed in backward; CPU's dW matmul
    # takes float32 operands (no 16-bit matmul with a float32 output there)
    bf16 = 3 * 5 if device == "cuda" else 2 * 5
    assert mm.seen.count((torch.bfloat16, torch.bfloat16)) == bf16 and len(mm.seen) == 3 * 5, mm.seen
    assert loss.dtype == h.grad.dtype == w.grad.dtype == torch.float32
    assert all(torch.isfinite(t).all() for t in (loss, h.grad, w.grad))
    assert abs(loss.double().cpu() - ref_loss) / ref_loss < 1e-2
    assert rel(h.grad.cpu(), ref_dh) < 3e-2 and rel(w.grad.cpu(), ref_dw) < 3e-2
    with torch.autocast(device, dtype=torch.bfloat16):
        uncapped = softcap_cross_entropy_sum(h.detach(), w.detach(), lab, None, 64)
    assert abs(uncapped.double().cpu() - ref_loss) / ref_loss > 1e-1


@pytest.mark.parametrize("compiled", [False, True])
def test_under_autocast_the_peak_is_the_memory_plans_loss_row(compiled):
    """bf16 autocast on CPU, Gemma2-like ratio of vocabulary to hidden size: the loss's peak
    above its inputs stays within 5 % of what the memory plan counts for it (three slices of
    float32 logits, the float32 embedding gradient, one bf16 copy of the embedding): no
    temporary of the embedding's size besides those."""
    from types import SimpleNamespace

    from gemma2 import memory
    vocab, hidden, tokens, chunk = 32000, 1024, 256, 64
    h = torch.randn(tokens, hidden, requires_grad=True)
    w = (torch.randn(vocab, hidden) * 0.05).requires_grad_()
    lab = torch.randint(0, vocab, (tokens,))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = softcap_cross_entropy_sum(h, w, lab, 30.0, chunk, compiled=compiled)
        loss.backward()

    step()                                   # w.grad exists before the measured call, as in training
    job = SimpleNamespace(cfg=SimpleNamespace(vocab_size=vocab, hidden_size=hidden), tokens=tokens,
                          loss_chunk=chunk, fsdp=False)
    planned = memory._loss_buffers(job, act=2)
    measured = peak_bytes(step, torch.device("cpu"))
    assert measured <= 1.05 * planned, (measured / planned, measured, planned)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cap", [30.0, None])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_compiled_slices_equal_the_float64_reference(cap, device):
    """compiled=True runs each slice's elementwise work as inductor's fused kernels (C++ on CPU,
    Triton on CUDA): the same loss and gradients as the float64 full-logits reference with a
    saturating cap, ignored labels and a last slice of another length; under bf16 autocast it
    agrees with the eager slices (the same bf16 logits, float32 math); a dropped cap is caught."""
    h, w, lab = inputs(n=150, vocab=300)
    ref_loss, ref_dh, ref_dw, raw = reference(h, w, lab, cap)
    h, w, lab = h.to(device), w.to(device), lab.to(device)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = softcap_cross_entropy_sum(hh, ww, lab, cap, 64, compiled=True)
    loss.backward()
    for t in (loss, hh.grad, ww.grad):
        assert torch.isfinite(t).all()
    assert abs(loss.double().cpu() - ref_loss) / ref_loss < 1e-6
    assert rel(hh.grad.cpu(), ref_dh) < 1e-5 and rel(ww.grad.cpu(), ref_dw) < 1e-5
    if cap is not None:
        assert (raw.abs() > 2 * cap).float().mean() > 0.2
        uncapped = softcap_cross_entropy_sum(h, w, lab, None, 64, compiled=True)
        assert abs(uncapped.double().cpu() - ref_loss) / ref_loss > 1e-2
    got = {}
    for compiled in (True, False):            # under bf16 autocast: the same bf16 logits in
        hb, wb = h.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16):
            lb = softcap_cross_entropy_sum(hb, wb, lab, cap, 64, compiled=compiled)
        lb.backward()
        got[compiled] = (lb.detach(), hb.grad, wb.grad)
    assert abs(got[True][0] - got[False][0]) / got[False][0].abs() < 1e-5
    assert all(rel(a.cpu(), b.double().cpu()) < 1e-3 for a, b in zip(got[True][1:], got[False][1:]))
