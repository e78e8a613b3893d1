"""The layering a reader relies on: the two model files stand alone, and no module of the project imports
itself back through others, counting imports inside functions (a cycle hidden in a function is still a
cycle a reader has to untangle). And every test is in one of README's two commands (conftest.py).
"""
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("lib", "tools")  # the plumbing, and the tools a user runs on a checkpoint
MODULES = {path.stem: path for path in ROOT.glob("*.py")} | {
    f"{package}.{path.stem}": path for package in PACKAGES for path in (ROOT / package).glob("*.py")
    if path.stem != "__init__"}
MODEL_FILES = ("revit", "alternet")
MAX_COLUMNS = 110
# held to MAX_COLUMNS; the others join as they are wrapped
NARROW_FILES = ("revit.py", "alternet.py", "train.py", "bench.py", "hubconf.py", "lib/moe.py", "lib/build.py",
                "lib/tasks.py", "lib/planted.py", "lib/tables.py", "lib/weights.py", "tools/analyze.py",
                "tools/depths.py", "tools/plot.py", "tools/sweep.py", "results/render.py", "sample.py",
                "lib/budget.py", "lib/cli.py", "lib/resume.py", "lib/boundary.py", "lib/checkpoint.py",
                "lib/data.py", "lib/memory.py", "tests/test_analyze.py", "tests/test_plot.py",
                "tools/probes.py", "lib/language.py", "tools/export.py", "tests/test_cli.py",
                "tests/test_faults.py")


