"""The bytes-per-rank model behind comm="auto" (comm_model.py): closed forms for the ring under
causal zigzag, the windowed ring, all_gather, a2a and a2a+p2p, the busiest-rank total, the
choice, the select CLI, and ring dK/dV returned in the kernel's 16-bit partial dtype
(partial_bytes=) for exclusive blocks. tests_dist/test_comm_model_dist.py checks the model against
transport.counting() on real gloo ranks; benchmarks/comm_bytes.py at Gemma2-9B shapes."""
import pytest
import torch

from cp_softcap.comm_model import bytes_per_rank, choose_comm, describe_comm_choice, sent_per_rank
from cp_softcap.layout import block_exclusive, key_range, ring_blocks
from cp_softcap.spec import make_spec

MiB = 2 ** 20


def spec_of(cp, window=None, causal=True, hq=16, hkv=8, d=256, dtype=torch.bfloat16):
    return make_spec(head_dim=d, num_heads=hq, num_kv_heads=hkv, dtype=dtype, device_type="cpu",
                     softcap=50.0, causal=causal, window=window, cp_size=cp, comm="auto")


def totals(per):
    return [sum(ops.values()) for ops in per]


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ring_causal_closed_form(cp, dtype):
    """Rank r sends its first chunk (c keys) to each later rank and both chunks (2c) to each
    earlier one, fwd and again bwd; it returns float32 dK/dV for c keys of each earlier source
    and 2c of each later one."""
    s, b = 2 * cp * 64, 3
    sp = spec_of(cp, dtype=dtype, hkv=2, d=8)
    e, g, c = dtype.itemsize, 4, 64
    kv = b * 2 * (8 + 8)
    per = sent_per_rank(sp, s, "ring", batch=b)
    for r, ops in enumerate(per):
        send, recv = (cp - 1 - r) * c + r * 2 * c, r * c + (cp - 1 - r) * 2 * c
        assert ops == {"ring.fwd.kv": send * kv * e, "ring.bwd.kv": send * kv * e,
                       "ring.bwd.dkv": recv * kv * g}
    assert bytes_per_rank(sp, s, batch=b)["ring"] == max(totals(per))
    if dtype == torch.bfloat16:   # 2e == g: every rank sends the same, 3/4 of all_gather
        assert len(set(totals(per))) == 1
        assert 4 * bytes_per_rank(sp, s, batch=b)["ring"] == 3 * bytes_per_rank(sp, s, batch=b)["all_gather"]


def test_busiest_rank_total_not_per_op_maxima():
    """float32 causal: kv and dkv peak on different ranks; the model is the max of the totals."""
    per = sent_per_rank(spec_of(4, dtype=torch.float32), 4 * 2 * 128, "ring")
    ops = per[0].keys()
    per_op_max = sum(max(p.get(op, 0) for p in per) for op in ops)
    assert bytes_per_rank(spec_of(4, dtype=torch.float32), 4 * 2 * 128)["ring"] == max(totals(per)) < per_op_max


def test_ring_without_mask_sends_whole_shards():
    sp = spec_of(4, causal=False)
    costs = bytes_per_rank(sp, 4096)
    assert costs["ring"] == costs["all_gather"] == 3 * 1024 * 8 * 512 * (2 + 2 + 4)


@pytest.mark.parametrize("s", [32768, 131072])
def test_windowed_ring_is_the_visible_key_ranges(s):
    cp, w = 8, (4095, 0)
    sp = spec_of(cp, window=w)
    c = s // cp // 2
    kv = 8 * 512
    for r, ops in enumerate(sent_per_rank(sp, s, "ring")):
        send = sum((key_range(cp, q, r, c, sp.window) or (0, 0))[1] - (key_range(cp, q, r, c, sp.window) or (0, 0))[0]
                   for q in range(cp) if q != r)
        assert ops.get("ring.fwd.kv", 0) == ops.get("ring.bwd.kv", 0) == send * kv * 2
    # a window narrower than a chunk: bytes do not grow with S (measured 255.9 MiB at 32K and 128K)
    assert bytes_per_rank(sp, s)["ring"] / MiB == pytest.approx(255.94, abs=0.01)


