"""Every bad user input raises ValueError/TypeError with a message that names the value, through
make_spec, check_qkv and cps.attention; and the checks do not rely on `assert` (python -O)."""
import math
import subprocess
import sys
import textwrap

import pytest
import torch

import cp_softcap as cps
from cp_softcap.spec import check_qkv, make_spec, normalize_softcap, normalize_window

BASE = dict(head_dim=64, num_heads=8, num_kv_heads=4, dtype=torch.bfloat16, device_type="cpu")


def mk(**kw):
    return make_spec(**{**BASE, **kw})


# ------------------------------------------------------------------ softcap
@pytest.mark.parametrize("cap,exc,text", [
    (-1.0, ValueError, "-1.0"),
    (-50, ValueError, "-50.0"),
    (float("nan"), ValueError, "nan"),
    (float("inf"), ValueError, "inf"),
    (float("-inf"), ValueError, "-inf"),
    ("50", TypeError, "'50'"),
    (True, TypeError, "True"),
    (False, TypeError, "False"),
    (torch.tensor(50.0), TypeError, "tensor"),
    ([50.0], TypeError, "[50.0]"),
])
def test_bad_softcap(cap, exc, text):
    with pytest.raises(exc) as e:
        mk(softcap=cap)
    assert text in str(e.value)
    with pytest.raises(exc):
        normalize_softcap(cap)


@pytest.mark.parametrize("cap,expected", [(None, None), (0.0, None), (0, None), (50, 50.0), (1e-3, 1e-3)])
def test_good_softcap(cap, expected):
    assert mk(softcap=cap).softcap == expected


# ------------------------------------------------------------------ window / causal
@pytest.mark.parametrize("window,text", [
    ((-2, 0), "-2"),
    ((0, -5), "-5"),
    ((1.5, 0), "1.5"),
    (("4", 0), "'4'"),
    ((True, 0), "True"),
    ((4,), "(4,)"),
    ((1, 2, 3), "(1, 2, 3)"),
    (4095, "4095"),
    ("full", "'full'"),
])
def test_bad_window(window, text):
    with pytest.raises(ValueError) as e:
        mk(window=window)
    assert text in str(e.value)


def test_causal_with_right_window():
    with pytest.raises(ValueError, match="right side 7"):
        mk(causal=True, window=(16, 7))
    assert mk(causal=True, window=(16, 0)).window == (16, 0)
    assert mk(causal=True, window=(16, None)).window == (16, 0)   # causal forces right = 0
    assert mk(causal=True).window == (None, 0)


@pytest.mark.parametrize("window,expected", [(None, (None, None)), ((-1, -1), (None, None)),
                                             ((4095, 0), (4095, 0)), ([3, None], (3, None))])
def test_good_window(window, expected):
    assert normalize_window(window, False) == expected


def test_causal_not_bool():
    with pytest.raises(TypeError, match="'yes'"):
        mk(causal="yes")


# ------------------------------------------------------------------ scale, heads, dropout, misc
@pytest.mark.parametrize("scale,exc,text", [
    (0.0, ValueError, "0.0"), (-0.1, ValueError, "-0.1"), (float("nan"), ValueError, "nan"),
    (float("inf"), ValueError, "inf"), ("0.1", TypeError, "'0.1'"), (True, TypeError, "True"),
])
def test_bad_scale(scale, exc, text):
    with pytest.raises(exc) as e:
        mk(scale=scale)
    assert text in str(e.value)


def test_default_scale():
    assert math.isclose(mk().scale, 64 ** -0.5)


@pytest.mark.parametrize("hq,hkv", [(8, 3), (6, 4), (8, 0), (8, -2)])
def test_bad_gqa(hq, hkv):
    with pytest.raises(ValueError) as e:
        mk(num_heads=hq, num_kv_heads=hkv)
    assert f"num_heads={hq}" in str(e.value) and f"num_kv_heads={hkv}" in str(e.value)


@pytest.mark.parametrize("dropout,text", [(0.1, "dropout=0.1"), (1.0, "1.0"), (-0.1, "-0.1"),
                                          (float("nan"), "nan"), ("0.1", "'0.1'")])
def test_bad_dropout(dropout, text):
    with pytest.raises(ValueError) as e:
        mk(dropout=dropout)
    assert text in str(e.value)


def test_softcap_with_dropout():
    with pytest.raises(ValueError, match=r"softcap=50.0 with dropout=0.1"):
        mk(softcap=50.0, dropout=0.1)


@pytest.mark.parametrize("kw,exc,text", [
    (dict(dtype=torch.int32), TypeError, "torch.int32"),
    (dict(dtype=torch.float8_e4m3fn), TypeError, "float8"),
    (dict(comm="ring2"), ValueError, "'ring2'"),
    (dict(cp_size=0), ValueError, "0"),
    (dict(cp_size=2.0), ValueError, "2.0"),
    (dict(cp_size=True), ValueError, "True"),
])
def test_bad_misc(kw, exc, text):
    with pytest.raises(exc) as e:
        mk(**kw)
    assert text in str(e.value)


# ------------------------------------------------------------------ tensors (check_qkv and cps.attention)
def t(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, dtype=dtype) if device == "cpu" else torch.empty(*shape, dtype=dtype, device=device)


