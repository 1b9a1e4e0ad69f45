"""Every tested HF model family under attn_implementation="cp_softcap" at cp 4 (gloo), every comm,
against HF's "eager" attention on one process in float64: tiny Gemma2 (softcaps, a sliding
layer), Gemma3 (a sliding and a full layer), Mistral (every layer windowed), Qwen2
(use_sliding_window, the second layer windowed), gpt-oss (a sliding and a full layer, learned
attention sinks, MoE) and Llama (examples/hf/families.py), for rows of 48 tokens and for one
packed row of 4 documents (the global boundaries passed as model(..., cu_seqlens=cu)): the
logits, the loss summed over the ranks and every parameter's gradient summed over the ranks.
Also: what each layer hands the library (its window, softcap, sinks); that dropping a window or
the sinks moves the eager logits far beyond the tolerance (so a CP run that ignored them would
fail); CPTrainer and CPSFTTrainer fine-tuning gpt-oss against the plain one-process trainers;
examples/hf/sft.py on 2 ranks against its one-process run.

One launch (tests_dist/hf_models_workers.py: 4 forked gloo ranks, then 2, and a reference
process) serves every test here, once per session even when xdist spreads the tests over
workers (session_once.py); each case reports on its own.
"""
import os
import sys

import pytest

pytest.importorskip("transformers", minversion="5")
pytest.importorskip("trl", minversion="1.16")
sys.path.insert(0, os.path.dirname(__file__))
import gemma2_launch as L  # noqa: E402
from gemma2_launch import rel  # noqa: E402
from session_once import once_per_session  # noqa: E402

pytestmark = [pytest.mark.xdist_group("hf_models_cp"), pytest.mark.timeout(480)]

WORKERS = os.path.join(L.ROOT, "tests_dist", "hf_models_workers.py")
FAMILIES = ("gemma2", "gemma3", "mistral", "qwen2", "gpt_oss", "llama")
COMMS = ("ring", "all_gather", "a2a", "a2a+p2p", "auto")
LAYOUTS = ("rows", "packed")
# HF's sliding_window w per windowed layer (examples/hf/families.py); the library gets the
# window (w - 1, 0): query i sees keys i - w < j <= i
WINDOWS = {"gemma2": {0: 16}, "gemma3": {0: 10}, "mistral": {0: 12, 1: 12}, "qwen2": {1: 8},
           "gpt_oss": {0: 6}, "llama": {}}
# Relative tolerance of the float64 model comparisons. The models are float64, but HF computes
# parts of them in float32 whatever the model's dtype: RMSNorm (all six families), the eager
# attention's softmax (all but gpt-oss) and the cross-entropy (logits.float()). Differences of
# float64 size (1e-16) in the attention output then surface at float32 size wherever they cross
# a float32 rounding boundary. Measured maxima over all cases: 7.1e-7 against eager (Qwen2's
# gradients), 2e-7 against cp_softcap on one device (the Gemmas' norm-weight gradients, which
# HF sums over the tokens in float32: the CP split reorders that sum); gpt-oss against its
# float64 eager: 4e-15. What the tolerance must catch moves the logits by > 0.1: a window
# dropped (0.16-1.2, test_dropping_a_window_or_the_sinks_is_far_beyond_the_tolerance), the
# sinks dropped (1.2), a document seeing another, wrong positions.
TOL = 1e-5
CONTROL = 1e-2                   # a dropped window or sink moves the logits by more than this


