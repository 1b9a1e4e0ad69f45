"""Train Gemma2 with context parallelism (cp_softcap.CPAttention): dp x cp ranks.

    torchrun --nproc-per-node 8 examples/gemma2/train.py                  # tiny model, cp=8, CPU ok
    torchrun --nproc-per-node 8 examples/gemma2/train.py --cp 4 --seq-len 8192 --config 2b
    torchrun ... train.py --model-dir /path/gemma-2-2b --data my.txt --ckpt-dir runs/ckpt

NCCL on GPUs (one per local rank), gloo on CPU otherwise. bf16 autocast on GPU, fp32 on CPU.
Checkpoints (--ckpt-dir) resume automatically from the newest complete `step-N` folder.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time

import torch
import torch.distributed as dist

if __package__ in (None, ""):   # run as a script: make `gemma2` importable from examples/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gemma2 import checkpoint, parallel  # noqa: E402
from gemma2.config import CONFIGS, from_hf_json, get_config  # noqa: E402
from gemma2.data import ByteTokenizer, get_batch, load_tokens  # noqa: E402
from gemma2.model import Gemma2, load_hf_weights  # noqa: E402

PEAK_FLOPS = 989e12   # H100/H200 dense bf16, for MFU


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--config", default="tiny", choices=sorted(CONFIGS), help="model shape (ignored with --model-dir)")
    a("--model-dir", help="local HF Gemma2 checkpoint dir (config.json, *.safetensors, tokenizer)")
    a("--data", help="UTF-8 text file or .pt 1-D token tensor (default: stdlib pydoc_data.topics)")
    a("--cp", type=int, help="context-parallel size (default: all ranks; dp = world / cp)")
    a("--comm", default="ring", choices=parallel.COMMS,
      help="CP algorithm: ring (zigzag ring), all_gather, a2a (Ulysses: query heads %% cp == 0), "
      "a2a+p2p (a2a in groups of --a2a-size, ring across them), auto (fewest bytes per rank)")
    a("--a2a-size", type=int, help="all-to-all group size for --comm a2a+p2p (divides cp and the heads)")
    a("--backend", default="auto", help="attention kernel (auto = cp_softcap's selector)")
    a("--device", default="auto", choices=("auto", "cpu", "cuda"))
    a("--fsdp", action="store_true", help="shard parameters, grads and optimizer state over all ranks "
      "(FSDP2); needed for 9b/27b. Default: a full replica per rank, gradients all-reduced")
    a("--seq-len", type=int, default=256, help="global sequence length (a multiple of 2*cp)")
    a("--batch-size", type=int, default=8, help="sequences per dp rank per step")
    a("--max-steps", type=int, default=50, help="total optimizer steps (sets the LR schedule)")
    a("--stop-after", type=int, help="stop after this many steps in this run (e.g. a job time limit)")
    a("--lr", type=float, default=3e-3)
    a("--min-lr-ratio", type=float, default=0.1, help="cosine decays to lr * this")
    a("--warmup", type=int, default=5, help="linear warmup steps")
    a("--weight-decay", type=float, default=0.1)
    a("--grad-clip", type=float, default=1.0, help="max global grad norm (0 = off)")
    a("--seed", type=int, default=0, help="model init seed (all ranks); data seeds add the dp rank")
    a("--ckpt-dir", help="checkpoint folder; resumes from its newest complete step-N")
    a("--ckpt-every", type=int, default=0, help="save every N steps (0 = only at the end)")
    a("--keep", type=int, default=2, help="complete checkpoints to keep (0 = all)")
    a("--metrics", help="append one JSON line per step here (rank 0)")
    a("--log-every", type=int, default=1)
    a("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    for name, low in (("seq_len", 1), ("batch_size", 1), ("max_steps", 1), ("stop_after", 1),
                      ("warmup", 0), ("ckpt_every", 0), ("keep", 0), ("log_every", 1)):
        value = getattr(args, name)
        if value is not None and value < low:
            p.error(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
    return args


def lr_at(step: int, args) -> float:
    """Linear warmup to --lr over --warmup steps, then cosine down to lr * min_lr_ratio."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.max_steps - args.warmup)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6   # KiB -> GB (Linux)


