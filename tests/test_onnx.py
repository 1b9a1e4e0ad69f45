"""ONNX: single-device cps.attention with softcap (and CPAttention with cp_group=None) exports
through torch.onnx.export and onnxruntime reproduces the eager result; the export path
(cp_softcap.export) equals the torch kernel. The CP refusal is tested in
tests_dist/test_bad_inputs_dist.py (it needs a process group)."""
import os
import subprocess
import sys

import pytest
import torch

import cp_softcap as cps
from cp_softcap.export import export_attention
from cp_softcap.export import refuse_cp
from cp_softcap.testing import saturating_qkv

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")


class Attn(torch.nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def forward(self, q, k, v):
        return cps.attention(q, k, v, **self.kw)


CASES = [   # (hq, hkv, softcap, causal, window, sq, sk)
    (4, 2, 50.0, True, None, 16, 16),
    (4, 1, 5.0, True, (5, 0), 16, 16),
    (2, 2, 1.0, False, (3, 4), 12, 20),
]


def _export_and_run(module, q, k, v, path):
    torch.onnx.export(module, (q, k, v), path, input_names=["q", "k", "v"], output_names=["out"],
                      dynamo=True)
    onnx.checker.check_model(onnx.load(path))
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    (got,) = sess.run(None, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy()})
    return torch.from_numpy(got)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES, ids=["gemma2-global", "gemma2-local-mqa", "two-sided-sq<sk"])
def test_attention_with_softcap_exports_and_matches_onnxruntime(case, tmp_path):
    hq, hkv, cap, causal, window, sq, sk = case
    q, k, v, frac = saturating_qkv(1, sq, sk, hq, hkv, 16, torch.float32, cap, requires_grad=False)
    kw = dict(softcap=cap, causal=causal, window=window, causal_align="bottom_right")
    eager = cps.attention(q, k, v, **kw)
    got = _export_and_run(Attn(**kw).eval(), q, k, v, str(tmp_path / "attn.onnx"))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, eager, rtol=2e-5, atol=2e-5)
    nocap = cps.attention(q, k, v, causal=causal, window=window, causal_align="bottom_right")
    assert (got - nocap).abs().max() > 1e-2, "the exported graph lost the softcap"


@pytest.mark.timeout(120)
def test_cpattention_without_group_exports(tmp_path):
    q, k, v, _ = saturating_qkv(1, 16, 16, 4, 2, 16, torch.float32, 50.0, requires_grad=False)
    layer = cps.CPAttention(None, softcap=50.0, window=(7, 0)).eval()
    got = _export_and_run(layer, q, k, v, str(tmp_path / "layer.onnx"))
    torch.testing.assert_close(got, layer(q, k, v), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("window,sq,sk", [(None, 24, 24), ((4, 0), 24, 24), ((2, 1), 10, 30),
                                          ((None, 0), 30, 10)])   # last: empty leading rows
def test_export_math_equals_torch_kernel(dtype, window, sq, sk):
    q, k, v, _ = saturating_qkv(2, sq, sk, 4, 2, 16, dtype, 5.0, requires_grad=False)
    scale = 16 ** -0.5
    out, lse = export_attention(q, k, v, scale=scale, softcap=5.0, window=window or (None, None))
    ref_out, ref_lse = cps.attention(q, k, v, softcap=5.0, causal=False, window=window,
                                     return_lse=True, backend="torch", causal_align="bottom_right")
    assert out.dtype == dtype and out.shape == ref_out.shape and lse.shape == ref_lse.shape
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.double(), ref_out.double(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), ref_lse.double(), rtol=tol, atol=tol)


def _exporting(monkeypatch):
    """Every module's is_exporting answers True. Each module binds its own name (from .export
    import is_exporting), and one left unpatched would let the raw-call plan cache serve a
    call planned before the export."""
    import sys

    import cp_softcap.export as export
    patched = [m for name, m in list(sys.modules.items()) if name.split(".")[0] == "cp_softcap"
               and getattr(m, "is_exporting", None) is export.is_exporting]
    assert {"cp_softcap.plan", "cp_softcap.plan_cache"} <= {m.__name__ for m in patched}
    for module in patched:
        monkeypatch.setattr(module, "is_exporting", lambda: True)


def test_forced_non_torch_backend_is_refused_under_export(monkeypatch):
    import cp_softcap.api as api
    q, k, v, _ = saturating_qkv(1, 8, 8, 2, 2, 16, torch.float32, None, requires_grad=False)
    cps.attention(q, k, v, backend="sdpa")      # the same call outside export: a warm plan cache
    _exporting(monkeypatch)
    with pytest.raises(ValueError, match="backend='sdpa' cannot be exported"):
        cps.attention(q, k, v, backend="sdpa")
    torch.testing.assert_close(cps.attention(q, k, v, causal=False, backend="torch"),
                               api.export_attention(q, k, v, scale=0.25, softcap=None, window=(None, None))[0])


def test_refuse_cp_is_a_value_error_under_python_O():
    """refuse_cp raises ValueError (not an assert) while exporting, also with python -O."""
    code = ("import torch, cp_softcap.plan as e\n"
            "torch.onnx.is_in_onnx_export = lambda: True\n"
            "e.refuse_cp(1)\n"
            "try:\n    e.refuse_cp(2)\nexcept ValueError as x:\n    print('OK', x)\n")
    r = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0 and r.stdout.startswith("OK") and "cp=2" in r.stdout, r.stdout + r.stderr
    refuse_cp(4)   # not exporting: no error
