"""Dense frozen-backbone probes: semantic segmentation (mIoU) and monocular depth (RMSE) on patch tokens.

    python -m tools.probes --probe seg --backbone out/revit-mini/ckpt.pt --eval-depths 2,4,8
    python -m tools.probes --probe monodepth --backbone ckpt.pt --data /datasets/nyu_depth_v2 \\
        --probe-cache cache/

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
from collections import namedtuple
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

if not __package__:  # run as a file (python tools/probes.py): the project's modules are not on the path
    sys.exit("tools/probes.py: error: run it from the repository root as python -m tools.probes")

from lib import checkpoint
import train
from lib.boundary import DENSE_PROBES, check_numbers, fail, outputs_problem, parse_depths, path_problem
from lib.cli import atomic_write, dataclass_parser, f, markdown, non_finite_place, opt, pick_device
from lib.cli import run_main, write_json  # run_main: Ctrl-C is one line
from lib.data import NORMALISATION, epoch_order, load_images

PROG = "python -m tools.probes"  # how it runs: from the repository root, as a module
IGNORE_INDEX = 255         # label value never scored (ADE20k's "other", unlabelled pixels)
PROXY_BACKGROUND = 26      # Fashion-MNIST proxy: pixels below ~0.1 are background
PROXY_LEVELS = 4           # ... and the rest falls into 4 intensity classes
DELTA_MIN_DEPTH = 1e-3     # predicted depths are clamped to this before the ratio of delta < 1.25
OUT_FILES = ("probe_results.json", "probe_heads.safetensors")


@dataclass
class ProbeConfig:
    """The flags of `python -m tools.probes`, with the dense probe's own training settings as defaults."""
    probe: str = opt("seg", "seg (a linear head, mIoU) | monodepth (linear and MLP depth heads, RMSE)")
    backbone: str = opt("", "checkpoint of the frozen backbone (any vision checkpoint of this project)")
    depth: int | None = opt(None, "backbone steps the heads train at (auto: its reference depth)")
    eval_depths: str = opt("", "further backbone depths to evaluate the trained heads at, e.g. 2,4,8")
    data: str = opt("", "dense data: tensor files, ADE20k or NYUv2 (auto: the Fashion-MNIST proxy)")
    data_dir: str = opt("", "Fashion-MNIST's folder (auto: ./data, $REVIT_DATA_DIR, /usr/share/datasets)")
    download: bool = opt(False, "download Fashion-MNIST when no search location has it (only when asked)")
    train_subset: int = opt(0, "use only the first N training images (0: all)")
    test_subset: int = opt(0, "evaluate on only the first N test images (0: all)")
    # a linear head on fixed features: few epochs, a large lr (best of a 1e-3..3e-2 sweep on the proxy)
    epochs: int = opt(10, "epochs over the training images")
    max_steps: int = opt(0, "optimizer steps; overrides --epochs when > 0")
    batch_size: int = opt(64, "images per optimizer step")
    lr: float = opt(1e-2, "peak AdamW learning rate (cosine decay to 1e-5 x lr; used as given)")
    weight_decay: float = opt(0.0, "AdamW weight decay of the heads")
    eval_batch_size: int = opt(256, "images per batch in feature extraction and evaluation")
    probe_cache: str = opt("", "folder caching backbone features by checkpoint, depth and data")
    seed: int = opt(0, "random seed: head init and data order")
    device: str = opt("auto", "auto | cpu | cuda | cuda:N | mps")
    out_dir: str = opt("", "write probe_results.json and probe_heads.safetensors here (empty: print only)")


def build_parser() -> argparse.ArgumentParser:
    return dataclass_parser(ProbeConfig, __doc__.split("\n\n")[0], prog=PROG)


# --- metrics (numerators and denominators accumulate over batches; the ratio is taken once) ---


def confusion_matrix(pred: torch.Tensor, target: torch.Tensor, num_classes: int) -> torch.Tensor:
    """(K, K) pixel counts, rows = true class, columns = predicted class; ignored pixels dropped."""
    keep = target != IGNORE_INDEX
    flat = target[keep].long() * num_classes + pred[keep].long()  # labels in range: load_data checks them
    return torch.bincount(flat, minlength=num_classes ** 2).view(num_classes, num_classes)


def mean_iou(confusion: torch.Tensor) -> float:
    """Mean over classes of TP / (TP + FP + FN); a class absent from both prediction and target
    (union 0) is left out of the mean (the mmsegmentation convention)."""
    confusion = confusion.double()
    intersection = confusion.diagonal()
    union = confusion.sum(0) + confusion.sum(1) - intersection
    present = union > 0
    return (intersection[present] / union[present]).mean().item() if present.any() else float("nan")


