"""Shared test fixtures: where the real data lives, and a small CPU budget.

Data is never downloaded at test time. Fashion-MNIST is searched in ./data (of the repository),
$REVIT_DATA_DIR and Debian's /usr/share/datasets (`apt-get install dataset-fashion-mnist`, what
README's set-up installs); tests that need it are skipped with the reason when none has it.
The language-model tests train on the corpus the repository generates (data.grammar_corpus);
the tinyshakespeare test reads $REVIT_DATA_DIR/tinyshakespeare.txt and is skipped without it.

Devices: the suite runs on the CPU, also on a machine with a GPU. Bit-for-bit resume and 2 ranks =
1 rank are promised on the CPU only (bf16 autocast and atomics differ run to run on a GPU), so unless
REVIT_GPU_TESTS=1 the GPUs are hidden (CUDA_VISIBLE_DEVICES="", set here before torch initialises
CUDA, inherited by torchrun and every subprocess): --device auto is the CPU everywhere. Tests marked
`gpu` need a CUDA GPU and run only with REVIT_GPU_TESTS=1 on a machine that has one:

    REVIT_GPU_TESTS=1 python -m pytest -q -m gpu

With REVIT_GPU_TESTS=1 the unmarked tests still see no GPU (`cpu_unless_marked_gpu` below).
"""
import os
import sys
from pathlib import Path

GPU_TESTS = os.environ.get("REVIT_GPU_TESTS") == "1"
if not GPU_TESTS:  # before torch reads it: CUDA initialises lazily, at its first use
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest  # noqa: E402

try:
    import torch  # noqa: E402
except ModuleNotFoundError as missing:  # a python without README's set-up: say so in one line, not per test file
    pytest.exit(f"the tests need the packages of requirements.txt, and {missing.name!r} is not installed for "
                f"{sys.executable}: python -m pip install -r requirements.txt (README's set-up, in its .venv)",
                returncode=4)

ROOT = Path(__file__).resolve().parent.parent
torch.set_num_threads(min(2, torch.get_num_threads()))
SKIP_GPU = ("needs a CUDA GPU: run with REVIT_GPU_TESTS=1 on a machine that has one" if not GPU_TESTS else
            "REVIT_GPU_TESTS=1 but torch sees no CUDA GPU")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; runs only with REVIT_GPU_TESTS=1")


def pytest_collection_modifyitems(config, items):
    if GPU_TESTS and torch.cuda.is_available():
        return
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skip(reason=SKIP_GPU))


@pytest.fixture(autouse=True)
def cpu_unless_marked_gpu(request, monkeypatch):
    """With REVIT_GPU_TESTS=1 the GPUs stay visible to the process: an unmarked test still runs on the
    CPU (--device auto picks it, and its subprocesses see no GPU)."""
    if GPU_TESTS and not request.node.get_closest_marker("gpu"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture
def one_thread():
    """One intra-op thread, for tests that time or measure memory (`pytestmark = pytest.mark.usefixtures(
    "one_thread")`): on a shared machine two spinning OpenMP threads can be 20x slower, and one heap arena
    keeps memory peaks repeatable."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fetching_tiktoken(monkeypatch):
    """A stand-in tiktoken whose get_encoding tries to connect, as the real one does when its files are not
    cached: the list it returns holds each connection attempt's error (a guard that refuses first leaves
    its own message there)."""
    import socket
    import types
    attempts = []

    def get_encoding(name):
        try:
            socket.create_connection(("openaipublic.blob.core.windows.net", 443), timeout=0.01)
        except OSError as e:
            attempts.append(str(e))
            raise
        raise AssertionError("the stand-in reached past the guard")

    monkeypatch.setitem(sys.modules, "tiktoken", types.SimpleNamespace(get_encoding=get_encoding))
    return attempts


def _data_roots():
    env = os.environ.get("REVIT_DATA_DIR")
    return [ROOT / "data"] + ([Path(env)] if env else []) + [Path("/usr/share/datasets")]


@pytest.fixture(scope="session")
def fashion_mnist_dir():
    for root in _data_roots():
        for d in (root / "fashion-mnist", root):
            if (d / "t10k-labels-idx1-ubyte.gz").exists():
                return d
    pytest.skip("Fashion-MNIST not found in ./data, $REVIT_DATA_DIR or /usr/share/datasets: "
                "`apt-get install dataset-fashion-mnist`")


@pytest.fixture(scope="session")
def shakespeare_path():
    env = os.environ.get("REVIT_DATA_DIR")
    path = Path(env) / "tinyshakespeare.txt" if env else None
    if path is None or not path.is_file():
        pytest.skip("tinyshakespeare.txt not found: set REVIT_DATA_DIR to a folder that holds it "
                    "(python train.py --dataset tinyshakespeare --download --data-dir DIR fetches it)")
    return path
