"""Packed documents under CP (cu_seqlens=) for every comm type against the float64 reference of
block-diagonal document attention (gloo on CPU, float64): saturating caps, causal with and
without a window smaller than the documents, a two-sided window, GQA and MQA, documents of
length 1, shorter than a chunk, longer than a rank's share, crossing rank borders, an
all-padding tail and a rank holding only padding; a negative control (boundaries dropped must
fail); one document spanning the stream against the unpacked call; bad boundaries on one rank
raise on every rank. Each spawn runs every comm type and case (few process groups)."""
import os

import pytest
import torch

from harness import run_ranks


COMMS = ("ring", "all_gather", "a2a", "a2a+p2p", "auto")
TOL = 1e-9


def _cases(cp: int):
    """(cu_seqlens, user stream length S, options). Lengths add up to less than S: the user's
    own padding tail, then the library pads to packed_len(S, cp)."""
    from cp_softcap.documents import packed_layout
    if cp == 2:     # padded stream 128, 64 tokens per rank
        long = [1, 5, 70, 1, 7, 20, 4]                    # 70 > a rank's share
        s = 118
    else:           # padded stream 256
        long = [1, 5, 90, 1, 7, 20, 60, 40, 12]
        s = 246
    cu = [0]
    for n in long:
        cu.append(cu[-1] + n)
    few = [0, 3, 20, 31]                                   # most of the stream is padding
    gqa = dict(hq=4, hkv=2)
    return [
        (cu, s, dict(softcap=50.0, causal=True, **gqa)),
        (cu, s, dict(softcap=1.0, causal=True, window=(6, 0), **gqa)),
        (cu, s, dict(softcap=5.0, causal=False, window=(9, 4), hq=4, hkv=1)),
        (few, s, dict(softcap=30.0, causal=True, window=(4, 0), **gqa)),
        ([0, 2, 8], s, dict(softcap=2.0, causal=True, **gqa)),   # other ranks: only padding
        # a PackedLayout balanced for two layer kinds, passed in place of the boundaries
        (packed_layout(cu, s, cp, layer_windows=[None, (6, 0)]), s, dict(softcap=50.0, causal=True,
                                                                         window=(6, 0), **gqa)),
    ]


def _reference(q, k, v, dout, cu, opts):
    from cp_softcap.testing import reference_attention
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    window = opts.get("window") or (None, None)
    out, _ = reference_attention(*leaves, cu_seqlens=cu, softcap=opts["softcap"],
                                 causal=opts["causal"], window=window)
    out.backward(dout)
    return out.detach(), [t.grad for t in leaves]


def _group(comm, hybrid):
    import torch.distributed as dist
    return hybrid if comm == "a2a+p2p" else dist.group.WORLD


def _run(comm, group, q, k, v, dout, cp, rank, cu, opts):
    import cp_softcap as cps
    from cp_softcap.sharding import shard
    local = [shard(t, cp, rank, cu_seqlens=cu).requires_grad_() for t in (q, k, v)]
    out = cps.cp_attention(*local, group, comm=comm, cu_seqlens=cu, softcap=opts["softcap"],
                           causal=opts["causal"], window=opts.get("window"))
    out.backward(shard(dout, cp, rank, cu_seqlens=cu))
    return out.detach(), [t.grad for t in local]


def _check_case(i, comm, group, cp, rank, docs, s, opts):
    from cp_softcap.sharding import packed_len, shard
    from cp_softcap.testing import rel_err, saturating_qkv
    cu = list(getattr(docs, "cu_seqlens", docs))       # boundaries of a list or a PackedLayout
    torch.manual_seed(300 + i)
    n = packed_len(s, cp)
    q, k, v, frac = saturating_qkv(2, n, n, opts["hq"], opts["hkv"], 8, torch.float64,
                                   opts["softcap"], requires_grad=False)
    dout = torch.randn(q.shape, dtype=torch.float64)
    ref_out, ref_grads = _reference(q, k, v, dout, cu, opts)
    out, grads = _run(comm, group, q[:, :s], k[:, :s], v[:, :s], dout[:, :s], cp, rank, docs, opts)
    label = f"{comm} cp={cp} rank {rank} case {i}"
    pieces = [(out, ref_out)] + list(zip(grads, ref_grads))
    errs = []
    for got, want in pieces:
        if not torch.isfinite(got).all():
            raise AssertionError(f"NaN/inf in the result [{label}]")
        errs.append(rel_err(got, shard(want, cp, rank, cu_seqlens=docs)))
    if not max(errs) <= TOL:
        raise AssertionError(f"out/dq/dk/dv rel errors {errs} > {TOL} [{label}]")
    pad = shard(torch.arange(n), cp, rank, dim=0, cu_seqlens=docs) >= cu[-1]
    if any(t[:, pad].abs().max().item() != 0 for t in [out] + grads if pad.any()):
        raise AssertionError(f"padding tokens have a nonzero output or gradient [{label}]")
    # negative control: the same output against the reference WITHOUT the boundaries (checked
    # over all ranks by the caller: a rank may hold only tokens the boundaries do not change)
    dropped, _ = _reference(q, k, v, dout, [0, cu[-1]], opts)
    miss = rel_err(out, shard(dropped, cp, rank, cu_seqlens=docs))
    return max(errs), frac, bool(pad.all()), miss


