"""Each decision has one home: the rules below are written once in the library (and the
examples ask the library), so a second copy that could drift fails here. A scan of the source,
with the module that owns each rule."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("cp_softcap", "examples") for p in (ROOT / d).rglob("*.py")]

RULES = [  # (decision, pattern, the one file allowed to hold it)
    ("the zigzag length rule (2*cp divides the sequence)", r"%\s*\(2\s*\*\s*\w+(\.\w+)?\)",
     "cp_softcap/spec.py"),
    ("DeviceMesh detection", r"isinstance\(\w+, DeviceMesh\)", "cp_softcap/groups.py"),
    ("document starts from position_ids", r"\[:, 1:\]\s*-\s*\w+\[:, :-1\]", "cp_softcap/documents.py"),
    ("FA3's opt-in", r"fa3_enabled\(\)", "cp_softcap/selector.py"),
    ("the attention-mask acceptance rule", r"\.bool\(\)\.all\(\)", "cp_softcap/spec.py"),
]


@pytest.mark.parametrize("decision,pattern,home", RULES, ids=[r[0] for r in RULES])
def test_decision_lives_in_one_file(decision, pattern, home):
    where = sorted(str(p.relative_to(ROOT)) for p in SOURCES
                   # settings.py defines fa3_enabled (the rule's setting, not the rule)
                   if p.name != "settings.py" and re.search(pattern, p.read_text()))
    assert where == [home], f"{decision}: found in {where}, its one home is {home}"
