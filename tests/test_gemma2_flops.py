"""The MFU formula (examples/gemma2/flops.py) against torch.utils.flop_counter on one training step
of a small Gemma2, and its attention pairs against the masks the kernel applies.

What is compared, and why in two parts: FlopCounterMode counts the matmuls that run. Outside
attention that is exactly the model's math, so the formula's 6 * N * tokens must agree (within
5 %; the difference is the norm weights, which do no matmul). Inside attention it counts what the
pure-PyTorch CPU kernel computes: whole score blocks (one dense 256 x 256 block per layer here),
with the scores recomputed in backward, 14 * Hq * D FLOPs per computed pair, which the test
checks exactly. The formula instead counts the pairs the model lets each query see (12 * Hq * D
each: no recomputation, no masked entries), so those pairs are checked against a brute-force
count of the causal, sliding-window and document masks.
"""
import os
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from cp_softcap.kernels.base import visible_mask  # noqa: E402
from gemma2 import flops  # noqa: E402
from gemma2.config import get_config  # noqa: E402
from gemma2.model import Gemma2, loss_sum  # noqa: E402

pytestmark = pytest.mark.timeout(120)

# vocab 1024 x hidden 64: the tied LM head is 21 % of N, so counting it twice (or not at all)
# would miss by far more than 5 %; attention at 256 tokens is 13 % of the step's model FLOPs
CFG = get_config("tiny", vocab_size=1024)
S = 256


def count(model, ids, chunked: bool):
    """(total, attention) FLOPs FlopCounterMode sees in one forward + backward."""
    with FlopCounterMode(display=False) as fc:
        if chunked:       # the training loss: logits a slice at a time, gradients in its forward
            model(ids[:, :-1], labels=ids[:, 1:]).backward()
        else:             # full logits: the LM head's matmul once forward, twice backward
            loss_sum(model(ids[:, :-1]), ids[:, 1:]).backward()
    attention = sum(sum(ops.values()) for name, ops in fc.get_flop_counts().items()
                    if name.endswith("self_attn.attn"))
    return fc.get_total_flops(), attention


def test_formula_agrees_with_flop_counter():
    model = Gemma2(CFG, backend="torch")
    model.reset_parameters(0)
    ids = torch.randint(3, CFG.vocab_size, (1, S + 1))
    total, attention = count(model, ids, chunked=False)
    n = model.num_params()
    hd = CFG.num_attention_heads * CFG.head_dim
    # outside attention: 6 N per token (the tied LM head once) within 5 %
    outside = total - attention
    assert abs(outside / (6 * n * S) - 1) < 0.05, (outside, 6 * n * S)
    lm_head = CFG.vocab_size * CFG.hidden_size
    assert abs(outside / (6 * (n + lm_head) * S) - 1) > 0.05     # counted twice: caught
    assert abs(outside / (6 * (n - lm_head) * S) - 1) > 0.05     # left out: caught
    # inside attention: the CPU kernel's dense block per layer, scores recomputed in backward
    assert attention == 14 * hd * S * S * CFG.num_hidden_layers
    # the formula's attention is 12 * Hq * D per visible pair, well below that dense count
    per_token = flops.flops_per_token(CFG, n, S)
    assert per_token * S == pytest.approx(6 * n * S + 12 * hd * flops.attention_pairs(CFG, S))
    assert 0.05 < (per_token - 6 * n) * S / total < 0.25
    # the training loss computes the LM head's logits once and its two gradients: exactly the
    # FLOPs of the full path, which the formula counts (no recomputed logits)
    chunked_total, _ = count(model, ids, chunked=True)
    assert chunked_total == total


def brute_pairs(n: int, window, cu):
    """True entries of the [n, n] mask: causal, at most `window` keys, same document."""
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    doc = torch.full((n,), -1)
    for d, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        doc[a:b] = d
    mask = (j <= i) & (doc[:, None] == doc[None]) & (doc[:, None] >= 0)
    if window is not None:
        mask &= i - j < window
    return int(mask.sum())


@pytest.mark.parametrize("n,window,cu", [(256, None, None), (256, 64, None), (300, 64, None),
                                         (40, 64, None), (256, 64, [0, 10, 100, 230]),
                                         (256, None, [0, 256])])
def test_attention_pairs_are_the_masks(n, window, cu):
    cfg = get_config("tiny", sliding_window=window or 64, num_hidden_layers=2)
    windows = [window, None]             # layer 0 sliding, layer 1 full
    want = sum(brute_pairs(n, w, cu or [0, n]) for w in windows)
    if window is None:
        want = 2 * brute_pairs(n, None, cu or [0, n])
        cfg = get_config("tiny", sliding_window=n, num_hidden_layers=2)
    assert flops.attention_pairs(cfg, n, cu) == want
    if cu is None:      # the kernel's own mask (window (w - 1, 0): w keys including the query)
        kernel = visible_mask(n, n, (None if window is None else window - 1, 0), "cpu")
        assert flops.visible_pairs(n, window) == int(kernel.sum())


def test_gemma2_2b_at_8k():
    """The numbers examples/gemma2/README.md quotes: 2b at 8K tokens."""
    cfg = get_config("2b")
    with torch.device("meta"):
        n = Gemma2(cfg).num_params()
    per_token = flops.flops_per_token(cfg, n, 8192)
    attention = per_token - 6 * n
    # 13 full layers see 4096.5 keys per token on average, 13 sliding layers 3072.25
    assert attention == pytest.approx(12 * 8 * 256 * 13 * (4096.5 + 3072.25), rel=1e-9)
    assert per_token == pytest.approx(17.976e9, rel=1e-4)