def _one_document(comm, group, cp, rank):
    """One causal document spanning a stream of 32 * cp tokens: its layout is zigzag, so the
    packed shards are the unpacked shards; the results must agree (bitwise where the calls are
    the same). Returns whether every tensor is bitwise equal, and the largest difference."""
    import cp_softcap as cps
    from cp_softcap.sharding import shard
    n = 32 * cp
    torch.manual_seed(7)
    q, k, v, dout = (torch.randn(2, n, 4, 8, dtype=torch.float64) * 3 for _ in range(4))
    opts = dict(softcap=5.0, causal=True)
    packed = _run(comm, group, q, k, v, dout, cp, rank, [0, n], opts)
    local = [shard(t, cp, rank).requires_grad_() for t in (q, k, v)]
    out = cps.cp_attention(*local, group, comm=comm, **opts)
    out.backward(shard(dout, cp, rank))
    plain = [out.detach()] + [t.grad for t in local]
    pairs = list(zip([packed[0]] + packed[1], plain))
    return all(torch.equal(a, b) for a, b in pairs), max((a - b).abs().max().item() for a, b in pairs)


# At cp 4 the schemes whose geometry does not change with cp (one gather, one all-to-all) run
# two cases (GQA causal; MQA two-sided window, KV heads replicated by a2a); every case at cp 2.
LIGHT = {"all_gather": (0, 2), "a2a": (0, 2), "auto": (0, 2)}


def _worker(rank, world):
    import cp_softcap as cps
    hybrid = cps.make_hybrid_groups(None, 2) if world == 4 else None
    report = {}
    for comm in COMMS:
        if comm == "a2a+p2p" and hybrid is None:
            continue
        group = _group(comm, hybrid)
        for i, (cu, s, opts) in enumerate(_cases(world)):
            if world == 4 and i not in LIGHT.get(comm, (i,)):
                continue
            report[(comm, i)] = _check_case(i, comm, group, world, rank, cu, s, opts)
        report[(comm, "one document")] = _one_document(comm, group, world, rank)
    return report


@pytest.mark.parametrize("world", [2, 4])
def test_packed_matches_float64_reference(world):
    reports = run_ranks(_worker, world, timeout=400)
    worst = max(v[0] for r in reports for key, v in r.items() if key[1] != "one document")
    saturated = min(v[1] for r in reports for key, v in r.items() if key[1] != "one document")
    padding_only = any(v[2] for r in reports for key, v in r.items() if key[1] != "one document")
    print(f"cp={world}: worst rel error {worst:.3g}, saturated fraction >= {saturated:.2f}, "
          f"a rank holding only padding: {padding_only}")
    assert saturated > 0.1
    for key in reports[0]:
        if key[1] != "one document":
            miss = max(r[key][3] for r in reports)
            assert miss > 1e3 * TOL, f"boundaries-dropped control too weak for {key}: {miss:.3g}"
    for comm in COMMS:
        ones = [r[(comm, "one document")] for r in reports if (comm, "one document") in r]
        if ones:
            print(f"  {comm}: one document vs unpacked: bitwise {all(b for b, _ in ones)}, "
                  f"max diff {max(d for _, d in ones):.3g}")
            assert max(d for _, d in ones) <= 1e-12
            if comm in ("ring", "a2a", "auto"):     # the same kernel calls as the unpacked path
                assert all(b for b, _ in ones), f"{comm}: one document is not bitwise the unpacked call"


