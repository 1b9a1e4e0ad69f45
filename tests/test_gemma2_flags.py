"""examples/gemma2 flags and memory plan, without any process group: --help shows every default
and documents --keep; every bad flag is reported at once with the valid values, printed by rank 0
only; --plan prints the per-rank plan for any world size and exits without initialising
torch.distributed; a run that cannot fit is refused with flags that would fit."""
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "examples"))
from gemma2 import flags, memory, train  # noqa: E402
from gemma2.config import get_config  # noqa: E402

pytestmark = pytest.mark.timeout(120)
TRAIN = os.path.join(ROOT, "examples", "gemma2", "train.py")


def test_help_shows_every_default():
    p = flags.parser("")
    text = " ".join(p.format_help().split())
    for action in p._actions:
        if action.option_strings and action.dest != "help":
            shown = f"(default: {action.default})"
            assert shown in text, (action.dest, shown)
    assert "(default: 256)" in text and "complete checkpoints to keep" in text


def _run(args, rank="0"):
    env = dict(os.environ, RANK=rank, WORLD_SIZE="4", LOCAL_WORLD_SIZE="4")
    return subprocess.run([sys.executable, TRAIN, *args], env=env, capture_output=True, text=True,
                          timeout=60)


def test_bad_flags_all_at_once_and_only_on_rank_0():
    bad = ["--cp", "3", "--seq-len", "100", "--loss-chunk", "0", "--comm", "a2a"]
    lead, other = _run(bad, "0"), _run(bad, "1")
    assert lead.returncode == 2 and other.returncode == 0     # rank 0 alone reports (flags.py)
    assert other.stdout == other.stderr == ""
    err = lead.stderr
    assert "--loss-chunk must be >= 1, got 0" in err and "divisors: 1, 2, 4" in err
    assert "--comm a2a splits the 4 query heads over cp=3" in err
    choice = _run(["--ac", "some"], "0")
    assert choice.returncode == 2 and "choose from 'none', 'full', 'selective'" in choice.stderr


def test_compile_refused_without_a_cxx_compiler(monkeypatch):
    monkeypatch.setattr(flags.shutil, "which", lambda name: None)
    monkeypatch.setattr(flags, "device_type", lambda args: "cpu")
    with pytest.raises(SystemExit):
        flags.parse(["--compile"])


def test_plan_for_64_ranks_without_a_process_group(capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--plan", "--world-size", "64", "--config", "27b", "--seq-len", "131072",
                    "--batch-size", "1", "--fsdp", "--ac", "full", "--dtype", "bfloat16",
                    "--device-mem-gib", "141"])
    assert e.value.code == 0 and not dist.is_initialized()
    out = capsys.readouterr().out
    assert "64 ranks = dp 1 x cp 64" in out and "2048 tokens per rank" in out
    assert "peak = parameters + optimizer" in out and "141.000 GiB" in out


def test_refusal_names_flags_that_fit():
    job = memory.Job(get_config("2b"), 32768, 1, 8, 8, dtype="bfloat16", device_type="cuda")
    limit = 45 * memory.GIB
    msg = memory.check(job, limit)
    assert msg and "per rank but the device has 45.0 GiB" in msg and "--fsdp" in msg
    assert memory.check(memory.Job(get_config("2b"), 32768, 1, 8, 8, fsdp=True, ac="full",
                                   dtype="bfloat16", device_type="cuda"), limit) is None


def test_plan_rows_move_the_right_way():
    """AC and FSDP shrink what they should; 4x the sequence roughly 4x the activations."""
    base = dict(cfg=get_config("9b"), batch=1, world=8, cp=8, dtype="bfloat16", device_type="cuda")

    def rows(**kw):
        return dict(memory.estimate(memory.Job(**{**base, **kw})))

    none, full = rows(seq_len=32768), rows(seq_len=32768, ac="full")
    sel, fsdp = rows(seq_len=32768, ac="selective"), rows(seq_len=32768, fsdp=True)
    acts = "activations kept for backward [step]"
    assert full[acts] < sel[acts] < none[acts]
    assert fsdp["parameters (float32)"] * 8 == none["parameters (float32)"]
    long = rows(seq_len=131072)
    assert 3.9 < long[acts] / none[acts] < 4.1


def test_readme_plan_example_prints_what_readme_says(capsys):
    """The README's 9b `--plan` command, run as written, refuses with the numbers README quotes
    (it names --device-mem-gib, so the result does not depend on this machine's memory)."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    cmd = next(line.strip("`") for line in readme.splitlines()
               if line.startswith("`python examples/gemma2/train.py --plan"))
    argv = cmd.split()[2:]
    assert "--device-mem-gib" in argv
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    after = readme[readme.index(cmd):][:400]
    assert "refuses (313 GiB per rank)" in " ".join(after.split())
    assert "needs about 313.1 GiB per rank but the device has 139.0 GiB" in out
    assert "--fsdp --ac selective (100.9 GiB), --fsdp --ac full (29.7 GiB)" in out


def _errors(argv, capsys, monkeypatch) -> str:
    """flags.parse's report for argv on a plain one-process run (status 2)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "CP_SOFTCAP_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as e:
        flags.parse(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_bad_numbers_are_refused_with_the_flags(capsys, monkeypatch):
    err = _errors(["--lr", "nan", "--min-lr-ratio", "-3", "--weight-decay", "-1"], capsys, monkeypatch)
    assert "--lr must be a finite number, got nan" in err
    assert "--min-lr-ratio must be in [0, 1]" in err and "got -3.0" in err
    assert "--weight-decay must be >= 0, got -1.0" in err
    err = _errors(["--lr", "0", "--min-lr-ratio", "1.5"], capsys, monkeypatch)
    assert "--lr must be > 0, got 0.0" in err and "got 1.5" in err


def test_backend_is_checked_with_the_flags(capsys, monkeypatch):
    err = _errors(["--backend", "flash2"], capsys, monkeypatch)
    assert "--backend flash2: backend='flash2' is not a kernel" in err and "'fa2'" in err
    err = _errors(["--backend", "sdpa"], capsys, monkeypatch)
    assert "--backend sdpa cannot serve the sliding layers" in err and "softcap=50.0" in err
    err = _errors(["--backend", "fa2", "--device", "cpu"], capsys, monkeypatch)
    assert "--backend fa2 cannot serve" in err and "does not run on cpu" in err
    assert "use --backend auto (here: torch)" in err
    monkeypatch.setattr(flags, "device_type", lambda args: "cpu")
    args, _, _ = flags.parse(["--backend", "torch"])
    assert args.backend == "torch"


def test_output_paths_are_checked_before_training(tmp_path, capsys, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("x")
    err = _errors(["--ckpt-dir", str(afile), "--metrics", str(tmp_path / "nodir" / "m.jsonl")],
                  capsys, monkeypatch)
    assert f"--ckpt-dir '{afile}' exists and is not a directory" in err
    assert f"its directory {tmp_path / 'nodir'} does not exist" in err
    err = _errors(["--ckpt-dir", str(afile / "sub"), "--metrics", str(tmp_path)], capsys, monkeypatch)
    assert f"cannot be created: {afile} is a file" in err and "is a directory; pass a file" in err
    args, _, _ = flags.parse(["--ckpt-dir", str(tmp_path / "new" / "ckpt"),
                              "--metrics", str(tmp_path / "m.jsonl")])
    assert not (tmp_path / "new").exists()     # checked, not created: rank 0 creates it at the first save
