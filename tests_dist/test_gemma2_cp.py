"""Gemma2 under context parallelism equals the full model on one process (world 4, gloo; the
ranks of tests_dist/gemma2_workers.py forked by tests_dist/harness.py, whose forkserver has
imported torch and transformers once): examples/gemma2's training step with cp = 1, 2, 4 and
dp x cp = 2 x 2, for every comm type (ring, all_gather, a2a, a2a+p2p with a2a groups of 2, auto;
all in one launch), and HF
Gemma2ForCausalLM with attn_implementation="cp_softcap" under CP 2 and 4 (ring; a2a and a2a+p2p
at CP 4). a2a needs the query heads divisible by the a2a group: both configs have 4 heads, which
cp 2 and 4 divide. float32, a sequence longer than the sliding window, relative errors within
1e-5. The example's DDP (gradients summed during backward) against a flat all-reduce after
backward over a few optimizer steps: bitwise on 2 ranks, to float32 rounding on 4. Also (no
ranks) the train.py --comm / --a2a-size checks."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import gemma2_launch as L  # noqa: E402
from harness import run_ranks  # noqa: E402

TOL = 1e-5


# CP algorithms the training step is checked with: ring at (dp, cp) = (4,1), (2,2), (1,4), each
# other one at (2,2) and (1,4); "a2a+p2p:2" = all-to-all groups of 2 ranks, a ring across them
COMMS = "ring,all_gather,a2a,a2a+p2p:2,auto"


def _workers(rank, world, kind, *args):
    """One rank of gemma2_workers.<kind>(*args) in the harness's process group."""
    import gemma2_workers
    getattr(gemma2_workers, kind)(*args)


def _run(kind, tmp_path, timeout, *extra):
    out = tmp_path / f"{kind}.json"
    run_ranks(_workers, 4, kind, str(out), *extra, timeout=timeout, env={"CP_SOFTCAP_TIMEOUT": "60"})
    errs = json.loads(out.read_text())
    print(json.dumps(errs, indent=1))
    return errs


# DDP against the flat all-reduce at dp 2 x cp 2 over 3 AdamW steps (lr 1e-2): 4 ranks sum in an
# order that depends on how each all-reduce splits its buffer, so the gradients agree to float32
# rounding; AdamW divides each update by its gradient's RMS (eps 1e-8), which turns the rounding
# of a gradient that nearly cancels into an update difference of up to lr x 1e-3 or so (measured:
# losses equal, gradients 6e-8 apart in norm, weights 1.4e-6)
DDP_4_RANKS_TOL = {"loss": 1e-6, "grads": 1e-6, "weights": 1e-3 * 1e-2}


@pytest.mark.timeout(240)
def test_training_step_cp_equals_single_process(tmp_path):
    errs = _run("recipe", tmp_path, 200, COMMS)
    control = errs.pop("control: no window, loss")
    ddp = {k[len("ddp dp2xcp2 "):]: errs.pop(k) for k in list(errs) if k.startswith("ddp ")}
    assert ddp.pop("weights moved") > 1e-3, ddp
    assert all(ddp[k] <= tol for k, tol in DDP_4_RANKS_TOL.items()) and len(ddp) == 3, ddp
    assert set(errs) >= {"dp4xcp1 loss", "dp2xcp2 grads", "dp1xcp4 grads", "cp2 grads"}
    for comm in (c.split(":")[0] for c in COMMS.split(",") if c != "ring"):
        assert set(errs) >= {f"dp{dp}xcp{cp} {comm} {w}" for dp, cp in ((2, 2), (1, 4))
                             for w in ("loss", "grads")}, comm
    bad = {k: v for k, v in errs.items() if not v <= TOL}
    assert not bad, f"relative errors above {TOL}: {bad}"
    assert control > 100 * TOL, f"dropping the sliding window changed the loss by only {control:.2e}"


@pytest.mark.timeout(200)
def test_activation_checkpointing_is_bitwise_under_cp(tmp_path):
    """--ac full / selective give the loss and gradients of --ac none, bitwise, at cp 4 for ring,
    all_gather and a2a: the recomputed forward reruns the CP collectives in step on every rank."""
    errs = _run("ac", tmp_path, 160)
    for comm in ("ring", "all_gather", "a2a"):    # 2 layers: attention calls x 100 + MLP calls
        calls = {m: errs.pop(f"{comm} ac {m} calls") for m in ("none", "full", "selective")}
        assert calls == {"none": 202, "full": 404, "selective": 204}, (comm, calls)
    assert set(errs) == {f"{c} ac {m}" for c in ("ring", "all_gather", "a2a") for m in ("full", "selective")}
    assert not any(errs.values()), f"AC changed the result: {errs}"


