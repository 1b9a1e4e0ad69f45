"""The selector: one test per row of RULES (on stub kernels, so each rule is isolated from the
adapters' own declarations), then the real table: softcap never selects sdpa, fa3 opt-in and never
under CP, forced backends, CP_SOFTCAP_BACKEND, unknown names, caching, preference, and the CLI."""
import dataclasses
import subprocess
import sys

import pytest
import torch

from cp_softcap import selector
from cp_softcap.kernels import KERNEL_NAMES, get_kernel
from cp_softcap.kernels.base import Capabilities, Kernel
from cp_softcap.cli import main as cli_main
from cp_softcap.selector import RULES, clear_cache, rejection, select
from cp_softcap.spec import make_spec

ALL_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
DEVICES = frozenset({"cpu", "cuda"})


class Stub(Kernel):
    """A kernel that can do everything unless told otherwise."""

    def __init__(self, name="stub", probe_result=None, **caps):
        self.name = name
        base = dict(softcap=True, window=True, gqa=True, dtypes=ALL_DTYPES, devices=DEVICES,
                    backward_devices=DEVICES, max_head_dim=1 << 30, head_dim_multiple=1, cp=True,
                    dlse=True, deterministic_backward=True)
        base.update(caps)
        self.caps = Capabilities(**base)
        self._probe = probe_result

    def probe(self, spec):
        if isinstance(self._probe, Exception):
            raise self._probe
        return self._probe


def spec(**kw):
    base = dict(head_dim=64, num_heads=4, num_kv_heads=4, dtype=torch.float32, device_type="cpu")
    base.update(kw)
    return make_spec(**base)


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv("CP_SOFTCAP_BACKEND", raising=False)
    monkeypatch.delenv("CP_SOFTCAP_FA3", raising=False)
    clear_cache()
    yield
    clear_cache()


def firing(name, s, kernel):
    """Indices of the RULES rows that reject `kernel` (called `name`) for spec `s`."""
    return [i for i, r in enumerate(RULES)
            if (r.kernels == ("*",) or name in r.kernels) and r.rejects(s, kernel)]



# (id, kernel name, stub caps, triggering spec kwargs, clean spec kwargs, env, reason fragment)
RULE_CASES = [
    ("device", "torch", dict(devices=frozenset({"cpu"})), dict(device_type="cuda"), dict(), {},
     "does not run on cuda"),
    ("backward", "torch", dict(backward_devices=frozenset({"cuda"})), dict(), dict(needs_backward=False), {},
     "has no backward on cpu"),
    ("dtype", "torch", dict(dtypes=frozenset({torch.float16, torch.bfloat16})), dict(dtype=torch.float32),
     dict(dtype=torch.bfloat16), {}, "does not support dtype float32"),
    ("softcap", "torch", dict(softcap=False), dict(softcap=5.0), dict(softcap=0.0), {},
     "cannot apply softcap=5.0"),
    ("window", "torch", dict(window=False), dict(window=(10, 0), causal=True), dict(causal=True), {},
     "cannot apply window=(10, 0)"),
    ("gqa", "torch", dict(gqa=False), dict(num_heads=8, num_kv_heads=2), dict(num_heads=8, num_kv_heads=8), {},
     "cannot serve GQA (8 query / 2 kv heads)"),
    ("max_head_dim", "torch", dict(max_head_dim=256), dict(head_dim=512), dict(head_dim=256), {},
     "head dim 512 > its maximum 256"),
    ("head_dim_multiple", "torch", dict(head_dim_multiple=8), dict(head_dim=100), dict(head_dim=96), {},
     "head dim 100 is not a multiple of 8"),
    ("cp", "torch", dict(cp=False), dict(cp_size=4), dict(cp_size=1), {},
     "excluded under context parallelism (cp=4)"),
    ("dlse", "torch", dict(dlse=False), dict(return_lse=True), dict(return_lse=True, needs_backward=False), {},
     "cannot back-propagate through the returned LSE"),
    ("deterministic", "torch", dict(deterministic_backward=False), dict(deterministic=True),
     dict(deterministic=True, needs_backward=False), {}, "no deterministic backward"),
    ("fa3_opt_in", "fa3", dict(), dict(device_type="cuda"), dict(device_type="cuda"), {"clean": "1"},
     "CP_SOFTCAP_FA3=1"),
    ("fa3_never_cp", "fa3", dict(), dict(device_type="cuda", cp_size=8), dict(device_type="cuda"),
     {"trigger": "1", "clean": "1"}, "not under context parallelism (cp=8): FA3's context-parallel path cannot carry the softcap"),
    ("sdpa_no_varlen", "sdpa", dict(segments=True), dict(documents=True), dict(), {},
     "PyTorch SDPA has no variable-length path that returns the LSE"),
    ("segments", "torch", dict(segments=False), dict(documents=True), dict(), {},
     "cannot separate packed documents (no segments= support)"),
]


