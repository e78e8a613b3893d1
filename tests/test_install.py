"""`pip install -e .` and `pip install .` from a clone make `import revit, alternet` work from any folder, and
install nothing else: lib/ and tools/ stay in the repository, so they cannot shadow another package's `lib`.

Offline: a throwaway venv under tmp_path borrows this interpreter's site-packages (torch, einops, pip,
setuptools) through a .pth file, and pip builds with --no-index --no-build-isolation --no-deps. The clone is a
copy of the files the install reads plus lib/ and tools/, the folders that made setuptools' automatic
discovery fail ("Multiple top-level packages discovered in a flat-layout").
"""
import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CLONE_FILES = ("pyproject.toml", "README.md", "revit.py", "alternet.py")
CLONE_FOLDERS = ("lib", "tools")
CHECK = """
import importlib.util, json, revit, alternet
print(json.dumps({"revit": revit.__file__, "alternet": alternet.__file__,
                  "others": [n for n in ("lib", "tools", "train") if importlib.util.find_spec(n)]}))
"""


def build_tools_or_skip():
    setuptools = pytest.importorskip("setuptools")
    pytest.importorskip("pip")
    major, minor = (int(part) for part in setuptools.__version__.split(".")[:2])
    if (major, minor) < (70, 1):  # bdist_wheel moved into setuptools in 70.1; before, the `wheel` package
        pytest.importorskip("wheel", reason=f"setuptools {setuptools.__version__} builds wheels with `wheel`")


@pytest.mark.parametrize("editable", [True, False], ids=["pip install -e .", "pip install ."])
def test_pip_install_puts_the_model_files_and_nothing_else_on_any_folders_path(tmp_path, editable):
    build_tools_or_skip()
    clone, env, elsewhere = tmp_path / "clone", tmp_path / "env", tmp_path / "elsewhere"
    clone.mkdir()
    elsewhere.mkdir()
    for name in CLONE_FILES:
        shutil.copy(ROOT / name, clone / name)
    for name in CLONE_FOLDERS:
        shutil.copytree(ROOT / name, clone / name, ignore=shutil.ignore_patterns("__pycache__"))
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    site_packages = next((env / "lib").glob("python*/site-packages"))
    (site_packages / "borrowed.pth").write_text("\n".join(p for p in sys.path if p.endswith("site-packages")))
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    install = [str(python), "-m", "pip", "install", "--quiet", "--no-index", "--no-build-isolation",
               "--no-deps", *(["-e"] if editable else []), str(clone)]
    done = subprocess.run(install, cwd=elsewhere, env=clean, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    shown = subprocess.run([str(python), "-c", CHECK], cwd=elsewhere, env=clean, capture_output=True,
                           text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    found = json.loads(shown.stdout)
    home = clone if editable else site_packages  # editable: the clone's own files; else copies in the venv
    assert Path(found["revit"]) == home / "revit.py" and Path(found["alternet"]) == home / "alternet.py"
    assert found["others"] == []
