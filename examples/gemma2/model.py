"""A compact Gemma2 whose attention is cp_softcap.CPAttention (context parallel, softcap 50,
sliding window 4096 on even layers). Module names follow HF's, so HF safetensors load as-is.

Under context parallelism every rank holds a zigzag shard of the sequence: input ids and position
ids [B, S/cp] (cp_softcap.sharding.shard / positions); everything outside attention is per token,
so only CPAttention talks to the other ranks.
"""
from __future__ import annotations

import glob
import json
import os
import zlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from cp_softcap import CPAttention

from . import fused
from .config import Gemma2Config
from .loss import softcap_cross_entropy_sum


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * (1 + w), computed in float32 and cast back; w starts at 0.
    liger: the same in one Triton kernel (fused.py, --fused)."""
    liger = False

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.liger:
            return fused.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """position_ids [B, S] (global positions) -> cos, sin [B, S, head_dim] in `dtype`."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float,
                                             device=position_ids.device) / head_dim))
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D]; cos/sin [B, S, D]."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class _CastOnce(torch.autograd.Function):
    """x -> n aliases of one cast of x to `dtype`; backward sums their n gradients in x's dtype.

    Under autocast every matmul casts its float32 activation input again and keeps its own copy
    for backward; q/k/v (and gate/up) share one input, so that is three (two) casts, three (two)
    saved bf16 copies and, in backward, three (two) gradient casts and float32 adds. Here it is one
    cast, one saved copy, one gradient cast and in-place float32 adds of the bf16 gradients:
    the same values in forward and the same float32 sum of the same bf16 gradients in backward."""

    @staticmethod
    def forward(ctx, x, dtype, n):
        ctx.dtype = x.dtype
        y = x.to(dtype)
        return tuple(y.view_as(y) for _ in range(n))

    @staticmethod
    def backward(ctx, *grads):
        total = None
        for g in grads:
            if g is not None:
                total = g.to(ctx.dtype) if total is None else total.add_(g)
        return total, None, None


def autocast_inputs(x: torch.Tensor, n: int) -> tuple:
    """n inputs for n matmuls of the same activation x: one shared cast under autocast."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
        if x.dtype == torch.float32 and dtype != x.dtype:
            return _CastOnce.apply(x, dtype, n)
    return (x,) * n


class Attention(nn.Module):
    liger = False       # RoPE by Liger's kernel (fused.py)

    def __init__(self, cfg: Gemma2Config, layer: int, cp_group, comm: str, backend: str):
        super().__init__()
        self.h, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.hkv * self.d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.hkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=False)
        sliding = cfg.layer_type(layer) == "sliding_attention"
        self.attn = CPAttention(cp_group, softcap=cfg.attn_logit_softcapping,
                                window=(cfg.sliding_window - 1, 0) if sliding else None,
                                scale=cfg.scale, comm=comm, backend=backend)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, S, hidden] -> q [B, S, Hq, D], k, v [B, S, Hkv, D], RoPE applied to q and k."""
        b, s, _ = x.shape
        xq, xk, xv = autocast_inputs(x, 3)
        q = self.q_proj(xq).view(b, s, self.h, self.d)
        k = self.k_proj(xk).view(b, s, self.hkv, self.d)
        v = self.v_proj(xv).view(b, s, self.hkv, self.d)
        if self.liger:
            q, k = fused.rope(q, k, cos, sin)
            return q.to(v.dtype), k.to(v.dtype), v
        return apply_rope(q, cos, sin).to(v.dtype), apply_rope(k, cos, sin).to(v.dtype), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        return self.o_proj(self.attn(*self.project(x, cos, sin)).reshape(b, s, self.h * self.d))