@pytest.mark.parametrize("qkv,exc,text", [
    ((t(2, 8, 4, 16), t(2, 8, 2, 16), t(2, 8, 2, 16, dtype=torch.float16)), TypeError, "torch.float16"),
    ((t(2, 8, 4, 16, dtype=torch.bfloat16), t(2, 8, 2, 16), t(2, 8, 2, 16)), TypeError, "torch.bfloat16"),
    ((t(2, 8, 4, 16), t(2, 8, 2, 16, device="meta"), t(2, 8, 2, 16)), ValueError, "meta"),
    ((t(8, 4, 16), t(2, 8, 2, 16), t(2, 8, 2, 16)), ValueError, "(8, 4, 16)"),
    ((t(2, 8, 4, 16), t(1, 2, 8, 2, 16), t(2, 8, 2, 16)), ValueError, "(1, 2, 8, 2, 16)"),
    ((t(2, 8, 4, 16), t(2, 8, 2, 16), t(2, 8, 2)), ValueError, "(2, 8, 2)"),
    ((torch.ones(2, 8, 4, 16, dtype=torch.int64), t(2, 8, 2, 16), t(2, 8, 2, 16)), TypeError, "torch.int64"),
    (([[1.0]], t(2, 8, 2, 16), t(2, 8, 2, 16)), TypeError, "list"),
    ((t(2, 8, 4, 16), t(3, 8, 2, 16), t(3, 8, 2, 16)), ValueError, "q 2, k 3"),
    ((t(2, 8, 4, 16), t(2, 8, 2, 16), t(2, 9, 2, 16)), ValueError, "8 vs 9"),
    ((t(2, 8, 4, 16), t(2, 8, 2, 16), t(2, 8, 1, 16)), ValueError, "2 vs 1"),
    ((t(2, 8, 4, 16), t(2, 8, 2, 32), t(2, 8, 2, 32)), ValueError, "16 vs 32"),
    ((t(2, 8, 6, 16), t(2, 8, 4, 16), t(2, 8, 4, 16)), ValueError, "num_heads=6"),
    ((t(2, 8, 4, 16), t(2, 8, 0, 16), t(2, 8, 0, 16)), ValueError, "num_kv_heads=0"),
])
def test_bad_tensors(qkv, exc, text):
    with pytest.raises(exc) as e:
        check_qkv(*qkv)
    assert text in str(e.value)
    with pytest.raises(exc) as e:
        cps.attention(*qkv, softcap=50.0)
    assert text in str(e.value)


@pytest.mark.parametrize("kw,exc,text", [
    (dict(softcap=-3.0), ValueError, "-3.0"), (dict(softcap=float("nan")), ValueError, "nan"),
    (dict(softcap=True), TypeError, "True"), (dict(window=(-3, 0)), ValueError, "-3"),
    (dict(causal=True, window=(4, 4)), ValueError, "right side 4"), (dict(scale=0.0), ValueError, "0.0"),
    (dict(backend="fa9"), ValueError, "'fa9'"), (dict(softcap=5.0, backend="sdpa"), ValueError, "softcap=5.0"),
])
def test_attention_bad_options(kw, exc, text):
    q, k, v = t(1, 8, 4, 16), t(1, 8, 2, 16), t(1, 8, 2, 16)
    with pytest.raises(exc) as e:
        cps.attention(q, k, v, **kw)
    assert text in str(e.value)


def test_module_validates_at_construction():
    with pytest.raises(ValueError, match="-1.0"):
        cps.CPAttention(None, softcap=-1.0)
    with pytest.raises(ValueError, match="'bogus'"):
        cps.CPAttention(None, softcap=50.0, comm="bogus")


_UNDER_O = textwrap.dedent("""
    import sys, torch
    assert sys.flags.optimize >= 1, "not running under -O"
    import cp_softcap as cps
    from cp_softcap.spec import make_spec
    results = []
    def expect(exc, text, fn):
        try:
            fn()
        except exc as e:
            results.append(text in str(e))
        else:
            results.append(False)
    base = dict(head_dim=64, num_heads=8, num_kv_heads=4, dtype=torch.bfloat16, device_type="cpu")
    expect(ValueError, "-1.0", lambda: make_spec(**base, softcap=-1.0))
    expect(ValueError, "nan", lambda: make_spec(**base, softcap=float("nan")))
    expect(TypeError, "True", lambda: make_spec(**base, softcap=True))
    expect(ValueError, "right side 3", lambda: make_spec(**base, causal=True, window=(8, 3)))
    expect(ValueError, "num_kv_heads=3", lambda: make_spec(**{**base, "num_kv_heads": 3}))
    expect(ValueError, "0.0", lambda: make_spec(**base, scale=0.0))
    q, k = torch.randn(1, 8, 4, 16), torch.randn(1, 8, 3, 16)
    expect(ValueError, "num_heads=4", lambda: cps.attention(q, k, k, softcap=50.0))
    expect(TypeError, "float16", lambda: cps.attention(q, q.half(), q, softcap=50.0))
    print(results)
    sys.exit(0 if all(results) and len(results) == 8 else 1)
""")


def test_checks_survive_python_O():
    res = subprocess.run([sys.executable, "-O", "-c", _UNDER_O], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
