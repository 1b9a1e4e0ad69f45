"""A context-parallel training step of an HF transformers Gemma2 with
attn_implementation="cp_softcap", checked against the same model on one process.

    python examples/hf_cp.py                               # spawns 2 CPU ranks itself (gloo)
    python examples/hf_cp.py --nproc 4 --dp 2
    torchrun --nproc-per-node 2 examples/hf_cp.py --dp 1

A tiny random Gemma2 (attention softcap 3, final softcap 5, a 12-token sliding window on layer 0,
GQA 4/2) runs one forward + backward with input_ids, position_ids and labels sharded over
dp x cp ranks: loss = this rank's cross-entropy sum / the step's valid-label count, gradients
summed over all ranks. Every rank compares the summed loss, the logits put back together with
cps.sharding.gather and the gradients with the eager model in float64 on the whole batch,
prints the worst relative error, and exits non-zero on a mismatch; a negative control checks
that the comparison would fail without the attention softcap. CPU only (gloo); needs
transformers (pip install -e ".[gemma2]"), no download.

The blocks between `# [README:... begin]` and `# [README:... end]` are copied verbatim in
README.md (hf-step) and docs/hf.md (hf, which holds hf-step); tests/test_readme.py checks that
they agree.
"""
from __future__ import annotations

import sys

from _launch import cp_size, parse_dp_args, run_ranks   # examples/_launch.py: torchrun or spawned ranks

# [README:hf begin]
import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
import cp_softcap as cps
from cp_softcap.integrations.hf import use_cp_group   # registers attn_implementation="cp_softcap"


def tiny_gemma2(attn_implementation="cp_softcap"):
    """A random 2-layer Gemma2 (a real one: Gemma2ForCausalLM.from_pretrained(path,
    attn_implementation="cp_softcap"))."""
    config = transformers.Gemma2Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=12,
        sliding_window=12, attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
        attn_implementation=attn_implementation)
    return transformers.Gemma2ForCausalLM(config)


def hf_train_step(model, tokens, mesh, pad_id=0):
    """Forward + backward of this rank's zigzag shard of `tokens` [B, S+1] (the SAME tokens on
    every CP rank of a dp group). Returns this rank's HF output (loss, logits shard)."""
# [README:hf-step begin]
    cp_group, dp_group = mesh.get_group("cp"), mesh.get_group("dp")
    cp, r = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    use_cp_group(cp_group)                        # None = one device; comm="a2a", "auto", ... too
    lab = tokens[:, 1:].masked_fill(tokens[:, 1:] == pad_id, -100)   # shifted on the FULL sequence
    S = lab.shape[1]                              # a multiple of 2 * cp
    ids = cps.sharding.shard(tokens[:, :-1], cp, r)
    labels = cps.sharding.shard(lab, cp, r).contiguous()
    pos = cps.sharding.positions(S, cp, r)[None]  # global position ids: required under CP
    n_valid = (lab != -100).sum()                 # valid labels of the whole step:
    dist.all_reduce(n_valid, group=dp_group)      # this batch's, summed over dp
    # shift_labels: already shifted, so HF does not shift across shard borders;
    # num_items_in_batch: loss = this rank's CE sum / n_valid
    out = model(input_ids=ids, position_ids=pos, labels=labels, shift_labels=labels,
                num_items_in_batch=n_valid)
# [README:hf-step end]
    out.loss.backward()
    for p in model.parameters():                  # SUM gradients over dp x cp
        dist.all_reduce(p.grad)
    return out
# [README:hf end]

B, S = 2, 48
TOL = 1e-4              # float32 CP vs float64 one process, relative to the largest reference value


def batch(dp_rank: int) -> torch.Tensor:
    """dp group `dp_rank`'s tokens [B, S+1]; pad id 0 at the end of row 1 (labels -100)."""
    g = torch.Generator().manual_seed(200 + dp_rank)
    tokens = torch.randint(1, 97, (B, S + 1), generator=g)
    tokens[1, -7:] = 0
    return tokens


def init_weights(model: torch.nn.Module) -> None:
    """The same weights on every rank, large enough that the attention softcap saturates."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "norm" in name else 0.5))


def reference(model: torch.nn.Module, dp: int, softcap=3.0):
    """float64 eager Gemma2 on one process, whole global batch: (loss, logits, grads)."""
    ref = tiny_gemma2("eager")
    for layer in ref.model.layers:
        layer.self_attn.attn_logit_softcapping = softcap
    ref.load_state_dict(model.state_dict())
    ref.double()
    tokens = torch.cat([batch(d) for d in range(dp)])
    lab = tokens[:, 1:].masked_fill(tokens[:, 1:] == 0, -100)
    out = ref(input_ids=tokens[:, :-1], labels=lab, shift_labels=lab)
    out.loss.backward()
    return out.loss.detach(), out.logits.detach(), {n: p.grad for n, p in ref.named_parameters()}


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref|; inf when `a` has a NaN or inf."""
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def run_rank(dp: int) -> int:
    """One rank's whole program, after torch.distributed is initialised. Returns the exit code."""
    world, rank = dist.get_world_size(), dist.get_rank()
    cp = cp_size(world, dp, S)
    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    model = tiny_gemma2()
    init_weights(model)
    dp_rank = mesh.get_local_rank("dp")
    out = hf_train_step(model, batch(dp_rank), mesh)
    use_cp_group(None)
    logits = cps.sharding.gather(out.logits.detach(), mesh.get_group("cp"))
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)                                   # the step's loss: the sum over ranks

    ref_loss, ref_logits, ref_grads = reference(model, dp)
    mine = slice(dp_rank * B, (dp_rank + 1) * B)
    errs = {"loss": rel_err(loss, ref_loss), "logits": rel_err(logits, ref_logits[mine]),
            "grads": max(rel_err(p.grad, ref_grads[n]) for n, p in model.named_parameters())}
    control = rel_err(logits, reference(model, dp, softcap=None)[1][mine])
    ok = max(errs.values()) <= TOL and control > 100 * TOL
    if rank == 0 or not ok:
        print(f"rank {rank} (dp {dp} x cp {cp}): max relative error vs float64 eager on one process: "
              + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()) + f" (tolerance {TOL:.0e}); "
              + f"control without the softcap must differ: {control:.2e} -> {'OK' if ok else 'MISMATCH'}",
              flush=True)
    return 0 if ok else 1


def main(argv=None) -> int:
    a = parse_dp_args(__doc__, argv, nproc=2, dp=1, seq_len=S)
    return run_ranks(run_rank, a.nproc, a.dp)


if __name__ == "__main__":
    sys.exit(main())
