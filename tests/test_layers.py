"""The import rules of docs/layers.md, checked on the source: no import cycle at module level in
cp_softcap/ or benchmarks/, kernels/ imports nothing above the bottom row, and the plan never
imports the algorithms (cp/ imports the plan, not the other way round)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOTTOM_ROW = {"spec", "settings", "layout", "documents", "doc_geometry", "merge"}


def _modules(pkg: str) -> dict:
    out = {}
    for path in (ROOT / pkg).rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, known: dict) -> set:
    """Modules of `known` that `name` imports at module level (also inside top-level if/try)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for top in ast.parse(path.read_text()).body:
        for node in (ast.walk(top) if isinstance(top, (ast.If, ast.Try)) else [top]):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                mod = ".".join(base + ([node.module] if node.module else []))
                names = ([mod] if node.module else []) + [f"{mod}.{a.name}" for a in node.names]
            else:
                continue
            found.update(n for n in names if n in known and n != name)
    return found


def _graph() -> dict:
    known = {**_modules("cp_softcap"), **_modules("benchmarks")}
    return {name: _imports(name, path, known) for name, path in known.items()}


def _cycle(graph: dict):
    """One import cycle as a list of modules, or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        state[m] = "done"
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_sees_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_kernels_import_nothing_above_the_bottom_row():
    allowed = {f"cp_softcap.{m}" for m in BOTTOM_ROW}
    for name, deps in _graph().items():
        if name.startswith("cp_softcap.kernels"):
            above = sorted(d for d in deps if not d.startswith("cp_softcap.kernels") and d not in allowed)
            assert not above, f"{name} imports {above}, above the kernels (docs/layers.md)"


def test_plan_and_modules_below_it_never_import_the_algorithms():
    """Only the layers above the plan (api.py, integrations, cp/ and its one-device counterpart
    packed_local.py) import cp/."""
    for name, deps in _graph().items():
        if name.startswith(("cp_softcap.cp", "cp_softcap.api", "cp_softcap.integrations",
                            "cp_softcap.packed_local", "benchmarks")) or name == "cp_softcap":
            continue
        into = sorted(d for d in deps if d.startswith("cp_softcap.cp"))
        assert not into, f"{name} imports {into}: the algorithms read the plan, never the reverse"
