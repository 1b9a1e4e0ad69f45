"""`python -m cp_softcap ...` (console script `cp-softcap-select`): print which kernel serves a
spec and why every other one was rejected. Example:
    python -m cp_softcap --softcap 50 --head-dim 256 --heads 16 --kv-heads 8 --cp 8 \
        --device cuda --dtype bf16 --window 4095 0 --causal
"""
from __future__ import annotations

import argparse
import sys

import torch

from .heads import heads_divide
from .selector import select
from .spec import COMM_TYPES, make_spec

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
           "fp64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float32": torch.float32, "float64": torch.float64}


def _window_side(text: str):
    return None if text.lower() in ("none", "-1", "inf") else int(text)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cp_softcap", description=("Print which kernel serves an attention call and why every other kernel "
                                             "was rejected (on this machine)."),
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--softcap", type=float, default=None, help="tanh cap; 0 or absent = off")
    p.add_argument("--head-dim", type=int, default=128, help="head dim of q/k and v")
    p.add_argument("--heads", type=int, default=16, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (None: --heads)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="input dtype")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                   help="device type (cuda where CUDA is available)")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True,
                   help="causal attention, as the library's default")
    p.add_argument("--window", nargs=2, type=_window_side, metavar=("LEFT", "RIGHT"), default=None,
                   help="sliding window sides ('none' = unbounded)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size")
    p.add_argument("--comm", choices=COMM_TYPES, default="ring", help="CP algorithm, as comm= does")
    p.add_argument("--no-backward", action="store_true", help="forward only (inference)")
    p.add_argument("--backend", default="auto", help="force a kernel, as backend= does")
    p.add_argument("--seq-len", type=int, default=None,
                   help="global sequence length: with --cp > 1, print comm='auto''s choice and its byte model")
    p.add_argument("--a2a-size", type=int, default=None,
                   help="with --seq-len: also model comm='a2a+p2p' with all-to-all groups of this size "
                        "(shown only; comm='auto' does not pick it)")
    return p


def _usage_problems(a) -> list:
    """What the parser's types cannot see: counts below 1, options that would be ignored, and
    all-to-all head splits that cannot work."""
    problems = []
    if a.heads < 1 or (a.kv_heads is not None and a.kv_heads < 1):
        problems.append(f"--heads {a.heads} / --kv-heads {a.kv_heads}: every head count must be >= 1")
    if a.a2a_size is not None and not a.seq_len:
        problems.append("--a2a-size only models comm='a2a+p2p' bytes, which needs --seq-len")
    if a.comm == "a2a+p2p" and a.a2a_size is None:
        problems.append("--comm a2a+p2p needs --a2a-size (the all-to-all group size)")
    inner = a.cp if a.comm == "a2a" else a.a2a_size if a.comm == "a2a+p2p" else None
    if inner and a.heads >= 1 and not heads_divide(a.heads, inner):
        problems.append(f"--comm {a.comm}: {a.heads} query heads cannot be split over an all-to-all "
                        f"group of {inner}; use --comm ring or all_gather, or a group size dividing "
                        f"{a.heads}")
    return problems


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    problems = _usage_problems(a)
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        return 2
    try:
        spec = make_spec(head_dim=a.head_dim, num_heads=a.heads, num_kv_heads=a.kv_heads or a.heads,
                         dtype=_DTYPES[a.dtype], device_type=a.device, softcap=a.softcap,
                         causal=a.causal, window=tuple(a.window) if a.window else None,
                         needs_backward=not a.no_backward, cp_size=a.cp, comm=a.comm)
        sel = select(spec, a.backend)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"spec: {spec.describe()}")
    print(sel.table())
    if a.cp > 1 and a.seq_len:
        from .comm_model import describe_comm_choice
        try:
            print(describe_comm_choice(spec, a.seq_len, a2a_size=a.a2a_size,
                                       partial_bytes=sel.kernel.partial_dtype(spec.dtype).itemsize))
        except (ValueError, ZeroDivisionError) as e:
            print(f"error: cannot model comm for --seq-len {a.seq_len}: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
