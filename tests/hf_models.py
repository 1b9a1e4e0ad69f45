"""Tiny random HF models (Gemma2, gpt-oss, and every family of examples/hf/families.py) as
eager / cp_softcap pairs for the HF integration tests (callers importorskip transformers first)."""
import copy

import torch


def gemma2_pair(**config):
    """(eager, ours): one tiny random Gemma2ForCausalLM (softcap, sliding window, GQA, scaling
    1/sqrt(query_pre_attn_scalar)) under attn_implementation "eager" and "cp_softcap", with the
    same weights, scaled so that the logits saturate the softcap. `config` overrides fields of
    the Gemma2Config."""
    import transformers
    base = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=12,
                sliding_window=16, attn_logit_softcapping=3.0, final_logit_softcapping=5.0)
    base.update(config)
    cfg = transformers.Gemma2Config(**base)
    eager = transformers.Gemma2ForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="eager")
    with torch.no_grad():
        for name, p in eager.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 0.5))   # saturate the softcap
    ours = transformers.Gemma2ForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="cp_softcap")
    ours.load_state_dict(eager.state_dict())
    return eager, ours


GPTOSS_SINKS = (8.0, -1.0, 10.0, 0.5)       # heads 0 and 2: the sink dominates their rows


def gptoss_pair(**config):
    """(eager, ours): one tiny random GptOssForCausalLM (learned attention sinks `s_aux`, a
    sliding layer of window 6 then a full layer, GQA 4/2, MoE with 4 experts) under "eager"
    and "cp_softcap", with the same weights; its sinks GPTOSS_SINKS. float32 only: gpt-oss's
    eager MoE uses a grouped matmul that refuses float64."""
    import transformers
    base = dict(vocab_size=97, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                num_experts_per_tok=2, sliding_window=6,
                layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256)
    base.update(config)
    cfg = transformers.GptOssConfig(**base)
    eager = transformers.GptOssForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="eager")
    with torch.no_grad():
        for name, p in eager.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 0.5))
            if name.endswith("sinks"):
                p.copy_(torch.tensor(GPTOSS_SINKS))
    ours = transformers.GptOssForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="cp_softcap")
    ours.load_state_dict(eager.state_dict())
    return eager, ours


# Gemma2's softcaps small enough for the 0.5-scaled weights to saturate them
_SATURATE = {"gemma2": dict(attn_logit_softcapping=3.0, final_logit_softcapping=5.0)}


def family_pair(family, dtype=torch.float64, **config):
    """(eager, ours): examples/hf/families.py's tiny random model of `family` under "eager" and
    "cp_softcap" with the same weights, scaled as gemma2_pair's (gpt-oss's sinks GPTOSS_SINKS),
    in float64 by default (gpt-oss with its "eager" experts, which take float64). `config`
    overrides fields of the family's tiny config."""
    import os
    import sys
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "hf")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    from families import tiny_model
    config = {**_SATURATE.get(family, {}), **config}
    eager = tiny_model(family, "eager", dtype=dtype, **config)
    with torch.no_grad():
        for name, p in eager.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 0.5))
            if name.endswith("sinks"):
                p.copy_(torch.tensor(GPTOSS_SINKS, dtype=p.dtype))
    ours = tiny_model(family, "cp_softcap", dtype=dtype, **config)
    ours.load_state_dict(eager.state_dict())
    return eager, ours
