"""scripts/stage_gpu_extras.py and scripts/install_gpu_extras.py without a network or a GPU: the
pinned list parses into groups; small stand-in wheels (one repacked as .tar.xz) are packed into
size-limited folders, one of them split across folders; the installer reports the group that
waits for a missing folder, and with every folder present rebuilds each wheel byte for byte in
content (the same files, the same bytes)."""
import importlib.util
import os
import random
import shutil
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


stage, install = _load("stage_gpu_extras"), _load("install_gpu_extras")


def _wheel(folder, name, version, size, seed):
    path = os.path.join(folder, f"{name}-{version}-py3-none-any.whl")
    data = random.Random(seed).randbytes(size)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(f"{name}/lib.bin", data)
        z.writestr(f"{name}-{version}.dist-info/RECORD", "")
    return path


def test_the_pinned_list():
    groups = stage.read_groups()
    assert {"fa4", "liger", "peers", "fa2"} <= set(groups)
    assert all("==" in r for rs in groups.values() for r in rs)
    assert "flash-attn-4==4.0.0b36" in groups["fa4"]


def test_pack_split_and_install_round_trip(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    small = _wheel(str(wheels), "small_pkg", "1.0", 20_000, 7)
    big = _wheel(str(wheels), "big_pkg", "2.0", 300_000, 13)
    packed_big = stage.recompress(big, str(wheels))
    assert packed_big.endswith(".whl.tar.xz")
    prefix = str(tmp_path / ".gpu_extras_")
    folders = stage.pack([("g1", os.path.basename(small), small),
                          ("g2", os.path.basename(big), packed_big)],
                         part_bytes=os.path.getsize(packed_big) // 2 + 1, prefix=prefix)
    assert len(folders) >= 2
    entries = {e["wheel"]: e for e in install.manifest(prefix)["files"]}
    assert len(entries[os.path.basename(big)]["chunks"]) >= 2        # split across folders
    assert entries[os.path.basename(small)]["chunks"][0]["part"] == 1

    pip_calls = []
    monkeypatch.setattr(install, "installed", lambda wheel: False)
    monkeypatch.setattr(install.subprocess, "run",
                        lambda cmd: pip_calls.append(cmd) or type("R", (), {"returncode": 0})())
    last = folders[-1]
    hidden = last + ".away"
    os.rename(last, hidden)                 # the last folder not uploaded yet
    assert install.main(["--prefix", prefix]) == 3
    assert [os.path.basename(w) for w in pip_calls[0][8:]] == [os.path.basename(small)]
    os.rename(hidden, last)
    out = tmp_path / "rebuilt"
    out.mkdir()
    rebuilt = install.assemble(entries[os.path.basename(big)], prefix, str(out))
    with zipfile.ZipFile(big) as a, zipfile.ZipFile(rebuilt) as b:
        assert sorted(a.namelist()) == sorted(b.namelist())
        assert all(a.read(n) == b.read(n) for n in a.namelist())
    shutil.copy(os.path.join(folders[0], "MANIFEST.json"), tmp_path / "m.json")
    entries[os.path.basename(small)]["sha256"] = "0" * 64             # a damaged upload is refused
    with pytest.raises(RuntimeError, match="sha256"):
        install.assemble(entries[os.path.basename(small)], prefix, str(out))
