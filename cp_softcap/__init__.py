"""cp_softcap: context-parallel attention with tanh logit softcapping.

Tensors are [B, S, H, D]: batch, sequence, heads, head dim (SDPA's [B, H, S, D] transposed).

    import cp_softcap as cps
    out = cps.attention(q, k, v, softcap=50.0)                            # one device, causal
    attn = cps.CPAttention(cp_group, softcap=50.0, window=(4095, 0))      # context parallel
"""
from . import sharding
from .api import CPAttention, attention, cp_attention
from .groups import make_hybrid_groups
from .selector import Selection, select
from .spec import AttnSpec, make_spec

__all__ = ["make_hybrid_groups", "sharding", "attention", "cp_attention", "CPAttention", "select", "Selection", "AttnSpec", "make_spec"]
__version__ = "0.1.0"