def _make(kw):
    kw = dict(kw)
    det = kw.pop("deterministic", None)
    s = spec(**kw)
    return dataclasses.replace(s, deterministic=True) if det else s


@pytest.mark.parametrize("case", RULE_CASES, ids=[c[0] for c in RULE_CASES])
def test_rule(case, monkeypatch):
    """Each rule rejects exactly its case, with its reason, and only that rule fires; the same
    kernel serves the clean variant of the spec."""
    _, name, caps, trigger, clean, env, fragment = case
    kernel = Stub(name, **caps)
    monkeypatch.setattr(selector, "get_kernel", lambda n: kernel)
    if "trigger" in env:
        monkeypatch.setenv("CP_SOFTCAP_FA3", env["trigger"])
    s = _make(trigger)
    fired = firing(name, s, kernel)
    assert len(fired) == 1, f"expected exactly one rule to fire, got {fired}"
    reason = rejection(name, s)
    assert reason is not None and fragment in reason, reason
    assert RULES[fired[0]].reason(s, kernel) == reason
    if "clean" in env:
        monkeypatch.setenv("CP_SOFTCAP_FA3", env["clean"])
    else:
        monkeypatch.delenv("CP_SOFTCAP_FA3", raising=False)
    assert rejection(name, _make(clean)) is None


def test_every_rule_has_a_test(monkeypatch):
    covered = set()
    for _, name, caps, trigger, _, env, _ in RULE_CASES:
        kernel = Stub(name, **caps)
        if "trigger" in env:
            monkeypatch.setenv("CP_SOFTCAP_FA3", env["trigger"])
        else:
            monkeypatch.delenv("CP_SOFTCAP_FA3", raising=False)
        covered.update(firing(name, _make(trigger), kernel))
    assert covered == set(range(len(RULES))), f"RULES rows without a test: {set(range(len(RULES))) - covered}"


def test_probe_failure_and_crash_fail_closed(monkeypatch):
    kernels = {"a": Stub("a", probe_result="no GPU here"), "b": Stub("b", probe_result=RuntimeError("boom"))}
    monkeypatch.setattr(selector, "get_kernel", lambda n: kernels[n])
    assert rejection("a", spec()) == "no GPU here"
    assert rejection("b", spec()) == "probe failed: RuntimeError: boom"


def test_unimportable_adapter_is_rejected_with_reason(monkeypatch):
    def broken(n):
        raise ImportError(f"No module named 'flash_attn_{n}'")
    monkeypatch.setattr(selector, "get_kernel", broken)
    assert rejection("fa2", spec()).startswith("adapter not importable: No module named")


# ---------------------------------------------------------------- the real table and kernels

@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("extra", [dict(), dict(causal=True), dict(cp_size=8), dict(return_lse=True),
                                   dict(needs_backward=False), dict(num_kv_heads=2)],
                         ids=["plain", "causal", "cp8", "lse", "fwd_only", "gqa"])
def test_softcap_never_selects_sdpa(device, dtype, extra):
    s = spec(device_type=device, dtype=dtype, softcap=50.0, **extra)
    sel = select(s)
    assert sel.name != "sdpa"
    assert "softcap=50.0" in sel.rejected["sdpa"]
    assert get_kernel(sel.name).caps.softcap


