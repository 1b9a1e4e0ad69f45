"""GradAccumulator: partial sums over position ranges, widening 16-bit partials."""
import torch

from cp_softcap.merge import GradAccumulator


def test_full_cover_first_then_partial_adds():
    parts = [torch.randn(2, 8, 3, dtype=torch.bfloat16), torch.randn(2, 3, 3, dtype=torch.bfloat16)]
    acc = GradAccumulator((2, 8, 3), torch.float32, "cpu")
    acc.add(0, 8, parts[0])
    acc.add(5, 8, parts[1])
    want = parts[0].float()
    want[:, 5:8] += parts[1].float()
    assert acc.result().dtype == torch.float32
    torch.testing.assert_close(acc.result(), want, rtol=0, atol=0)


def test_partial_first_zero_fills_the_rest():
    g = torch.randn(1, 4, 2)
    acc = GradAccumulator((1, 10, 2), torch.float32, "cpu")
    acc.add(3, 7, g)
    want = torch.zeros(1, 10, 2)
    want[:, 3:7] = g
    torch.testing.assert_close(acc.result(), want, rtol=0, atol=0)


def test_untouched_is_zero():
    acc = GradAccumulator((1, 5, 2), torch.float64, "cpu")
    assert torch.equal(acc.result(), torch.zeros(1, 5, 2, dtype=torch.float64))


def test_full_cover_partial_of_the_buffer_dtype_is_taken_without_copy():
    g = torch.randn(1, 6, 2)
    acc = GradAccumulator((1, 6, 2), torch.float32, "cpu")
    acc.add(0, 6, g)
    assert acc.result() is g


def test_a_view_is_copied_not_taken():
    base = torch.randn(1, 12, 2)
    view = base[:, :6]
    acc = GradAccumulator((1, 6, 2), torch.float32, "cpu")
    acc.add(0, 6, view)
    acc.add(0, 3, torch.ones(1, 3, 2))
    assert torch.equal(view, base[:, :6])               # the caller's tensor is left alone
    torch.testing.assert_close(acc.result()[:, 3:], view[:, 3:], rtol=0, atol=0)


def test_bf16_buffer_of_disjoint_partials_is_exact():
    parts = [torch.randn(1, 3, 4, dtype=torch.bfloat16), torch.randn(1, 4, 4, dtype=torch.bfloat16)]
    acc = GradAccumulator((1, 9, 4), torch.bfloat16, "cpu")
    acc.add(1, 4, parts[0])
    acc.add(5, 9, parts[1])
    want = torch.zeros(1, 9, 4, dtype=torch.bfloat16)
    want[:, 1:4], want[:, 5:9] = parts
    assert acc.result().dtype == torch.bfloat16 and torch.equal(acc.result(), want)
