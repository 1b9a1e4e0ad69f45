"""HF Gemma2 (attn_implementation="cp_softcap") on a packed (padding-free) stream under CP 2
(gloo, float64): the shards of the packed layout with the GLOBAL boundaries passed as
model(..., cu_seqlens=cu) give the logits and parameter gradients of each document run alone
through cp_softcap on one process; ring and a2a, and the ring with the model compiled whole
(fullgraph=True, the boundaries a tensor; an unpacked zigzag shard too, against eager); negative
controls: the boundaries left out,
and position_ids that are not the packed layout's (left out, or zigzag ones; compiled too)."""
import os
import sys

import pytest
import torch

from harness import run_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

DOCS = [1, 6, 23, 30]           # window 8: two documents longer than it
S = 60


def _worker(rank, world):
    import torch.distributed as dist
    from test_hf_packed import models
    import cp_softcap as cps
    from cp_softcap.integrations import hf as hf_int

    torch.manual_seed(0)
    _, ours = models()
    torch.manual_seed(1)
    ids = torch.randint(0, 97, (1, S))
    g = torch.randn(1, S, 97, dtype=torch.float64)
    cu = [0]
    for n in DOCS:
        cu.append(cu[-1] + n)
    # reference: each document alone, one process
    hf_int.use_cp_group(None)
    ref_logits = []
    for a, b in zip(cu, cu[1:]):
        out = ours(input_ids=ids[:, a:b]).logits
        (out * g[:, a:b]).sum().backward()
        ref_logits.append(out.detach())
    ref = torch.cat(ref_logits, 1)
    ref_grads = {n: p.grad.clone() for n, p in ours.named_parameters()}
    errs = {}
    for comm in ("ring", "a2a"):
        ours.zero_grad()
        hf_int.use_cp_group(dist.group.WORLD, comm=comm)
        local_ids = cps.sharding.shard(ids, world, rank, cu_seqlens=cu)
        pos = cps.sharding.positions(S, world, rank, cu_seqlens=cu)[None]
        out = ours(input_ids=local_ids, position_ids=pos, cu_seqlens=cu).logits
        (out * cps.sharding.shard(g, world, rank, cu_seqlens=cu)).sum().backward()
        for p in ours.parameters():
            dist.all_reduce(p.grad)
        full = cps.sharding.gather(out.detach().contiguous(), cu_seqlens=cu)[:, :S]
        errs[f"{comm} logits"] = ((full - ref).abs().max() / ref.abs().max()).item()
        errs[f"{comm} grads"] = max(((ours.get_parameter(n).grad - r).abs().max()
                                     / r.abs().max().clamp_min(1e-30)).item() for n, r in ref_grads.items())
        assert torch.isfinite(out).all()
    # compiled whole, fullgraph=True: the positions are checked inside the library's operator
    hf_int.use_cp_group(dist.group.WORLD, comm="ring")
    ours.zero_grad()
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    cu_t = torch.tensor(cu)
    out = compiled(input_ids=local_ids, position_ids=pos, cu_seqlens=cu_t).logits
    (out * cps.sharding.shard(g, world, rank, cu_seqlens=cu)).sum().backward()
    for p in ours.parameters():
        dist.all_reduce(p.grad)
    full = cps.sharding.gather(out.detach().contiguous(), cu_seqlens=cu)[:, :S]
    errs["compiled logits"] = ((full - ref).abs().max() / ref.abs().max()).item()
    errs["compiled grads"] = max(((ours.get_parameter(n).grad - r).abs().max()
                                  / r.abs().max().clamp_min(1e-30)).item() for n, r in ref_grads.items())
    with pytest.raises(ValueError, match=r"rank \d: position_ids .* are not cp_softcap.sharding.positions"):
        compiled(input_ids=local_ids, position_ids=torch.arange(pos.shape[1])[None], cu_seqlens=cu_t)
    # and an unpacked zigzag shard (no boundaries): compiled equals eager, its positions checked
    zig = cps.sharding.shard(torch.randint(0, 97, (1, 32 * world)), world, rank)
    zpos = cps.sharding.positions(32 * world, world, rank)[None]
    with torch.no_grad():
        errs["compiled zigzag"] = (compiled(input_ids=zig, position_ids=zpos).logits
                                   - ours(input_ids=zig, position_ids=zpos).logits).abs().max().item()
        with pytest.raises(ValueError, match=r"rank \d: position_ids .* are not cp_softcap.sharding.positions"):
            compiled(input_ids=zig, position_ids=torch.arange(32)[None])
    # negative control: the packed shards without the global boundaries (a2a: positions unchecked)
    hf_int.use_cp_group(dist.group.WORLD, comm="ring")
    with pytest.raises(ValueError, match="cu_seqlens=cu_global"):
        ours(input_ids=local_ids, position_ids=pos)
    # the boundaries without this rank's packed positions: HF's default arange, or zigzag
    # positions of a zigzag shard, would silently give RoPE and the masks the wrong positions
    for comm in ("ring", "a2a"):
        hf_int.use_cp_group(dist.group.WORLD, comm=comm)
        with pytest.raises(ValueError, match=r"positions\(64, cp=2, rank=\d, cu_seqlens=cu_global\)"):
            ours(input_ids=local_ids, cu_seqlens=cu)
        zig = cps.sharding.shard(torch.randint(0, 97, (1, 32 * world)), world, rank)
        with pytest.raises(ValueError, match="are not cp_softcap.sharding.positions"):
            ours(input_ids=zig, position_ids=cps.sharding.positions(32 * world, world, rank)[None],
                 cu_seqlens=[0, 20, 32 * world])
    hf_int.use_cp_group(None)
    return errs


@pytest.mark.timeout(180)
def test_hf_gemma2_packed_under_cp():
    pytest.importorskip("transformers", reason="needs transformers (pip install -e '.[gemma2]')")
    errs = run_ranks(_worker, 2, timeout=150)[0]
    print(errs)
    assert set(errs) == {f"{c} {w}" for c in ("ring", "a2a", "compiled") for w in ("logits", "grads")} | {
        "compiled zigzag"}
    assert errs.pop("compiled zigzag") <= 1e-12, errs
    # logits: float64 throughout; gradients: Gemma2's RMSNorm reduces in float32
    assert all(v <= 1e-10 for k, v in errs.items() if "logits" in k), errs
    assert all(v <= 1e-6 for k, v in errs.items() if "grads" in k), errs
