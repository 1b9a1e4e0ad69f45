"""How the all-to-all (comm="a2a", and the inner groups of "a2a+p2p") splits attention heads over
its ranks: rank j gets query heads [j*Hq/I, (j+1)*Hq/I); K/V heads are split the same way when
Hkv % I == 0, else replicated so each rank has the KV heads its query heads use. The plan,
the byte model and the algorithm read the split from here.
"""
from __future__ import annotations

from typing import List


def heads_divide(num_heads: int, ranks: int) -> bool:
    """The all-to-all gives each of `ranks` ranks the same number of query heads."""
    return num_heads % ranks == 0


def check_heads(hq: int, inner: int, rank: int, comm: str = "a2a") -> None:
    if not heads_divide(hq, inner):
        fix = ("a smaller a2a group (make_hybrid_groups(group, a2a_size) with a2a_size dividing "
               f"{hq})" if comm == "a2a+p2p" else "comm='a2a+p2p' with a smaller inner group")
        raise ValueError(f"comm={comm!r} needs the query head count divisible by the all-to-all group "
                         f"size: {hq} heads, group of {inner} (rank {rank}); use comm='ring' or "
                         f"comm='all_gather', or {fix}")


def query_head_index(hq: int, ranks: int) -> List[List[int]]:
    per = hq // ranks
    return [list(range(j * per, (j + 1) * per)) for j in range(ranks)]


def kv_head_index(hq: int, hkv: int, ranks: int) -> List[List[int]]:
    """KV heads each rank needs, so that local query head i uses local KV head i // (hq/ranks/len)."""
    per_q, group = hq // ranks, hq // hkv
    if hkv % ranks == 0:
        per = hkv // ranks
        return [list(range(j * per, (j + 1) * per)) for j in range(ranks)]
    if group % per_q == 0:             # every local query head shares one KV head
        return [[(j * per_q) // group] for j in range(ranks)]
    return [[(j * per_q + i) // group for i in range(per_q)] for j in range(ranks)]
