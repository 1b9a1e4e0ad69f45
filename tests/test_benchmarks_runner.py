"""`python -m benchmarks` (benchmarks/__main__.py, suites in benchmarks/suites.py): every suite's
dry run on CPU (each step succeeds and writes records in the harness's format, with the
environment they ran in), and the runner's rules: which steps run where, how records are named,
the launch command on several GPUs."""
import json
import os

import pytest
from bench_dry import suite_dry_run

from benchmarks import __main__ as runner
from benchmarks._util import RESULTS, out_dir_for
from benchmarks.suites import SUITES, Step

ENV_KEYS = {"device", "card", "gpus", "torch", "cuda", "git", "git_dirty", "date", "python"}


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("suite", list(SUITES))
def test_suite_dry_run(tmp_path_factory, suite):
    dry = suite_dry_run(tmp_path_factory, suite)
    assert [s["step"] for s in dry["steps"]] == [f"{suite}.{s.name}" for s in SUITES[suite]]
    for step in dry["steps"]:
        assert step["status"] == "ok", step
        assert step["records"], step
        for name in step["records"]:
            if not name.endswith(".json"):
                continue
            with open(os.path.join(dry["folder"], name)) as f:
                blob = json.load(f)
            assert set(blob) == {"meta", "records"}, name
            assert ENV_KEYS <= set(blob["meta"]["env"]), (name, blob["meta"]["env"])
            assert blob["meta"]["env"]["gpus"] == 0 or blob["meta"]["env"]["card"]


def test_every_step_names_a_module_and_runs_somewhere():
    import importlib.util
    for suite, steps in SUITES.items():
        assert steps, suite
        for step in steps:
            assert importlib.util.find_spec(step.module), step.module
            assert step.gpus in (0, 1, "all") and step.min_gpus >= 1, step
            assert "--out-dir" not in [*step.full, *(step.quick or ()), *step.dry], step
    assert any(s.quick is not None for steps in SUITES.values() for s in steps)


def test_where_a_step_runs():
    gpu, cpu = Step("g", "m"), Step("c", "m", gpus=0)
    many = Step("n", "m", gpus="all", min_gpus=2)
    assert runner.why_not(gpu, "dry", 0) is None                     # every dry run is CPU
    assert "CUDA" in runner.why_not(gpu, "full", 0)
    assert runner.why_not(cpu, "full", 0) is None
    assert runner.why_not(many, "quick", 1) == "needs 2 GPUs (one rank per GPU), this machine has 1"
    assert runner.why_not(Step("q", "m", quick=None), "quick", 8) == "not part of a quick run"
    assert runner.command(many, "full", 4, "/o")[1:6] == ["-m", "torch.distributed.run", "--standalone",
                                                          "--nproc-per-node=4", "-m"]
    assert runner.command(Step("a", "m", gpus="all"), "full", 1, "/o")[1:3] == ["-m", "m"]


def test_record_names(tmp_path):
    gpu, cpu = Step("g", "m"), Step("c", "m", gpus=0)
    assert runner.suffix(gpu, "full", "h100") == "_h100"
    assert runner.suffix(gpu, "quick", "h200") == "_h200_quick"
    assert runner.suffix(cpu, "quick", "h100") == "_quick"
    assert runner.suffix(gpu, "dry", None) == ""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir(), out.mkdir()
    for name in ("kernels.json", "kernels.png", "trace.txt"):
        (src / name).write_text("x")
    assert runner.collect(str(src), str(out), "_h100") == ["kernels_h100.json", "kernels_h100.png"]


def test_dry_runs_never_write_into_the_results(monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    assert out_dir_for(None, dry=True) != RESULTS
    assert out_dir_for(None, dry=False) == RESULTS


def test_list_and_usage(capsys):
    assert runner.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(s in out for s in SUITES)
    with pytest.raises(SystemExit):
        runner.main(["nonsense", "--dry-run"])
