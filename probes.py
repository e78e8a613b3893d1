"""Dense frozen-backbone probes: semantic segmentation (mIoU) and depth (RMSE) on patch tokens.

    python probes.py --probe seg --backbone out/revit-mini/ckpt.pt --eval-depths 2,4,8
    python probes.py --probe depth --backbone ckpt.pt --data /datasets/nyu_depth_v2 --probe-cache cache/
    python train.py --probe seg|depth --backbone CKPT ...     # the same run, once train.py dispatches here

The reViT paper's Table 2 / Appendix A.3 "Frozen-backbone evaluation": the encoder stays frozen and
is read out by an ADE20k linear segmentation head and by linear and two-layer MLP depth heads on
NYUv2 (RMSE in metres). Here, for any checkpoint of this project (reViT at any depth, ViT, Raptor,
the MoE baselines):
- features: out["tokens"][:, 1:], the final-LayerNorm patch tokens, computed once per (checkpoint,
  depth, data) under no_grad with the backbone in eval mode; optionally cached on disk (safetensors);
- seg: a linear map per patch token to class logits, upsampled bilinearly to pixel resolution,
  per-pixel cross-entropy with an ignore index; reported as mIoU (and pixel accuracy);
- depth: a linear and a two-layer MLP head per patch token, upsampled bilinearly, trained with a
  squared error on valid pixels; reported as RMSE and the accuracy delta < 1.25;
- the heads are trained at one depth (--depth, default the backbone's reference depth) and the same
  heads are evaluated at every --eval-depths, as train.py's classification probe does, so the
  elastic-depth curve of Fig. 2 can be drawn for dense tasks; a constant predictor is the baseline row.
Simplifications (stated, not the paper's protocol of Jacobs et al., 2026): images and label maps are
resized to the backbone's square input size and scored at that resolution (no sliding window, no
Eigen crop or depth cap for NYUv2); no augmentation; AdamW with a cosine schedule on fixed features.

Data (--data ROOT; without it: the Fashion-MNIST dense proxy). Formats, detected in this order:
1. tensor files, no Pillow needed: ROOT/train.pt and ROOT/val.pt, each a dict of tensors
   (torch.save, read with weights_only=True):
       "images": uint8 (N, C, H, W)   H = W = the backbone's image_size
       "labels": int64 (N, H, W)      seg: class ids 0..K-1, 255 = ignore;  plus "num_classes": int
    or "depth":  float32 (N, H, W)    depth: metres, NaN or 0 = no measurement
2. ADE20k (ADEChallengeData2016 as released): ROOT/images/{training,validation}/*.jpg and
   ROOT/annotations/{training,validation}/*.png; annotation 0 ("other") is ignored, 1..150 become
   classes 0..149 (the usual reduce-zero-label convention). Needs Pillow.
3. NYUv2, the official-split export used by BTS / AdaBins / DINOv2 depth evaluation:
   ROOT/official_splits/{train,test}/<scene>/rgb_XXXXX.jpg with sync_depth_XXXXX.png (uint16,
   millimetres, 0 = invalid). Needs Pillow.
4. image folders: ROOT/{train,val}/images/<name>.png|jpg with ROOT/{train,val}/labels/<name>.png
   (class id per pixel, 255 = ignore) or ROOT/{train,val}/depth/<name>.png (uint16 millimetres).
   Needs Pillow.

The Fashion-MNIST dense proxy (offline work and tests; NOT a segmentation or depth benchmark):
real Fashion-MNIST images, with targets computed from the pixels themselves -- seg: background
(pixel < 26/255) plus 4 classes of quantised intensity (5 classes); depth: 1 + intensity in [1, 2]
(arbitrary units). It checks that the machinery works and that patch tokens carry spatial detail.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

import train
from data import NORMALISATION, epoch_order, load_images
from train import fail, opt

DENSE_PROBES = ("seg", "depth")
IGNORE_INDEX = 255         # label value never scored (ADE20k's "other", unlabelled pixels)
PROXY_BACKGROUND = 26      # Fashion-MNIST proxy: pixels below ~0.1 are background
PROXY_LEVELS = 4           # ... and the rest falls into 4 intensity classes
DELTA_MIN_DEPTH = 1e-3     # predictions are clamped to this before the ratio of delta < 1.25


# Training defaults of a dense probe; train.py applies them over its own when --probe is seg|depth.
DEFAULTS = dict(epochs=10, batch_size=64, lr=1e-2, weight_decay=0.0)  # lr: a 1e-3..3e-2 sweep on the proxy


@dataclass
class ProbeConfig:
    """The flags of `python probes.py`; the same names as train.py's TrainConfig, which run() also accepts."""
    probe: str = opt("seg", "seg (linear segmentation head, mIoU) | depth (linear and MLP depth heads, RMSE)")
    backbone: str = opt("", "checkpoint of the frozen backbone (any vision checkpoint of this project)")
    depth: int | None = opt(None, "train the heads on the backbone's tokens at this depth (auto: its reference depth)")
    eval_depths: str = opt("", "comma-separated further depths to evaluate the trained heads at, e.g. 2,4,8")
    data: str = opt("", "dense data root (tensor files, ADE20k, NYUv2 or image folders; see the module "
                        "docstring); auto: the Fashion-MNIST dense proxy")
    data_dir: str = opt("", "where Fashion-MNIST lives for the proxy (auto: ./data, $REVIT_DATA_DIR, "
                            "/usr/share/datasets)")
    download: bool = opt(True, "download Fashion-MNIST when no search location has it")
    train_subset: int = opt(0, "use only the first N training images (0: all)")
    test_subset: int = opt(0, "evaluate on only the first N test images (0: all)")
    epochs: int | None = opt(DEFAULTS["epochs"], "epochs over the training images")
    max_steps: int = opt(0, "optimizer steps; overrides --epochs when > 0")
    batch_size: int = opt(DEFAULTS["batch_size"], "images per optimizer step")
    lr: float | None = opt(DEFAULTS["lr"], "peak AdamW learning rate (cosine decay to 1e-5 x lr; used as given)")
    weight_decay: float = opt(DEFAULTS["weight_decay"], "AdamW weight decay of the heads")
    eval_batch_size: int = opt(256, "images per batch in feature extraction and evaluation")
    probe_cache: str = opt("", "folder caching backbone features, keyed by checkpoint hash, depth and data "
                               "(empty: recompute every run)")
    seed: int = opt(0, "random seed: head init and data order")
    device: str = opt("auto", "auto | cpu | cuda | cuda:N")
    out_dir: str = opt("", "write probe_results.json and probe_heads.pt here (empty: print only)")


