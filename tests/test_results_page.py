"""benchmarks/RESULTS.md is a status page: it names only files of the repository, every plot it
embeds exists, and every plot is drawn from its JSON by benchmarks/plots.py."""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS_MD = ROOT / "benchmarks" / "RESULTS.md"
RESULTS = ROOT / "benchmarks" / "results"


def test_embedded_plots_exist_and_each_has_its_json():
    text = RESULTS_MD.read_text()
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert images, "RESULTS.md embeds no plot"
    for rel in images:
        png = RESULTS_MD.parent / rel
        assert png.is_file(), f"RESULTS.md embeds {rel}, which does not exist"
        assert png.with_suffix(".json").is_file(), f"{rel} has no JSON to redraw it from"


def test_names_only_repository_files():
    text = RESULTS_MD.read_text()
    for rel in re.findall(r"`(results/[\w./{},-]+)`", text):
        for name in re.sub(r"\{(.*?)\}", lambda m: m.group(1).split(",")[0], rel).split():
            assert (RESULTS_MD.parent / name).exists(), f"RESULTS.md names {rel}, which is not in the repo"
    assert not re.search(r"\]\((/|\.\./\.\.)", text), "RESULTS.md links outside the repository"


def test_summary_lists_what_has_not_run():
    summary = RESULTS_MD.read_text().split("## Summary", 1)[1].split("\n## ", 1)[0]
    for row in ("more than one GPU", "packed documents on a GPU", "Gemma2 training at scale"):
        assert row in summary, f"summary has no row for {row!r}"
    assert summary.count("not yet run") >= 3


def test_plots_redraw_from_json(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.plots import plot_json
    drawn = 0
    for path in sorted(RESULTS.glob("*.json")):
        png = plot_json(str(path), str(tmp_path / (path.stem + ".png")))
        if png is not None:
            assert Path(png).stat().st_size > 0
            assert (RESULTS / (path.stem + ".png")).is_file(), f"{path.name} has no committed plot"
            drawn += 1
        else:
            assert not any("ratio" in r or "tflops" in r for r in json.loads(path.read_text()).get("records", [])), (
                f"{path.name} has benchmark records but no plot")
    assert drawn >= 5
