"""The Gemma2 example's training step under each --compile mode, side by side in one run: whole
decoder layers compiled with fullgraph=True ("blocks"), the pieces around attention ("pieces"),
and eager. Each mode is one `examples/gemma2/train.py` process (a fresh compiler cache state,
the same seed, data and flags); the figure per mode is the median over steps 2..N of the
per-step MFU, tokens/s and peak memory the example's --metrics lines record.

    python benchmarks/compile_modes.py                          # GPU: 2b at 8K, 20 steps
    python benchmarks/compile_modes.py --dry-run                # CPU: tiny, 3 steps (a check)

Writes compile_modes[_TAG].json and .png (median MFU per mode; tokens/s on CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks._util import OUT_DIR_HELP, bar_plot, out_dir_for, save, table  # noqa: E402

MODES = {"blocks": ["--compile"], "pieces": ["--compile", "pieces"], "eager": []}


def run_mode(mode: str, flags, steps: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        cmd = [sys.executable, os.path.join(ROOT, "examples", "gemma2", "train.py"), *flags,
               *MODES[mode], "--max-steps", str(steps), "--no-progress", "--metrics", metrics]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode != 0:
            return {"mode": mode, "error": (proc.stderr or proc.stdout)[-2000:], "cmd": cmd}
        recs = [json.loads(line) for line in open(metrics)]
    later = recs[1:] or recs                 # step 1 holds the compile
    med = lambda key: statistics.median(r[key] for r in later) if later[0].get(key) is not None else None  # noqa: E731
    return {"mode": mode, "steps": len(recs), "median_mfu": med("mfu"),
            "median_tokens_per_s": med("tokens_per_s_per_device"), "median_step_s": med("step_s"),
            "peak_gib": max(r["memory_gib"] for r in recs), "first_step_s": recs[0]["step_s"],
            "final_loss": recs[-1]["loss"], "cmd": cmd}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny config, 3 steps")
    p.add_argument("--config", default="2b")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--timeout", type=float, default=400.0, help="seconds per mode")
    p.add_argument("--tag", default=None)
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    args = p.parse_args(argv)
    if args.dry_run:
        args.config, args.seq_len, args.steps = "tiny", 64, 3
    flags = ["--config", args.config, "--seq-len", str(args.seq_len), "--batch-size", "1"]
    records = []
    for mode in args.modes:
        rec = run_mode(mode, flags, args.steps, args.timeout)
        records.append(rec)
        print(mode, "failed:\n" + rec["error"] if "error" in rec else "done", flush=True)
    ok = [r for r in records if "error" not in r]
    rows = [["mode", "median MFU", "tokens/s", "s/step", "peak GiB", "first step s", "final loss"]]
    for r in ok:
        mfu = "n/a" if r["median_mfu"] is None else f"{100 * r['median_mfu']:.1f} %"
        rows.append([r["mode"], mfu, f"{r['median_tokens_per_s']:,.0f}", f"{r['median_step_s']:.3f}",
                     f"{r['peak_gib']:.1f}", f"{r['first_step_s']:.1f}", f"{r['final_loss']:.4f}"])
    out = out_dir_for(args.out_dir, args.dry_run)
    name = "compile_modes" + (f"_{args.tag}" if args.tag else "")
    path = save(name, records, {"config": args.config, "seq_len": args.seq_len, "steps": args.steps,
                                "figure": "median over steps 2..N"}, out)
    if ok:
        gpu = ok[0]["median_mfu"] is not None
        key = "median_mfu" if gpu else "median_tokens_per_s"
        vals = [100 * r[key] if gpu else r[key] for r in ok]
        bar_plot(path[:-5] + ".png", [r["mode"] for r in ok], {args.config: vals},
                 "MFU %" if gpu else "tokens/s", f"train.py {args.config} at {args.seq_len}: --compile modes")
    print(table(rows))
    print(f"wrote {path}")
    return 0 if len(ok) == len(records) else 1


if __name__ == "__main__":
    sys.exit(main())
