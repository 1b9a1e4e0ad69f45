"""The runner's dry run of a benchmark suite (`python -m benchmarks SUITE --dry-run`: CPU, tiny
shapes), once per test session and shared by the xdist workers: tests/test_benchmarks_runner.py
checks every step of it, and the tests of one benchmark's records read them from here, so CI
runs each step's dry run once."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests_dist"))
from session_once import once_per_session  # noqa: E402


def suite_dry_run(tmp_path_factory, suite):
    """{"folder": where the records are, "steps": the runner's result per step}."""
    def compute(folder):
        from benchmarks.__main__ import run
        _, steps = run([suite], "dry", folder, in_process=True)
        return {"folder": folder, "steps": steps}
    return once_per_session(tmp_path_factory, f"bench_dry_{suite}", compute)


def dry_record(tmp_path_factory, suite, name):
    """The JSON record <name>.json of the suite's dry run."""
    dry = suite_dry_run(tmp_path_factory, suite)
    with open(os.path.join(dry["folder"], name + ".json")) as f:
        return json.load(f)
