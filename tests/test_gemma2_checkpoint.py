"""examples/gemma2/checkpoint.py: a step-N folder counts only with a valid COMPLETE marker whose
files all exist with the recorded sizes; newer half-written or corrupt folders are skipped with
a warning and never chosen."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from gemma2.checkpoint import MARKER, check_complete, latest_complete  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def fake_ckpt(root, step, *, marker=True, files=None):
    path = os.path.join(root, f"step-{step}")
    os.makedirs(path)
    files = files or {".metadata": b"m" * 10, "__0_0.distcp": b"x" * 100}
    for name, data in files.items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
    if marker:
        with open(os.path.join(path, MARKER), "w") as f:
            json.dump({"step": step, "files": {k: len(v) for k, v in files.items()}}, f)
    return path


def test_newest_complete_is_chosen(tmp_path):
    root = str(tmp_path)
    fake_ckpt(root, 2)
    good = fake_ckpt(root, 10)
    assert latest_complete(root, warn=False) == (10, good)


def test_broken_folders_are_skipped_with_warnings(tmp_path):
    root = str(tmp_path)
    good = fake_ckpt(root, 4)
    fake_ckpt(root, 6, marker=False)                                   # half-written
    p = fake_ckpt(root, 8)
    with open(os.path.join(p, "__0_0.distcp"), "r+b") as f:           # truncated data
        f.truncate(10)
    p = fake_ckpt(root, 9)
    with open(os.path.join(p, MARKER), "w") as f:                      # garbage marker
        f.write("{not json")
    p = fake_ckpt(root, 11)
    os.remove(os.path.join(p, "__0_0.distcp"))                          # missing file
    os.makedirs(os.path.join(root, "step-x"))                           # not a step folder
    with pytest.warns(UserWarning) as rec:
        assert latest_complete(root) == (4, good)
    msgs = " ".join(str(w.message) for w in rec)
    for reason in ("step-6", "no COMPLETE marker", "step-8", "bytes", "step-9", "unreadable",
                   "step-11", "missing"):
        assert reason in msgs, reason


def test_marker_step_must_match_folder(tmp_path):
    p = fake_ckpt(str(tmp_path), 3)
    os.rename(p, os.path.join(str(tmp_path), "step-5"))
    assert "says step 3" in check_complete(os.path.join(str(tmp_path), "step-5"), 5)


def test_empty_or_missing_dir(tmp_path):
    assert latest_complete(str(tmp_path / "nope")) is None
    assert latest_complete(str(tmp_path)) is None
