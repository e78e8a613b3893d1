"""Dense frozen-backbone probes: semantic segmentation (mIoU) and monocular depth (RMSE) on patch tokens.

    python -m tools.probes --probe seg --backbone out/revit-mini/ckpt.pt --eval-depths 2,4,8
    python -m tools.probes --probe monodepth --backbone ckpt.pt --data /datasets/nyu_depth_v2 --probe-cache cache/

reViT (arXiv 2610.12448) Table 2 and App. A.3: the encoder stays frozen and its final-LayerNorm patch
tokens are read out by a linear segmentation head (ADE20k) and by linear and two-layer MLP depth heads
(NYUv2, RMSE in metres), upsampled bilinearly to pixels. The heads train at --depth and are evaluated at
every --eval-depths (the elastic-depth curve of Fig. 2); a constant predictor is the baseline row.
Simplifications (not the protocol of Jacobs et al., 2026): inputs resized to the backbone's input size (no
sliding window, Eigen crop or depth cap), no augmentation, AdamW with a cosine schedule on fixed features.

Data (--data ROOT), detected in this order (2 and 3 need Pillow):
1. ROOT/train.pt and ROOT/val.pt, each a dict of tensors: "images" uint8 (N, C, H, W) at the backbone's
   image_size, with "labels" int64 (N, H, W) (seg: class ids 0..K-1, 255 = ignore; plus "num_classes":
   int) or "depth" float32 (N, H, W) (metres; NaN or 0 = no measurement);
2. ADE20k (ADEChallengeData2016): images/ and annotations/ {training,validation}; annotation 0 ("other")
   is ignored, 1..150 become classes 0..149 (reduce-zero-label);
3. NYUv2's official splits (as BTS / AdaBins / DINOv2): official_splits/{train,test}/<scene>/
   rgb_XXXXX.jpg with sync_depth_XXXXX.png (uint16 millimetres, 0 = invalid).
Without --data: the Fashion-MNIST dense proxy (a check of the machinery, NOT a benchmark): real images
with targets from their pixels -- seg: background (< 26/255) and 4 intensity classes; monodepth:
1 + intensity in [1, 2] (arbitrary units).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

if not __package__:  # run as a file (python tools/probes.py): the project's modules are not on the path
    sys.exit("tools/probes.py: error: run it from the repository root as python -m tools.probes")

from lib import checkpoint
import train
from lib.boundary import DENSE_PROBES, check_numbers, fail, outputs_problem, parse_depths, path_problem
from lib.cli import atomic_write, dataclass_parser, non_finite_place, opt, pick_device, write_json
from lib.cli import run_main  # Ctrl-C: one line
from lib.data import NORMALISATION, epoch_order, load_images

PROG = "python -m tools.probes"  # how it runs: from the repository root, as a module
IGNORE_INDEX = 255         # label value never scored (ADE20k's "other", unlabelled pixels)
PROXY_BACKGROUND = 26      # Fashion-MNIST proxy: pixels below ~0.1 are background
PROXY_LEVELS = 4           # ... and the rest falls into 4 intensity classes
DELTA_MIN_DEPTH = 1e-3     # predicted depths are clamped to this before the ratio of delta < 1.25


@dataclass
class ProbeConfig:
    """The flags of `python -m tools.probes`, with the dense probe's own training settings as defaults."""
    probe: str = opt("seg", "seg (linear segmentation head, mIoU) | monodepth (linear and MLP monocular "
                            "depth heads, RMSE)")
    backbone: str = opt("", "checkpoint of the frozen backbone (any vision checkpoint of this project)")
    depth: int | None = opt(None, "recurrent steps of the backbone the heads are trained on (auto: its "
                                  "reference depth)")
    eval_depths: str = opt("", "comma-separated further backbone depths to evaluate the trained heads at, e.g. 2,4,8")
    data: str = opt("", "dense data root (tensor files, ADE20k or NYUv2; see the module docstring); auto: "
                        "the Fashion-MNIST dense proxy")
    data_dir: str = opt("", "where Fashion-MNIST lives for the proxy (auto: ./data, $REVIT_DATA_DIR, "
                            "/usr/share/datasets)")
    download: bool = opt(False, "download Fashion-MNIST when no search location has it (only when asked)")
    train_subset: int = opt(0, "use only the first N training images (0: all)")
    test_subset: int = opt(0, "evaluate on only the first N test images (0: all)")
    # a linear head on fixed features: few epochs, a large lr (best of a 1e-3..3e-2 sweep on the proxy), no decay
    epochs: int = opt(10, "epochs over the training images")
    max_steps: int = opt(0, "optimizer steps; overrides --epochs when > 0")
    batch_size: int = opt(64, "images per optimizer step")
    lr: float = opt(1e-2, "peak AdamW learning rate (cosine decay to 1e-5 x lr; used as given)")
    weight_decay: float = opt(0.0, "AdamW weight decay of the heads")
    eval_batch_size: int = opt(256, "images per batch in feature extraction and evaluation")
    probe_cache: str = opt("", "folder caching backbone features, keyed by checkpoint hash, depth and data "
                               "(empty: recompute every run)")
    seed: int = opt(0, "random seed: head init and data order")
    device: str = opt("auto", "auto | cpu | cuda | cuda:N | mps")
    out_dir: str = opt("", "write probe_results.json and probe_heads.pt here (empty: print only)")


