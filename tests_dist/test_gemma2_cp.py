"""Gemma2 under context parallelism equals the full model on one process (torchrun, world 4,
gloo): examples/gemma2's training step with cp = 1, 2, 4 and dp x cp = 2 x 2, and HF
Gemma2ForCausalLM with attn_implementation="cp_softcap" under CP 2 and 4. float32, a sequence
longer than the sliding window, relative errors within 1e-5."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import gemma2_launch as L  # noqa: E402

TOL = 1e-5


# CP algorithms the training step is checked with (the (2,2) and (1,4) cases run once per extra one)
COMMS = "ring"


def _run(kind, tmp_path, timeout, *extra):
    out = tmp_path / f"{kind}.json"
    L.run(4, L.WORKERS, [kind, str(out), *extra], timeout=timeout, what=f"gemma2 {kind} workers (world 4)")
    errs = json.loads(out.read_text())
    print(json.dumps(errs, indent=1))
    return errs


@pytest.mark.timeout(240)
def test_training_step_cp_equals_single_process(tmp_path):
    errs = _run("recipe", tmp_path, 200, COMMS)
    control = errs.pop("control: no window, loss")
    assert set(errs) >= {"dp4xcp1 loss", "dp2xcp2 grads", "dp1xcp4 grads", "cp2 grads"}
    bad = {k: v for k, v in errs.items() if not v <= TOL}
    assert not bad, f"relative errors above {TOL}: {bad}"
    assert control > 100 * TOL, f"dropping the sliding window changed the loss by only {control:.2e}"


@pytest.mark.timeout(240)
def test_hf_gemma2_cp_equals_eager():
    pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[gemma2]')")
    import tempfile, pathlib
    with tempfile.TemporaryDirectory() as tmp:
        errs = _run("hf", pathlib.Path(tmp), timeout=200)
    assert set(errs) == {f"cp{c} {w}" for c in (2, 4) for w in ("logits", "loss", "grads")}
    bad = {k: v for k, v in errs.items() if not v <= TOL}
    assert not bad, f"relative errors above {TOL}: {bad}"
