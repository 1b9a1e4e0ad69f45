"""attn_implementation="cp_softcap" inside torch.compile, one device: a tiny HF Gemma2 compiled
whole with fullgraph=True (no layer breaks its graph: position_ids are read inside the
library's operator) gives the logits and parameter gradients of the same model run eagerly, in
float64, on an ordinary batch, on packed rows whose documents come from position_ids resets
(one row, and two rows joined into one stream) and from the cu_seq_lens_q/k kwargs; new resets
of the same shape do not recompile; an all-ones attention_mask compiles and a padding mask is
refused from inside the compiled graph. The CP case (positions checked inside the operator):
tests_dist/test_hf_packed_cp.py."""
import pytest
import torch

from hf_models import gemma2_pair
from test_hf_packed import LENGTHS, documents, models, per_document

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[gemma2]')")
hf_int = pytest.importorskip("cp_softcap.integrations.hf")

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def _fresh():
    hf_int.use_cp_group(None)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _run(model, g, **inputs):
    out = model(**inputs).logits
    (out * g).sum().backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return out.detach(), grads


def _same(a, b, tol):
    (out_a, grads_a), (out_b, grads_b) = a, b
    assert torch.isfinite(out_a).all()
    torch.testing.assert_close(out_a, out_b, rtol=tol, atol=tol)
    for name, ref in grads_b.items():
        scale = max(1.0, ref.abs().max().item())
        torch.testing.assert_close(grads_a[name], ref, rtol=tol, atol=tol * scale, msg=name)


def _packed_inputs(rows: int):
    """Each row: the LENGTHS documents back to back, positions restarting at each."""
    docs = documents()
    ids = torch.cat(docs)[None].repeat(rows, 1)
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None].repeat(rows, 1)
    return docs, ids, pos


# aot_eager leaves the model's own ops as they are: compiled equals eager to rounding of
# float64 (1e-12); inductor fuses them, Gemma2's RMSNorm among them, which computes in float32
# (1e-5). The attention itself is the same eager call inside the operator.
@pytest.mark.parametrize("backend,tol", [("aot_eager", 1e-12),
                                         pytest.param("inductor", 1e-5, marks=pytest.mark.slow)])
def test_compiled_model_matches_eager(backend, tol):
    _, ours = models()
    compiled = torch.compile(ours, fullgraph=True, backend=backend)
    torch.manual_seed(2)
    ids = torch.randint(0, 97, (2, 40))                      # 40 > the sliding window 8
    g = torch.randn(2, 40, 97, dtype=torch.float64)
    _same(_run(compiled, g, input_ids=ids), _run(ours, g, input_ids=ids), tol)
    # packed rows: documents from the resets of position_ids, one row and two rows joined
    for rows in (1, 2):
        docs, ids, pos = _packed_inputs(rows)
        g = torch.randn(*ids.shape, 97, dtype=torch.float64)
        got = _run(compiled, g, input_ids=ids, position_ids=pos)
        _same(got, _run(ours, g, input_ids=ids, position_ids=pos), tol)
        if rows == 1:   # and they are the documents: each one alone gives the same logits
            ref, _ = per_document(ours, docs, g)
            ours.zero_grad()
            torch.testing.assert_close(got[0], ref, rtol=max(tol, 1e-10), atol=max(tol, 1e-10))
            unpacked = ours(input_ids=ids).logits.detach()
            assert (unpacked - ref).abs().max() > 1e-2    # resets ignored: a different result


def test_flattening_collator_kwargs_compiled():
    """cu_seq_lens_q/k (DataCollatorWithFlattening's keys) over two rows joined into one stream."""
    _, ours = models()
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    _, ids, pos = _packed_inputs(2)
    ends = torch.tensor(LENGTHS).cumsum(0)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), ends, ends + ends[-1]]).to(torch.int32)
    kw = dict(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
              max_length_q=max(LENGTHS), max_length_k=max(LENGTHS))
    g = torch.randn(*ids.shape, 97, dtype=torch.float64)
    _same(_run(compiled, g, **kw), _run(ours, g, **kw), 1e-12)


def test_new_resets_do_not_recompile():
    _, ours = models()
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    _, ids, pos = _packed_inputs(1)
    compiled(input_ids=ids, position_ids=pos)
    other = torch.cat([torch.arange(n) for n in (30, 23, 6, 1)])[None]
    g = torch.randn(*ids.shape, 97, dtype=torch.float64)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = _run(compiled, g, input_ids=ids, position_ids=other)
        plain = compiled(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]).logits
    _same(got, _run(ours, g, input_ids=ids, position_ids=other), 1e-12)
    torch.testing.assert_close(plain, ours(input_ids=ids).logits, rtol=1e-12, atol=1e-12)


