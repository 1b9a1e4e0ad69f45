"""GradAccumulator: partial sums over position ranges, widening 16-bit partials."""
import torch

from cp_softcap.cp.grad_accum import GradAccumulator


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
