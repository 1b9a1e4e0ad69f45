"""Packed documents under context parallelism, checked on CPU.

    python examples/packed_cp.py            # spawns 4 CPU ranks itself (gloo)
    torchrun --nproc-per-node 4 examples/packed_cp.py

One stream packs documents of very different lengths (1 token, shorter than a chunk, longer than
a rank's share) plus a padding tail. Every rank shards q, k, v with the same global
`cu_seqlens`, runs `cps.cp_attention(..., cu_seqlens=cu)` with each comm type (softcap 2: most
scores saturate it), and compares its output and gradients with attention computed ONE DOCUMENT
AT A TIME on one device (`cps.attention` per document, float64). It also checks that ignoring the
boundaries would be caught, and prints `-> OK` (exit code 0) or `-> MISMATCH` (exit code 1).

The block between `# [README:packed begin]` and `# [README:packed end]` is copied verbatim in
docs/packing.md (tests/test_readme.py checks that they agree).
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import cp_softcap as cps
from _launch import parse_args, run_ranks   # examples/_launch.py: torchrun or spawned ranks

# [README:packed begin]
DOCS = [1, 37, 150, 9, 60, 3]      # document lengths; 260 tokens of documents, then padding
S = 270                            # the stream: documents, then 10 tokens of the user's padding
cu = [0]
for n in DOCS:
    cu.append(cu[-1] + n)          # GLOBAL boundaries [0, 1, 38, 188, 197, 257, 260], every rank


def packed_step(q, k, v, dout, group, comm):
    """q/k/v/dout [B, S, H, D]: the whole stream, the same on every rank. Returns this rank's
    output shard and the gradients of its q/k/v shards."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    # shard() pads the stream at its end to packed_len(S, cp) and gives this rank its tokens of
    # the packed layout (balanced by attention area); ids, labels and positions shard the same way
    local = [cps.sharding.shard(t, cp, rank, cu_seqlens=cu).requires_grad_() for t in (q, k, v)]
    out = cps.cp_attention(*local, group, softcap=2.0, causal=True, comm=comm, cu_seqlens=cu)
    out.backward(cps.sharding.shard(dout, cp, rank, cu_seqlens=cu))
    return out, [t.grad for t in local]
# [README:packed end]


HEADS = 4                          # query heads (= kv heads) of the test tensors


def one_document_at_a_time(q, k, v, dout):
    """float64 output and gradients of every document attended on its own (padding: 0)."""
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    pieces = [cps.attention(*(t[:, a:b] for t in leaves), softcap=2.0, causal=True)
              for a, b in zip(cu, cu[1:])]
    out = torch.cat(pieces + [torch.zeros_like(leaves[0][:, cu[-1]:])], dim=1)
    out.backward(dout.double())
    return out.detach(), [t.grad for t in leaves]


def run_rank() -> int:
    group, cp, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, S, HEADS, 16) * 4 for _ in range(4))
    ref_out, ref_grads = one_document_at_a_time(q, k, v, dout)
    worst = 0.0
    shard = lambda t: cps.sharding.shard(t, cp, rank, cu_seqlens=cu)     # noqa: E731
    rel = lambda a, b: ((a.double() - b).abs().max() / b.abs().max()).item()   # noqa: E731
    for comm in ("ring", "all_gather", "a2a", "auto"):
        out, grads = packed_step(q, k, v, dout, group, comm)
        errs = [rel(out, shard(ref_out))] + [rel(g, shard(r)) for g, r in zip(grads, ref_grads)]
        worst = max(worst, max(errs))
    # the same float32 inputs as ONE document: ignoring the boundaries must be far off
    whole = cps.attention(*(t.double() for t in (q, k, v)), softcap=2.0, causal=True)
    miss = rel(out, shard(whole))
    stats = torch.tensor([worst, -miss])
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    worst, miss = stats[0].item(), -stats[1].item()
    ok = worst < 1e-4 and miss > 1e-2
    if rank == 0:
        print(f"cp={cp}: packed documents vs one document at a time: max relative error {worst:.2e} "
              f"(ring, all_gather, a2a, auto); boundaries ignored would be off by {miss:.2f} "
              f"-> {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


def check_ranks(world: int) -> None:
    """The a2a case splits the HEADS query heads over the ranks, so their number must divide it."""
    if HEADS % world:
        ok = [n for n in range(1, HEADS + 1) if HEADS % n == 0]
        raise ValueError(f"{world} ranks: this example also runs comm='a2a', which splits its {HEADS} "
                         f"query heads over the ranks; use {', '.join(map(str, ok))} ranks")


def main(argv=None) -> int:
    a = parse_args(__doc__, argv, nproc=4, check=check_ranks)
    return run_ranks(run_rank, a.nproc)


if __name__ == "__main__":
    sys.exit(main())
