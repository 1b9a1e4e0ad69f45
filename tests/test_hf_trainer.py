"""cp_softcap.integrations.hf_trainer in one process: the collator's shards (labels shifted on the
full sequence, global positions) and each refusal with its message. The multi-rank Trainer runs
are in tests_dist/test_hf_trainer_dist.py."""
import pytest
import torch

pytest.importorskip("transformers", minversion="5")
pytest.importorskip("accelerate")
from cp_softcap.integrations.hf_trainer import CPCollator, check_cp_model, cp_mesh, shard_batch  # noqa: E402
from cp_softcap.sharding import positions, shard, unshard  # noqa: E402

B, S = 2, 16


def batch(**extra):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 50, (B, S), generator=g)
    labels = ids.clone()
    labels[1, -5:] = -100
    return {"input_ids": ids, "labels": labels, **extra}


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_shards_put_back_give_the_full_shifted_batch(cp):
    full = batch()
    shards = [shard_batch(full, cp, r) for r in range(cp)]
    shifted = torch.cat([full["labels"][:, 1:], torch.full((B, 1), -100)], dim=1)
    assert torch.equal(unshard([s["input_ids"] for s in shards]), full["input_ids"])
    assert torch.equal(unshard([s["shift_labels"] for s in shards]), shifted)
    for r, s in enumerate(shards):
        assert s["labels"] is s["shift_labels"]
        assert torch.equal(s["position_ids"], positions(S, cp, r).expand(B, -1))
    if cp > 1:          # negative control: shifting each shard pairs tokens across shard borders
        per_shard = torch.nn.functional.pad(shard(full["labels"], cp, 0)[:, 1:], (0, 1), value=-100)
        assert not torch.equal(shards[0]["shift_labels"], per_shard)


def test_all_ones_mask_and_plain_positions_are_dropped():
    out = CPCollator(lambda f: f[0], 2, 1)([batch(attention_mask=torch.ones(B, S, dtype=torch.long),
                                                  position_ids=torch.arange(S).expand(B, -1))])
    assert "attention_mask" not in out
    assert torch.equal(out["position_ids"][0], positions(S, 2, 1))


def test_refuses_padding_mask():
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, -5:] = 0
    with pytest.raises(ValueError, match=r"attention_mask \(2, 16\) with padding.*labels -100 and drop"):
        shard_batch(batch(attention_mask=mask), 2, 0)


def test_refuses_a_mask_that_is_not_2d_without_claiming_padding():
    """An all-ones 4-D mask is refused (hf.mask_is_empty accepts only 2-D), and the message says
    why: it has no zeros to blame."""
    with pytest.raises(ValueError, match=r"attention_mask \(2, 1, 16, 16\) of 4 dimensions") as e:
        shard_batch(batch(attention_mask=torch.ones(B, 1, S, S, dtype=torch.long)), 2, 0)
    assert "zeros" not in str(e.value)


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("flash_kwargs", [False, True])
def test_packed_shards_put_back_give_the_stream(cp, flash_kwargs):
    import transformers
    docs = [{"input_ids": list(range(3, 3 + n))} for n in (7, 11, 5)]
    full = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(docs)
    shards = [shard_batch(full, cp, r) for r in range(cp)]
    cu = [0, 7, 18, 23]
    assert all(s["cu_seqlens"].cu_seqlens == tuple(cu) for s in shards)
    assert all(k not in shards[0] for k in ("cu_seq_lens_q", "max_length_q"))
    put_back = {k: unshard([s[k] for s in shards], cu_seqlens=cu, seq_len=23)
                for k in ("input_ids", "shift_labels", "position_ids")}
    assert torch.equal(put_back["input_ids"], full["input_ids"])
    assert torch.equal(put_back["position_ids"], full["position_ids"])
    assert torch.equal(put_back["shift_labels"][:, :-1], full["labels"][:, 1:])
    assert put_back["shift_labels"][0, -1] == -100


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_flattened_batch_of_one_document_of_any_length(cp):
    """A flattened batch holding ONE document (batch size 1, a last partial batch) has plain
    positions: it is taken as one packed document, whatever its length."""
    import transformers
    full = transformers.DataCollatorWithFlattening()([{"input_ids": list(range(3, 10))}])
    shards = [shard_batch(full, cp, r) for r in range(cp)]
    assert all(s["cu_seqlens"].cu_seqlens == (0, 7) for s in shards)
    put_back = {k: unshard([s[k] for s in shards], cu_seqlens=[0, 7], seq_len=7)
                for k in ("input_ids", "shift_labels", "position_ids")}
    assert torch.equal(put_back["input_ids"], full["input_ids"])
    assert torch.equal(put_back["position_ids"], torch.arange(7)[None])
    assert torch.equal(put_back["shift_labels"][:, :-1], full["labels"][:, 1:])


def test_one_process_takes_any_length():
    full = {k: v[:, :13] for k, v in batch().items()}
    out = shard_batch(full, 1, 0)
    assert torch.equal(out["input_ids"], full["input_ids"]) and "cu_seqlens" not in out
    assert torch.equal(out["shift_labels"][:, :-1], full["labels"][:, 1:])
    assert torch.equal(out["position_ids"], torch.arange(13).expand(B, -1))


