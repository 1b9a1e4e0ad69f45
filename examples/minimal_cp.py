"""A complete context-parallel training step with cps.CPAttention, checked against one device.

    python examples/minimal_cp.py                          # spawns 4 CPU ranks itself (gloo)
    python examples/minimal_cp.py --nproc 2 --dp 1
    torchrun --nproc-per-node 4 examples/minimal_cp.py --dp 2

A one-layer model (embedding, RoPE, softcapped sliding-window attention, logits) runs one
forward + backward with its tokens sharded over dp x cp ranks. Every rank then compares the
loss, the logits put back together with cps.sharding.gather, and the summed gradients with the
same model run in float64 on the whole batch through one-device cps.attention, prints the worst
relative error, and exits non-zero on a mismatch. Negative controls check that the comparison
would fail if the softcap or the window were dropped. CPU only (gloo); on GPUs the same steps
run with init_device_mesh("cuda", ...) and NCCL.

The blocks between `# [README:... begin]` and `# [README:... end]` are copied verbatim in
README.md (cpattention) and docs/api.md (model); tests/test_readme.py checks that they agree.
"""
from __future__ import annotations

import sys

from _launch import cp_size, parse_dp_args, run_ranks   # examples/_launch.py: torchrun or spawned ranks

# [README:model begin]
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
import cp_softcap as cps

SOFTCAP = 2.0           # small, so that most scores saturate it (|s| > 2 * cap)
WINDOW = (11, 0)        # key j visible from query i iff i - 11 <= j <= i (global positions)
SCALE = 0.25            # 1 / sqrt(head dim 16)


def rope(x, pos, base=10000.0):
    """Rotary embedding of x [B, s, H, D] at the GLOBAL positions pos [s] of its tokens."""
    half = x.shape[-1] // 2
    freq = base ** (-torch.arange(half, dtype=torch.float64, device=x.device) / half)
    angle = (pos.to(torch.float64)[:, None] * freq)[:, None]            # [s, 1, D/2]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class TinyLM(torch.nn.Module):
    """Embedding -> one attention layer -> logits. Only `attn` knows about context parallelism:
    everything else works per token, so it runs unchanged on a rank's shard of the sequence."""

    def __init__(self, attn, vocab=64, heads=4, kv_heads=2, head_dim=16):
        super().__init__()
        self.attn, self.h, self.hkv, self.d = attn, heads, kv_heads, head_dim
        self.emb = torch.nn.Embedding(vocab, heads * head_dim)
        self.wq = torch.nn.Linear(heads * head_dim, heads * head_dim, bias=False)
        self.wkv = torch.nn.Linear(heads * head_dim, 2 * kv_heads * head_dim, bias=False)
        self.wo = torch.nn.Linear(heads * head_dim, vocab, bias=False)

    def forward(self, ids, pos):                                 # ids [B, s], pos [s]
        x = self.emb(ids)
        q = self.wq(x).unflatten(-1, (self.h, self.d))                       # [B, s, Hq, D]
        k, v = self.wkv(x).unflatten(-1, (2, self.hkv, self.d)).unbind(2)    # [B, s, Hkv, D]
        out = self.attn(rope(q, pos), rope(k, pos), v)                       # [B, s, Hq, D]
        return self.wo(out.flatten(2))                                       # [B, s, vocab]
# [README:model end]


# [README:cpattention begin]
def build(dp, cp):
    """After dist.init_process_group (torchrun does it): the (dp, cp) mesh and this rank's model."""
    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))   # "cuda" (NCCL) on GPUs
    # attn(q, k, v) takes this rank's shards [B, S/cp, H, D]: batch, sequence, heads, head dim
    attn = cps.CPAttention(mesh.get_group("cp"), softcap=SOFTCAP, causal=True, window=WINDOW, scale=SCALE)
    return mesh, TinyLM(attn)                              # cp: adjacent ranks (the mesh's last dim)


def cp_train_step(model, tokens, mesh, pad_id=0):
    """Forward + backward of this rank's zigzag shard of `tokens` [B, S+1]: every CP rank of a
    dp group passes the SAME tokens. Returns this rank's loss and logits shard [B, S/cp, vocab]."""
    cp_group, dp_group = mesh.get_group("cp"), mesh.get_group("dp")
    cp, r = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    inp = tokens[:, :-1]                                   # 1. shift labels on the FULL sequence
    lab = tokens[:, 1:].masked_fill(tokens[:, 1:] == pad_id, -100)
    S = inp.shape[1]                                       #    (a multiple of 2 * cp: pad_to_multiple)
    ids = cps.sharding.shard(inp, cp, r)                   # 2. zigzag shard: [B, S/cp]
    labels = cps.sharding.shard(lab, cp, r)
    pos = cps.sharding.positions(S, cp, r)                 # 3. global positions, for RoPE
    logits = model(ids, pos)
    n_valid = (lab != -100).sum()                          # 4. valid labels of the whole step:
    dist.all_reduce(n_valid, group=dp_group)               #    this batch's, summed over dp
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / n_valid
    loss.backward()
    for p in model.parameters():                           # 5. SUM gradients over dp x cp
        dist.all_reduce(p.grad)
    return loss, logits
