"""The one backend selector, shared by the single-device and CP paths.

`RULES` is the single table. Each row names the kernels it applies to ("*" = all), a test on
(spec, kernel) that, when true, makes the kernel ineligible, and the reason shown to the user.
A kernel is eligible only if no row rejects it and its probe passes (fail closed). Among the
eligible, the first in `PREFERENCE[device]` wins.

Preference (fastest verified first; figures measured on an H200, benchmarks/RESULTS.md):
  cuda: fa3 (opt-in only) > sdpa (no softcap: cuDNN 584-639 TFLOP/s fwd) > fa4 (softcap 50:
        ~457 fwd / ~366 fwd+bwd) > fa2 > flex (softcap: ~160-175 fwd / ~115 fwd+bwd) > torch
  cpu:  sdpa (no softcap; fused C++) > torch (everything else)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple, Union

from . import settings
from .kernels import KERNEL_NAMES, get_kernel
from .kernels.base import Kernel
from .spec import AttnSpec

PREFERENCE: Dict[str, Tuple[str, ...]] = {
    "cuda": ("fa3", "sdpa", "fa4", "fa2", "flex", "torch"),
    "cpu": ("sdpa", "torch", "flex"),
}


@dataclass(frozen=True)
class Rule:
    kernels: Tuple[str, ...]   # ("*",) = every kernel
    rejects: Callable[[AttnSpec, Kernel], bool]
    reason: Callable[[AttnSpec, Kernel], str]


def _dt(spec: AttnSpec) -> str:
    return str(spec.dtype).replace("torch.", "")


RULES: Tuple[Rule, ...] = (
    Rule(("*",), lambda s, k: s.device_type not in k.caps.devices,
         lambda s, k: f"does not run on {s.device_type} (runs on {sorted(k.caps.devices)})"),
    Rule(("*",), lambda s, k: s.needs_backward and s.device_type not in k.caps.backward_devices,
         lambda s, k: f"has no backward on {s.device_type}"),
    Rule(("*",), lambda s, k: s.dtype not in k.caps.dtypes,
         lambda s, k: f"does not support dtype {_dt(s)}"),
    Rule(("*",), lambda s, k: s.softcap is not None and not k.caps.softcap,
         lambda s, k: f"cannot apply softcap={s.softcap} (it would be silently dropped)"),
    Rule(("*",), lambda s, k: s.has_window and not k.caps.window,
         lambda s, k: f"cannot apply window={s.window}"),
    Rule(("*",), lambda s, k: s.gqa and not k.caps.gqa,
         lambda s, k: f"cannot serve GQA ({s.num_heads} query / {s.num_kv_heads} kv heads)"),
    Rule(("*",), lambda s, k: max(s.head_dim, s.head_dim_v) > k.caps.max_head_dim,
         lambda s, k: f"head dim {max(s.head_dim, s.head_dim_v)} > its maximum {k.caps.max_head_dim}"),
    Rule(("*",), lambda s, k: s.head_dim % k.caps.head_dim_multiple != 0
         or s.head_dim_v % k.caps.head_dim_multiple != 0,
         lambda s, k: f"head dim {s.head_dim} is not a multiple of {k.caps.head_dim_multiple}"),
    # before the generic CP row, so that FA3 under CP is refused with its reason
    Rule(("fa3",), lambda s, k: s.cp_size > 1,
         lambda s, k: f"not under context parallelism (cp={s.cp_size}): FA3's context-parallel "
                      "path cannot carry the softcap"),
    Rule(("*",), lambda s, k: s.cp_size > 1 and not k.caps.cp,
         lambda s, k: f"excluded under context parallelism (cp={s.cp_size})"),
    # packed documents: before the generic row, so that sdpa is refused with its own reason
    Rule(("sdpa",), lambda s, k: s.documents,
         lambda s, k: "cannot separate packed documents: PyTorch SDPA has no variable-length "
                      "path that returns the LSE"),
    Rule(("*",), lambda s, k: s.documents and not k.caps.segments,
         lambda s, k: "cannot separate packed documents (no segments= support)"),
    Rule(("*",), lambda s, k: s.return_lse and s.needs_backward and not k.caps.dlse,
         lambda s, k: "cannot back-propagate through the returned LSE (no dLSE input)"),
    Rule(("*",), lambda s, k: s.deterministic and s.needs_backward and not k.caps.deterministic_backward,
         lambda s, k: "has no deterministic backward and torch.use_deterministic_algorithms is on"),
    Rule(("fa3",), lambda s, k: not settings.fa3_enabled(),
         lambda s, k: "opt-in only: set CP_SOFTCAP_FA3=1 (single device, never under CP)"),
)


@dataclass(frozen=True)
class Selection:
    kernel: Kernel
    name: str
    rejected: Dict[str, str]          # kernel name -> reason, for every kernel not chosen
    forced: bool = False

    def table(self) -> str:
        lines = [f"{'kernel':<7} {'status':<9} reason"]
        extra = () if self.name in KERNEL_NAMES else (self.name,)     # a kernel instance passed in
        for name in extra + KERNEL_NAMES:
            if name == self.name:
                lines.append(f"{name:<7} {'CHOSEN':<9} {'forced by backend=' if self.forced else 'first eligible in preference order'}")
            else:
                status = "eligible" if self.rejected[name] == "" else "rejected"
                lines.append(f"{name:<7} {status:<9} {self.rejected[name] or 'eligible, lower preference'}")
        return "\n".join(lines)


def rejection(name: str, spec: AttnSpec) -> Optional[str]:
    """Why kernel `name` cannot serve `spec`, or None if it can. Table rows first, then probe."""
    try:
        kernel = get_kernel(name)
    except ImportError as e:
        return f"adapter not importable: {e}"
    return kernel_rejection(kernel, spec)


def kernel_rejection(kernel: Kernel, spec: AttnSpec) -> Optional[str]:
    """Why this kernel instance cannot serve `spec`, or None if it can."""
    name = kernel.name
    for rule in RULES:
        if (rule.kernels == ("*",) or name in rule.kernels) and rule.rejects(spec, kernel):
            return rule.reason(spec, kernel)
    try:
        return kernel.probe(spec)
    except Exception as e:  # a probe that crashes fails closed
        return f"probe failed: {type(e).__name__}: {e}"


_SELECTIONS: Dict[tuple, Selection] = {}


def check_backend(backend) -> None:
    """The construction-time check of a backend= argument (CPAttention, use_cp_group): "auto", a
    kernel name or a Kernel instance, so a typo fails where it is written, not at the first call."""
    if backend in (None, "auto") or isinstance(backend, Kernel) or backend in KERNEL_NAMES:
        return
    raise ValueError(f"backend={backend!r} is not a kernel; choose one of {KERNEL_NAMES}, 'auto' or "
                     "a Kernel instance")


def requested_backend(backend: Union[None, str, Kernel]) -> Union[None, str, Kernel]:
    """backend= argument (a kernel name or a Kernel instance), else CP_SOFTCAP_BACKEND, else
    None (auto)."""
    if isinstance(backend, Kernel):
        return backend
    name = backend if backend not in (None, "auto") else settings.backend()
    if name in (None, "auto"):
        return None
    if name not in KERNEL_NAMES:
        raise ValueError(f"backend={name!r} is not a kernel; choose one of {KERNEL_NAMES} or 'auto' "
                         "(check CP_SOFTCAP_BACKEND too)")
    return name


def select(spec: AttnSpec, backend: Union[None, str, Kernel] = "auto") -> Selection:
    """Pick the kernel for `spec`. backend: "auto", a kernel name or a Kernel instance (used as
    is, after the same rules and probe). Cached per (spec, backend). Raises ValueError when a
    forced backend cannot serve the spec, or when no kernel can (naming every kernel's reason)."""
    forced = requested_backend(backend)
    key = (spec, forced, settings.fa3_enabled())   # the fa3 rule reads the setting
    if key in _SELECTIONS:
        return _SELECTIONS[key]
    reasons = {name: rejection(name, spec) for name in KERNEL_NAMES}
    if isinstance(forced, Kernel):
        reason = kernel_rejection(forced, spec)
        if reason is not None:
            raise ValueError(f"backend {forced.name!r} ({type(forced).__name__}) cannot serve this "
                             f"call: {reason} [{spec.describe()}]; use backend='auto' or fix the call")
        rejected = {n: (r or "") for n, r in reasons.items() if n != forced.name}
        _SELECTIONS[key] = Selection(forced, forced.name, rejected, forced=True)
        return _SELECTIONS[key]
    if forced is not None:
        if reasons[forced] is not None:
            raise ValueError(f"backend {forced!r} cannot serve this call: {reasons[forced]} "
                             f"[{spec.describe()}]; use backend='auto' or fix the call")
        chosen = forced
    else:
        order = PREFERENCE.get(spec.device_type, ("torch",))
        eligible = [n for n in order if reasons[n] is None]
        if not eligible:
            detail = "; ".join(f"{n}: {r}" for n, r in reasons.items())
            raise ValueError(f"no kernel can serve [{spec.describe()}]: {detail}")
        chosen = eligible[0]
    rejected = {n: (r or "") for n, r in reasons.items() if n != chosen}
    sel = Selection(get_kernel(chosen), chosen, rejected, forced=forced is not None)
    _SELECTIONS[key] = sel
    return sel


def clear_cache() -> None:
    _SELECTIONS.clear()