# One launch serves both checks of world 2 (a module fixture would launch once per xdist worker)
@pytest.mark.timeout(240)
def test_packed_step_and_ddp_at_world_2(tmp_path):
    """train.py --pack's step at cp 2 (ring, a2a) equals the single-process loss and gradients
    computed one document at a time; dropping the boundaries changes the loss.

    parallelize.apply_ddp (DDP summing gradients during backward) against a flat all-reduce of
    every gradient after backward, 3 AdamW steps at dp 2 x cp 1 and dp 1 x cp 2: losses, the
    first step's gradients and the final weights bitwise equal (2 ranks: one order of
    summation), also with several small buckets and with the layers compiled (blocks,
    aot_eager, fullgraph; one graph per kind of layer, no graph break) under selective AC. With
    small buckets, DDP had launched all but the embedding's bucket before backward produced the
    embedding's gradient, its last."""
    run_ranks(_workers, 2, "world2", str(tmp_path), timeout=200, env={"CP_SOFTCAP_TIMEOUT": "60"})
    found = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in ("packed", "ddp")}
    print(json.dumps(found, indent=1))

    errs = found["packed"]
    control = errs.pop("control: boundaries dropped, loss")
    assert errs.pop("documents") == 5
    assert set(errs) == {f"pack cp2 {c} {w}" for c in ("ring", "a2a") for w in ("loss", "grads")}
    bad = {k: v for k, v in errs.items() if not v <= TOL}
    assert not bad, f"relative errors above {TOL}: {bad}"
    assert control > 100 * TOL, f"dropping the document boundaries changed the loss by only {control:.2e}"

    errs = found["ddp"]
    assert errs.pop("compiled graphs") == 2 and errs.pop("compiled graph breaks") == 0, errs
    buckets, before = errs.pop("buckets"), errs.pop("buckets launched before the embedding gradient")
    assert buckets > 2 and before == buckets - 1, (buckets, before)
    tags = ("dp2xcp1", "dp1xcp2 small buckets", "dp1xcp2 compiled ac")
    assert set(errs) == {f"ddp {t} {w}" for t in tags for w in ("loss", "grads", "weights", "weights moved")}
    assert all(errs[f"ddp {t} weights moved"] > 1e-3 for t in tags), errs
    assert not any(v for k, v in errs.items() if not k.endswith("moved")), f"not bitwise: {errs}"


def test_pack_data_and_flags():
    """--pack's rows from the built-in corpus (documents at blank lines): bos at every document
    start, the last token of each document and the padding tail unlabelled, labels the next token
    inside a document; --pack with --batch-size > 1 is refused before anything is built."""
    sys.path.insert(0, os.path.join(os.path.dirname(L.TRAIN), os.pardir))
    from gemma2.data import get_packed_batch, load_documents
    from gemma2.flags import parse

    docs = load_documents()
    assert len(docs) > 100
    for step in range(3):
        inp, lab, cu = get_packed_batch(docs, step=step, dp_rank=0, seq_len=512, seed=0)
        assert cu[0] == 0 and cu[-1] <= 512 and len(cu) >= 2
        for a, b in zip(cu, cu[1:]):
            assert inp[0, a] == 2 and lab[0, b - 1] == -100
            assert (lab[0, a:b - 1] == inp[0, a + 1:b]).all()
        assert (lab[0, cu[-1]:] == -100).all() and (inp[0, cu[-1]:] == 0).all()
    args = parse(["--pack", "--batch-size", "1", "--cp", "1"])[0]
    assert args.pack and args.batch_size == 1
    with pytest.raises(SystemExit) as e:
        parse(["--pack", "--cp", "1"])
    assert e.value.code == 2


@pytest.mark.timeout(240)
def test_hf_gemma2_cp_equals_eager():
    pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[gemma2]')")
    import tempfile, pathlib
    with tempfile.TemporaryDirectory() as tmp:
        errs = _run("hf", pathlib.Path(tmp), timeout=200)
    tags = ["cp2", "cp4", "cp4 a2a", "cp4 a2a+p2p"]
    assert set(errs) == {f"{t} {w}" for t in tags for w in ("logits", "loss", "grads")}
    bad = {k: v for k, v in errs.items() if not v <= TOL}
    assert not bad, f"relative errors above {TOL}: {bad}"


def test_comm_flag_checks():
    """train.py's --comm / --a2a-size verdicts (parallel.check_comm), before any process group."""
    sys.path.insert(0, os.path.join(os.path.dirname(L.TRAIN), os.pardir))
    from gemma2 import parallel
    from gemma2.flags import parser

    parse_args = parser("").parse_args

    for comm in ("ring", "all_gather", "a2a", "auto"):
        parallel.check_comm(comm, 4, 4)
        assert parse_args(["--comm", comm]).comm == comm
    parallel.check_comm("a2a+p2p", 8, 4, 2)
    parallel.check_comm("a2a+p2p", 4, 4, 4)
    assert parse_args(["--comm", "a2a+p2p", "--a2a-size", "2"]).a2a_size == 2
    for args, match in [(("a2a", 8, 4), r"splits the 4 query heads over cp=8 .* --a2a-size 4"),
                        (("a2a+p2p", 8, 4), r"needs --a2a-size N.* \(1, 2, 4\)"),
                        (("a2a+p2p", 8, 4, 3), r"--a2a-size 3 must divide both cp=8 and the 4"),
                        (("a2a+p2p", 8, 4, 8), r"--a2a-size 8 must divide .* use one of 1, 2, 4"),
                        (("a2a+p2p", 6, 4, 4), r"--a2a-size 4 must divide both cp=6"),
                        (("ring", 4, 4, 2), r"only for --comm a2a\+p2p"),
                        (("nccl", 4, 4), r"choose one of ring, all_gather")]:
        with pytest.raises(ValueError, match=match):
            parallel.check_comm(*args)
    with pytest.raises(SystemExit):
        parse_args(["--comm", "ulysses"])


def test_hf_use_cp_group_comm_checks():
    """use_cp_group refuses a group that does not fit comm (before any collective)."""
    pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[gemma2]')")
    from cp_softcap.integrations.hf import use_cp_group
    with pytest.raises(ValueError, match="only meaningful with comm='a2a\\+p2p'"):
        use_cp_group((object(), object()), comm="ring")
    with pytest.raises(ValueError, match="make_hybrid_groups"):
        use_cp_group(object(), comm="a2a+p2p")
    with pytest.raises(ValueError, match="comm must be one of"):
        use_cp_group(None, comm="ulysses")
    use_cp_group(None, comm="a2a+p2p")      # one device: accepted, comm unused
    use_cp_group(None)
