"""attn_implementation="cp_softcap" (cp_softcap.integrations.hf) on one process: HF Gemma2 gives
eager's logits and gradients (softcap, sliding window, GQA, scaling 1/sqrt(query_pre_attn_scalar)),
and masks/dropout/positions it cannot honour are refused with errors that say what to do."""
import pytest
import torch

from hf_models import gemma2_pair

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[gemma2]')")
hf_int = pytest.importorskip("cp_softcap.integrations.hf")

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _no_group():
    hf_int.use_cp_group(None)
    yield
    hf_int.use_cp_group(None)


def test_registered_name():
    assert transformers.AttentionInterface._global_mapping["cp_softcap"] is hf_int.cp_softcap_attention
    from transformers.masking_utils import AttentionMaskInterface
    assert AttentionMaskInterface._global_mapping["cp_softcap"] is hf_int._mask_function


def test_logits_and_grads_match_eager():
    eager, ours = gemma2_pair()
    ids = torch.randint(0, 97, (2, 40))                       # 40 > sliding window 16
    ref, out = eager(input_ids=ids).logits, ours(input_ids=ids).logits
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(ref)
    (ref * g).sum().backward()
    (out * g).sum().backward()
    ep = dict(eager.named_parameters())
    for name, p in ours.named_parameters():
        r = ep[name].grad
        torch.testing.assert_close(p.grad, r, rtol=1e-4, atol=1e-5 * max(1.0, r.abs().max().item()), msg=name)


def test_hf_loss_with_shift_labels_and_all_ones_mask():
    eager, ours = gemma2_pair()
    ids = torch.randint(0, 97, (2, 33))
    a = eager(input_ids=ids, labels=ids).loss
    lab = ids[:, 1:].contiguous()
    b = ours(input_ids=ids[:, :-1], labels=lab, shift_labels=lab, attention_mask=torch.ones_like(ids[:, :-1])).loss
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_mask_is_not_built():
    """No [S, S] mask is built: the attention function sees None."""
    _, ours = gemma2_pair()
    seen = []
    orig = hf_int._check_mask
    hf_int._check_mask = lambda m: seen.append(m) or orig(m)
    try:
        ours(input_ids=torch.randint(0, 97, (1, 20)))
    finally:
        hf_int._check_mask = orig
    assert seen and all(m is None for m in seen)


def test_refuses_padding_mask():
    _, ours = gemma2_pair()
    ids = torch.randint(0, 97, (2, 20))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    with pytest.raises(ValueError, match="padding"):
        ours(input_ids=ids, attention_mask=mask)


def test_refuses_dense_4d_mask():
    _, ours = gemma2_pair()
    ids = torch.randint(0, 97, (1, 20))
    mask = torch.zeros(1, 1, 20, 20)
    with pytest.raises(ValueError, match="dense attention mask"):
        ours(input_ids=ids, attention_mask=mask)


def test_refuses_dropout():
    _, ours = gemma2_pair(attention_dropout=0.1)
    ours.train()
    with pytest.raises(ValueError, match="dropout"):
        ours(input_ids=torch.randint(0, 97, (1, 20)))


def test_packed_positions_are_documents():
    """Position resets are document boundaries on one device (tests/test_hf_packed.py checks the
    packed results): the same tokens with and without a reset differ."""
    _, ours = gemma2_pair()
    ids = torch.randint(0, 97, (1, 20))
    with torch.no_grad():
        packed = ours(input_ids=ids, position_ids=torch.cat([torch.arange(10), torch.arange(10)])[None]).logits
        second = ours(input_ids=ids[:, 10:]).logits
    torch.testing.assert_close(packed[:, 10:], second, rtol=1e-5, atol=1e-5)


def test_generate_with_cache_matches_eager():
    eager, ours = gemma2_pair()
    eager.eval(), ours.eval()
    ids = torch.randint(0, 97, (1, 12))
    kw = dict(max_new_tokens=6, do_sample=False)
    assert torch.equal(eager.generate(ids, **kw), ours.generate(ids, **kw))