def valid_depth(target: torch.Tensor) -> torch.Tensor:
    """The pixels with a measurement: NYUv2 marks a missing one with 0; we also accept NaN."""
    return torch.isfinite(target) & (target > 0)


def depth_map_sums(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[sum of squared errors, pixels with delta < 1.25, valid pixels] over the valid_depth pixels."""
    valid = valid_depth(target)
    pred, target = pred[valid].double(), target[valid].double()
    clamped = pred.clamp(min=DELTA_MIN_DEPTH)
    ratio = torch.maximum(clamped / target, target / clamped)
    return torch.stack([((pred - target) ** 2).sum(), (ratio < 1.25).sum().double(),
                        torch.tensor(float(valid.sum()), dtype=torch.float64)])


def batch_sums(pred: torch.Tensor, target: torch.Tensor, data) -> torch.Tensor:
    """What one batch adds to the test metric (batch size never changes a metric)."""
    if data.task == "seg":
        return confusion_matrix(pred, target, data.num_classes)
    return depth_map_sums(pred, target)


def metrics_of(sums: torch.Tensor, data) -> dict:
    if data.task == "seg":
        return {"miou": mean_iou(sums), "pixel_acc": (sums.diagonal().sum() / sums.sum()).item()}
    squared_error, within, count = sums.tolist()
    count = count or math.nan  # no valid depth: not a number, refused before anything is reported
    return {"rmse": math.sqrt(squared_error / count), "delta1": within / count}


# --- heads: per patch token, then bilinear upsampling to pixel resolution ---


class DenseHead(nn.Module):
    """Per patch token, Linear (hidden=0) or Linear-GELU-Linear to `out` maps, upsampled bilinearly to
    pixels: class logits (as DINOv2's linear head) or one depth map starting at `bias`."""

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
    valid = valid_depth(target)
    return ((pred[:, 0] - target.nan_to_num()) ** 2 * valid).sum() / valid.sum().clamp(min=1)


# --- data ---


# images (N, C, H, W) uint8; targets (N, H, W): int64 class ids (IGNORE_INDEX: unscored) or float32 depth
DenseSplit = namedtuple("DenseSplit", "images targets")


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


def load_proxy(cfg: ProbeConfig) -> DenseData:
    """Real Fashion-MNIST images via train.py's loader, dense targets derived from them (a proxy)."""
    images = load_images("fashion-mnist", data_dir=cfg.data_dir, download=cfg.download,
                         train_subset=cfg.train_subset, test_subset=cfg.test_subset)
    splits = [DenseSplit(s.images, proxy_targets(s.images, cfg.probe)) for s in (images.train, images.test)]
    return DenseData("Fashion-MNIST dense proxy", cfg.probe, *splits,
                     num_classes=1 + PROXY_LEVELS if cfg.probe == "seg" else 0, unit="a.u.")


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
            image = Image.open(image_path).convert("RGB" if channels == 3 else "L")
            target = Image.open(target_path).resize((size, size), Image.NEAREST)
        except OSError as e:  # a missing target, or a file Pillow cannot read
            fail(f"--data: {e}")
        image = np.array(image.resize((size, size), Image.BICUBIC)).reshape(size, size, channels)
        images.append(torch.from_numpy(image).permute(2, 0, 1))
        target = torch.from_numpy(np.asarray(target).astype(np.int64))
        if task == "seg":  # ADE20k: annotation 0 ("other") ignored, 1..150 -> classes 0..149
            targets.append(torch.where(target == 0, IGNORE_INDEX, target - 1))
        else:  # uint16 millimetres, 0 = no measurement
            targets.append(torch.where(target > 0, target.float() / 1000, torch.nan))
    return DenseSplit(torch.stack(images), torch.stack(targets))


def read_tensor_files(root: Path, cfg: ProbeConfig) -> DenseData:
    """Format 1: ROOT/train.pt and ROOT/val.pt (module docstring)."""
    seg, key = cfg.probe == "seg", "labels" if cfg.probe == "seg" else "depth"
    splits = []
    for name, n in (("train", cfg.train_subset), ("val", cfg.test_subset)):
        path = root / f"{name}.pt"
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 -- whatever torch.load raises, the file is unusable
            fail(f"--data {path}: {checkpoint.unreadable(e)}")
        blob = blob if isinstance(blob, dict) else {}
        images, targets, num_classes = blob.get("images"), blob.get(key), blob.get("num_classes", 0)
        if not (torch.is_tensor(images) and torch.is_tensor(targets) and images.dtype == torch.uint8
                and images.ndim == 4 and targets.shape == images[:, 0].shape
                and (not seg or isinstance(num_classes, int) and num_classes > 0)):
            fail(f"--data {path}: needs a dict with the tensors 'images' (uint8, N x C x H x W) and '{key}' "
                 f"(N x H x W) for --probe {cfg.probe}" + (", and 'num_classes' (an int > 0)" if seg else ""))
        n = n or None  # 0: all
        splits.append(DenseSplit(images[:n], targets[:n].to(torch.long if seg else torch.float)))
    return DenseData(f"{root.name} (tensor files)", cfg.probe, *splits, num_classes=num_classes if seg else 0)


def load_dense(cfg: ProbeConfig, size: int, channels: int) -> DenseData:
    """--data ROOT in one of the documented formats (module docstring), detected in that order."""
    root = Path(cfg.data)
    if all(os.path.lexists(root / name) for name in ("train.pt", "val.pt")):  # read_tensor_files checks them
        return read_tensor_files(root, cfg)
    ade = root / "ADEChallengeData2016" if (root / "ADEChallengeData2016").is_dir() else root
    nyu = root / "official_splits" if (root / "official_splits").is_dir() else root
    if (ade / "annotations" / "training").is_dir():
        name, task, num_classes = "ADE20k", "seg", 150
        pairs = [[(p, ade / "annotations" / split / f"{p.stem}.png")
                  for p in sorted((ade / "images" / split).glob("*.jpg"))]
                 for split in ("training", "validation")]
    elif (nyu / "test").is_dir() and next((nyu / "test").rglob("sync_depth_*.png"), None):
        name, task, num_classes = "NYUv2", "monodepth", 0
        pairs = [[(p, p.with_name(p.name.replace("rgb_", "sync_depth_")).with_suffix(".png"))
                  for p in sorted((nyu / split).rglob("rgb_*.jpg"))] for split in ("train", "test")]
    else:
        pairs = [[]]
    if not all(pairs):
        fail(f"--data {root}: not a dense data set in a known layout (train.pt/val.pt, ADE20k, NYUv2 "
             f"official_splits, with image pairs in each split); see tools/probes.py")
    if task != cfg.probe:  # before reading a whole data set of the other kind
        fail(f"--data {root} is {name}, a {task} data set; --probe {cfg.probe} needs "
             f"{'label maps (e.g. ADE20k)' if cfg.probe == 'seg' else 'depth maps (e.g. NYUv2)'}")
    splits = [read_pairs(files[:n or None], task, size, channels)
              for files, n in zip(pairs, (cfg.train_subset, cfg.test_subset))]
    return DenseData(name, task, *splits, num_classes=num_classes)


# --- frozen features, with an optional disk cache ---


@torch.no_grad()
def extract_features(backbone, images: torch.Tensor, mean, std, depth, batch_size: int, device):
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
    """--backbone, frozen, with what its features depend on (each part of the cache key) and the depths
    it runs at: the one the heads train at first, then --eval-depths."""

    def __init__(self, cfg: ProbeConfig):
        self.device, self.batch_size = pick_device(cfg.device), cfg.eval_batch_size
        model, ckpt = checkpoint.load_vision_model(cfg.backbone, "--backbone", self.device)  # in eval mode
        self.model, self.ckpt, config = model.requires_grad_(False), ckpt, model.config  # frozen
        self.depths = [cfg.depth or config.depth]
        self.depths += [d for d in parse_depths(cfg.eval_depths) if d != self.depths[0]]
        x = torch.zeros(1, config.in_channels, config.image_size, config.image_size, device=self.device)
        for depth in self.depths:
            try:
                with torch.no_grad():
                    model(x, depth=depth)
            except ValueError as e:  # e.g. a plain ViT runs only its own depth
                fail(f"--backbone {cfg.backbone} cannot run at depth {depth}: {e}")
        # the mean/std the backbone was trained with (its checkpoint's data set), else ImageNet's
        dataset = (ckpt.get("train_config") or {}).get("dataset", "")
        self.mean, self.std = NORMALISATION.get(dataset, NORMALISATION["imagenet"])
        if len(self.mean) != config.in_channels:
            self.mean, self.std = [0.5] * config.in_channels, [0.25] * config.in_channels
        self.cache = cfg.probe_cache  # folder of cached features ("" for none)
        if self.cache:
            with open(cfg.backbone, "rb") as file:
                self.ckpt_hash = hashlib.file_digest(file, "sha256").hexdigest()

    def features(self, images: torch.Tensor, depth: int | None) -> torch.Tensor:
        """extract_features, through the cache when there is one (key: checkpoint file, depth, images,
        normalisation); an unreadable, misshapen or non-finite entry is recomputed and replaced."""
        extract = partial(extract_features, self.model, images, self.mean, self.std, depth, self.batch_size,
                          self.device)
        if not self.cache:
            return extract()
        data = hashlib.sha256(images.contiguous().numpy().tobytes())
        data.update(repr((tuple(images.shape), list(self.mean), list(self.std))).encode())
        name = f"{self.ckpt_hash[:16]}-depth{depth}-data{data.hexdigest()[:16]}.safetensors"
        path = Path(self.cache) / name
        shape = (len(images), self.model.config.num_patches, self.model.config.dim)
        with contextlib.suppress(SafetensorError, KeyError, OSError):
            cached = load_file(path)["features"]
            if cached.shape == shape and torch.isfinite(cached).all():
                return cached
        feats = extract()
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
        constant = t[valid_depth(t)].mean().item()
    prediction = torch.full_like(data.test.targets, constant)
    return metrics_of(batch_sums(prediction, data.test.targets, data), data), constant


def train_heads(frozen: FrozenBackbone, data: DenseData, depth: int, constant: float, cfg) -> dict:
    """seg: one linear head; monodepth: a linear and an MLP head (hidden width = backbone width), the
    depth heads starting from the constant baseline. Each head starts from the same seed."""
    config = frozen.model.config
    grid = config.image_size // config.patch_size
    if data.task == "seg":
        heads = {"linear": partial(DenseHead, config.dim, data.num_classes, grid)}
        loss_fn = partial(F.cross_entropy, ignore_index=IGNORE_INDEX)
    else:
        heads = {"linear": partial(DenseHead, config.dim, 1, grid, 0, constant),
                 "mlp": partial(DenseHead, config.dim, 1, grid, config.dim, constant)}
        loss_fn = depth_map_loss
    feats = frozen.features(data.train.images, depth)
    for name, build in heads.items():
        torch.manual_seed(cfg.seed)
        heads[name] = fit_head(build(), feats, data.train.targets, loss_fn, cfg, frozen.device)
    return heads


def evaluate_heads(frozen: FrozenBackbone, heads: dict, data: DenseData, depths: list[int]) -> dict:
    """{depth: metrics} of the same trained heads at each backbone depth; with two heads (monodepth) each
    metric is named after its head (rmse_linear, rmse_mlp, ...)."""
    results = {}
    for depth in depths:
        feats = frozen.features(data.test.images, depth)
        results[depth] = {}
        for name, head in heads.items():
            metrics = evaluate_head(head, feats, data.test.targets, data, frozen.batch_size, frozen.device)
            results[depth].update({f"{k}_{name}" if len(heads) > 1 else k: v for k, v in metrics.items()})
    return results


# --- one probe run: every input checked, then the heads trained and evaluated at each depth ---


def check_config(cfg: ProbeConfig) -> None:
    """The flags, before any file is read (ranges: lib/boundary.py's table): one line naming the flag."""
    check_numbers(asdict(cfg))
    parse_depths(cfg.eval_depths)
    hint = {"depth": " (monocular depth is monodepth; --depth sets the backbone's steps)",
            "mean": " (mean pooling is train.py's --probe cls --probe-pool mean)"}.get(cfg.probe, "")
    data = cfg.data and path_problem(cfg.data, "folder")
    cache = cfg.probe_cache and outputs_problem("--probe-cache", cfg.probe_cache, ())
    out = cfg.out_dir and outputs_problem("--out-dir", cfg.out_dir, OUT_FILES)
    for broken, message in [
            (cfg.probe not in DENSE_PROBES, f"--probe must be one of {', '.join(DENSE_PROBES)} here (cls is "
                                            f"train.py's); got {cfg.probe!r}{hint}"),
            (not cfg.backbone, f"--probe {cfg.probe} needs --backbone CHECKPOINT"),
            (not cfg.max_steps and not cfg.epochs, "--epochs must be > 0 (or give --max-steps); got 0"),
            (data, f"--data {cfg.data}: {data}"), (cache, cache), (out, out)]:
        if broken:
            fail(message)


def load_data(cfg: ProbeConfig, config) -> DenseData:
    """--data (or the proxy), checked against the backbone's input and the batch size."""
    data = load_dense(cfg, config.image_size, config.in_channels) if cfg.data else load_proxy(cfg)
    expected = (config.in_channels, config.image_size, config.image_size)
    shape = next((s.images.shape[1:] for s in (data.train, data.test) if s.images.shape[1:] != expected), ())
    labels = [t for t in (data.train.targets, data.test.targets) if data.task == "seg"]
    for broken, message in [
            (shape, f"--data {data.name}: images are {tuple(shape)}; the backbone expects {expected}"),
            (any(((t < 0) | (t >= data.num_classes) & (t != IGNORE_INDEX)).any() for t in labels),
             f"--data {data.name}: labels must be in 0..{data.num_classes - 1} or {IGNORE_INDEX} (ignore)"),
            (len(data.train.images) < cfg.batch_size, f"--batch-size {cfg.batch_size} is larger than the "
                                                      f"training set ({len(data.train.images)} images)")]:
        if broken:
            fail(message)
    return data


def run(cfg: ProbeConfig) -> dict:
    t_start = time.perf_counter()
    check_config(cfg)
    try:
        frozen = FrozenBackbone(cfg)
        data = load_data(cfg, frozen.model.config)
    except (ValueError, FileNotFoundError) as e:  # a reader's one line, naming the flag or the file
        fail(str(e))
    depths = frozen.depths
    baseline, constant = constant_baseline(data)
    heads = train_heads(frozen, data, depths[0], constant, cfg)
    results = evaluate_heads(frozen, heads, data, depths)
    if len(heads) > 1:  # the constant row, under each head's column names
        baseline = {f"{k}_{name}": v for k, v in baseline.items() for name in heads}
    summary = {"probe": data.task, "data": data.name, "unit": data.unit, "backbone": str(cfg.backbone),
               "arch": frozen.ckpt["arch"], "reference_depth": frozen.model.config.depth,
               "trained_depth": depths[0], "train_images": len(data.train.images),
               "test_images": len(data.test.images),
               **{f"test_{k}": v for k, v in results[depths[0]].items()},
               "depths": {str(d): r for d, r in results.items()}, "constant": baseline,
               "minutes": (time.perf_counter() - t_start) / 60}
    place = non_finite_place(summary)
    if place:  # as a non-finite loss stops train.py: a metric that is not a number is never reported
        fail(f"--probe {cfg.probe}: the metric {place} is not finite (every test pixel ignored, or a "
             f"diverged head); nothing written")
    print(results_table(summary))
    if cfg.out_dir:
        write_json(summary, str(Path(cfg.out_dir) / OUT_FILES[0]))
        tensors = {f"{name}.{key}": value.detach().cpu().contiguous() for name, head in heads.items()
                   for key, value in head.state_dict().items()}
        atomic_write(Path(cfg.out_dir) / OUT_FILES[1],  # tagged: a re-run into --out-dir may replace it
                     lambda tmp: save_file(tensors, tmp, metadata={"format": "revit.probe_heads"}))
    return summary


def percent(key):
    return lambda r: f"{100 * r[key]:.1f}"


COLUMNS = {"seg": [("mIoU %", percent("miou")), ("pixel acc %", percent("pixel_acc"))],
           "monodepth": [("RMSE lin", f("rmse_linear", "{:.4f}")), ("RMSE MLP", f("rmse_mlp", "{:.4f}")),
                         ("δ<1.25 lin %", percent("delta1_linear")),
                         ("δ<1.25 MLP %", percent("delta1_mlp"))]}


def results_table(summary: dict) -> str:
    """A markdown table: one row per depth (the trained one marked) and the constant predictor."""
    header = (f"{summary['arch']} | {summary['data']} | {summary['train_images']} train / "
              f"{summary['test_images']} test images")
    if summary["probe"] == "monodepth":
        header += f" | RMSE in {summary['unit']}"
    trained = str(summary["trained_depth"])
    rows = [{"depth": f"{d} (trained)" if d == trained else d, **metrics}
            for d, metrics in sorted(summary["depths"].items(), key=lambda kv: int(kv[0]))]
    rows.append({"depth": "constant", **summary["constant"]})
    return header + "\n" + markdown(rows, [("backbone depth", f("depth", "{}")), *COLUMNS[summary["probe"]]])


def main(argv=None) -> dict:
    return run(ProbeConfig(**vars(build_parser().parse_args(argv))))


if __name__ == "__main__":
    run_main(main, "every file it writes is written whole or not at all")