def test_attention_mask_compiled():
    _, ours = models()
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    ids = torch.randint(0, 97, (2, 20))
    ones = torch.ones_like(ids)
    torch.testing.assert_close(compiled(input_ids=ids, attention_mask=ones).logits,
                               ours(input_ids=ids).logits, rtol=1e-12, atol=1e-12)
    padded = ones.clone()
    padded[1, -3:] = 0
    with pytest.raises(ValueError, match=r"2-D attention_mask \(2, 20\) with padding"):
        compiled(input_ids=ids, attention_mask=padded)


def test_gpt_oss_sinks_compiled_with_packed_rows():
    """gpt-oss's attention sinks (s_aux) and a window through the operator, two packed rows
    joined into one stream inside it: compiled equals eager (float32: gpt-oss's eager MoE
    refuses float64)."""
    from hf_models import gptoss_pair
    torch.manual_seed(0)
    _, ours = gptoss_pair()
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    _, ids, pos = _packed_inputs(2)
    g = torch.randn(*ids.shape, 97)
    got, want = _run(compiled, g, input_ids=ids, position_ids=pos), _run(ours, g, input_ids=ids, position_ids=pos)
    _same(got, want, 1e-5)
    assert any(n.endswith("sinks") and w.abs().max() > 0 for n, w in want[1].items())


def test_different_key_boundaries_refused_compiled():
    _, ours = models()
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    _, ids, pos = _packed_inputs(1)
    ends = torch.tensor(LENGTHS).cumsum(0)
    cu_q = torch.cat([torch.zeros(1, dtype=torch.int64), ends]).to(torch.int32)
    cu_k = cu_q.clone()
    cu_k[1] += 1
    kw = dict(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu_q, max_length_q=max(LENGTHS),
              max_length_k=max(LENGTHS))
    for model in (ours, compiled):
        with pytest.raises(ValueError, match="cu_seq_lens_q != cu_seq_lens_k"):
            model(cu_seq_lens_k=cu_k, **kw)


def test_joined_rows_lse_through_the_operator():
    """The operator joins rows whose positions restart into one stream and hands back out and
    LSE in the rows' shapes: both equal the library's packed call on the joined stream."""
    import cp_softcap as cps
    from cp_softcap.compiled import compiled_attention
    torch.manual_seed(3)
    b, s, hq, hkv, d = 2, 24, 4, 2, 8
    q = torch.randn(b, s, hq, d, dtype=torch.float64)
    k, v = (torch.randn(b, s, hkv, d, dtype=torch.float64) for _ in range(2))
    pos = torch.cat([torch.arange(10), torch.arange(14)])[None]

    def call(q, k, v, pos):
        return compiled_attention(q, k, v, group_names_="", comm="ring", backend="auto", softcap=5.0,
                                  causal=True, window=(6, 0), scale=None, cu_seqlens=None,
                                  one_device=True, positions=pos)
    out, lse = torch.compile(call, fullgraph=True, backend="aot_eager")(q, k, v, pos)
    joined = [t.reshape(1, b * s, *t.shape[2:]) for t in (q, k, v)]
    ref_out, ref_lse = cps.attention(*joined, softcap=5.0, window=(6, 0), return_lse=True,
                                     cu_seqlens=[0, 10, 24, 34, 48])
    torch.testing.assert_close(out, ref_out.reshape(b, s, hq, d), rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse.reshape(hq, b, s).transpose(0, 1), rtol=0, atol=0)


def test_group_of_one_rank_is_one_device(gloo_group_of_one):
    """A CP group of one rank (DP-only runs) is one device: generation over a KV cache (queries
    shorter than keys) works as without a group, and the compiled model equals eager."""
    eager, ours = gemma2_pair()
    eager.eval(), ours.eval()
    hf_int.use_cp_group(gloo_group_of_one)
    ids = torch.randint(0, 97, (1, 12))
    kw = dict(max_new_tokens=4, do_sample=False)
    try:
        assert torch.equal(eager.generate(ids, **kw), ours.generate(ids, **kw))
        compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(input_ids=ids).logits, ours(input_ids=ids).logits,
                                   rtol=1e-6, atol=1e-6)
    finally:
        hf_int.use_cp_group(None)
