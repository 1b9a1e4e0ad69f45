"""benchmarks/training/gaps.py: the GPU's busy time and idle gaps from a Chrome trace (speed.py
--trace). Overlapping kernels count once; each gap names its neighbours and the host ops that
were running when it began."""
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.training import gaps  # noqa: E402


def _k(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_busy_time_and_the_longest_gaps(tmp_path):
    events = [
        _k("a", 0, 100), _k("b", 50, 100),          # overlap: busy 0..150
        _k("copy", 150, 10, "gpu_memcpy"),          # back to back: no gap
        _k("c", 400, 100),                          # gap 240 after the copy
        _k("d", 510, 40),                           # gap 10: below min_us
        _k("e", 1000, 50),                          # gap 450
        {"ph": "X", "cat": "cpu_op", "name": "aten::item", "ts": 540, "dur": 400},
        {"ph": "X", "cat": "cpu_op", "name": "aten::_local_scalar_dense", "ts": 545, "dur": 390},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5},
        {"ph": "i", "cat": "kernel", "name": "not a span", "ts": 700},
    ]
    s = gaps.gaps({"traceEvents": events})
    assert s["span_us"] == 1050 and s["busy_us"] == 150 + 10 + 100 + 40 + 50
    assert s["idle_us"] == 1050 - 350
    assert [(g["gap_us"], g["before"], g["after"]) for g in s["gaps"]] == [(450, "d", "e"), (240, "copy", "c")]
    assert s["gaps"][0]["host"] == ["aten::item", "aten::_local_scalar_dense"]
    assert s["idle_in_gaps_us"] == 690
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert gaps.gaps(gaps.load(str(path)))["busy_us"] == s["busy_us"]
    assert "GPU busy 0.3 ms of 1.1 ms" in gaps.render(s)


def test_a_trace_without_gpu_events():
    s = gaps.gaps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}]})
    assert s["busy_fraction"] is None and gaps.render(s) == "no GPU events in the trace"


def test_a_kernel_inside_another_is_counted_once_and_the_enclosing_one_is_the_neighbour():
    s = gaps.gaps({"traceEvents": [_k("big", 0, 1000), _k("inner", 100, 100), _k("next", 1100, 10)]})
    assert s["busy_us"] == 1010 and s["span_us"] == 1110
    assert [(g["gap_us"], g["before"], g["after"]) for g in s["gaps"]] == [(100, "big", "next")]