BAD = [
    ("starts past 0", [3, 10, 40]),
    ("decreasing", [0, 30, 20, 40]),
    ("past the stream", [0, 30, 10_000]),
    ("float values", torch.tensor([0.0, 30.0, 40.0])),
    ("valid but different", [0, 31, 40]),
    ("missing on one rank", None),
]


def _bad_worker(rank, world):
    import torch.distributed as dist
    import cp_softcap as cps
    from cp_softcap.sharding import shard
    good = [0, 30, 40]
    x = shard(torch.randn(1, 64, 2, 8, dtype=torch.float64), world, rank, cu_seqlens=good)
    messages = {}
    for name, bad in BAD:
        try:
            cps.cp_attention(x, x, x, dist.group.WORLD, cu_seqlens=bad if rank == 1 else good)
        except (ValueError, TypeError) as e:
            messages[name] = str(e)
            continue
        raise AssertionError(f"rank {rank}: boundaries {name} on rank 1 did not raise")
    try:                                    # every rank passes the same bad boundaries
        cps.cp_attention(x, x, x, dist.group.WORLD, cu_seqlens=[0, 30, 20, 40])
    except ValueError as e:
        messages["all decreasing"] = str(e)
    wrong_len = x[:, :-4]
    try:                                    # shards not laid out by shard(..., cu_seqlens=)
        cps.cp_attention(wrong_len, wrong_len, wrong_len, dist.group.WORLD, cu_seqlens=good)
    except ValueError as e:
        messages["local length"] = str(e)
    out = cps.cp_attention(x, x, x, dist.group.WORLD, cu_seqlens=good)   # the ranks still agree
    return messages, bool(torch.isfinite(out).all())


def test_bad_boundaries_raise_on_every_rank():
    results = run_ranks(_bad_worker, 2, timeout=120)
    for rank, (messages, finite) in enumerate(results):
        assert finite
        assert set(messages) == {name for name, _ in BAD} | {"all decreasing", "local length"}, messages
        for name, _ in BAD:
            assert "document layout differs" in messages[name], (rank, name, messages[name])
        assert "rank 1" in messages["past the stream"] and "past the stream" in messages["past the stream"]
        for same in ("all decreasing", "local length"):   # the same on every rank: no "differs"
            assert "differs" not in messages[same] and f"on CP rank {rank}" in messages[same], messages[same]
        assert "strictly increasing" in messages["all decreasing"] and "cumsum" in messages["all decreasing"]
        assert "sharding.shard" in messages["local length"]
    print(results[0][0]["decreasing"])


BYTE_CASES = [
    # (comm, a2a_size, causal, window, native partials, dtype)
    ("ring", None, True, None, False, torch.float32),
    ("ring", None, True, (6, 0), True, torch.bfloat16),
    ("ring", None, False, (9, 4), True, torch.bfloat16),
    ("ring", None, True, None, True, torch.bfloat16),
    ("all_gather", None, True, (6, 0), False, torch.bfloat16),
    ("a2a", None, True, None, True, torch.bfloat16),
    ("a2a+p2p", 2, True, None, False, torch.bfloat16),
    ("a2a+p2p", 2, True, (6, 0), True, torch.bfloat16),
]


BLOCK_KEYS = ("0", "16384")          # one step per block, and the default-like blocks


def _bytes_worker(rank, world):
    import cp_softcap as cps
    from cases import native_standin
    cu, s, _ = _cases(world)[0]
    hybrid = cps.make_hybrid_groups(None, 2)
    native = native_standin()
    out = []
    for keys in BLOCK_KEYS:
        os.environ["CP_SOFTCAP_RING_BLOCK_KEYS"] = keys
        out.append(_count_bytes(rank, world, cu, s, hybrid, native))
    return out


