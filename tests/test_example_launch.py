"""The small examples' launcher (examples/_launch.py): a bad --nproc or a rank count the example
cannot run is a usage error (status 2) before any process is spawned; under torchrun only rank 0
prints it."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import _launch  # noqa: E402
import minimal_cp  # noqa: E402
import packed_cp  # noqa: E402

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def no_spawn(monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(_launch.mp, "spawn", lambda *a, **k: pytest.fail("spawned after a usage error"))


def _usage_error(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("main", [minimal_cp.main, packed_cp.main])
@pytest.mark.parametrize("nproc", ["0", "-2"])
def test_nproc_below_one_is_a_usage_error(main, nproc, capsys):
    err = _usage_error(main, ["--nproc", nproc], capsys)
    assert "usage:" in err and f"--nproc must be >= 1 (the ranks to spawn), got {nproc}" in err


def test_packed_cp_refuses_ranks_its_a2a_case_cannot_take(capsys, monkeypatch):
    err = _usage_error(packed_cp.main, ["--nproc", "3"], capsys)
    assert "splits its 4 query heads over the ranks; use 1, 2, 4 ranks" in err
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SystemExit) as e:      # torchrun: rank 0 reports, the others stay quiet
        packed_cp.main([])
    assert e.value.code == 0 and capsys.readouterr().err == ""


def test_dp_split_is_checked(capsys):
    err = _usage_error(minimal_cp.main, ["--nproc", "4", "--dp", "3"], capsys)
    assert "--dp 3 does not divide the number of ranks 4" in err


def test_hf_trainer_flags_are_checked_once_before_setup(capsys, monkeypatch):
    pytest.importorskip("transformers")
    from gemma2 import hf_trainer
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    for argv, message in ((["--cp", "3"], "--cp 3 must divide the 4 ranks (dp = ranks / cp); use one of 1, 2, 4"),
                          (["--cp", "0"], "--cp must be >= 1, got 0"),
                          (["--comm", "a2a+p2p"], "invalid choice: 'a2a+p2p'"),
                          (["--comm", "bogus"], "invalid choice: 'bogus'"),
                          (["--cp", "4", "--comm", "a2a", "--steps", "0"], "--steps must be >= 1")):
        err = _usage_error(hf_trainer.parse, argv, capsys)
        assert message in err, (argv, err)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as e:
        hf_trainer.parse(["--cp", "3"])
    assert e.value.code == 0 and capsys.readouterr().err == ""
    assert hf_trainer.parse(["--cp", "4", "--comm", "a2a"]).comm == "a2a"
