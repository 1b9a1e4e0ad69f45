"""The documentation's code is real: every Python block of README is a verbatim excerpt of an
example program that a test runs, every excerpt marked in those programs appears in README or a
page of docs/, and the commands of README, docs/ and the example's README (the examples, the
selector CLI, the example's --plan) run as written in a fresh copy of the repository, which stays
clean (nothing written into tracked or untracked paths). The benchmarks' dry runs are
tests/test_benchmarks_runner.py's."""
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, ROOT / "examples" / "gemma2" / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
EXAMPLES = ("examples/minimal_cp.py", "examples/hf_cp.py", "examples/packed_cp.py")
# programs with excerpts: the examples above (run here), and the Trainer and SFT examples, which
# tests_dist/test_hf_trainer_dist.py and tests_dist/test_trl_sft_dist.py run on 4 gloo ranks
EXCERPTED = EXAMPLES + ("examples/gemma2/hf_trainer.py", "examples/gemma2/sft.py")
# bash blocks whose commands set up a venv or launch the Gemma2 job: CI runs the test command
# itself (.ci/run) and tests_dist/test_gemma2_train.py runs the training script under torchrun
COVERED_ELSEWHERE = ("python3 -m venv", "pip install", "torchrun", "launch/", "sbatch")

pytestmark = pytest.mark.timeout(420)


def fenced_blocks(text: str, lang: str):
    return [m.group(1) for m in re.finditer(rf"^```{lang}\n(.*?)^```$", text, re.S | re.M)]


MARKER = re.compile(r"^# \[README:([\w-]+) (begin|end)\]\n", re.M)


def excerpts(path: str) -> dict:
    """{name: text} of the `# [README:name begin]` ... `# [README:name end]` blocks of a file
    (the markers start a line; blocks may nest, and inner markers are not part of the text),
    dedented: a block from inside a function reads as top-level code."""
    src = (ROOT / path).read_text()
    found = {}
    for m in MARKER.finditer(src):
        if m.group(2) != "begin":
            continue
        end = src.find(f"# [README:{m.group(1)} end]\n", m.end())
        assert end >= 0, f"{path}: excerpt {m.group(1)} has no end marker"
        found[m.group(1)] = textwrap.dedent(MARKER.sub("", src[m.end():end]))
    assert found, f"{path} has no README excerpt markers"
    return found


def doc_commands():
    """The bash commands of README, docs/ and the example's README that run on a CPU machine
    in seconds."""
    cmds = []
    for page in PAGES:
        for block in fenced_blocks(page.read_text(), "bash"):
            for line in block.strip().splitlines():
                if line.startswith(COVERED_ELSEWHERE):
                    continue
                assert line.startswith(("python -m cp_softcap", "python examples/", "python benchmarks/")), (
                    f"{page.relative_to(ROOT)} bash line {line!r} is neither run by tests/test_readme.py "
                    "nor listed in its COVERED_ELSEWHERE; run it here or say where it is tested")
                cmds.append(line.split("  #")[0].strip())
    return cmds


def test_python_blocks_are_excerpts_of_the_examples():
    wanted = {f"{path}:{name}": text for path in EXCERPTED for name, text in excerpts(path).items()}
    blocks = fenced_blocks(README.read_text(), "python")
    stray = [b.splitlines()[0] for b in blocks if b not in wanted.values()]
    assert not stray, f"README python blocks that no tested example holds (first lines): {stray}"
    shown = [b for page in PAGES for b in fenced_blocks(page.read_text(), "python")]
    for key, text in wanted.items():
        assert text in shown, (f"no ```python block of README or docs/ equals the excerpt {key}; copy "
                               "the lines between its markers verbatim (dedented)")


def test_readme_names_commands_that_run():
    cmds = doc_commands()
    assert any(c.startswith("python -m cp_softcap") for c in cmds), cmds
    assert not any("..." in c for c in cmds), cmds


def fresh_copy(dest: Path) -> Path:
    """The tracked and untracked-but-not-ignored files of this checkout, committed into a new
    git repository: a clone of the working tree, so uncommitted edits are tested too."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(git + ["init", "-q"], cwd=dest, check=True)
    subprocess.run(git + ["add", "-A"], cwd=dest, check=True)
    subprocess.run(git + ["commit", "-q", "-m", "copy"], cwd=dest, check=True)
    return dest


def test_examples_and_commands_run_in_a_fresh_copy_that_stays_clean(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout (the test copies its tracked files and checks git status)")
    repo = fresh_copy(tmp_path / "repo")
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(repo)           # the copy's package, not the installed checkout
    env["CP_SOFTCAP_TIMEOUT"] = "120"
    env["TMPDIR"] = str(tmp_path)           # the commands' temporary folders: cleaned up with tmp_path
    cmds = doc_commands() + [f"python {e}" for e in EXAMPLES]
    for cmd in dict.fromkeys(cmds):         # README also names the examples: run each once
        argv = cmd.split()
        argv[0] = sys.executable
        res = subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True, timeout=240)
        assert res.returncode == 0, f"{cmd} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        if cmd.startswith("python examples/"):
            assert "-> OK" in res.stdout, f"{cmd} printed no OK line:\n{res.stdout}"
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=repo,
                            capture_output=True, text=True, check=True).stdout
    assert status == "", f"the documented commands left the repository dirty:\n{status}"


@pytest.mark.parametrize("page,heading", [("README.md", "## What no other library does"),
                                          ("docs/comparison.md", "# Compared with")])
def test_comparison_table_is_complete(page, heading):
    """Every row of the comparison table (README's short one, docs/comparison.md's full one)
    has a cell per system, and every footnote it cites is defined (and every definition
    cited)."""
    text = (ROOT / page).read_text()
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    widths = {len(row.strip().strip("|").split(" | ")) for row in rows if not row.startswith("|---")}
    assert widths == {8}, f"rows of the comparison table have {widths} cells, want 8 (feature + 7 systems)"
    cited = set(re.findall(r"\[\^([\w-]+)\](?!:)", section))
    defined = set(re.findall(r"^\[\^([\w-]+)\]:", section, re.M))
    assert cited == defined, f"cited but undefined: {cited - defined}; defined but unused: {defined - cited}"
    assert "not yet run" in section


def test_readme_is_short_and_keeps_its_two_commands():
    """README is read in minutes: at most 200 lines, and its test command is exactly CI's."""
    text = README.read_text()
    assert len(text.splitlines()) <= 200, f"README.md has {len(text.splitlines())} lines, the limit is 200"
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip().startswith("pytest ")]
    assert len(ci) == 1, ci
    assert any(line.endswith("&& " + ci[0]) for block in fenced_blocks(text, "bash")
               for line in block.splitlines()), f"README's test command is not CI's {ci[0]!r}"
    assert "examples/gemma2/train.py" in text
