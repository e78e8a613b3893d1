"""Dense probes (probes.py): metrics against hand-computed values, heads that learn on the
Fashion-MNIST proxy, a frozen backbone that stays bit-identical, and the feature cache."""
import math
import re
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import safetensors.torch
import torch

import alternet
from lib import checkpoint
from lib import data
from tools import probes
import revit
import train

ONE_LINE_ERROR = re.compile(r"^(\S+\.py|python -m [\w.]+): error: [^\n]+$")  # `prog: error: message`, nothing more

SMALL = dict(image_size=28, patch_size=7, in_channels=1, num_classes=10, dim=16, heads=2, ffn_dim=32, depth=4)


def save_backbone(path, arch="revit-mini", seed=0, **overrides):
    """A tiny randomly initialised backbone with the keys train.py's checkpoints have."""
    torch.manual_seed(seed)
    model = revit.create_model(arch, **{**SMALL, **overrides})
    torch.save({"model": model.state_dict(), "arch": arch, "model_config": asdict(model.config),
                "train_config": {"dataset": "fashion-mnist"}, "step": 0}, path)
    return path


def probe_cfg(backbone, data_dir, **overrides):
    base = dict(backbone=str(backbone), data_dir=str(data_dir), download=False, train_subset=512, test_subset=256,
                max_steps=60, batch_size=32, lr=1e-2, device="cpu")
    return probes.ProbeConfig(**{**base, **overrides})


# --- metrics against hand-computed values ---


def miou(pred, target, num_classes):
    return probes.mean_iou(probes.confusion_matrix(pred, target, num_classes))


def test_miou_with_ignore_index_and_an_empty_class():
    target = torch.tensor([[0, 0, 1], [1, 255, 2]])
    pred = torch.tensor([[0, 1, 1], [1, 2, 0]])
    # class 0: TP 1, FN 1 (pixel 2 -> 1), FP 1 (pixel 6 predicted 0) -> 1/3
    # class 1: TP 2, FP 1 -> 2/3;  class 2: TP 0, FN 1, FP 0 (the 2 on an ignored pixel does not count) -> 0
    # class 3: absent from target and prediction -> left out of the mean
    confusion = probes.confusion_matrix(pred, target, num_classes=4)
    assert confusion.sum() == 5  # the ignored pixel is dropped
    assert miou(pred, target, num_classes=4) == pytest.approx((1 / 3 + 2 / 3 + 0) / 3)
    assert miou(target.clamp(max=3), target, num_classes=4) == 1.0  # perfect on the scored pixels


def slow_scores(preds, targets, num_classes):
    """mIoU and pixel accuracy by their definitions, pixel by pixel over every image: per class
    |pred = c and target = c| / |pred = c or target = c| over scored pixels, averaged over the classes
    that occur in either."""
    pixels = [(int(p), int(t)) for pred, target in zip(preds, targets)
              for p, t in zip(pred.flatten(), target.flatten()) if t != probes.IGNORE_INDEX]
    ious = []
    for c in range(num_classes):
        union = sum(p == c or t == c for p, t in pixels)
        if union:
            ious.append(sum(p == c and t == c for p, t in pixels) / union)
    return sum(ious) / len(ious), sum(p == t for p, t in pixels) / len(pixels)


class FixedHead(torch.nn.Module):
    """A 'head' that returns the prediction stored for each image (its feature is the image's index)."""
    def __init__(self, predictions):
        super().__init__()
        self.predictions = predictions

    def forward(self, features, size):
        return self.predictions[features[:, 0, 0].long()]


