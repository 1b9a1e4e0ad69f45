"""HF Trainer with context parallelism (cp_softcap.integrations.hf_trainer) against the same plain
Trainer run in one process without CP (HF's eager attention in float64): dp 2 x cp 2 ring and
dp 1 x cp 4 a2a in float32 end with the same logged losses, grad norms, eval loss and weights
(1e-5 relative), and so do packed batches (DataCollatorWithFlattening) at dp 2 x cp 2 ring and
dp 1 x cp 4 all_gather against padded rows of the same documents, a dp 2 x cp 2 run resumed
from a step-2 checkpoint, one reading an IterableDataset, and a packed one with
Trainer(torch_compile=True); with Trainer's shuffling, CP peers
read the same batches; negative controls (each rank's loss normalised by its own tokens, packed
documents without their boundaries) do not match; the example runs. One single-process
reference and 4 CPU ranks with torchrun's environment (tests_dist/hf_trainer_workers.py), forked
together after one import of everything (tests_dist/fork_launch.py), once per session.
"""
import json
import os
import sys

import pytest

pytest.importorskip("transformers", minversion="5")
pytest.importorskip("accelerate")
sys.path.insert(0, os.path.dirname(__file__))
import gemma2_launch as L  # noqa: E402
from gemma2_launch import rel  # noqa: E402
from session_once import once_per_session  # noqa: E402

WORKERS = os.path.join(L.ROOT, "tests_dist", "hf_trainer_workers.py")
TOL = 1e-5           # float32 CP vs float64 eager, relative (measured ~1e-7)


def _launch(out: str) -> str:
    cp_out, _ = L.reference_and_cp(WORKERS, out, "HF Trainer reference and CP runs")
    assert "dp 2 x cp 2 (ring, packed): train losses [" in cp_out      # examples/gemma2/hf_trainer.py ran
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    # once per session: xdist's -n 2 may hand this module's tests to both workers
    out = once_per_session(tmp_path_factory, "hf_trainer", _launch)
    return L.loader(out), out


def errors(run, ref) -> dict:
    (log, weights), (ref_log, ref_weights) = run, ref
    assert len(log["losses"]) == len(ref_log["losses"]) == 3
    return {"losses": rel(log["losses"], ref_log["losses"]),
            "eval": rel(log["eval_loss"], ref_log["eval_loss"]),
            "grad_norms": rel(log["grad_norms"], ref_log["grad_norms"]),
            "weights": max(rel(weights[k], ref_weights[k]) for k in ref_weights)}


@pytest.mark.timeout(480)
@pytest.mark.parametrize("name,dp", [("dp2_cp2_ring", 2), ("dp1_cp4_a2a", 1), ("dp2_cp2_ring_resumed", 2),
                                     ("dp2_cp2_ring_packed", 2), ("dp1_cp4_all_gather_packed", 1),
                                     ("dp2_cp2_ring_iterable", 2),
                                     ("dp2_cp2_ring_packed_compiled", 2)])
def test_matches_one_process_trainer(runs, name, dp):
    load, _ = runs
    if name.endswith("_compiled"):
        assert load(name)[0]["graphs"] > 0         # Trainer(torch_compile=True) compiled the model
    err = errors(load(name), load(f"ref_dp{dp}"))
    assert max(err.values()) <= TOL, err
    init, trained = _initial_weights(), load(name)[1]
    assert max(rel(trained[k], init[k]) for k in init) > 1e-3      # the weights were trained


@pytest.mark.timeout(480)
@pytest.mark.parametrize("name", ["dp2_cp2_ring_per_rank", "dp2_cp2_ring_no_boundaries"])
def test_negative_controls_fail(runs, name):
    """The loss normalised by each rank's own tokens; packed documents without their boundaries."""
    load, _ = runs
    err = errors(load(name), load("ref_dp2"))
    assert err["losses"] > 1e-3 and err["weights"] > 1e-3, err


@pytest.mark.timeout(480)
def test_shuffled_batches_agree_within_cp_groups(runs):
    _, out = runs
    with open(os.path.join(out, "shuffled.json")) as f:
        steps = json.load(f)          # per micro-step: every rank's global boundaries (ranks 0-3)
    assert len(steps) == 6
    for cu in steps:
        assert cu[0] == cu[1] and cu[2] == cu[3], cu       # cp peers: the same batch
    assert any(cu[0] != cu[2] for cu in steps)             # dp groups: different batches


@pytest.mark.timeout(480)
def test_trainer_refusals(runs):
    _, out = runs
    with open(os.path.join(out, "refusals.json")) as f:
        messages = json.load(f)
    assert "attn_implementation='eager'" in messages["eager_model"]
    assert "attn_implementation='cp_softcap'" in messages["eager_model"]
    assert "average_tokens_across_devices=False" in messages["per_rank_tokens"]
    assert "global rank 0" in messages["per_rank_tokens"]
    assert "accelerator_config={'dispatch_batches': False}" in messages["dispatch_batches"]
    assert "label smoothing" in messages["label_smoothing"]
    assert "compute_metrics" in messages["compute_metrics"] and "loss only" in messages["compute_metrics"]
    assert "would return no predictions" in messages["predict"]


def _initial_weights():
    sys.path.insert(0, os.path.dirname(WORKERS))
    import hf_trainer_workers as W
    return W.model("eager").state_dict()
