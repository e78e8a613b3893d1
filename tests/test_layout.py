"""The layering a reader relies on: the two model files stand alone, and no module of the project imports
itself back through others, counting imports inside functions (a cycle hidden in a function is still a
cycle a reader has to untangle).
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULES = {path.stem: path for path in ROOT.glob("*.py")}
MODEL_FILES = ("revit", "alternet")


def project_imports(path: Path) -> set[str]:
    """The project modules `path` imports, at any level (module, class or function body)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & set(MODULES) - {path.stem}


GRAPH = {name: project_imports(path) for name, path in MODULES.items()}


def cycle_through(start: str) -> list[str] | None:
    """A path start -> ... -> start in the import graph, or None."""
    stack, seen = [(start, [start])], set()
    while stack:
        name, path = stack.pop()
        for child in GRAPH[name]:
            if child == start:
                return path + [start]
            if child not in seen:
                seen.add(child)
                stack.append((child, path + [child]))
    return None


def test_the_graph_is_read_from_the_files():
    assert {"revit", "alternet", "train", "bench", "depths"} <= set(GRAPH)
    assert {"revit", "train", "memory"} <= GRAPH["bench"] and "bench" in GRAPH["depths"]


def test_no_import_cycle_at_any_level():
    cycles = {name: cycle_through(name) for name in GRAPH}
    assert {name: " -> ".join(c) for name, c in cycles.items() if c} == {}


def test_the_model_files_import_nothing_of_the_project():
    assert {name: GRAPH[name] for name in MODEL_FILES} == {name: set() for name in MODEL_FILES}