def test_dense_metrics_count_every_pixel_once():
    """Images of different sizes of scored area, a class absent from one image and from the whole
    data, and batches of 2: mIoU is per class over every pixel (not the global IoU of all classes
    pooled, not a mean of per-image or per-batch mIoUs, not counting the absent class as 0); RMSE
    and delta < 1.25 are over every valid pixel (not a mean of per-image RMSEs), delta two-sided."""
    g = torch.Generator().manual_seed(0)
    targets = torch.randint(0, 3, (5, 6, 6), generator=g)
    targets[0, :, :4] = probes.IGNORE_INDEX  # image 0: few scored pixels
    targets[1][targets[1] == 2] = 0  # class 2 absent from image 1; class 3 absent everywhere
    right = torch.tensor([0.95, 0.9, 0.3, 0.5, 0.2])[:, None, None]  # each image its share of right pixels
    preds = torch.where(torch.rand(5, 6, 6, generator=g) < right, targets.clamp(max=2),
                        torch.randint(0, 3, (5, 6, 6), generator=g))
    data = probes.DenseData("test", "seg", None, None, num_classes=4)
    feats = torch.arange(5.0)[:, None, None].expand(5, 1, 1)
    logits = torch.nn.functional.one_hot(preds, 4).permute(0, 3, 1, 2).float()
    scores = probes.evaluate_head(FixedHead(logits), feats, targets, data, batch_size=2, device="cpu")
    expected_miou, expected_acc = slow_scores(preds, targets, 4)
    assert scores["miou"] == pytest.approx(expected_miou, rel=1e-12)
    assert scores["pixel_acc"] == pytest.approx(expected_acc, rel=1e-6)  # a float32 ratio
    per_image = sum(slow_scores(p[None], t[None], 4)[0] for p, t in zip(preds, targets)) / 5
    per_batch = sum(slow_scores(preds[i:i + 2], targets[i:i + 2], 4)[0] for i in (0, 2, 4)) / 3
    pooled = probes.confusion_matrix(preds, targets, 4).double()
    pooled = pooled.trace() / (pooled.sum(0) + pooled.sum(1) - pooled.diagonal()).sum()
    for wrong in (per_image, per_batch, pooled.item(), expected_miou * 3 / 4):  # the input tells these apart
        assert abs(wrong - expected_miou) > 0.01

    depth = 1 + torch.rand(5, 6, 6, generator=g)
    depth[0, :, :4] = float("nan")  # image 0: few valid pixels
    depth[2, 0] = 0.0
    guess = depth.nan_to_num(1.0) * (0.6 + 0.8 * torch.rand(5, 6, 6, generator=g))  # above and below by 40%
    data = probes.DenseData("test", "monodepth", None, None)
    scores = probes.evaluate_head(FixedHead(guess[:, None]), feats, depth, data, batch_size=2, device="cpu")
    valid = [(float(p), float(t)) for p, t in zip(guess.flatten(), depth.flatten()) if t == t and t > 0]
    rmse = math.sqrt(sum((p - t) ** 2 for p, t in valid) / len(valid))
    delta1 = sum(max(p / t, t / p) < 1.25 for p, t in valid) / len(valid)
    assert scores["rmse"] == pytest.approx(rmse, rel=1e-9)
    assert scores["delta1"] == pytest.approx(delta1, rel=1e-12)
    one_sided = sum(p / t < 1.25 for p, t in valid) / len(valid)
    per_image_rmse = sum(probes.metrics_of(probes.depth_map_sums(p, t), data)["rmse"]
                         for p, t in zip(guess, depth)) / 5
    assert abs(one_sided - delta1) > 0.05 and abs(per_image_rmse - rmse) > 1e-3


def test_rmse_and_delta_skip_invalid_pixels():
    target = torch.tensor([[1.0, 2.0], [0.0, float("nan")]])  # 0 and NaN: no measurement
    pred = torch.tensor([[1.5, 2.0], [9.0, 9.0]])
    data = probes.DenseData("test", "monodepth", None, None)
    metrics = probes.metrics_of(probes.depth_map_sums(pred, target), data)
    assert metrics["rmse"] == pytest.approx(math.sqrt(0.25 / 2))
    assert metrics["delta1"] == pytest.approx(0.5)  # 1.5/1 >= 1.25; 2/2 < 1.25


def test_proxy_targets():
    images = torch.tensor([0, 25, 26, 140, 255], dtype=torch.uint8).view(1, 1, 1, 5)
    assert probes.proxy_targets(images, "seg").tolist() == [[[0, 0, 1, 2, 4]]]
    assert probes.proxy_targets(images, "monodepth")[0, 0, -1].item() == 2.0


def test_heads_upsample_to_pixels():
    feats = torch.randn(2, 16, 8)  # (B, P = 4x4, d)
    assert probes.DenseHead(8, 5, grid=4)(feats, (28, 28)).shape == (2, 5, 28, 28)
    assert probes.DenseHead(8, 1, grid=4, hidden=12)(feats, (28, 28)).shape == (2, 1, 28, 28)


