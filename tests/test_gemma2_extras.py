"""examples/gemma2/sft.py and hf_trainer.py without their optional packages (accelerate, trl,
hidden from the interpreter by a sitecustomize finder): one line on stderr naming the [sft]
extra, status 2, from rank 0 only; no ImportError traceback, also under torchrun."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
GEMMA2 = os.path.join(ROOT, "examples", "gemma2")
sys.path.insert(0, GEMMA2)
import extras  # noqa: E402

pytestmark = pytest.mark.timeout(120)
BLOCKER = '''import sys
class _Hidden:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"accelerate", "trl"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _Hidden())
'''
HINT = 'pip install -e ".[sft]"'


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    site = tmp_path_factory.mktemp("hidden")
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def _run(cmd, env, **extra):
    return subprocess.run(cmd, env={**env, **extra}, capture_output=True, text=True, timeout=100, cwd=ROOT)


@pytest.mark.parametrize("script, missing", [("sft.py", "accelerate, trl"), ("hf_trainer.py", "accelerate")])
def test_missing_extra_is_one_line_naming_it(env, script, missing):
    run = _run([sys.executable, os.path.join(GEMMA2, script)], env)
    assert run.returncode == 2 and run.stdout == ""
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith(f"{script}: error: needs {missing}, not installed here") and HINT in lines[0]
    quiet = _run([sys.executable, os.path.join(GEMMA2, script)], env, RANK="1", WORLD_SIZE="4")
    assert quiet.returncode == 0 and quiet.stdout == quiet.stderr == ""


def test_under_torchrun_the_line_is_printed_once_without_a_traceback(env):
    run = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                os.path.join(GEMMA2, "sft.py")], env)
    out = run.stdout + run.stderr
    assert run.returncode != 0
    assert out.count(HINT) == 1 and "ModuleNotFoundError" not in out and "sft.py: error: needs" in out
    assert "exitcode  : 2" in out          # torchrun's own summary of rank 0's status


def test_the_check_names_an_old_transformers(monkeypatch):
    monkeypatch.setattr(extras.importlib.metadata, "version", lambda name: "4.57.1")
    assert extras.problems(("transformers", "json")) == ["transformers>=5 (found 4.57.1)"]
    assert extras.problems(("json",)) == []
    assert extras.problems(("no_such_module_here",)) == ["no_such_module_here"]
