"""examples/gemma2 --fused: which pieces run on Liger Kernel (fused.choose), and that the model
calls liger_kernel 0.8.5's functions with their real signatures and layouts.

On CPU: the selection rules (liger absent -> the PyTorch pieces; --fused liger without it, or on
CPU -> an error naming the fix), and the whole model with every piece routed through stand-ins
that have liger's signatures (heads-first RoPE, offset/casting of RMSNorm, the fused loss's
positional arguments) but compute in PyTorch: loss and gradients equal the PyTorch pieces'.
On CUDA with liger_kernel installed: each real Liger piece against ours in bf16 (output and
gradients within bf16 tolerance), and a training step of the whole model.
"""
import os
import sys
import types

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from gemma2 import flags, fused  # noqa: E402
from gemma2.config import get_config  # noqa: E402
from gemma2.loss import softcap_cross_entropy_sum  # noqa: E402
from gemma2.model import RMSNorm, apply_rope, rope_cos_sin, Gemma2  # noqa: E402

pytestmark = pytest.mark.timeout(120)


# ----------------------------------------------------------------------------- selection (CPU)

def test_auto_without_liger_is_pytorch(monkeypatch):
    monkeypatch.setattr(fused, "liger_problem", lambda: "liger_kernel does not import here (ImportError)")
    assert fused.choose("auto", "cuda") == ()
    assert fused.choose("auto", "cpu") == ()
    assert fused.choose("torch", "cuda") == ()


def test_forced_liger_without_it_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(fused, "liger_problem", lambda: "liger_kernel does not import here (ImportError)")
    with pytest.raises(ValueError, match=r"--fused liger: liger_kernel does not import.*cp-softcap\[gpu\].*--fused auto or torch"):
        fused.choose("liger", "cuda")
    with pytest.raises(ValueError, match="this run is on cpu; use --fused auto or torch"):
        fused.choose("liger", "cpu")
    with pytest.raises(ValueError, match="choose one of auto, liger, torch"):
        fused.choose("triton", "cuda")


def test_auto_with_liger_on_cuda(monkeypatch):
    monkeypatch.setattr(fused, "liger_problem", lambda: None)
    assert fused.choose("auto", "cuda") == fused.PIECES
    assert fused.choose("liger", "cuda", compile=True) == fused.PIECES
    assert fused.choose("auto", "cuda", compile=True) == ("loss",)   # inductor fuses the rest
    assert fused.choose("torch", "cuda") == ()


def test_flag_refuses_liger_on_cpu(capsys):
    with pytest.raises(SystemExit) as e:
        flags.parse(["--fused", "liger", "--device", "cpu"])
    assert e.value.code == 2 and "--fused liger runs Triton GPU kernels" in capsys.readouterr().err
    args, _, _ = flags.parse(["--device", "cpu"])
    assert args.fused == "auto"


def test_this_machine_reports_why_not():
    problem = fused.liger_problem()
    assert problem is None or problem.startswith("liger_kernel does not import here")


# ------------------------------------------- liger's signatures, computed in PyTorch (CPU)

class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, X, W, eps, offset=0.0, casting_mode="llama", in_place=True, row_mode=None):
        assert (offset, casting_mode, in_place) == (1.0, "gemma", False)
        ctx.save_for_backward(X, W)
        ctx.eps = eps
        return _rms_ref(X, W, eps)

    @staticmethod
    def backward(ctx, dy):
        X, W = ctx.saved_tensors
        with torch.enable_grad():
            x, w = X.detach().requires_grad_(), W.detach().requires_grad_()
            dx, dw = torch.autograd.grad(_rms_ref(x, w, ctx.eps), (x, w), dy)
        return dx, dw, None, None, None, None, None


def _rms_ref(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).type_as(x)


def _geglu(a, b):
    return F.gelu(a, approximate="tanh") * b


def _rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, rotary_dim=None):
    """q [B, Hq, S, D], k [B, Hkv, S, D], cos/sin [B or 1, S, D] (liger's layout)."""
    assert q.shape[2] == cos.shape[1] and k.shape[2] == cos.shape[1], (q.shape, cos.shape)
    c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rot = lambda x: torch.cat((-x.chunk(2, -1)[1], x.chunk(2, -1)[0]), -1)   # noqa: E731
    return (q * c + rot(q) * s).to(q.dtype), (k * c + rot(k) * s).to(k.dtype)


