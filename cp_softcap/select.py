"""`python -m cp_softcap.select ...`: print which kernel serves a spec and why every other one
was rejected. Example:
    python -m cp_softcap.select --softcap 50 --head-dim 256 --heads 16 --kv-heads 8 --cp 8 \
        --device cuda --dtype bf16 --window 4095 0 --causal
"""
from __future__ import annotations

import argparse
import sys

import torch

from .selector import select
from .spec import make_spec

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
           "fp64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float32": torch.float32, "float64": torch.float64}


def _window_side(text: str):
    return None if text.lower() in ("none", "-1", "inf") else int(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cp_softcap.select", description=__doc__.split("\n")[0])
    p.add_argument("--softcap", type=float, default=None, help="0 or absent = off")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--window", nargs=2, type=_window_side, metavar=("LEFT", "RIGHT"), default=None)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--comm", default="ring")
    p.add_argument("--no-backward", action="store_true", help="forward only (inference)")
    p.add_argument("--backend", default="auto", help="force a kernel, as backend= does")
    p.add_argument("--seq-len", type=int, default=None,
                   help="global sequence length: with --cp > 1, print comm='auto''s choice and its byte model")
    p.add_argument("--a2a-size", type=int, default=None,
                   help="with --seq-len: also model comm='a2a+p2p' with all-to-all groups of this size "
                        "(shown only; comm='auto' does not pick it)")
    a = p.parse_args(argv)
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
        from .cp.auto import describe_comm_choice
        try:
            print(describe_comm_choice(spec, a.seq_len, a2a_size=a.a2a_size,
                                       partial_bytes=sel.kernel.partial_dtype(spec.dtype).itemsize))
        except (ValueError, ZeroDivisionError) as e:
            print(f"error: cannot model comm for --seq-len {a.seq_len}: {e}", file=sys.stderr)
            return 2
    return 0


class _CallableModule(type(sys)):
    """Importing this CLI module (`import cp_softcap.select`, the console script) makes Python
    rebind the package attribute `cp_softcap.select` from the selector function to this module.
    Delegating calls keeps `cps.select(spec, backend)` working after that import."""

    def __call__(self, *args, **kwargs):
        return select(*args, **kwargs)


if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__].__class__ = _CallableModule
