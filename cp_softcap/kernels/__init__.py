"""Per-chunk kernels behind one contract (see base.py). One module per kernel.

`get_kernel(name)` imports the adapter lazily; GPU packages are imported only by their probes.
"""
from __future__ import annotations

import importlib
from typing import Dict, Tuple

from .base import CAUSAL, FULL, Capabilities, Kernel

_MODULES = {"fa2": ("fa2", "FA2Kernel"), "fa3": ("fa3", "FA3Kernel"), "fa4": ("fa4", "FA4Kernel"),
            "flex": ("flex", "FlexKernel"), "sdpa": ("sdpa", "SdpaKernel"),
            "torch": ("torch_kernel", "TorchKernel")}
KERNEL_NAMES: Tuple[str, ...] = tuple(_MODULES)        # the one list of kernel names
_CACHE: Dict[str, Kernel] = {}


def get_kernel(name: str) -> Kernel:
    """The adapter instance for `name`; raises ValueError for an unknown name, ImportError if
    the adapter module itself cannot load (its package's absence is reported by probe())."""
    if name not in _MODULES:
        raise ValueError(f"unknown kernel {name!r}; choose one of {KERNEL_NAMES} or 'auto'")
    if name not in _CACHE:
        module, cls = _MODULES[name]
        _CACHE[name] = getattr(importlib.import_module(f"{__name__}.{module}"), cls)()
    return _CACHE[name]


__all__ = ["Capabilities", "Kernel", "KERNEL_NAMES", "get_kernel", "FULL", "CAUSAL"]
