"""The bad-input matrix (single process): every bad or edge input to cps.attention,
cp_attention / CPAttention, the sharding helpers, the selector and its CLI ends in either a clear
error (type, and a message naming the value and the fix) or a correct result checked against the
float64 reference. docs/failures.md's "Bad inputs" table lists these rows; the CP
rows that need a process group live in tests_dist/test_bad_inputs_dist.py. Every case is also run
under python -O (no asserts guard user input)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import cp_softcap as cps
from cp_softcap import sharding
from cp_softcap.testing import reference_attention
from cp_softcap.cli import main as select_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def qkv(b=1, s=16, hq=4, hkv=2, d=16, dtype=torch.float32, sk=None, grad=False, dv=None):
    q = torch.randn(b, s, hq, d, dtype=dtype) * 2
    k = torch.randn(b, s if sk is None else sk, hkv, d, dtype=dtype) * 2
    v = torch.randn(b, s if sk is None else sk, hkv, d if dv is None else dv, dtype=dtype)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def att(*, q=None, k=None, v=None, **kw):
    dq, dk, dv = qkv()
    return cps.attention(dq if q is None else q, dk if k is None else k, dv if v is None else v, **kw)


def cpa(**kw):
    return cps.cp_attention(*qkv(), None, **kw)


def layer(**kw):
    return cps.CPAttention(None, **kw)


def check_ref(q, k, v, **kw):
    """Run cps.attention forward and backward; compare with the float64 reference."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = cps.attention(q, k, v, **kw)
    sq, sk = q.shape[1], k.shape[1]     # bottom-right: queries aligned to the END of the keys
    ref, _ = reference_attention(q.detach(), k.detach(), v.detach(),
                                 **{key: kw[key] for key in ("softcap", "causal", "scale") if key in kw},
                                 window=kw.get("window") or (None, None), q_pos=torch.arange(sq) + sk - sq)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    out.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))
    return "ok"


def ok_transposed():
    """[B, H, S, D] storage viewed as [B, S, H, D] (the usual HF layout): works, matches."""
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in qkv())
    assert not q.is_contiguous()
    return check_ref(q, k, v, softcap=5.0, causal=True)


def ok_strided():
    """Every other token and a head-dim slice of wider tensors: works, matches."""
    q, k, v = qkv(s=32, d=32)
    return check_ref(q[:, ::2, :, :16], k[:, ::2, :, :16], v[:, ::2, :, :16], softcap=30.0, causal=True)


def ok_no_grad():
    q, k, v = qkv()
    out = cps.attention(q, k, v, softcap=50.0, causal=True)
    assert not out.requires_grad
    ref, _ = reference_attention(q, k, v, softcap=50.0, causal=True)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    return "ok"


def ok_empty(b, s, sk):
    q, k, v = qkv(b=b, s=s, sk=sk, grad=True)
    out = cps.attention(q, k, v, softcap=50.0, causal=True)
    assert out.shape == (b, s, 4, 16) and torch.all(out == 0)
    out.sum().backward()
    assert all(torch.all(t.grad == 0) for t in (q, k, v))
    return "ok"


def ok_zero_softcap():
    q, k, v = qkv()
    torch.testing.assert_close(cps.attention(q, k, v, softcap=0.0, causal=True),
                               cps.attention(q, k, v, softcap=None, causal=True), rtol=0, atol=0)
    return "ok"


def ok_big_head_dim():
    """head dim 512: the kernels with a maximum are rejected, auto falls back to one that serves it."""
    q, k, v = qkv(s=8, d=512)
    sel = cps.select(cps.make_spec(head_dim=512, num_heads=4, num_kv_heads=2, dtype=torch.float32,
                                   device_type="cpu", softcap=50.0, causal=True))
    assert sel.name == "torch"
    return check_ref(q, k, v, softcap=50.0, causal=True)


def ok_float64_sq_ne_sk():
    q, k, v = qkv(s=8, sk=20, dtype=torch.float64)
    return check_ref(q, k, v, softcap=5.0, causal=True, window=(3, 0), causal_align="bottom_right")


def ok_pad():
    x = torch.randn(2, 10, 3)
    y = sharding.pad_to_multiple(x, 4)
    assert y.shape == (2, 12, 3) and torch.equal(y[:, :10], x) and torch.all(y[:, 10:] == 0)
    return "ok"


