"""The tested HF model families (examples/hf/families.py) on one process: each tiny config has the
windowed layers docs/models.md lists, and what attn_implementation="cp_softcap" refuses for
every family (attention dropout, a padding mask; Gemma3's bidirectional mode) is refused with
its message. examples/hf/sft.py's usage errors. The multi-rank runs against eager are in
tests_dist/test_hf_models_cp.py."""
import importlib.util
import os
import sys

import pytest
import torch

pytest.importorskip("transformers", minversion="5")
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "examples", "hf"))
import families  # noqa: E402

# HF's sliding_window per windowed layer, as docs/models.md lists them
WINDOWS = {"gemma2": {0: 16}, "gemma3": {0: 10}, "mistral": {0: 12, 1: 12}, "qwen2": {1: 8},
           "gpt_oss": {0: 6}, "llama": {}}


@pytest.mark.parametrize("family", families.FAMILIES)
def test_tiny_config_windows(family):
    config = families.tiny_config(family)
    assert {i: config.sliding_window for i in families.windowed_layers(config)} == WINDOWS[family]


@pytest.mark.parametrize("family", families.FAMILIES)
def test_dropout_and_padding_masks_are_refused(family):
    ids = torch.randint(3, families.VOCAB, (1, 16))
    model = families.tiny_model(family, attention_dropout=0.1).train()
    with pytest.raises(ValueError, match=r"got attention dropout=0.1.*config.attention_dropout = 0.0"):
        model(input_ids=ids)
    model = families.tiny_model(family)
    mask = torch.ones(1, 16, dtype=torch.long)
    mask[0, -4:] = 0
    with pytest.raises(ValueError, match="2-D attention_mask .* with padding"):
        model(input_ids=ids, attention_mask=mask)
    model(input_ids=ids, attention_mask=torch.ones_like(mask))          # all ones: nothing to apply


def test_gemma3_bidirectional_is_refused():
    """use_bidirectional_attention adds a mask function that cp_softcap does not apply."""
    model = families.tiny_model("gemma3", use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="changes the causal mask with extra mask functions"):
        model(input_ids=torch.randint(3, families.VOCAB, (1, 16)))


def _example():
    spec = importlib.util.spec_from_file_location("hf_sft_example", os.path.join(ROOT, "examples", "hf", "sft.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv,world,message", [
    (["--cp", "3"], "4", "--cp 3 must divide the 4 ranks (dp = ranks / cp); use one of 1, 2, 4"),
    (["--comm", "a2a", "--cp", "8"], "8", "--comm a2a splits the 4 query heads over cp=8 ranks"),
    (["--family", "bert"], "1", "invalid choice: 'bert'"),
    (["--model-dir", "/nonexistent"], "1", "--model-dir /nonexistent has no config.json"),
])
def test_example_usage_errors(argv, world, message, capsys, monkeypatch):
    example = _example()
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as e:
        example.parse(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
