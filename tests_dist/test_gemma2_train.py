"""examples/gemma2/train.py end to end under torchrun (CPU, gloo, cp = 2): a resumed run is
bitwise identical to an uninterrupted one (losses and final weights and optimizer state), newer
half-written or corrupt checkpoint folders are skipped with a warning, and two torchrun
processes with --nnodes 2 against a loopback c10d endpoint train with FSDP2 and save a sharded
checkpoint (the multi-node path)."""
import json
import os
import shutil
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import gemma2_launch as L  # noqa: E402

SMALL = ["--seq-len", "64", "--batch-size", "2", "--no-progress", "--cp", "2"]


def losses(path):
    with open(path) as f:
        return [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, f)]


def load_dcp(path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = path + ".pt"
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)


def flat(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


@pytest.mark.timeout(330)
def test_resume_is_bitwise_and_skips_broken_checkpoints(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    common = SMALL + ["--max-steps", "4", "--warmup", "2"]
    L.run(2, L.TRAIN, common + ["--ckpt-dir", a, "--metrics", a + ".jsonl"], 100, "straight run")
    L.run(2, L.TRAIN, common + ["--ckpt-dir", b, "--metrics", b + ".jsonl", "--stop-after", "2"], 100,
          "first half")
    # a newer half-written folder (no marker) and a newer corrupt one (truncated data file)
    shutil.copytree(os.path.join(b, "step-2"), os.path.join(b, "step-3"))
    os.remove(os.path.join(b, "step-3", "COMPLETE"))
    shutil.copytree(os.path.join(b, "step-2"), os.path.join(b, "step-7"))
    with open(os.path.join(b, "step-7", "COMPLETE")) as f:
        meta = json.load(f)
    meta["step"] = 7
    with open(os.path.join(b, "step-7", "COMPLETE"), "w") as f:
        json.dump(meta, f)
    victim = os.path.join(b, "step-7", "__0_0.distcp")
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    out = L.run(2, L.TRAIN, common + ["--ckpt-dir", b, "--metrics", b + ".jsonl"], 100, "resumed run")
    assert "resumed from step 2" in out
    assert "ignoring checkpoint" in out and "step-7" in out and "step-3" in out, out[-3000:]
    assert losses(a + ".jsonl") == losses(b + ".jsonl")          # bitwise: floats compared exactly
    sa, sb = dict(flat(load_dcp(os.path.join(a, "step-4")))), dict(flat(load_dcp(os.path.join(b, "step-4"))))
    assert sa.keys() == sb.keys() and any(k.startswith("model.") for k in sa)
    for k in sa:
        if isinstance(sa[k], torch.Tensor):
            assert torch.equal(sa[k], sb[k]), k
        else:
            assert sa[k] == sb[k], k


@pytest.mark.timeout(240)
def test_two_nodes_over_c10d_loopback(tmp_path):
    endpoint = f"127.0.0.1:{L.free_port()}"
    metrics = str(tmp_path / "m.jsonl")
    procs = [L.start(L.torchrun_args(1, nnodes=2, endpoint=endpoint, rdzv_id=f"gemma2-{os.getpid()}")
                     + [L.TRAIN, *SMALL, "--max-steps", "3", "--metrics", metrics, "--fsdp",
                        "--ckpt-dir", str(tmp_path / "ckpt")])
             for _ in range(2)]
    outs = L.finish(procs, 200, "two-node torchrun (c10d, loopback)")
    text = "\n".join(outs)
    assert "world 2 = dp 1 x cp 2" in text and "done: steps 1-3" in text, text[-3000:]
    rows = losses(metrics)
    assert [r[0] for r in rows] == [1, 2, 3] and all(r[1] == r[1] for r in rows)
    for rec in map(json.loads, open(metrics)):     # torchtitan's columns; no MFU without a GPU
        assert rec["mfu"] is None and rec["tokens_per_s_per_device"] > 0 and rec["tflops"] > 0
        assert rec["memory_gib"] > 0
    assert os.path.isfile(tmp_path / "ckpt" / "step-3" / "COMPLETE")


@pytest.mark.timeout(150)
def test_bad_flags_fail_before_any_process_group_and_print_once():
    p = L.start(L.torchrun_args(2) + [L.TRAIN, "--seq-len", "100", "--ac", "partial"])
    try:
        p.wait(timeout=120)        # two interpreters importing torch on a busy 2-core machine
    finally:
        L.proctree.kill_tree(p)
    out = L._read(p)
    assert p.returncode != 0
    assert out.count("invalid choice: 'partial'") == 1, out[-3000:]
    assert "]:Traceback" not in out        # no worker raised (torchrun's own summary follows)