def build(args, d: parallel.Dist):
    """Model (same init on every rank), optimizer, token stream."""
    cfg = from_hf_json(args.model_dir) if args.model_dir else get_config(args.config)
    if not args.model_dir and cfg.vocab_size < ByteTokenizer.vocab_size:
        raise ValueError(f"config {args.config} has vocab {cfg.vocab_size} < 259 byte tokens")
    try:                 # the same verdict on every rank, before any collective
        parallel.check_comm(args.comm, d.cp, cfg.num_attention_heads, args.a2a_size)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    group = parallel.attention_group(d, args.comm, cfg.num_attention_heads, args.a2a_size)
    if args.fsdp:        # build on the meta device, shard, then materialise only this rank's shards
        with torch.device("meta"):
            model = Gemma2(cfg, group, comm=args.comm, backend=args.backend)
        parallel.shard_model(model, d)
        model.to_empty(device=d.device)
    else:
        model = Gemma2(cfg, group, comm=args.comm, backend=args.backend)
    model.reset_parameters(args.seed)
    if args.model_dir:
        load_hf_weights(model, args.model_dir)
    model.to(d.device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    tokens = load_tokens(args.data, args.model_dir)
    if int(tokens.max()) >= cfg.vocab_size:
        raise ValueError(f"token id {int(tokens.max())} >= vocab size {cfg.vocab_size}; the tokenizer "
                         "does not match the model config")
    return cfg, model, opt, tokens


def kernel_choice(cfg, d: parallel.Dist, args, dtype: torch.dtype) -> str:
    """The kernel cp_softcap's selector picks for the sliding and the full layers (raises, naming
    every kernel's reason, when none can serve them), and what --comm auto picks for each."""
    from cp_softcap import make_spec, select
    from cp_softcap.cp.auto import choose_comm
    picks = []
    for kind, window in (("sliding", (cfg.sliding_window - 1, 0)), ("full", None)):
        spec = make_spec(head_dim=cfg.head_dim, num_heads=cfg.num_attention_heads,
                         num_kv_heads=cfg.num_key_value_heads, dtype=dtype, device_type=d.device.type,
                         softcap=cfg.attn_logit_softcapping, causal=True, window=window, scale=cfg.scale,
                         cp_size=d.cp, comm=args.comm)
        auto = (f" (comm auto: {choose_comm(spec, args.seq_len, args.batch_size)})"
                if args.comm == "auto" and d.cp > 1 else "")
        picks.append(f"{kind} layers -> {select(spec, args.backend).name}{auto}")
    return ", ".join(picks)


def main(argv=None) -> None:
    args = parse_args(argv)
    d = parallel.init(args.cp, args.device)
    if args.seq_len % (2 * d.cp):
        good = (args.seq_len // (2 * d.cp) + 1) * 2 * d.cp
        raise SystemExit(f"--seq-len {args.seq_len} must be a multiple of 2*cp = {2 * d.cp} (zigzag: "
                         f"2 chunks per CP rank); use --seq-len {good}, or a different --cp")
    cfg, model, opt, tokens = build(args, d)
    start = checkpoint.load_latest(args.ckpt_dir, model, opt)
    lead = d.rank == 0
    if lead:
        print(f"gemma2 {args.model_dir or args.config}: {model.num_params() / 1e6:.2f}M params, "
              f"world {d.world} = dp {d.dp} x cp {d.cp} on {d.device.type}/{d.backend}, "
              f"seq {args.seq_len} ({args.seq_len // d.cp} per rank), batch {args.batch_size} per dp rank, "
              f"comm {args.comm}" + (f" (a2a groups of {args.a2a_size})" if args.a2a_size else "") +
              (", FSDP2" if args.fsdp else "") +
              (f", resumed from step {start}" if start else ""), flush=True)
        dtype = torch.bfloat16 if d.device.type == "cuda" else torch.float32
        print(f"attention kernels: {kernel_choice(cfg, d, args, dtype)} "
              "(python -m cp_softcap.select explains the choice)", flush=True)
    stop = args.max_steps if args.stop_after is None else min(args.max_steps, start + args.stop_after)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if d.device.type == "cuda"
                else torch.autocast("cpu", enabled=False))
    flops_tok = model.flops_per_token(args.seq_len)
    tok_per_dev = args.batch_size * args.seq_len * d.dp / d.world
    bar = None
    if lead and not args.no_progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=args.max_steps, initial=start, desc="train", dynamic_ncols=True, file=sys.stdout)
        except ImportError:
            pass
    say = bar.write if bar is not None else (lambda s: print(s, flush=True))
    metrics = open(args.metrics, "a") if (lead and args.metrics) else None
    t_run = time.perf_counter()
    first = last = None
    for step in range(start, stop):
        t0 = time.perf_counter()
        lr = lr_at(step, args)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = get_batch(tokens, step=step, dp_rank=d.dp_rank, batch_size=args.batch_size,
                          seq_len=args.seq_len, seed=args.seed, bos_id=cfg.bos_token_id)
        loss = parallel.loss_and_grads(model, batch, d, autocast, pad_id=cfg.pad_token_id)
        max_norm = args.grad_clip if args.grad_clip > 0 else float("inf")
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        gnorm = gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm
        loss_v, gnorm_v = loss.item(), gnorm.item()
        if d.device.type == "cuda":
            torch.cuda.synchronize(d.device)
        dt = time.perf_counter() - t0
        first = loss_v if first is None else first
        last = loss_v
        done = step + 1
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss_v:.3f}")
        if lead:
            tps = tok_per_dev / dt
            rec = {"step": done, "loss": loss_v, "grad_norm": gnorm_v, "lr": lr, "tokens_per_s_per_device": tps,
                   "tflops": tps * flops_tok / 1e12, "mfu": tps * flops_tok / PEAK_FLOPS,
                   "memory_gb": memory_gb(d.device), "step_s": dt}
            if metrics:
                metrics.write(json.dumps(rec) + "\n")
                metrics.flush()
            if done % args.log_every == 0 or done == stop:
                mfu = f"MFU {100 * rec['mfu']:.2f}%" if d.device.type == "cuda" else "MFU n/a on CPU"
                say(f"step {done:5d}/{args.max_steps} | loss {loss_v:.4f} | grad {gnorm_v:.3f} | lr {lr:.2e} | "
                    f"{tps:,.0f} tok/s/dev | {rec['tflops']:.4f} TFLOP/s | {mfu} | mem {rec['memory_gb']:.2f} GB")
        if args.ckpt_dir and ((args.ckpt_every and done % args.ckpt_every == 0) or done == stop):
            path = checkpoint.save(args.ckpt_dir, done, model, opt, keep=args.keep)
            if lead:
                say(f"saved {path}")
    if bar is not None:
        bar.close()
    if lead:
        if first is None:
            print(f"nothing to do: already at step {start} >= --max-steps {args.max_steps} "
                  f"(raise --max-steps or use a new --ckpt-dir)", flush=True)
        else:
            print(f"done: steps {start + 1}-{stop}, loss {first:.4f} -> {last:.4f}, "
                  f"{time.perf_counter() - t_run:.1f} s", flush=True)
    if metrics:
        metrics.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
