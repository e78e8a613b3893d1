"""Shared test fixtures: where the real data lives, and a small CPU budget.

Data is never downloaded at test time. The search order is $REVIT_DATA_DIR, ./data,
../shared/data (the layout CI is given) and Debian's /usr/share/datasets.
"""
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
torch.set_num_threads(min(2, torch.get_num_threads()))


def _data_roots():
    env = os.environ.get("REVIT_DATA_DIR")
    roots = [Path(env)] if env else []
    return roots + [ROOT / "data", ROOT.parent / "shared" / "data", Path("/usr/share/datasets")]


@pytest.fixture(scope="session")
def fashion_mnist_dir():
    for root in _data_roots():
        for d in (root / "fashion-mnist", root):
            if (d / "t10k-labels-idx1-ubyte.gz").exists():
                return d
    pytest.fail("Fashion-MNIST not found: set REVIT_DATA_DIR or run `apt-get install dataset-fashion-mnist`")


@pytest.fixture(scope="session")
def shakespeare_path():
    for root in _data_roots():
        p = root / "tinyshakespeare.txt"
        if p.exists():
            return p
    pytest.fail("tinyshakespeare.txt not found: set REVIT_DATA_DIR to a folder that holds it")