def ok_shard_roundtrip_noncontiguous():
    x = torch.randn(2, 3, 16).transpose(1, 2)          # [2, 16, 3], non-contiguous
    parts = [sharding.shard(x, 4, r) for r in range(4)]
    assert torch.equal(sharding.unshard(parts), x)
    return "ok"


def ok_v_head_dim_other_than_qk():
    """v's head dim differs from q/k's: auto picks a kernel that serves it (not CPU sdpa)."""
    q, k, v = qkv(dv=32)
    check_ref(q, k, v, causal=True)
    return check_ref(q, k, v, softcap=5.0, causal=True)


def fa2_big_head_dim():
    spec = cps.make_spec(head_dim=512, num_heads=4, num_kv_heads=2, dtype=torch.bfloat16,
                         device_type="cuda", softcap=50.0, causal=True)
    return cps.select(spec, "fa2")


def cli(*argv):
    """The selector CLI: (exit code, stderr) like a shell sees it."""
    import contextlib
    import io
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            rc = select_main(list(argv))
        except SystemExit as e:     # argparse errors
            rc = e.code
    return rc, err.getvalue() + out.getvalue()


# (id, call, expected exception type or "ok", regex the message must match)
MATRIX = [
    # ---- cps.attention: tensors
    ("mixed-dtypes", lambda: att(k=qkv(dtype=torch.bfloat16)[1]), TypeError, r"share one dtype.*float32.*bfloat16"),
    ("mixed-devices", lambda: att(k=qkv()[1].to("meta")), ValueError, r"one device.*cpu.*meta"),
    ("q-3d", lambda: att(q=torch.randn(16, 4, 16)), ValueError, r"q must be 4-D.*\(16, 4, 16\)"),
    ("k-5d", lambda: att(k=torch.randn(1, 16, 2, 16, 1)), ValueError, r"k must be 4-D.*transpose"),
    ("q-not-tensor", lambda: att(q=[[1.0]]), TypeError, r"q must be a torch.Tensor, got list"),
    ("int-dtype", lambda: att(q=torch.ones(1, 16, 4, 16, dtype=torch.long)), TypeError, r"floating"),
    ("float8-dtype", lambda: cps.attention(*(t.to(torch.float8_e4m3fn) for t in qkv())), TypeError,
     r"float8.*not supported"),
    ("hq-not-multiple-of-hkv", lambda: att(q=torch.randn(1, 16, 3, 16)), ValueError, r"num_heads=3.*num_kv_heads=2"),
    ("zero-kv-heads", lambda: att(k=torch.randn(1, 16, 0, 16), v=torch.randn(1, 16, 0, 16)), ValueError,
     r"num_kv_heads=0"),
    ("head-dim-mismatch", lambda: att(k=torch.randn(1, 16, 2, 8)), ValueError, r"head dims differ: 16 vs 8"),
    ("zero-head-dim", lambda: cps.attention(*qkv(d=0)), ValueError, r"head_dim=0"),
    ("batch-mismatch", lambda: att(q=torch.randn(2, 16, 4, 16)), ValueError, r"batch sizes differ: q 2, k 1"),
    ("kv-len-mismatch", lambda: att(v=torch.randn(1, 15, 2, 16)), ValueError, r"sequence lengths differ: 16 vs 15"),
    ("head-dim-512-auto", ok_big_head_dim, "ok", ""),
    ("head-dim-512-forced-fa2", fa2_big_head_dim, ValueError, r"backend 'fa2'.*head dim 512 > its maximum"),
    # ---- cps.attention: options
    ("softcap-negative", lambda: att(softcap=-50.0), ValueError, r"softcap.*positive finite float, got -50\.0"),
    ("softcap-nan", lambda: att(softcap=float("nan")), ValueError, r"softcap.*nan"),
    ("softcap-inf", lambda: att(softcap=float("inf")), ValueError, r"softcap.*inf"),
    ("softcap-string", lambda: att(softcap="50"), TypeError, r"softcap.*'50'.*str"),
    ("softcap-bool", lambda: att(softcap=True), TypeError, r"softcap.*True.*bool"),
    ("softcap-tensor", lambda: att(softcap=torch.tensor(50.0)), TypeError, r"softcap.*Tensor"),
    ("softcap-zero-is-off", ok_zero_softcap, "ok", ""),
    ("window-negative", lambda: att(window=(-2, 0)), ValueError, r"window left side.*-2"),
    ("window-one-element", lambda: att(window=(3,)), ValueError, r"window must be None or a \(left, right\) pair"),
    ("window-float", lambda: att(window=(1.5, 0)), ValueError, r"left side.*1\.5"),
    ("window-string", lambda: att(window="sliding"), ValueError, r"window must be.*'sliding'"),
    ("window-future-with-causal", lambda: att(window=(4, 3), causal=True), ValueError,
     r"causal=True with window right side 3"),
    ("scale-zero", lambda: att(scale=0.0), ValueError, r"scale must be a positive finite float, got 0\.0"),
    ("scale-negative", lambda: att(scale=-0.1), ValueError, r"scale.*-0\.1"),
    ("scale-nan", lambda: att(scale=float("nan")), ValueError, r"scale.*nan"),
    ("scale-inf", lambda: att(scale=float("inf")), ValueError, r"scale.*inf"),
    ("scale-string", lambda: att(scale="0.1"), TypeError, r"scale.*'0\.1'"),
    ("causal-not-bool", lambda: att(causal="yes"), TypeError, r"causal must be a bool, got 'yes'"),
    ("backend-unknown", lambda: att(backend="cudnn"), ValueError, r"backend='cudnn' is not a kernel"),
    ("backend-sdpa-with-softcap", lambda: att(backend="sdpa", softcap=50.0), ValueError,
     r"backend 'sdpa' cannot serve.*softcap=50\.0.*silently dropped"),
    ("backend-fa3-not-opted-in", lambda: att(backend="fa3"), ValueError, r"fa3"),
    ("dropout-with-softcap", lambda: cps.make_spec(head_dim=16, num_heads=4, num_kv_heads=2,
                                                   dtype=torch.float32, device_type="cpu", softcap=50.0,
                                                   dropout=0.1), ValueError, r"softcap=50\.0 with dropout=0\.1"),
    ("dropout-kwarg-to-attention", lambda: att(dropout_p=0.1), TypeError, r"dropout_p"),
    ("hf-dropout-with-softcap", lambda: _hf_dropout(), ValueError, r"dropout=0\.1"),
    # ---- cps.attention: edge inputs with a correct result
    ("transposed-bhsd-storage", ok_transposed, "ok", ""),
    ("strided-slices", ok_strided, "ok", ""),
    ("no-requires-grad", ok_no_grad, "ok", ""),
    ("seq-len-0", lambda: ok_empty(2, 0, 0), "ok", ""),
    ("batch-0", lambda: ok_empty(0, 16, 16), "ok", ""),
    ("no-keys", lambda: ok_empty(1, 8, 0), "ok", ""),
    ("float64-sq<sk-window", ok_float64_sq_ne_sk, "ok", ""),
    # ---- cps.attention: Sq != Sk under a causal mask or a window needs its alignment said
    ("causal-sq-ne-sk-unaligned", lambda: att(q=torch.randn(1, 8, 4, 16)), ValueError,
     r"q has 8 tokens and k/v have 16.*\[batch, seq, heads, head_dim\].*causal_align='bottom_right'"),
    ("window-sq-ne-sk-unaligned", lambda: att(q=torch.randn(1, 8, 4, 16), causal=False, window=(3, 3)),
     ValueError, r"window=\(3, 3\).*causal_align"),
    ("sdpa-layout-bhsd", lambda: cps.attention(torch.randn(1, 4, 16, 16), *(torch.randn(1, 2, 16, 16)
                                                                           for _ in "kv"), softcap=50.0),
     ValueError, r"q has 4 tokens and k/v have 2.*q\.transpose\(1, 2\)"),
    ("causal-align-top-left", lambda: att(q=torch.randn(1, 8, 4, 16), causal_align="top_left"),
     ValueError, r"top_left.*not implemented.*k\[:, :Sq\]"),
    ("causal-align-unknown", lambda: att(causal_align="end"), ValueError,
     r"causal_align must be None or one of \('bottom_right',\), got 'end'"),
    ("cp_attention-one-device-unaligned", lambda: cps.cp_attention(torch.randn(1, 8, 4, 16),
                                                                   *qkv()[1:], None),
     ValueError, r"q has 8 tokens.*causal_align"),
    ("CPAttention-causal-align-unknown", lambda: layer(causal_align="bottom-right"), ValueError,
     r"causal_align.*'bottom-right'"),
    # ---- cp_attention / CPAttention (single process; the CP rows are in tests_dist)
    ("CPAttention-softcap-negative", lambda: layer(softcap=-1.0), ValueError, r"softcap.*-1\.0"),
    ("CPAttention-softcap-nan", lambda: layer(softcap=float("nan")), ValueError, r"softcap.*nan"),
    ("CPAttention-bad-comm", lambda: layer(comm="ring2"), ValueError, r"comm must be one of.*'ring2'"),
    ("CPAttention-bad-window", lambda: layer(window=(-3, 0)), ValueError, r"left side.*-3"),
    ("CPAttention-window-future-causal", lambda: layer(window=(8, 2)), ValueError, r"right side 2"),
    ("cp_attention-uninitialised-group", lambda: cps.cp_attention(*qkv(), object()), RuntimeError,
     r"torch.distributed is not initialised.*init_process_group"),
    ("cp_attention-bad-tensor", lambda: cps.cp_attention(torch.randn(4, 16), *qkv()[1:], None), ValueError, r"4-D"),
    ("cp_attention-scale-nan", lambda: cpa(scale=float("nan")), ValueError, r"scale.*nan"),
    ("cp_attention-int-group", lambda: cps.cp_attention(*qkv(), 2), TypeError,
     r"group=2 \(int\) is not a process group.*softcap=2"),
    ("CPAttention-int-group", lambda: cps.CPAttention(2), TypeError,
     r"group=2 \(int\) is not a process group.*softcap=2"),
    ("cp_attention-list-of-ranks", lambda: cps.cp_attention(*qkv(), [0, 1]), TypeError,
     r"list of ranks.*new_group\(\[0, 1\]\)"),
    ("CPAttention-list-of-ranks", lambda: cps.CPAttention([0, 1], comm="a2a+p2p"), TypeError,
     r"list of ranks"),
    ("make_hybrid_groups-float-size", lambda: cps.make_hybrid_groups(None, 4 / 2), TypeError,
     r"a2a_size=2.0 \(float\) must be an int"),
    ("attention-v-head-dim-other-than-qk", ok_v_head_dim_other_than_qk, "ok", ""),
    # ---- sharding helpers
    ("shard-indivisible", lambda: sharding.shard(torch.randn(1, 10, 2), 2, 0), ValueError,
     r"sequence length 10 on rank 0 is not a positive multiple of 2\*cp=4.*pad_to_multiple"),
    ("shard-seq-0", lambda: sharding.shard(torch.randn(1, 0, 2), 2, 0), ValueError, r"sequence length 0"),
    ("shard-cp-0", lambda: sharding.shard(torch.randn(1, 8, 2), 0, 0), ValueError, r"cp must be a positive int, got 0"),
    ("shard-cp-bool", lambda: sharding.shard(torch.randn(1, 8, 2), True, 0), ValueError, r"got True"),
    ("shard-rank-out-of-range", lambda: sharding.shard(torch.randn(1, 8, 2), 2, 2), ValueError,
     r"rank 2 is outside the CP group of size 2"),
    ("positions-indivisible", lambda: sharding.positions(10, 2, 0), ValueError, r"10 .*2\*cp=4"),
    ("pad-multiple-0", lambda: sharding.pad_to_multiple(torch.randn(1, 8), 0), ValueError, r"multiple.*got 0"),
    ("pad-to-multiple", ok_pad, "ok", ""),
    ("unshard-empty-list", lambda: sharding.unshard([]), ValueError, r"at least one shard"),
    ("unshard-odd-shards", lambda: sharding.unshard([torch.randn(1, 5), torch.randn(1, 5)]), ValueError,
     r"5 .*not even"),
    ("unshard-unequal-shards", lambda: sharding.unshard([torch.randn(1, 4), torch.randn(1, 6)]), ValueError,
     r"rank 1.*6.*rank 0.*4"),
    ("shard-unshard-noncontiguous", ok_shard_roundtrip_noncontiguous, "ok", ""),
    ("shard-1d-default-dim", lambda: sharding.shard(torch.arange(8), 2, 0), ValueError,
     r"shape \(8,\).*no dim 1.*dim=0"),
    ("cpattention-backend-typo", lambda: cps.CPAttention(None, backend="flash2"), ValueError,
     r"backend='flash2' is not a kernel.*'fa2'"),
    # ---- the selector CLI (exit code 2 and a message, never a traceback)
    ("cli-softcap-negative", lambda: cli("--softcap", "-1"), 2, r"error: softcap.*-1\.0"),
    ("cli-softcap-nan", lambda: cli("--softcap", "nan"), 2, r"error: softcap.*nan"),
    ("cli-softcap-word", lambda: cli("--softcap", "big"), 2, r"invalid float value: 'big'"),
    ("cli-gqa-mismatch", lambda: cli("--heads", "3", "--kv-heads", "2"), 2, r"num_heads=3.*num_kv_heads=2"),
    ("cli-forced-sdpa-softcap", lambda: cli("--softcap", "50", "--backend", "sdpa", "--device", "cpu"), 2,
     r"backend 'sdpa' cannot serve.*softcap"),
    ("cli-fa3-under-cp", lambda: cli("--backend", "fa3", "--cp", "2", "--device", "cuda"), 2, r"fa3"),
    ("cli-window-negative", lambda: cli("--window", "-5", "0"), 2, r"window left side.*-5"),
    ("cli-window-word", lambda: cli("--window", "abc", "0"), 2, r"invalid _window_side value: 'abc'"),
    ("cli-cp-0", lambda: cli("--cp", "0"), 2, r"cp_size must be a positive int, got 0"),
    ("cli-comm-unknown", lambda: cli("--comm", "nccl"), 2, r"invalid choice: 'nccl'.*choose from.*ring"),
    ("cli-dtype-unknown", lambda: cli("--dtype", "int8"), 2, r"invalid choice: 'int8'"),
    ("cli-head-dim-0", lambda: cli("--head-dim", "0"), 2, r"head_dim=0"),
    ("cli-heads-0", lambda: cli("--heads", "0"), 2, r"every head count must be >= 1"),
    ("cli-a2a-heads-indivisible", lambda: cli("--cp", "3", "--comm", "a2a"), 2,
     r"16 query heads cannot be split over an all-to-all group of 3"),
    ("cli-a2a-size-without-seq-len", lambda: cli("--a2a-size", "2"), 2, r"needs --seq-len"),
    ("cli-a2a-p2p-without-size", lambda: cli("--comm", "a2a+p2p", "--cp", "4"), 2, r"needs --a2a-size"),
    ("cli-ok", lambda: cli("--softcap", "50", "--cp", "2", "--device", "cpu", "--dtype", "fp32",
                           "--window", "4095", "0", "--causal"), 0, r"torch +CHOSEN"),
]


