"""A costly fixture value computed once per pytest session, even when pytest-xdist hands the tests
that need it to several workers (CI's `-n 2` distributes tests one by one, so a module-scoped
fixture would run once per worker that gets one of the module's tests).

The first worker to take the lock computes the value and writes it as JSON beside the workers'
temporary directories; the others wait on the lock and read it. A failure is stored too, so
every worker reports it instead of computing it again.
"""
from __future__ import annotations

import fcntl
import json
import os

import pytest


def once_per_session(tmp_path_factory, name: str, compute):
    """compute(directory) -> a JSON-able value, run once per session; `directory` is a fresh
    folder for its files. Raises pytest's failure with the message of a failed compute."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent              # the session's folder, shared by its workers
    path = base / f"{name}.json"
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            folder = base / name
            folder.mkdir(exist_ok=True)
            try:
                value = {"value": compute(str(folder))}
            except (Exception, pytest.fail.Exception) as e:     # pytest.fail (a hang guard) too
                value = {"failed": f"{type(e).__name__}: {e}"}
            path.write_text(json.dumps(value))
        stored = json.loads(path.read_text())
    if "failed" in stored:
        pytest.fail(f"{name} (computed once for the session): {stored['failed']}", pytrace=False)
    return stored["value"]


def slow_selected(request) -> bool:
    """Whether this session runs any test marked `slow` from the requesting fixture's module, so
    that a once-per-session computation can leave out what only those tests read. Every
    pytest-xdist worker collects and deselects the same items, so each gets the same answer
    (part of once_per_session's name where it changes the value)."""
    return any(item.get_closest_marker("slow") is not None
               for item in request.session.items if item.path == request.path)