def _launch(folder: str) -> dict:
    import json
    # a hang guard, not a speed check (measured 27-48 s of wall time on a loaded 2-core machine)
    L.finish([L.start([sys.executable, WORKERS, folder])], timeout=420, what="HF model families under CP")
    with open(os.path.join(folder, "results.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = once_per_session(tmp_path_factory, "hf_models_cp", _launch)
    print(f"HF model families launch: {out['cpu_s']:.1f} s of CPU, {out['wall_s']:.1f} s of wall time")
    return out


def _part(results, name):
    part = results[name]
    assert "error" not in part, part["error"]
    return part


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("family", FAMILIES)
def test_family_under_cp_matches_eager(results, family, comm, layout):
    case = _part(results, "cp")["cases"][f"{family} {comm} {layout}"]
    assert "error" not in case, case["error"]
    for against in ("eager", "one device"):         # HF eager; cp_softcap without CP
        err = case[against]
        assert max(err["logits"], err["loss"], err["grads"]) <= TOL, (against, err)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_layer_hands_the_library_its_window(results, family):
    """On one device, the window, softcap and sinks each layer passes to cp_softcap."""
    calls = _part(results, "cp")["checks"][family]["calls"]
    assert len(calls) == 2
    for layer, (window, softcap, sinks) in enumerate(calls):
        w = WINDOWS[family].get(layer)
        assert window == (None if w is None else [w - 1, 0]), (layer, window)
        assert softcap == (3.0 if family == "gemma2" else None), (layer, softcap)
        assert sinks == (family == "gpt_oss"), layer


@pytest.mark.parametrize("family", [f for f in FAMILIES if WINDOWS[f]])
def test_dropping_a_window_or_the_sinks_is_far_beyond_the_tolerance(results, family):
    """The eager logits with every window wider than the rows (and for gpt-oss with the sinks
    dropped) differ from the real ones by far more than TOL: the windows and sinks are exercised
    (48-token rows, windows of 6-16), and a CP run that ignored them would fail."""
    checks = _part(results, "cp")["checks"][family]
    assert checks["window dropped"] > CONTROL >= 1000 * TOL, checks
    if family == "gpt_oss":
        assert checks["sinks dropped"] > CONTROL, checks


@pytest.mark.parametrize("name,dp_cp", [("trainer", "dp 2 x cp 2 ring"), ("sft", "dp 1 x cp 4 a2a")])
def test_gpt_oss_trainers_match_one_process(results, name, dp_cp):
    """CPTrainer (packed documents) and CPSFTTrainer (padding-free rows, completion-only loss)
    fine-tuning gpt-oss in float64 (3 steps, gradient accumulation 2, clipping) against the
    plain Trainer / SFTTrainer with eager attention on one process: per-step loss and grad
    norm, eval loss, final weights. The logged losses are rounded to float32 by the trainers:
    measured <= 1e-7; the weights <= 4e-10."""
    run = _part(results, "cp")["trainers"][name]
    ref = _part(results, "reference")[name]
    assert "error" not in run, run["error"]
    assert "error" not in ref, ref["error"]
    err = {k: rel(run["steps"][k], ref["steps"][k]) for k in ("loss", "grad_norm")}
    err["eval_loss"] = rel(run["eval_loss"], ref["eval_loss"])
    err["weights"] = max(rel(run["weights"][k], ref["weights"][k]) for k in ref["weights"])
    assert len(run["steps"]["loss"]) == len(ref["steps"]["loss"]) == 3
    assert max(err.values()) <= 1e-6, (dp_cp, err)
    assert run["moved"] > 1e-3 and ref["moved"] > 1e-3      # the weights were trained


def test_cptrainer_refuses_a_moe_load_balancing_loss(results):
    """gpt-oss with config.output_router_logits: each rank would add the load-balancing loss of
    its own shard's routing (at cp 2 the first logged loss moved by 2.5e-3 against one process
    before this refusal)."""
    message = _part(results, "cp")["trainers"]["moe_loss_refused"]
    assert message is not None, "CPTrainer accepted a MoE load-balancing loss under CP"
    assert "MoE load-balancing loss" in message and "output_router_logits = False" in message, message
    assert "global rank 0" in message, message


def test_example_on_two_ranks_matches_one_process(results):
    """examples/hf/sft.py --family gemma3 (TRL's BFD packing, float32) on 2 ranks (dp 1 x cp 2,
    ring) against the same example with --cp 1 on one process: the losses of 3 AdamW steps and
    the eval loss. float32 rounding (~1e-7 per operation) differs between the CP split and one
    process, and AdamW's normalised steps carry it into the weights: measured <= 1e-5."""
    run, ref = _part(results, "example"), _part(results, "reference")["example"]
    assert run["family"] == ref["family"] == "gemma3_text"
    assert (run["dp"], run["cp"], ref["cp"]) == (1, 2, 1)
    assert len(run["losses"]) == 3
    assert rel(run["losses"], ref["losses"]) <= 1e-4, (run, ref)
    assert rel(run["eval_loss"], ref["eval_loss"]) <= 1e-4, (run, ref)
    assert run["losses"][-1] < run["losses"][0]              # it trains
