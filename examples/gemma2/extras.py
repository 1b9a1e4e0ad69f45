"""What every example entry script needs before its own imports (standard library only):

- `usage_exit` and `RankZeroParser`: a usage error ends the run with one message. Under torchrun
  rank 0 prints it and exits 2; the other ranks exit 0 without a word, since torchrun stops the
  remaining workers as soon as one fails, which could kill rank 0 before it has printed.
  torchrun then adds its own summary of rank 0's exit status.
- `require`: the optional packages a script needs, checked before it imports them: a missing one
  is one line naming the extra that installs it, instead of an ImportError traceback per rank.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import sys


def usage_exit(text: str) -> None:
    """Rank 0 (or a process started without torchrun) prints `text` to stderr and exits 2; the
    other ranks exit 0 without a word."""
    if os.environ.get("RANK", "0") != "0":
        sys.exit(0)
    print(text, file=sys.stderr, flush=True)
    sys.exit(2)


class RankZeroParser(argparse.ArgumentParser):
    """argparse whose usage errors go through usage_exit (one message per job, not one per rank)."""

    def error(self, message):
        usage_exit(f"{self.format_usage()}{self.prog}: error: {message}")


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
    usage_exit(f"{script}: error: needs {', '.join(found)}, not installed here; install the "
               f"[{extra}] extra from the repository root: pip install -e \".[{extra}]\"")