def _flce(_input, weight, target, bias=None, ce_weight=None, ignore_index=-100, lse_square_scale=0.0,
          label_smoothing=0.0, reduction="mean", softcap=None, return_z_loss=False, accum_dtype=None, *rest):
    assert _input.dim() == 2 and target.dim() == 1 and bias is None and ce_weight is None
    assert (ignore_index, lse_square_scale, label_smoothing, reduction, return_z_loss) == (-100, 0.0, 0.0, "sum", False)
    z = F.linear(_input, weight).float()
    z = softcap * torch.tanh(z / softcap) if softcap is not None else z
    return F.cross_entropy(z, target, ignore_index=ignore_index, reduction="sum"), None, None, None


def _fn(f):
    return types.SimpleNamespace(apply=f)


@pytest.fixture
def fake_liger(monkeypatch):
    ops = types.ModuleType("liger_kernel.ops")
    ops.LigerRMSNormFunction = _RMSNorm
    ops.LigerGELUMulFunction = _fn(_geglu)
    ops.LigerRopeFunction = _fn(_rope)
    ops.LigerFusedLinearCrossEntropyFunction = _fn(_flce)
    pkg = types.ModuleType("liger_kernel")
    pkg.ops = ops
    monkeypatch.setitem(sys.modules, "liger_kernel", pkg)
    monkeypatch.setitem(sys.modules, "liger_kernel.ops", ops)
    assert fused.liger_problem() is None


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(ids[:, :-1], labels=ids[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_model_calls_liger_as_defined(fake_liger):
    cfg = get_config("tiny", num_hidden_layers=2, sliding_window=16, attn_logit_softcapping=5.0,
                     final_logit_softcapping=3.0)
    torch.manual_seed(0)
    ref = Gemma2(cfg)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    lig = Gemma2(cfg)
    lig.load_state_dict(ref.state_dict())
    fused.apply(lig, fused.choose("liger", "cuda"))
    from gemma2.metrics import fused_choice
    assert fused_choice(lig) == "liger: rms_norm, geglu, rope, loss"
    assert fused_choice(ref) == "none (pure PyTorch)"
    ids = torch.randint(3, cfg.vocab_size, (2, 49))
    ids[0, 5] = 0
    (l0, g0), (l1, g1) = _step(ref, ids), _step(lig, ids)
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=0)
    for name in g0:       # float32 rounding, relative to each gradient's largest entry
        err = ((g1[name] - g0[name]).abs().max() / g0[name].abs().max()).item()
        assert err < 1e-5, (name, err)
    fused.apply(lig, ())
    assert fused_choice(lig) == "none (pure PyTorch)"


def _liger_slice(tokens, vocab, hidden, c):
    """liger_kernel 0.8.5's slice length for chunk_mem_const c (fused_linear_cross_entropy.py)."""
    inc = -(-vocab // (c * hidden))
    n = -(-tokens // inc)
    return min(1 << (n - 1).bit_length(), tokens)


def test_liger_slices_are_large_and_bounded():
    # Gemma2 2b at 8K tokens: Liger's default (c = 1) slices 128 tokens; ours 2048 (1 GiB of bf16)
    assert _liger_slice(8192, 256000, 2304, 1) == 128
    assert _liger_slice(8192, 256000, 2304, fused.liger_chunk_mem_const(8192, 256000, 2304, 2)) == 2048
    assert _liger_slice(8192, 256000, 2304, fused.liger_chunk_mem_const(8192, 256000, 2304, 2, 1000)) == 512
    for tokens in (1, 100, 4096, 8191, 32768, 131072):
        for vocab, hidden in ((256000, 2304), (256000, 3584), (32000, 4096), (300, 64)):
            for chunk in (None, 1, 300, 2048, 10 ** 6):
                c = fused.liger_chunk_mem_const(tokens, vocab, hidden, 2, chunk)
                target = chunk if chunk is not None else fused.SLICE_BYTES // (2 * vocab)
                # never above the target, unless Liger's own default (c = 1) already is
                assert c >= 1 and _liger_slice(tokens, vocab, hidden, c) <= max(
                    target, _liger_slice(tokens, vocab, hidden, 1)), \
                    (tokens, vocab, hidden, chunk)


def test_liger_loss_gets_autocast_dtype_and_its_slices(fake_liger):
    seen = []

    def spy(*args):
        seen.append((args[0].dtype, args[1].dtype, args[-1]))
        return _flce(*args[:12])

    sys.modules["liger_kernel.ops"].LigerFusedLinearCrossEntropyFunction = _fn(spy)
    h = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(300, 32, requires_grad=True)
    lab = torch.randint(0, 300, (64,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fused.softcap_cross_entropy_sum(h, w, lab, 5.0, chunk=16)
    loss.backward()
    assert seen == [(torch.bfloat16, torch.bfloat16, fused.liger_chunk_mem_const(64, 300, 32, 2, 16))]
    assert loss.dtype == torch.float32 and w.grad.dtype == torch.float32 and h.grad.dtype == torch.float32
    # the weight entered in bf16: its gradient carries one bf16 rounding, as under plain autocast
    assert torch.equal(w.grad, w.grad.bfloat16().float())
    ref = softcap_cross_entropy_sum(h.detach(), w.detach(), lab, 5.0)
    torch.testing.assert_close(loss.detach(), ref, rtol=2e-2, atol=0)
    seen.clear()
    fused.softcap_cross_entropy_sum(h, w, lab, 5.0)            # no autocast: float32 as given
    assert seen[0][:2] == (torch.float32, torch.float32)


# ------------------------------------------------------------------ the real kernels (CUDA)

def _liger_on_cuda():
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return fused.liger_problem()


cuda_liger = pytest.mark.skipif(_liger_on_cuda() is not None, reason=str(_liger_on_cuda()))


def _close(a, b, what, rtol=2e-2):
    """bf16 tolerance: relative to the reference's largest entry."""
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all(), what
    err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-6)
    assert err < rtol, f"{what}: max error {err:.3g} of the largest entry"


def _grads(fn, *xs):
    xs = [x.detach().clone().requires_grad_() for x in xs]
    out = fn(*xs)
    g = torch.randn_like(out)
    out.backward(g)
    return out, [x.grad for x in xs]


@pytest.mark.gpu
@cuda_liger
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_liger_rms_norm(dtype):
    x = torch.randn(2, 512, 2304, device="cuda", dtype=dtype) * 3
    norm = RMSNorm(2304, 1e-6).cuda()
    with torch.no_grad():
        norm.weight.normal_(0, 0.3)
    ref = lambda x, w: _rms_ref(x, w, 1e-6)     # noqa: E731
    torch.manual_seed(1)
    o0, g0 = _grads(ref, x, norm.weight)
    torch.manual_seed(1)
    o1, g1 = _grads(lambda x, w: fused.rms_norm(x, w, 1e-6), x, norm.weight)
    assert o1.dtype == o0.dtype == dtype
    for a, b, what in zip([o1, *g1], [o0, *g0], ("out", "dx", "dw")):
        _close(a, b, what)


@pytest.mark.gpu
@cuda_liger
def test_liger_geglu():
    a, b = (torch.randn(2, 512, 9216, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    torch.manual_seed(1)
    o0, g0 = _grads(_geglu, a, b)
    torch.manual_seed(1)
    o1, g1 = _grads(fused.geglu, a, b)
    for x, y, what in zip([o1, *g1], [o0, *g0], ("out", "dgate", "dup")):
        _close(x, y, what)


@pytest.mark.gpu
@cuda_liger
def test_liger_rope():
    b, s = 2, 512
    q = torch.randn(b, s, 8, 256, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, s, 4, 256, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(s, device="cuda")[None] + 1000
    cos, sin = rope_cos_sin(pos, 256, 10000.0, torch.float32)

    def ours(q, k):
        return torch.cat([apply_rope(q, cos, sin).to(q.dtype).flatten(2), apply_rope(k, cos, sin).to(k.dtype).flatten(2)], -1)

    def liger(q, k):      # q, k come from a linear's output in the model: fresh storage here too
        q2, k2 = fused.rope(q * 1, k * 1, cos, sin)
        return torch.cat([q2.flatten(2), k2.flatten(2)], -1)

    torch.manual_seed(1)
    o0, g0 = _grads(ours, q, k)
    torch.manual_seed(1)
    o1, g1 = _grads(liger, q, k)
    for x, y, what in zip([o1, *g1], [o0, *g0], ("out", "dq", "dk")):
        _close(x, y, what)


@pytest.mark.gpu
@cuda_liger
def test_liger_loss_with_softcap():
    h = torch.randn(4096, 2304, device="cuda") * 2
    w = torch.randn(32000, 2304, device="cuda") * 0.05
    lab = torch.randint(0, 32000, (4096,), device="cuda")
    lab[::7] = -100
    results = []
    for fn in (lambda h, w: softcap_cross_entropy_sum(h, w, lab, 30.0),
               lambda h, w: fused.softcap_cross_entropy_sum(h, w, lab, 30.0)):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn(hh, ww)
        loss.backward()
        results.append((loss.detach(), hh.grad, ww.grad))
    (l0, dh0, dw0), (l1, dh1, dw1) = results
    assert l1.dtype == torch.float32 and dw1.dtype == torch.float32
    torch.testing.assert_close(l1, l0, rtol=2e-3, atol=0)
    _close(dh1, dh0, "dh")
    _close(dw1, dw0, "dw")
    # negative control: without the softcap the loss differs well beyond that tolerance
    assert abs(fused.softcap_cross_entropy_sum(h, w, lab, None).item() / l0.item() - 1) > 1e-2


@pytest.mark.gpu
@cuda_liger
def test_liger_training_step_matches_pytorch():
    cfg = get_config("2b", num_hidden_layers=2, vocab_size=32000)
    ids = torch.randint(3, cfg.vocab_size, (1, 2049), device="cuda")
    out = []
    for pieces in ((), fused.PIECES):
        model = Gemma2(cfg)
        model.reset_parameters(0)
        model.cuda()
        fused.apply(model, pieces)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids[:, :-1], labels=ids[:, 1:])
        loss.backward()
        out.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = out
    torch.testing.assert_close(l1, l0, rtol=5e-3, atol=0)
    for name in g0:
        rel = ((g1[name] - g0[name]).norm() / g0[name].norm().clamp_min(1e-12)).item()
        assert rel < 3e-2, (name, rel)


def test_speed_variants_leave_one_piece_out(monkeypatch):
    from benchmarks.training import speed
    monkeypatch.setattr(fused, "liger_problem", lambda: None)
    v = dict(speed.variants("cuda"))
    assert list(v)[0] == "liger" and v["liger"] == fused.PIECES and v["torch"] == ()
    for p in fused.PIECES:          # each piece alone on PyTorch, the other three on Liger
        assert set(v[f"torch {p}"]) == set(fused.PIECES) - {p}
    assert speed.variants("cpu") == [("torch", ())]
    # under --compile: auto's pick first (the profiled one), then all Liger, then none
    c = speed.variants("cuda", compile=True)
    assert c[0][1] == fused.choose("auto", "cuda", compile=True) == ("loss",)
    assert dict(c)["compile, liger"] == fused.PIECES and dict(c)["compile, torch"] == ()


def test_speed_script_runs_on_cpu(tmp_path):
    """benchmarks/training/speed.py (the per-piece timing and profile) on a tiny model: on CPU
    only the PyTorch variant runs; its record and the profile table are written."""
    import json
    import subprocess
    root = os.path.join(os.path.dirname(__file__), "..")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    res = subprocess.run([sys.executable, "-m", "benchmarks.training.speed", "--device", "cpu", "--seq-len", "64",
                          "--batch-size", "1", "--no-progress", "--warm", "1", "--steps", "1",
                          "--out-dir", str(tmp_path),
                          "--profile-table", str(tmp_path / "t.txt"), "--top", "3",
                          "--trace", str(tmp_path / "trace.json.gz")],
                         cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    (rec,) = json.loads((tmp_path / "speed.json").read_text())["records"]
    assert rec["variant"] == "torch" and rec["tokens_per_s"] > 0 and rec["mfu"] is None
    assert "aten::" in (tmp_path / "t.txt").read_text()
    # the Chrome trace is written; on CPU it has no GPU events to find gaps between
    assert (tmp_path / "trace.json.gz").stat().st_size > 0 and "no GPU events" in res.stdout