# --- probe runs on the Fashion-MNIST proxy ---


def test_seg_probe_beats_constant_and_leaves_backbone_untouched(tmp_path, fashion_mnist_dir, monkeypatch):
    path = save_backbone(tmp_path / "backbone.pt")
    loaded = {}

    load = checkpoint.load_vision_model

    def load_and_snapshot(*args):  # the very module the probe uses, and a copy of it as loaded
        model, ckpt = load(*args)
        loaded["model"], loaded["before"] = model, {k: v.clone() for k, v in model.state_dict().items()}
        return model, ckpt
    monkeypatch.setattr(checkpoint, "load_vision_model", load_and_snapshot)
    summary = probes.run(probe_cfg(path, fashion_mnist_dir, probe="seg", eval_depths="2,6"))
    assert summary["test_miou"] > summary["constant"]["miou"] + 0.05
    assert summary["test_pixel_acc"] > summary["constant"]["pixel_acc"]
    assert set(summary["depths"]) == {"2", "4", "6"}  # reference depth 4 plus the requested ones
    assert all(0 <= r["miou"] <= 1 for r in summary["depths"].values())
    after = loaded["model"].state_dict()
    assert all(torch.equal(loaded["before"][k], after[k]) for k in after)  # parameters and buffers
    assert all(p.grad is None for p in loaded["model"].parameters())
    table = probes.results_table(summary)
    assert "| 4 (trained) |" in table and "| constant |" in table


def test_feature_extraction_does_not_change_the_backbone(tmp_path, fashion_mnist_dir):
    model = revit.create_model("revit-mini", **SMALL, depth_drop=0.5)
    model.train()  # extract_features must switch to eval (no elastic depth) and never touch the weights
    before = {k: v.clone() for k, v in model.state_dict().items()}
    images = data.load_fashion_mnist(fashion_mnist_dir)[1][0][:8]
    a = probes.extract_features(model, images, [0.286], [0.353], 3, 4, "cpu")
    b = probes.extract_features(model, images, [0.286], [0.353], 3, 8, "cpu")
    assert torch.equal(a, b)  # deterministic, batch-size independent up to fp16 storage
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_monodepth_probe_linear_and_mlp_beat_constant(tmp_path, fashion_mnist_dir):
    path = save_backbone(tmp_path / "vit.pt", arch="vit-mini")
    summary = probes.run(probe_cfg(path, fashion_mnist_dir, probe="monodepth"))
    for head in ("linear", "mlp"):
        assert summary[f"test_rmse_{head}"] < 0.8 * summary["constant"][f"rmse_{head}"]
        assert 0 <= summary[f"test_delta1_{head}"] <= 1


def test_feature_cache_gives_the_same_result(tmp_path, fashion_mnist_dir):
    path = save_backbone(tmp_path / "backbone.pt", arch="raptor-mini-k2")
    cache = tmp_path / "cache"
    kwargs = dict(probe="seg", eval_depths="3", train_subset=128, test_subset=64, max_steps=10)
    plain = probes.run(probe_cfg(path, fashion_mnist_dir, **kwargs))
    first = probes.run(probe_cfg(path, fashion_mnist_dir, probe_cache=str(cache), **kwargs))
    entries = sorted(cache.iterdir())
    assert len(entries) == 3  # train features at depth 4, test features at depths 4 and 3
    second = probes.run(probe_cfg(path, fashion_mnist_dir, probe_cache=str(cache), **kwargs))
    assert sorted(cache.iterdir()) == entries  # read, not recomputed
    assert plain["depths"] == first["depths"] == second["depths"]


