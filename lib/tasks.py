"""What a run trains: each task supplies the loss of a batch and the evaluation, and `build` makes the
data, model and task of a config. train.py's loop and --eval-only use them; tools/probes.py reuses
DENSE_PROBES, bench.py's depth table the evaluation (through train.evaluate).

    ClassificationTask   images -> classes (also the linear probe: its model is a ProbeModel)
    DistillTask          Eq. 5 of reViT (arXiv 2610.12448, App. A.3): match a frozen teacher's final tokens
    LanguageTask         next-token prediction with AlterNet (arXiv 2611.08741): the model computes its loss

`cfg` is train.py's TrainConfig; the tasks read only the fields they name.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import alternet
from lib import data
import revit
from lib.checkpoint import model_or_fail, preset_module, unwrap
from lib.cli import device_options, fail, parse_depths, parse_model_args, say


# --- image tasks: classification (and the linear probe), distillation ---


def classification_loss(logits, targets, kind):
    """Cross-entropy against soft (mixed, smoothed) targets (B, classes), or DeiT III's binary form."""
    if kind == "bce":  # DeiT III: binarise the mixed targets, then per-class binary cross-entropy
        return F.binary_cross_entropy_with_logits(logits, targets.gt(0.0).to(logits.dtype))
    return torch.sum(-targets * F.log_softmax(logits, dim=-1), dim=-1).mean()


class ClassificationTask:
    """Supervised image classification (also the linear probe: its model is a ProbeModel)."""

    def __init__(self, cfg, images: data.ImageData, device, augment: data.Augment, autocast):
        self.cfg, self.data, self.device, self.augment, self.autocast = cfg, images, device, augment, autocast

    def loss(self, model, images, labels):
        x, targets = self.augment(images.to(self.device, non_blocking=True), labels.to(self.device))
        with self.autocast():
            out = model(x, return_states=True)
        task = classification_loss(out["logits"].float(), targets, self.cfg.loss)
        aux = out.get("aux_losses", {})
        return task + sum(aux.values()), {"task": task, **aux}

    def score(self, model, x, labels, depth) -> dict:
        """Sums over one test batch (divided by the image count at the end)."""
        with self.autocast():
            logits = (model(x) if depth is None else model(x, depth=depth)).float()
        return {"acc": (logits.argmax(-1) == labels).sum().float(), "loss": F.cross_entropy(logits, labels, reduction="sum")}

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
            tokens = model(x, return_states=True, **({} if depth is None else {"depth": depth}))["tokens"]
            target = self.teacher(x)
        return {"distill_mse": F.mse_loss(tokens.float(), target.float(), reduction="sum") / tokens[0].numel()}


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


def load_teacher(spec: str, device) -> nn.Module:
    """--teacher: a checkpoint of this project or hub:NAME (DINOv2), frozen on `device`."""
    if spec.startswith("hub:"):
        try:
            teacher = TeacherTokens(torch.hub.load("facebookresearch/dinov2", spec[4:]), hub=True)
        except Exception as e:  # noqa: BLE001
            fail(f"--teacher {spec}: could not load it from torch.hub (needs internet access): {str(e).splitlines()[0]}")
    else:
        teacher = TeacherTokens(model_or_fail(spec, "--teacher"), hub=False)
    return teacher.to(device).eval().requires_grad_(False)


def check_teacher(model, teacher, images, device):
    """Before training: the teacher runs on these images and its tokens match the student's shape."""
    x = torch.zeros(2, images.channels, images.image_size, images.image_size, device=device)
    try:
        with torch.no_grad():
            target = teacher(x)
    except Exception as e:  # noqa: BLE001
        fail(f"--teacher cannot run on {images.channels}x{images.image_size}² images: {str(e).splitlines()[0]}")
    with torch.no_grad():
        tokens = model.to(device).eval()(x, return_states=True)["tokens"]
    model.train()
    if tokens.shape[1:] != target.shape[1:]:
        fail(f"student tokens {tuple(tokens.shape[1:])} and teacher tokens {tuple(target.shape[1:])} differ "
             f"(tokens x width): distillation needs the same patch grid and width (use --patch-size / --model-args dim=)")


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


# Probe name -> builder(backbone, num_classes, cfg) -> trainable model, trained by the loop above.
PROBES = {"cls": lambda backbone, num_classes, cfg: ProbeModel(backbone, num_classes, cfg.probe_pool)}


