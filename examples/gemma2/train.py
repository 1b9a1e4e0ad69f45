"""Train Gemma2 with context parallelism (cp_softcap.CPAttention): dp x cp ranks.

    torchrun --nproc-per-node 8 examples/gemma2/train.py                  # tiny model, cp=8, CPU ok
    torchrun --nproc-per-node 8 examples/gemma2/train.py --cp 4 --seq-len 8192 --config 2b
    torchrun ... train.py --model-dir /path/gemma-2-2b --data my.txt --ckpt-dir runs/ckpt
    python examples/gemma2/train.py --plan --world-size 64 --config 27b --seq-len 131072 --fsdp --ac full

NCCL on GPUs (one per local rank), gloo on CPU otherwise. bf16 autocast on GPU, fp32 on CPU.
Checkpoints (--ckpt-dir) resume automatically from the newest complete `step-N` folder. Before
anything is built, the flags are checked and the memory plan must fit the device (--plan prints it).
"""
from __future__ import annotations

import math
import os
import sys
import time

if __package__ in (None, ""):   # run as a script: make `gemma2` importable from examples/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gemma2.allocator import expandable_segments  # noqa: E402

expandable_segments()           # before torch is imported (allocator.py says why)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import cp_softcap as cps  # noqa: E402
from gemma2 import checkpoint, flags, fused, memory, metrics, parallel, parallelize  # noqa: E402
from gemma2.data import check_ids, get_batch, get_packed_batch, load_documents, load_tokens  # noqa: E402
from gemma2.model import Gemma2, load_hf_weights  # noqa: E402
from gemma2.step import loss_and_grads, packed_loss_and_grads  # noqa: E402