def _hf_dropout():
    from cp_softcap.integrations.hf import cp_softcap_attention
    q = torch.randn(1, 4, 8, 16)
    return cp_softcap_attention(torch.nn.Module(), q, q[:, :2], q[:, :2], dropout=0.1, softcap=50.0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name,call,expected,pattern", MATRIX, ids=[m[0] for m in MATRIX])
def test_bad_input_matrix(name, call, expected, pattern):
    if expected == "ok":
        assert call() == "ok"
    elif isinstance(expected, int):                 # CLI exit code
        rc, text = call()
        assert rc == expected, text
        assert "Traceback" not in text
        assert pytest.importorskip("re").search(pattern, text, flags=pytest.importorskip("re").S), text
    else:
        with pytest.raises(expected, match=pattern):
            call()


def test_matrix_is_big_enough():
    assert len(MATRIX) >= 25
    assert sum(1 for m in MATRIX if m[2] == "ok") >= 8


@pytest.mark.timeout(120)
def test_error_rows_hold_under_python_O():
    """Every raising row raises the same way when asserts are stripped."""
    code = ("import sys; sys.path.insert(0, 'tests'); import torch, test_bad_inputs as t\n"
            "bad = []\n"
            "for name, call, exp, pat in t.MATRIX:\n"
            "    if exp == 'ok' or isinstance(exp, int) or name.startswith('hf-'):\n        continue\n"
            "    try:\n        call()\n        bad.append((name, 'no error'))\n"
            "    except exp:\n        pass\n"
            "    except Exception as e:\n        bad.append((name, repr(e)))\n"
            "print('BAD', bad)\n")
    r = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, cwd=ROOT,
                       timeout=110)
    assert r.returncode == 0 and "BAD []" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
