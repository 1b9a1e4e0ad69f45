"""The LM head's loss alone at Gemma2's shapes: the chunked softcapped cross-entropy of
examples/gemma2/loss.py at several slice sizes (on a GPU also with compiled=True, its slices'
elementwise work fused by inductor), next to Liger's fused linear cross-entropy and the plain
PyTorch path with all logits at once.

    python benchmarks/lm_loss.py                 # GPU: 2b's head (2304 x 256,000), 8K tokens
    python benchmarks/lm_loss.py --dry-run       # CPU, tiny shapes (a check of the script)

What train.py runs: forward and backward of the float32 loss sum under bf16 autocast, hidden
states and the tied embedding in float32, final softcap 30, every 50th label ignored. Per
variant: the median ms (`bench_ms`), the peak memory above the inputs, and the relative error
of the loss, dh and dW against the same loss computed in float32 without autocast (so bf16
rounding, not a bug, is what the error shows; the float64 exactness is the tests' job). Liger's
row runs only where liger_kernel imports (GPU). Writes lm_loss[_tag].json and .png.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Dict, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from benchmarks._util import OUT_DIR_HELP, bar_plot, bench_ms, device_name, out_dir_for, report  # noqa: E402
from gemma2 import fused, loss  # noqa: E402

CAP = 30.0


def inputs(tokens: int, hidden: int, vocab: int, device: str, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g).to(device)
    w = (torch.randn(vocab, hidden, generator=g) * hidden ** -0.5).to(device)
    lab = torch.randint(0, vocab, (tokens,), generator=g)
    lab[::50] = loss.IGNORE
    return h.requires_grad_(), w.requires_grad_(), lab.to(device)


def step(fn, h, w, lab, chunk: Optional[int], autocast: bool):
    """One forward+backward of fn's loss sum; returns (loss, dh, dW), grads reset first."""
    h.grad = w.grad = None
    with torch.autocast(h.device.type, dtype=torch.bfloat16, enabled=autocast):
        out = fn(h, w, lab, CAP, chunk)
    out.backward()
    return out.detach(), h.grad, w.grad


def full_logits(h, w, lab, cap, chunk):
    """The plain PyTorch path the sliced losses replace: all [tokens, vocab] logits at once."""
    z = torch.nn.functional.linear(h, w).float()
    z = cap * torch.tanh(z / cap)
    return torch.nn.functional.cross_entropy(z, lab, ignore_index=loss.IGNORE, reduction="sum")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def measure(fn, h, w, lab, chunk, ref, rep_ms: int) -> Dict:
    """ms, peak GiB above the inputs (CUDA only) and the errors against ref of one variant."""
    got = step(fn, h, w, lab, chunk, autocast=True)
    errs = [rel(x, r) for x, r in zip(got, ref)]
    del got
    ms = bench_ms(lambda: step(fn, h, w, lab, chunk, autocast=True), rep_ms=rep_ms)
    peak = None
    if h.is_cuda:
        h.grad = w.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(fn, h, w, lab, chunk, autocast=True)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
    return dict(ms=ms, peak_gib=peak, loss_rel=errs[0], dh_rel=errs[1], dw_rel=errs[2])


def plot(blob: Dict, png: str) -> None:
    recs = [r for r in blob["records"] if "ms" in r]
    labels = [r["variant"] for r in recs]
    bar_plot(png, labels, {"fwd+bwd ms": [r["ms"] for r in recs]}, "ms per loss fwd+bwd",
             f"LM-head loss, {blob['meta']['tokens']} tokens x {blob['meta']['vocab']} vocab\n"
             f"{blob['meta']['device']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=2304)
    p.add_argument("--vocab", type=int, default=256000)
    p.add_argument("--chunks", type=int, nargs="+", default=None,
                   help="tokens per slice of our loss (default: its default, then 2x, 4x, 8x)")
    p.add_argument("--rep-ms", type=int, default=500)
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    p.add_argument("--tag", default="")
    p.add_argument("--dry-run", action="store_true", help="CPU, 256 tokens, vocab 4,000, hidden 64, slices of 64-512 tokens")
    a = p.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() and not a.dry_run else "cpu"
    if a.dry_run:
        a.tokens, a.hidden, a.vocab, a.rep_ms = 256, 64, 4000, 20
    a.out_dir = out_dir_for(a.out_dir, dry=a.dry_run)
    default = 64 if a.dry_run else loss.default_chunk(a.vocab)      # a dry run: several slices
    chunks = a.chunks or [default * m for m in (1, 2, 4, 8)]
    h, w, lab = inputs(a.tokens, a.hidden, a.vocab, dev)
    ref = step(loss.softcap_cross_entropy_sum, h, w, lab, default, autocast=False)   # float32
    variants = [(f"ours, {c} tokens/slice" + (" (default)" if c == default else ""),
                 loss.softcap_cross_entropy_sum, c) for c in chunks]
    if dev == "cuda":       # the slices' elementwise work fused by inductor (compiled=True)
        variants += [(f"ours compiled, {c} tokens/slice", functools.partial(
            loss.softcap_cross_entropy_sum, compiled=True), c) for c in (chunks[0], chunks[-1])]
        if fused.liger_problem() is None:
            variants.append(("Liger (default slices)", fused.softcap_cross_entropy_sum, None))
    variants.append(("PyTorch, full logits", full_logits, None))
    records, rows = [], [["variant", "ms", "peak GiB", "loss rel", "dh rel", "dW rel"]]
    for name, fn, chunk in variants:
        try:
            rec = measure(fn, h, w, lab, chunk, ref, a.rep_ms)
        except torch.OutOfMemoryError as e:          # a variant that does not fit is a result too
            h.grad = w.grad = None
            torch.cuda.empty_cache()
            records.append(dict(variant=name, chunk=chunk, error=str(e).split(". ")[0]))
            rows.append([name, "out of memory", "-", "-", "-", "-"])
            continue
        records.append(dict(variant=name, chunk=chunk, **rec))
        rows.append([name, f"{rec['ms']:.1f}", "-" if rec["peak_gib"] is None else f"{rec['peak_gib']:.2f}",
                     *(f"{rec[k]:.1e}" for k in ("loss_rel", "dh_rel", "dw_rel"))])
    meta = dict(tokens=a.tokens, hidden=a.hidden, vocab=a.vocab, softcap=CAP, dtype="bfloat16 autocast",
                device=device_name() if dev == "cuda" else "cpu", torch=torch.__version__,
                reference="the same loss in float32, no autocast")
    report("lm_loss", records, meta, rows, a.out_dir, a.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