def lr_at(step: int, args) -> float:
    """Linear warmup to --lr over --warmup steps, then cosine down to lr * min_lr_ratio."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.max_steps - args.warmup)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def plan_job(args, cfg, world: int) -> memory.Job:
    device_type = flags.device_type(args)
    return memory.Job(cfg, args.seq_len, args.batch_size, world, args.cp or world, fsdp=args.fsdp,
                      ac=args.ac, dtype=flags.compute_dtype(args), comm=args.comm,
                      loss_chunk=args.loss_chunk, device_type=device_type,
                      fused=fused.planned(args.fused, device_type, args.compile))


def check_memory(args, job: memory.Job) -> None:
    """--plan: print the plan and exit. Otherwise refuse (flags.fail) when the estimate does not
    fit the device."""
    limit = memory.device_memory(job.device_type, flags.local_world(), args.device_mem_gib)
    if args.plan:
        verdict = memory.check(job, limit)
        print(memory.render(job, limit) + "\n" + (f"does not fit: {verdict}" if verdict else "fits"), flush=True)
        sys.exit(0)
    refusal = None if args.skip_memory_check else memory.check(job, limit)
    if refusal:
        flags.fail(refusal)


def build(args, cfg, d: parallel.Dist):
    """Model (same init on every rank; AC, compile, then FSDP2 or DDP applied), optimizer, token
    stream."""
    group = parallel.attention_group(d, args.comm, cfg.num_attention_heads, args.a2a_size)
    with torch.device("meta" if args.fsdp else "cpu"):   # FSDP: materialise only this rank's shards
        model = Gemma2(cfg, group, comm=args.comm, backend=args.backend)
    model.loss_chunk = args.loss_chunk
    fused.apply(model, fused.choose(args.fused, d.device.type, args.compile))
    parallelize.apply_ac(model, args.ac)
    if args.compile:
        parallelize.apply_compile(model, args.compile)
    if args.fsdp:
        parallelize.apply_fsdp(model, d, getattr(torch, flags.compute_dtype(args)))
        model.to_empty(device=d.device)
    elif d.grad_mesh.size() > 1:
        parallelize.apply_ddp(model, d)
    model.reset_parameters(args.seed)
    if args.model_dir:
        load_hf_weights(model, args.model_dir)
    model.to(d.device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    # fused: one kernel per parameter group on CUDA instead of several foreach passes over the
    # float32 weights and both moments (2b: 2.6 B parameters, ~30 GB of optimizer state)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=d.device.type == "cuda")
    if args.pack:     # a list of documents; checked against the vocab as one stream
        tokens = load_documents(args.data, args.model_dir, cfg.eos_token_id)
        top = max(int(t.max()) for t in tokens)
    else:
        tokens = load_tokens(args.data, args.model_dir)
        top = int(tokens.max())
    check_ids(top, cfg.vocab_size, "the tokenized corpus")
    return model, opt, tokens


def train_step(model, opt, tokens, step: int, args, cfg, d, autocast):
    """One optimizer step: (loss, grad norm, lr, model FLOPs per token of this step's batch)."""
    lr = lr_at(step, args)
    for g in opt.param_groups:
        g["lr"] = lr
    if args.pack:
        inp, lab, cu = get_packed_batch(tokens, step=step, dp_rank=d.dp_rank, seq_len=args.seq_len,
                                        seed=args.seed, bos_id=cfg.bos_token_id, pad_id=cfg.pad_token_id)
        # one layout balanced for both of Gemma2's layer kinds (global and sliding-window): each
        # kind synchronises the ranks, so each needs its own balance
        layout = cps.documents.packed_layout(cu, args.seq_len, d.cp,
                                             layer_windows=[None, (cfg.sliding_window - 1, 0)])
        loss = packed_loss_and_grads(model, inp, lab, layout, d, autocast)
        flops = model.flops_per_token(args.seq_len, cu)      # documents attend only themselves
    else:
        batch = get_batch(tokens, step=step, dp_rank=d.dp_rank, batch_size=args.batch_size,
                          seq_len=args.seq_len, seed=args.seed, bos_id=cfg.bos_token_id)
        loss = loss_and_grads(model, batch, d, autocast, pad_id=cfg.pad_token_id)
        flops = model.flops_per_token(args.seq_len)
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or float("inf"))
    opt.step()
    opt.zero_grad(set_to_none=True)
    gnorm = gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm
    return loss.item(), gnorm.item(), lr, flops


def main(argv=None) -> None:
    args, cfg, world = flags.parse(argv, __doc__)
    job = plan_job(args, cfg, world)
    check_memory(args, job)
    d = parallel.init(args.cp, args.device)
    model, opt, tokens = build(args, cfg, d)
    start = checkpoint.load_latest(args.ckpt_dir, model, opt)
    stop = args.max_steps if args.stop_after is None else min(args.max_steps, start + args.stop_after)
    dtype = getattr(torch, job.dtype)
    autocast = torch.autocast(d.device.type, dtype=dtype, enabled=dtype != torch.float32)
    log = metrics.Logger(args, d.device, args.batch_size * args.seq_len / d.cp, start, lead=d.rank == 0)
    log.say(metrics.describe(args, cfg, d, model.num_params(), start))
    log.say(f"attention kernels: {metrics.kernel_choice(cfg, d.cp, args, d.device.type, dtype)}")
    log.say(f"fused kernels (--fused {args.fused}): {metrics.fused_choice(model)}")
    for step in range(start, stop):
        t0 = time.perf_counter()
        loss, gnorm, lr, flops = train_step(model, opt, tokens, step, args, cfg, d, autocast)
        if d.device.type == "cuda":
            torch.cuda.synchronize(d.device)
        log.step(step + 1, stop, loss, gnorm, lr, time.perf_counter() - t0, flops)
        if args.ckpt_dir and ((args.ckpt_every and (step + 1) % args.ckpt_every == 0) or step + 1 == stop):
            log.say(f"saved {checkpoint.save(args.ckpt_dir, step + 1, model, opt, keep=args.keep)}")
    log.close(stop)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
