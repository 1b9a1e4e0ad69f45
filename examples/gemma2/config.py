"""Gemma2 model configurations: the published 2B/9B/27B shapes, a tiny one for laptops and tests,
and a reader for a local HF checkpoint's config.json."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from typing import List, Optional


@dataclass(frozen=True)
class Gemma2Config:
    vocab_size: int = 256000
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    query_pre_attn_scalar: float = 256      # attention scale = query_pre_attn_scalar ** -0.5
    sliding_window: int = 4096              # key j visible from query i iff i - 4096 < j <= i
    attn_logit_softcapping: Optional[float] = 50.0
    final_logit_softcapping: Optional[float] = 30.0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    initializer_range: float = 0.02
    pad_token_id: int = 0
    eos_token_id: int = 1
    bos_token_id: int = 2
    # "sliding_attention" or "full_attention" per layer; empty = Gemma2's even-sliding pattern
    layer_types: List[str] = field(default_factory=list)

    def layer_type(self, i: int) -> str:
        if self.layer_types:
            return self.layer_types[i]
        return "sliding_attention" if i % 2 == 0 else "full_attention"

    @property
    def scale(self) -> float:
        return float(self.query_pre_attn_scalar) ** -0.5

    def to_dict(self) -> dict:
        return asdict(self)


CONFIGS = {
    "tiny": Gemma2Config(vocab_size=259, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         query_pre_attn_scalar=16, sliding_window=64),
    "2b": Gemma2Config(),
    "9b": Gemma2Config(hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                       num_attention_heads=16, num_key_value_heads=8),
    "27b": Gemma2Config(hidden_size=4608, intermediate_size=36864, num_hidden_layers=46,
                        num_attention_heads=32, num_key_value_heads=16, head_dim=128,
                        query_pre_attn_scalar=144),
}


def get_config(name: str, **overrides) -> Gemma2Config:
    """A named config ("tiny", "2b", "9b", "27b") with field overrides (e.g. vocab_size=259)."""
    if name not in CONFIGS:
        raise ValueError(f"unknown config {name!r}; choose one of {sorted(CONFIGS)} "
                         "or pass --model-dir with a local HF checkpoint")
    return replace(CONFIGS[name], **overrides)


def from_hf_json(model_dir: str) -> Gemma2Config:
    """Read `model_dir/config.json` of an HF Gemma2 checkpoint (transformers 4.x or 5.x layout)."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in --model-dir {model_dir!r}; point it at a local "
                                "HF Gemma2 checkpoint directory (config.json + *.safetensors)")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except ValueError as e:     # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not valid JSON ({e}); restore the checkpoint's config.json") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} holds a JSON {type(raw).__name__}, not an object of config fields")
    if raw.get("model_type") not in (None, "gemma2"):
        raise ValueError(f"{path} has model_type={raw.get('model_type')!r}; this example builds Gemma2 "
                         "(model_type 'gemma2')")
    act = raw.get("hidden_activation") or raw.get("hidden_act")
    if act not in (None, "gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"{path}: hidden activation {act!r}; this Gemma2 implements gelu_pytorch_tanh")
    if raw.get("attention_bias"):
        raise ValueError(f"{path}: attention_bias=true; Gemma2 (and this model) has no attention biases")
    known = set(Gemma2Config.__dataclass_fields__)
    kw = {k: v for k, v in raw.items() if k in known and v is not None}
    rope = raw.get("rope_parameters") or {}
    if "rope_theta" not in kw and "rope_theta" in rope:
        kw["rope_theta"] = rope["rope_theta"]
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if isinstance(kw.get(key), list):
            kw[key] = kw[key][0]
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if key in raw and raw[key] is None:   # an explicit null in config.json turns the cap off
            kw[key] = None
    return Gemma2Config(**kw)
