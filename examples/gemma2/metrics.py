"""Rank 0's view of training, as torchtitan logs it: loss, grad norm, lr, tokens/s per device,
TFLOP/s, MFU (GPU only: null in the JSON on CPU), peak memory; a progress bar; one JSON line per
step (--metrics). TFLOP/s and MFU count model FLOPs (flops.py: causal attention pairs, sliding
windows and documents, the tied LM head once, no recomputation) over PEAK_FLOPS."""
from __future__ import annotations

import json
import resource
import sys
import time
from typing import Optional

import torch

PEAK_FLOPS = 989e12   # H100/H200 dense bf16, for MFU


def peak_memory_gib(device: torch.device) -> float:
    """GPU: the allocator's peak; CPU: the process's peak resident set (all of it, not just tensors)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20   # KiB (Linux)


def alloc_retries(device: torch.device) -> Optional[int]:
    """GPU: how often the caching allocator has had to free its cache and retry a cudaMalloc
    (each retry synchronises the device: a step near the memory limit slows down for it)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


class Logger:
    def __init__(self, args, device: torch.device, tokens_per_device: float, start: int, lead: bool):
        self.args, self.device, self.lead, self.start = args, device, lead, start
        self.tok = tokens_per_device
        self.first = self.last = None
        self.t_run = time.perf_counter()
        self.file = open(args.metrics, "a") if (lead and args.metrics) else None
        self.bar = None
        if lead and not args.no_progress:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=args.max_steps, initial=start, desc="train", dynamic_ncols=True,
                                file=sys.stdout)
            except ImportError:
                pass

    def say(self, text: str) -> None:
        if self.lead:
            (self.bar.write if self.bar is not None else lambda s: print(s, flush=True))(text)

    def step(self, done: int, stop: int, loss: float, gnorm: float, lr: float, seconds: float,
             flops_per_token: float) -> None:
        """One step's line; flops_per_token: the step's model FLOPs per token (flops.py)."""
        self.first = loss if self.first is None else self.first
        self.last = loss
        if not self.lead:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}")
        tps = self.tok / seconds
        gpu = self.device.type == "cuda"
        rec = {"step": done, "loss": loss, "grad_norm": gnorm, "lr": lr, "tokens_per_s_per_device": tps,
               "tflops": tps * flops_per_token / 1e12, "mfu": tps * flops_per_token / PEAK_FLOPS if gpu else None,
               "memory_gib": peak_memory_gib(self.device), "alloc_retries": alloc_retries(self.device),
               "step_s": seconds}
        if self.file:
            self.file.write(json.dumps(rec) + "\n")
            self.file.flush()
        if done % self.args.log_every == 0 or done == stop:
            mfu = f"MFU {100 * rec['mfu']:.2f}%" if gpu else "MFU n/a on CPU"
            self.say(f"step {done:5d}/{self.args.max_steps} | loss {loss:.4f} | grad {gnorm:.3f} | "
                     f"lr {lr:.2e} | {tps:,.0f} tok/s/dev | {rec['tflops']:.4f} TFLOP/s | {mfu} | "
                     f"mem {rec['memory_gib']:.2f} GiB"
                     + (f" | alloc retries {rec['alloc_retries']}" if rec["alloc_retries"] else ""))

    def close(self, stop: int) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file:
            self.file.close()
        if not self.lead:
            return
        if self.first is None:
            print(f"nothing to do: already at step {self.start} >= --max-steps {self.args.max_steps} "
                  "(raise --max-steps or use a new --ckpt-dir)", flush=True)
        else:
            print(f"done: steps {self.start + 1}-{stop}, loss {self.first:.4f} -> {self.last:.4f}, "
                  f"{time.perf_counter() - self.t_run:.1f} s", flush=True)


def describe(args, cfg, d, n_params: int, start: int) -> str:
    """The run's one-line summary printed before the first step."""
    return (f"gemma2 {args.model_dir or args.config}: {n_params / 1e6:.2f}M params, world {d.world} = "
            f"dp {d.dp} x cp {d.cp} on {d.device.type}, seq {args.seq_len} ({args.seq_len // d.cp} per "
            f"rank), batch {args.batch_size} per dp rank, comm {args.comm}"
            + (f" (a2a groups of {args.a2a_size})" if args.a2a_size else "")
            + (", FSDP2" if args.fsdp else "") + (f", ac {args.ac}" if args.ac != "none" else "")
            + (f", compiled ({args.compile})" if args.compile else "") + (f", resumed from step {start}" if start else ""))


def layer_specs(cfg, cp: int, args, device_type: str, dtype: torch.dtype) -> list:
    """[(kind, AttnSpec)] of the sliding-window and the full attention layers of this run."""
    import cp_softcap as cps
    return [(kind, cps.make_spec(head_dim=cfg.head_dim, num_heads=cfg.num_attention_heads,
                                 num_kv_heads=cfg.num_key_value_heads, dtype=dtype,
                                 device_type=device_type, softcap=cfg.attn_logit_softcapping,
                                 causal=True, window=window, scale=cfg.scale, cp_size=cp,
                                 comm=args.comm, documents=args.pack))
            for kind, window in (("sliding", (cfg.sliding_window - 1, 0)), ("full", None))]


def kernel_choice(cfg, cp: int, args, device_type: str, dtype: torch.dtype) -> Optional[str]:
    """The kernel cp_softcap's selector picks for the sliding and the full layers (raises, naming
    every kernel's reason, when none can serve them)."""
    import cp_softcap as cps
    return ", ".join(f"{kind} layers -> {cps.select(spec, args.backend).name}"
                     for kind, spec in layer_specs(cfg, cp, args, device_type, dtype))


def fused_choice(model) -> str:
    """Which pieces outside attention run on Liger's kernels (fused.py), e.g. "liger: rms_norm,
    geglu, rope, loss" or "none (pure PyTorch)"."""
    from .model import MLP, Attention, RMSNorm
    on = {"rms_norm": RMSNorm, "geglu": MLP, "rope": Attention}
    pieces = [name for name, cls in on.items()
              if any(isinstance(m, cls) and m.liger for m in model.modules())]
    pieces += ["loss"] if model.liger_loss else []
    return f"liger: {', '.join(pieces)}" if pieces else "none (pure PyTorch)"
