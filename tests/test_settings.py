"""cp_softcap.settings: every CP_SOFTCAP_* variable, its default and its validation."""
import pytest

from cp_softcap import settings

BAD = [
    ("CP_SOFTCAP_TIMEOUT", v, settings.timeout_s) for v in ("inf", "nan", "-1", "0", "soon", "1e999")
] + [
    ("CP_SOFTCAP_RING_BLOCK_KEYS", v, settings.ring_block_keys) for v in ("-1", "lots", "1.5")
] + [
    (name, "yes", fn) for name, fn in (("CP_SOFTCAP_FA3", settings.fa3_enabled),
                                       ("CP_SOFTCAP_CHECK_EVERY_CALL", settings.check_every_call),
                                       ("CP_SOFTCAP_FUSED_MERGE", settings.fused_merge))
] + [("CP_SOFTCAP_SDPA_OP", "math", settings.sdpa_op)]


@pytest.mark.parametrize("name,value,fn", BAD, ids=[f"{n}={v}" for n, v, _ in BAD])
def test_bad_value_names_the_variable_the_value_and_what_is_valid(name, value, fn, monkeypatch):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as e:
        fn()
    msg = str(e.value)
    assert name in msg and repr(value) in msg and "expected" in msg, msg


def test_defaults_and_good_values(monkeypatch):
    for name in ("CP_SOFTCAP_TIMEOUT", "CP_SOFTCAP_RING_BLOCK_KEYS", "CP_SOFTCAP_BACKEND",
                 "CP_SOFTCAP_FA3", "CP_SOFTCAP_CHECK_EVERY_CALL", "CP_SOFTCAP_FUSED_MERGE",
                 "CP_SOFTCAP_SDPA_OP"):
        monkeypatch.delenv(name, raising=False)
    assert settings.timeout_s() == 120.0 and settings.ring_block_keys() == 32768
    assert settings.backend() is None and settings.sdpa_op() is None
    assert not settings.fa3_enabled() and not settings.check_every_call() and settings.fused_merge()
    for name, value, fn, want in (("CP_SOFTCAP_TIMEOUT", "2.5", settings.timeout_s, 2.5),
                                  ("CP_SOFTCAP_RING_BLOCK_KEYS", "0", settings.ring_block_keys, 0),
                                  ("CP_SOFTCAP_BACKEND", "torch", settings.backend, "torch"),
                                  ("CP_SOFTCAP_BACKEND", "auto", settings.backend, None),
                                  ("CP_SOFTCAP_FA3", "1", settings.fa3_enabled, True),
                                  ("CP_SOFTCAP_FUSED_MERGE", "0", settings.fused_merge, False),
                                  ("CP_SOFTCAP_SDPA_OP", "flash", settings.sdpa_op, "flash")):
        monkeypatch.setenv(name, value)
        assert fn() == want, (name, value)


def test_docs_table_lists_every_setting():
    """One table, in docs/settings.md, documents every variable this module reads."""
    import pathlib
    import re
    root = pathlib.Path(settings.__file__).parent
    read = set(re.findall(r'"(CP_SOFTCAP_[A-Z0-9_]+)"', (root / "settings.py").read_text()))
    page = (root.parent / "docs" / "settings.md").read_text()
    rows = set(re.findall(r"^\| `(CP_SOFTCAP_[A-Z0-9_]+)`", page, flags=re.M))
    assert read == rows, f"docs/settings.md table {sorted(rows)} vs settings {sorted(read)}"
