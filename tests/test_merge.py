"""LSE merge properties: merging the key chunks of a row in any grouping and order equals the
full computation; +inf LSE (flash-attn 2's empty-row marker) is empty; -inf never makes NaN; a
row empty everywhere ends at out = 0, lse = -inf."""
import random

import pytest
import torch

from cp_softcap.merge import clean_lse, merge, merge_into, new_accumulator
from cp_softcap.testing import reference_attention
from cp_softcap.testing import assert_finite, lse_err, rel_err, saturating_qkv

NEG_INF, POS_INF = float("-inf"), float("inf")


def _partials(q, k, v, cuts, *, softcap, causal, window, dtype):
    """Reference (out, lse) of each key chunk [cuts[i], cuts[i+1]) with global positions."""
    sq, sk = q.shape[1], k.shape[1]
    q_pos = torch.arange(sq) + (sk - sq)
    parts = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        o, l = reference_attention(q, k[:, a:b], v[:, a:b], softcap=softcap, causal=causal, window=window,
                                   q_pos=q_pos, k_pos=torch.arange(a, b))
        parts.append((o.to(dtype), l.float()))
    return parts


def _random_tree_merge(parts, rng):
    """Merge in a random order and a random grouping (merged groups are merged again)."""
    items = list(parts)
    rng.shuffle(items)
    while len(items) > 1:
        n = rng.randint(2, len(items))
        start = rng.randint(0, len(items) - n)
        group = items[start:start + n]
        items[start:start + n] = [merge(group)]
        rng.shuffle(items)
    return merge(items)   # also normalises a single partial to float32


@pytest.mark.parametrize("trial", range(6))
@pytest.mark.parametrize("mode", ["full", "causal", "window"])
def test_any_grouping_equals_full(mode, trial):
    rng = random.Random(trial * 7 + len(mode))
    softcap = rng.choice([None, 1.0, 5.0, 30.0, 50.0])
    causal = mode == "causal"
    window = (rng.randint(0, 12), rng.randint(0, 6)) if mode == "window" else None
    sq, sk = rng.choice([(24, 24), (16, 40), (40, 16)])
    q, k, v, _ = saturating_qkv(2, sq, sk, 4, 2, 16, torch.float64, softcap or 1.0, requires_grad=False)
    n_chunks = rng.randint(2, 6)
    cuts = sorted([0, sk] + [rng.randint(0, sk) for _ in range(n_chunks - 1)])   # may be empty chunks
    parts = _partials(q, k, v, cuts, softcap=softcap, causal=causal, window=window, dtype=torch.float32)
    out, lse = _random_tree_merge(parts, rng)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    q_pos = torch.arange(sq) + (sk - sq)
    ref_out, ref_lse = reference_attention(q, k, v, softcap=softcap, causal=causal, window=window, q_pos=q_pos)
    assert_finite(out, "merged out")
    # float32 partials: lse ~ cap carries ~|lse| * 6e-8 absolute error into the weights
    assert rel_err(out, ref_out) < 1e-5
    assert lse_err(lse, ref_lse) < 2e-6
    empty = ref_lse == NEG_INF
    assert torch.all(out.transpose(1, 2)[empty] == 0)


def test_bf16_partials_merge_in_float32():
    q, k, v, _ = saturating_qkv(1, 32, 64, 2, 2, 16, torch.float64, 30.0, requires_grad=False)
    parts = _partials(q, k, v, [0, 20, 41, 64], softcap=30.0, causal=True, window=None, dtype=torch.bfloat16)
    out, lse = merge(parts)
    assert out.dtype == torch.float32
    ref_out, _ = reference_attention(q, k, v, softcap=30.0, causal=True, q_pos=torch.arange(32) + 32)
    assert rel_err(out, ref_out) < 8e-3


def test_pos_inf_lse_is_empty():
    """A partial with lse = +inf (flash-attn 2 empty row) contributes nothing, whatever its out."""
    q, k, v, _ = saturating_qkv(1, 16, 32, 2, 1, 16, torch.float64, 5.0, requires_grad=False)
    parts = _partials(q, k, v, [0, 10, 32], softcap=5.0, causal=False, window=None, dtype=torch.float32)
    junk_out = torch.randn(1, 16, 2, 16) * 100
    junk_lse = torch.full((1, 2, 16), POS_INF)
    for order in ([parts[0], (junk_out, junk_lse), parts[1]], [(junk_out, junk_lse), *parts],
                  [*parts, (junk_out, junk_lse)]):
        out, lse = merge(order)
        ref_out, ref_lse = merge(parts)
        assert_finite(out)
        torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-6)
        torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-6)
    # +inf alone: empty row
    out, lse = merge([(junk_out, junk_lse)])
    assert torch.all(out == 0) and torch.all(lse == NEG_INF)
    assert torch.equal(clean_lse(torch.tensor([POS_INF, 1.0, NEG_INF])), torch.tensor([NEG_INF, 1.0, NEG_INF]))


def test_neg_inf_rows_never_nan():
    """Every combination of empty / non-empty partial per row: no NaN, right answer."""
    b, s, h, d = 1, 4, 1, 8
    o1, o2 = torch.randn(b, s, h, d), torch.randn(b, s, h, d)
    l1 = torch.tensor([[[NEG_INF, NEG_INF, 0.5, 1.0]]])
    l2 = torch.tensor([[[NEG_INF, 2.0, NEG_INF, -1.0]]])
    for parts in ([(o1, l1), (o2, l2)], [(o2, l2), (o1, l1)]):
        out, lse = merge(parts)
        assert_finite(out, "out")
        assert not torch.isnan(lse).any()
        assert torch.all(out[:, 0] == 0) and lse[0, 0, 0] == NEG_INF          # empty in both
        torch.testing.assert_close(out[:, 1], o2[:, 1]); assert lse[0, 0, 1] == 2.0
        torch.testing.assert_close(out[:, 2], o1[:, 2]); assert lse[0, 0, 2] == 0.5
        w1 = torch.sigmoid(torch.tensor(2.0))                                    # exp(1 - logaddexp(1, -1))
        torch.testing.assert_close(out[:, 3], w1 * o1[:, 3] + (1 - w1) * o2[:, 3])


def test_all_empty_row():
    parts = [(torch.randn(2, 5, 3, 4), torch.full((2, 3, 5), NEG_INF)) for _ in range(3)]
    out, lse = merge(parts)
    assert torch.all(out == 0) and torch.all(lse == NEG_INF)


def test_merge_into_views_and_accumulator():
    """merge_into works on row slices of a float32 accumulator (how ring code uses it)."""
    acc_out, acc_lse = new_accumulator((1, 10, 2, 8), 8, torch.float32, "cpu")
    assert acc_out.dtype == torch.float32 and torch.all(acc_lse == NEG_INF) and torch.all(acc_out == 0)
    o, l = torch.randn(1, 5, 2, 8), torch.randn(1, 2, 5)
    merge_into(acc_out[:, 5:], acc_lse[:, :, 5:], o, l)
    torch.testing.assert_close(acc_out[:, 5:], o)
    torch.testing.assert_close(acc_lse[:, :, 5:], l)
    assert torch.all(acc_out[:, :5] == 0) and torch.all(acc_lse[:, :, :5] == NEG_INF)
    acc64, lse64 = new_accumulator((1, 3, 1, 4), 4, torch.float64, "cpu")
    assert acc64.dtype == torch.float64 and lse64.dtype == torch.float64


def test_merge_needs_a_partial():
    with pytest.raises(ValueError, match="at least one"):
        merge([])
