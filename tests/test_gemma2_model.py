"""examples/gemma2's model equals transformers' Gemma2ForCausalLM (eager attention) on a tiny
random config with the same weights, in float32: logits and every parameter's gradient, with a
sequence longer than the sliding window; and HF safetensors load into it by name."""
import copy
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[gemma2]')")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from gemma2.config import from_hf_json, get_config  # noqa: E402
from gemma2.model import Gemma2, load_hf_weights  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def hf_tiny(cfg):
    hcfg = transformers.Gemma2Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        query_pre_attn_scalar=cfg.query_pre_attn_scalar, sliding_window=cfg.sliding_window,
        attn_logit_softcapping=cfg.attn_logit_softcapping,
        final_logit_softcapping=cfg.final_logit_softcapping, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    return hcfg


def randomize(model):
    """Weights large enough that both softcaps and the window matter; norms away from 0."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 0.15))


def twins(seq_window=24, cap=5.0):
    cfg = get_config("tiny", sliding_window=seq_window, attn_logit_softcapping=cap,
                     final_logit_softcapping=3.0, num_hidden_layers=3)
    hf = transformers.Gemma2ForCausalLM._from_config(copy.deepcopy(hf_tiny(cfg)), attn_implementation="eager")
    randomize(hf)
    ours = Gemma2(cfg)
    missing = ours.load_state_dict(hf.state_dict(), strict=False)
    assert not missing.missing_keys, missing.missing_keys
    assert set(missing.unexpected_keys) <= {"lm_head.weight"}
    return cfg, hf.double().float(), ours


def test_logits_and_grads_match_hf_eager():
    cfg, hf, ours = twins()
    ids = torch.randint(0, cfg.vocab_size, (2, 80))          # 80 > window 24: sliding layers differ
    ref = hf(input_ids=ids).logits
    out = ours(ids)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(ref)
    (ref * g).sum().backward()
    (out * g).sum().backward()
    hp = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        ref_g = hp[name].grad
        torch.testing.assert_close(p.grad, ref_g, rtol=1e-4, atol=1e-5 * max(1.0, ref_g.abs().max().item()),
                                   msg=name)
    # negative control: the window matters at this length (a full-causal sliding layer differs)
    ours.model.layers[0].self_attn.attn.window = (None, 0)
    assert (ours(ids) - ref).abs().max() > 1e-3


def test_position_ids_are_global():
    cfg, hf, ours = twins()
    ids = torch.randint(0, cfg.vocab_size, (1, 48))
    pos = torch.arange(48)[None] + 7
    torch.testing.assert_close(ours(ids, pos), hf(input_ids=ids, position_ids=pos).logits,
                               rtol=1e-5, atol=1e-5)


def test_load_hf_safetensors_dir(tmp_path):
    cfg, hf, ours = twins()
    hf.save_pretrained(tmp_path)
    loaded_cfg = from_hf_json(str(tmp_path))
    for field in ("hidden_size", "num_hidden_layers", "head_dim", "sliding_window", "query_pre_attn_scalar",
                  "attn_logit_softcapping", "final_logit_softcapping", "rope_theta", "vocab_size"):
        assert getattr(loaded_cfg, field) == getattr(cfg, field), field
    fresh = Gemma2(loaded_cfg)
    load_hf_weights(fresh, str(tmp_path))
    ids = torch.randint(0, cfg.vocab_size, (1, 40))
    torch.testing.assert_close(fresh(ids), hf(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_load_rejects_wrong_shapes(tmp_path):
    cfg, hf, _ = twins()
    hf.save_pretrained(tmp_path)
    other = Gemma2(get_config("tiny", hidden_size=32))
    with pytest.raises(ValueError, match="does not match"):
        load_hf_weights(other, str(tmp_path))
