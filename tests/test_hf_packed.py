"""attn_implementation="cp_softcap" on packed (padding-free) batches, one device: a tiny random
Gemma2 (softcap, sliding window shorter than the documents, GQA) in float64 on a packed stream
gives the logits and parameter gradients of running each document separately: through
cp_softcap itself (logits to 1e-10; gradients to 1e-6, since Gemma2's RMSNorm reduces its
weight gradients in float32) and through eager (whose softmax runs in float32: 1e-5);
boundaries from position_ids resets, from the cu_seq_lens_q/k kwargs transformers'
DataCollatorWithFlattening emits, or from cu_seqlens=; a negative control ignores them."""
import pytest
import torch

from hf_models import gemma2_pair

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[gemma2]')")
hf_int = pytest.importorskip("cp_softcap.integrations.hf")

pytestmark = pytest.mark.timeout(120)
LENGTHS = [1, 6, 23, 30]            # a 1-token document, one shorter and two longer than the window


def models():
    torch.manual_seed(0)
    eager, ours = gemma2_pair(sliding_window=8)
    return eager.double(), ours.double()


def documents():
    torch.manual_seed(1)
    return [torch.randint(0, 97, (n,)) for n in LENGTHS]


def per_document(eager, docs, g):
    """Logits of each document run alone, and the parameter gradients of sum(logits * g)."""
    logits, off = [], 0
    for d in docs:
        out = eager(input_ids=d[None]).logits
        (out * g[:, off:off + len(d)]).sum().backward()
        logits.append(out.detach())
        off += len(d)
    return torch.cat(logits, 1), {n: p.grad for n, p in eager.named_parameters()}


def check_packed(ours, eager, docs, **packed_kwargs):
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    g = torch.randn(1, ids.shape[1], 97, dtype=torch.float64)
    out = ours(input_ids=ids, position_ids=pos, **packed_kwargs).logits
    (out * g).sum().backward()
    grads = {n: p.grad.clone() for n, p in ours.named_parameters()}
    ours.zero_grad()
    assert torch.isfinite(out).all()
    for ref_model, tol, grad_tol in ((ours, 1e-10, 1e-6), (eager, 1e-5, 1e-5)):
        ref, ref_grads = per_document(ref_model, docs, g)
        ref_model.zero_grad()
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
        for name, gr in grads.items():
            assert torch.isfinite(gr).all(), name
            scale = max(1.0, ref_grads[name].abs().max().item())
            torch.testing.assert_close(gr, ref_grads[name], rtol=grad_tol, atol=grad_tol * scale, msg=name)
    return out.detach(), ref


@pytest.fixture(autouse=True)
def _no_group():
    hf_int.use_cp_group(None)
    yield
    hf_int.use_cp_group(None)


def test_position_id_resets_give_per_document_attention(monkeypatch):
    eager, ours = models()
    docs = documents()
    out, ref = check_packed(ours, eager, docs)
    # negative control: the same positions with the boundaries ignored
    monkeypatch.setattr(hf_int, "_boundaries", lambda *a: (None, False))
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        mixed = ours(input_ids=torch.cat(docs)[None], position_ids=pos).logits
    assert (mixed - ref).abs().max() > 1e-3


def spy(monkeypatch):
    """Record the cu_seqlens each packed attention call receives."""
    seen, real = [], hf_int.attention

    def attention(*a, cu_seqlens=None, **kw):
        if cu_seqlens is not None:          # unpacked calls (one document alone) pass none
            seen.append(torch.as_tensor(cu_seqlens).tolist())
        return real(*a, cu_seqlens=cu_seqlens, **kw)
    monkeypatch.setattr(hf_int, "attention", attention)
    return seen


def test_flattening_collator_kwargs(monkeypatch):
    """What DataCollatorWithFlattening(return_flash_attn_kwargs=True) hands the model."""
    eager, ours = models()
    seen = spy(monkeypatch)
    docs = documents()
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True,
                                                      return_position_ids=True)
    batch = collate([{"input_ids": d.tolist()} for d in docs])
    assert torch.equal(batch["cu_seq_lens_q"].long(), torch.tensor([0, 1, 7, 30, 60]))
    kw = {k: batch[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    check_packed(ours, eager, docs, **kw)
    assert seen and all(c == [0, 1, 7, 30, 60] for c in seen)


def test_cu_seqlens_kwarg_and_rows_joined(monkeypatch):
    """cu_seqlens= wins over position_ids and holds for every batch row (as under CP); two rows
    with resets are joined into one stream."""
    eager, ours = models()
    docs = documents()
    seen = spy(monkeypatch)
    check_packed(ours, eager, docs, cu_seqlens=[0, 1, 7, 30, 60], cu_seq_lens_q=torch.tensor([0, 60]))
    assert seen and all(c == [0, 1, 7, 30, 60] for c in seen)
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        one = ours(input_ids=ids, position_ids=pos).logits
        two = ours(input_ids=ids.expand(2, -1), position_ids=pos.expand(2, -1)).logits
        shared = ours(input_ids=ids.expand(2, -1), cu_seqlens=[0, 1, 7, 30, 60],
                      position_ids=pos.expand(2, -1)).logits
    torch.testing.assert_close(two, one.expand(2, -1, -1), rtol=1e-12, atol=1e-12)
    assert [0, 1, 7, 30, 60, 61, 67, 90, 120] in seen           # resets: the rows joined
    torch.testing.assert_close(shared, two, rtol=1e-12, atol=1e-12)
    assert seen[-1] == [0, 1, 7, 30, 60]                        # cu_seqlens=: every row's boundaries


def test_mismatched_collator_kwargs_are_refused():
    _, ours = models()
    ids = torch.randint(0, 97, (1, 20))
    with pytest.raises(ValueError, match="cu_seq_lens_q != cu_seq_lens_k"):
        ours(input_ids=ids, cu_seq_lens_q=torch.tensor([0, 10, 20]), cu_seq_lens_k=torch.tensor([0, 5, 20]))