def _count_bytes(rank, world, cu, s, hybrid, native):
    import torch.distributed as dist
    import cp_softcap as cps
    from cp_softcap.sharding import shard
    from cp_softcap.transport import counting
    out = []
    for i, (comm, a2a, causal, window, nat, dtype) in enumerate(BYTE_CASES):
        g = torch.Generator().manual_seed(i)
        q, k, v = (shard(torch.randn(2, s, h, 8, generator=g), world, rank, cu_seqlens=cu)
                   .to(dtype).requires_grad_() for h in (4, 2, 2))
        with counting() as fwd:
            o = cps.cp_attention(q, k, v, hybrid if comm == "a2a+p2p" else dist.group.WORLD,
                                 softcap=5.0, causal=causal, window=window, comm=comm,
                                 backend=native if nat else "auto", cu_seqlens=cu)
        with counting() as bwd:
            o.backward(torch.ones_like(o))
        out.append({"fwd": dict(fwd.sent), "bwd": dict(bwd.sent)})
    return out


def test_byte_model_equals_counted_bytes():
    """comm_model.py's model with documents= == the bytes each rank counted, op by op (cp 4)."""
    from cp_softcap.sharding import layout_for
    world = 4
    cu, s, _ = _cases(world)[0]
    layout = layout_for(cu, s, world)
    per_keys = run_ranks(_bytes_worker, world, timeout=200)
    for b, block_keys in enumerate(BLOCK_KEYS):
        _compare_bytes([r[b] for r in per_keys], block_keys, layout, world)


def _compare_bytes(measured, block_keys, layout, world):
    from cp_softcap.comm_model import bytes_per_rank, sent_per_rank
    from cp_softcap.spec import make_spec
    for i, (comm, a2a, causal, window, nat, dtype) in enumerate(BYTE_CASES):
        spec = make_spec(head_dim=8, num_heads=4, num_kv_heads=2, dtype=dtype, device_type="cpu",
                         softcap=5.0, causal=causal, window=window, cp_size=world, comm=comm,
                         documents=True)
        kw = dict(partial_bytes=dtype.itemsize if nat else None, block_keys=int(block_keys),
                  documents=layout)
        model = sent_per_rank(spec, layout.seq_len, comm, batch=2, a2a_size=a2a, **kw)
        for r in range(world):
            want = {ph: {op: b for op, b in model[r].items() if f".{ph}." in op} for ph in ("fwd", "bwd")}
            assert measured[r][i] == want, f"{BYTE_CASES[i]} rank {r}: counted {measured[r][i]} != {want}"
        busiest = max(sum(m[i]["fwd"].values()) + sum(m[i]["bwd"].values()) for m in measured)
        assert bytes_per_rank(spec, layout.seq_len, batch=2, a2a_size=a2a, **kw)[comm] == busiest


def _bf16_returns_worker(rank, world):
    """Packed ring with bf16 kernel partials: returning exclusive blocks' dK/dV in bf16 gives
    bitwise the gradients of returning float32 copies (what doc_geometry.block_exclusive
    promises), and at least one block does return bf16."""
    import torch.distributed as dist
    import cp_softcap as cps
    from cases import native_standin
    from cp_softcap.cp import ring
    from cp_softcap.sharding import shard
    kernel, exact, bf16_blocks = native_standin(), ring.return_dtype, [0]

    def counted(partial, acc, exclusive):
        dt = exact(partial, acc, exclusive)
        bf16_blocks[0] += dt == torch.bfloat16
        return dt
    cu, s, _ = _cases(world)[0]
    same = []
    for keys in ("0", "16384"):
        os.environ["CP_SOFTCAP_RING_BLOCK_KEYS"] = keys
        for causal, window in ((True, None), (True, (6, 0)), (False, (9, 4))):
            torch.manual_seed(1)
            q, k, v, dout = (torch.randn(2, s, h, 8).to(torch.bfloat16) for h in (4, 2, 2, 4))
            grads = []
            for returns in (counted, lambda partial, acc, *_: acc):
                ring.return_dtype = returns
                local = [shard(t, world, rank, cu_seqlens=cu).requires_grad_() for t in (q, k, v)]
                out = cps.cp_attention(*local, dist.group.WORLD, backend=kernel, softcap=30.0,
                                       causal=causal, window=window, cu_seqlens=cu)
                out.backward(shard(dout, world, rank, cu_seqlens=cu))
                grads.append([t.grad for t in local])
            same.append(all(torch.equal(a, b) for a, b in zip(*grads)))
    return same, bf16_blocks[0]


def test_packed_bf16_returns_are_bitwise_the_float32_returns():
    results = run_ranks(_bf16_returns_worker, 4, timeout=200)
    assert all(all(same) for same, _ in results), results
    assert sum(n for _, n in results) > 0, results