def build_parser() -> argparse.ArgumentParser:
    return dataclass_parser(ProbeConfig, __doc__.split("\n\n")[0], prog=PROG)


# --- metrics (numerators and denominators accumulate over batches; the ratio is taken once) ---


def confusion_matrix(pred: torch.Tensor, target: torch.Tensor, num_classes: int) -> torch.Tensor:
    """(K, K) pixel counts, rows = true class, columns = predicted class; ignored pixels dropped."""
    keep = target != IGNORE_INDEX
    target, pred = target[keep].long(), pred[keep].long()  # labels in range: load_data checks them
    return torch.bincount(target * num_classes + pred, minlength=num_classes ** 2).view(num_classes, num_classes)


def mean_iou(confusion: torch.Tensor) -> float:
    """Mean over classes of TP / (TP + FP + FN); a class absent from both prediction and target
    (union 0) is left out of the mean (the mmsegmentation convention)."""
    confusion = confusion.double()
    intersection = confusion.diagonal()
    union = confusion.sum(0) + confusion.sum(1) - intersection
    present = union > 0
    return (intersection[present] / union[present]).mean().item() if present.any() else float("nan")


def depth_map_sums(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[sum of squared errors, pixels with delta < 1.25, valid pixels] over pixels with a finite
    target > 0 (NYUv2 marks missing measurements with 0; we also accept NaN)."""
    valid = torch.isfinite(target) & (target > 0)
    pred, target = pred[valid].double(), target[valid].double()
    ratio = torch.maximum(pred.clamp(min=DELTA_MIN_DEPTH) / target, target / pred.clamp(min=DELTA_MIN_DEPTH))
    return torch.stack([((pred - target) ** 2).sum(), (ratio < 1.25).sum().double(),
                        torch.tensor(float(valid.sum()), dtype=torch.float64)])


def depth_map_metrics(sums: torch.Tensor) -> dict:
    squared_error, within, count = sums.tolist()
    return {"rmse": math.sqrt(squared_error / count), "delta1": within / count}


def batch_sums(pred: torch.Tensor, target: torch.Tensor, data) -> torch.Tensor:
    """What one batch adds to the test metric: sums over batches, ratios once (batch size never changes
    a metric)."""
    return confusion_matrix(pred, target, data.num_classes) if data.task == "seg" else depth_map_sums(pred, target)


def metrics_of(sums: torch.Tensor, data) -> dict:
    if data.task == "seg":
        return {"miou": mean_iou(sums), "pixel_acc": (sums.diagonal().sum() / sums.sum()).item()}
    return depth_map_metrics(sums)


# --- heads: per patch token, then bilinear upsampling to pixel resolution ---


class DenseHead(nn.Module):
    """Per patch token, Linear (hidden=0) or Linear-GELU-Linear to `out` maps, upsampled bilinearly to pixels:
    class logits (not probabilities, as in DINOv2's linear head) or one depth map starting at `bias`."""

    def __init__(self, dim: int, out: int, grid: int, hidden: int = 0, bias: float = 0.0):
        super().__init__()
        self.grid = grid
        self.net = nn.Linear(dim, out) if hidden == 0 else nn.Sequential(
            nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, out))
        last = self.net if hidden == 0 else self.net[-1]
        nn.init.trunc_normal_(last.weight, std=0.01)
        nn.init.constant_(last.bias, bias)

    def forward(self, features: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        maps = rearrange(self.net(features.float()), "b (h w) k -> b k h w", h=self.grid)
        return F.interpolate(maps, size=size, mode="bilinear", align_corners=False)  # (B, K, H, W)


def depth_map_loss(pred, target):
    """Mean squared error over valid pixels (the reported metric is its square root); pred (B, 1, H, W)."""
    pred = pred[:, 0]
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
    task: str               # "seg" | "monodepth"
    train: DenseSplit
    test: DenseSplit
    num_classes: int = 0    # seg only
    unit: str = "m"         # unit of the depth maps


def proxy_targets(images: torch.Tensor, task: str) -> torch.Tensor:
    """Targets of the Fashion-MNIST proxy from the pixels: (N, 1, H, W) uint8 -> (N, H, W)."""
    x = images[:, 0].long()
    if task == "seg":  # 0 background, 1..PROXY_LEVELS quantised intensity
        level = 1 + (x - PROXY_BACKGROUND) * PROXY_LEVELS // (256 - PROXY_BACKGROUND)
        return torch.where(x < PROXY_BACKGROUND, 0, level)
    return 1.0 + x.float() / 255  # monodepth: depth in [1, 2], positive so that delta < 1.25 is defined


def load_proxy(cfg: ProbeConfig, task: str) -> DenseData:
    """Real Fashion-MNIST images via train.py's loader, dense targets derived from them (a proxy)."""
    images = load_images("fashion-mnist", data_dir=cfg.data_dir, download=cfg.download,
                         train_subset=cfg.train_subset, test_subset=cfg.test_subset)
    splits = [DenseSplit(s.images, proxy_targets(s.images, task)) for s in (images.train, images.test)]
    return DenseData("Fashion-MNIST dense proxy", task, *splits,
                     num_classes=1 + PROXY_LEVELS if task == "seg" else 0, unit="a.u.")


def read_pairs(pairs: list, task: str, size: int, channels: int) -> DenseSplit:
    """(image file, target file) pairs -> tensors at size x size (bicubic images, nearest targets)."""
    import numpy as np
    try:
        from PIL import Image
    except ImportError:
        fail("reading ADE20k / NYUv2 needs Pillow (pip install pillow), or convert the data to the tensor "
             "format (ROOT/train.pt, ROOT/val.pt; see tools/probes.py)")
    images, targets = [], []
    for image_path, target_path in pairs:
        try:
            image = Image.open(image_path).convert("RGB" if channels == 3 else "L").resize((size, size), Image.BICUBIC)
            target = np.asarray(Image.open(target_path).resize((size, size), Image.NEAREST))
        except OSError as e:  # a missing target, or a file Pillow cannot read
            fail(f"--data: {e}")
        images.append(torch.from_numpy(np.array(image)).reshape(size, size, channels).permute(2, 0, 1))
        if task == "seg":  # ADE20k: annotation 0 ("other") ignored, 1..150 -> classes 0..149
            labels = torch.from_numpy(target.astype(np.int64))
            targets.append(torch.where(labels == 0, IGNORE_INDEX, labels - 1))
        else:  # uint16 millimetres, 0 = no measurement
            depth_map = torch.from_numpy(target.astype(np.float32)) / 1000
            targets.append(torch.where(depth_map > 0, depth_map, torch.nan))
    if not images:
        fail(f"--data: no {task} image pairs found")
    return DenseSplit(torch.stack(images), torch.stack(targets))


def read_tensor_files(root: Path, task: str, cfg: ProbeConfig) -> DenseData:
    """Format 1: ROOT/train.pt and ROOT/val.pt (module docstring)."""
    key = "labels" if task == "seg" else "depth"
    splits = []
    for name, n in (("train", cfg.train_subset), ("val", cfg.test_subset)):
        path = root / f"{name}.pt"
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 -- whatever torch.load raises, the file is unusable
            fail(f"--data {path}: {checkpoint.unreadable(e)}")
        images, targets = (blob.get(k) if isinstance(blob, dict) else None for k in ("images", key))
        if not (torch.is_tensor(images) and torch.is_tensor(targets) and images.dtype == torch.uint8
                and images.ndim == 4 and targets.shape == images[:, 0].shape):
            fail(f"--data {path}: needs a dict with the tensors 'images' (uint8, N x C x H x W) and '{key}' "
                 f"(N x H x W) for --probe {task}")
        images, targets = images[:n or None], targets[:n or None]
        splits.append(DenseSplit(images, targets.long() if task == "seg" else targets.float()))
    num_classes = blob.get("num_classes", 0) if task == "seg" else 0
    if task == "seg" and not (isinstance(num_classes, int) and num_classes > 0):
        fail(f"--data {root / 'val.pt'}: needs 'num_classes' (an int > 0) for --probe seg")
    return DenseData(f"{root.name} (tensor files)", task, *splits, num_classes=num_classes)


def load_dense(cfg: ProbeConfig, task: str, size: int, channels: int) -> DenseData:
    """--data ROOT in one of the documented formats (module docstring), detected in that order."""
    root = Path(cfg.data)
    if all(os.path.lexists(root / name) for name in ("train.pt", "val.pt")):  # read_tensor_files checks them
        return read_tensor_files(root, task, cfg)
    ade = root / "ADEChallengeData2016" if (root / "ADEChallengeData2016").is_dir() else root
    nyu = root / "official_splits" if (root / "official_splits").is_dir() else root
    if (ade / "annotations" / "training").is_dir():
        name, kind, num_classes = "ADE20k", "seg", 150
        pairs = [[(p, ade / "annotations" / split / f"{p.stem}.png")
                  for p in sorted((ade / "images" / split).glob("*.jpg"))]
                 for split in ("training", "validation")]
    elif (nyu / "test").is_dir() and next((nyu / "test").rglob("sync_depth_*.png"), None):
        name, kind, num_classes = "NYUv2", "monodepth", 0
        pairs = [[(p, p.with_name(p.name.replace("rgb_", "sync_depth_")).with_suffix(".png"))
                  for p in sorted((nyu / split).rglob("rgb_*.jpg"))] for split in ("train", "test")]
    else:
        fail(f"--data {root}: not a dense data set in a known layout (train.pt/val.pt, ADE20k, NYUv2 "
             f"official_splits); see tools/probes.py")
    if kind != task:
        fail(f"--data {root} is {name}, a {kind} data set; --probe {task} needs "
             f"{'label maps (e.g. ADE20k)' if task == 'seg' else 'depth maps (e.g. NYUv2)'}")
    splits = [read_pairs(files[:n or None], task, size, channels)
              for files, n in zip(pairs, (cfg.train_subset, cfg.test_subset))]
    return DenseData(name, task, *splits, num_classes=num_classes)


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
    memory; a linear probe does not notice), the backbone in eval mode."""
    backbone.eval()
    mean = torch.tensor(mean, device=device).view(1, -1, 1, 1)
    std = torch.tensor(std, device=device).view(1, -1, 1, 1)
    out = []
    for chunk in images.split(batch_size):
        x = (chunk.to(device).float() / 255 - mean) / std
        tokens = backbone(x, return_states=True, **({} if depth is None else {"depth": depth}))["tokens"]
        out.append(tokens[:, 1:].to("cpu", torch.float16))  # drop the class token: (B, P, d)
    return torch.cat(out)


class FrozenBackbone:
    """The frozen model (eval mode, requires_grad False) and what its features depend on: each part of the
    cache key."""

    def __init__(self, model: nn.Module, ckpt: dict, device, cfg: ProbeConfig):
        self.model, self.ckpt, self.device, self.batch_size = model, ckpt, device, cfg.eval_batch_size
        self.mean, self.std = normalisation(ckpt, model.config.in_channels)
        self.cache = cfg.probe_cache  # folder of cached features ("" for none)
        self.ckpt_hash = file_hash(cfg.backbone) if cfg.probe_cache else ""

    def features(self, images: torch.Tensor, depth: int | None) -> torch.Tensor:
        """extract_features, through the cache when there is one (key: checkpoint file, depth, images,
        normalisation); an unreadable, misshapen or non-finite entry is recomputed and replaced."""
        if not self.cache:
            return extract_features(self.model, images, self.mean, self.std, depth, self.batch_size, self.device)
        from safetensors import SafetensorError
        from safetensors.torch import load_file, save_file
        data = hashlib.sha256(images.contiguous().numpy().tobytes())
        data.update(repr((tuple(images.shape), list(self.mean), list(self.std))).encode())
        path = Path(self.cache) / f"{self.ckpt_hash[:16]}-depth{depth}-data{data.hexdigest()[:16]}.safetensors"
        if path.is_file():
            with contextlib.suppress(SafetensorError, KeyError, OSError):
                cached = load_file(path)["features"]
                config = self.model.config
                if cached.shape == (len(images), config.num_patches, config.dim) and torch.isfinite(cached).all():
                    return cached
        feats = extract_features(self.model, images, self.mean, self.std, depth, self.batch_size, self.device)
        atomic_write(path, lambda tmp: save_file({"features": feats.contiguous()}, tmp))  # never torn
        return feats


# --- training and evaluation of the heads on fixed features ---


def fit_head(head: nn.Module, feats: torch.Tensor, targets: torch.Tensor, loss_fn, cfg, device) -> nn.Module:
    """AdamW with cosine decay (train.lr_at), data order from data.epoch_order (a function of seed, epoch)."""
    n, size = len(feats), tuple(targets.shape[-2:])
    steps_per_epoch = max(1, n // cfg.batch_size)
    total = cfg.max_steps or cfg.epochs * steps_per_epoch
    sched = dict(warmup_steps=0, total_steps=total, warmup_lr=cfg.lr, min_lr=1e-5 * cfg.lr)
    head.to(device).train()
    optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    for step in range(total):
        epoch, s = divmod(step, steps_per_epoch)
        if s == 0:
            order = epoch_order(n, cfg.seed, epoch, 1)
        idx = order[s * cfg.batch_size:(s + 1) * cfg.batch_size]
        for group in optimizer.param_groups:
            group["lr"] = train.lr_at(step, cfg.lr, sched)
        loss = loss_fn(head(feats[idx].to(device), size), targets[idx].to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return head.eval()


@torch.no_grad()
def evaluate_head(head, feats, targets, data: DenseData, batch_size: int, device) -> dict:
    size = tuple(targets.shape[-2:])
    total = 0
    for f, t in zip(feats.split(batch_size), targets.split(batch_size)):
        pred = head(f.to(device), size).cpu()  # seg: (B, K, H, W) logits; monodepth: (B, 1, H, W)
        total = total + batch_sums(pred.argmax(1) if data.task == "seg" else pred[:, 0], t, data)
    return metrics_of(total, data)


def constant_baseline(data: DenseData) -> tuple[dict, float]:
    """The best constant predictor fitted on the training targets: majority class / mean depth."""
    t = data.train.targets
    if data.task == "seg":
        constant = float(torch.bincount(t[t != IGNORE_INDEX].flatten(), minlength=data.num_classes).argmax())
    else:
        constant = t[torch.isfinite(t) & (t > 0)].mean().item()
    prediction = torch.full_like(data.test.targets, constant)
    return metrics_of(batch_sums(prediction, data.test.targets, data), data), constant


def train_heads(frozen: FrozenBackbone, data: DenseData, depth: int, constant: float, cfg) -> dict:
    """seg: one linear head; monodepth: a linear and an MLP head (hidden width = backbone width), the
    depth heads starting from the constant baseline. Each head starts from the same seed."""
    config = frozen.model.config
    grid = config.image_size // config.patch_size
    feats = frozen.features(data.train.images, depth)
    if data.task == "seg":
        heads = {"linear": lambda: DenseHead(config.dim, data.num_classes, grid)}
        loss_fn = partial(F.cross_entropy, ignore_index=IGNORE_INDEX)
    else:
        heads = {"linear": lambda: DenseHead(config.dim, 1, grid, 0, constant),
                 "mlp": lambda: DenseHead(config.dim, 1, grid, config.dim, constant)}
        loss_fn = depth_map_loss
    trained = {}
    for name, build in heads.items():
        torch.manual_seed(cfg.seed)
        trained[name] = fit_head(build(), feats, data.train.targets, loss_fn, cfg, frozen.device)
    return trained


def evaluate_heads(frozen: FrozenBackbone, heads: dict, data: DenseData, depths: list[int]) -> dict:
    """{depth: metrics} of the same trained heads at each backbone depth; with two heads (monodepth) each
    metric is named after its head (rmse_linear, rmse_mlp, ...)."""
    results = {}
    for depth in depths:
        test_feats = frozen.features(data.test.images, depth)
        results[depth] = {}
        for name, head in heads.items():
            metrics = evaluate_head(head, test_feats, data.test.targets, data, frozen.batch_size, frozen.device)
            results[depth].update({f"{k}_{name}" if len(heads) > 1 else k: v for k, v in metrics.items()})
    return results


# --- one probe run ---


def check_config(cfg: ProbeConfig) -> None:
    """The flags that need no file (lib/boundary.py's ranges): one line naming the flag."""
    if cfg.probe not in DENSE_PROBES:
        hint = " (monocular depth is monodepth; --depth sets the backbone's steps)" if cfg.probe == "depth" else ""
        fail(f"--probe must be one of {', '.join(DENSE_PROBES)} here (cls is train.py's); got {cfg.probe!r}{hint}")
    if not cfg.backbone:
        fail(f"--probe {cfg.probe} needs --backbone CHECKPOINT")
    check_numbers(asdict(cfg))
    if cfg.max_steps == 0 and cfg.epochs <= 0:
        fail(f"--epochs must be > 0 (or give --max-steps); got {cfg.epochs}")
    parse_depths(cfg.eval_depths)
    if cfg.data and path_problem(cfg.data, "folder"):
        fail(f"--data {cfg.data}: {path_problem(cfg.data, 'folder')}")
    for flag, folder, names in (("--probe-cache", cfg.probe_cache, ()),
                                ("--out-dir", cfg.out_dir, ("probe_results.json", "probe_heads.pt"))):
        if folder and outputs_problem(flag, folder, names):
            fail(outputs_problem(flag, folder, names))


def load_backbone(cfg: ProbeConfig) -> tuple[FrozenBackbone, list[int]]:
    """--backbone, frozen, and the depths it runs at: the one the heads train on first, then --eval-depths."""
    device = pick_device(cfg.device)
    model, ckpt = checkpoint.load_vision_model(cfg.backbone, "--backbone", device)
    model.eval().requires_grad_(False)  # frozen: no dropout, drop-path or elastic depth
    config = model.config
    trained_depth = cfg.depth or config.depth
    depths = [trained_depth] + [d for d in parse_depths(cfg.eval_depths) if d != trained_depth]
    x = torch.zeros(1, config.in_channels, config.image_size, config.image_size, device=device)
    for depth in depths:
        try:
            with torch.no_grad():
                model(x, depth=depth)
        except ValueError as e:  # e.g. a plain ViT runs only its own depth
            fail(f"--backbone {cfg.backbone} cannot run at depth {depth}: {e}")
    return FrozenBackbone(model, ckpt, device, cfg), depths


def load_data(cfg: ProbeConfig, config) -> DenseData:
    """--data (or the proxy), checked against the backbone's input and the batch size."""
    data = load_dense(cfg, cfg.probe, config.image_size, config.in_channels) if cfg.data else load_proxy(cfg, cfg.probe)
    expected = (config.in_channels, config.image_size, config.image_size)
    for split in (data.train, data.test):
        if tuple(split.images.shape[1:]) != expected:
            fail(f"--data {data.name}: images are {tuple(split.images.shape[1:])}; the backbone expects {expected}")
        t = split.targets
        if data.task == "seg" and ((t < 0) | ((t >= data.num_classes) & (t != IGNORE_INDEX))).any():
            fail(f"--data {data.name}: labels must be in 0..{data.num_classes - 1} or {IGNORE_INDEX} (ignore)")
    if len(data.train.images) < cfg.batch_size:
        fail(f"--batch-size {cfg.batch_size} is larger than the training set ({len(data.train.images)} images)")
    return data


def run(cfg: ProbeConfig) -> dict:
    """Every input checked; then the heads trained and evaluated at each depth -> the summary."""
    t_start = time.perf_counter()
    check_config(cfg)
    try:
        frozen, depths = load_backbone(cfg)
        data = load_data(cfg, frozen.model.config)
    except (ValueError, FileNotFoundError) as e:  # a reader's one line, naming the flag or the file
        fail(str(e))
    baseline, constant = constant_baseline(data)
    heads = train_heads(frozen, data, depths[0], constant, cfg)
    results = evaluate_heads(frozen, heads, data, depths)
    if len(heads) > 1:  # the constant row, under each head's column names
        baseline = {f"{k}_{name}": v for k, v in baseline.items() for name in heads}
    summary = {"probe": data.task, "data": data.name, "unit": data.unit, "backbone": str(cfg.backbone),
               "arch": frozen.ckpt["arch"], "reference_depth": frozen.model.config.depth, "trained_depth": depths[0],
               "train_images": len(data.train.images), "test_images": len(data.test.images),
               **{f"test_{k}": v for k, v in results[depths[0]].items()},
               "depths": {str(d): r for d, r in results.items()}, "constant": baseline,
               "minutes": (time.perf_counter() - t_start) / 60}
    place = non_finite_place(summary)
    if place:  # as a non-finite loss stops train.py: a metric that is not a number is never reported
        fail(f"--probe {cfg.probe}: the metric {place} is not finite (every test pixel ignored, or a diverged "
             f"head); nothing written")
    print(results_table(summary))
    if cfg.out_dir:
        out = Path(cfg.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        write_json(summary, str(out / "probe_results.json"))
        checkpoint.atomic_save({name: dict(head.state_dict()) for name, head in heads.items()},
                               out / "probe_heads.pt")  # plain tensors: loads with weights_only=True
    return summary


COLUMNS = {"seg": [("miou", "mIoU %", 100), ("pixel_acc", "pixel acc %", 100)],
           "monodepth": [("rmse_linear", "RMSE lin", 1), ("rmse_mlp", "RMSE MLP", 1),
                         ("delta1_linear", "δ<1.25 lin %", 100), ("delta1_mlp", "δ<1.25 MLP %", 100)]}


def results_table(summary: dict) -> str:
    """A markdown table: one row per depth (the trained one marked) and the constant predictor."""
    columns = COLUMNS[summary["probe"]]
    header = (f"{summary['arch']} | {summary['data']} | {summary['train_images']} train / "
              f"{summary['test_images']} test images")
    if summary["probe"] == "monodepth":
        header += f" | RMSE in {summary['unit']}"
    lines = [header, "| backbone depth | " + " | ".join(title for _, title, _ in columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    rows = sorted(summary["depths"].items(), key=lambda kv: int(kv[0]))
    for depth, metrics in rows + [("constant", summary["constant"])]:
        label = f"{depth} (trained)" if depth == str(summary["trained_depth"]) else depth
        lines.append(f"| {label} | " + " | ".join(f"{scale * metrics[key]:.{1 if scale == 100 else 4}f}"
                                                   for key, _, scale in columns) + " |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    return run(ProbeConfig(**vars(build_parser().parse_args(argv))))


if __name__ == "__main__":
    run_main(main, "every file it writes is written whole or not at all")
