"""Tiny random configs of the HF model families that run under attn_implementation="cp_softcap",
one per family, for runs without a download (examples/hf/sft.py --family) and for the tests.

Each keeps what makes its family's attention different, at a toy size (2 layers, 4 query heads
and 2 KV heads of dim 8, hidden 32):

    family    windowed layers (HF sliding_window w)        other attention features
    gemma2    layer 0 of 2 (w = 16)                         tanh logit softcap, final softcap,
                                                            scaling 1/sqrt(query_pre_attn_scalar)
    gemma3    layer 0 of 2 (w = 10)                         QK-norm, per-layer-kind RoPE bases
    mistral   every layer (w = 12)
    qwen2     layer 1 of 2 (w = 8; use_sliding_window,      QKV bias
              max_window_layers=1)
    gpt_oss   layer 0 of 2 (w = 6)                          learned attention sinks, MoE (4 experts)
    llama     none                                          plain causal attention

A window w lets query i see keys i - w < j <= i. The windows are shorter than the examples'
30-70-token conversations and the tests' 48-token rows, so every windowed layer masks.
"""
from __future__ import annotations

import torch

FAMILIES = ("gemma2", "gemma3", "mistral", "qwen2", "gpt_oss", "llama")
VOCAB = 128                 # holds examples/gemma2/sft.py's toy tokenizer (102 ids)

_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_dropout=0.0,
               pad_token_id=0, bos_token_id=2, eos_token_id=5)

_FAMILY = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(query_pre_attn_scalar=8, sliding_window=16, attn_logit_softcapping=50.0,
                    final_logit_softcapping=30.0,
                    layer_types=["sliding_attention", "full_attention"])),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(query_pre_attn_scalar=8, sliding_window=10,
                    layer_types=["sliding_attention", "full_attention"])),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=12)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    # max_position_embeddings: gpt-oss's YaRN RoPE expects 32 x its original 4096 positions
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                     sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                     max_position_embeddings=131072)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
}


def tiny_config(family: str, **overrides):
    """The tiny config of `family` (one of FAMILIES); overrides replace its fields."""
    import transformers
    if family not in _FAMILY:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    config_cls, _, fields = _FAMILY[family]
    return getattr(transformers, config_cls)(**{**_COMMON, **fields, **overrides})


def tiny_model(family: str, attn_implementation: str = "cp_softcap", *, seed: int = 0,
               dtype: torch.dtype = torch.float32, **overrides):
    """A random model of tiny_config(family, **overrides), the same weights for the same seed
    on every rank. gpt-oss's experts use the "eager" experts implementation in float64 (its
    default grouped matmul takes float32 and lower only)."""
    import transformers

    import cp_softcap.integrations.hf  # noqa: F401  (registers attn_implementation="cp_softcap")
    config = tiny_config(family, **overrides)
    kw = {}
    if family == "gpt_oss" and dtype == torch.float64:
        kw["experts_implementation"] = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, _FAMILY[family][1])._from_config(
        config, attn_implementation=attn_implementation, **kw)
    return model.to(dtype)


def windowed_layers(config) -> list:
    """The indices of the layers whose attention is windowed (HF's sliding_window reaches the
    attention function there)."""
    if not getattr(config, "sliding_window", None):
        return []
    types = getattr(config, "layer_types", None)
    if types is None:            # Mistral: one window for every layer
        return list(range(config.num_hidden_layers))
    return [i for i, t in enumerate(types) if t == "sliding_attention"]
