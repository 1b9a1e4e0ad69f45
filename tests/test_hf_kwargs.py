"""attn_implementation="cp_softcap" ignores nothing silently: gpt-oss's learned attention sinks
(`s_aux`) reach the library (logits and every gradient, the sinks' included, match "eager" on
one process; the sinks dropped fail the same comparison), and a keyword the attention function
does not implement is refused with a ValueError naming it (None values and the keys HF passes
through every layer are accepted)."""
import logging

import pytest
import torch

from hf_models import gemma2_pair, gptoss_pair

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[gemma2]')")
hf_int = pytest.importorskip("cp_softcap.integrations.hf")

pytestmark = pytest.mark.timeout(120)

# float32 on both sides (gpt-oss's eager MoE refuses float64): the two compute the same
# attention with different summation orders, measured ~3e-7 (logits) and ~2e-6 (gradients) of
# the largest value; 1e-5 / 1e-4 leave a margin of ~30x while the sinks dropped differ by ~1e-1.
LOGITS_TOL, GRAD_TOL = 1e-5, 1e-4


@pytest.fixture(autouse=True)
def _no_group():
    hf_int.use_cp_group(None)
    logging.getLogger("transformers").setLevel(logging.ERROR)   # tiny configs' RoPE warning
    yield
    hf_int.use_cp_group(None)


def _err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_gptoss_sinks_match_eager():
    torch.manual_seed(0)
    eager, ours = gptoss_pair()
    ids = torch.randint(0, 97, (2, 20))                     # 20 > sliding window 6
    ref, out = eager(input_ids=ids).logits, ours(input_ids=ids).logits
    assert torch.isfinite(out).all()
    assert _err(out, ref) <= LOGITS_TOL
    g = torch.randn_like(ref)
    (ref * g).sum().backward()
    (out * g).sum().backward()
    ep = dict(eager.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.isfinite(p.grad).all(), name
        assert _err(p.grad, ep[name].grad) <= GRAD_TOL, name
    assert all(ep[n].grad.abs().max() > 1e-3 for n in ep if n.endswith("sinks"))


def test_gptoss_without_sinks_fails(monkeypatch):
    """Negative control: the same model with s_aux dropped on the way is far off."""
    torch.manual_seed(0)
    eager, ours = gptoss_pair()
    ids = torch.randint(0, 97, (2, 20))
    ref = eager(input_ids=ids).logits

    def drop(module, q, k, v, mask=None, s_aux=None, **kw):
        return hf_int.cp_softcap_attention(module, q, k, v, mask, **kw)
    transformers.AttentionInterface.register("cp_softcap_nosink", drop)
    ours.set_attn_implementation("cp_softcap_nosink")
    assert _err(ours(input_ids=ids).logits, ref) > 1e3 * LOGITS_TOL


def _call(**kwargs):
    q = torch.randn(1, 4, 8, 8)
    k = v = torch.randn(1, 2, 8, 8)
    module = torch.nn.Module()
    return hf_int.cp_softcap_attention(module, q, k, v, None, scaling=0.3, **kwargs)


@pytest.mark.parametrize("name,value", [("head_mask", torch.ones(4)), ("alibi_slopes", torch.ones(4)),
                                        ("sinks", torch.zeros(4)), ("attn_bias", 1.0),
                                        ("softmax_scale", 0.5)])
def test_unknown_keyword_refused(name, value):
    with pytest.raises(ValueError, match=f"keyword argument '{name}'"):
        _call(**{name: value})


def test_known_and_none_keywords_accepted():
    out, weights = _call(num_items_in_batch=torch.tensor(8), shift_labels=torch.zeros(1, 8),
                         output_attentions=False, use_cache=False, head_mask=None,
                         max_length_q=8, max_length_k=8)
    assert weights is None and out.shape == (1, 8, 4, 8)


def test_s_aux_is_the_sinks():
    s_aux = torch.tensor([9.0, 0.0, -3.0, 11.0])
    torch.manual_seed(1)
    q, k = torch.randn(1, 4, 8, 8), torch.randn(1, 2, 8, 8)
    ours, _ = hf_int.cp_softcap_attention(torch.nn.Module(), q, k, k, None, scaling=0.3, s_aux=s_aux)
    import cp_softcap as cps
    ref = cps.attention(q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2), scale=0.3,
                        sinks=s_aux)
    assert torch.equal(ours, ref)
    with pytest.raises(ValueError, match="query heads"):
        _call(s_aux=torch.zeros(3))


def test_gemma2_still_accepted():
    """The keywords a Gemma2 training call passes (labels, shift_labels, num_items_in_batch)."""
    eager, ours = gemma2_pair()
    ids = torch.randint(0, 97, (1, 17))
    lab = ids[:, 1:].contiguous()
    out = ours(input_ids=ids[:, :-1], labels=lab, shift_labels=lab, num_items_in_batch=torch.tensor(16))
    assert torch.isfinite(out.loss)
