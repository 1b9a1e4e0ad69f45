"""Model FLOPs of one training step, the numerator of MFU (metrics.py divides by the GPU's peak).

Per token of a step over sequences of `seq_len` tokens:

    flops_per_token = 6 * N + 12 * Hq * D * sum over layers of (visible pairs of the layer) / seq_len

6 * N: every parameter does one multiply-add (2 FLOPs) per token in forward and two in backward.
N counts every parameter once; the embedding is tied to the LM head, so the LM head's
[hidden x vocab] matmul is counted once, and the embedding lookup (no matmul) not at all. Norm
weights are in N too (a rounding: 4 norms of `hidden` per layer).

Attention: each (query, key) pair a layer attends costs 2 * D FLOPs for its score and 2 * D for
its share of the output per query head in forward, twice that in backward: 12 * Hq * D per pair.
Pairs are counted as the model defines them, not as a kernel happens to compute them: causal
(query i sees keys 0..i, so (S + 1) / 2 per token on average), a sliding-window layer only its
`sliding_window` newest keys, and packed documents (--pack) only keys of their own document
(the padding after the last document attends nothing). Work a kernel or activation
checkpointing repeats (the scores recomputed in backward, a layer recomputed under --ac) is
not counted: this is model FLOPs, not hardware FLOPs.

tests/test_gemma2_flops.py checks this against torch.utils.flop_counter on one training step.
"""
from __future__ import annotations

from typing import Optional, Sequence


def visible_pairs(length: int, window: Optional[int] = None) -> int:
    """(query, key) pairs of a causal attention over `length` tokens where each query sees at most
    `window` keys (itself included; None = all earlier keys)."""
    if window is None or window >= length:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


def layer_windows(cfg) -> list:
    """Keys each query of each layer may see: cfg.sliding_window on sliding layers, else None."""
    return [cfg.sliding_window if cfg.layer_type(i) == "sliding_attention" else None
            for i in range(cfg.num_hidden_layers)]


def attention_pairs(cfg, seq_len: int, cu_seqlens: Optional[Sequence[int]] = None) -> int:
    """Visible pairs of one sequence summed over the layers; with cu_seqlens (the row's document
    boundaries [0, e1, ..., T]) each document attends only itself."""
    bounds = list(cu_seqlens) if cu_seqlens is not None else [0, seq_len]
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    return sum(visible_pairs(n, w) for w in layer_windows(cfg) for n in lengths)


def flops_per_token(cfg, n_params: int, seq_len: int,
                    cu_seqlens: Optional[Sequence[int]] = None) -> float:
    """Training FLOPs per token (the module docstring's formula)."""
    attention = 12 * cfg.num_attention_heads * cfg.head_dim * attention_pairs(cfg, seq_len, cu_seqlens)
    return 6 * n_params + attention / seq_len