# Dense probes train per-patch heads on (cached) frozen features in probes.py's own loop: probes.run.
DENSE_PROBES = ("seg", "monodepth")


# --- the language task (AlterNet) ---


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

    def loss(self, model, tokens, targets):
        tokens, targets = tokens.to(self.device), targets.to(self.device)
        fraction = unwrap(model).config.random_length_fraction
        lengths = None
        if model.training and fraction > 0:
            lengths = alternet.training_lengths(len(tokens), tokens.shape[1], fraction).to(self.device)
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
        was_training = model.training
        model.eval()
        lm = unwrap(model)
        depth, threshold = lm.config.max_depth, 0.5 if lm.config.halting else None
        # sums over this rank's windows: CE at [halted, depth 1..D], iterations, tokens, sequences;
        # then causal CE, causal iterations, causal tokens, full-window CE on the causal windows
        stats = torch.zeros(depth + 8, dtype=torch.float64, device=self.device)
        causal_left = self.causal_windows
        for x, y in self.windows(rank, world):
            with self.autocast():  # a fixed-depth model (halting off) "halts" at its last step
                # with targets the model returns per-token CE (D', B, T), never D' full-vocabulary logits
                halted = lm(x, targets=y, halt_threshold=threshold)
                fixed = lm(x, targets=y, halt_threshold=None)  # all D steps
            halted_losses = halted["token_losses"][-1]  # (B, T): each row at the iteration it stopped at
            for row, token_losses in enumerate([halted_losses, *fixed["token_losses"]]):
                stats[row] += token_losses.sum()
            stats[depth + 1:depth + 4] += torch.tensor([halted["iterations"].sum().item(), y.numel(), len(x)],
                                                       dtype=torch.float64, device=self.device)
            if causal_left > 0:
                x, y, full = x[:causal_left], y[:causal_left], halted_losses[:causal_left].sum()
                causal_left -= len(x)
                with self.autocast():
                    causal = alternet.causal_loss(lm, x, y, halt_threshold=threshold)
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
        model.train(was_training)  # the loop's model trains on; a tool's stays in eval mode
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
        _, decode = alternet.text_codec(self.cfg.tokenizer)
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


# --- what a run trains, built from its config: data, model, task ---


def build(cfg, rank: int, world: int, device, ckpt: dict | None):
    """Data, model and task -> (model, task, batches(start_step), augment, steps_per_epoch). A resumed
    or evaluated checkpoint supplies the model config. Reads only; any user error exits here."""
    options = device_options(device.type, cfg.bf16)
    dtype = options["autocast_dtype"]
    autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype else contextlib.nullcontext
    if cfg.arch in alternet.PRESETS:
        return build_language(cfg, rank, world, device, ckpt, autocast)
    try:
        images = data.load_images(cfg.dataset, cfg.data, cfg.data_dir, cfg.download, cfg.train_subset,
                                  cfg.test_subset, cfg.workers)
    except (ValueError, FileNotFoundError) as e:
        fail(f"--dataset {cfg.dataset}: {e}")
    if options["data_on_device"] and isinstance(images.train, data.TensorImages):  # small sets live on the GPU
        for split in (images.train, images.test):
            split.images, split.labels = split.images.to(device), split.labels.to(device)
    steps_per_epoch = len(images.train) // cfg.batch_size
    if steps_per_epoch == 0:
        fail(f"--batch-size {cfg.batch_size} is larger than the training set ({len(images.train)} images)")
    augment = data.Augment(images, device, cfg.seed + rank, **{k: getattr(cfg, k) for k in AUGMENT_FIELDS})
    if cfg.probe:
        backbone = model_or_fail(cfg.backbone, "--backbone")
        if (backbone.config.image_size, backbone.config.in_channels) != (images.image_size, images.channels):
            fail(f"--backbone expects {backbone.config.in_channels}x{backbone.config.image_size}² images; "
                 f"{cfg.dataset} has {images.channels}x{images.image_size}²")
        model = PROBES[cfg.probe](backbone, images.num_classes, cfg)
    else:
        model = make(revit.create_model, cfg.arch, ckpt["model_config"] if ckpt else vision_overrides(cfg, images))
    task = ClassificationTask(cfg, images, device, augment, autocast)
    if cfg.teacher:
        teacher = load_teacher(cfg.teacher, device)
        check_teacher(model, teacher, images, device)
        task = DistillTask(cfg, images, device, augment, autocast, teacher)
    check_eval_depths(cfg, (model.backbone if cfg.probe else model).config)
    batches = lambda start: data.image_batches(images.train, cfg.batch_size, cfg.seed, cfg.repeated_aug,  # noqa: E731
                                               rank, world, start)
    return model, task, batches, augment, steps_per_epoch