class MLP(nn.Module):
    liger = False       # gelu_tanh(gate) * up by Liger's kernel (fused.py)

    def __init__(self, cfg: Gemma2Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xg, xu = autocast_inputs(x, 2)
        if self.liger:
            return self.down_proj(fused.geglu(self.gate_proj(xg), self.up_proj(xu)))
        return self.down_proj(F.gelu(self.gate_proj(xg), approximate="tanh") * self.up_proj(xu))


class DecoderLayer(nn.Module):
    """Sandwich norms: x + post_attn(attn(input(x))), then x + post_ffn(mlp(pre_ffn(x))).

    `ac` picks what backward recomputes instead of keeping (torch.utils.checkpoint,
    use_reentrant=False): "none"; "full", the whole layer (its CP attention, collectives included,
    runs again); "mlp", the feed-forward half only (attention's activations are kept, so backward
    never reruns attention or its collectives). --compile compiles the whole layer (attention is
    one opaque operator in its graph), or with --compile pieces the three pieces around
    attention (pre_attention, post_attention, feed_forward).
    """

    def __init__(self, cfg: Gemma2Config, layer: int, cp_group, comm: str, backend: str):
        super().__init__()
        self.self_attn = Attention(cfg, layer, cp_group, comm, backend)
        self.mlp = MLP(cfg)
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.ac = "none"

    def pre_attention(self, x, cos, sin):
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

    def post_attention(self, x, out):
        b, s, _ = x.shape
        return x + self.post_attention_layernorm(self.self_attn.o_proj(out.reshape(b, s, -1)))

    def feed_forward(self, x):
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def _layer(self, x, cos, sin, cu_seqlens=None):
        x = self.post_attention(x, self.self_attn.attn(*self.pre_attention(x, cos, sin),
                                                       cu_seqlens=cu_seqlens))
        if self.ac == "mlp":
            return checkpoint(self.feed_forward, x, use_reentrant=False)
        return self.feed_forward(x)

    def forward(self, x, cos, sin, cu_seqlens=None):
        if self.ac == "full":
            return checkpoint(self._layer, x, cos, sin, cu_seqlens, use_reentrant=False)
        return self._layer(x, cos, sin, cu_seqlens)


class Gemma2Body(nn.Module):
    def __init__(self, cfg: Gemma2Config, cp_group, comm: str, backend: str):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, cp_group, comm, backend)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Gemma2(nn.Module):
    """Gemma2 causal LM on CPAttention.

    Args: cfg; cp_group: the context-parallel process group (None or size 1 = one device), for
    comm "a2a+p2p" the (a2a, ring) pair from parallel.attention_group; comm: CP algorithm ("ring",
    "all_gather", "a2a", "a2a+p2p", "auto"); backend: kernel ("auto" = selector).
    forward(input_ids [B, S_local], position_ids [B or 1, S_local] global positions, default
    arange) -> logits [B, S_local, vocab], final-softcapped (cap * tanh(logits / cap)).
    cu_seqlens (packed documents): the GLOBAL document boundaries of the stream, the same on every
    CP rank; ids/positions/labels are then sharded with the same cu_seqlens and positions are
    document-relative (cp_softcap.sharding.positions(..., cu_seqlens=)).
    """

    def __init__(self, cfg: Gemma2Config, cp_group=None, *, comm: str = "ring", backend: str = "auto"):
        super().__init__()
        self.cfg = cfg
        self.model = Gemma2Body(cfg, cp_group, comm, backend)
        self.loss_chunk: Optional[int] = None     # tokens per loss slice (None: 256 MiB of logits)
        self.liger_loss = False                   # the loss by Liger's fused kernel (fused.py)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Gemma2's init: normal(0, initializer_range) for matrices, norms at 0. Each tensor is drawn
        whole from a generator seeded by (seed, its name), so the result is the same on every
        rank and with or without FSDP sharding (only one full tensor exists at a time)."""
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                full = torch.empty(p.shape).normal_(0.0, self.cfg.initializer_range, generator=g)
            else:
                full = torch.zeros(p.shape)
            assign(p, full)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, cu_seqlens=None) -> torch.Tensor:
        """Without labels: the logits. With labels [B, S_local] (-100 = not predicted): the float32
        cross-entropy SUM over this rank's tokens, computed `loss_chunk` tokens at a time
        (loss.py), so the [tokens, vocab] logits never exist."""
        cfg, emb = self.cfg, self.model.embed_tokens
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        x = emb(input_ids) * torch.tensor(cfg.hidden_size ** 0.5, dtype=emb.weight.dtype)
        cos, sin = rope_cos_sin(position_ids, cfg.head_dim, cfg.rope_theta, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, cu_seqlens)
        h, cap = self.model.norm(x), cfg.final_logit_softcapping
        if labels is not None and self.liger_loss:
            return fused.softcap_cross_entropy_sum(h, emb.weight, labels, cap, self.loss_chunk)
        if labels is not None:
            return softcap_cross_entropy_sum(h, emb.weight, labels, cap, self.loss_chunk)
        logits = F.linear(h, emb.weight)     # tied lm_head
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int, cu_seqlens=None) -> float:
        """Training (model) FLOPs per token, for MFU: 6N + the attention pairs each layer sees
        (causal, sliding windows, documents), 12 * heads * head_dim each; flops.py explains."""
        from .flops import flops_per_token
        return flops_per_token(self.cfg, self.num_params(), seq_len, cu_seqlens)


def assign(p: torch.Tensor, full: torch.Tensor) -> None:
    """p.copy_(full) for a plain or an FSDP2-sharded (DTensor) parameter; full is the whole tensor."""
    if hasattr(p, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor
        full = distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None)
    p.copy_(full)


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed float32 cross-entropy over labels != -100. logits [B, S, V], labels [B, S]."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100,
                           reduction="sum")


def weight_files(model_dir: str) -> list:
    """The checkpoint's *.safetensors files (those its index names, when it has one), all present."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                names = json.load(f)["weight_map"].values()
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index} is not a safetensors index (a JSON object with a "
                             f"'weight_map'): {type(e).__name__}: {e}") from None
        files = sorted({os.path.join(model_dir, v) for v in names})
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"{index} names {len(missing)} file(s) that are not there: "
                                    f"{', '.join(map(os.path.basename, missing[:3]))}")
    else:
        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in --model-dir {model_dir!r}; a HF Gemma2 checkpoint "
                                "directory holds config.json, the weights and the tokenizer")
    return files


def load_hf_weights(model: Gemma2, model_dir: str) -> None:
    """Copy an HF Gemma2 checkpoint (model_dir/*.safetensors) into `model`, in place.

    Names match HF's ("model.layers.0.self_attn.q_proj.weight", ...); "lm_head.weight" is tied to
    the embedding and skipped. Raises naming the missing/unexpected tensors or mismatched shapes.
    """
    from safetensors import safe_open

    files = weight_files(model_dir)
    params = dict(model.named_parameters())
    seen = set()
    with torch.no_grad():
        for path in files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    if name == "lm_head.weight":
                        continue
                    if name not in params:
                        raise KeyError(f"{path} holds {name!r}, which this Gemma2 has no parameter for; "
                                       "is this a Gemma2 (not Gemma/Gemma3) checkpoint?")
                    t = f.get_tensor(name)
                    if t.shape != params[name].shape:
                        raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} != model shape "
                                         f"{tuple(params[name].shape)}; the config does not match "
                                         f"the weights in {model_dir!r}")
                    assign(params[name], t)
                    seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise KeyError(f"{len(missing)} parameters missing from {model_dir!r}: {missing[:5]}...")
