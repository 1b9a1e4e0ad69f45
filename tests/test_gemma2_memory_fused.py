"""examples/gemma2/memory.py with fused pieces: what one decoder layer's halves keep for backward,
counted with saved_tensors_hooks, drops by exactly what memory._halves subtracts when RMSNorm
and GEGLU run fused. The fused pieces here are CPU stand-ins that compute the same values and
keep what Liger's kernels keep (RMSNorm: its input and one float32 per row; GEGLU: gate and up;
RoPE: cos and sin). And AC keeps autocast's bf16 weight copies only of what it does not
recompute."""
import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from gemma2 import fused, memory  # noqa: E402
from gemma2 import model as gm  # noqa: E402
from gemma2.config import get_config  # noqa: E402

pytestmark = pytest.mark.timeout(120)


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, w, rstd.squeeze(-1))
        return (xf * rstd * (1.0 + w.float())).to(x.dtype)


class _Geglu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return F.gelu(a, approximate="tanh") * b


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return gm.apply_rope(q, cos, sin).to(q.dtype), gm.apply_rope(k, cos, sin).to(k.dtype)


def _kept_per_token(cfg, pieces, dtype, monkeypatch, t=64):
    """Bytes per token each half keeps for backward (the layer's input excluded: AC keeps it)."""
    monkeypatch.setattr(fused, "rms_norm", lambda x, w, eps: _Norm.apply(x, w, eps))
    monkeypatch.setattr(fused, "geglu", lambda a, b: _Geglu.apply(a, b))
    monkeypatch.setattr(fused, "rope", lambda q, k, cos, sin: _Rope.apply(q, k, cos, sin))
    layer = gm.DecoderLayer(cfg, 0, None, "ring", "torch")
    owners = {"rms_norm": gm.RMSNorm, "geglu": gm.MLP, "rope": gm.Attention}
    for m in layer.modules():
        m.liger = any(isinstance(m, owners[p]) for p in pieces if p in owners)
    x = torch.randn(1, t, cfg.hidden_size, requires_grad=True)
    cos, sin = gm.rope_cos_sin(torch.arange(t)[None], cfg.head_dim, 10000.0, torch.float32)
    kept = {}
    for half in ("attn", "mlp"):
        seen = {}

        def pack(tensor):
            if t in tensor.shape:            # per-token tensors (not weights or their casts)
                seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            if half == "attn":
                layer.post_attention(x, layer.self_attn.attn(*layer.pre_attention(x, cos, sin)))
            else:
                layer.feed_forward(x)
        seen.pop(x.untyped_storage().data_ptr(), None)
        kept[half] = sum(seen.values()) / t
    return kept


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pieces", [("rms_norm",), ("geglu",), ("rope",), fused.PIECES])
def test_fused_pieces_keep_what_the_plan_subtracts(pieces, dtype, monkeypatch):
    # intermediate 5 x hidden: a GEGLU term is not mistaken for a norm term
    cfg = get_config("tiny", hidden_size=96, intermediate_size=480, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, num_hidden_layers=1)
    act = 2 if dtype == torch.bfloat16 else 4
    ours = _kept_per_token(cfg, (), dtype, monkeypatch)
    fused_kept = _kept_per_token(cfg, pieces, dtype, monkeypatch)
    plan_ours, plan_fused = memory._halves(cfg, act), memory._halves(cfg, act, pieces)
    assert ours["attn"] - fused_kept["attn"] == plan_ours[0] - plan_fused[0]
    assert ours["mlp"] - fused_kept["mlp"] == plan_ours[1] - plan_fused[1]
    if "rms_norm" in pieces:                 # the check has teeth: fused norms keep less
        assert fused_kept["attn"] < ours["attn"]


def test_ac_keeps_the_bf16_weight_copies_of_what_it_does_not_recompute():
    cfg = get_config("2b")
    rows = {ac: dict(memory.estimate(memory.Job(cfg, 8192, 1, 1, 1, ac=ac, dtype="bfloat16",
                                                device_type="cuda")))
            for ac in ("none", "selective", "full")}
    copies = {ac: r["bf16 weight copies kept for backward (autocast) [step]"] for ac, r in rows.items()}
    layer, _ = memory.param_counts(cfg)
    h, i = cfg.hidden_size, cfg.intermediate_size
    assert copies["none"] == 2 * layer * cfg.num_hidden_layers
    assert copies["full"] == 2 * layer
    # selective recomputes the feed-forward half: every layer's q/k/v/o copies, one layer's MLP
    attn = h * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    assert copies["selective"] == 2 * (attn * cfg.num_hidden_layers + 3 * h * i)
    assert copies["full"] < copies["selective"] < copies["none"]