@pytest.mark.parametrize("cp", [2, 4])
def test_packed_layout_balanced_for_every_layer_kind(cp):
    """With a model's layer windows (Gemma2: global and sliding), the shards follow ONE layout
    balanced for both kinds, and that PackedLayout is what the model gets as cu_seqlens."""
    import transformers
    from cp_softcap.documents import PackedLayout
    from cp_softcap.integrations.hf_trainer import layer_windows
    config = transformers.Gemma2Config(num_hidden_layers=4, sliding_window=8)
    windows = layer_windows(config)
    assert windows == [(7, 0), None]
    assert layer_windows(transformers.Gemma2Config(num_hidden_layers=2, layer_types=["full_attention"] * 2)) is None
    docs = [{"input_ids": list(range(3, 3 + n))} for n in (40, 3, 25, 60, 9)]
    full = transformers.DataCollatorWithFlattening()(docs)
    shards = [shard_batch(full, cp, r, windows) for r in range(cp)]
    layout = shards[0]["cu_seqlens"]
    assert isinstance(layout, PackedLayout) and len(layout.windows) == 2
    assert layout.cu_seqlens == (0, 40, 43, 68, 128, 137)
    put_back = {k: unshard([s[k] for s in shards], cu_seqlens=layout, seq_len=137)
                for k in ("input_ids", "position_ids")}
    assert torch.equal(put_back["input_ids"], full["input_ids"])
    assert torch.equal(put_back["position_ids"], full["position_ids"])


def test_refuses_packed_rows():
    pos = torch.cat([torch.arange(10), torch.arange(6)]).expand(B, -1)
    with pytest.raises(ValueError, match=r"packed batch of shape \(2, 16\).*ONE row"):
        shard_batch(batch(position_ids=pos), 2, 0)


def test_refuses_packed_document_not_starting_at_zero():
    one = {k: v[:1] for k, v in batch().items()}
    pos = torch.cat([torch.arange(10), torch.arange(3, 9)])[None]
    with pytest.raises(ValueError, match="documents must start at position 0"):
        shard_batch({**one, "position_ids": pos}, 2, 0)


def test_refuses_length_the_layout_cannot_take():
    full = {k: v[:, :14] for k, v in batch().items()}
    with pytest.raises(ValueError, match=r"sequence length 14 .* 2 \* cp = 8 \(CP rank 3\).*pad_to_multiple"):
        shard_batch(full, 4, 3)


def test_refuses_unknown_per_token_tensor():
    with pytest.raises(ValueError, match="'token_type_ids'.*does not know how to shard"):
        shard_batch(batch(token_type_ids=torch.zeros(B, S, dtype=torch.long)), 2, 0)


def test_refuses_cp_not_dividing_world(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError, match=r"cp=3 does not divide the world of 4 ranks \(rank 1\)"
                                         r".*\[1, 2, 4\]"):
        cp_mesh(3)


def test_refuses_model_not_routed_through_cp_softcap():
    import transformers
    config = transformers.Gemma2Config(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                                       attn_implementation="eager")
    model = transformers.Gemma2ForCausalLM(config)
    with pytest.raises(ValueError, match="attn_implementation='eager', which does not route through"):
        check_cp_model(model)
    model.set_attn_implementation("cp_softcap")
    check_cp_model(model)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_neftune_bound_takes_the_global_length(cp):
    """NEFTune's noise bound on a CP rank equals HF's one-process bound for the same batch:
    zigzag rows (cp x the shard) and a packed stream of 19 tokens (the layout's end padding not
    counted); HF's own hook on the shard would use the shard's length."""
    from transformers.integrations.neftune import neftune_post_forward_hook

    from cp_softcap.integrations.hf_trainer import global_seq_len, neftune_global_hook

    def bound(hook, out, **kw):
        emb = torch.nn.Module()
        emb.neftune_noise_alpha = 5.0
        seen = []
        original = torch.Tensor.uniform_
        torch.Tensor.uniform_ = lambda t, a, b: seen.append(float(b)) or original(t, a, b)
        try:
            hook(emb, None, out, **kw)
        finally:
            torch.Tensor.uniform_ = original
        return seen[0]

    d = 8
    packed = {"input_ids": torch.arange(19)[None],
              "position_ids": torch.tensor([list(range(7)) + list(range(12))])}
    for full in (batch(), packed):
        length = full["input_ids"].size(1)
        one_process = bound(neftune_post_forward_hook, torch.zeros(1, length, d))
        for r in range(cp):
            part = shard_batch(full, cp, r)
            assert global_seq_len(part, cp) == length
            out = torch.zeros(1, part["input_ids"].size(1), d)
            assert bound(neftune_global_hook, out, alpha=5.0, seq_len=global_seq_len(part, cp)) == one_process
            if cp > 1:          # control: the shard's own length, as HF's hook takes it
                per_shard = bound(neftune_post_forward_hook, out)
                assert per_shard > 1.05 * one_process
                if full is not packed:
                    assert per_shard == pytest.approx(cp ** 0.5 * one_process, rel=1e-6)
