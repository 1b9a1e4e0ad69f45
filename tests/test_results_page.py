"""benchmarks/RESULTS.md against the records in benchmarks/results/: every figure is a link to its
record whose title says which value it is, and that record holds that value (to the figure's
printed precision); every record there is referenced; the summary names the card of each row
and has no figure without a record; every plot is drawn from its JSON by benchmarks/plots.py.

A figure link: [104 %](results/fa4_softcap.json "model=9B S=32768 kernel='fa4 score_mod' mode=fwd pct_of_cudnn")
  title = filters, then what to read:
    key=value, key!=value, key>=value, key<=value, key>value, key<value   (record fields)
    @rows                    read meta["rows"] instead of "records" (a JSON Lines file: its lines)
    field, a/b               the value of one matching record (exactly one must match)
    median(x) min(x) max(x)  over every matching record;  count  the number of them
    ...*100                  scaled (percent of a fraction)
  or the title `text`: the link's text appears verbatim in the record (a log).
"""
import json
import math
import re
import shlex
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS_MD = ROOT / "benchmarks" / "RESULTS.md"
RESULTS = ROOT / "benchmarks" / "results"
LINK = re.compile(r'\[([^\]]+)\]\((results/[^)\s]+)(?:\s+"([^"]*)")?\)')
NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


def _text():
    return RESULTS_MD.read_text()


def _records(path: Path, rows: bool):
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    blob = json.loads(path.read_text())
    return blob["meta"]["rows"] if rows else blob["records"]


def _matches(rec, key, op, want):
    if key not in rec:
        return False
    got = rec[key]
    if isinstance(got, (int, float)) and not isinstance(got, bool):
        try:
            want_v = float(want)
        except ValueError:
            return False
        return {"=": got == want_v, "!=": got != want_v, ">=": got >= want_v, "<=": got <= want_v,
                ">": got > want_v, "<": got < want_v}[op]
    text = json.dumps(got) if isinstance(got, (list, dict)) else str(got)
    return {"=": text == want, "!=": text != want}.get(op, False)


def _field(rec, expr):
    if "/" in expr:
        a, b = expr.split("/")
        return rec[a] / rec[b]
    return rec[expr]


def figure_value(path: Path, spec: str) -> float:
    tokens = shlex.split(spec)
    rows = "@rows" in tokens
    tokens = [t for t in tokens if t != "@rows"]
    *filters, what = tokens
    scale = 1.0
    if "*" in what:
        what, factor = what.split("*")
        scale = float(factor)
    recs = _records(path, rows)
    for f in filters:
        key, op, want = re.match(r"([\w+]+)(!=|>=|<=|=|>|<)(.*)$", f).groups()
        recs = [r for r in recs if _matches(r, key, op, want)]
    agg = re.match(r"(median|min|max)\((.+)\)$", what)
    if what == "count":
        return float(len(recs))
    assert recs, f"{path.name}: no record matches {spec!r}"
    if agg:
        fn = {"median": statistics.median, "min": min, "max": max}[agg.group(1)]
        return scale * fn(_field(r, agg.group(2)) for r in recs)
    assert len(recs) == 1, f"{path.name}: {len(recs)} records match {spec!r}, the figure needs one"
    return scale * _field(recs[0], what)


def test_every_figure_holds_its_records_value():
    checked = 0
    for shown, target, spec in LINK.findall(_text()):
        path = RESULTS_MD.parent / target
        assert path.is_file(), f"RESULTS.md links {target}, which is not in the repository"
        if not spec:
            continue
        if spec == "text":
            assert shown in path.read_text(), f"{target} does not contain {shown!r}"
            checked += 1
            continue
        number = NUMBER.search(shown)
        assert number, f"figure {shown!r} ({target}) has no number"
        text = number.group(0).replace(",", "")
        decimals = len(text.split(".")[1]) if "." in text else 0
        value = figure_value(path, spec)
        assert math.isfinite(value), (shown, target, spec)
        assert abs(value - float(text)) <= 0.5 * 10 ** -decimals + 1e-9, (
            f"RESULTS.md shows {shown!r} for {target} {spec!r}; the record holds {value:.6g}")
        checked += 1
    assert checked >= 40, f"only {checked} figures checked"


def test_every_record_is_referenced():
    text = _text()
    named = {m for m in re.findall(r"results/[\w./-]+\.(?:jsonl|json|log|txt|png)", text)}
    for path in sorted(RESULTS.rglob("*")):
        if path.is_dir():
            continue
        rel = "results/" + path.relative_to(RESULTS).as_posix()
        if path.suffix == ".png":
            assert path.with_suffix(".json").is_file(), f"{rel} has no JSON to redraw it from"
            rel = rel[:-4] + ".json"
        assert rel in named, f"{rel} is referenced nowhere in RESULTS.md: delete it (git keeps it)"


def test_summary_rows_name_their_card_and_records():
    summary = _text().split("## Summary", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in summary.splitlines() if r.startswith("| ") and not r.startswith("| what")]
    assert len(rows) >= 15
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        what, figure, where = cells[0], cells[1], cells[2]
        assert re.search(r"\b(H100|H200|CPU)\b", where), f"row names no card (or CPU): {what}"
        if "not yet run" in figure.lower():
            continue
        assert LINK.search(figure), f"figure of {what!r} links no record"
        bare = LINK.sub("", figure)          # names with digits (fa4, 9B, 32K) are not figures
        assert not re.search(r"(?<![\w.])[-+]?\d[\d,.]*(?!\w)", bare), (
            f"{what!r}: a figure outside a record link: {bare!r}")


def test_names_only_repository_files():
    text = _text()
    for rel in re.findall(r"`(results/[\w./-]+)`", text):
        assert (RESULTS_MD.parent / rel).exists(), f"RESULTS.md names {rel}, which is not in the repo"
    assert not re.search(r"\]\((/|\.\./\.\.)", text), "RESULTS.md links outside the repository"


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
