"""benchmarks/cp_sim.py --per-call on CPU (torch kernel, tiny shapes): every call of the rank is
timed, with each fully visible call also as a windowed one and, when it has enough keys, with
its backward in key pieces; the pieces' gradients add up to the whole call's."""
import torch

from benchmarks import cp_sim
from cp_softcap.kernels import get_kernel


def test_per_call_rows(monkeypatch):
    monkeypatch.setattr(cp_sim, "PIECE_KEYS", 64)
    kernel = get_kernel("torch")
    sim = cp_sim.RankSim(kernel, 512, 2, 4, 2, 32, torch.float32, "cpu", 50.0, (None, 0), 0, 0)
    rows = cp_sim.per_call(sim, kernel, 512, 4, 32, 50.0, (None, 0), 1)
    where = [r["where"] for r in rows]
    assert where == ["self", "block 0", "full", "block 0 as local", "block 0 in pieces"]
    assert all(r["fwd_ms"] > 0 and r["bwd_ms"] > 0 for r in rows)


def test_key_pieces_sum_to_the_whole_backward():
    """What the 'in pieces' row times is the same work: with the rows' final O/LSE, the key
    pieces' dK/dV are slices of the whole call's and their dQ add up to its dQ."""
    torch.manual_seed(0)
    kernel = get_kernel("torch")
    q, k, v = (torch.randn(1, 32, 2, 8, dtype=torch.float64) * 3 for _ in range(3))
    kw = dict(scale=8 ** -0.5, softcap=2.0, window=(None, None))
    out, lse = kernel.forward(q, k, v, **kw)
    dout = torch.randn_like(out)
    whole = kernel.backward(dout, q, k, v, out, lse, **kw)
    parts = [kernel.backward(dout, q, k[:, a:a + 8], v[:, a:a + 8], out, lse, **kw)
             for a in range(0, 32, 8)]
    torch.testing.assert_close(sum(p[0] for p in parts), whole[0])
    torch.testing.assert_close(torch.cat([p[1] for p in parts], 1), whole[1])
    torch.testing.assert_close(torch.cat([p[2] for p in parts], 1), whole[2])
