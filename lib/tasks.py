"""What an image run trains (`build`: data, model, task of train.py's config) and reports (`summarise`):
ClassificationTask (also the linear probe, a ProbeModel; its loss is train.py's train_step) and
DistillTask (Eq. 5 of reViT, arXiv 2610.12448, App. A.3). The language task is lib/language.py, the
planted-depth task lib/planted.py.
"""

from __future__ import annotations

import contextlib
import hashlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import revit
from lib import data
from lib.boundary import fail, is_vision, model_overrides, or_fail, parse_depths, preset_module
from lib.checkpoint import load_checkpoint, load_vision_model
from lib.cli import device_options, say


# --- image tasks: classification (and the linear probe), distillation ---


class ClassificationTask:
    """Supervised image classification (also the linear probe: its model is a ProbeModel)."""

    loss = None  # the default training loss: augment, forward, cross-entropy + aux, in train.py's train_step

    def __init__(self, cfg, images: data.ImageData, device, augment: data.Augment, autocast):
        self.cfg, self.data, self.device, self.augment, self.autocast = cfg, images, device, augment, autocast

    def score(self, model, x, labels, depth) -> dict:
        """Sums over one test batch (divided by the image count at the end)."""
        with self.autocast():
            logits = model(x, depth=depth).float()  # depth None: the trained one
        return {"acc": (logits.argmax(-1) == labels).sum().float(),
                "loss": F.cross_entropy(logits, labels, reduction="sum")}

    @torch.no_grad()
    def evaluate(self, model, depths, rank, world):
        """{depth: metrics} over this rank's shard of the test set (depth None: the reference depth)."""
        was_training = model.training
        model.eval()
        index_batches = torch.arange(len(self.data.test))[rank::world].split(self.cfg.eval_batch_size)
        results = {}
        for depth in depths:
            sums, count = {}, torch.zeros((), device=self.device)
            for images, labels in self.data.test.batches(index_batches):
                x = self.augment.normalise(images.to(self.device).float() / 255)
                for key, value in self.score(model, x, labels.to(self.device), depth).items():
                    sums[key] = sums.get(key, 0) + value
                count += len(labels)
            stats = torch.stack([*sums.values(), count])
            if world > 1:
                dist.all_reduce(stats)
            results[depth] = {key: (stats[i] / stats[-1]).item() for i, key in enumerate(sums)}
        model.train(was_training)  # the loop's model trains on; a tool's stays in eval mode
        return results


class DistillTask(ClassificationTask):
    """Eq. 5 of the reViT paper (App. A.3): 1/(T d) ||LN(X^L) - Y||_F^2 against a frozen teacher's
    final post-LayerNorm tokens."""

    def __init__(self, cfg, images, device, augment, autocast, teacher):
        super().__init__(cfg, images, device, augment, autocast)
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

    def score(self, model, x, labels, depth):
        with self.autocast():
            tokens = model(x, depth=depth, return_states=True)["tokens"]
            target = self.teacher(x)
        error = F.mse_loss(tokens.float(), target.float(), reduction="sum") / tokens[0].numel()
        return {"distill_mse": error}


def gate_summary(model) -> dict:
    """reViT's gate matrix at its trained depth L as the spread (max - min over steps and experts; 0 = flat)
    and the dominant expert of each step (Fig. 3). {} for a model without depth-only gates or E = 1."""
    if not isinstance(model, revit.ReViT) or not getattr(model.config, "depth_programmed", True) \
            or model.config.num_experts < 2:
        return {}
    with torch.no_grad():
        gates = model.gate_matrix()
    return {"gate_spread": float(gates.max() - gates.min()), "dominant_expert": gates.argmax(1).tolist()}


# --- the distillation teacher and the linear probe ---


class TeacherTokens(nn.Module):
    """A frozen teacher's final post-norm tokens (B, 1 + patches, d): a checkpoint of this project, or
    torch.hub DINOv2 ([class token, patch tokens] after its final norm, registers dropped)."""

    def __init__(self, model, hub: bool):
        super().__init__()
        self.model, self.hub = model, hub

    def forward(self, x):
        if not self.hub:
            return self.model(x, return_states=True)["tokens"]
        feats = self.model.forward_features(x)
        return torch.cat([feats["x_norm_clstoken"][:, None], feats["x_norm_patchtokens"]], dim=1)


