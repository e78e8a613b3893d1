"""Train reViT / ViT / Raptor on images and AlterNet on text: one loop, single process or torchrun.

    python train.py --arch revit-mini                     # Fashion-MNIST on a CPU, a few minutes
    python train.py --arch revit-s --dataset cifar10      # any preset of revit.py or alternet.py
    torchrun --nproc_per_node 8 train.py --arch revit-b --data /imagenet --compile
    python train.py --arch alternet-tiny                  # byte-level tinyshakespeare

Modes (one loop, a task object supplies the loss and the evaluation):
- supervised images: DeiT III recipe of the reViT paper's Table 6 (AdamW, cosine with linear warmup,
  BCE on binarised mixup/cutmix targets, 3-Augment, colour jitter 0.3) -- the dataclass defaults;
  small data sets override epochs/batch/augmentation through DATASET_DEFAULTS (printed at start);
- distillation (`--teacher`): final-layer token MSE of SPEC §1.5 (Eq. 4) against a frozen teacher;
- linear probe (`--probe cls --backbone CKPT`): frozen backbone, linear head on the class token or
  on mean-pooled patch tokens; dense probes (`--probe seg|depth`: per-patch segmentation and depth
  heads on cached frozen features, mIoU / RMSE per --eval-depths) run probes.py's loop;
- language model (an alternet preset): next-token loss returned by the model, validation loss and
  bits-per-byte at the halted depth and at every fixed depth.

The loop knows nothing about a model beyond: it returns its loss terms (aux losses already
weighted), and the optional hooks set_step(step) / after_optimizer_step() / no_weight_decay().
Checkpoints are written atomically and hold everything needed to resume bit-for-bit on CPU:
the data order is a function of (seed, epoch, step), and every RNG state is saved.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import gzip
import json
import math
import os
import pickle
import random
import tarfile
import time
import typing
import urllib.request
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

import revit


def fail(message: str):
    """A user error: one clear line on stderr, non-zero exit, nothing written."""
    raise SystemExit(f"train.py: error: {message}")


def opt(default, help: str):
    return field(default=default, metadata={"help": help})


# --- config: defaults are the reViT paper's Table 6 (DeiT III ImageNet recipe) ---


@dataclass
class TrainConfig:
    # model
    arch: str = opt("revit-mini", "preset name from revit.PRESETS or alternet.PRESETS (see --list-archs)")
    patch_size: int | None = opt(None, "override the preset's patch size (auto: adapted to small images, see README)")
    depth: int | None = opt(None, "override the reference recurrent depth L / number of blocks (seg/depth "
                                  "probes: the backbone depth the heads are trained at)")
    num_experts: int | None = opt(None, "override E, the experts of reViT's bank")
    drop_path: float | None = opt(None, "override the per-block stochastic depth rate")
    depth_drop: float | None = opt(None, "elastic-depth rate: drop whole recurrent steps per image (paper: 0.3)")
    model_args: str = opt("", "any other model config fields, e.g. 'dim=128,heads=4' (see revit.ViTConfig)")
    # data
    dataset: str = opt("", "fashion-mnist | cifar10 | cifar100 | imagenet (ImageFolder at --data) | text "
                           "(auto: fashion-mnist for vision presets, tinyshakespeare for language presets)")
    data: str = opt("", "your own data: an ImageFolder root with train/ and val/ (vision) or a UTF-8 text "
                        "file / folder of .txt files (language)")
    data_dir: str = opt("", "where the built-in data sets live, files directly in it or in a per-data-set "
                            "subfolder (auto: ./data, then $REVIT_DATA_DIR, then /usr/share/datasets)")
    download: bool = opt(True, "download a built-in data set into the data dir when no search location has it")
    tokenizer: str = opt("byte", "text only: byte (vocab 256) | gpt2 (tiktoken BPE, vocab 50257)")
    block_size: int | None = opt(None, "text only: training sequence length (auto: the model's max length)")
    train_subset: int = opt(0, "use only the first N training examples (0: all) -- quick experiments")
    test_subset: int = opt(0, "evaluate on only the first N test examples (0: all)")
    workers: int = opt(8, "ImageFolder only: data-loading worker processes per rank")
    # optimisation
    epochs: int | None = opt(300, "training epochs (Table 6: 300; smaller data sets set their own)")
    max_steps: int = opt(0, "optimizer steps to train; overrides --epochs when > 0 (text data trains by steps)")
    batch_size: int = opt(2048, "GLOBAL batch per optimizer step, over all ranks and accumulation steps")
    grad_accum: int = opt(1, "gradient accumulation micro-steps per optimizer step")
    lr: float | None = opt(None, "peak learning rate at --lr-batch images (auto: Table 6's 4e-3 up to width 384 "
                                 "('S'), 3e-3 for B/L; language: 3e-4, 1e-3 up to width 256)")
    lr_batch: int = opt(2048, "linear scale rule: peak lr = lr * batch_size / lr_batch (0: use lr as given)")
    min_lr: float = opt(1e-5, "final learning rate of the cosine schedule")
    warmup_epochs: float = opt(5.0, "linear warmup length in epochs (Table 6: 5)")
    warmup_steps: int | None = opt(None, "warmup length in optimizer steps; overrides --warmup-epochs")
    warmup_lr: float = opt(1e-6, "learning rate at the start of warmup (Table 6: 1e-6)")
    weight_decay: float = opt(0.05, "AdamW weight decay; never on 1-D params (norms, biases, LayerScale), "
                                    "class/position tokens or the reViT router's output layer")
    beta1: float = opt(0.9, "AdamW beta1")
    beta2: float = opt(0.999, "AdamW beta2")
    grad_clip: float = opt(1.0, "clip the global gradient norm to this value (0: off)")
    # loss and augmentation (applied to the batch tensor on the device)
    loss: str = opt("bce", "bce (DeiT III: binary cross-entropy on binarised mixup/cutmix targets) | ce")
    label_smoothing: float = opt(0.0, "label smoothing of the one-hot targets (Table 6: 0)")
    mixup: float = opt(0.8, "mixup Beta(alpha, alpha) parameter (0: off)")
    cutmix: float = opt(1.0, "cutmix Beta(alpha, alpha) parameter (0: off)")
    mix_prob: float = opt(1.0, "probability of applying mixup or cutmix to a batch")
    mix_switch_prob: float = opt(0.5, "probability of cutmix instead of mixup when both are on")
    random_crop: bool = opt(True, "random crop after reflect-padding by image_size/8, and horizontal flip")
    three_augment: bool = opt(True, "DeiT III 3-Augment: per image one of grayscale, solarize, gaussian blur")
    color_jitter: float = opt(0.3, "brightness/contrast/saturation jitter strength (0: off)")
    repeated_aug: int = opt(3, "repeated augmentation: each image appears this many times per epoch (1: off)")
    # evaluation, elastic depth, distillation, probes
    eval_depths: str = opt("", "comma-separated depths for the final evaluation, e.g. 4,8,12 (reViT / Raptor)")
    eval_interval: int = opt(0, "evaluate and checkpoint every N optimizer steps (0: every epoch; text: 500)")
    eval_batch_size: int = opt(256, "batch per rank for evaluation")
    eval_iters: int = opt(0, "text only: evaluate on at most this many validation batches (0: all)")
    teacher: str = opt("", "distillation: a checkpoint of this project, or hub:dinov2_vitb14 (needs internet)")
    probe: str = opt("", "probe of a frozen --backbone: cls (linear classification) | seg (linear segmentation "
                         "head, mIoU) | depth (linear and MLP depth heads, RMSE); seg/depth run probes.py")
    probe_pool: str = opt("cls", "probe input: cls (final class token, out['pre_logits']) | mean (patch tokens)")
    backbone: str = opt("", "probe mode: checkpoint of the frozen backbone")
    probe_cache: str = opt("", "seg/depth probes: folder caching the frozen backbone's features (keyed by "
                               "checkpoint hash, depth and data; empty: recompute)")
    # system
    out_dir: str = opt("", "run folder for ckpt.pt and metrics.jsonl (auto: out/<arch>-<time>; "
                           "with --resume: the checkpoint's folder)")
    resume: str = opt("", "continue the run saved in this checkpoint (same arch; config taken from it)")
    save_interval: int = opt(0, "also checkpoint every N optimizer steps (0: only at evaluations and the end)")
    stop_at_step: int = opt(0, "stop (as if killed) after this optimizer step, checkpointing first; the "
                               "schedule is unchanged so --resume continues exactly")
    seed: int = opt(0, "random seed: model init, data order, augmentation")
    device: str = opt("auto", "auto | cpu | cuda | cuda:N")
    bf16: bool = opt(True, "bf16 autocast (CUDA only; CPU always runs in float32)")
    compile: bool = opt(False, "torch.compile the model (CUDA only)")
    ddp_find_unused: bool = opt(False, "DDP find_unused_parameters (needed if some parameters get no gradient)")
    log_interval: int = opt(10, "write a metrics line every N optimizer steps")
    progress: bool = opt(True, "show a tqdm progress bar")


# Per-data-set defaults for fields the user did not set; everything else is Table 6.
# Fashion-MNIST: short CPU schedule (the 300-epoch ImageNet recipe would take days there);
# mixup/cutmix/3-Augment slow down such short runs, so they are off (turn on with the flags).
DATASET_DEFAULTS = {
    "imagenet": dict(),
    # A 15-epoch CPU run of a 0.2M model: heavy regularisation only slows it (random crop + flip
    # cost 12 points of test accuracy after one epoch in our runs), so plain images and cross-entropy.
    "fashion-mnist": dict(epochs=15, batch_size=256, warmup_epochs=0.5, loss="ce", mixup=0.0, cutmix=0.0,
                          random_crop=False, three_augment=False, color_jitter=0.0, repeated_aug=1,
                          lr_batch=256, lr=3e-3),
    "cifar10": dict(epochs=100, batch_size=256, warmup_epochs=5.0, repeated_aug=1, color_jitter=0.0),
    "cifar100": dict(epochs=100, batch_size=256, warmup_epochs=5.0, repeated_aug=1, color_jitter=0.0),
    "text": dict(max_steps=2000, batch_size=32, warmup_steps=100, lr_batch=0, weight_decay=0.1,
                 beta2=0.95, eval_interval=500, ddp_find_unused=True),  # top-k: unrouted experts get no grad
}
# A probe trains only a linear head: no heavy augmentation, plain cross-entropy, no decay.
PROBE_DEFAULTS = dict(loss="ce", mixup=0.0, cutmix=0.0, three_augment=False, color_jitter=0.0, weight_decay=0.0)


def dataclass_parser(config_class, description: str, suppress_defaults: bool = False) -> argparse.ArgumentParser:
    """One flag per dataclass field (--snake_case -> --snake-case), its help from the field's metadata.
    suppress_defaults: unset flags stay absent from the namespace, so the caller sees what was given."""
    parser = argparse.ArgumentParser(description=description,
                                     argument_default=argparse.SUPPRESS if suppress_defaults else None)
    hints = typing.get_type_hints(config_class)
    for f in fields(config_class):
        kind = ([a for a in typing.get_args(hints[f.name]) if a is not type(None)] or [hints[f.name]])[0]
        flag = "--" + f.name.replace("_", "-")
        shown = "auto" if f.default is None or f.default == "" else f.default
        extra = {} if suppress_defaults else {"default": f.default}
        help_text = f"{f.metadata['help']} [default: {shown}]"
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text, **extra)
        else:
            parser.add_argument(flag, type=kind, metavar=kind.__name__.upper(), help=help_text, **extra)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = dataclass_parser(TrainConfig, __doc__.split("\n\n")[0], suppress_defaults=True)
    parser.add_argument("--list-archs", action="store_true", help="print the preset names and exit")
    return parser


def family_of(arch: str) -> str:
    if arch in revit.PRESETS:
        return "vision"
    alternet = import_alternet(required=False)
    if alternet is not None and arch in alternet.PRESETS:
        return "language"
    names = sorted(revit.PRESETS) + (sorted(alternet.PRESETS) if alternet else [])
    fail(f"unknown --arch {arch!r}; valid names: {', '.join(names)}")


def import_alternet(required: bool = True):
    try:
        import alternet
    except ImportError as e:
        if required:
            fail(f"language models need alternet.py next to train.py ({e})")
        return None
    return alternet


def resolve_config(explicit: dict) -> TrainConfig:
    """Table 6 defaults <- data-set / mode defaults <- flags the user gave. Validates everything."""
    if explicit.get("backbone") and "arch" not in explicit:  # a probe is named after its backbone
        with contextlib.suppress(Exception):  # an unreadable file is reported when it is loaded
            explicit["arch"] = torch.load(explicit["backbone"], map_location="cpu", weights_only=True)["arch"]
    arch = explicit.get("arch", TrainConfig.arch)
    family = family_of(arch)
    dataset = explicit.get("dataset") or ("text" if family == "language" else
                                          "imagenet" if explicit.get("data") else "fashion-mnist")
    if dataset not in DATASET_DEFAULTS:
        fail(f"unknown --dataset {dataset!r}; choose one of {', '.join(DATASET_DEFAULTS)}")
    if (family == "language") != (dataset == "text"):
        fail(f"--arch {arch} is a {family} model but --dataset {dataset} is "
             f"{'text' if dataset == 'text' else 'images'}")
    values = dict(DATASET_DEFAULTS[dataset], dataset=dataset)
    if explicit.get("probe"):
        values.update(PROBE_DEFAULTS)
        if explicit["probe"] in DENSE_PROBES:
            import probes
            values.update(probes.DEFAULTS)
    values.update(explicit)
    cfg = TrainConfig(**values)
    check_config(cfg)
    return cfg


def check_config(cfg: TrainConfig) -> None:
    positive = ["batch_size", "grad_accum", "eval_batch_size", "log_interval"]
    non_negative = ["min_lr", "warmup_epochs", "warmup_lr", "weight_decay", "grad_clip", "label_smoothing",
                    "mixup", "cutmix", "max_steps", "train_subset", "test_subset", "eval_interval",
                    "save_interval", "stop_at_step", "color_jitter", "lr_batch", "eval_iters", "workers"]
    for name in positive:
        if getattr(cfg, name) <= 0:
            fail(f"--{name.replace('_', '-')} must be > 0; got {getattr(cfg, name)}")
    for name in non_negative:
        if getattr(cfg, name) < 0:
            fail(f"--{name.replace('_', '-')} must be >= 0; got {getattr(cfg, name)}")
    if cfg.lr is not None and cfg.lr <= 0:
        fail(f"--lr must be > 0; got {cfg.lr}")
    if cfg.epochs is not None and cfg.epochs <= 0 and cfg.max_steps == 0:
        fail(f"--epochs must be > 0 (or give --max-steps); got {cfg.epochs}")
    if cfg.repeated_aug < 1:
        fail(f"--repeated-aug must be >= 1; got {cfg.repeated_aug}")
    if cfg.loss not in ("bce", "ce"):
        fail(f"--loss must be bce or ce; got {cfg.loss!r}")
    if cfg.tokenizer not in ("byte", "gpt2"):
        fail(f"--tokenizer must be byte or gpt2; got {cfg.tokenizer!r}")
    if cfg.probe and cfg.probe not in (*PROBES, *DENSE_PROBES):
        fail(f"--probe must be one of {', '.join((*PROBES, *DENSE_PROBES))}; got {cfg.probe!r}")
    if cfg.probe and not cfg.backbone:
        fail("--probe needs --backbone CHECKPOINT (the frozen model to probe)")
    if cfg.probe_pool not in ("cls", "mean"):
        fail(f"--probe-pool must be cls or mean; got {cfg.probe_pool!r}")
    if cfg.probe and cfg.teacher:
        fail("--probe and --teacher cannot be combined")
    if cfg.data_dir and not Path(cfg.data_dir).is_dir():
        fail(f"--data-dir {cfg.data_dir} does not exist (omit it to search ./data, $REVIT_DATA_DIR and "
             f"/usr/share/datasets)")
    if cfg.data and not Path(cfg.data).exists():
        fail(f"--data {cfg.data} does not exist")
    for path, flag in ((cfg.resume, "--resume"), (cfg.backbone, "--backbone")):
        if path and not Path(path).is_file():
            fail(f"{flag} {path}: no such checkpoint file")
    if cfg.teacher and not cfg.teacher.startswith("hub:") and not Path(cfg.teacher).is_file():
        fail(f"--teacher {cfg.teacher}: no such checkpoint file (or use hub:dinov2_vitb14)")
    parse_depths(cfg.eval_depths)
    parse_model_args(cfg.model_args)


def parse_depths(text: str) -> list[int]:
    try:
        depths = [int(d) for d in text.split(",") if d.strip()]
    except ValueError:
        fail(f"--eval-depths must be comma-separated integers, e.g. 4,8,12; got {text!r}")
    if any(d < 1 for d in depths):
        fail(f"--eval-depths must be positive; got {text!r}")
    return depths


def parse_model_args(text: str) -> dict:
    overrides = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            fail(f"--model-args expects key=value pairs separated by commas; got {item!r}")
        try:
            overrides[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            overrides[key.strip()] = value.strip()
    return overrides


# --- data: Fashion-MNIST (IDX), CIFAR (python pickles), ImageFolder, text ---

URLS = {
    "fashion-mnist": "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
    "cifar10": "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
    "cifar100": "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
    "text": "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
}
FMNIST_FILES = ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"]
# name: (subfolder, file that marks it, how to get it)
BUILTIN = {
    "fashion-mnist": ("fashion-mnist", "t10k-labels-idx1-ubyte.gz",
                      f"`apt-get install dataset-fashion-mnist`, or download {', '.join(FMNIST_FILES)} "
                      f"from {URLS['fashion-mnist']}"),
    "cifar10": ("cifar-10-batches-py", "test_batch", f"download and unpack {URLS['cifar10']}"),
    "cifar100": ("cifar-100-python", "test", f"download and unpack {URLS['cifar100']}"),
    "text": ("", "tinyshakespeare.txt", f"download {URLS['text']} as tinyshakespeare.txt"),
}
NORMALISATION = {  # per-channel mean, std of the training set
    "fashion-mnist": ([0.2860], [0.3530]),
    "cifar10": ([0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]),
    "cifar100": ([0.5071, 0.4865, 0.4409], [0.2673, 0.2564, 0.2762]),
    "imagenet": ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
}


def data_roots(cfg: TrainConfig) -> list[Path]:
    roots = [Path(cfg.data_dir or "data")]
    if os.environ.get("REVIT_DATA_DIR"):
        roots.append(Path(os.environ["REVIT_DATA_DIR"]))
    return roots + [Path("/usr/share/datasets")]


def find_builtin(cfg: TrainConfig, name: str, is_main: bool) -> Path:
    """The folder holding data set `name`: search the roots, else download (rank 0), else explain."""
    subfolder, marker, how = BUILTIN[name]
    for root in data_roots(cfg):
        for folder in (root / subfolder, root) if subfolder else (root,):
            if (folder / marker).exists():
                return folder
    target = Path(cfg.data_dir or "data")
    if cfg.download and is_main:
        try:
            download_builtin(name, target)
        except OSError as e:
            fail(f"{name} not found in {', '.join(map(str, data_roots(cfg)))} and the download failed ({e}). "
                 f"To get it: {how}, into {target}/")
    if dist.is_initialized():
        dist.barrier()
    folder = target / subfolder if subfolder else target
    if not (folder / marker).exists():
        fail(f"{name} not found in {', '.join(map(str, data_roots(cfg)))}. To get it: {how}, into {target}/ "
             f"(or point --data-dir at a folder that has it)")
    return folder


def fetch(url: str, path: Path) -> None:
    """Download to a temp name, then rename: an interrupted download never looks like data."""
    tmp = path.with_name(path.name + ".part")
    with urllib.request.urlopen(url, timeout=60) as response, open(tmp, "wb") as f:
        f.write(response.read())
    os.replace(tmp, path)


def download_builtin(name: str, target: Path) -> None:
    print(f"downloading {name} into {target} ...")
    if name == "fashion-mnist":
        (target / "fashion-mnist").mkdir(parents=True, exist_ok=True)
        for file in FMNIST_FILES:
            fetch(URLS[name] + file, target / "fashion-mnist" / file)
    elif name == "text":
        target.mkdir(parents=True, exist_ok=True)
        fetch(URLS[name], target / "tinyshakespeare.txt")
    else:
        target.mkdir(parents=True, exist_ok=True)
        archive = target / Path(URLS[name]).name
        fetch(URLS[name], archive)
        with tarfile.open(archive) as tar:
            tar.extractall(target, filter="data")


def read_idx(path: Path) -> torch.Tensor:
    """IDX format (LeCun): 2 zero bytes, dtype code 0x08 (uint8), rank, big-endian dims, data."""
    raw = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
    if raw[:3] != b"\x00\x00\x08":
        fail(f"{path} is not an uint8 IDX file")
    rank = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(rank)]
    return torch.frombuffer(bytearray(raw[4 + 4 * rank:]), dtype=torch.uint8).view(*dims)


def load_fashion_mnist(folder: Path):
    def split(prefix):
        images = read_idx(folder / f"{prefix}-images-idx3-ubyte.gz").unsqueeze(1)  # (N, 1, 28, 28)
        return images, read_idx(folder / f"{prefix}-labels-idx1-ubyte.gz").long()
    return split("train"), split("t10k"), 10


def load_cifar(folder: Path, classes: int):
    def read(names):
        images, labels = [], []
        for name in names:
            with open(folder / name, "rb") as f:
                try:
                    batch = pickle.load(f, encoding="bytes")  # the official archive format
                except ModuleNotFoundError as e:
                    fail(f"reading the CIFAR archives needs numpy (pip install numpy): {e}")
            images.append(torch.tensor(batch[b"data"], dtype=torch.uint8).view(-1, 3, 32, 32))
            labels.append(torch.tensor(batch[b"labels" if classes == 10 else b"fine_labels"]))
        return torch.cat(images), torch.cat(labels).long()
    if classes == 10:
        return read([f"data_batch_{i}" for i in range(1, 6)]), read(["test_batch"]), 10
    return read(["train"]), read(["test"]), 100


class TensorImages:
    """A whole image data set as uint8 tensors (N, C, H, W); batches are index gathers."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def batches(self, index_batches):
        for idx in index_batches:
            yield self.images[idx], self.labels[idx]