@pytest.mark.parametrize("task", ["seg", "monodepth"])
def test_probes_with_the_backbone_on_a_device(tmp_path, fashion_mnist_dir, monkeypatch, task):
    """Feature extraction, head training and evaluation with backbone and heads on an accelerator, here
    device_check's CPU stand-in: a tensor built on the CPU and mixed with the device's raises there, as
    on a GPU. Same numbers as on the CPU."""
    from device_check import FAKE, OnFakeDevice
    path = save_backbone(tmp_path / "backbone.pt")
    kwargs = dict(probe=task, eval_depths="2", train_subset=64, test_subset=32, max_steps=3, batch_size=16)
    on_cpu = probes.run(probe_cfg(path, fashion_mnist_dir, **kwargs))
    monkeypatch.setattr(probes, "pick_device", lambda name: FAKE)
    with OnFakeDevice():
        on_device = probes.run(probe_cfg(path, fashion_mnist_dir, **kwargs))
    assert on_device["depths"] == on_cpu["depths"] and on_device["constant"] == on_cpu["constant"]


def test_cli_writes_results_and_rejects_bad_input(tmp_path, fashion_mnist_dir, capsys):
    path = save_backbone(tmp_path / "vit.pt", arch="vit-mini")
    args = ["--backbone", str(path), "--data-dir", str(fashion_mnist_dir), "--no-download", "--device", "cpu",
            "--train-subset", "64", "--test-subset", "32", "--max-steps", "3", "--batch-size", "16"]
    for _ in range(2):  # a re-run into the same --out-dir replaces its own earlier output
        probes.main(["--probe", "seg", *args, "--out-dir", str(tmp_path / "run")])
    assert (tmp_path / "run" / "probe_results.json").is_file()
    heads = safetensors.torch.load_file(tmp_path / "run" / "probe_heads.safetensors")
    assert heads["linear.net.weight"].shape == (1 + probes.PROXY_LEVELS, 16)
    with pytest.raises(SystemExit, match="untied ViT"):  # a plain ViT runs only its own depth
        probes.main(["--probe", "seg", *args, "--eval-depths", "2"])
    with pytest.raises(SystemExit, match="--probe"):
        probes.main(["--probe", "cls", *args])
    with pytest.raises(SystemExit, match="not a dense data set"):
        probes.main(["--probe", "seg", *args, "--data", str(tmp_path)])


def test_tensor_file_format(tmp_path):
    path = save_backbone(tmp_path / "backbone.pt")
    g = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        images = torch.randint(0, 256, (40, 1, 28, 28), dtype=torch.uint8, generator=g)
        labels = (images[:, 0] > 128).long()
        labels[:, :2] = probes.IGNORE_INDEX
        torch.save({"images": images, "labels": labels, "num_classes": 2}, tmp_path / f"{split}.pt")
    summary = probes.run(probes.ProbeConfig(probe="seg", backbone=str(path), data=str(tmp_path), max_steps=5,
                                            batch_size=8, device="cpu"))
    assert summary["data"].endswith("(tensor files)") and summary["train_images"] == 40


def test_a_metric_that_is_not_a_number_stops_the_probe_and_is_never_written(tmp_path):
    """Every test pixel ignored: mIoU is the mean over no class (NaN). Like a non-finite loss in train.py, it
    stops the probe with one line naming the metric, and neither the results nor the heads are written."""
    path = save_backbone(tmp_path / "backbone.pt")
    g = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        images = torch.randint(0, 256, (16, 1, 28, 28), dtype=torch.uint8, generator=g)
        labels = (images[:, 0] > 128).long()
        if split == "val":
            labels[:] = probes.IGNORE_INDEX
        torch.save({"images": images, "labels": labels, "num_classes": 2}, tmp_path / f"{split}.pt")
    with pytest.raises(SystemExit) as info:
        probes.run(probes.ProbeConfig(probe="seg", backbone=str(path), data=str(tmp_path), max_steps=2,
                                      batch_size=8, device="cpu", out_dir=str(tmp_path / "run")))
    assert ONE_LINE_ERROR.match(str(info.value)) and "the metric test_miou is not finite" in str(info.value)
    assert not (tmp_path / "run").exists()
    for split, depth in (("train", torch.rand(16, 28, 28) + 1), ("val", torch.zeros(16, 28, 28))):
        torch.save({"images": images, "depth": depth}, tmp_path / f"{split}.pt")  # no valid test depth
    with pytest.raises(SystemExit) as info:
        probes.run(probes.ProbeConfig(probe="monodepth", backbone=str(path), data=str(tmp_path), max_steps=2,
                                      batch_size=8, device="cpu", out_dir=str(tmp_path / "run")))
    assert ONE_LINE_ERROR.match(str(info.value)) and "the metric test_rmse_linear is not finite" in str(info.value)


