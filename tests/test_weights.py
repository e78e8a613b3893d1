"""The weights shipped in weights/ (README: try it without training): each reproduces the scores its card
(weights/NAME.json) records on a fixed test subset, loads through torch.hub from the clone without a network,
and is a checkpoint every command of the repository reads.
"""
import json
import math
from pathlib import Path

import pytest
import torch

import train
from lib.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parent.parent
CARDS = sorted((ROOT / "weights").glob("*.json"))
ENTRY = {"revit-mini": "revit_mini", "alternet-tiny": "alternet_tiny"}  # hubconf's function per card


def card(path: Path) -> dict:
    return json.loads(path.read_text())


def test_the_two_models_are_shipped_small():
    assert {path.stem for path in CARDS} == set(ENTRY)
    sizes = {path.stem: (ROOT / "weights" / card(path)["file"]).stat().st_size for path in CARDS}
    assert sum(sizes.values()) < 8e6, sizes


@pytest.mark.parametrize("path", CARDS, ids=lambda p: p.stem)
def test_the_shipped_weights_reproduce_their_recorded_scores(path, request):
    """`python train.py --eval-only weights/NAME.safetensors ...` as the card's check names it: the same
    accuracy to one image in the subset, the same losses to float32 noise across CPUs."""
    check = card(path)["check"]
    argv = list(check["argv"])
    if card(path)["dataset"] == "fashion-mnist":
        argv += ["--data-dir", str(request.getfixturevalue("fashion_mnist_dir"))]
    got = train.main([arg.replace("weights/", f"{ROOT}/weights/") for arg in argv])
    for key, recorded in check["scores"].items():
        if key.endswith("acc"):
            assert abs(got[key] - recorded) <= 1 / check["items"] + 1e-9, key
        else:
            assert math.isclose(got[key], recorded, rel_tol=1e-3), (key, got[key], recorded)


@pytest.mark.parametrize("path", CARDS, ids=lambda p: p.stem)
def test_torch_hub_loads_them_from_the_clone(path, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("torch.hub reached for the network")
    monkeypatch.setattr(torch.hub, "download_url_to_file", no_network)
    model = torch.hub.load(str(ROOT), ENTRY[path.stem], source="local", trust_repo=True)
    saved = load_checkpoint(str(ROOT / "weights" / card(path)["file"]), "weights")["model"]
    assert not model.training and model.state_dict().keys() == saved.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    fresh = torch.hub.load(str(ROOT), ENTRY[path.stem], source="local", pretrained=False, trust_repo=True)
    assert type(fresh) is type(model) and fresh.config == model.config


def test_torch_hub_lists_only_the_two_models():
    import hubconf  # torch.hub.list's rule: every public callable of hubconf.py is an entry point
    assert sorted(f for f in dir(hubconf) if callable(getattr(hubconf, f)) and not f.startswith("_")) == \
        sorted(ENTRY.values())


def test_a_weights_file_cannot_be_resumed_and_another_safetensors_file_is_named(tmp_path):
    weights = str(ROOT / "weights" / "revit-mini.safetensors")
    resumed = (r"not a training checkpoint of this project \(missing optimizer, step, rng\); "
               r"a .safetensors file holds weights only: continue a run from its ckpt.pt")
    with pytest.raises(SystemExit, match=resumed):
        train.main(["--resume", weights])
    from tools import export
    export.main([weights, "--depth", "4", "--format", "timm", "--out", str(tmp_path / "timm.safetensors")])
    expected = "format 'timm'; expected a checkpoint's weights .weights/. or a compact or folded export"
    with pytest.raises(SystemExit, match=expected):
        train.main(["--eval-only", str(tmp_path / "timm.safetensors")])


def test_an_export_of_the_shipped_weights_evaluates_as_they_do(tmp_path, fashion_mnist_dir):
    """train.py --eval-only of a compact export (every depth) is the weights' evaluation; of a folded one (a
    plain ViT of L blocks), the weights' at L (tests/test_export.py checks what the files carry)."""
    from tools import export
    weights, compact, folded = (str(ROOT / "weights" / "revit-mini.safetensors"),
                                str(tmp_path / "c.safetensors"), str(tmp_path / "f.safetensors"))
    export.main([weights, "--format", "compact", "--out", compact])
    export.main([compact, "--depth", "4", "--format", "safetensors", "--out", folded])  # a compact exports on
    evaluate = ["--test-subset", "200", "--data-dir", str(fashion_mnist_dir)]
    at_depth_4 = train.main(["--eval-only", weights, "--eval-depths", "4", *evaluate])["depths"]["4"]
    assert train.main(["--eval-only", compact, "--eval-depths", "4", *evaluate])["depths"]["4"] == at_depth_4
    assert math.isclose(train.main(["--eval-only", folded, *evaluate])["test_acc"], at_depth_4["acc"])


def test_packing_a_checkpoint_gives_the_same_weights_file(tmp_path):
    """The cards' packed_by command: save_weights of a checkpoint read back equal, readable by all."""
    from lib.weights import read_weights, save_weights
    shipped = read_weights(ROOT / "weights" / "revit-mini.safetensors")
    save_weights(shipped, tmp_path / "packed.safetensors")
    packed = read_weights(tmp_path / "packed.safetensors")
    assert packed.keys() == shipped.keys() and packed["train_config"] == shipped["train_config"]
    assert all(torch.equal(packed["model"][k], v) for k, v in shipped["model"].items())
    assert (tmp_path / "packed.safetensors").stat().st_mode & 0o044 == 0o044  # others may read it


def test_torch_hub_refuses_weights_that_are_not_finite(tmp_path, monkeypatch):
    """hubconf reads the weights itself (no lib/): it too refuses a NaN, as every reader does."""
    import hubconf
    from lib.weights import read_weights, save_weights
    ckpt = read_weights(ROOT / "weights" / "revit-mini.safetensors")
    ckpt["model"]["block.attn.proj.bias"][0] = float("nan")
    save_weights(ckpt, tmp_path / "revit-mini.safetensors")
    monkeypatch.setattr(hubconf, "WEIGHTS", tmp_path)
    with pytest.raises(ValueError, match="revit-mini.safetensors: its weights are not finite"):
        hubconf.revit_mini()