def teacher_for(cfg, model, images, device) -> nn.Module:
    """--teacher (a checkpoint of this project, or hub:NAME, DINOv2) frozen on `device`, once it has run
    on these images and given tokens of the student's shape."""
    if cfg.teacher.startswith("hub:"):
        try:
            teacher = TeacherTokens(torch.hub.load("facebookresearch/dinov2", cfg.teacher[4:]), hub=True)
        except Exception as e:  # noqa: BLE001
            fail(f"--teacher {cfg.teacher}: could not load it from torch.hub (needs internet access): "
                 f"{str(e).splitlines()[0]}")
    else:
        teacher = TeacherTokens(or_fail(load_vision_model, cfg.teacher, "--teacher")[0], hub=False)
    teacher = teacher.to(device).eval().requires_grad_(False)
    x = torch.zeros(2, images.channels, images.image_size, images.image_size, device=device)
    with torch.no_grad():
        try:
            target = teacher(x)
        except Exception as e:  # noqa: BLE001
            fail(f"--teacher cannot run on {images.channels}x{images.image_size}² images: "
                 f"{str(e).splitlines()[0]}")
        tokens = model.to(device).eval()(x, return_states=True)["tokens"]
    model.train()
    if tokens.shape[1:] != target.shape[1:]:
        fail(f"student tokens {tuple(tokens.shape[1:])} and teacher tokens {tuple(target.shape[1:])} differ "
             f"(tokens x width): distillation needs the same patch grid and width (use --patch-size / "
             f"--model-args dim=)")
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
            out = self.backbone(images, depth=depth, return_states=True)
        return out["pre_logits"] if self.pool == "cls" else out["tokens"][:, 1:].mean(1)  # (B, d)

    def forward(self, images, depth=None, return_states=False):
        logits = self.head(self.features(images, depth))
        return {"logits": logits, "aux_losses": {}} if return_states else logits


# --- what a run reports: the depth table of its final evaluation (train.py, --eval-only) ---


def eval_depths(cfg, model: nn.Module) -> list:
    """The depths of the final evaluation (--eval-depths; None: the reference depth), each one the model can
    run: a ViT only its own depth, recurrent models >= 2 (build asks first: a run stops before training)."""
    if cfg.dataset in data.TEXT_DATASETS:
        return [None]
    config = (model.backbone if cfg.probe else model).config
    depths = parse_depths(cfg.eval_depths)
    for d in depths:
        if config.arch == "vit" and d != config.depth:
            fail(f"--eval-depths {cfg.eval_depths}: an untied ViT runs only its own depth ({config.depth}); "
                 f"other depths need a reViT or Raptor model")
        if config.arch != "vit" and d < 2:
            fail(f"--eval-depths {cfg.eval_depths}: recurrent models need depth >= 2; got {d}")
    return [None] + [d for d in depths if d != config.depth]


def summarise(cfg, model: nn.Module, results: dict) -> tuple[dict, str]:
    """Print the depth table of train.evaluate's results; -> (summary fields, the headline)."""
    if cfg.dataset in data.TEXT_DATASETS:
        say(f"{'depth':>8} {'val loss':>9} {'bits/byte':>9} {'mean iters':>10}")
        for key, r in results.items():
            say(f"{key or 'halted':>8} {r['loss']:9.4f} {r['bpb']:9.4f} {r['iterations']:10.2f}")
        h = results[None]
        return ({"val_loss": h["loss"], "val_bpb": h["bpb"], "mean_iterations": h["iterations"],
                 "fixed_depth_bpb": {str(k): r["bpb"] for k, r in results.items() if k is not None},
                 **({"val_causal_bpb": h["causal_bpb"]} if "causal_bpb" in h else {})},
                f"val loss {h['loss']:.4f} | {h['bpb']:.4f} bits/byte at {h['iterations']:.2f} "
                f"mean iterations")
    reference = (model.backbone if cfg.probe else model).config.depth
    key = "distill_mse" if cfg.teacher else "mse" if cfg.dataset == "planted" else "acc"
    if len(results) > 1:
        say(f"{'depth':>6} {'test acc %' if key == 'acc' else key:>12}")
        for depth, r in sorted(results.items(), key=lambda kv: kv[0] or reference):
            value = 100 * r[key] if key == "acc" else r[key]
            say(f"{depth or reference:>6} {value:12.4f}{' (trained)' if depth is None else ''}")
    ref = results[None]
    metric = f"test acc {100 * ref['acc']:.2f}%" if key == "acc" else \
        f"test {key.replace('_', ' ')} {ref[key]:.5f}"
    return ({"reference_depth": reference, **{f"test_{k}": v for k, v in ref.items()},
             "depths": {str(reference if d is None else d): r for d, r in results.items()}},
            f"{metric} at depth {reference}")


def backbone_arch(path: str) -> str:
    """A linear probe is named after its --backbone, which must be a vision model of revit.py."""
    arch = or_fail(load_checkpoint, path, "--backbone")["arch"]
    if not is_vision(preset_module(arch)):
        fail(f"--backbone {path} is a checkpoint of {arch}, not a vision model of revit.py")
    return arch