def test_forced_sdpa_with_softcap_raises_naming_rule():
    with pytest.raises(ValueError, match=r"backend 'sdpa' cannot serve this call: cannot apply softcap=5\.0"):
        select(spec(softcap=5.0), "sdpa")


def test_forced_sdpa_with_window_raises_naming_rule():
    with pytest.raises(ValueError, match=r"'sdpa'.*cannot apply window=\(10, 0\)"):
        select(spec(window=(10, 0), causal=True), "sdpa")


def test_fa3_is_never_chosen_under_cp(monkeypatch):
    monkeypatch.setenv("CP_SOFTCAP_FA3", "1")
    for cp in (2, 8):
        s = spec(device_type="cuda", dtype=torch.bfloat16, softcap=50.0, cp_size=cp, head_dim=128)
        sel = select(s)
        assert sel.name != "fa3" and sel.rejected["fa3"]
        with pytest.raises(ValueError, match="'fa3'"):
            select(s, "fa3")


def test_fa3_needs_opt_in_and_cache_sees_env(monkeypatch):
    """With an fa3 that could serve everything, only CP_SOFTCAP_FA3=1 makes it eligible, and a
    cached selection does not outlive a change of the variable."""
    real = selector.get_kernel
    fa3 = Stub("fa3")
    monkeypatch.setattr(selector, "get_kernel", lambda n: fa3 if n == "fa3" else real(n))
    s = spec(device_type="cuda", dtype=torch.bfloat16, softcap=50.0)
    assert select(s).name != "fa3"
    assert "CP_SOFTCAP_FA3=1" in select(s).rejected["fa3"]
    monkeypatch.setenv("CP_SOFTCAP_FA3", "1")
    assert select(s).name == "fa3"          # first in cuda preference once opted in
    monkeypatch.setenv("CP_SOFTCAP_FA3", "0")
    assert select(s).name != "fa3"
    with pytest.raises(ValueError, match="CP_SOFTCAP_FA3=1"):
        select(s, "fa3")


def test_flex_has_no_cpu_backward():
    sel = select(spec(softcap=30.0))
    assert "no backward on cpu" in sel.rejected["flex"] or "not importable" in sel.rejected["flex"]


@pytest.mark.parametrize("kw,expected", [
    (dict(), "sdpa"),                                            # no cap on CPU: fused sdpa
    (dict(softcap=50.0), "torch"),
    (dict(return_lse=True), "torch"),                            # sdpa has no dLSE
    (dict(return_lse=True, needs_backward=False), "sdpa"),
    (dict(window=(8, 0), causal=True), "torch"),                 # sdpa: no windows
    (dict(causal=True), "sdpa"),
])
def test_cpu_preference(kw, expected):
    assert select(spec(**kw)).name == expected


@pytest.mark.parametrize("cp,comm", [(1, "ring"), (2, "ring"), (2, "all_gather"), (2, "a2a"),
                                     (4, "a2a+p2p"), (2, "auto")])
def test_v_head_dim_other_than_qk_never_selects_sdpa_on_cpu(cp, comm):
    """The CPU SDPA ops need one head size: head_dim_v != head_dim goes to a kernel that serves
    it, on one device and under every comm type; forcing sdpa names the reason."""
    s = spec(head_dim=32, head_dim_v=64, cp_size=cp, comm=comm)
    sel = select(s)
    assert sel.name == "torch", sel.table()
    assert "v head dim 64 != q/k head dim 32" in sel.rejected["sdpa"]
    with pytest.raises(ValueError, match="v head dim 64 != q/k head dim 32"):
        select(s, "sdpa")


def test_v_head_dim_other_than_qk_end_to_end_on_cpu():
    import cp_softcap as cps
    from cp_softcap.testing import reference_attention
    q, k = (torch.randn(1, 16, 2, 8, dtype=torch.float64) * 4 for _ in range(2))
    v = torch.randn(1, 16, 2, 16, dtype=torch.float64)
    want = reference_attention(q, k, v, causal=True)[0]
    got = cps.attention(q.float(), k.float(), v.float())
    assert got.shape == (1, 16, 2, 16) and torch.isfinite(got).all()
    assert (got.double() - want).abs().max() < 1e-5


