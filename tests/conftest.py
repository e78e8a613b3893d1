"""Shared test fixtures: where the real data lives, and a small CPU budget.

Data is never downloaded at test time. Fashion-MNIST is searched in ./data (of the repository),
$REVIT_DATA_DIR and Debian's /usr/share/datasets (`apt-get install dataset-fashion-mnist`, what
README's set-up installs); tests that need it are skipped with the reason when none has it.
The language-model tests train on the corpus the repository generates (data.grammar_corpus);
the tinyshakespeare test reads $REVIT_DATA_DIR/tinyshakespeare.txt and is skipped without it.
"""
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
torch.set_num_threads(min(2, torch.get_num_threads()))


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
