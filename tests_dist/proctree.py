"""Start torchrun (or any command) for a test and kill everything it started, whatever happened.

torchrun starts each worker with start_new_session=True (torch 2.13,
torch/distributed/elastic/multiprocessing/subprocess_handler), so a worker is NOT in torchrun's
process group: killpg of torchrun's group alone reaches torchrun only, and a worker whose
torchrun has already died (re-parented to init) is no longer among torchrun's descendants either.
`start` therefore marks the whole tree with a unique environment variable, which every worker
and grandchild inherits, and `kill_tree` kills torchrun's group, each descendant's own group and
every process that still carries the mark.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from typing import List, Mapping, Optional, Sequence

TAG_VAR = "CP_SOFTCAP_TEST_TREE"


def start(cmd: Sequence[str], *, cwd: str, env: Mapping[str, str], stdout, stderr=subprocess.STDOUT,
          **kwargs) -> subprocess.Popen:
    """Popen(cmd) in a session of its own (its pid is its process group id), its environment
    marked with a fresh tag (proc.tag) that `tagged` finds in every process below it."""
    tag = uuid.uuid4().hex
    p = subprocess.Popen(list(cmd), cwd=cwd, env={**env, TAG_VAR: tag}, stdout=stdout, stderr=stderr,
                         start_new_session=True, **kwargs)
    p.tag = tag
    return p


def _pids() -> List[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def descendants(pid: int) -> List[int]:
    """Pids of every live descendant of `pid` (from /proc)."""
    children: dict = {}
    for child in _pids():
        try:
            with open(f"/proc/{child}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def tagged(tag: str) -> List[int]:
    """Live processes (not zombies) whose environment holds TAG_VAR=tag, orphans included."""
    needle = f"{TAG_VAR}={tag}".encode()
    me, found = os.getpid(), []
    for pid in _pids():
        if pid == me:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except (OSError, IndexError):
            continue
        found.append(pid)
    return found


def _signal_group_and_pid(pid: int, sig: int) -> None:
    """Signal `pid` and its process group (a worker leads its own), never the test's group."""
    try:
        pgid = os.getpgid(pid)
        if pgid != os.getpgrp():
            os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def kill_tree(proc: subprocess.Popen, grace: float = 5.0) -> List[int]:
    """Stop `proc` (started by `start`) and everything below it.

    While it runs, SIGTERM its group first and wait up to `grace` seconds (torchrun then stops
    its workers itself; 0 = no grace); then SIGKILL its group, every descendant's group and every
    process still marked with its tag, until none is left (10 s at most). Reaps `proc`. Returns
    the marked pids still alive at the end (empty unless something could not be killed)."""
    tag = getattr(proc, "tag", None)
    if proc.poll() is None and grace > 0:
        _signal_group_and_pid(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    deadline = time.monotonic() + 10
    while True:
        victims = set(tagged(tag) if tag else ())
        if proc.poll() is None:     # not reaped yet, so its pid cannot belong to anyone else
            victims |= {proc.pid, *descendants(proc.pid)}
        if not victims or time.monotonic() > deadline:
            break
        for pid in victims:
            _signal_group_and_pid(pid, signal.SIGKILL)
        time.sleep(0.05)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    return sorted(victims)


def left_over(procs: Sequence[subprocess.Popen]) -> List[int]:
    """Marked processes of `procs` still alive (for assertions after kill_tree)."""
    out: List[int] = []
    for p in procs:
        tag: Optional[str] = getattr(p, "tag", None)
        if tag:
            out += tagged(tag)
    return out