def test_backend_env_var_forces(monkeypatch):
    monkeypatch.setenv("CP_SOFTCAP_BACKEND", "torch")
    sel = select(spec())
    assert sel.name == "torch" and sel.forced
    assert select(spec(), "sdpa").name == "sdpa"        # an explicit backend= wins over the env
    monkeypatch.setenv("CP_SOFTCAP_BACKEND", "sdpa")
    with pytest.raises(ValueError, match="cannot apply softcap"):
        select(spec(softcap=5.0))
    monkeypatch.setenv("CP_SOFTCAP_BACKEND", "auto")
    assert select(spec(softcap=5.0)).name == "torch"


def test_unknown_backend_names():
    with pytest.raises(ValueError, match=r"backend='fa5' is not a kernel; choose one of"):
        select(spec(), "fa5")


def test_unknown_backend_in_env(monkeypatch):
    monkeypatch.setenv("CP_SOFTCAP_BACKEND", "nope")
    with pytest.raises(ValueError, match=r"'nope'.*CP_SOFTCAP_BACKEND"):
        select(spec())


def test_no_kernel_can_serve_names_every_reason():
    with pytest.raises(ValueError) as e:
        select(spec(device_type="mps"))
    for name in KERNEL_NAMES:
        assert f"{name}:" in str(e.value)


def test_caching():
    s = spec(softcap=50.0)
    a = select(s)
    assert select(spec(softcap=50.0)) is a             # equal specs hit the cache
    assert select(s, "torch") is not a                 # forced is a different key
    assert select(spec(softcap=30.0)) is not a
    clear_cache()
    assert select(s) is not a and select(s).name == a.name


def test_selection_table_lists_every_kernel():
    sel = select(spec(softcap=50.0))
    table = sel.table()
    for name in KERNEL_NAMES:
        assert name in table
    assert table.count("CHOSEN") == 1 and "torch   CHOSEN" in table
    assert set(sel.rejected) == set(KERNEL_NAMES) - {"torch"}


# ---------------------------------------------------------------- CLI

def test_cli_prints_table(capsys):
    rc = cli_main(["--softcap", "50", "--head-dim", "256", "--heads", "16", "--kv-heads", "8", "--cp", "8",
                   "--device", "cpu", "--dtype", "bf16", "--window", "4095", "0", "--causal"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "softcap=50.0" in out and "window=(4095, 0)" in out and "cp=8" in out
    assert "torch   CHOSEN" in out
    assert "sdpa    rejected" in out and "cannot apply softcap=50.0" in out


@pytest.mark.parametrize("argv,msg", [
    (["--softcap", "-1", "--device", "cpu"], "-1.0"),
    (["--softcap", "50", "--device", "cpu", "--backend", "sdpa"], "cannot apply softcap=50.0"),
    (["--heads", "6", "--kv-heads", "4", "--device", "cpu"], "num_heads=6"),
    (["--device", "cpu", "--backend", "fa5"], "'fa5'"),
    (["--device", "cpu", "--causal", "--window", "4", "2"], "window right side 2"),
])
def test_cli_errors_exit_2(capsys, argv, msg):
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and msg in err


def test_cli_bad_argument_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["--dtype", "int8"])
    assert e.value.code == 2


def test_cli_as_module():
    ok = subprocess.run([sys.executable, "-m", "cp_softcap", "--softcap", "30", "--device", "cpu",
                         "--dtype", "fp32"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "torch   CHOSEN" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "cp_softcap", "--softcap", "nan", "--device", "cpu"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "nan" in bad.stderr


def test_cli_help_shows_every_default(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for default in ("(default: None)", "(default: 128)", "(default: 16)", "(default: bf16)",
                    "(default: True)", "(default: 1)", "(default: ring)", "(default: auto)"):
        assert default in text, default
    assert text.count("(default:") >= 13, text
