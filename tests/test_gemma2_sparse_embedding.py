"""examples/gemma2's sparse token-lookup gradient (Gemma2.sparse_embedding_grad): the tied
embedding's gradient is the same dense float32 tensor as with a dense lookup gradient (the rows
added into the LM head's share), with repeated tokens and the padding id in the batch, through
our loss and through the logits; an optimizer step after it matches too."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from gemma2 import model as gm  # noqa: E402
from gemma2.config import get_config  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _grads(sparse: bool, with_labels: bool, steps: int = 1):
    cfg = get_config("tiny", sliding_window=16, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                     num_hidden_layers=2)
    torch.manual_seed(3)
    model = gm.Gemma2(cfg).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    model.sparse_embedding_grad = sparse
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    gen = torch.Generator().manual_seed(4)
    for _ in range(steps):
        ids = torch.randint(0, 12, (2, 41), generator=gen)     # few ids: many repeated rows
        ids[0, :5] = cfg.pad_token_id
        opt.zero_grad(set_to_none=True)
        if with_labels:
            loss = model(ids[:, :-1], labels=ids[:, 1:])
        else:
            loss = model(ids[:, :-1]).square().mean()
        loss.backward()
        grad = model.model.embed_tokens.weight.grad.clone()      # before the clip scales it
        assert grad.layout == torch.strided and torch.isfinite(grad).all()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return grad, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("with_labels", [True, False])
def test_sparse_lookup_gradient_equals_the_dense_one(with_labels):
    grad, params = _grads(True, with_labels, steps=2)
    ref_grad, ref_params = _grads(False, with_labels, steps=2)
    # the same float64 sums, possibly added in another order
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-14)
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p, r, rtol=1e-12, atol=1e-14)
    # the lookup's share is there: without it the gradient would differ
    cfg = get_config("tiny")
    assert grad[: cfg.vocab_size].abs().sum() > 0


def test_dropping_the_lookup_rows_would_be_caught(monkeypatch):
    """The lookup's share is material: with the lookup detached from the weight (its rows never
    added) the tied gradient differs from the one above exactly on the looked-up ids."""
    grad, _ = _grads(True, True)
    real = gm.F.embedding
    monkeypatch.setattr(gm.F, "embedding", lambda ids, w, *a, **k: real(ids, w.detach(), *a, **k))
    head_only, _ = _grads(True, True)
    monkeypatch.undo()
    differs = (grad - head_only).abs().amax(-1) > 1e-9
    ids = torch.randint(0, 12, (2, 41), generator=torch.Generator().manual_seed(4))[:, :-1]
    ids[0, :5] = get_config("tiny").pad_token_id
    looked_up = torch.zeros_like(differs)
    looked_up[ids.unique()] = True
    looked_up[get_config("tiny").pad_token_id] = False      # padding rows get no gradient
    assert torch.equal(differs, looked_up)