def project_imports(path: Path) -> set[str]:
    """The project modules `path` imports, at any level (module, class or function body):
    `import revit`, `from lib import data` and `from lib.cli import fail` name revit, lib.data, lib.cli."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    assert not any(isinstance(node, ast.ImportFrom) and node.level for node in ast.walk(ast.parse(path.read_text())))
    return names & set(MODULES) - {name for name, p in MODULES.items() if p == path}


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
    assert {"revit", "alternet", "train", "bench", "tools.depths", "lib.data"} <= set(GRAPH)
    assert {"revit", "train", "lib.memory", "lib.cli"} <= GRAPH["bench"] and "bench" in GRAPH["tools.depths"]


def test_the_top_level_is_the_brief_and_the_rest_is_in_folders():
    """A newcomer sees the two model files, the loop, the benchmark and the sampler; the tools a user runs
    on a checkpoint are in tools/, the plumbing they share in lib/. hubconf.py is torch.hub's convention: the
    file must be named so and sit at the top (torch.hub.load(REPO, "revit_mini") imports it from there)."""
    assert {path.name for path in ROOT.glob("*.py")} == {"revit.py", "alternet.py", "train.py", "bench.py",
                                                         "sample.py", "hubconf.py"}
    assert {name.split(".")[1] for name in MODULES if name.startswith("tools.")} == {
        "analyze", "depths", "export", "plot", "probes", "sweep"}


def test_nothing_imports_upward():
    """The plumbing (lib/) imports the models, never the loop or a tool; the loop imports no tool."""
    upward = {name: sorted(g for g in GRAPH[name] if g.startswith("tools.") or g in ("train", "bench", "sample"))
              for name in GRAPH if name.startswith("lib.") or name == "train"}
    assert {name: found for name, found in upward.items() if found} == {}


def test_no_import_cycle_at_any_level():
    cycles = {name: cycle_through(name) for name in GRAPH}
    assert {name: " -> ".join(c) for name, c in cycles.items() if c} == {}


def test_the_model_files_import_nothing_of_the_project():
    assert {name: GRAPH[name] for name in MODEL_FILES} == {name: set() for name in MODEL_FILES}


def test_hubconf_imports_only_the_model_files():
    """torch.hub.load runs hubconf.py from a clone or a downloaded archive: it reads the shipped weights
    itself, so a hub user needs the two model files, never lib/ or tools/."""
    assert GRAPH["hubconf"] == {"revit", "alternet"}


def test_every_name_readme_points_a_reader_to_exists():
    """README's "Read the code" names classes, functions and tables instead of line numbers; each must exist."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Read the code"):readme.index("\n## ", readme.index("## Read the code") + 1)]
    named = set(re.findall(r"`([A-Za-z_]\w*)`", section))
    defined = set()
    for name in ("revit", "alternet", "train", "lib.tasks"):
        for node in ast.walk(ast.parse(MODULES[name].read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.Assign):
                defined |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    assert len(named) > 15 and named - defined == set()


def test_readme_counts_the_planted_bugs_there_are():
    """README says how many bugs tests/mutants.py plants; the number is the list's length, not a memory of it."""
    sys.path.insert(0, str(ROOT / "tests"))
    import mutants
    claimed = re.search(r"plants one bug at a time \((\d+):", (ROOT / "README.md").read_text())
    assert claimed and int(claimed.group(1)) == len(mutants.MUTANTS)


def test_every_arxiv_id_cited_is_one_of_the_two_papers():
    """Code, tests and documents cite reViT (arXiv 2610.12448) and AlterNet (arXiv 2611.08741) by id; a typo
    in an id sends a reader to another paper."""
    files = [*MODULES.values(), *ROOT.glob("tests/*.py"), *ROOT.glob("*.md"), *ROOT.glob("docs/*.md"),
             ROOT / "results" / "render.py"]
    cited = {m for path in files for m in re.findall(r"arXiv:? ?(\d{4}\.\d{4,5})", path.read_text())}
    assert cited == {"2610.12448", "2611.08741"}


QUICK_START_LINES = 3500  # project lines `python train.py --arch revit-mini` may import (nanoGPT's: ~670)
QUICK_START_IMPORTS = """
import json, os, sys
sys.argv = ["train.py"]  # the error prefix and the prog of a real run
import train
train.main(sys.argv[1:] + {argv})
root = os.getcwd()
def ours(path):  # a module of the project: top level, lib/ or tools/ (not a virtual environment inside it)
    if not (os.path.isabs(path) and path.startswith(root + os.sep) and path.endswith(".py")):
        return False
    relative = os.path.relpath(path, root).split(os.sep)
    return len(relative) == 1 or (len(relative) == 2 and relative[0] in ("lib", "tools"))
project = {{name: module.__file__ for name, module in sys.modules.items()
           if getattr(module, "__file__", None) and ours(module.__file__)}}
print(json.dumps({{name: len(open(path).read().splitlines()) for name, path in project.items()}}))
"""


def test_the_quick_start_imports_what_it_runs(tmp_path, fashion_mnist_dir):
    """A CPU vision run imports the model, the loop and the plumbing it executes: not the language model,
    its task, the memory planner (a CPU run of a small model does not plan) or the comparison mechanisms."""
    argv = ["--max-steps", "2", "--train-subset", "256", "--test-subset", "64", "--batch-size", "32",
            "--no-progress", "--data-dir", str(fashion_mnist_dir), "--out-dir", str(tmp_path / "run")]
    done = subprocess.run([sys.executable, "-c", QUICK_START_IMPORTS.format(argv=argv)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"revit", "train", "lib.data", "lib.tasks", "lib.checkpoint", "lib.cli"} <= set(lines)
    assert not set(lines) & {"alternet", "lib.language", "lib.memory", "lib.moe", "lib.planted", "bench", "sample"}, sorted(lines)
    assert not any(name.startswith("tools.") for name in lines), sorted(lines)
    assert sum(lines.values()) <= QUICK_START_LINES, lines


@pytest.mark.parametrize("name", NARROW_FILES)
def test_every_line_reads_without_scrolling(name):
    """At most MAX_COLUMNS characters per line (nanoGPT's model.py has 17 lines over 100)."""
    lines = (ROOT / name).read_text().splitlines()
    wide = [f"{name}:{i} has {len(line)}" for i, line in enumerate(lines, 1) if len(line) > MAX_COLUMNS]
    assert wide == [], f"lines wider than {MAX_COLUMNS} columns: {', '.join(wide)}"


def test_every_test_file_is_in_one_set_and_every_exception_names_a_test():
    """`python -m pytest -q` (fast) and `-m deep` together run every test once: each test file is in exactly
    one of conftest's file lists, and each test it moves to the other set is a test of a file of the first."""
    import conftest
    files = {path.name for path in (ROOT / "tests").glob("test_*.py")}
    listed = [*conftest.FAST_FILES, *conftest.DEEP_FILES]
    assert sorted(listed) == sorted(set(listed)) and set(listed) == files, (
        f"not in a list of tests/conftest.py: {sorted(files - set(listed))}; listed twice or missing: "
        f"{sorted({name for name in listed if listed.count(name) > 1 or name not in files})}")
    moved = [(rule, conftest.FAST_FILES) for rule in conftest.DEEP_TESTS] + [
        (rule, conftest.DEEP_FILES) for rule in conftest.FAST_TESTS]
    for rule, home in moved:
        file, name = rule.split("::")
        source = (ROOT / "tests" / file).read_text() if file in home else ""
        assert re.search(rf"^def {re.escape(name)}\(", source, re.M), f"conftest.py names {rule}: no such test"
