"""Every CP_SOFTCAP_* environment variable, read and validated here and nowhere else.

Each function reads its variable at call time (so a test or a launcher may set it late) and
raises ValueError naming the variable, the value and what is valid. docs/settings.md lists them
in one table (tests/test_settings.py holds the two in step).

A warm call does not come here: plan_cache.py keys the plan caches on the raw strings of the variables
read per call (PLANNING: what a plan depends on; PER_CALL: what each call reads) and asks the
functions below only for a value it has not seen.
"""
from __future__ import annotations

import math
import os
from typing import Optional, Tuple

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_RING_BLOCK_KEYS = 32768     # measured best on H200 at 32K/128K, cp 4/8 (benchmarks/RESULTS.md)
SDPA_OPS: Tuple[str, ...] = ("cudnn", "flash", "efficient")


PLANNING = ("CP_SOFTCAP_BACKEND", "CP_SOFTCAP_FA3", "CP_SOFTCAP_RING_BLOCK_KEYS")
PER_CALL = ("CP_SOFTCAP_TIMEOUT", "CP_SOFTCAP_CHECK_EVERY_CALL")


def _raw(name: str) -> str:
    return os.environ.get(name, "")


def _bad(name: str, raw: str, valid: str) -> ValueError:
    return ValueError(f"{name}={raw!r} is not valid: expected {valid}; unset it for the default")


def _number(name: str, parse, ok, valid: str, default):
    raw = _raw(name)
    if not raw:
        return default
    try:
        value = parse(raw)
    except ValueError:
        raise _bad(name, raw, valid) from None
    if not ok(value):
        raise _bad(name, raw, valid)
    return value


def timeout_s() -> float:
    """CP_SOFTCAP_TIMEOUT: seconds a CP collective waits for a peer (default 120), where the
    wait blocks this thread: gloo, and results read on the host (transport.wait says why CUDA
    tensors over NCCL are bounded by the process group's timeout instead)."""
    return _number("CP_SOFTCAP_TIMEOUT", float, lambda x: math.isfinite(x) and x > 0,
                   "a finite number of seconds > 0", DEFAULT_TIMEOUT_S)


def ring_block_keys() -> int:
    """CP_SOFTCAP_RING_BLOCK_KEYS: keys a ring block aims for (default 32768; 0 = one ring step
    per block)."""
    return _number("CP_SOFTCAP_RING_BLOCK_KEYS", int, lambda x: x >= 0,
                   "an integer number of keys >= 0", DEFAULT_RING_BLOCK_KEYS)


def backend() -> Optional[str]:
    """CP_SOFTCAP_BACKEND: the kernel used where a call passes backend='auto' (None = let the
    selector choose). The selector checks that the name is a kernel."""
    raw = _raw("CP_SOFTCAP_BACKEND").strip()
    return None if raw in ("", "auto") else raw


def _flag(name: str, default: bool) -> bool:
    raw = _raw(name)
    if raw == "":
        return default
    if raw not in ("0", "1"):
        raise _bad(name, raw, "0 or 1")
    return raw == "1"


def fa3_enabled() -> bool:
    """CP_SOFTCAP_FA3=1: let the selector use FA3 (single device only; default 0)."""
    return _flag("CP_SOFTCAP_FA3", False)


def check_every_call() -> bool:
    """CP_SOFTCAP_CHECK_EVERY_CALL=1: compare the ranks' call signatures on every call, not only
    on the first call of each signature (default 0)."""
    return _flag("CP_SOFTCAP_CHECK_EVERY_CALL", False)


def fused_merge() -> bool:
    """CP_SOFTCAP_FUSED_MERGE=0: use the eager LSE merge even where the Triton one applies
    (default 1)."""
    return _flag("CP_SOFTCAP_FUSED_MERGE", True)


def sdpa_op() -> Optional[str]:
    """CP_SOFTCAP_SDPA_OP: the one CUDA SDPA op the sdpa kernel may use (default: the first of
    cudnn, flash, efficient that passes its self-test)."""
    raw = _raw("CP_SOFTCAP_SDPA_OP")
    if raw == "":
        return None
    if raw not in SDPA_OPS:
        raise _bad("CP_SOFTCAP_SDPA_OP", raw, f"one of {', '.join(SDPA_OPS)}")
    return raw