# [README:cpattention end]

B, S, VOCAB = 2, 64, 64
TOL = 1e-4              # float32 CP vs float64 one device, relative to the largest reference value


def batch(dp_rank: int) -> torch.Tensor:
    """dp group `dp_rank`'s tokens [B, S+1]; pad id 0 at the end of row 0 (labels -100)."""
    g = torch.Generator().manual_seed(100 + dp_rank)
    tokens = torch.randint(1, VOCAB, (B, S + 1), generator=g)
    tokens[0, -9:] = 0
    return tokens


def init_weights(model: torch.nn.Module) -> None:
    """The same weights on every rank, standard normal: large enough that most attention scores
    saturate the softcap."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))


def reference(model: torch.nn.Module, dp: int, softcap=SOFTCAP, window=WINDOW):
    """float64, one device, whole global batch: (loss, logits of every dp batch, grads, the
    fraction of scores with |s| > 2 * softcap)."""
    big = []

    def attn(q, k, v):
        s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)) * SCALE
        big.append((s.abs() > 2 * SOFTCAP).double().mean().item())
        return cps.attention(q, k, v, softcap=softcap, causal=True, window=window, scale=SCALE)

    ref = TinyLM(attn)
    ref.load_state_dict(model.state_dict())
    ref.double()
    tokens = torch.cat([batch(d) for d in range(dp)])
    lab = tokens[:, 1:].masked_fill(tokens[:, 1:] == 0, -100)
    logits = ref(tokens[:, :-1], torch.arange(S))
    loss = F.cross_entropy(logits.flatten(0, 1), lab.flatten(), reduction="sum") / (lab != -100).sum()
    loss.backward()
    return loss.detach(), logits.detach(), {n: p.grad for n, p in ref.named_parameters()}, big[0]


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref|; inf when `a` has a NaN or inf."""
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def run_rank(dp: int) -> int:
    """One rank's whole program, after torch.distributed is initialised. Returns the exit code."""
    world, rank = dist.get_world_size(), dist.get_rank()
    cp = cp_size(world, dp, S)
    mesh, model = build(dp, cp)
    init_weights(model)
    dp_rank = mesh.get_local_rank("dp")
    loss, logits = cp_train_step(model, batch(dp_rank), mesh)
    logits_full = cps.sharding.gather(logits.detach(), mesh.get_group("cp"))   # [B, S, vocab]
    loss_sum = loss.detach().clone()
    dist.all_reduce(loss_sum)                               # the step's loss: the sum over ranks

    ref_loss, ref_logits, ref_grads, saturated = reference(model, dp)
    mine = slice(dp_rank * B, (dp_rank + 1) * B)
    errs = {"loss": rel_err(loss_sum, ref_loss), "logits": rel_err(logits_full, ref_logits[mine]),
            "grads": max(rel_err(p.grad, ref_grads[n]) for n, p in model.named_parameters())}
    controls = {"no softcap": rel_err(logits_full, reference(model, dp, softcap=None)[1][mine]),
                "no window": rel_err(logits_full, reference(model, dp, window=None)[1][mine])}
    ok = max(errs.values()) <= TOL and min(controls.values()) > 100 * TOL and saturated > 0.3
    if rank == 0 or not ok:
        print(f"rank {rank} (dp {dp} x cp {cp}): max relative error vs float64 one device: "
              + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()) + f" (tolerance {TOL:.0e}); "
              + "controls that must differ: " + ", ".join(f"{k} {v:.2e}" for k, v in controls.items())
              + f"; {saturated:.0%} of scores have |s| > 2 * softcap -> {'OK' if ok else 'MISMATCH'}",
              flush=True)
    return 0 if ok else 1


def main(argv=None) -> int:
    a = parse_dp_args(__doc__, argv, nproc=4, dp=2, seq_len=S)
    return run_ranks(run_rank, a.nproc, a.dp)


if __name__ == "__main__":
    sys.exit(main())