def test_gemma2_9b_values_match_the_measurement():
    """benchmarks/comm_bytes.py measured these (busiest rank, fwd+bwd, MiB, cp=8)."""
    for s, want in ((32768, {"ring": 672, "all_gather": 896, "a2a": 224}),
                    (131072, {"ring": 2688, "all_gather": 3584, "a2a": 896})):
        got = bytes_per_rank(spec_of(8), s)
        assert {k: v / MiB for k, v in got.items()} == want
    assert bytes_per_rank(spec_of(8), 32768, a2a_size=2)["a2a+p2p"] / MiB == 416
    assert bytes_per_rank(spec_of(8), 32768, a2a_size=4)["a2a+p2p"] / MiB == 288
    assert bytes_per_rank(spec_of(8), 131072, a2a_size=2)["a2a+p2p"] / MiB == 1664
    assert bytes_per_rank(spec_of(8), 131072, a2a_size=4)["a2a+p2p"] / MiB == 1152


def test_a2a_counts_replicated_kv_heads():
    # 16 query heads, 2 KV heads over 8 ranks: each rank gets 1 (replicated) KV head, not 2/8
    sp = spec_of(8, hkv=2)
    ops = sent_per_rank(sp, 8192, "a2a")[0]
    n = 8192 // 8
    assert ops["a2a.fwd.k"] == 7 * n * 1 * 256 * 2
    assert ops["a2a.fwd.q"] == 7 * n * 2 * 256 * 2
    assert ops["a2a.bwd.dq"] == 7 * n * 2 * 256 * 4
    assert "a2a" not in bytes_per_rank(spec_of(8, hq=12, hkv=4), 8192)


@pytest.mark.parametrize("window", [None, (100, 0)])
def test_hybrid_limits_are_ring_and_a2a(window):
    """a2a_size 1 is the plain ring; a2a_size cp is plain a2a."""
    sp = spec_of(8, window=window)
    assert sent_per_rank(sp, 16384, "a2a+p2p", a2a_size=1) == sent_per_rank(sp, 16384, "ring")
    assert sent_per_rank(sp, 16384, "a2a+p2p", a2a_size=8) == sent_per_rank(sp, 16384, "a2a")


