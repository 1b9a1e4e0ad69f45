"""examples/gemma2 flags and memory plan, without any process group: --help shows every default
and documents --keep; every bad flag is reported at once with the valid values, printed by rank 0
only; --plan prints the per-rank plan for any world size and exits without initialising
torch.distributed; a run that cannot fit is refused with flags that would fit."""
import os
import sys

import pytest
import torch
import torch.distributed as dist

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "examples"))
from gemma2 import data, flags, memory, train  # noqa: E402
from gemma2.config import get_config  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def test_help_shows_every_default():
    p = flags.parser("")
    text = " ".join(p.format_help().split())
    for action in p._actions:
        if action.option_strings and action.dest != "help":
            shown = f"(default: {action.default})"
            assert shown in text, (action.dest, shown)
    assert "(default: 256)" in text and "complete checkpoints to keep" in text


def _run(args, rank, monkeypatch, capsys):
    """flags.parse(args) as rank `rank` of 4 under torchrun: (exit status, stdout, stderr). In
    process: tests_dist/test_gemma2_train.py runs train.py itself under torchrun with bad flags."""
    for key, value in (("RANK", rank), ("WORLD_SIZE", "4"), ("LOCAL_WORLD_SIZE", "4")):
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as e:
        flags.parse(args)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_bad_flags_all_at_once_and_only_on_rank_0(monkeypatch, capsys):
    bad = ["--cp", "3", "--seq-len", "100", "--loss-chunk", "0", "--comm", "a2a"]
    (lead, _, err), other = _run(bad, "0", monkeypatch, capsys), _run(bad, "1", monkeypatch, capsys)
    assert lead == 2 and other == (0, "", "")     # rank 0 alone reports (flags.py)
    assert "--loss-chunk must be >= 1, got 0" in err and "divisors: 1, 2, 4" in err
    assert "--comm a2a splits the 4 query heads over cp=3" in err
    assert "--seq-len 100 must be a multiple of 2*cp = 6" in err      # although --cp 3 is refused too
    code, _, err = _run(["--ac", "some"], "0", monkeypatch, capsys)
    assert code == 2 and "choose from 'none', 'full', 'selective'" in err


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
    """The example README's 9b `--plan` command, run as written, refuses with the numbers it quotes
    (it names --device-mem-gib, so the result does not depend on this machine's memory)."""
    readme = open(os.path.join(ROOT, "examples", "gemma2", "README.md")).read()
    cmd = next(line.strip("`") for line in readme.splitlines()
               if line.startswith("`python examples/gemma2/train.py --plan"))
    argv = cmd.split()[2:]
    assert "--device-mem-gib" in argv
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    after = readme[readme.index(cmd):][:400]
    assert "refuses (334 GiB per rank)" in " ".join(after.split())
    assert "needs about 333.7 GiB per rank but the device has 139.0 GiB" in out
    assert "--fsdp --ac selective (91.7 GiB), --fsdp --ac full (29.5 GiB)" in out


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
    assert "--backend 'flash2' is not a kernel; choose auto, fa2, fa3, fa4, flex, sdpa, torch" in err
    monkeypatch.setenv("CP_SOFTCAP_BACKEND", "bogus")
    with pytest.raises(SystemExit):
        flags.parse([])
    assert "backend='bogus' is not a kernel" in capsys.readouterr().err
    monkeypatch.delenv("CP_SOFTCAP_BACKEND")
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


def _model_dir(path, vocab=300, tokenizer=False):
    path.mkdir()
    (path / "config.json").write_text(
        '{"model_type": "gemma2", "vocab_size": %d, "hidden_size": 64, "intermediate_size": 128, '
        '"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, '
        '"head_dim": 16}' % vocab)
    (path / "model.safetensors").write_bytes(b"")
    if tokenizer:
        (path / "tokenizer.json").write_text("{}")
    return str(path)


