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


def _kept_per_token(cfg, pieces, dtype, monkeypatch, t=40):
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


def _weight_casts(ac):
    """(bf16 weight copies alive when the loss starts, alive once the forward's autocast block
    has ended, linear weights, attention-half weights) for a tiny 2-layer model under `--ac ac`."""
    import gc
    import weakref
    from torch.utils._python_dispatch import TorchDispatchMode
    from gemma2.parallelize import apply_ac

    cfg = get_config("tiny", num_hidden_layers=2, hidden_size=48, intermediate_size=80,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    model = gm.Gemma2(cfg)
    apply_ac(model, ac)
    weights = {n: p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n}
    shapes = {tuple(p.shape) for p in weights.values()}
    refs = []

    class Casts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if (func is torch.ops.aten._to_copy.default and out.dtype == torch.bfloat16
                    and tuple(out.shape) in shapes):
                refs.append(weakref.ref(out))
            return out

    at_loss = []
    model.model.norm.register_forward_hook(
        lambda *_: at_loss.append(sum(r() is not None for r in refs)))
    ids = torch.randint(3, cfg.vocab_size, (1, 33))
    with torch.autocast("cpu", dtype=torch.bfloat16), Casts():
        loss = model(ids[:, :-1], labels=ids[:, 1:])
    gc.collect()
    after = sum(r() is not None for r in refs)
    loss.backward()
    attn = sum(1 for n in weights if ".self_attn." in n)
    return at_loss[0], after, len(weights), attn


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_autocast_keeps_every_weight_copy_through_the_loss_and_ac_drops_what_it_recomputes(ac):
    """What the plan's two weight-copy rows assume, measured: autocast's cache holds every
    weight's bf16 copy until its block ends (after the loss), whatever AC does; after it, only
    the copies the kept activations need survive (AC full: none; selective: the attention
    half's). The backward's recompute then casts one layer's again."""
    at_loss, after, n_weights, n_attn = _weight_casts(ac)
    assert at_loss == n_weights
    assert after == {"none": n_weights, "selective": n_attn, "full": 0}[ac]


def test_the_plan_counts_the_cache_while_the_loss_runs():
    cfg = get_config("2b")
    layer = memory.param_counts(cfg).layer
    n = cfg.num_hidden_layers
    h, i = cfg.hidden_size, cfg.intermediate_size
    attn = h * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    for ac, kept in (("none", layer * n), ("selective", attn * n + 3 * h * i), ("full", layer)):
        rows = dict(memory.estimate(memory.Job(cfg, 8192, 1, 1, 1, ac=ac, dtype="bfloat16",
                                               device_type="cuda")))
        assert rows["bf16 weight copies kept for backward (autocast) [step]"] == 2 * kept
        assert rows["bf16 weight copies in autocast's cache, until the loss ends [step]"] == 2 * (layer * n - kept)


def _plan_peak(capsys, *flags):
    import re
    from gemma2 import train
    with pytest.raises(SystemExit) as e:
        train.main(["--plan", "--config", "2b", "--seq-len", "32768", "--batch-size", "1",
                    "--ac", "selective", "--device-mem-gib", "139", *flags])
    assert e.value.code in (0, None)
    return float(re.search(r"peak = .* ([\d.]+) GiB", capsys.readouterr().out).group(1))


def test_plan_counts_the_fused_pieces_a_run_would_use_on_any_machine(capsys):
    """--plan needs only shapes: --fused liger plans Liger's pieces on a machine without a GPU
    (no error), --compile plans inductor's, --fused torch none of them."""
    liger = _plan_peak(capsys, "--fused", "liger")
    compiled = _plan_peak(capsys, "--compile", "--fused", "torch")
    torch_pieces = _plan_peak(capsys, "--fused", "torch")
    assert liger == compiled < torch_pieces