def same_file(path: str, flag: str, saved: str | None) -> str:
    """The sha256 of the file read at `flag`, which must be the `saved` one of a resumed or evaluated run
    (None: saved before the hash): a probe's head fits its backbone's features, a student its teacher's."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if saved not in (None, digest):
        fail(f"{flag} {path} is not the file this run was trained on (its content changed)")
    return digest


# --- what a run trains, built from its config: data, model, task ---


def build(cfg, rank: int, world: int, device, ckpt: dict | None):
    """Data, model and task -> (model, task, batches(start_step), augment, steps_per_epoch); a resumed or
    evaluated checkpoint `ckpt` supplies the model config. Reads only; any user error exits here."""
    options = device_options(device.type, cfg.precision)
    autocast = autocast_of(device, options)
    try:
        images = data.load_images(cfg.dataset, cfg.data, cfg.data_dir, cfg.download, cfg.train_subset,
                                  cfg.test_subset, cfg.workers)
    except (ValueError, FileNotFoundError) as e:
        fail(f"--dataset {cfg.dataset}: {e}")
    for split, asked in (("train", cfg.train_subset), ("test", cfg.test_subset)):
        n = len(getattr(images, split))
        if asked > n:  # the loaders take all there is: said, as train.py's own override lines are
            say(f"override: {split}_subset={n} ({cfg.dataset} has {n:,} {split} images, fewer than "
                f"--{split}-subset {asked})")
    if options["data_on_device"] and isinstance(images.train, data.TensorImages):  # small sets: on the GPU
        for split in (images.train, images.test):
            split.images, split.labels = split.images.to(device), split.labels.to(device)
    steps_per_epoch = len(images.train) // cfg.batch_size
    if steps_per_epoch == 0:
        fail(f"--batch-size {cfg.batch_size} is larger than the training set ({len(images.train)} images)")
    augment = data.Augment(images, device, cfg.seed + rank, **{k: getattr(cfg, k) for k in AUGMENT_FIELDS})
    if cfg.probe:
        backbone = or_fail(load_vision_model, cfg.backbone, "--backbone")[0]
        if (backbone.config.image_size, backbone.config.in_channels) != (images.image_size, images.channels):
            fail(f"--backbone expects {backbone.config.in_channels}x{backbone.config.image_size}² images; "
                 f"{cfg.dataset} has {images.channels}x{images.image_size}²")
        model = ProbeModel(backbone, images.num_classes, cfg.probe_pool)  # --probe cls
        saved = ckpt["model_config"].get("backbone_sha256") if ckpt else None
        model.backbone_sha256 = same_file(cfg.backbone, "--backbone", saved)
    else:
        overrides = ckpt["model_config"] if ckpt else vision_overrides(cfg, images)
        model = make(preset_module(cfg.arch, overrides).create_model, cfg.arch, overrides)
    if cfg.teacher:
        task = DistillTask(cfg, images, device, augment, autocast, teacher_for(cfg, model, images, device))
        if not cfg.teacher.startswith("hub:"):  # a file of ours (hub:NAME is torch.hub's)
            saved = ckpt.get("teacher_sha256") if ckpt else None
            task.teacher_sha256 = same_file(cfg.teacher, "--teacher", saved)
    else:
        task = ClassificationTask(cfg, images, device, augment, autocast)
    eval_depths(cfg, model)  # a depth the model cannot run stops the run here, not after training
    batches = lambda start: data.image_batches(  # noqa: E731
        images.train, cfg.batch_size, cfg.seed, cfg.repeated_aug, rank, world, start)
    return model, task, batches, augment, steps_per_epoch


AUGMENT_FIELDS = ("random_crop", "three_augment", "color_jitter", "mixup", "cutmix", "mix_prob",
                  "mix_switch_prob", "label_smoothing")


def vision_overrides(cfg, images: data.ImageData) -> dict:
    """model_overrides with the data's properties, and the patch size for small images."""
    overrides = model_overrides(cfg, dict(image_size=images.image_size, in_channels=images.channels,
                                          num_classes=images.num_classes))
    preset = preset_module(cfg.arch, overrides).PRESETS[cfg.arch]  # revit, or lib.moe for a mechanism
    patch = overrides.get("patch_size", preset.get("patch_size", 16))
    if "patch_size" not in overrides and (images.image_size % patch or images.image_size // patch < 4):
        cfg.patch_size = overrides["patch_size"] = 4 if images.image_size % 4 == 0 else 1
        say(f"override: patch_size={cfg.patch_size} (auto: {cfg.arch} is a {preset.get('image_size', 224)}px "
            f"preset with patch {patch}; {images.image_size}x{images.image_size} images need a finer grid)")
    return overrides


def autocast_of(device, options: dict):
    """The autocast context of a run (bf16 or fp16, as --precision resolved), or a no-op one (float32)."""
    dtype = options["autocast_dtype"]
    return (lambda: torch.autocast(device.type, dtype=dtype)) if dtype else contextlib.nullcontext


def make(create, arch, overrides):
    try:
        return create(arch, **overrides)
    except (ValueError, TypeError) as e:
        fail(f"cannot build {arch} with {overrides}: {e}")
