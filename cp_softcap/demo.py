"""`python -m cp_softcap.demo`: softcapped attention on one device against the float64 reference."""
import torch

from . import attention, select
from .api import spec_for
from .reference import reference_attention


def main() -> None:
    torch.manual_seed(0)
    q = (torch.randn(1, 256, 8, 64) * 3).requires_grad_()
    k = (torch.randn(1, 256, 4, 64) * 3).requires_grad_()
    v = torch.randn(1, 256, 4, 64).requires_grad_()
    opts = dict(softcap=5.0, causal=True, window=(63, 0))
    print(select(spec_for(q, k, v, scale=None, **opts)).table())
    out = attention(q, k, v, **opts)
    ref, _ = reference_attention(q, k, v, **opts)
    print(f"max |out - float64 reference| = {(out.double() - ref).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