class FolderImages:
    """An ImageFolder tree read by torchvision (resize/crop on CPU workers; the rest on the device)."""

    def __init__(self, root: Path, image_size: int, train: bool, workers: int):
        try:
            import torchvision.transforms.v2 as T
            from torchvision.datasets import ImageFolder
        except ImportError:
            fail("--data with an image folder needs torchvision and Pillow: pip install torchvision pillow")
        if train:  # 3-Augment's RandomResizedCrop (scale 0.08-1, bicubic); flips etc. run on the device
            resize = [T.RandomResizedCrop(image_size, scale=(0.08, 1.0), interpolation=T.InterpolationMode.BICUBIC)]
        else:  # evaluation crop ratio 1.0 (Table 6): resize the short side, centre crop
            resize = [T.Resize(image_size, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(image_size)]
        self.dataset = ImageFolder(str(root), transform=T.Compose([T.PILToTensor(), *resize]))
        self.labels = torch.tensor(self.dataset.targets)
        self.workers = workers

    def __len__(self):
        return len(self.dataset)

    def batches(self, index_batches):
        loader = torch.utils.data.DataLoader(self.dataset, batch_sampler=[idx.tolist() for idx in index_batches],
                                             num_workers=self.workers, pin_memory=torch.cuda.is_available())
        yield from loader


@dataclass
class ImageData:
    train: object
    test: object
    num_classes: int
    channels: int
    image_size: int
    mean: list
    std: list


def load_images(cfg: TrainConfig, is_main: bool) -> ImageData:
    if cfg.dataset == "imagenet":
        if not cfg.data:
            fail("--dataset imagenet needs --data ROOT (an ImageFolder tree with train/ and val/)")
        root = Path(cfg.data)
        for split in ("train", "val"):
            if not (root / split).is_dir():
                fail(f"--data {root} must contain {split}/ (ImageFolder layout: {split}/<class>/<image>)")
        size = 224  # Table 6 training and evaluation resolution
        train = FolderImages(root / "train", size, True, cfg.workers)
        test = FolderImages(root / "val", size, False, cfg.workers)
        mean, std = NORMALISATION["imagenet"]
        return ImageData(train, test, len(train.dataset.classes), 3, size, mean, std)
    folder = find_builtin(cfg, cfg.dataset, is_main)
    if cfg.dataset == "fashion-mnist":
        (xtr, ytr), (xte, yte), classes = load_fashion_mnist(folder)
    else:
        (xtr, ytr), (xte, yte), classes = load_cifar(folder, 10 if cfg.dataset == "cifar10" else 100)
    if cfg.train_subset:
        xtr, ytr = xtr[:cfg.train_subset], ytr[:cfg.train_subset]
    if cfg.test_subset:
        xte, yte = xte[:cfg.test_subset], yte[:cfg.test_subset]
    mean, std = NORMALISATION[cfg.dataset]
    return ImageData(TensorImages(xtr, ytr), TensorImages(xte, yte), classes, xtr.shape[1], xtr.shape[-1], mean, std)


def epoch_order(n: int, seed: int, epoch: int, repeats: int) -> torch.Tensor:
    """The sample order of one epoch: a function of (seed, epoch) only, so a resumed run sees the same
    data. Repeated augmentation (DeiT) draws n/repeats images and shows each `repeats` times; copies
    are adjacent and the rank split is strided, so they land on different ranks."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=g)
    if repeats > 1:
        perm = perm[:math.ceil(n / repeats)].repeat_interleave(repeats)[:n]
    return perm


def image_batches(data, cfg, rank, world, start_step, steps_per_epoch):
    """Yield (step, images uint8, labels) for this rank from `start_step` on, forever."""
    step = start_step
    while True:
        epoch, first = divmod(step, steps_per_epoch)
        order = epoch_order(len(data), cfg.seed, epoch, cfg.repeated_aug)
        index_batches = [order[s * cfg.batch_size:(s + 1) * cfg.batch_size][rank::world]  # strided rank split
                         for s in range(first, steps_per_epoch)]
        for images, labels in data.batches(index_batches):
            yield step, images, labels
            step += 1


def load_text(cfg: TrainConfig, is_main: bool) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """Train/val token tensors (90/10 split), tokens per byte, vocabulary size."""
    if cfg.data:
        path = Path(cfg.data)
        files = sorted(path.rglob("*.txt")) if path.is_dir() else [path]
        if not files:
            fail(f"--data {path} holds no .txt files")
    else:
        files = [find_builtin(cfg, "text", is_main) / "tinyshakespeare.txt"]
    try:
        text = "\n".join(f.read_text(encoding="utf-8") for f in files)
    except UnicodeDecodeError as e:
        fail(f"--data must be UTF-8 text ({e})")
    raw = text.encode("utf-8")
    if cfg.tokenizer == "byte":
        tokens, vocab = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long(), 256
    else:
        try:
            import tiktoken
            encoding = tiktoken.get_encoding("gpt2")
        except Exception as e:  # package missing or its encoding files not downloadable
            fail(f"--tokenizer gpt2 needs the tiktoken package and its gpt2 encoding files ({e})")
        tokens, vocab = torch.tensor(encoding.encode_ordinary(text), dtype=torch.long), encoding.n_vocab
    split = int(0.9 * len(tokens))
    return tokens[:split], tokens[split:], len(tokens) / len(raw), vocab


def text_batches(tokens, cfg, rank, world, start_step, block_size):
    """Random windows; the windows of step s are drawn from a generator seeded by (seed, s)."""
    step = start_step
    while True:
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        starts = torch.randint(len(tokens) - block_size - 1, (cfg.batch_size,), generator=g)[rank::world]
        windows = torch.stack([tokens[s:s + block_size + 1] for s in starts.tolist()])  # (b, T+1)
        yield step, windows[:, :-1], windows[:, 1:]
        step += 1


# --- batch augmentation on the device (DeiT III 3-Augment, mixup / cutmix) ---


class Augment:
    """Per-image randomness from a torch.Generator on the device, per-batch (mixup/cutmix) from a
    python Random; both are saved in checkpoints."""

    def __init__(self, cfg: TrainConfig, data: ImageData, device, seed: int):
        self.cfg, self.num_classes = cfg, data.num_classes
        self.mean = torch.tensor(data.mean, device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(data.std, device=device).view(1, -1, 1, 1)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.batch_rng = random.Random(seed)

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std

    def rand(self, *shape):
        return torch.rand(*shape, generator=self.generator, device=self.generator.device)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor):
        """uint8 (B, C, H, W), labels (B,) -> normalised float images, soft targets (B, classes)."""
        cfg = self.cfg
        x = images.float() / 255
        if cfg.random_crop:
            x = self.crop_and_flip(x)
        if cfg.three_augment:
            x = self.three_augment(x)
        if cfg.color_jitter:
            x = self.jitter(x, cfg.color_jitter)
        x = self.normalise(x)
        targets = F.one_hot(labels, self.num_classes).float()
        targets = targets * (1 - cfg.label_smoothing) + cfg.label_smoothing / self.num_classes
        return self.mix(x, targets)

    def crop_and_flip(self, x):
        b, _, h, w = x.shape
        pad = max(1, h // 8)  # 4 px at 32x32, 3 px at 28x28
        padded = F.pad(x, (pad, pad, pad, pad), mode="reflect")
        oy = (self.rand(b) * (2 * pad + 1)).long()  # (B,) crop offsets
        ox = (self.rand(b) * (2 * pad + 1)).long()
        rows = (oy[:, None] + torch.arange(h, device=x.device))[:, None, :, None]  # (B, 1, H, 1)
        cols = (ox[:, None] + torch.arange(w, device=x.device))[:, None, None, :]  # (B, 1, 1, W)
        batch = torch.arange(b, device=x.device)[:, None, None, None]
        chans = torch.arange(x.shape[1], device=x.device)[None, :, None, None]
        x = padded[batch, chans, rows, cols]  # (B, C, H, W)
        flip = (self.rand(b) < 0.5)[:, None, None, None]
        return torch.where(flip, x.flip(3), x)

    @staticmethod
    def grayscale(x):
        if x.shape[1] == 1:
            return x
        weights = torch.tensor([0.299, 0.587, 0.114], device=x.device).view(1, 3, 1, 1)
        return (x * weights).sum(1, keepdim=True).expand_as(x)

    def blur(self, x, sigma):
        """Gaussian blur with a per-image sigma: separable conv, one kernel per image (grouped)."""
        b, c, h, w = x.shape
        radius = min(6, (h - 1) // 2)  # 3 * max sigma, capped so reflect padding fits
        offsets = torch.arange(-radius, radius + 1, device=x.device).float()
        kernel = torch.exp(-offsets[None] ** 2 / (2 * sigma[:, None] ** 2))  # (B, k)
        kernel = (kernel / kernel.sum(1, keepdim=True)).repeat_interleave(c, 0)  # (B*C, k)
        y = F.pad(x.reshape(1, b * c, h, w), (radius,) * 4, mode="reflect")
        y = F.conv2d(y, kernel[:, None, :, None], groups=b * c)  # vertical
        y = F.conv2d(y, kernel[:, None, None, :], groups=b * c)  # horizontal
        return y.view(b, c, h, w)

    def three_augment(self, x):
        """DeiT III: one of {grayscale, solarize, gaussian blur sigma in [0.1, 2]} per image."""
        choice = (self.rand(x.shape[0]) * 3).long()[:, None, None, None]
        sigma = 0.1 + 1.9 * self.rand(x.shape[0])
        solarized = torch.where(x >= 0.5, 1 - x, x)  # PIL solarize threshold 128
        return torch.where(choice == 0, self.grayscale(x), torch.where(choice == 1, solarized, self.blur(x, sigma)))

    def jitter(self, x, strength):
        """ColorJitter(b, c, s) with factors in [1-strength, 1+strength], in a fixed order."""
        b = x.shape[0]
        factor = lambda: (1 + strength * (2 * self.rand(b) - 1)).view(b, 1, 1, 1)  # noqa: E731
        x = (x * factor()).clamp(0, 1)                                                     # brightness
        mean = self.grayscale(x).mean((1, 2, 3), keepdim=True)
        x = (mean + factor() * (x - mean)).clamp(0, 1)                                     # contrast
        gray = self.grayscale(x)
        return (gray + factor() * (x - gray)).clamp(0, 1)                                  # saturation

    def mix(self, x, targets):
        """Batch mixup / cutmix with the flipped batch as partner (timm's 'batch' mode)."""
        cfg, rng = self.cfg, self.batch_rng
        if not (cfg.mixup or cfg.cutmix) or rng.random() >= cfg.mix_prob:
            return x, targets
        use_cutmix = cfg.cutmix > 0 and (cfg.mixup == 0 or rng.random() < cfg.mix_switch_prob)
        lam = rng.betavariate(cfg.cutmix, cfg.cutmix) if use_cutmix else rng.betavariate(cfg.mixup, cfg.mixup)
        if use_cutmix:
            h, w = x.shape[-2:]
            cut_h, cut_w = int(h * math.sqrt(1 - lam)), int(w * math.sqrt(1 - lam))
            cy, cx = rng.randrange(h), rng.randrange(w)
            y0, y1 = max(cy - cut_h // 2, 0), min(cy + cut_h // 2, h)
            x0, x1 = max(cx - cut_w // 2, 0), min(cx + cut_w // 2, w)
            x = x.clone()
            x[:, :, y0:y1, x0:x1] = x.flip(0)[:, :, y0:y1, x0:x1]
            lam = 1 - (y1 - y0) * (x1 - x0) / (h * w)  # the area actually pasted
        else:
            x = lam * x + (1 - lam) * x.flip(0)
        return x, lam * targets + (1 - lam) * targets.flip(0)


# --- tasks: each supplies the loss of a batch and the evaluation ---


def classification_loss(logits, targets, kind):
    if kind == "bce":  # DeiT III: binarise the mixed targets, then per-class binary cross-entropy
        return F.binary_cross_entropy_with_logits(logits, targets.gt(0.0).to(logits.dtype))
    return torch.sum(-targets * F.log_softmax(logits, dim=-1), dim=-1).mean()


class ClassificationTask:
    """Supervised image classification (also the linear probe: its model is a ProbeModel)."""

    def __init__(self, cfg, data: ImageData, device, augment: Augment, autocast):
        self.cfg, self.data, self.device, self.augment, self.autocast = cfg, data, device, augment, autocast

    def loss(self, model, images, labels):
        x, targets = self.augment(images.to(self.device, non_blocking=True), labels.to(self.device))
        with self.autocast():
            out = model(x, return_states=True)
        task = classification_loss(out["logits"].float(), targets, self.cfg.loss)
        aux = out.get("aux_losses", {})
        return task + sum(aux.values()), {"task": task, **aux}

    @torch.no_grad()
    def evaluate(self, model, depths, rank, world):
        """Top-1 accuracy at each depth (None = the model's reference depth) over this rank's shard."""
        model.eval()
        n = len(self.data.test)
        order = torch.arange(n)[rank::world]
        index_batches = order.split(self.cfg.eval_batch_size)
        results = {}
        for depth in depths:
            stats = torch.zeros(3, device=self.device)  # correct, loss sum, count
            for images, labels in self.data.test.batches(index_batches):
                x = self.augment.normalise(images.to(self.device).float() / 255)
                labels = labels.to(self.device)
                with self.autocast():
                    logits = model(x) if depth is None else model(x, depth=depth)
                logits = logits.float()
                stats += torch.stack([(logits.argmax(-1) == labels).sum().float(),
                                      F.cross_entropy(logits, labels, reduction="sum"),
                                      torch.tensor(float(len(labels)), device=self.device)])
            if world > 1:
                dist.all_reduce(stats)
            results[depth] = {"acc": (stats[0] / stats[2]).item(), "loss": (stats[1] / stats[2]).item()}
        model.train()
        return results


class DistillTask(ClassificationTask):
    """Eq. 4: L_dist = 1/(T d) ||LN(X^L) - Y||_F^2 against a frozen teacher's final post-LN tokens."""

    def __init__(self, cfg, data, device, augment, autocast, teacher):
        super().__init__(cfg, data, device, augment, autocast)
        self.teacher = teacher

    def loss(self, model, images, labels):
        x, _ = self.augment(images.to(self.device, non_blocking=True), labels.to(self.device))
        with self.autocast():
            out = model(x, return_states=True)
            with torch.no_grad():
                target = self.teacher(x)
        task = F.mse_loss(out["tokens"].float(), target.float())
        aux = out.get("aux_losses", {})
        return task + sum(aux.values()), {"distill": task, **aux}

    @torch.no_grad()
    def evaluate(self, model, depths, rank, world):
        model.eval()
        order = torch.arange(len(self.data.test))[rank::world]
        results = {}
        for depth in depths:
            stats = torch.zeros(2, device=self.device)
            for images, _ in self.data.test.batches(order.split(self.cfg.eval_batch_size)):
                x = self.augment.normalise(images.to(self.device).float() / 255)
                with self.autocast():
                    tokens = model(x, return_states=True, **({} if depth is None else {"depth": depth}))["tokens"]
                    target = self.teacher(x)
                stats += torch.stack([F.mse_loss(tokens.float(), target.float(), reduction="sum") / tokens[0].numel(),
                                      torch.tensor(float(len(x)), device=self.device)])
            if world > 1:
                dist.all_reduce(stats)
            results[depth] = {"distill_mse": (stats[0] / stats[1]).item()}
        model.train()
        return results


class ProjectTeacher(nn.Module):
    """A checkpoint of this project as a frozen teacher: its final post-LayerNorm tokens."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x, return_states=True)["tokens"]


class DinoTeacher(nn.Module):
    """torch.hub DINOv2: [class token, patch tokens] after its final norm (registers dropped)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        feats = self.model.forward_features(x)
        return torch.cat([feats["x_norm_clstoken"][:, None], feats["x_norm_patchtokens"]], dim=1)


def load_teacher(spec: str, device) -> nn.Module:
    if spec.startswith("hub:"):
        try:
            model = torch.hub.load("facebookresearch/dinov2", spec[4:])
        except Exception as e:
            fail(f"could not load {spec} from torch.hub (needs internet access): {e}")
        teacher = DinoTeacher(model)
    else:
        teacher = ProjectTeacher(load_model(spec)[0])
    teacher.to(device).eval().requires_grad_(False)
    return teacher


class ProbeModel(nn.Module):
    """A frozen backbone (always in eval mode, no grad) and a trainable linear head."""

    def __init__(self, backbone: nn.Module, num_classes: int, pool: str):
        super().__init__()
        self.backbone = backbone.eval().requires_grad_(False)
        self.pool = pool
        self.head = nn.Linear(backbone.config.dim, num_classes)
        nn.init.trunc_normal_(self.head.weight, std=0.01)
        nn.init.zeros_(self.head.bias)

    def train(self, mode: bool = True):
        super().train(mode)
        self.backbone.eval()  # frozen: no dropout / drop-path / elastic depth
        return self

    def features(self, images, depth=None):
        with torch.no_grad():
            out = self.backbone(images, return_states=True, **({} if depth is None else {"depth": depth}))
        return out["pre_logits"] if self.pool == "cls" else out["tokens"][:, 1:].mean(1)  # (B, d)

    def forward(self, images, depth=None, return_states=False):
        logits = self.head(self.features(images, depth))
        return {"logits": logits, "aux_losses": {}} if return_states else logits


# Probe name -> builder(backbone, num_classes, cfg) -> trainable model, trained by the loop below.
PROBES = {"cls": lambda backbone, num_classes, cfg: ProbeModel(backbone, num_classes, cfg.probe_pool)}
# Dense probes train per-patch heads on (cached) frozen features in probes.py's own loop: probes.run.
DENSE_PROBES = ("seg", "depth")


class LanguageTask:
    """Next-token prediction; the model computes its own loss (PonderNet L_PN + aux terms).

    Training cuts the model config's random_length_fraction of each batch to random valid lengths
    (torch's global RNG, saved in checkpoints), so the router and halt heads, which read the last
    valid token, learn every position generation routes on. Evaluation reports the full-window
    numbers (halted, and every fixed depth) and next to them "causal": alternet.causal_loss, each
    position routed and halted on its own prefix as in generation, on the first causal_windows
    validation windows of each rank (T forwards per window, so a subset); then prints a sample.
    """

    def __init__(self, cfg, val_tokens, tokens_per_byte, block_size, device, autocast, causal_windows=4,
                 sample_tokens=80):
        self.cfg, self.val, self.tokens_per_byte = cfg, val_tokens, tokens_per_byte
        self.block_size, self.device, self.autocast = block_size, device, autocast
        self.causal_windows, self.sample_tokens = causal_windows, sample_tokens
        self.alternet = import_alternet()

    def loss(self, model, tokens, targets):
        tokens, targets = tokens.to(self.device), targets.to(self.device)
        fraction = unwrap(model).config.random_length_fraction
        lengths = None
        if model.training and fraction > 0:
            lengths = self.alternet.training_lengths(len(tokens), tokens.shape[1], fraction).to(self.device)
        with self.autocast():
            out = model(tokens, targets=targets, lengths=lengths)
        return out["loss"], {"task": out["task_loss"], **out["aux_losses"]}

    def windows(self, rank, world):
        """(x, y) validation batches of this rank: (B, T) each, consecutive non-overlapping windows."""
        n = (len(self.val) - 1) // self.block_size
        starts = torch.arange(n)[rank::world] * self.block_size
        if self.cfg.eval_iters:
            starts = starts[:self.cfg.eval_iters * self.cfg.eval_batch_size]
        for chunk in starts.split(self.cfg.eval_batch_size):
            rows = torch.stack([self.val[s:s + self.block_size + 1] for s in chunk.tolist()])
            yield rows[:, :-1].to(self.device), rows[:, 1:].to(self.device)

    @torch.no_grad()
    def evaluate(self, model, depths, rank, world):
        """Validation loss and bits-per-byte at the halted depth, at every fixed depth 1..D, and causal."""
        model.eval()
        lm = unwrap(model)
        depth, threshold = lm.config.max_depth, 0.5 if lm.config.halting else None
        # sums over this rank's windows: CE at [halted, depth 1..D], iterations, tokens, sequences;
        # then causal CE, causal iterations, causal tokens, full-window CE on the causal windows
        stats = torch.zeros(depth + 8, dtype=torch.float64, device=self.device)
        causal_left = self.causal_windows
        for x, y in self.windows(rank, world):
            with self.autocast():  # a fixed-depth model (halting off) "halts" at its last step
                halted = lm(x, halt_threshold=threshold)
                fixed = lm(x, halt_threshold=None)  # all D steps: step_logits (D, B, T, V)
            for row, logits in enumerate([halted["logits"], *fixed["step_logits"]]):
                stats[row] += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
            stats[depth + 1:depth + 4] += torch.tensor([halted["iterations"].sum().item(), y.numel(), len(x)],
                                                       dtype=torch.float64, device=self.device)
            if causal_left > 0:
                x, y, halted_logits = x[:causal_left], y[:causal_left], halted["logits"][:causal_left]
                causal_left -= len(x)
                with self.autocast():
                    causal = self.alternet.causal_loss(lm, x, y, halt_threshold=threshold)
                full = F.cross_entropy(halted_logits.float().flatten(0, 1), y.flatten(), reduction="sum")
                stats[depth + 4:] += torch.tensor([causal["ce"].sum().item(), causal["iterations"].sum().item(),
                                                   y.numel(), full.item()], dtype=torch.float64, device=self.device)
        if world > 1:
            dist.all_reduce(stats)
        results = self.results(stats.tolist(), depth)
        if rank == 0 and "causal_loss" in results["halted"]:
            r = results["halted"]
            print(f"causal (each position routed on its own prefix, {r['causal_tokens']} tokens): loss "
                  f"{r['causal_loss']:.4f}, {r['causal_bpb']:.4f} bits/byte, {r['causal_iterations']:.2f} "
                  f"iterations | full window, same tokens: loss {r['causal_full_window_loss']:.4f}")
        if rank == 0 and self.sample_tokens:
            self.print_sample(lm, threshold)
        model.train()
        return results

    def results(self, stats, depth):
        """{"halted" | 1..D: {loss, bpb, iterations}} from the summed statistics; "halted" also holds
        the causal metric (causal_loss, causal_bpb, causal_iterations) and the full-window loss on
        the same tokens (causal_full_window_loss)."""
        iterations, tokens, sequences, causal_ce, causal_iterations, causal_tokens, full_ce = stats[depth + 1:]
        results = {}
        for row, key in enumerate(["halted", *range(1, depth + 1)]):
            loss = stats[row] / tokens
            results[key] = {"loss": loss, "bpb": loss * self.tokens_per_byte / math.log(2),
                            "iterations": iterations / sequences if key == "halted" else float(key)}
        if causal_tokens:  # iterations: mean per position (each is one generated token's forward)
            loss = causal_ce / causal_tokens
            results["halted"].update(causal_loss=loss, causal_bpb=loss * self.tokens_per_byte / math.log(2),
                                     causal_iterations=causal_iterations / causal_tokens,
                                     causal_full_window_loss=full_ce / causal_tokens, causal_tokens=int(causal_tokens))
        return results

    def print_sample(self, lm, threshold):
        """A short continuation of the first validation tokens (fixed seed; the training RNG is untouched)."""
        _, decode = self.alternet.text_codec(self.cfg.tokenizer)
        prompt = self.val[:min(32, self.block_size)][None].to(self.device)  # (1, P)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(0)
            with self.autocast():
                ids, used = lm.generate(prompt, self.sample_tokens, halt_threshold=threshold or 0.5,
                                        temperature=0.8, top_k=min(40, lm.config.vocab_size),
                                        return_iterations=True)
        text = decode(ids[0, prompt.shape[1]:].tolist())
        print(f"sample: {decode(prompt[0].tolist())!r} -> {text!r} "
              f"({used.float().mean().item():.2f} iterations per token)")


# --- optimizer and schedule ---


def param_groups(model: nn.Module, weight_decay: float):
    """AdamW groups: decay only >= 2-D weights that the model does not list in no_weight_decay()
    (reViT/ViT list cls_token, pos_embed and the router's output layer)."""
    exclude = set(getattr(model, "no_weight_decay", lambda: set())())
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 and name not in exclude else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(step: int, peak: float, sched: dict) -> float:
    """Linear warmup from warmup_lr, then cosine to min_lr, by optimizer step (DeiT steps per epoch;
    per-step is the smooth version of the same curve)."""
    warmup, total = sched["warmup_steps"], sched["total_steps"]
    if step < warmup:
        return sched["warmup_lr"] + (peak - sched["warmup_lr"]) * step / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return sched["min_lr"] + 0.5 * (peak - sched["min_lr"]) * (1 + math.cos(math.pi * progress))


# --- checkpoints ---


def atomic_save(obj: dict, path: Path) -> None:
    """Write to a temp file in the same folder, then os.replace: a crash never leaves a torn file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        torch.save(obj, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under DDP and torch.compile wrappers (what checkpoints store)."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def rng_state(augment: Augment | None) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if augment is not None:
        state["augment"] = augment.generator.get_state()
        state["augment_batch"] = augment.batch_rng.getstate()
    return state


def set_rng_state(state: dict, augment: Augment | None) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if augment is not None:
        augment.generator.set_state(state["augment"])
        augment.batch_rng.setstate(state["augment_batch"])


def model_family(arch: str):
    if arch in revit.PRESETS:
        return revit
    alternet = import_alternet(required=False)
    if alternet is not None and arch in alternet.PRESETS:
        return alternet
    raise ValueError(f"checkpoint of unknown arch {arch!r}")


def load_model(path, device="cpu"):
    """Rebuild a trained model from a checkpoint of this project -> (model in eval mode, ckpt dict)."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if ckpt.get("arch") == "linear-probe":
        raise ValueError(f"{path} is a probe head; load its backbone ({ckpt['model_config']['backbone']})")
    model = model_family(ckpt["arch"]).create_model(ckpt["arch"], **ckpt["model_config"])
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval(), ckpt


def primitive(value):
    """Config values as plain Python (checkpoints load with weights_only=True)."""
    if isinstance(value, dict):
        return {k: primitive(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(primitive(v) for v in value)
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)


# --- the run ---


def setup_distributed(cfg: TrainConfig):
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK: nccl on CUDA, gloo on CPU."""
    if cfg.device == "auto":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        device_type = torch.device(cfg.device).type
        if device_type == "cuda" and not torch.cuda.is_available():
            fail(f"--device {cfg.device}: CUDA is not available")
    if "RANK" not in os.environ:
        return 0, 1, torch.device(cfg.device if cfg.device not in ("auto",) else device_type)
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if device_type == "cuda":
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return rank, world, torch.device(f"cuda:{local}" if device_type == "cuda" else "cpu")


def vision_overrides(cfg: TrainConfig, data: ImageData, is_main: bool) -> dict:
    """Model config overrides: data properties, CLI flags, and the patch size for small images."""
    preset = revit.PRESETS[cfg.arch]
    overrides = dict(image_size=data.image_size, in_channels=data.channels, num_classes=data.num_classes)
    for name in ("patch_size", "depth", "num_experts", "drop_path", "depth_drop"):
        if getattr(cfg, name) is not None:
            overrides[name] = getattr(cfg, name)
    overrides.update(parse_model_args(cfg.model_args))
    patch = overrides.get("patch_size", preset.get("patch_size", 16))
    if "patch_size" not in overrides and (data.image_size % patch or data.image_size // patch < 4):
        overrides["patch_size"] = 4 if data.image_size % 4 == 0 else 1
        if is_main:
            print(f"note: {cfg.arch} is a {preset.get('image_size', 224)}px preset with patch {patch}; on "
                  f"{data.image_size}x{data.image_size} images it is built with patch_size="
                  f"{overrides['patch_size']} (override with --patch-size)")
    return overrides


def build(cfg: TrainConfig, rank: int, world: int, device, resume_ckpt):
    """Data, model and task of this run. Raises SystemExit on any user error before anything is written."""
    is_main = rank == 0
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" and cfg.bf16 \
        else contextlib.nullcontext
    if cfg.dataset == "text":
        alternet = import_alternet()
        train_tokens, val_tokens, tokens_per_byte, vocab = load_text(cfg, is_main)
        overrides = parse_model_args(cfg.model_args)
        if cfg.tokenizer != "byte":
            overrides["vocab_size"] = vocab
        model = make(alternet.create_model, cfg.arch, resume_ckpt["model_config"] if resume_ckpt else overrides)
        block_size = cfg.block_size or model.config.seq_len
        if block_size > model.config.seq_len:
            fail(f"--block-size {block_size} exceeds the model's seq_len {model.config.seq_len} "
                 f"(raise it with --model-args seq_len={block_size})")
        if len(val_tokens) <= block_size + 1:
            fail(f"validation text is too short for --block-size {block_size}")
        task = LanguageTask(cfg, val_tokens, tokens_per_byte, block_size, device, autocast)
        batches = lambda start: text_batches(train_tokens, cfg, rank, world, start, block_size)  # noqa: E731
        return model, task, batches, None, None
    data = load_images(cfg, is_main)
    if device.type == "cuda" and isinstance(data.train, TensorImages):  # small data sets live on the GPU
        for split in (data.train, data.test):
            split.images, split.labels = split.images.to(device), split.labels.to(device)
    steps_per_epoch = len(data.train) // cfg.batch_size
    if steps_per_epoch == 0:
        fail(f"--batch-size {cfg.batch_size} is larger than the training set ({len(data.train)} images)")
    augment = Augment(cfg, data, device, seed=cfg.seed + rank)
    if cfg.probe:
        backbone, _ = load_model_checked(cfg.backbone, "--backbone")
        if (backbone.config.image_size, backbone.config.in_channels) != (data.image_size, data.channels):
            fail(f"--backbone expects {backbone.config.in_channels}x{backbone.config.image_size}² images; "
                 f"{cfg.dataset} has {data.channels}x{data.image_size}²")
        model = PROBES[cfg.probe](backbone, data.num_classes, cfg)
        task = ClassificationTask(cfg, data, device, augment, autocast)
    else:
        overrides = resume_ckpt["model_config"] if resume_ckpt else vision_overrides(cfg, data, is_main)
        model = make(revit.create_model, cfg.arch, overrides)
        if cfg.teacher:
            teacher = load_teacher(cfg.teacher, device)
            check_teacher(model, teacher, data, device)
            task = DistillTask(cfg, data, device, augment, autocast, teacher)
        else:
            task = ClassificationTask(cfg, data, device, augment, autocast)
        depth_of = model.config.depth
        for d in parse_depths(cfg.eval_depths):
            if model.config.arch == "vit" and d != depth_of:
                fail(f"--eval-depths {cfg.eval_depths}: an untied ViT runs only its own depth ({depth_of}); "
                     f"other depths need a reViT or Raptor model")
            if model.config.arch != "vit" and d < 2:
                fail(f"--eval-depths: recurrent models need depth >= 2; got {d}")
    batches = lambda start: image_batches(data.train, cfg, rank, world, start, steps_per_epoch)  # noqa: E731
    return model, task, batches, augment, steps_per_epoch


def make(create, arch, overrides):
    try:
        return create(arch, **overrides)
    except (ValueError, TypeError) as e:
        fail(f"cannot build {arch} with {overrides}: {e}")


def load_model_checked(path, flag):
    try:
        return load_model(path)
    except Exception as e:  # noqa: BLE001 -- any unreadable file is a user error here
        fail(f"{flag} {path} is not a usable checkpoint of this project: {e}")


def check_teacher(model, teacher, data, device):
    x = torch.zeros(2, data.channels, data.image_size, data.image_size, device=device)
    try:
        with torch.no_grad():
            target = teacher(x)
    except Exception as e:  # noqa: BLE001
        fail(f"the teacher cannot run on {data.channels}x{data.image_size}² images: {e}")
    model.to(device)
    with torch.no_grad():
        tokens = model.eval()(x, return_states=True)["tokens"]
    model.train()
    if tokens.shape[1:] != target.shape[1:]:
        fail(f"student tokens {tuple(tokens.shape[1:])} and teacher tokens {tuple(target.shape[1:])} differ "
             f"(tokens x width): Eq. 4 needs the same patch grid and width (use --patch-size / --model-args dim=)")


# The model and the data order of a run: a resumed run must keep them.
FIXED_ON_RESUME = ("arch", "patch_size", "depth", "num_experts", "drop_path", "depth_drop", "model_args",
                   "dataset", "data", "tokenizer", "train_subset", "batch_size", "seed", "probe", "probe_pool",
                   "backbone", "teacher")


def main(argv=None) -> dict:
    explicit = vars(build_parser().parse_args(argv))
    if explicit.pop("list_archs", False):
        alternet = import_alternet(required=False)
        print("\n".join(sorted(revit.PRESETS) + (sorted(alternet.PRESETS) if alternet else [])))
        return {}
    resume_ckpt = None
    if explicit.get("resume"):
        path = explicit["resume"]
        if not Path(path).is_file():
            fail(f"--resume {path}: no such checkpoint file")
        try:
            resume_ckpt = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001
            fail(f"--resume {path} is not a readable checkpoint: {e}")
        saved = resume_ckpt["train_config"]
        out_dir = explicit.get("out_dir") or str(Path(path).parent)  # the run folder may have moved
        if "arch" in explicit and explicit["arch"] != saved["arch"]:
            fail(f"--resume {path} is a checkpoint of {saved['arch']}, not {explicit['arch']}")
        # (FIXED_ON_RESUME below covers the other fields that shape the model or the data order)
        # the saved run's config; flags given now may extend it (e.g. more --epochs, --eval-depths)
        for name in FIXED_ON_RESUME:
            if name in explicit and explicit[name] != saved.get(name):
                fail(f"--{name.replace('_', '-')} cannot change on --resume (the checkpoint has "
                     f"{saved.get(name)!r}); start a new run instead")
        known = {f.name for f in fields(TrainConfig)} - {"stop_at_step"}
        explicit = {**{k: v for k, v in saved.items() if k in known}, **explicit}
        explicit["out_dir"] = out_dir
    cfg = resolve_config(explicit)
    if cfg.probe in DENSE_PROBES:  # single process; results table per --eval-depths, probe_results.json
        import probes
        return probes.run(cfg)
    rank, world, device = setup_distributed(cfg)
    try:
        return train(cfg, rank, world, device, resume_ckpt)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def train(cfg: TrainConfig, rank: int, world: int, device, resume_ckpt) -> dict:
    is_main = rank == 0
    if cfg.batch_size % (world * cfg.grad_accum):
        fail(f"--batch-size {cfg.batch_size} must be divisible by ranks x --grad-accum = {world * cfg.grad_accum}")
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    if device.type == "cuda":  # TF32 for the float32 parts outside autocast
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    model, task, batches, augment, steps_per_epoch = build(cfg, rank, world, device, resume_ckpt)
    module = model
    language = cfg.dataset == "text"
    num_params = sum(p.numel() for p in (module.head.parameters() if cfg.probe else module.parameters()))

    # schedule: every length in optimizer steps
    total_steps = cfg.max_steps or cfg.epochs * steps_per_epoch
    if cfg.warmup_steps is not None:
        warmup_steps = cfg.warmup_steps
    else:
        warmup_steps = 0 if language else round(cfg.warmup_epochs * steps_per_epoch)
    width = getattr(unwrap(module).config, "dim", 0) if not cfg.probe else 0
    if cfg.lr is not None:
        base_lr = cfg.lr
    elif language:  # AlterNet paper 3e-4; the small byte-level CPU presets train faster at 1e-3
        base_lr = 1e-3 if width <= 256 else 3e-4
    else:  # Table 6: 4e-3 for S, 3e-3 for B and L
        base_lr = 3e-3 if width >= 768 else 4e-3
    peak_lr = base_lr * cfg.batch_size / cfg.lr_batch if cfg.lr_batch else base_lr
    sched = dict(warmup_steps=min(warmup_steps, total_steps), total_steps=total_steps,
                 warmup_lr=min(cfg.warmup_lr, peak_lr), min_lr=min(cfg.min_lr, peak_lr), peak_lr=peak_lr)
    eval_every = cfg.eval_interval or steps_per_epoch or 500

    model.to(device)
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=peak_lr,
                                  betas=(cfg.beta1, cfg.beta2), fused=device.type == "cuda" or None)
    step, metrics = 0, {}
    if resume_ckpt is not None:
        unwrap(model).load_state_dict(resume_ckpt["model"]) if not cfg.probe else \
            model.head.load_state_dict(resume_ckpt["model"])
        optimizer.load_state_dict(resume_ckpt["optimizer"])
        step, metrics = resume_ckpt["step"], resume_ckpt.get("metrics", {})
        rngs = resume_ckpt["rng"]
        set_rng_state(rngs[rank] if len(rngs) == world else rngs[0], augment)
    else:  # each rank its own stream for drop-path / elastic depth / augmentation
        torch.manual_seed(cfg.seed + 1 + rank)

    if is_main:  # the first write of the run: everything above validated the input
        out_dir = Path(cfg.out_dir or f"out/{cfg.arch}-{time.strftime('%Y%m%d-%H%M%S')}")
        out_dir.mkdir(parents=True, exist_ok=True)
    out_dir = broadcast(out_dir if is_main else None, world)
    cfg.out_dir = str(out_dir)
    ckpt_path, log_path = out_dir / "ckpt.pt", out_dir / "metrics.jsonl"
    log = open(log_path, "a") if is_main else None
    if is_main:
        print(json.dumps(asdict(cfg), indent=1))
        print(f"{cfg.arch}: {num_params / 1e6:.3f}M trainable parameters | {world} rank(s) on {device} | "
              f"{total_steps} steps ({steps_per_epoch or '-'} per epoch) | peak lr {peak_lr:.3g} | out {out_dir}")
        write_jsonl(log, {"event": "resume" if resume_ckpt else "start", "step": step, "config": asdict(cfg),
                          "params": num_params, "peak_lr": peak_lr})

    if cfg.compile:
        if device.type == "cuda":
            model = torch.compile(model)
        elif is_main:
            print("note: --compile is used on CUDA only; running eagerly on CPU")
    if world > 1:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=cfg.ddp_find_unused)

    def save(step):
        if is_main:
            # a plain dict of tensors: state_dict()'s _metadata is not needed to load and must not
            # smuggle non-tensor objects past weights_only=True
            ckpt = {"model": dict((module.head if cfg.probe else unwrap(module)).state_dict()),
                    "arch": "linear-probe" if cfg.probe else cfg.arch,
                    "model_config": primitive(dict(backbone=cfg.backbone, pool=cfg.probe_pool) if cfg.probe
                                              else asdict(unwrap(module).config)),
                    "train_config": asdict(cfg), "optimizer": optimizer.state_dict(),
                    "scheduler": dict(sched, name="warmup-cosine", step=step), "step": step,
                    "rng": all_rng, "metrics": primitive(metrics)}
            atomic_save(ckpt, ckpt_path)
        if world > 1:
            dist.barrier()

    def gather_rng():
        state = rng_state(augment)
        if world == 1:
            return [state]
        states = [None] * world
        dist.all_gather_object(states, state)
        return states

    hooks = unwrap(module)
    set_step = getattr(hooks, "set_step", None)
    after_step = getattr(hooks, "after_optimizer_step", None)
    model.train()
    bar = tqdm(total=total_steps, initial=step, disable=not (is_main and cfg.progress), dynamic_ncols=True)
    last_good = (step, str(ckpt_path)) if resume_ckpt else None
    t0, seen, t_start = time.perf_counter(), 0, time.perf_counter()
    data_iter = batches(step) if step < total_steps else iter(())
    done = stop = step >= total_steps
    for step_index, inputs, targets in data_iter:
        assert step_index == step
        lr = lr_at(step, peak_lr, sched)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if set_step is not None:
            set_step(step)
        parts_sum, loss_sum = {}, torch.zeros((), device=device)
        micro = list(zip(inputs.chunk(cfg.grad_accum), targets.chunk(cfg.grad_accum)))
        for i, (x, y) in enumerate(micro):
            sync = i == len(micro) - 1 or world == 1
            with (contextlib.nullcontext() if sync else model.no_sync()):
                loss, parts = task.loss(model, x, y)
                (loss / cfg.grad_accum).backward()
            loss_sum += loss.detach() / cfg.grad_accum
            for k, v in parts.items():
                parts_sum[k] = parts_sum.get(k, 0.0) + v.detach() / cfg.grad_accum
        if world > 1:
            dist.all_reduce(loss_sum)
            loss_sum /= world
        loss_value = loss_sum.item()
        if not math.isfinite(loss_value):
            where = f"{last_good[1]} (step {last_good[0]})" if last_good else "none written yet"
            fail(f"non-finite loss {loss_value} at step {step} (epoch {step // steps_per_epoch if steps_per_epoch else 0})"
                 f"; stopped without saving. Last good checkpoint: {where}. Try a lower --lr or --grad-clip 1.0")
        if cfg.grad_clip:
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step()
        step += 1
        seen += len(inputs) * world
        bar.update(1)

        if step % cfg.log_interval == 0 or step == total_steps:
            elapsed = time.perf_counter() - t0
            rate = seen * (inputs.shape[1] if language else 1) / max(elapsed, 1e-9)
            bar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}", **{"tok/s" if language else "img/s": f"{rate:.0f}"})
            if is_main:
                write_jsonl(log, {"step": step, "loss": loss_value, "lr": lr, "per_s": rate,
                                  **({"grad_norm": grad_norm.item()} if cfg.grad_clip else {}),
                                  **{k: v.item() if torch.is_tensor(v) else v for k, v in parts_sum.items()}})
            t0, seen = time.perf_counter(), 0
        done = step >= total_steps
        stop = cfg.stop_at_step and step >= cfg.stop_at_step
        if step % eval_every == 0 and not done:  # the end has its own, fuller evaluation
            results = task.evaluate(unwrap(model), [None], rank, world)
            metrics = {"step": step, **report(results, language)}
            if is_main:
                bar.write(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()
                                                        if isinstance(v, float)))
                write_jsonl(log, {"step": step, "eval": metrics})
        if stop or step % eval_every == 0 or (cfg.save_interval and step % cfg.save_interval == 0):
            all_rng = gather_rng()
            save(step)
            last_good = (step, str(ckpt_path))
        if done or stop:
            break
    bar.close()

    if stop and not done:
        if is_main:
            print(f"stopped at step {step} as asked (--stop-at-step); continue with --resume {ckpt_path}")
        return {"step": step, "checkpoint": str(ckpt_path)}
    summary = final_evaluation(cfg, unwrap(model), task, language, rank, world, num_params, time.perf_counter() - t_start)
    metrics = {"step": step, **summary}
    all_rng = gather_rng()
    save(step)
    if is_main:
        write_jsonl(log, {"event": "final", **summary})
        log.close()
    return {**summary, "step": step, "checkpoint": str(ckpt_path), "out_dir": str(out_dir)}


def broadcast(obj, world):
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def write_jsonl(log, record):
    log.write(json.dumps(primitive(record)) + "\n")
    log.flush()


def report(results: dict, language: bool) -> dict:
    first = results[next(iter(results))]
    if language:
        return {"val_loss": first["loss"], "val_bpb": first["bpb"], "mean_iterations": first["iterations"]}
    return {f"test_{k}": v for k, v in first.items()}


def final_evaluation(cfg, model, task, language, rank, world, num_params, seconds) -> dict:
    """Depth table (vision: --eval-depths; language: halted + every fixed depth) and the summary line."""
    is_main = rank == 0
    if language:
        results = task.evaluate(model, None, rank, world)
        if is_main:
            print(f"{'depth':>8} {'val loss':>9} {'bits/byte':>9} {'mean iters':>10}")
            for key, r in results.items():
                print(f"{key:>8} {r['loss']:9.4f} {r['bpb']:9.4f} {r['iterations']:10.2f}")
        halted = results["halted"]
        summary = {"arch": cfg.arch, "params": num_params, "val_loss": halted["loss"], "val_bpb": halted["bpb"],
                   "mean_iterations": halted["iterations"],
                   "fixed_depth_bpb": {str(k): r["bpb"] for k, r in results.items() if k != "halted"}}
        line = (f"{cfg.arch} | {num_params / 1e6:.3f}M params | val loss {halted['loss']:.4f} | "
                f"{halted['bpb']:.4f} bits/byte at {halted['iterations']:.2f} mean iterations")
    else:
        config = model.backbone.config if cfg.probe else model.config
        reference_depth = config.depth
        depths = [None] + [d for d in parse_depths(cfg.eval_depths) if d != reference_depth]
        results = task.evaluate(model, depths, rank, world)
        ref = results[None]
        key = "distill_mse" if cfg.teacher else "acc"
        if is_main and len(results) > 1:
            print(f"{'depth':>6} {'test acc %' if key == 'acc' else key:>12}")
            for depth, r in sorted(results.items(), key=lambda kv: kv[0] or reference_depth):
                mark = " (trained)" if depth is None else ""
                print(f"{depth or reference_depth:>6} {(100 * r[key]) if key == 'acc' else r[key]:12.4f}{mark}")
        summary = {"arch": cfg.arch, "params": num_params, "reference_depth": reference_depth,
                   **{f"test_{k}": v for k, v in ref.items()},
                   "depths": {str(reference_depth if d is None else d): r for d, r in results.items()}}
        metric = f"test acc {100 * ref['acc']:.2f}%" if key == "acc" else f"test distill MSE {ref[key]:.5f}"
        line = f"{cfg.arch} | {num_params / 1e6:.3f}M params | {metric} at depth {reference_depth}"
    if is_main:
        print(f"done: {line} | {seconds / 60:.1f} min")
    return {**summary, "minutes": seconds / 60}


if __name__ == "__main__":
    main()