def test_model_dir_without_tokenizer_or_weights_is_refused(tmp_path, capsys, monkeypatch):
    md = _model_dir(tmp_path / "ckpt")
    err = _errors(["--model-dir", md], capsys, monkeypatch)
    assert f"--model-dir '{md}' has no tokenizer (tokenizer.json or tokenizer.model)" in err
    ids = tmp_path / "ids.pt"
    torch.save(torch.arange(1000) % 300, ids)       # token ids need no tokenizer
    monkeypatch.setattr(flags, "device_type", lambda args: "cpu")
    args, cfg, _ = flags.parse(["--model-dir", md, "--data", str(ids)])
    assert cfg.vocab_size == 300
    torch.save(torch.arange(1000), ids)
    err = _errors(["--model-dir", md, "--data", str(ids)], capsys, monkeypatch)
    assert "has token id 999 >= vocab size 300" in err
    os.remove(os.path.join(md, "model.safetensors"))
    err = _errors(["--model-dir", md], capsys, monkeypatch)
    assert f"no *.safetensors in --model-dir '{md}'" in err and "has no tokenizer" in err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{bad json")
    err = _errors(["--model-dir", str(bad)], capsys, monkeypatch)
    assert f"{bad / 'config.json'} is not valid JSON" in err


@pytest.mark.parametrize("name, content, extra, message", [
    ("missing.txt", None, [], "does not exist"),
    ("empty.txt", b"", [], "holds no text"),
    ("blank.txt", b"\n\n  \n", ["--pack", "--batch-size", "1"], "holds no text"),
    ("bin.dat", bytes(range(256)), [], "is not UTF-8 text"),
    ("tiny.txt", b"abc", [], "the corpus has 3 tokens, fewer than --seq-len 256 + 1"),
    ("float.pt", torch.rand(500), [], "must hold a 1-D integer tensor of token ids, got Tensor torch.float32"),
    ("rows.pt", torch.zeros(2, 500, dtype=torch.long), [], "must hold a 1-D integer tensor"),
    ("bool.pt", torch.ones(500, dtype=torch.bool), [], "must hold a 1-D integer tensor"),
    ("empty.pt", torch.zeros(0, dtype=torch.long), [], "holds an empty tensor"),
    ("neg.pt", torch.tensor([5] * 300 + [-5]), [], "holds token id -5 at position 300; ids must be >= 0"),
    ("big.pt", torch.tensor([5] * 300 + [259]), [], "has token id 259 >= vocab size 259"),
    ("eos.pt", torch.ones(300, dtype=torch.long), ["--pack", "--batch-size", "1"], "--pack found no documents"),
    ("junk.pt", b"not a pickle", [], "could not be read as a torch.save file"),
])
def test_data_is_checked_with_the_flags(tmp_path, capsys, monkeypatch, name, content, extra, message):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        torch.save(content, path)
    err = _errors(["--data", str(path), *extra], capsys, monkeypatch)
    assert message in err, err


def test_loader_and_check_share_one_validation(tmp_path):
    neg = tmp_path / "neg.pt"
    torch.save(torch.tensor([3, -1]), neg)
    for load in (data.load_tokens, data.load_documents):
        with pytest.raises(ValueError, match="holds token id -1 at position 1"):
            load(str(neg))
    with pytest.raises(FileNotFoundError, match="has no tokenizer"):
        data.load_tokens(None, model_dir=str(tmp_path))


def test_plan_needs_no_corpus_that_long(capsys):
    """--plan reads shapes only: 1M tokens plan although the built-in corpus has ~466K."""
    with pytest.raises(SystemExit) as e:
        train.main(["--plan", "--config", "9b", "--seq-len", "1048576", "--world-size", "64", "--batch-size", "1",
                    "--fsdp", "--ac", "full", "--dtype", "bfloat16", "--device-mem-gib", "139"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "seq 1048576 (16384 tokens per rank)" in out and out.rstrip().endswith("fits")
    with pytest.raises(SystemExit) as e:      # a real run still checks the corpus
        flags.parse(["--seq-len", "1048576"])
    assert e.value.code == 2 and "fewer than --seq-len 1048576" in capsys.readouterr().err


@pytest.mark.parametrize("user", [None, ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512"),
                                  ("PYTORCH_ALLOC_CONF", "expandable_segments:False")])
def test_allocator_defaults_to_expandable_segments_unless_configured(monkeypatch, user):
    """The memory plan counts allocated bytes, so runs get expandable segments by default; an
    allocator the user configured (either variable) is left exactly as set."""
    from gemma2 import allocator
    for name in allocator.USER_SETTINGS:       # set, then removed: restored as they were after
        monkeypatch.setenv(name, "x")
        monkeypatch.delenv(name)
    if user:
        monkeypatch.setenv(*user)
    allocator.expandable_segments()
    if user is None:
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    else:
        assert os.environ[user[0]] == user[1]
        other = (set(allocator.USER_SETTINGS) - {user[0]}).pop()
        assert other not in os.environ


def test_every_run_entry_sets_the_allocator_before_torch_is_imported():
    """CUDA builds of torch may read the allocator's settings when torch loads: each entry
    script calls expandable_segments() before its first torch import, and nothing it imports
    before that imports torch."""
    import ast
    from gemma2 import allocator
    imports = [ast.unparse(n) for n in ast.walk(ast.parse(open(allocator.__file__).read()))
               if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert imports == ["import os"], imports

    def roots(node):                    # the top-level packages an import statement loads
        if isinstance(node, ast.Import):
            return {a.name.split(".")[0] for a in node.names}
        return {(node.module or "").split(".")[0]} if isinstance(node, ast.ImportFrom) else set()

    for name in ("examples/gemma2/train.py", "benchmarks/training/speed.py",
                 "benchmarks/training/memcheck.py"):
        tree = ast.parse(open(os.path.join(ROOT, name)).read())
        call = next(n.lineno for n in tree.body if isinstance(n, ast.Expr)
                    and ast.unparse(n) == "expandable_segments()")
        first_torch = min(n.lineno for n in tree.body if roots(n) & {"torch", "cp_softcap"})
        assert call < first_torch, (name, call, first_torch)
        before = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.lineno < call
                  and n.module and n.module.startswith("gemma2")]
        assert [n.module for n in before] == ["gemma2.allocator"], (name, [n.module for n in before])


def test_plan_leaves_cuda_its_own_memory(monkeypatch):
    """On a GPU the plan may use the card's total less what CUDA holds outside PyTorch's
    allocator (an H100 run with 1.28 GiB of it ran out of memory at a plan that filled the
    card); --device-mem-gib is taken as given."""
    class Props:
        total_memory = 80 * memory.GIB
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert memory.device_memory("cuda", 1) == 80 * memory.GIB - memory.CUDA_OUTSIDE_ALLOCATOR
    assert memory.CUDA_OUTSIDE_ALLOCATOR >= 1.28 * memory.GIB
    assert memory.device_memory("cuda", 1, 139.0) == 139 * memory.GIB


def _plan(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        train.main(["--plan", *argv])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_plan_defaults_to_the_gpu_run_a_user_would_make(capsys, monkeypatch):
    """--plan with no --dtype / --batch-size plans a GPU run: bf16, batch 1, against an 80 GB H100
    when this machine has no GPU (said in the output), the GPU's memory when it has one, or
    --device-mem-gib; 9b at 128K on 8 ranks then names the flags that fit."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    out = _plan(["--config", "9b", "--seq-len", "131072", "--world-size", "8"], capsys)
    assert "batch 1, bfloat16" in out and "(16384 tokens per rank)" in out
    assert "no GPU here: planned against an 80 GB H100, 79.11 GiB" in out
    assert f"{(memory.H100_TOTAL - memory.CUDA_OUTSIDE_ALLOCATOR) / memory.GIB:10.3f} GiB" in out
    assert "these would fit: --fsdp --ac full (29.5 GiB)" in out and "nothing among" not in out
    out = _plan(["--config", "9b", "--seq-len", "131072", "--world-size", "8", "--device-mem-gib", "60"], capsys)
    assert "60.000 GiB" in out and "no GPU here" not in out and "batch 1, bfloat16" in out

    class Props:
        total_memory = 141 * memory.GIB
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    out = _plan(["--config", "9b", "--seq-len", "131072", "--world-size", "8", "--fsdp", "--ac", "full"], capsys)
    assert "139.500 GiB" in out and "no GPU here" not in out and out.rstrip().endswith("fits")


def test_plan_takes_given_batch_dtype_and_a_cpu_device(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = _plan(["--config", "2b", "--seq-len", "8192", "--world-size", "8", "--batch-size", "2",
                 "--dtype", "float32", "--device-mem-gib", "80"], capsys)
    assert "batch 2, float32" in out
    out = _plan(["--config", "2b", "--seq-len", "8192", "--world-size", "8", "--device", "cpu"], capsys)
    assert "batch 1, float32" in out and "no GPU here" not in out      # a CPU run: the host's memory
    args, _, _ = flags.parse([])
    assert args.batch_size == 8                                          # a run's default is unchanged


def test_help_plan_example_plans_a_run_that_fits(capsys, monkeypatch):
    """train.py's --help names a 27b --plan at 131,072 tokens on 64 ranks: as written it plans
    bf16, batch 1, and fits an H100 (this machine has no GPU, or its own)."""
    cmd = next(line.strip() for line in train.__doc__.splitlines() if "--plan" in line and "train.py" in line)
    argv = cmd.split("train.py", 1)[1].split()
    assert "--dtype" not in argv and "--batch-size" not in argv and "--device-mem-gib" not in argv
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = _plan([a for a in argv if a != "--plan"], capsys)
    assert "64 ranks = dp 1 x cp 64" in out and "batch 1, bfloat16" in out
    assert out.rstrip().endswith("fits") and "does not fit" not in out


def test_every_flag_problem_is_reported_with_the_seq_len(capsys, monkeypatch):
    """--cp 3 --seq-len 100 --data nope.txt --comm a2a on one process: four problems, four lines."""
    err = _errors(["--cp", "3", "--seq-len", "100", "--data", "nope.txt", "--comm", "a2a"], capsys, monkeypatch)
    problems = err.split("train.py: error:", 1)[1].strip().splitlines()
    assert len(problems) == 4, err
    assert "--cp 3 must divide the world size 1" in problems[0]
    assert "--seq-len 100 must be a multiple of 2*cp = 6" in problems[1] and "use --seq-len 102" in problems[1]
    assert "--comm a2a splits the 4 query heads over cp=3" in problems[2]
    assert "--data 'nope.txt' does not exist" in problems[3]