def test_dense_probes_have_one_entry_point(tmp_path, fashion_mnist_dir):
    """python -m tools.probes runs the dense probes; train.py names it in one line (it trains --probe cls) and
    imports none of the tools, at any level (no import cycle: probes.py imports train.py)."""
    import ast
    path = save_backbone(tmp_path / "backbone.pt")
    args = ["--probe", "monodepth", "--backbone", str(path), "--data-dir", str(fashion_mnist_dir), "--no-download",
            "--device", "cpu", "--train-subset", "64", "--test-subset", "32", "--max-steps", "3",
            "--batch-size", "16", "--eval-depths", "2"]
    summary = probes.main([*args, "--probe-cache", str(tmp_path / "cache"), "--out-dir", str(tmp_path / "run")])
    assert set(summary["depths"]) == {"2", "4"} and (tmp_path / "run" / "probe_results.json").is_file()
    assert summary["probe"] == "monodepth"
    for probe in ("seg", "monodepth"):
        with pytest.raises(SystemExit) as info:
            train.main(["--probe", probe, "--backbone", str(path), "--out-dir", str(tmp_path / "train")])
        assert ONE_LINE_ERROR.match(str(info.value)) and \
            f"--probe {probe} is a dense probe: python -m tools.probes --probe {probe} --backbone CKPT" in str(info.value)
    assert not (tmp_path / "train").exists()
    source = ast.parse((Path(train.__file__)).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(source) if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])}
    assert not imported & {"probes", "analyze", "export", "bench", "sweep"}, imported


def write_png_pairs(root, task):
    """A few random images and targets in the ADE20k (seg) or NYUv2 official-split (depth) layout."""
    import numpy as np
    Image = pytest.importorskip("PIL.Image", reason="Pillow not installed (an optional extra: pip install -r requirements-extra.txt)")
    rng = np.random.default_rng(0)
    for split in (("training", "validation") if task == "seg" else ("train", "test")):
        for i in range(8):
            image = Image.fromarray(rng.integers(0, 256, (40, 50), dtype=np.uint8))
            if task == "seg":
                (root / "images" / split).mkdir(parents=True, exist_ok=True)
                (root / "annotations" / split).mkdir(parents=True, exist_ok=True)
                image.save(root / "images" / split / f"ADE_{i}.jpg")
                Image.fromarray(rng.integers(0, 151, (40, 50), dtype=np.uint8)).save(
                    root / "annotations" / split / f"ADE_{i}.png")
            else:
                scene = root / "official_splits" / split / "kitchen"
                scene.mkdir(parents=True, exist_ok=True)
                image.save(scene / f"rgb_{i:05d}.jpg")
                Image.fromarray(rng.integers(0, 10000, (40, 50)).astype(np.uint16)).save(
                    scene / f"sync_depth_{i:05d}.png")


@pytest.mark.parametrize("task", ["seg", "monodepth"])
def test_ade20k_and_nyuv2_layouts(tmp_path, task):
    write_png_pairs(tmp_path / "data", task)
    path = save_backbone(tmp_path / "backbone.pt")
    summary = probes.run(probes.ProbeConfig(probe=task, backbone=str(path), data=str(tmp_path / "data"),
                                            max_steps=2, batch_size=4, device="cpu"))
    assert summary["data"] == ("ADE20k" if task == "seg" else "NYUv2") and summary["test_images"] == 8


def test_public_layouts_without_pillow_say_what_to_install(tmp_path, monkeypatch):
    for split in ("training", "validation"):
        (tmp_path / "images" / split).mkdir(parents=True)
        (tmp_path / "annotations" / split).mkdir(parents=True)
        (tmp_path / "images" / split / "a.jpg").write_bytes(b"")
    path = save_backbone(tmp_path / "backbone.pt")
    monkeypatch.setitem(sys.modules, "PIL", None)  # `from PIL import Image` now raises ImportError
    with pytest.raises(SystemExit, match="needs Pillow"):
        probes.run(probes.ProbeConfig(probe="seg", backbone=str(path), data=str(tmp_path), device="cpu"))


