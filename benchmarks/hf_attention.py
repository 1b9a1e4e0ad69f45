"""HF transformers' Gemma2 with attn_implementation="cp_softcap" next to HF's own attention
implementations, on one device: the whole model's forward + backward, tokens/s and peak memory,
and each implementation's float32 logits against eager's.

    python benchmarks/hf_attention.py              # GPU: Gemma2-2B shapes (random weights), bf16,
                                                   # 8192 tokens, batch 1
    python benchmarks/hf_attention.py --dry-run    # CPU: a tiny Gemma2, float32; checks the script

Implementations: cp_softcap (cp_softcap.integrations.hf, the kernel its selector picks), eager
(HF's reference: softcap and sliding window, [S, S] scores per layer), sdpa (SDPA has no softcap,
so transformers refuses it for Gemma2: it runs here with the attention softcap turned off, a
different model, recorded with softcap false and its logits' difference from eager's) and flash_attention_2
(needs flash-attn 2; it applies the softcap). One model
is built once, every implementation runs the same weights and tokens (set_attn_implementation).
Time: median of --steps timed steps after one warm-up step, each a forward with labels (HF's
loss) and a backward, gradients dropped between steps. Peak memory: torch.cuda.max_memory_allocated
over the steps (the weights and their gradients included). Logits: a no-grad forward, compared
in float32 with eager's (max and mean absolute difference over all positions and the vocab).
An implementation that runs out of memory or fails is recorded with its error, not dropped.
Writes benchmarks/results/hf_attention.json and .png (a dry run: $OUT or a new temporary folder).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from typing import Dict, List

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# run as a script, this folder comes first on sys.path, and its kernels.py would stand in for
# the `kernels` package transformers imports: the repository root instead
sys.path[:] = [os.path.dirname(HERE)] + [q for q in sys.path if os.path.abspath(q or ".") != HERE]
from benchmarks._util import OUT_DIR_HELP, bar_plot, out_dir_for, report  # noqa: E402

IMPLS = ("cp_softcap", "eager", "sdpa", "flash_attention_2")
APPLIES_SOFTCAP = {"cp_softcap": True, "eager": True, "sdpa": False, "flash_attention_2": True}


def gemma2_config(dry: bool):
    """Gemma2-2B's published shapes (or a tiny one for --dry-run)."""
    import transformers
    if dry:
        return transformers.Gemma2Config(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
            sliding_window=32, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    return transformers.Gemma2Config(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)


def missing(impl: str) -> str:
    """Why `impl` cannot run here ("" when it can)."""
    if impl == "flash_attention_2":
        from transformers.utils import is_flash_attn_2_available
        if not torch.cuda.is_available():
            return "flash_attention_2 needs a CUDA GPU"
        if not is_flash_attn_2_available():
            return "flash-attn 2 is not installed"
    return ""


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def train_steps(model, ids, steps: int) -> Dict:
    """Median seconds of forward (HF loss) + backward over `steps` steps after one warm-up."""
    times = []
    for i in range(steps + 1):
        model.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        sync()
        if i:
            times.append(time.perf_counter() - t0)
    if not torch.isfinite(loss):
        raise RuntimeError(f"the loss is {loss.item()}")
    return {"step_s": statistics.median(times), "loss": loss.item()}


@torch.no_grad()
def logits_f32(model, ids) -> torch.Tensor:
    return model(input_ids=ids).logits.float()


def run_impl(model, impl: str, ids, steps: int, ref_logits) -> Dict:
    rec = {"impl": impl, "softcap": APPLIES_SOFTCAP[impl]}
    why = missing(impl)
    if why:
        return {**rec, "skipped": why}
    try:
        model.set_attn_implementation(impl)
    except (ValueError, ImportError) as e:   # this transformers refuses it for Gemma2
        if impl != "sdpa":
            return {**rec, "skipped": f"transformers refuses it: {str(e).split('. ')[0]}"}
        # SDPA has no softcap: time it on the same model with the attention softcap off (a
        # different model, so its logits differ from eager's), set past the refusal, and say so
        model.config._attn_implementation = impl
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        rec["forced"] = ("transformers refuses sdpa for Gemma2 (no softcap); run with the attention "
                         "softcap off, set directly")
    try:
        logits = logits_f32(model, ids)
        if ref_logits is not None:
            diff = (logits - ref_logits).abs()
            rec.update(logits_max_abs_diff=diff.max().item(), logits_mean_abs_diff=diff.mean().item())
        del logits
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        rec.update(train_steps(model, ids, steps))
        rec["tokens_per_s"] = ids.numel() / rec["step_s"]
        if torch.cuda.is_available():
            rec["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    except torch.cuda.OutOfMemoryError as e:
        rec["error"] = f"out of memory: {str(e).splitlines()[0]}"
    except Exception as e:           # recorded, so one failing implementation keeps the others
        rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    model.zero_grad(set_to_none=True)
    for layer in model.model.layers:      # the softcap back on for the next implementation
        layer.self_attn.attn_logit_softcapping = model.config.attn_logit_softcapping
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rec


def plot(blob: Dict, png: str) -> None:
    ok = [r for r in blob["records"] if "tokens_per_s" in r]
    labels = [r["impl"] + ("" if r["softcap"] else " (no softcap)") for r in ok]
    series = {"tokens/s (k)": [r["tokens_per_s"] / 1e3 for r in ok]}
    if all("peak_gib" in r for r in ok):
        series["peak GiB"] = [r["peak_gib"] for r in ok]
    m = blob["meta"]
    bar_plot(png, labels, series, "k tokens/s | GiB",
             f"HF Gemma2 fwd+bwd, {m['seq_len']} tokens, {m['dtype']}, {m['device']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny Gemma2, float32: checks the script")
    p.add_argument("--seq-len", type=int,
                   help="tokens (default 8192 on a GPU of more than 100 GiB, else 4096; dry run 128)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per implementation (median)")
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--out-dir", help=OUT_DIR_HELP)
    p.add_argument("--tag", help="suffix of the output names")
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        p.error("needs a CUDA GPU (or --dry-run on CPU)")
    if args.steps < 1 or (args.seq_len is not None and args.seq_len < 2):
        p.error(f"--steps must be >= 1 and --seq-len >= 2 (got {args.steps}, {args.seq_len})")
    import transformers
    import cp_softcap.integrations.hf as cps_hf      # registers attn_implementation="cp_softcap"
    cps_hf.use_cp_group(None)
    dry = args.dry_run
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    seq = args.seq_len or (128 if dry else default_seq_len())
    cfg = gemma2_config(dry)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Gemma2ForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="eager",
                                                            dtype=dtype)
    ids = torch.randint(3, cfg.vocab_size, (1, seq), device=device)
    impls = ["eager"] + [i for i in args.impls if i != "eager"]   # eager first: the logits reference
    records: List[Dict] = []
    ref = None
    for impl in impls:
        if impl == "eager":
            model.set_attn_implementation("eager")
            try:
                ref = logits_f32(model, ids)
            except torch.cuda.OutOfMemoryError as e:
                records.append({"impl": "eager-logits", "error": f"out of memory: {str(e).splitlines()[0]}"})
        rec = run_impl(model, impl, ids, args.steps, ref)
        if impl in args.impls:
            records.append(rec)
        print({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in rec.items()}, flush=True)
    del ref
    meta = {"model": "Gemma2-2B shapes, random weights" if not dry else "tiny Gemma2 (dry run)",
            "seq_len": seq, "batch": 1, "dtype": str(dtype).replace("torch.", ""),
            "transformers": transformers.__version__, "steps": args.steps,
            "cp_softcap_kernel": _selected_kernel(cfg, device, dtype),
            "date": time.strftime("%Y-%m-%d"),
            "note": "sdpa: HF drops Gemma2's attention softcap (softcap false): a different model"}
    rows = [["impl", "softcap", "tokens/s", "step s", "peak GiB", "logits max|d| vs eager", "error"]]
    for r in records:
        rows.append([r["impl"], str(r.get("softcap", "")), f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else "-",
                     f"{r['step_s']:.3f}" if "step_s" in r else "-",
                     f"{r['peak_gib']:.1f}" if "peak_gib" in r else "-",
                     f"{r['logits_max_abs_diff']:.3g}" if "logits_max_abs_diff" in r else "-",
                     r.get("error") or r.get("skipped") or ""])
    report("hf_attention", records, meta, rows, out_dir_for(args.out_dir, dry), args.tag)
    return 0


def default_seq_len() -> int:
    """8192 tokens where the card holds them: HF's Gemma2 at 8K needs more than an 80 GB card
    (its float32 logits and their softcap alone take about 25 GB), so 4096 below 100 GiB."""
    return 8192 if torch.cuda.get_device_properties(0).total_memory > 100 * 2**30 else 4096


def _selected_kernel(cfg, device, dtype) -> str:
    """The kernel cp_softcap's selector picks for this model's full-attention layers."""
    import cp_softcap as cps
    spec = cps.make_spec(head_dim=cfg.head_dim, num_heads=cfg.num_attention_heads,
                         num_kv_heads=cfg.num_key_value_heads, dtype=dtype, device_type=device.type,
                         softcap=cfg.attn_logit_softcapping, causal=True, window=None,
                         scale=cfg.query_pre_attn_scalar ** -0.5)
    return cps.select(spec, "auto").name


if __name__ == "__main__":
    sys.exit(main())