def test_hybrid_is_inner_a2a_plus_outer_ring():
    sp = spec_of(8)
    per = sent_per_rank(sp, 32768, "a2a+p2p", a2a_size=2)
    inner = sent_per_rank(spec_of(2), 2 * 4096, "a2a")[0]               # same n = 4096 per rank
    outer = sent_per_rank(spec_of(4, hq=8, hkv=4), 32768, "ring")        # heads per inner rank
    for r in range(8):
        assert per[r] == {**inner, **outer[r // 2]}
    assert "a2a+p2p" not in bytes_per_rank(sp, 32768)
    assert "a2a+p2p" not in bytes_per_rank(spec_of(8, hq=6, hkv=2), 32768, a2a_size=4)
    with pytest.raises(ValueError, match="divides cp"):
        sent_per_rank(sp, 32768, "a2a+p2p", a2a_size=3)


def test_bad_seq_len_raises():
    with pytest.raises(ValueError, match="multiple of 2\\*cp"):
        bytes_per_rank(spec_of(8), 1000)


def test_choose_comm():
    assert choose_comm(spec_of(8), 32768) == "a2a"
    assert choose_comm(spec_of(8, window=(4095, 0)), 131072) == "ring"     # 256 MiB vs a2a 896
    assert choose_comm(spec_of(8, window=(4095, 0)), 32768) == "a2a"       # 224 vs ring 255.9
    assert choose_comm(spec_of(4, causal=False, hq=6, hkv=2), 4096) == "ring"   # tie with all_gather
    assert choose_comm(spec_of(8, hq=12, hkv=4), 32768) == "ring"          # a2a impossible


def test_describe_shows_hybrid_but_auto_does_not_pick_it():
    text = describe_comm_choice(spec_of(8, window=(4095, 0)), 32768, a2a_size=4)
    assert "a2a+p2p/4" in text and "not an auto candidate" in text
    chosen = [line for line in text.splitlines() if "CHOSEN" in line]
    assert len(chosen) == 1 and chosen[0].split()[0] == "a2a"
    assert "a2a+p2p" not in describe_comm_choice(spec_of(8), 32768)


def test_select_cli_seq_len(capsys):
    from cp_softcap.cli import main
    args = ["--softcap", "50", "--head-dim", "256", "--heads", "16", "--kv-heads", "8", "--cp", "8",
            "--device", "cpu", "--causal", "--window", "4095", "0", "--seq-len", "131072"]
    assert main(args + ["--a2a-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "ring               255.9 MiB CHOSEN" in out and "a2a+p2p/2          640.0 MiB" in out
    assert main(args[:-1] + ["1000"]) == 2
    assert "multiple of 2*cp" in capsys.readouterr().err


# --------------------------------------------------------------------------- native (16-bit) dK/dV partials

ALL_COMMS = ("ring", "all_gather", "a2a")


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("block_keys", [0, 1, 16384, None])
@pytest.mark.parametrize("causal", [True, False])
def test_native_partials_halve_exclusive_dkv(cp, block_keys, causal):
    """bf16 partials (flash-attn family): causal zigzag blocks (and unmasked ones) are always
    exclusive, so every rank's ring.bwd.dkv is exactly half the float32 model; a2a's gradients
    (one kernel call per head) halve too; nothing else changes, and all_gather does not depend on
    the partials at all."""
    sp, s = spec_of(cp, causal=causal), 2 * cp * 64
    c = s // cp // 2
    assert all(block_exclusive(cp, r, c, sp.window, steps)
               for r in range(cp) for steps in ring_blocks(cp, 2 * c, block_keys or 0))
    for comm in ALL_COMMS:
        base = sent_per_rank(sp, s, comm, batch=3)
        native = sent_per_rank(sp, s, comm, batch=3, partial_bytes=2, block_keys=block_keys)
        if comm == "all_gather":
            assert native == base
            continue
        if comm == "a2a":
            for b, n in zip(base, native):
                assert all(n[op] * 2 == b[op] > 0 for op in ("a2a.bwd.dq", "a2a.bwd.dk", "a2a.bwd.dv"))
                assert all(n[op] == b[op] for op in b if op.startswith("a2a.fwd") or op == "a2a.bwd.dout")
            continue
        for b, n in zip(base, native):
            assert n["ring.bwd.dkv"] * 2 == b["ring.bwd.dkv"] > 0
            assert {k: v for k, v in n.items() if k != "ring.bwd.dkv"} == \
                {k: v for k, v in b.items() if k != "ring.bwd.dkv"}
    if cp > 2:   # a2a+p2p: the outer ring's dkv halves too, the inner a2a is unchanged
        base = sent_per_rank(sp, s, "a2a+p2p", a2a_size=2)
        native = sent_per_rank(sp, s, "a2a+p2p", a2a_size=2, partial_bytes=2, block_keys=block_keys)
        for b, n in zip(base, native):
            assert n["ring.bwd.dkv"] * 2 == b["ring.bwd.dkv"] > 0
            assert {k: v for k, v in n.items() if k != "ring.bwd.dkv"} == \
                {k: v for k, v in b.items() if k != "ring.bwd.dkv"}


def test_gemma2_9b_with_native_partials():
    """cp 8, bf16: causal ring 672 -> 560 MiB (dkv 224 -> 112 on every rank); a2a 224 -> 168 (its
    dq/dk/dv halve); all_gather unchanged; a2a+p2p's inner a2a returns the outer ring's float32
    sums, so only its ring part changes. a2a+p2p/4 at 128K (outer ring of 2): the outer rank 0 sends K/V 64+64 and dkv
    256 -> 128, rank 1 K/V 128+128 and dkv 128 -> 64 MiB, so the busiest total (a2a 768 +
    ring) goes 1152 -> 1088, now on rank 1."""
    got = bytes_per_rank(spec_of(8), 32768, a2a_size=2, partial_bytes=2)
    assert {k: v / MiB for k, v in got.items()} == {"ring": 560, "all_gather": 896, "a2a": 168,
                                                    "a2a+p2p": 368}
    got = bytes_per_rank(spec_of(8), 131072, a2a_size=4, partial_bytes=2)
    assert {k: v / MiB for k, v in got.items()} == {"ring": 2240, "all_gather": 3584, "a2a": 672,
                                                    "a2a+p2p": 1088}


# cp 4, chunk 8, window (11, 0): rank 2's keys of rank 3 (step 3) are read by two calls on
# disjoint keys [5, 8) and [8, 16) (still exclusive); rank 3's keys of rank 2 (step 1) by two
# calls that share keys [5, 8) (not exclusive). Keys received per source:
#   rank 0: src1 8, src2 3 | rank 1: src0 8, src2 8, src3 3 | rank 2: src0 3, src1 8, src3 11
#   rank 3: src1 3, src2 8*                                   (* = non-exclusive source)
W_CP, W_C, W_WIN = 4, 8, (11, 0)
W_KV = 2 * (8 + 8)                  # hkv 2, D = Dv = 8, batch 1: bytes per key per element byte


@pytest.mark.parametrize("block_keys,dkv_elems", [
    # one step per block: only the non-exclusive slot stays float32 (4 B), the rest 2 B
    (0, [11 * 2, 19 * 2, 22 * 2, 3 * 2 + 8 * 4]),
    # one block of all steps (16 local tokens): rank 3's whole block stays float32
    (16384, [11 * 2, 19 * 2, 22 * 2, 11 * 4]),
])
def test_window_non_exclusive_block_keeps_float32(block_keys, dkv_elems):
    sp = spec_of(W_CP, window=W_WIN, hkv=2, d=8)
    s = 2 * W_CP * W_C
    assert [len(ring_blocks(W_CP, 2 * W_C, block_keys))] == [3 if block_keys == 0 else 1]
    native = sent_per_rank(sp, s, "ring", partial_bytes=2, block_keys=block_keys)
    assert [ops["ring.bwd.dkv"] for ops in native] == [n * W_KV for n in dkv_elems]
    base = sent_per_rank(sp, s, "ring")
    assert [ops["ring.bwd.dkv"] for ops in base] == [n * 4 * W_KV for n in (11, 19, 22, 11)]
    for b, n in zip(base, native):
        assert b["ring.fwd.kv"] == n["ring.fwd.kv"] and b["ring.bwd.kv"] == n["ring.bwd.kv"]


def test_block_keys_default_is_the_environment(monkeypatch):
    """block_keys=None reads CP_SOFTCAP_RING_BLOCK_KEYS as the ring does (settings.ring_block_keys())."""
    sp, s = spec_of(W_CP, window=W_WIN, hkv=2, d=8), 2 * W_CP * W_C
    for env in ("0", "16384"):
        monkeypatch.setenv("CP_SOFTCAP_RING_BLOCK_KEYS", env)
        assert sent_per_rank(sp, s, "ring", partial_bytes=2) == \
            sent_per_rank(sp, s, "ring", partial_bytes=2, block_keys=int(env))
    monkeypatch.delenv("CP_SOFTCAP_RING_BLOCK_KEYS")
    assert sent_per_rank(sp, s, "ring", partial_bytes=2) == \
        sent_per_rank(sp, s, "ring", partial_bytes=2, block_keys=16384)


@pytest.mark.parametrize("dtype,g", [(torch.bfloat16, 4), (torch.float32, 4), (torch.float64, 8)])
@pytest.mark.parametrize("window", [None, (4095, 0), (11, 0), (9, 4)])
def test_float32_partials_keep_todays_model(dtype, g, window, monkeypatch):
    """partial_bytes None or equal to the gradient bytes (the torch kernel) is today's model, for
    any block size, and then the block size is not even read."""
    monkeypatch.setenv("CP_SOFTCAP_RING_BLOCK_KEYS", "not a number")
    for cp, s in ((4, 2 * 4 * 8), (8, 32768)):
        sp = spec_of(cp, window=window, dtype=dtype, causal=window != (9, 4))
        for comm in ALL_COMMS:
            base = sent_per_rank(sp, s, comm)
            for bk in (None, 0, 16384):
                assert sent_per_rank(sp, s, comm, partial_bytes=g, block_keys=bk) == base
        assert bytes_per_rank(sp, s, a2a_size=2, partial_bytes=g) == bytes_per_rank(sp, s, a2a_size=2)
        assert choose_comm(sp, s, partial_bytes=g) == choose_comm(sp, s)


def test_choose_comm_with_native_partials():
    """Gemma2-9B window (4095, 0), cp 8, bf16 partials. 32K: the ring sends 192.0 MiB with
    blocks of one or two steps (every block's calls read disjoint keys); a2a (bf16 gradients
    too) sends 168 and wins. 128K: the ring's 192.0 beats a2a's 672."""
    sp = spec_of(8, window=(4095, 0))
    ring = lambda keys: bytes_per_rank(sp, 32768, partial_bytes=2, block_keys=keys)["ring"] / MiB  # noqa: E731
    assert ring(16384) == pytest.approx(191.95, abs=0.01)
    assert ring(32768) == pytest.approx(191.95, abs=0.01)
    assert bytes_per_rank(sp, 32768, partial_bytes=2)["a2a"] / MiB == 168
    assert choose_comm(sp, 32768, partial_bytes=2, block_keys=16384) == "a2a"
    assert choose_comm(sp, 131072, partial_bytes=2, block_keys=32768) == "ring"
    text = describe_comm_choice(sp, 32768, partial_bytes=2, block_keys=0)
    assert "partials of 2 B" in text.splitlines()[0]
    chosen = [line for line in text.splitlines() if "CHOSEN" in line]
    assert len(chosen) == 1 and chosen[0].split()[:2] == ["a2a", "168.0"]
    assert "partials" not in describe_comm_choice(sp, 32768, partial_bytes=4)
    for bad in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match="partial_bytes"):
            bytes_per_rank(sp, 32768, partial_bytes=bad)