# --- every bad input: one line naming it, before anything is written ---


def bad_files(tmp_path):
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    torch.save({"model": {}, "note": tmp_path}, tmp_path / "pickled.pt")  # a pickled Python object
    lm = alternet.create_model("alternet-tiny", dim=16, heads=2, ffn_dim=16, num_experts=2, seq_len=8)
    torch.save({"model": lm.state_dict(), "arch": "alternet-tiny", "model_config": asdict(lm.config)},
               tmp_path / "language.pt")
    for name, blob in (("garbage_data", None), ("list_data", [1, 2]), ("no_labels", {"images": torch.zeros(2)})):
        (tmp_path / name).mkdir()
        for split in ("train", "val"):
            if blob is None:
                (tmp_path / name / f"{split}.pt").write_bytes(b"not a tensor file")
            else:
                torch.save(blob, tmp_path / name / f"{split}.pt")
    (tmp_path / "file").write_text("")


@pytest.mark.parametrize("flags, needle", [
    (dict(backbone="{tmp}/missing.pt"), "--backbone {tmp}/missing.pt: no such file"),
    (dict(backbone="{tmp}/garbage.pt"), "--backbone {tmp}/garbage.pt: not a PyTorch file"),
    (dict(backbone="{tmp}/pickled.pt"), "--backbone {tmp}/pickled.pt: it stores the Python object pathlib"),
    (dict(backbone="{tmp}/language.pt"), "--backbone {tmp}/language.pt: holds the language model alternet-tiny"),
    (dict(probe="depth"), "got 'depth' (monocular depth is monodepth; --depth sets the backbone's steps)"),
    (dict(probe="mean"), "got 'mean' (mean pooling is train.py's --probe cls --probe-pool mean)"),
    (dict(lr=float("nan")), "--lr must be a finite number; got nan"),
    (dict(lr=-1.0), "--lr must be in (0, 10]; got -1.0"),
    (dict(weight_decay=-0.1), "--weight-decay must be in 0..10; got -0.1"),
    (dict(batch_size=0), "--batch-size must be in 1..1,048,576; got 0"),
    (dict(max_steps=0, epochs=0), "--epochs must be > 0 (or give --max-steps); got 0"),
    (dict(train_subset=-5), "--train-subset must be in 0..1,000,000,000; got -5"),
    (dict(depth=0), "--depth must be in 1..256; got 0"),
    (dict(max_steps=10 ** 30), "--max-steps must be in 0..1,000,000,000; got 100000...(31 digits)"),
    (dict(eval_batch_size=10 ** 30), "--eval-batch-size must be in 1..1,048,576"),
    (dict(lr=1e308), "--lr must be in (0, 10]; got 1e+308"),
    (dict(eval_depths="2,x"), "--eval-depths must be comma-separated integers"),
    (dict(device="tpu:7"), "--device 'tpu:7': not a device"),
    (dict(data="{tmp}/nowhere"), "--data {tmp}/nowhere: no such folder"),
    (dict(data="{tmp}/garbage_data"), "--data {tmp}/garbage_data/train.pt: not a PyTorch file"),
    (dict(data="{tmp}/list_data"), "--data {tmp}/list_data/train.pt: needs a dict with the tensors 'images' (uint8"),
    (dict(data="{tmp}/no_labels"), "and 'labels' (N x H x W) for --probe seg"),
    (dict(probe_cache="{tmp}/file"), "--probe-cache {tmp}/file is a file"),
    (dict(out_dir="{tmp}/file"), "--out-dir {tmp}/file is a file"),
])
def test_bad_input_gives_one_line_and_writes_nothing(tmp_path, fashion_mnist_dir, flags, needle):
    bad_files(tmp_path)
    flags = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in flags.items()}
    outputs = dict(probe_cache=str(tmp_path / "cache"), out_dir=str(tmp_path / "run"))
    cfg = probe_cfg(flags.pop("backbone", save_backbone(tmp_path / "backbone.pt")), fashion_mnist_dir,
                    **{**outputs, **flags})
    with pytest.raises(SystemExit) as info:
        probes.run(cfg)
    message = str(info.value)
    assert ONE_LINE_ERROR.match(message) and needle.format(tmp=tmp_path) in message, message
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()
