"""The bad-input matrix under context parallelism (gloo, CPU, world 2): each row runs on every
rank with the same (bad) call and must raise the expected error on EVERY rank, naming the value,
the rank and the fix, or give the correct result against the float64 reference of full attention.
All rows run in one process group, one after the other: a row that desynchronised the ranks
(one raising before a collective the other entered) would make the next row time out, which the
CP_SOFTCAP_TIMEOUT of 5 s turns into a failure instead of a hang."""
from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

import cp_softcap as cps
from cp_softcap.testing import reference_attention
from cp_softcap.sharding import shard
from harness import run_ranks


def _local(b=1, s=16, hq=4, hkv=2, d=8, dtype=torch.float32, rank=0, cp=2, seed=0):
    """This rank's zigzag shards of global [b, s, h, d] tensors (same seed on every rank)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, hq, d, generator=g).to(dtype) * 2
    k = torch.randn(b, s, hkv, d, generator=g).to(dtype) * 2
    v = torch.randn(b, s, hkv, d, generator=g).to(dtype)
    return (q, k, v), tuple(shard(t, cp, rank) for t in (q, k, v))


def _check_vs_reference(rank, cp, transform, grad=True, **kw):
    """cp_attention on transformed local shards vs the float64 reference of the global call."""
    (q, k, v), (ql, kl, vl) = _local(rank=rank, cp=cp, seed=7)
    ql, kl, vl = (transform(t).requires_grad_(grad) for t in (ql, kl, vl))
    out = cps.cp_attention(ql, kl, vl, dist.group.WORLD, **kw)
    qr, kr, vr = (t.double().requires_grad_(True) for t in (q, k, v))
    ref, _ = reference_attention(qr, kr, vr, softcap=kw.get("softcap"), causal=kw.get("causal", True),
                                 window=kw.get("window") or (None, None))
    torch.testing.assert_close(out.double(), shard(ref.detach(), cp, rank), rtol=1e-5, atol=1e-5)
    if not grad:
        assert not out.requires_grad
        return "ok"
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    out.backward(shard(dout, cp, rank).to(out.dtype))
    ref.backward(dout)
    for mine, theirs in ((ql, qr), (kl, kr), (vl, vr)):
        torch.testing.assert_close(mine.grad.double(), shard(theirs.grad, cp, rank), rtol=1e-4, atol=1e-4)
    return "ok"


def _transposed(t):
    """The same values in [B, H, S, D] storage, viewed as [B, S, H, D] (non-contiguous)."""
    out = t.transpose(1, 2).contiguous().transpose(1, 2)
    assert not out.is_contiguous()
    return out


def _export_under_cp(rank, cp):
    class Layer(torch.nn.Module):
        def forward(self, q, k, v):
            return cps.cp_attention(q, k, v, dist.group.WORLD, softcap=50.0)
    _, (ql, kl, vl) = _local(rank=rank, cp=cp)
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        torch.onnx.export(Layer(), (ql, kl, vl), f"{tmp}/cp.onnx", dynamo=True)


def _torch_export_under_cp(rank, cp):
    class Layer(torch.nn.Module):
        def forward(self, q, k, v):
            return cps.CPAttention(dist.group.WORLD, softcap=50.0)(q, k, v)
    _, (ql, kl, vl) = _local(rank=rank, cp=cp)
    torch.export.export(Layer(), (ql, kl, vl))


def _empty_batch(rank, cp):
    _, (ql, kl, vl) = _local(b=0, rank=rank, cp=cp)
    ql.requires_grad_(True)
    out = cps.cp_attention(ql, kl, vl, dist.group.WORLD, softcap=50.0)
    assert out.shape == ql.shape
    out.sum().backward()
    assert ql.grad.shape == ql.shape
    return "ok"


def _call(rank, cp, **over):
    """cp_attention on local shards with keyword overrides for the tensors and the options."""
    shape = {key: over.pop(key) for key in ("b", "s", "hq", "hkv", "d", "dtype") if key in over}
    _, (ql, kl, vl) = _local(rank=rank, cp=cp, **shape)
    if "local_s" in over:       # local shards of a length that sharding.shard itself would refuse
        n = over.pop("local_s")
        ql, kl, vl = ql[:, :1].expand(-1, n, -1, -1), kl[:, :1].expand(-1, n, -1, -1), vl[:, :1].expand(-1, n, -1, -1)
    ql, kl, vl = over.pop("q", ql), over.pop("k", kl), over.pop("v", vl)
    group = over.pop("group", dist.group.WORLD)
    return cps.cp_attention(ql, kl, vl, group, **over)


def _not_a_member(rank, cp):
    only0 = dist.new_group([0])                    # collective: every rank creates it
    if rank == 0:
        return "skip"
    return _call(rank, cp, group=only0)


# (id, call(rank, cp), expected exception type or "ok", regex; "{rank}" is this rank)
ROWS = [
    ("global-seq-not-multiple-of-2cp", lambda r, cp: _call(r, cp, local_s=5), ValueError,
     r"local sequence length 5 on CP rank {rank} .*2\*cp=4.*pad_to_multiple"),
    ("seq-len-0", lambda r, cp: _call(r, cp, local_s=0), ValueError, r"local sequence length 0 on CP rank {rank}"),
    ("q-kv-local-lengths-differ", lambda r, cp: _call(r, cp, q=torch.randn(1, 4, 4, 8)), ValueError,
     r"local q has 4 tokens but k/v have 8 on CP rank {rank}"),
    ("hq-not-multiple-of-hkv", lambda r, cp: _call(r, cp, hq=3), ValueError, r"num_heads=3.*CP rank {rank}"),
    ("mixed-dtypes", lambda r, cp: _call(r, cp, k=torch.randn(1, 8, 2, 8, dtype=torch.float64)), TypeError,
     r"share one dtype.*CP rank {rank}"),
    ("wrong-rank-tensor", lambda r, cp: _call(r, cp, q=torch.randn(8, 4, 8)), ValueError, r"4-D.*CP rank {rank}"),
    ("softcap-negative", lambda r, cp: _call(r, cp, softcap=-5.0), ValueError, r"softcap.*-5\.0"),
    ("softcap-nan", lambda r, cp: _call(r, cp, softcap=float("nan")), ValueError, r"softcap.*nan"),
    ("softcap-string", lambda r, cp: _call(r, cp, softcap="50"), TypeError, r"softcap.*'50'"),
    ("window-invalid", lambda r, cp: _call(r, cp, window=(-1.5, 0)), ValueError, r"window left side.*-1\.5"),
    ("scale-zero", lambda r, cp: _call(r, cp, scale=0.0), ValueError, r"scale.*0\.0"),
    ("scale-nan", lambda r, cp: _call(r, cp, scale=float("nan")), ValueError, r"scale.*nan"),
    ("comm-unknown", lambda r, cp: _call(r, cp, comm="nccl"), ValueError, r"comm must be one of.*'nccl'"),
    ("forced-sdpa-with-softcap", lambda r, cp: _call(r, cp, softcap=50.0, backend="sdpa"), ValueError,
     r"backend 'sdpa' cannot serve.*softcap=50\.0"),
    ("forced-fa3-under-cp", lambda r, cp: _call(r, cp, backend="fa3"), ValueError, r"fa3"),
    ("torch.export-under-cp", _torch_export_under_cp, ValueError,
     r"^ValueError: cp_softcap: context-parallel attention \(cp=2\) cannot be exported"),
    ("onnx-export-under-cp", _export_under_cp, ValueError, r"context-parallel attention \(cp=2\) cannot be exported"),
    ("rank-not-in-group", _not_a_member, ValueError, r"global rank 1 is not a member of the process group"),
    ("transposed-bhsd-storage", lambda r, cp: _check_vs_reference(r, cp, _transposed, softcap=5.0), "ok", ""),
    ("strided-view", lambda r, cp: _check_vs_reference(r, cp, lambda t: torch.stack([t, 0 * t], -1)[..., 0],
                                                         softcap=30.0, window=(5, 0)), "ok", ""),
    ("no-requires-grad", lambda r, cp: _check_vs_reference(r, cp, lambda t: t, grad=False, softcap=50.0), "ok", ""),
    ("batch-0", _empty_batch, "ok", ""),
]


def _matrix_worker(rank, world):
    outcomes = []
    for name, call, expected, pattern in ROWS:
        try:
            value = call(rank, world)
            outcomes.append((name, "ok" if value in ("ok", "skip") else f"returned {type(value).__name__}", ""))
        except Exception as e:  # noqa: BLE001
            chain, cause = [], e
            while cause is not None:        # exporters wrap the error: report the whole chain
                chain.append(f"{type(cause).__name__}: {cause}")
                cause = cause.__cause__ or cause.__context__
            outcomes.append((name, type(e).__name__, " <- ".join(chain)[:3000]))
    return outcomes


def _exc_names(expected):
    return {t.__name__ for t in (expected if isinstance(expected, tuple) else (expected,))}


@pytest.mark.timeout(150)
def test_bad_input_matrix_under_cp():
    results = run_ranks(_matrix_worker, 2, timeout=120, env={"CP_SOFTCAP_TIMEOUT": "5"})
    problems = []
    for rank, outcomes in enumerate(results):
        assert [o[0] for o in outcomes] == [r[0] for r in ROWS]
        for (name, call, expected, pattern), (_, got, msg) in zip(ROWS, outcomes):
            if expected == "ok":
                if got != "ok":
                    problems.append(f"rank {rank} {name}: expected a result, got {got}: {msg}")
                continue
            if name == "rank-not-in-group" and rank == 0:
                continue
            names = _exc_names(expected)
            if got not in names and not any(n + ":" in msg for n in names):
                problems.append(f"rank {rank} {name}: expected {names}, got {got}: {msg}")
            elif not re.search(pattern.replace("{rank}", str(rank)), msg, flags=re.S):
                problems.append(f"rank {rank} {name}: message does not match {pattern!r}: {msg}")
    assert not problems, "\n".join(problems)


def _group_none_worker(rank, world):
    """group=None while 2 ranks run: one-device attention on this rank's tensors (documented),
    with a warning naming dist.group.WORLD; the HF function with no CP group set says nothing."""
    import warnings
    from cp_softcap.integrations.hf import cp_softcap_attention, use_cp_group
    _, (q, k, v) = _local(rank=rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = cps.cp_attention(q, k, v, None, softcap=5.0)
        cps.CPAttention(None, softcap=5.0)(q, k, v)
    texts = [str(w.message) for w in caught]
    use_cp_group(None)
    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        cp_softcap_attention(torch.nn.Module(), *(t.transpose(1, 2) for t in (q, k, v)), softcap=5.0)
    same = torch.allclose(out, cps.attention(q, k, v, softcap=5.0))
    return texts, [str(w.message) for w in quiet if "cp_softcap" in str(w.message)], same


def test_group_none_with_several_ranks_warns():
    for texts, quiet, same in run_ranks(_group_none_worker, 2):
        assert same
        assert len(texts) == 2 and all("dist.group.WORLD" in t and "2 ranks" in t for t in texts), texts
        assert quiet == [], quiet