def build_parser() -> argparse.ArgumentParser:
    return train.dataclass_parser(ProbeConfig, __doc__.split("\n\n")[0])


# --- metrics (numerators and denominators accumulate over batches; the ratio is taken once) ---


def confusion_matrix(pred: torch.Tensor, target: torch.Tensor, num_classes: int,
                     ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """(K, K) pixel counts, rows = true class, columns = predicted class; ignored pixels dropped."""
    keep = target != ignore_index
    target, pred = target[keep].long(), pred[keep].long()
    if target.numel() and (target.min() < 0 or target.max() >= num_classes):
        raise ValueError(f"labels must be in 0..{num_classes - 1} or {ignore_index} (ignore)")
    return torch.bincount(target * num_classes + pred, minlength=num_classes ** 2).view(num_classes, num_classes)


def mean_iou(confusion: torch.Tensor) -> float:
    """Mean over classes of TP / (TP + FP + FN); a class absent from both prediction and target
    (union 0) is left out of the mean (the mmsegmentation convention)."""
    confusion = confusion.double()
    intersection = confusion.diagonal()
    union = confusion.sum(0) + confusion.sum(1) - intersection
    present = union > 0
    return (intersection[present] / union[present]).mean().item() if present.any() else float("nan")


def miou(pred, target, num_classes: int, ignore_index: int = IGNORE_INDEX) -> float:
    return mean_iou(confusion_matrix(pred, target, num_classes, ignore_index))


def depth_sums(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[sum of squared errors, pixels with delta < 1.25, valid pixels] over pixels with a finite
    target > 0 (NYUv2 marks missing measurements with 0; we also accept NaN)."""
    valid = torch.isfinite(target) & (target > 0)
    pred, target = pred[valid].double(), target[valid].double()
    ratio = torch.maximum(pred.clamp(min=DELTA_MIN_DEPTH) / target, target / pred.clamp(min=DELTA_MIN_DEPTH))
    return torch.stack([((pred - target) ** 2).sum(), (ratio < 1.25).sum().double(),
                        torch.tensor(float(valid.sum()), dtype=torch.float64)])


def depth_metrics(sums: torch.Tensor) -> dict:
    squared_error, within, count = sums.tolist()
    return {"rmse": math.sqrt(squared_error / count), "delta1": within / count}


def rmse(pred, target) -> float:
    return depth_metrics(depth_sums(pred, target))["rmse"]


# --- heads: per patch token, then bilinear upsampling to pixel resolution ---


class SegmentationHead(nn.Module):
    """Linear per-patch classifier; logits (not probabilities) are upsampled, as in DINOv2's linear head."""

    def __init__(self, dim: int, num_classes: int, grid: int):
        super().__init__()
        self.grid = grid
        self.linear = nn.Linear(dim, num_classes)
        nn.init.trunc_normal_(self.linear.weight, std=0.01)
        nn.init.zeros_(self.linear.bias)

    def forward(self, features: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        logits = rearrange(self.linear(features.float()), "b (h w) k -> b k h w", h=self.grid)
        return F.interpolate(logits, size=size, mode="bilinear", align_corners=False)  # (B, K, H, W)


class DepthHead(nn.Module):
    """One depth value per patch token: linear (hidden=0) or Linear-GELU-Linear; upsampled bilinearly."""

    def __init__(self, dim: int, grid: int, hidden: int = 0, init_depth: float = 0.0):
        super().__init__()
        self.grid = grid
        self.net = nn.Linear(dim, 1) if hidden == 0 else nn.Sequential(
            nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, 1))
        last = self.net if hidden == 0 else self.net[-1]
        nn.init.trunc_normal_(last.weight, std=0.01)
        nn.init.constant_(last.bias, init_depth)  # start at the mean depth: the constant baseline

    def forward(self, features: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        depth = rearrange(self.net(features.float()), "b (h w) 1 -> b 1 h w", h=self.grid)
        return F.interpolate(depth, size=size, mode="bilinear", align_corners=False)[:, 0]  # (B, H, W)


def segmentation_loss(logits, target):
    return F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX)


def depth_loss(pred, target):
    """Mean squared error over valid pixels (the reported metric is its square root)."""
    valid = torch.isfinite(target) & (target > 0)
    return ((pred - target.nan_to_num()) ** 2 * valid).sum() / valid.sum().clamp(min=1)


# --- data ---


@dataclass
class DenseSplit:
    images: torch.Tensor    # (N, C, H, W) uint8
    targets: torch.Tensor   # (N, H, W) int64 class ids (IGNORE_INDEX = unscored) or float32 depth (NaN/0 = none)


@dataclass
class DenseData:
    name: str               # shown in the results, e.g. "Fashion-MNIST dense proxy"
    task: str               # "seg" | "depth"
    train: DenseSplit
    test: DenseSplit
    num_classes: int = 0    # seg only
    unit: str = "m"         # depth unit


def proxy_targets(images: torch.Tensor, task: str) -> torch.Tensor:
    """Targets of the Fashion-MNIST proxy from the pixels: (N, 1, H, W) uint8 -> (N, H, W)."""
    x = images[:, 0].long()
    if task == "seg":  # 0 background, 1..PROXY_LEVELS quantised intensity
        level = 1 + (x - PROXY_BACKGROUND) * PROXY_LEVELS // (256 - PROXY_BACKGROUND)
        return torch.where(x < PROXY_BACKGROUND, 0, level)
    return 1.0 + x.float() / 255  # depth in [1, 2], positive so that delta < 1.25 is defined


def load_proxy(cfg, task: str) -> DenseData:
    """Real Fashion-MNIST images via train.py's loader, dense targets derived from them (a proxy)."""
    dataset = getattr(cfg, "dataset", "") or "fashion-mnist"
    if dataset != "fashion-mnist":
        fail(f"without --data the dense probes use the Fashion-MNIST proxy; --dataset {dataset} has no dense "
             f"labels (give --data ROOT with a dense data set, see probes.py)")
    try:
        images = load_images("fashion-mnist", data_dir=cfg.data_dir, download=cfg.download,
                             train_subset=cfg.train_subset, test_subset=cfg.test_subset)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    splits = [DenseSplit(s.images, proxy_targets(s.images, task)) for s in (images.train, images.test)]
    return DenseData("Fashion-MNIST dense proxy", task, *splits,
                     num_classes=1 + PROXY_LEVELS if task == "seg" else 0, unit="a.u.")


def require_pil():
    try:
        from PIL import Image
    except ImportError:
        fail("reading ADE20k / NYUv2 / image-folder data needs Pillow (pip install pillow), or convert it to "
             "the tensor format (ROOT/train.pt, ROOT/val.pt; see probes.py)")
    return Image


def read_pairs(pairs: list, task: str, size: int, channels: int, label_map=None) -> DenseSplit:
    """(image file, target file) pairs -> tensors at size x size (bicubic images, nearest targets)."""
    import numpy as np
    Image = require_pil()
    images, targets = [], []
    for image_path, target_path in pairs:
        image = Image.open(image_path).convert("RGB" if channels == 3 else "L").resize((size, size), Image.BICUBIC)
        target = np.asarray(Image.open(target_path).resize((size, size), Image.NEAREST))
        images.append(torch.from_numpy(np.array(image)).reshape(size, size, channels).permute(2, 0, 1))
        if task == "seg":
            labels = torch.from_numpy(target.astype(np.int64))
            targets.append(label_map(labels) if label_map else labels)
        else:  # uint16 millimetres, 0 = no measurement
            depth = torch.from_numpy(target.astype(np.float32)) / 1000
            targets.append(torch.where(depth > 0, depth, torch.nan))
    if not images:
        fail(f"no {task} image pairs found")
    return DenseSplit(torch.stack(images), torch.stack(targets))


def subset(items: list, n: int) -> list:
    return items[:n] if n else items


def load_dense(cfg, task: str, size: int, channels: int) -> DenseData:
    """--data ROOT in one of the four documented formats (module docstring); None of them: an error."""
    root = Path(cfg.data)
    if (root / "train.pt").is_file() and (root / "val.pt").is_file():
        splits = []
        for name, n in (("train", cfg.train_subset), ("val", cfg.test_subset)):
            blob = torch.load(root / f"{name}.pt", map_location="cpu", weights_only=True)
            key = "labels" if task == "seg" else "depth"
            if key not in blob or "images" not in blob:
                fail(f"{root / name}.pt needs the tensors 'images' and '{key}' for --probe {task}")
            images, targets = blob["images"][:n or None], blob[key][:n or None]
            if images.dtype != torch.uint8 or images.ndim != 4 or targets.shape != images[:, 0].shape:
                fail(f"{root / name}.pt: images must be uint8 (N, C, H, W) and {key} (N, H, W)")
            splits.append(DenseSplit(images, targets.long() if task == "seg" else targets.float()))
        num_classes = int(blob.get("num_classes", 0)) if task == "seg" else 0
        if task == "seg" and not num_classes:
            fail(f"{root}/val.pt needs 'num_classes' (an int) for --probe seg")
        return DenseData(f"{root.name} (tensor files)", task, *splits, num_classes=num_classes)
    ade = root / "ADEChallengeData2016" if (root / "ADEChallengeData2016").is_dir() else root
    if (ade / "annotations" / "training").is_dir():
        if task != "seg":
            fail(f"{root} is ADE20k (segmentation); --probe depth needs depth maps (e.g. NYUv2)")
        reduce_zero = lambda labels: torch.where(labels == 0, IGNORE_INDEX, labels - 1)  # noqa: E731
        splits = [read_pairs(subset([(p, ade / "annotations" / split / f"{p.stem}.png")
                                     for p in sorted((ade / "images" / split).glob("*.jpg"))], n),
                             task, size, channels, reduce_zero)
                  for split, n in (("training", cfg.train_subset), ("validation", cfg.test_subset))]
        return DenseData("ADE20k", task, *splits, num_classes=150)
    nyu = root / "official_splits" if (root / "official_splits").is_dir() else root
    if (nyu / "test").is_dir() and next((nyu / "test").rglob("sync_depth_*.png"), None):
        if task != "depth":
            fail(f"{root} is NYUv2 (depth); --probe seg needs label maps (e.g. ADE20k)")
        splits = [read_pairs(subset([(p, p.with_name(p.name.replace("rgb_", "sync_depth_")).with_suffix(".png"))
                                     for p in sorted((nyu / split).rglob("rgb_*.jpg"))], n), task, size, channels)
                  for split, n in (("train", cfg.train_subset), ("test", cfg.test_subset))]
        return DenseData("NYUv2", task, *splits)
    folder = "labels" if task == "seg" else "depth"
    if (root / "train" / "images").is_dir() and (root / "train" / folder).is_dir():
        splits = []
        for split, n in (("train", cfg.train_subset), ("val", cfg.test_subset)):
            files = sorted(p for p in (root / split / "images").iterdir()
                           if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
            splits.append(read_pairs(subset([(p, root / split / folder / f"{p.stem}.png") for p in files], n),
                                     task, size, channels))
        labels = torch.cat([s.targets[s.targets != IGNORE_INDEX] for s in splits]) if task == "seg" else None
        num_classes = int(labels.max()) + 1 if task == "seg" and labels.numel() else 0  # ids 0..max seen
        return DenseData(f"{root.name} (image folders)", task, *splits, num_classes=num_classes)
    fail(f"--data {root}: not a dense data set in a known layout (train.pt/val.pt, ADE20k, NYUv2 "
         f"official_splits, or train/images + train/{folder}); see probes.py")


# --- frozen features, with an optional disk cache ---


def file_hash(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def normalisation(ckpt: dict, channels: int):
    """The mean/std the backbone was trained with (its checkpoint's data set), else ImageNet's."""
    dataset = (ckpt.get("train_config") or {}).get("dataset", "")
    mean, std = NORMALISATION.get(dataset, NORMALISATION["imagenet"])
    if len(mean) != channels:
        mean, std = [0.5] * channels, [0.25] * channels
    return mean, std


@torch.no_grad()
def extract_features(backbone, images: torch.Tensor, mean, std, depth, batch_size: int, device) -> torch.Tensor:
    """Final-LayerNorm patch tokens (N, P, d) of uint8 images, stored as float16 on the CPU (half the
    memory; a linear probe does not notice), the backbone in eval mode and under no_grad."""
    backbone.eval()
    mean = torch.tensor(mean, device=device).view(1, -1, 1, 1)
    std = torch.tensor(std, device=device).view(1, -1, 1, 1)
    out = []
    for chunk in images.split(batch_size):
        x = (chunk.to(device).float() / 255 - mean) / std
        tokens = backbone(x, return_states=True, **({} if depth is None else {"depth": depth}))["tokens"]
        out.append(tokens[:, 1:].to("cpu", torch.float16))  # drop the class token: (B, P, d)
    return torch.cat(out)


def features(backbone, images, mean, std, depth, cfg, device, ckpt_hash: str) -> torch.Tensor:
    """extract_features, read from / written to cfg.probe_cache when set. The key covers everything
    the features depend on: checkpoint file, depth, images and their normalisation."""
    if not cfg.probe_cache:
        return extract_features(backbone, images, mean, std, depth, cfg.eval_batch_size, device)
    from safetensors.torch import load_file, save_file
    data = hashlib.sha256(images.contiguous().numpy().tobytes())
    data.update(repr((tuple(images.shape), list(mean), list(std))).encode())
    path = Path(cfg.probe_cache) / f"{ckpt_hash[:16]}-depth{depth}-data{data.hexdigest()[:16]}.safetensors"
    if path.is_file():
        return load_file(path)["features"]
    feats = extract_features(backbone, images, mean, std, depth, cfg.eval_batch_size, device)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_file({"features": feats.contiguous()}, tmp)
    os.replace(tmp, path)  # a crash never leaves a torn cache entry
    return feats


# --- training and evaluation of one head on fixed features ---


def fit_head(head: nn.Module, feats: torch.Tensor, targets: torch.Tensor, loss_fn, cfg, device) -> nn.Module:
    """AdamW with cosine decay (train.lr_at), data order from data.epoch_order (a function of seed, epoch)."""
    n, size = len(feats), tuple(targets.shape[-2:])
    steps_per_epoch = max(1, n // cfg.batch_size)
    total = cfg.max_steps or cfg.epochs * steps_per_epoch
    sched = dict(warmup_steps=0, total_steps=total, warmup_lr=cfg.lr, min_lr=1e-5 * cfg.lr)
    head.to(device).train()
    optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    step = 0
    while step < total:
        epoch, first = divmod(step, steps_per_epoch)
        order = epoch_order(n, cfg.seed, epoch, 1)
        for s in range(first, steps_per_epoch):
            idx = order[s * cfg.batch_size:(s + 1) * cfg.batch_size]
            for group in optimizer.param_groups:
                group["lr"] = train.lr_at(step, cfg.lr, sched)
            loss = loss_fn(head(feats[idx].to(device), size), targets[idx].to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step == total:
                break
    return head.eval()


@torch.no_grad()
def evaluate_head(head, feats, targets, data: DenseData, batch_size: int, device) -> dict:
    size = tuple(targets.shape[-2:])
    if data.task == "seg":
        confusion = torch.zeros(data.num_classes, data.num_classes, dtype=torch.long)
        for f, t in zip(feats.split(batch_size), targets.split(batch_size)):
            pred = head(f.to(device), size).argmax(1).cpu()
            confusion += confusion_matrix(pred, t, data.num_classes)
        return seg_metrics(confusion)
    sums = torch.zeros(3, dtype=torch.float64)
    for f, t in zip(feats.split(batch_size), targets.split(batch_size)):
        sums += depth_sums(head(f.to(device), size).cpu(), t)
    return depth_metrics(sums)


def seg_metrics(confusion) -> dict:
    return {"miou": mean_iou(confusion), "pixel_acc": (confusion.diagonal().sum() / confusion.sum()).item()}


def constant_baseline(data: DenseData) -> tuple[dict, float]:
    """The best constant predictor fitted on the training targets: majority class / mean depth."""
    t = data.train.targets
    if data.task == "seg":
        majority = torch.bincount(t[t != IGNORE_INDEX].flatten(), minlength=data.num_classes).argmax()
        pred = torch.full_like(data.test.targets, int(majority))
        return seg_metrics(confusion_matrix(pred, data.test.targets, data.num_classes)), float(majority)
    mean = t[torch.isfinite(t) & (t > 0)].mean().item()
    return depth_metrics(depth_sums(torch.full_like(data.test.targets, mean), data.test.targets)), mean


# --- one probe run ---


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(name).type == "cuda" and not torch.cuda.is_available():
        fail(f"--device {name}: CUDA is not available")
    return torch.device(name)


def check_depths(backbone, depths: list, device):
    x = torch.zeros(1, backbone.config.in_channels, backbone.config.image_size, backbone.config.image_size,
                    device=device)
    for depth in depths:
        try:
            with torch.no_grad():
                backbone(x, **({} if depth is None else {"depth": depth}))
        except ValueError as e:
            fail(f"the backbone cannot run at depth {depth}: {e}")


def run(cfg, device=None) -> dict:
    """Train dense heads on a frozen backbone and evaluate them at each depth. `cfg` is a ProbeConfig
    or train.py's TrainConfig (same field names). Returns the summary (also probe_results.json)."""
    t_start = time.perf_counter()
    if cfg.probe not in DENSE_PROBES:
        fail(f"--probe must be one of {', '.join(DENSE_PROBES)} here (cls is train.py's); got {cfg.probe!r}")
    if not cfg.backbone or not Path(cfg.backbone).is_file():
        fail(f"--probe {cfg.probe} needs --backbone CHECKPOINT (an existing file); got {cfg.backbone!r}")
    for name in ("batch_size", "eval_batch_size"):
        if getattr(cfg, name) <= 0:
            fail(f"--{name.replace('_', '-')} must be > 0")
    if not (cfg.max_steps > 0 or (cfg.epochs or 0) > 0) or not cfg.lr or cfg.lr <= 0:
        fail("a dense probe needs --epochs or --max-steps > 0 and --lr > 0")
    device = device or resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    try:
        backbone, ckpt = train.load_model(cfg.backbone, flag="--backbone")
    except ValueError as e:
        fail(str(e))
    backbone.to(device).eval().requires_grad_(False)  # frozen: no dropout, drop-path or elastic depth
    config = backbone.config
    trained_depth = cfg.depth or config.depth
    depths = [trained_depth] + [d for d in train.parse_depths(cfg.eval_depths) if d != trained_depth]
    check_depths(backbone, depths, device)

    data = load_dense(cfg, cfg.probe, config.image_size, config.in_channels) if cfg.data else load_proxy(cfg, cfg.probe)
    for split in (data.train, data.test):
        if tuple(split.images.shape[1:]) != (config.in_channels, config.image_size, config.image_size):
            fail(f"{data.name}: images are {tuple(split.images.shape[1:])}; the backbone expects "
                 f"{(config.in_channels, config.image_size, config.image_size)}")
    if data.task == "seg":
        for split in (data.train, data.test):
            t = split.targets
            if ((t < 0) | ((t >= data.num_classes) & (t != IGNORE_INDEX))).any():
                fail(f"{data.name}: labels must be in 0..{data.num_classes - 1} or {IGNORE_INDEX} (ignore)")
    if len(data.train.images) < cfg.batch_size:
        fail(f"--batch-size {cfg.batch_size} is larger than the training set ({len(data.train.images)} images)")
    mean, std = normalisation(ckpt, config.in_channels)
    ckpt_hash = file_hash(cfg.backbone) if cfg.probe_cache else ""
    grid = config.image_size // config.patch_size
    feats = features(backbone, data.train.images, mean, std, trained_depth, cfg, device, ckpt_hash)

    baseline, constant = constant_baseline(data)
    heads = {}
    if data.task == "seg":
        torch.manual_seed(cfg.seed)
        heads["linear"] = fit_head(SegmentationHead(config.dim, data.num_classes, grid), feats,
                                   data.train.targets, segmentation_loss, cfg, device)
    else:
        for name, hidden in (("linear", 0), ("mlp", config.dim)):  # MLP hidden width = backbone width
            torch.manual_seed(cfg.seed)
            heads[name] = fit_head(DepthHead(config.dim, grid, hidden, constant), feats, data.train.targets,
                                   depth_loss, cfg, device)

    results = {}
    for depth in depths:
        test_feats = features(backbone, data.test.images, mean, std, depth, cfg, device, ckpt_hash)
        results[depth] = {}
        for name, head in heads.items():
            metrics = evaluate_head(head, test_feats, data.test.targets, data, cfg.eval_batch_size, device)
            results[depth].update({f"{k}_{name}" if data.task == "depth" else k: v for k, v in metrics.items()})
    if data.task == "depth":
        baseline = {f"{k}_{name}": v for k, v in baseline.items() for name in heads}

    summary = {"probe": data.task, "data": data.name, "unit": data.unit, "backbone": str(cfg.backbone),
               "arch": ckpt["arch"], "reference_depth": config.depth, "trained_depth": trained_depth,
               "train_images": len(data.train.images), "test_images": len(data.test.images),
               **{f"test_{k}": v for k, v in results[trained_depth].items()},
               "depths": {str(d): r for d, r in results.items()}, "constant": baseline,
               "minutes": (time.perf_counter() - t_start) / 60}
    print(results_table(summary))
    if cfg.out_dir:
        Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.out_dir) / "probe_results.json").write_text(json.dumps(summary, indent=1))
        torch.save({name: dict(head.state_dict()) for name, head in heads.items()},
                   Path(cfg.out_dir) / "probe_heads.pt")  # plain tensors: loads with weights_only=True
    return summary


COLUMNS = {"seg": [("miou", "mIoU %", 100), ("pixel_acc", "pixel acc %", 100)],
           "depth": [("rmse_linear", "RMSE lin", 1), ("rmse_mlp", "RMSE MLP", 1),
                     ("delta1_linear", "δ<1.25 lin %", 100), ("delta1_mlp", "δ<1.25 MLP %", 100)]}


def results_table(summary: dict) -> str:
    """A markdown table: one row per depth (the trained one marked) and the constant predictor."""
    columns = COLUMNS[summary["probe"]]
    header = (f"{summary['arch']} | {summary['data']} | {summary['train_images']} train / "
              f"{summary['test_images']} test images")
    if summary["probe"] == "depth":
        header += f" | RMSE in {summary['unit']}"
    lines = [header,
             "| depth | " + " | ".join(title for _, title, _ in columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    rows = sorted(summary["depths"].items(), key=lambda kv: int(kv[0]))
    for depth, metrics in rows + [("constant", summary["constant"])]:
        label = f"{depth} (trained)" if depth == str(summary["trained_depth"]) else depth
        lines.append(f"| {label} | " + " | ".join(f"{scale * metrics[key]:.{1 if scale == 100 else 4}f}"
                                                   for key, _, scale in columns) + " |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    cfg = ProbeConfig(**vars(build_parser().parse_args(argv)))
    return run(cfg)


if __name__ == "__main__":
    main()