AUGMENT_FIELDS = ("random_crop", "three_augment", "color_jitter", "mixup", "cutmix", "mix_prob", "mix_switch_prob",
                  "label_smoothing")


def build_language(cfg, rank, world, device, ckpt, autocast):
    try:
        train_tokens, val_tokens, tokens_per_byte, vocab = data.load_text(
            cfg.dataset if cfg.dataset != "text" else "", cfg.data, cfg.tokenizer, cfg.data_dir, cfg.download)
    except (ValueError, FileNotFoundError) as e:
        fail(f"{'--data' if cfg.data else '--dataset ' + cfg.dataset}: {e}")
    overrides = parse_model_args(cfg.model_args, alternet.AlterNetConfig)
    if cfg.tokenizer != "byte":
        overrides["vocab_size"] = vocab
    model = make(alternet.create_model, cfg.arch, ckpt["model_config"] if ckpt else overrides)
    if cfg.block_size is None:
        cfg.block_size = model.config.seq_len
        say(f"override: block_size={cfg.block_size} (auto: the model's seq_len)")
    block_size = cfg.block_size
    if block_size > model.config.seq_len:
        fail(f"--block-size {block_size} exceeds the model's seq_len {model.config.seq_len} "
             f"(raise it with --model-args seq_len={block_size})")
    if min(len(train_tokens), len(val_tokens)) <= block_size + 1:
        fail(f"the text has {len(train_tokens) + len(val_tokens)} tokens: too short for --block-size {block_size} "
             f"(90% train / 10% validation, each needs more than {block_size + 1})")
    task = LanguageTask(cfg, val_tokens, tokens_per_byte, block_size, device, autocast)
    batches = lambda start: data.text_batches(train_tokens, cfg.batch_size, block_size, cfg.seed,  # noqa: E731
                                              rank, world, start)
    return model, task, batches, None, None


def vision_overrides(cfg, images: data.ImageData) -> dict:
    """Model config overrides: data properties, CLI flags, and the patch size for small images."""
    preset = revit.PRESETS[cfg.arch]
    overrides = dict(image_size=images.image_size, in_channels=images.channels, num_classes=images.num_classes)
    for name in ("patch_size", "depth", "num_experts", "drop_path", "depth_drop"):
        if getattr(cfg, name) is not None:
            overrides[name] = getattr(cfg, name)
    overrides.update(parse_model_args(cfg.model_args, revit.ViTConfig))
    patch = overrides.get("patch_size", preset.get("patch_size", 16))
    if "patch_size" not in overrides and (images.image_size % patch or images.image_size // patch < 4):
        cfg.patch_size = overrides["patch_size"] = 4 if images.image_size % 4 == 0 else 1
        say(f"override: patch_size={cfg.patch_size} (auto: {cfg.arch} is a {preset.get('image_size', 224)}px preset "
            f"with patch {patch}; {images.image_size}x{images.image_size} images need a finer grid)")
    return overrides


def make(create, arch, overrides):
    """create(arch, **overrides), its ValueError / TypeError as the one-line exit."""
    preset_module(arch, overrides)  # imports lib.moe where a comparison mechanism is asked for
    try:
        return create(arch, **overrides)
    except (ValueError, TypeError) as e:
        fail(f"cannot build {arch} with {overrides}: {e}")


def check_eval_depths(cfg, config) -> None:
    """--eval-depths against what the model can run: a ViT only its own depth, recurrent models >= 2."""
    for d in parse_depths(cfg.eval_depths):
        if config.arch == "vit" and d != config.depth:
            fail(f"--eval-depths {cfg.eval_depths}: an untied ViT runs only its own depth ({config.depth}); "
                 f"other depths need a reViT or Raptor model")
        if config.arch != "vit" and d < 2:
            fail(f"--eval-depths {cfg.eval_depths}: recurrent models need depth >= 2; got {d}")
