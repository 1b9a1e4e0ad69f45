"""torch.distributed.checkpoint (DCP) checkpoints in `<dir>/step-N` folders.

A folder counts only once it is complete: every rank has written its DCP files, then rank 0
writes `COMPLETE` (JSON: step and the size of every file) last, atomically (tmp + fsync +
rename). On start, the newest folder whose marker is present and whose files all exist with
the recorded sizes is loaded; newer half-written or corrupt folders are skipped with a warning,
never loaded. Rank 0 decides and broadcasts, so all ranks load the same folder or none.
Multi-node runs need `--ckpt-dir` on a filesystem shared by all nodes.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from typing import List, Optional, Tuple

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def step_dirs(ckpt_dir: str) -> List[Tuple[int, str]]:
    """[(step, path)] of every `step-N` folder, newest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    found = [(int(m.group(1)), os.path.join(ckpt_dir, name))
             for name in os.listdir(ckpt_dir) if (m := _STEP_DIR.match(name))]
    return sorted(found, reverse=True)


def check_complete(path: str, step: int) -> Optional[str]:
    """None if `path` is a complete checkpoint of `step`, else the reason it is not."""
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        return "no COMPLETE marker (half-written: a run stopped while saving?)"
    try:
        with open(marker) as f:
            meta = json.load(f)
        files = dict(meta["files"])
        marked_step = int(meta["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable COMPLETE marker ({type(e).__name__}: {e})"
    if marked_step != step:
        return f"COMPLETE marker says step {marked_step}, folder says step {step}"
    if ".metadata" not in files:
        return "the marker lists no DCP .metadata file"
    for name, size in files.items():
        fp = os.path.join(path, name)
        if not os.path.isfile(fp):
            return f"file {name} listed in the marker is missing"
        if os.path.getsize(fp) != size:
            return f"file {name} has {os.path.getsize(fp)} bytes, the marker recorded {size}"
    return None


def latest_complete(ckpt_dir: str, warn=True) -> Optional[Tuple[int, str]]:
    """(step, path) of the newest complete checkpoint, skipping (with a warning) broken ones."""
    for step, path in step_dirs(ckpt_dir):
        reason = check_complete(path, step)
        if reason is None:
            return step, path
        if warn:
            warnings.warn(f"ignoring checkpoint {path}: {reason}", stacklevel=2)
    return None


def save(ckpt_dir: str, step: int, model, optimizer, keep: int = 2) -> str:
    """Collective: every rank calls it. Writes `<ckpt_dir>/step-<step>` and then its marker;
    keeps the newest `keep` complete checkpoints (0 = keep all)."""
    path = os.path.join(ckpt_dir, f"step-{step}")
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        if os.path.exists(path):              # leftover of a crash at this very step
            shutil.rmtree(path)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    dist.barrier()
    if rank == 0:
        files = {}
        for name in sorted(os.listdir(path)):
            fp = os.path.join(path, name)
            if os.path.isfile(fp):
                with open(fp, "rb") as f:
                    os.fsync(f.fileno())
                files[name] = os.path.getsize(fp)
        tmp = os.path.join(path, MARKER + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"step": step, "world_size": dist.get_world_size(), "files": files}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, MARKER))
        _fsync_dir(path)
        if keep > 0:
            complete = [(s, p) for s, p in step_dirs(ckpt_dir) if check_complete(p, s) is None]
            for _, old in complete[keep:]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return path


def load_latest(ckpt_dir: Optional[str], model, optimizer) -> int:
    """Collective. Load the newest complete checkpoint into model and optimizer (in place) and
    return its step; 0 when there is none (or ckpt_dir is None)."""
    if ckpt_dir is None:
        return 0
    choice = [None]
    if dist.get_rank() == 0:
        choice[0] = latest_complete(ckpt_dir)
    dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return 0
    step, path = choice[0]
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return step
