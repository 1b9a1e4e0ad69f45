"""scripts/gpu_check.sh runs on the device machine only; a typo there costs a GPU session. Here:
it parses, and every phase its header names has a branch (and every branch is named)."""
import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


def test_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_every_named_phase_has_a_branch():
    text = SCRIPT.read_text()
    header = text.split("set -uo pipefail")[0]
    named = set(re.findall(r"gpu_check\.sh (\w+)", header))
    branches = set(re.findall(r'"\$phase" = (\w+)', text))
    assert named - branches == set(), f"named in the header, no branch: {sorted(named - branches)}"
    assert branches - named == set(), f"branch the header does not name: {sorted(branches - named)}"
