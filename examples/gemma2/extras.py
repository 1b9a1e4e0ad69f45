"""The optional packages an entry script needs, checked before it imports them: a missing one
ends the run with one line naming the extra that installs it, instead of an ImportError
traceback from every rank. Standard library only (it runs before the script's own imports).

Under torchrun rank 0 prints the line and exits 2; the other ranks exit 0 without a word (as
flags.py does: torchrun stops the remaining workers as soon as one fails, which could kill
rank 0 before it has printed). torchrun then adds its own summary of rank 0's exit status.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys

SFT = ("transformers", "accelerate", "trl", "datasets")    # pyproject.toml's [sft] extra


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def problems(modules, min_transformers: int = 5) -> list:
    """What keeps `modules` from importing here: the missing ones, and a transformers older than
    `min_transformers` (cp_softcap's Trainer integration needs its num_items_in_batch hooks)."""
    out = [m for m in modules if not _importable(m)]
    if "transformers" in modules and "transformers" not in out:
        version = importlib.metadata.version("transformers")
        if int(version.split(".")[0]) < min_transformers:
            out.append(f"transformers>={min_transformers} (found {version})")
    return out


def require(script: str, modules=SFT, extra: str = "sft") -> None:
    """Exit with one line (status 2, rank 0 only) unless every module imports here."""
    found = problems(modules)
    if not found:
        return
    if os.environ.get("RANK", "0") != "0":
        sys.exit(0)
    print(f"{script}: error: needs {', '.join(found)}, not installed here; install the "
          f"[{extra}] extra from the repository root: pip install -e \".[{extra}]\"",
          file=sys.stderr, flush=True)
    sys.exit(2)
