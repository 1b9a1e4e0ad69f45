"""examples/gemma2's shared autocast cast (model.autocast_inputs): q/k/v and gate/up take one
bf16 cast of their float32 input instead of autocast's one cast per matmul. Same forward values
bitwise, the same gradients (a float32 sum of the same bf16 gradients), one saved copy."""
import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from gemma2 import model as gm  # noqa: E402
from gemma2.config import get_config  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _plain(x, n):
    return (x,) * n


def _three_linears(share: bool):
    torch.manual_seed(0)
    lins = [nn.Linear(64, 32, bias=False) for _ in range(3)]
    leaf = torch.randn(4, 16, 64, requires_grad=True)
    x = leaf * 1.0          # an activation: autocast caches casts of leaves only
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ins = gm.autocast_inputs(x, 3) if share else _plain(x, 3)
        outs = [lin(i) for lin, i in zip(lins, ins)]
    sum((o.float() * (k + 1)).sum() for k, o in enumerate(outs)).backward()
    copies = {t.untyped_storage().data_ptr() for t in saved if t.dtype == torch.bfloat16 and t.numel() == x.numel()}
    return outs, leaf.grad, [lin.weight.grad for lin in lins], len(copies)


def test_one_cast_same_values_and_gradients():
    outs, gx, gw, copies = _three_linears(share=True)
    ref_outs, ref_gx, ref_gw, ref_copies = _three_linears(share=False)
    assert (ref_copies, copies) == (3, 1)
    for o, r in zip(outs, ref_outs):
        assert o.dtype == torch.bfloat16 and torch.equal(o, r)
    for g, r in zip(gw, ref_gw):
        assert torch.equal(g, r)
    assert gx.dtype == torch.float32 and torch.isfinite(gx).all()
    # the same float32 sum of the same three bf16 gradients, possibly in another order
    torch.testing.assert_close(gx, ref_gx, rtol=1e-6, atol=1e-6)


def test_not_under_autocast_or_not_float32_it_is_the_input_itself():
    x = torch.randn(2, 3)
    assert all(t is x for t in gm.autocast_inputs(x, 3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        xb = x.bfloat16()
        assert all(t is xb for t in gm.autocast_inputs(xb, 2))


def _model_step(share: bool, monkeypatch):
    if not share:
        monkeypatch.setattr(gm, "autocast_inputs", _plain)
    cfg = get_config("tiny", sliding_window=16, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                     num_hidden_layers=2)
    torch.manual_seed(1)
    model = gm.Gemma2(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    ids = torch.randint(0, cfg.vocab_size, (1, 40))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids)
    logits.float().square().mean().backward()
    monkeypatch.undo()
    return logits, {n: p.grad for n, p in model.named_parameters()}


def test_gemma2_logits_bitwise_and_gradients_equal(monkeypatch):
    logits, grads = _model_step(True, monkeypatch)
    ref_logits, ref_grads = _model_step(False, monkeypatch)
    assert torch.isfinite(logits).all() and torch.equal(logits, ref_logits)
    for name, g in grads.items():
        # bf16 matmuls downstream of a float32 sum that may differ in its last bit
        torch.testing.assert_close(g, ref_grads[name], rtol=2e-2, atol=1e-5, msg=name)
