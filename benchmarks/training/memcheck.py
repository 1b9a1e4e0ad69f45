"""Measure what memory.py estimates: one training step's peak tensor memory per rank against the
plan, with train.py's flags (plus --vocab / --set FIELD=INT to change the config, and
--layers-ac to try a per-layer AC pattern such as full,none = every other layer).

    torchrun --nproc-per-node 2 -m benchmarks.training.memcheck --config tiny --seq-len 1024 --ac full
    python -m benchmarks.training.memcheck --loss-only      # chunked vs full-logits cross-entropy
    python -m benchmarks.training.memcheck --ac-timing --set hidden_size=256 --set intermediate_size=1024

The step measured is the second one (AdamW's state exists from the first); on CPU the peak comes
from torch.profiler's allocation records (measure.py), so it counts tensors only. With --out-dir
the result is written as memcheck[_TAG].json (benchmarks/_util.py's record format).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]      # the repository and its example

from gemma2.allocator import expandable_segments  # noqa: E402

expandable_segments()           # before torch is imported (allocator.py says why)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from gemma2 import flags, memory, parallel, train  # noqa: E402
from benchmarks.training.measure import peak_bytes, tensor_bytes  # noqa: E402


def _extra(argv):
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)   # --ac is train.py's
    p.add_argument("--vocab", type=int)
    p.add_argument("--set", action="append", default=[], metavar="FIELD=INT",
                   help="override an integer config field, e.g. --set hidden_size=256")
    p.add_argument("--layers-ac", help="comma-separated per-layer AC, repeated over the layers")
    p.add_argument("--loss-only", action="store_true")
    p.add_argument("--ac-timing", action="store_true", help="median step time of each AC choice")
    p.add_argument("--no-timing", action="store_true",
                   help="the peak only: skip the two timed steps after it (step_s is then None)")
    p.add_argument("--tokens", type=int, default=1024, help="--loss-only: tokens (hidden 256, vocab 256000)")
    p.add_argument("--out-dir", help="write memcheck[_TAG].json here (rank 0)")
    p.add_argument("--tag", default="", help="suffix of the output name")
    return p.parse_known_args(argv)


def step_peak(argv) -> dict:
    extra, rest = _extra(argv)
    args, cfg, world = flags.parse(rest, __doc__)
    if extra.vocab:
        cfg = dataclasses.replace(cfg, vocab_size=extra.vocab)
    cfg = dataclasses.replace(cfg, **{k: int(v) for k, v in (kv.split("=") for kv in extra.set)})
    job = dataclasses.replace(train.plan_job(args, cfg, world), cfg=cfg)
    d = parallel.init(args.cp, args.device)
    model, opt, tokens = train.build(args, cfg, d)
    if extra.layers_ac:
        pattern = extra.layers_ac.split(",")
        for i, layer in enumerate(model.model.layers):
            layer.ac = {"selective": "mlp"}.get(pattern[i % len(pattern)], pattern[i % len(pattern)])
    autocast = torch.autocast(d.device.type, enabled=job.dtype != "float32", dtype=getattr(torch, job.dtype))
    train.train_step(model, opt, tokens, 0, args, cfg, d, autocast)
    base = tensor_bytes(list(model.parameters()) + [t for s in opt.state.values() for t in s.values()])
    peak = peak_bytes(lambda: train.train_step(model, opt, tokens, 1, args, cfg, d, autocast), d.device, base)
    times = []
    for step in () if extra.no_timing else (2, 3):      # unprofiled, after the warm-up steps
        t0 = time.perf_counter()
        train.train_step(model, opt, tokens, step, args, cfg, d, autocast)
        times.append(time.perf_counter() - t0)
    worst = torch.tensor([peak], dtype=torch.float64, device=d.device)    # NCCL reduces on the GPU
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    est = memory.peak(job)
    dist.destroy_process_group()
    return {"flags": " ".join(rest), "layers_ac": extra.layers_ac, "vocab": cfg.vocab_size, "set": extra.set,
            "measured_mib": worst.item() / 2**20, "estimated_mib": est / 2**20,
            "estimate_over_measured": est / worst.item(), "step_s": min(times) if times else None}


def ac_timing(argv, rounds: int = 7) -> dict:
    """Step time of each AC choice, steps interleaved in one process (none, full, selective,
    every other layer full, then again) so that a busy machine slows them alike; the median."""
    import statistics
    extra, rest = _extra(argv)
    args, cfg, world = flags.parse(rest, __doc__)
    cfg = dataclasses.replace(cfg, **{k: int(v) for k, v in (kv.split("=") for kv in extra.set)})
    d = parallel.init(args.cp, args.device)
    runs = {}
    for name, pattern in (("none", ["none"]), ("full", ["full"]), ("selective", ["mlp"]),
                          ("every other layer", ["full", "none"])):
        model, opt, tokens = train.build(args, cfg, d)
        for i, layer in enumerate(model.model.layers):
            layer.ac = pattern[i % len(pattern)]
        runs[name] = (model, opt, tokens, [])
    dtype = getattr(torch, flags.compute_dtype(args))
    autocast = torch.autocast(d.device.type, dtype=dtype, enabled=dtype != torch.float32)
    for step in range(rounds + 1):
        for model, opt, tokens, times in runs.values():
            t0 = time.perf_counter()
            train.train_step(model, opt, tokens, step, args, cfg, d, autocast)
            if d.device.type == "cuda":
                torch.cuda.synchronize()
            if step:                                   # step 0 warms up
                times.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    return {name: statistics.median(r[3]) for name, r in runs.items()}


def loss_peak(tokens: int = 1024, hidden: int = 256, vocab: int = 256000) -> dict:
    """The loss alone at Gemma2's vocabulary: full float32 logits vs 256 MiB slices."""
    import torch.nn.functional as F
    from gemma2.loss import softcap_cross_entropy_sum

    h = torch.randn(tokens, hidden, requires_grad=True)
    w = (torch.randn(vocab, hidden) * 0.05).requires_grad_()
    lab = torch.randint(0, vocab, (tokens,))

    def full():
        F.cross_entropy((30 * torch.tanh(F.linear(h, w) / 30)).float(), lab, reduction="sum").backward()

    def chunked():
        softcap_cross_entropy_sum(h, w, lab, 30.0).backward()

    cpu, base = torch.device("cpu"), tensor_bytes([h, w])
    out = {"tokens": tokens, "hidden": hidden, "vocab": vocab}
    for name, fn in (("full", full), ("chunked", chunked)):
        h.grad = w.grad = None
        t0 = time.perf_counter()
        out[f"{name}_peak_mib"] = peak_bytes(fn, cpu, base) / 2**20
        out[f"{name}_s"] = time.perf_counter() - t0
    return out


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra, _ = _extra(argv)
    if extra.ac_timing:
        result = ac_timing(argv)
    else:
        result = loss_peak(extra.tokens) if extra.loss_only else step_peak(argv)
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps(result), flush=True)
        if extra.out_dir:
            from benchmarks._util import save
            kind = "ac_timing" if extra.ac_timing else "loss_only" if extra.loss_only else "step_peak"
            print("wrote", save("memcheck" + (f"_{extra.tag}" if extra.tag else ""), [result],
                                dict(kind=kind, argv=argv), extra.out_dir), flush=True)


if __name__ == "__main__":
    main()
