"""The bytes-per-rank model behind comm="auto" (cp/auto.py): closed forms for the ring under
causal zigzag, the windowed ring, all_gather, a2a and a2a+p2p, the busiest-rank total, the
choice, and the select CLI. tests_dist/test_comm_model_dist.py checks the model against
comm.counting() on real gloo ranks; benchmarks/comm_bytes.py at Gemma2-9B shapes."""
import pytest
import torch

from cp_softcap.cp.auto import bytes_per_rank, choose_comm, describe_comm_choice, sent_per_rank
from cp_softcap.layout import key_range
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
    from cp_softcap.select import main
    args = ["--softcap", "50", "--head-dim", "256", "--heads", "16", "--kv-heads", "8", "--cp", "8",
            "--device", "cpu", "--causal", "--window", "4095", "0", "--seq-len", "131072"]
    assert main(args + ["--a2a-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "ring               255.9 MiB CHOSEN" in out and "a2a+p2p/2          640.0 MiB" in out
    assert main(args[:-1] + ["1000"]) == 2
    assert "multiple of 2*cp" in capsys.readouterr().err
