"""Train reViT / ViT / Raptor on images and AlterNet on text: one loop, single process or torchrun.

    python train.py                                      # quick start: revit-mini on Fashion-MNIST, CPU minutes
    python train.py --arch revit-s --dataset cifar10     # any preset of revit.py or alternet.py
    torchrun --nproc_per_node 8 train.py --arch revit-b --data /imagenet --compile
    python train.py --arch alternet-tiny                 # bytes of the built-in corpus (data.grammar_corpus)
    python train.py --arch alternet-tiny --data tinyshakespeare.txt     # or --dataset tinyshakespeare --download
    python train.py --eval-only out/run/ckpt.pt --eval-depths 2,4,8     # evaluate, no training

The defaults are the quick start. Other settings are named recipes applied over them and printed
at start (`recipe: ...`, then one `override: ...` line per flag or automatic choice): `imagenet`
is the reViT paper's Table 6 (arXiv 2610.12448; DeiT III: AdamW, warmup + cosine, BCE on
binarised mixup/cutmix targets, 3-Augment, colour jitter 0.3), `cifar` shortens it, `text` is the
language-model schedule (plus alternet.RECIPES for the AlterNet paper's presets), `probe` trains a
linear head. Tasks supply the loss and the evaluation: classification, distillation (`--teacher`,
Eq. 5 of the reViT paper, App. A.3), linear probe (`--probe cls --backbone CKPT`; `seg|monodepth`
run probes.py) and language modelling (an alternet preset). The loop knows nothing about a model
beyond: it returns its loss terms, and the optional hooks set_step / after_optimizer_step /
no_weight_decay. Checkpoints are atomic, hold only finite weights, and resume bit-for-bit on CPU.
Nothing is downloaded unless asked (`--download`). Language presets train by default on a corpus the
repository generates (data.grammar_corpus: English-like sentences with agreement across nested
clauses): the same bytes on every machine and at every commit, no file, no network.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import fcntl
import json
import math
import os
import random
import time
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

import alternet
import data
import revit


def fail(message: str):
    """A user error: one clear line on stderr, non-zero exit, nothing written."""
    raise SystemExit(f"train.py: error: {message}")


def opt(default, help: str):
    return field(default=default, metadata={"help": help})


# --- config: the defaults are the quick start (revit-mini, Fashion-MNIST, a CPU, ~88% in minutes) ---


@dataclass
class TrainConfig:
    # model
    arch: str = opt("revit-mini", "preset name from revit.PRESETS or alternet.PRESETS (see --list-archs)")
    patch_size: int | None = opt(None, "override the preset's patch size (auto: adapted to small images)")
    depth: int | None = opt(None, "override the reference recurrent depth L / number of blocks")
    num_experts: int | None = opt(None, "override E, the experts of reViT's bank")
    drop_path: float | None = opt(None, "override the per-block stochastic depth rate")
    depth_drop: float | None = opt(None, "elastic-depth rate: drop whole recurrent steps per image (paper: 0.3)")
    model_args: str = opt("", "any other model config fields, e.g. 'dim=128,heads=4' (see revit.ViTConfig)")
    # data
    dataset: str = opt("", "fashion-mnist | cifar10 | cifar100 | imagenet (ImageFolder at --data) | grammar | "
                           "tinyshakespeare | text (your --data) (auto: fashion-mnist for vision presets, grammar, "
                           "the built-in corpus, for language presets)")
    data: str = opt("", "your own data: an ImageFolder root with train/ and val/, or a UTF-8 text file / folder")
    data_dir: str = opt("", "where the built-in data sets live (auto: ./data, then $REVIT_DATA_DIR, then "
                            "/usr/share/datasets)")
    download: bool = opt(False, "download a built-in data set into the data dir when no search location has it")
    tokenizer: str = opt("byte", "text only: byte (vocab 256) | gpt2 (tiktoken BPE, vocab 50257)")
    block_size: int | None = opt(None, "text only: training sequence length (auto: the model's max length)")
    train_subset: int = opt(0, "use only the first N training examples (0: all)")
    test_subset: int = opt(0, "evaluate on only the first N test examples (0: all)")
    workers: int = opt(8, "ImageFolder only: data-loading worker processes per rank")
    # optimisation
    recipe: str = opt("", "named settings applied over these defaults: imagenet | cifar | text | probe "
                          "(auto: from the data set and mode; printed at start)")
    epochs: int | None = opt(15, "training epochs")
    max_steps: int = opt(0, "optimizer steps to train; overrides --epochs when > 0")
    batch_size: int = opt(256, "GLOBAL batch per optimizer step, over all ranks and accumulation steps")
    grad_accum: int = opt(1, "gradient accumulation micro-steps per optimizer step")
    lr: float | None = opt(3e-3, "peak learning rate at --lr-batch examples (None in a recipe: chosen from the width)")
    lr_batch: int = opt(256, "linear scale rule: peak lr = lr * batch_size / lr_batch (0: use lr as given)")
    min_lr: float = opt(1e-5, "final learning rate of the cosine schedule")
    warmup_epochs: float = opt(0.5, "linear warmup length in epochs")
    warmup_steps: int | None = opt(None, "warmup length in optimizer steps; overrides --warmup-epochs")
    warmup_lr: float = opt(1e-6, "learning rate at the start of warmup")
    weight_decay: float = opt(0.05, "AdamW weight decay; never on biases, norms, LayerScale, class/position "
                                    "tokens or what a model lists in no_weight_decay()")
    beta1: float = opt(0.9, "AdamW beta1, in [0, 1)")
    beta2: float = opt(0.999, "AdamW beta2, in [0, 1)")
    grad_clip: float = opt(1.0, "clip the global gradient norm to this value (0: off)")
    # loss and augmentation (applied to the batch tensor on the device)
    loss: str = opt("ce", "ce | bce (DeiT III: binary cross-entropy on binarised mixup/cutmix targets)")
    label_smoothing: float = opt(0.0, "label smoothing of the one-hot targets")
    mixup: float = opt(0.0, "mixup Beta(alpha, alpha) parameter (0: off)")
    cutmix: float = opt(0.0, "cutmix Beta(alpha, alpha) parameter (0: off)")
    mix_prob: float = opt(1.0, "probability of applying mixup or cutmix to a batch")
    mix_switch_prob: float = opt(0.5, "probability of cutmix instead of mixup when both are on")
    random_crop: bool = opt(False, "random crop after reflect-padding by image_size/8, and horizontal flip")
    three_augment: bool = opt(False, "DeiT III 3-Augment: per image one of grayscale, solarize, gaussian blur")
    color_jitter: float = opt(0.0, "brightness/contrast/saturation jitter strength (0: off)")
    repeated_aug: int = opt(1, "repeated augmentation: each image appears this many times per epoch (1: off)")
    # evaluation, elastic depth, distillation, probes
    eval_depths: str = opt("", "comma-separated depths for the final evaluation, e.g. 4,8,12 (reViT / Raptor)")
    eval_only: str = opt("", "evaluate this checkpoint at --eval-depths and exit; nothing is trained or written")
    eval_interval: int = opt(0, "evaluate and checkpoint every N optimizer steps (0: every epoch; text: 500)")
    eval_batch_size: int = opt(256, "batch per rank for evaluation")
    eval_iters: int = opt(0, "text only: evaluate on at most this many validation batches (0: all)")
    teacher: str = opt("", "distillation: a checkpoint of this project, or hub:dinov2_vitb14 (needs internet)")
    probe: str = opt("", "probe of a frozen --backbone: cls (linear classification) | seg (linear segmentation "
                         "head, mIoU) | monodepth (linear and MLP depth heads, RMSE); seg/monodepth run probes.py")
    probe_pool: str = opt("cls", "probe input: cls (final class token, out['pre_logits']) | mean (patch tokens)")
    backbone: str = opt("", "probe mode: checkpoint of the frozen backbone")
    probe_cache: str = opt("", "seg/depth probes: folder caching the frozen backbone's features")
    # system
    out_dir: str = opt("", "run folder for ckpt.pt and metrics.jsonl (auto: out/<arch>-<time>; with --resume: "
                           "the checkpoint's folder)")
    overwrite: bool = opt(False, "start a new run in an --out-dir that already holds one (its files are replaced)")
    resume: str = opt("", "continue the run saved in this checkpoint (same arch; config taken from it)")
    save_interval: int = opt(0, "also checkpoint every N optimizer steps (0: only at evaluations and the end)")
    stop_at_step: int = opt(0, "stop (as if killed) after this optimizer step, checkpointing first")
    seed: int = opt(0, "random seed: model init, data order, augmentation")
    device: str = opt("auto", "auto | cpu | cuda | cuda:N")
    bf16: bool = opt(True, "bf16 autocast on CUDA (CPU runs in float32)")
    compile: bool = opt(False, "torch.compile the model (CUDA, or CPU with a C++ compiler)")
    ddp_find_unused: bool = opt(False, "DDP find_unused_parameters (needed if some parameters get no gradient)")
    log_interval: int = opt(10, "write a metrics line every N optimizer steps")
    progress: bool = opt(True, "show a tqdm progress bar")


TABLE6 = dict(epochs=300, batch_size=2048, lr=None, lr_batch=2048, warmup_epochs=5.0, loss="bce", mixup=0.8,
              cutmix=1.0, random_crop=True, three_augment=True, color_jitter=0.3, repeated_aug=3)
RECIPES = {  # name: (source, TrainConfig overrides applied over the quick-start defaults)
    "imagenet": ("reViT paper (arXiv 2610.12448) Table 6, the DeiT III recipe", TABLE6),
    "cifar": ("Table 6 shortened for 50k small images", dict(TABLE6, epochs=100, batch_size=256, warmup_epochs=5.0,
                                                             repeated_aug=1, color_jitter=0.0)),
    "text": ("language-model schedule sized for the CPU presets (our choice; the AlterNet paper's Table 2 "
             "settings, arXiv 2611.08741, come with its presets through alternet.RECIPES)",
             dict(max_steps=2000, batch_size=32, warmup_steps=100, lr=None, lr_batch=0, weight_decay=0.1,
                  beta2=0.95, eval_interval=500, ddp_find_unused=True)),  # top-k: unrouted experts get no grad
    "probe": ("linear probe: only a head trains, so no augmentation and no decay", dict(weight_decay=0.0)),
}
IMAGE_DATASETS, TEXT_DATASETS = ("fashion-mnist", "cifar10", "cifar100", "imagenet"), ("grammar", "tinyshakespeare", "text")
RECIPE_OF = {"cifar10": "cifar", "cifar100": "cifar", "imagenet": "imagenet", **dict.fromkeys(TEXT_DATASETS, "text")}


def say(line: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(line, flush=True)


def resolve_config(explicit: dict, announce: bool = True) -> TrainConfig:
    """Quick-start defaults <- the recipe(s) <- flags the user gave; prints what applies. Validates all."""
    show = say if announce else (lambda line: None)
    arch = explicit.get("arch", TrainConfig.arch)
    family = family_of(arch)
    dataset = explicit.get("dataset") or ("grammar" if family == "language" and not explicit.get("data") else
                                          "text" if family == "language" else
                                          "imagenet" if explicit.get("data") else "fashion-mnist")
    if dataset not in IMAGE_DATASETS + TEXT_DATASETS:
        fail(f"unknown --dataset {dataset!r}; choose one of {', '.join(IMAGE_DATASETS + TEXT_DATASETS)}")
    if (family == "language") != (dataset in TEXT_DATASETS):
        fail(f"--arch {arch} is a {family} model but --dataset {dataset} is {'text' if family != 'language' else 'images'}")
    recipe = explicit.get("recipe") or ("probe" if explicit.get("probe") else RECIPE_OF.get(dataset, ""))
    if recipe and recipe not in RECIPES:
        fail(f"unknown --recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
    layers = [(f"recipe: {recipe} -- {RECIPES[recipe][0]}", RECIPES[recipe][1])] if recipe else \
        [("recipe: quick start (the TrainConfig defaults)", {})]
    if arch in getattr(alternet, "RECIPES", {}):
        layers.append((f"recipe: {arch} -- alternet.RECIPES, the AlterNet paper's settings", alternet.RECIPES[arch]))
    values = {"dataset": dataset}
    for title, overrides in layers:
        show(title + "".join(f" {k}={v}" for k, v in overrides.items()))
        values.update(overrides)
    if not explicit.get("dataset"):
        show(f"override: dataset={dataset} (auto: {'the built-in corpus, ' if dataset == 'grammar' else ''}"
             f"{family} preset{', --data given' if explicit.get('data') else ''})")
    for name, value in explicit.items():
        if name in values and values[name] != value or name not in values and value != getattr(TrainConfig, name):
            show(f"override: {name}={value} (--{name.replace('_', '-')})")
    cfg = TrainConfig(**{**values, **explicit})
    check_config(cfg)
    return cfg


def family_of(arch: str) -> str:
    """'vision' or 'language' for a preset name (or the error listing the valid names)."""
    module = preset_module(arch)
    if module is None:
        fail(f"unknown --arch {arch!r}; valid names: {', '.join(sorted(revit.PRESETS) + sorted(alternet.PRESETS))}")
    return "vision" if module is revit else "language"


# --- the loop: set-up, one optimizer step, evaluate-and-save ---


@dataclass
class Run:
    """One training run. `model` is the plain module (what checkpoints store and evaluation runs);
    `forward` is what the training step calls (the same module, compiled and/or DDP-wrapped)."""
    cfg: TrainConfig
    rank: int
    world: int
    device: torch.device
    model: nn.Module
    forward: nn.Module
    task: object
    batches: object
    augment: object
    optimizer: torch.optim.Optimizer
    sched: dict
    steps_per_epoch: int | None
    folder: "RunFolder"
    step: int = 0
    metrics: dict = field(default_factory=dict)
    last_good: int | None = None

    @property
    def is_main(self):
        return self.rank == 0

    @property
    def trainable(self) -> nn.Module:  # a probe trains (and saves) only its head
        return self.model.head if self.cfg.probe else self.model


def train(cfg: TrainConfig, resume_ckpt: dict | None) -> dict:
    run = setup(cfg, resume_ckpt)
    try:
        return loop(run)
    finally:
        run.folder.close()


def loop(run: Run) -> dict:
    cfg, total = run.cfg, run.sched["total_steps"]
    eval_every = cfg.eval_interval or run.steps_per_epoch or 500
    bar = tqdm(total=total, initial=run.step, disable=not (run.is_main and cfg.progress), dynamic_ncols=True)
    t0, seen, start_step, t_start = time.perf_counter(), 0, run.step, time.perf_counter()
    stopped = False
    for step, inputs, targets in (run.batches(run.step) if run.step < total else ()):
        assert step == run.step  # the data order is a function of the step: resume sees the same batches
        record = train_step(run, inputs, targets)
        seen += len(inputs) * run.world
        bar.update(1)
        if run.step == start_step + 1 and run.device.type == "cpu" and run.is_main:
            note = cpu_time_note(cfg.arch, time.perf_counter() - t_start, total - start_step)
            if note:
                bar.write(note)
        if run.step % cfg.log_interval == 0 or run.step == total:
            rate = seen * (inputs.shape[1] if cfg.dataset in TEXT_DATASETS else 1) / max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}", per_s=f"{rate:.0f}")
            run.folder.log({**record, "per_s": rate}, run.is_main)
            t0, seen = time.perf_counter(), 0
        stopped = bool(cfg.stop_at_step and run.step >= cfg.stop_at_step)
        if run.step >= total or stopped:
            break
        evaluate_and_save(run, evaluate_now=run.step % eval_every == 0,
                          save_now=run.step % eval_every == 0 or bool(cfg.save_interval and run.step % cfg.save_interval == 0))
    bar.close()
    if stopped and run.step < total:
        save_checkpoint(run)
        say(f"stopped at step {run.step} as asked (--stop-at-step); continue with --resume {run.folder.ckpt}")
        return {"step": run.step, "checkpoint": str(run.folder.ckpt)}
    summary = final_evaluation(run, time.perf_counter() - t_start)
    run.metrics = {"step": run.step, **summary}
    save_checkpoint(run)
    run.folder.log({"event": "final", **summary}, run.is_main)
    return {**summary, "step": run.step, "checkpoint": str(run.folder.ckpt), "out_dir": str(run.folder.path)}


def train_step(run: Run, inputs, targets) -> dict:
    """One optimizer step: forward/backward over the micro-batches, then the divergence guard (loss
    AND gradient norm must be finite, checked before optimizer.step()), clip, step."""
    cfg, model = run.cfg, run.model
    lr = lr_at(run.step, run.sched["peak_lr"], run.sched)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    if hasattr(model, "set_step"):
        model.set_step(run.step)
    parts_sum, loss_sum = {}, torch.zeros((), device=run.device)
    micro = list(zip(inputs.chunk(cfg.grad_accum), targets.chunk(cfg.grad_accum)))
    for i, (x, y) in enumerate(micro):
        sync = i == len(micro) - 1 or run.world == 1
        with (contextlib.nullcontext() if sync else run.forward.no_sync()):
            loss, parts = run.task.loss(run.forward, x, y)
            (loss / cfg.grad_accum).backward()
        loss_sum += loss.detach() / cfg.grad_accum
        for k, v in parts.items():
            parts_sum[k] = parts_sum.get(k, 0.0) + v.detach() / cfg.grad_accum
    if run.world > 1:
        dist.all_reduce(loss_sum)
        loss_sum /= run.world
    # max_norm inf: the norm without clipping (the guard needs it either way); grads are all-reduced
    grad_norm = torch.nn.utils.clip_grad_norm_(run.trainable.parameters(), cfg.grad_clip or math.inf)
    loss_value, norm_value = torch.stack([loss_sum.float(), grad_norm.float()]).tolist()  # one device sync
    if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
        fail(divergence_message(run, loss_value, norm_value))
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    if hasattr(model, "after_optimizer_step"):
        model.after_optimizer_step()
    run.step += 1
    return {"step": run.step, "loss": loss_value, "lr": lr, "grad_norm": norm_value,
            **{k: v.item() if torch.is_tensor(v) else v for k, v in parts_sum.items()}}


def divergence_message(run: Run, loss: float, grad_norm: float) -> str:
    cfg = run.cfg
    what = f"non-finite loss {loss}" if not math.isfinite(loss) else \
        f"non-finite gradient norm {grad_norm} (loss {loss:.4g})"
    where = f"{run.folder.ckpt} (step {run.last_good})" if run.last_good is not None else "none written yet"
    hints = [f"a lower --lr (peak now {run.sched['peak_lr']:.3g})"]
    hints.append("--grad-clip 1.0" if not cfg.grad_clip else f"a longer warmup (--warmup-steps, now "
                                                                f"{run.sched['warmup_steps']})")
    if run.device.type == "cuda" and cfg.bf16:
        hints.append("--no-bf16")
    return (f"{what} at step {run.step}; stopped before the optimizer step, nothing saved. Last good "
            f"checkpoint: {where}. Try {' or '.join(hints)}")


def cpu_time_note(arch: str, seconds_per_step: float, steps: int) -> str | None:
    """On a CPU, one line with the estimated time of the run; above an hour, the CPU-sized preset."""
    hours = seconds_per_step * steps / 3600
    if hours < 1:  # nothing to say about a run that fits a coffee break
        return None
    mini = "alternet-tiny" if arch.startswith("alternet") else "revit-mini"
    return (f"note: on this CPU the run takes about {hours:.1f} h ({steps} steps x {seconds_per_step:.1f} s); "
            f"{mini} is the CPU-sized preset (python train.py --arch {mini}); a GPU runs this one")


def evaluate_and_save(run: Run, evaluate_now: bool, save_now: bool) -> None:
    if evaluate_now:
        results = evaluate_depths(run.model, run.task, [None], run.rank, run.world)
        run.metrics = {"step": run.step, **{f"val_{k}": v for k, v in results[None].items()}}
        say(f"step {run.step}: " + ", ".join(f"{k} {v:.4f}" for k, v in run.metrics.items() if isinstance(v, float)))
        run.folder.log({"step": run.step, "eval": run.metrics}, run.is_main)
    if save_now:
        save_checkpoint(run)


def evaluate_depths(model: nn.Module, task, depths=(None,), rank: int = 0, world: int = 1) -> dict:
    """The one evaluation path (the training loop, --eval-only, bench.py depths): {depth: metrics};
    depth None is the reference depth (language models: the halted depth, and every fixed depth)."""
    results = task.evaluate(unwrap(model), list(depths), rank, world)
    return {None if key == "halted" else key: value for key, value in results.items()}


def evaluate(model: nn.Module, task, depth: int | None = None, rank: int = 0, world: int = 1) -> dict:
    """Metrics of `model` on the task's test data at one depth (None: the reference depth)."""
    return evaluate_depths(model, task, [depth], rank, world)[depth]


def final_evaluation(run: Run, seconds: float) -> dict:
    """The depth table (vision: --eval-depths; language: halted + every fixed depth) and the summary line."""
    cfg, model = run.cfg, run.model
    num_params = sum(p.numel() for p in run.trainable.parameters())
    results = evaluate_depths(model, run.task, eval_depth_list(cfg, model), run.rank, run.world)
    summary, line = summarise(cfg, model, results)
    say(f"done: {cfg.arch} | {num_params / 1e6:.3f}M params | {line} | {seconds / 60:.1f} min")
    return {"arch": cfg.arch, "params": num_params, **summary, "minutes": seconds / 60}


def eval_depth_list(cfg: TrainConfig, model: nn.Module) -> list:
    if cfg.dataset in TEXT_DATASETS:
        return [None]
    reference = (model.backbone if cfg.probe else model).config.depth
    return [None] + [d for d in parse_depths(cfg.eval_depths) if d != reference]


def summarise(cfg: TrainConfig, model: nn.Module, results: dict) -> tuple[dict, str]:
    """Print the depth table; -> (summary fields, the headline)."""
    if cfg.dataset in TEXT_DATASETS:
        say(f"{'depth':>8} {'val loss':>9} {'bits/byte':>9} {'mean iters':>10}")
        for key, r in results.items():
            say(f"{key or 'halted':>8} {r['loss']:9.4f} {r['bpb']:9.4f} {r['iterations']:10.2f}")
        h = results[None]
        return ({"val_loss": h["loss"], "val_bpb": h["bpb"], "mean_iterations": h["iterations"],
                 "fixed_depth_bpb": {str(k): r["bpb"] for k, r in results.items() if k is not None}},
                f"val loss {h['loss']:.4f} | {h['bpb']:.4f} bits/byte at {h['iterations']:.2f} mean iterations")
    reference = (model.backbone if cfg.probe else model).config.depth
    key = "distill_mse" if cfg.teacher else "acc"
    if len(results) > 1:
        say(f"{'depth':>6} {'test acc %' if key == 'acc' else key:>12}")
        for depth, r in sorted(results.items(), key=lambda kv: kv[0] or reference):
            value = 100 * r[key] if key == "acc" else r[key]
            say(f"{depth or reference:>6} {value:12.4f}{' (trained)' if depth is None else ''}")
    ref = results[None]
    metric = f"test acc {100 * ref['acc']:.2f}%" if key == "acc" else f"test distill MSE {ref[key]:.5f}"
    return ({"reference_depth": reference, **{f"test_{k}": v for k, v in ref.items()},
             "depths": {str(reference if d is None else d): r for d, r in results.items()}},
            f"{metric} at depth {reference}")


# --- set-up: device, data, model, optimizer, run folder ---


def setup(cfg: TrainConfig, resume_ckpt: dict | None) -> Run:
    """Everything before the first step. The run folder is the first write: all input is validated."""
    rank, world, device = init_distributed(cfg)
    if cfg.batch_size % (world * cfg.grad_accum):
        fail(f"--batch-size {cfg.batch_size} must be divisible by ranks x --grad-accum = {world * cfg.grad_accum}")
    options = device_options(device.type, cfg.bf16)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    if options["tf32"]:  # TF32 for the float32 parts outside autocast
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    model, task, batches, augment, steps_per_epoch = build(cfg, rank, world, device, resume_ckpt)
    sched = schedule(cfg, model, steps_per_epoch)
    model.to(device)
    trainable = model.head if cfg.probe else model
    optimizer = torch.optim.AdamW(param_groups(trainable, cfg.weight_decay), lr=sched["peak_lr"],
                                  betas=(cfg.beta1, cfg.beta2), fused=options["fused_adamw"] or None)
    out_dir = broadcast(cfg.out_dir or f"out/{cfg.arch}-{time.strftime('%Y%m%d-%H%M%S')}", world)
    cfg.out_dir = out_dir
    folder = RunFolder(out_dir)
    if rank == 0:
        folder.open(fresh=resume_ckpt is None, overwrite=cfg.overwrite,
                    resume_step=resume_ckpt["step"] if resume_ckpt else None)
    run = Run(cfg, rank, world, device, model, model, task, batches, augment, optimizer, sched, steps_per_epoch,
              folder)
    if resume_ckpt is not None:
        run.trainable.load_state_dict(resume_ckpt["model"])
        optimizer.load_state_dict(resume_ckpt["optimizer"])
        run.step, run.metrics, run.last_good = resume_ckpt["step"], resume_ckpt.get("metrics", {}), resume_ckpt["step"]
        rngs = resume_ckpt["rng"]
        set_rng_state(rngs[rank] if len(rngs) == world else rngs[0], augment)
    else:  # each rank its own stream for drop-path / elastic depth / augmentation
        torch.manual_seed(cfg.seed + 1 + rank)
    run.forward = wrap(model, cfg, device, world)  # after loading: DDP starts from rank 0's weights
    num_params = sum(p.numel() for p in trainable.parameters())
    say(f"{cfg.arch}: {num_params / 1e6:.3f}M trainable parameters | {world} rank(s) on {device} | "
        f"{sched['total_steps']} steps ({steps_per_epoch or '-'} per epoch) | peak lr {sched['peak_lr']:.3g} | out {out_dir}")
    folder.log({"event": "resume" if resume_ckpt else "start", "step": run.step, "config": asdict(cfg),
                "params": num_params, "peak_lr": sched["peak_lr"]}, run.is_main)
    return run


def schedule(cfg: TrainConfig, model: nn.Module, steps_per_epoch: int | None) -> dict:
    """Every length in optimizer steps; the peak lr (chosen from the width when the recipe leaves it open)."""
    language = cfg.dataset in TEXT_DATASETS
    total = cfg.max_steps or cfg.epochs * steps_per_epoch
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else \
        0 if language else round(cfg.warmup_epochs * steps_per_epoch)
    if cfg.lr is None:
        width = 0 if cfg.probe else model.config.dim
        if language:  # AlterNet paper: 3e-4; the small byte-level CPU presets train faster at 1e-3
            cfg.lr, why = (1e-3, "width <= 256") if width <= 256 else (3e-4, "AlterNet paper, width > 256")
        else:  # Table 6: 4e-3 for S, 3e-3 for B and L
            cfg.lr, why = (3e-3, "Table 6, width >= 768 (B/L)") if width >= 768 else (4e-3, "Table 6, width < 768 (S)")
        say(f"override: lr={cfg.lr} (auto: {why})")
    peak = cfg.lr * cfg.batch_size / cfg.lr_batch if cfg.lr_batch else cfg.lr
    return dict(warmup_steps=min(warmup, total), total_steps=total, warmup_lr=min(cfg.warmup_lr, peak),
                min_lr=min(cfg.min_lr, peak), peak_lr=peak, name="warmup-cosine")


def build(cfg: TrainConfig, rank: int, world: int, device, ckpt: dict | None):
    """Data, model and task -> (model, task, batches(start_step), augment, steps_per_epoch). A resumed
    or evaluated checkpoint supplies the model config. Reads only; any user error exits here."""
    options = device_options(device.type, cfg.bf16)
    dtype = options["autocast_dtype"]
    autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype else contextlib.nullcontext
    if cfg.dataset in TEXT_DATASETS:
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


def vision_overrides(cfg: TrainConfig, images: data.ImageData) -> dict:
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
    try:
        return create(arch, **overrides)
    except (ValueError, TypeError) as e:
        fail(f"cannot build {arch} with {overrides}: {e}")


def check_eval_depths(cfg: TrainConfig, config) -> None:
    for d in parse_depths(cfg.eval_depths):
        if config.arch == "vit" and d != config.depth:
            fail(f"--eval-depths {cfg.eval_depths}: an untied ViT runs only its own depth ({config.depth}); "
                 f"other depths need a reViT or Raptor model")
        if config.arch != "vit" and d < 2:
            fail(f"--eval-depths {cfg.eval_depths}: recurrent models need depth >= 2; got {d}")


# --- devices: what differs on CUDA is decided by one function of the device type ---


def pick_device(name: str = "auto") -> torch.device:
    """auto: CUDA when present, else CPU. ValueError for a device this machine does not have."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name}: CUDA is not available on this machine")
    return device


def device_options(device_type: str, bf16: bool = True) -> dict:
    """The CUDA-only choices of the loop, as data (a CPU test checks them with device_type="cuda")."""
    cuda = device_type == "cuda"
    return {"fused_adamw": cuda, "tf32": cuda, "ddp_backend": "nccl" if cuda else "gloo",
            "autocast_dtype": torch.bfloat16 if cuda and bf16 else None, "data_on_device": cuda}


def init_distributed(cfg: TrainConfig):
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK: nccl on CUDA, gloo on CPU. -> (rank, world, device)."""
    try:
        device = pick_device(cfg.device)
    except ValueError as e:
        fail(f"--device: {e}")
    if "RANK" not in os.environ:
        return 0, 1, device
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if device.type == "cuda":
        torch.cuda.set_device(local)
        device = torch.device(f"cuda:{local}")
    dist.init_process_group(device_options(device.type)["ddp_backend"])
    return rank, world, device


def wrap(model: nn.Module, cfg: TrainConfig, device, world: int) -> nn.Module:
    """What the training step calls: the model, compiled (--compile, any device) and/or DDP-wrapped."""
    forward = torch.compile(model) if cfg.compile else model
    if world > 1:
        forward = nn.parallel.DistributedDataParallel(forward, device_ids=[device.index] if device.type == "cuda"
                                                      else None, find_unused_parameters=cfg.ddp_find_unused)
    return forward


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under DDP and torch.compile wrappers (what checkpoints store)."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def broadcast(obj, world):
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# --- tasks: each supplies the loss of a batch and the evaluation ---


def classification_loss(logits, targets, kind):
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
        model.train()
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
    if spec.startswith("hub:"):
        try:
            teacher = TeacherTokens(torch.hub.load("facebookresearch/dinov2", spec[4:]), hub=True)
        except Exception as e:  # noqa: BLE001
            fail(f"--teacher {spec}: could not load it from torch.hub (needs internet access): {str(e).splitlines()[0]}")
    else:
        teacher = TeacherTokens(model_or_fail(spec, "--teacher"), hub=False)
    return teacher.to(device).eval().requires_grad_(False)


def check_teacher(model, teacher, images, device):
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
                    causal = alternet.causal_loss(lm, x, y, halt_threshold=threshold)
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



# --- optimizer and schedule ---


def param_groups(model: nn.Module, weight_decay: float):
    """AdamW groups: decay a weight iff it is >= 2-D, not a bias (reViT's per-expert biases are 2-D:
    biases are never decayed, whatever their shape, as for every other model) and not listed in
    the model's no_weight_decay() (class/position tokens, the reViT router's output layer)."""
    exclude = set(getattr(model, "no_weight_decay", lambda: set())())
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 and not name.endswith("bias") and name not in exclude else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(step: int, peak: float, sched: dict) -> float:
    """Linear warmup from warmup_lr, then cosine to min_lr, by optimizer step (DeiT steps per epoch;
    per-step is the smooth version of the same curve)."""
    warmup, total = sched["warmup_steps"], sched["total_steps"]
    if step < warmup:
        return sched["warmup_lr"] + (peak - sched["warmup_lr"]) * step / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return sched["min_lr"] + 0.5 * (peak - sched["min_lr"]) * (1 + math.cos(math.pi * progress))


# --- checkpoints: atomic save, one loader with one error path ---

MODEL_KEYS = ("arch", "model_config", "model")
RESUME_KEYS = MODEL_KEYS + ("train_config", "optimizer", "step", "rng")


def atomic_save(obj: dict, path: Path) -> None:
    """Write to a temp file in the same folder, then os.replace: a crash never leaves a torn file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        torch.save(obj, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def unreadable(error: Exception) -> str:
    """Why torch.load refused a file, in one line. Its refusal of a file that holds arbitrary Python
    objects is reduced to the reason: its advice to load with weights_only=False is never passed on
    (that would run code stored in the file)."""
    text = " ".join(str(error).split())
    if "Unsupported global: GLOBAL " in text:  # a pickled Python object: never loaded, never run
        stored = text.split("GLOBAL ", 1)[1].split()[0]
        return (f"it stores the Python object {stored}, which a safe load refuses "
                "(files of this project hold only tensors and plain values)")
    if "WeightsUnpickler error:" in text:
        return f"not a PyTorch file ({text.split('WeightsUnpickler error:', 1)[1].split(' Check the')[0].strip()})"
    return f"not a PyTorch file ({text.split('. ')[0][:200] or 'empty or cut short'})"


def load_checkpoint(path, flag: str = "checkpoint", keys=MODEL_KEYS) -> dict:
    """A checkpoint of this project as a dict (tensors and plain values only: weights_only=True).
    ValueError with one line naming the flag, the file and what is wrong."""
    if not Path(path).is_file():
        raise ValueError(f"{flag} {path}: {'a folder, not a checkpoint file' if Path(path).is_dir() else 'no such file'}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- truncated, empty, not a torch file, pickled objects, ...
        raise ValueError(f"{flag} {path}: {unreadable(e)}") from None
    missing = [k for k in keys if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise ValueError(f"{flag} {path}: not a {'training ' if 'optimizer' in keys else ''}checkpoint of this "
                         f"project (missing {', '.join(missing)})")
    return ckpt


def load_model(path, device="cpu", flag: str = "checkpoint"):
    """Rebuild a trained model from a checkpoint of this project -> (model in eval mode, ckpt dict).
    ValueError with one line naming the flag, the file and what is wrong."""
    ckpt = load_checkpoint(path, flag)
    arch = ckpt["arch"]
    if arch == "linear-probe":
        raise ValueError(f"{flag} {path} is a linear-probe head, not a model; its backbone is "
                         f"{ckpt['model_config'].get('backbone')}")
    module = preset_module(arch)
    if module is None:
        raise ValueError(f"{flag} {path}: checkpoint of unknown arch {arch!r} (not a preset of revit.py or alternet.py)")
    try:
        model = module.create_model(arch, **ckpt["model_config"])
    except (ValueError, TypeError) as e:
        raise ValueError(f"{flag} {path}: its model_config does not build {arch}: {e}") from None
    try:
        missing, unexpected = model.load_state_dict(ckpt["model"], strict=False)
    except RuntimeError as e:  # shapes that differ
        raise ValueError(f"{flag} {path}: its weights do not fit {arch}: {' '.join(str(e).split())[:300]}") from None
    for problem, names in (("missing", missing), ("unexpected", unexpected)):
        if names:
            raise ValueError(f"{flag} {path}: its weights do not fit {arch}: {len(names)} {problem} tensors "
                             f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")
    return model.to(device).eval(), ckpt


def checkpoint_or_fail(path, flag, keys=MODEL_KEYS) -> dict:
    try:
        return load_checkpoint(path, flag, keys)
    except ValueError as e:
        fail(str(e))


def model_or_fail(path, flag) -> nn.Module:
    try:
        return load_model(path, flag=flag)[0]
    except ValueError as e:
        fail(str(e))


def save_checkpoint(run: Run) -> None:
    """Rank 0 writes model, optimizer, schedule, loop and every rank's RNG state; only finite weights."""
    rngs = [rng_state(run.augment)] if run.world == 1 else [None] * run.world
    if run.world > 1:
        dist.all_gather_object(rngs, rng_state(run.augment))
    if run.is_main:
        # a plain dict of tensors: state_dict()'s _metadata must not smuggle objects past weights_only
        weights = dict(run.trainable.state_dict())
        bad = [k for k, v in weights.items() if v.is_floating_point() and not torch.isfinite(v).all()]
        if bad:
            fail(f"weights became non-finite at step {run.step} ({bad[0]}); not saved. Last good checkpoint: "
                 f"{last_good(run)}. Try a lower --lr (peak now {run.sched['peak_lr']:.3g})")
        cfg = run.cfg
        ckpt = {"model": weights, "arch": "linear-probe" if cfg.probe else cfg.arch,
                "model_config": primitive(dict(backbone=cfg.backbone, pool=cfg.probe_pool) if cfg.probe
                                          else asdict(run.model.config)),
                "train_config": asdict(cfg), "optimizer": run.optimizer.state_dict(),
                "scheduler": dict(run.sched, step=run.step), "step": run.step, "rng": rngs,
                "metrics": primitive(run.metrics)}
        try:
            atomic_save(ckpt, run.folder.ckpt)
        except OSError as e:
            fail(f"cannot write {run.folder.ckpt}: {e.strerror or e}. Last good checkpoint: {last_good(run)}")
    if run.world > 1:
        dist.barrier()
    run.last_good = run.step


def last_good(run: Run) -> str:
    return f"{run.folder.ckpt} (step {run.last_good})" if run.last_good is not None else "none written yet"


def rng_state(augment) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if augment is not None:
        state["augment"] = augment.generator.get_state()
        state["augment_batch"] = augment.batch_rng.getstate()
    return state


def set_rng_state(state: dict, augment) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if augment is not None:
        augment.generator.set_state(state["augment"])
        augment.batch_rng.setstate(state["augment_batch"])


def primitive(value):
    """Config values as plain Python (checkpoints load with weights_only=True)."""
    if isinstance(value, dict):
        return {k: primitive(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(primitive(v) for v in value)
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)


class RunFolder:
    """A run's folder: ckpt.pt, metrics.jsonl and .lock, held (fcntl.flock) while a process trains there."""

    def __init__(self, path):
        self.path = Path(path)
        self.ckpt, self.metrics = self.path / "ckpt.pt", self.path / "metrics.jsonl"
        self.lock = self.log_file = None

    def check(self, fresh: bool, overwrite: bool) -> None:
        """Before any work, without writing: can the folder be written, is it free for a new run?"""
        existing = next(p for p in (self.path, *self.path.absolute().parents) if p.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            fail(f"--out-dir {self.path}: {existing} is not a writable folder")
        if fresh and not overwrite and (self.ckpt.exists() or self.metrics.exists()):
            fail(f"--out-dir {self.path} already holds a run; continue it with --resume {self.ckpt}, choose "
                 f"another --out-dir, or replace it with --overwrite")

    def open(self, fresh: bool, overwrite: bool, resume_step: int | None) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self.lock = open(self.path / ".lock", "w")
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fail(f"--out-dir {self.path} is in use by another training process; choose another --out-dir")
        except OSError as e:
            fail(f"--out-dir {self.path} is not writable: {e.strerror or e}")
        self.check(fresh, overwrite)  # again, now that no other process can start a run here
        for stale in self.path.glob(f".{self.ckpt.name}.tmp*"):  # saves interrupted by a kill
            stale.unlink()
        if fresh:
            self.ckpt.unlink(missing_ok=True)
            self.metrics.unlink(missing_ok=True)
        elif self.metrics.exists():  # the steps after the checkpoint will be logged again
            kept = [line for line in self.metrics.read_text().splitlines() if logged_by(line, resume_step)]
            self.metrics.write_text("".join(line + "\n" for line in kept))
        self.log_file = open(self.metrics, "a")

    def log(self, record: dict, is_main: bool) -> None:
        if is_main and self.log_file is not None:
            try:
                self.log_file.write(json.dumps(primitive(record)) + "\n")
                self.log_file.flush()
            except OSError as e:
                fail(f"cannot write {self.metrics}: {e.strerror or e}")

    def close(self) -> None:
        for handle in (self.log_file, self.lock):  # closing the lock file releases the lock
            if handle is not None:
                handle.close()


def logged_by(line: str, step: int) -> bool:
    """Whether a metrics.jsonl line was written before the checkpoint of `step` (torn lines are not)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return False
    return record.get("event") != "final" and record.get("step", 0) <= step


# --- command line: flags, validation, main ---


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


GREATER_THAN_ZERO = ("batch_size", "grad_accum", "eval_batch_size", "log_interval", "repeated_aug", "lr",
                     "block_size", "patch_size", "depth", "num_experts", "workers")
AT_LEAST_ZERO = ("epochs", "max_steps", "min_lr", "warmup_epochs", "warmup_steps", "warmup_lr", "weight_decay",
                 "grad_clip", "mixup", "cutmix", "train_subset", "test_subset", "eval_interval", "save_interval",
                 "stop_at_step", "color_jitter", "lr_batch", "eval_iters", "seed")
RULES = {**dict.fromkeys(GREATER_THAN_ZERO, (lambda v: v > 0, "> 0")),
         **dict.fromkeys(AT_LEAST_ZERO, (lambda v: v >= 0, ">= 0")),
         **dict.fromkeys(("beta1", "beta2"), (lambda v: 0 <= v < 1, "in [0, 1)")),
         **dict.fromkeys(("label_smoothing", "mix_prob", "mix_switch_prob", "drop_path", "depth_drop"),
                         (lambda v: 0 <= v <= 1, "in [0, 1]"))}
CHOICES = {"loss": ("ce", "bce"), "tokenizer": ("byte", "gpt2"), "probe_pool": ("cls", "mean"),
           "probe": ("", *PROBES, *DENSE_PROBES)}


def check_config(cfg: TrainConfig) -> None:
    """Every value against its allowed range or choices, before anything is read or written."""
    for name, value in asdict(cfg).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, float) and not math.isfinite(value):
            fail(f"{flag} must be a finite number; got {value}")
        if name in RULES and value is not None and not RULES[name][0](value):
            fail(f"{flag} must be {RULES[name][1]}; got {value}")
        if name in CHOICES and value not in CHOICES[name]:
            fail(f"{flag} must be one of {', '.join(c for c in CHOICES[name] if c)}; got {value!r}")
    if not cfg.max_steps and not cfg.epochs:
        fail("give --epochs or --max-steps (both are 0)" if cfg.dataset not in TEXT_DATASETS else
             "text data trains by steps: give --max-steps")
    if cfg.dataset in TEXT_DATASETS and not cfg.max_steps:
        fail("text data trains by steps: give --max-steps")
    if cfg.probe and not cfg.backbone:
        fail("--probe needs --backbone CHECKPOINT (the frozen model to probe)")
    if cfg.probe and cfg.teacher:
        fail("--probe and --teacher cannot be combined")
    if cfg.data_dir and not Path(cfg.data_dir).is_dir():
        fail(f"--data-dir {cfg.data_dir} does not exist (omit it to search ./data, $REVIT_DATA_DIR and "
             f"/usr/share/datasets)")
    if cfg.data and not Path(cfg.data).exists():
        fail(f"--data {cfg.data} does not exist")
    if cfg.teacher and not cfg.teacher.startswith("hub:") and not Path(cfg.teacher).is_file():
        fail(f"--teacher {cfg.teacher}: no such file (a checkpoint of this project, or hub:dinov2_vitb14)")
    parse_depths(cfg.eval_depths)
    module = preset_module(cfg.arch)
    parse_model_args(cfg.model_args, module.ViTConfig if module is revit else module.AlterNetConfig)


def parse_depths(text: str) -> list[int]:
    try:
        depths = [int(d) for d in text.split(",") if d.strip()]
    except ValueError:
        fail(f"--eval-depths must be comma-separated integers, e.g. 4,8,12; got {text!r}")
    if any(d < 1 for d in depths):
        fail(f"--eval-depths must be positive; got {text!r}")
    return depths


def parse_model_args(text: str, config_class=None) -> dict:
    """'dim=128,heads=4' -> {'dim': 128, 'heads': 4}; with config_class, each name and type checked."""
    hints = typing.get_type_hints(config_class) if config_class else {}
    overrides = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep:
            fail(f"--model-args expects key=value pairs separated by commas; got {item!r}")
        with contextlib.suppress(ValueError, SyntaxError):
            value = ast.literal_eval(value)
        if hints and key not in hints:
            fail(f"--model-args {key}: not a field of {config_class.__name__}; fields: {', '.join(hints)}")
        kinds = tuple(k for k in (typing.get_args(hints[key]) or (hints[key],)) if isinstance(k, type)) if hints else ()
        wrong = kinds and (not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds)
        if wrong and not (float in kinds and type(value) is int):
            fail(f"--model-args {key}={value!r}: {key} takes {' or '.join(k.__name__ for k in kinds)}")
        overrides[key] = value
    return overrides


def preset_module(arch: str):
    """revit or alternet, whichever defines preset `arch`; None if neither does."""
    return revit if arch in revit.PRESETS else alternet if arch in alternet.PRESETS else None


# The model and the data order of a run: a resumed run must keep them.
FIXED_ON_RESUME = ("arch", "patch_size", "depth", "num_experts", "drop_path", "depth_drop", "model_args",
                   "dataset", "data", "tokenizer", "train_subset", "batch_size", "seed", "probe", "probe_pool",
                   "backbone", "teacher")
EVAL_ONLY_FLAGS = {"eval_only", "eval_depths", "test_subset", "eval_batch_size", "eval_iters", "data", "data_dir",
                   "download", "device", "progress"}


def resume_config(explicit: dict) -> tuple[dict, dict]:
    """The checkpoint and the saved run's config; flags given now may extend it (e.g. more --epochs)."""
    path = explicit["resume"]
    ckpt = checkpoint_or_fail(path, "--resume", RESUME_KEYS)
    saved = ckpt["train_config"]
    if "arch" in explicit and explicit["arch"] != saved["arch"]:
        fail(f"--resume {path} is a checkpoint of {saved['arch']}, not {explicit['arch']}")
    for name in FIXED_ON_RESUME:
        if name in explicit and explicit[name] != saved.get(name):
            fail(f"--{name.replace('_', '-')} cannot change on --resume (the checkpoint has "
                 f"{saved.get(name)!r}); start a new run instead")
    known = {f.name for f in fields(TrainConfig)} - {"stop_at_step", "overwrite", "eval_only"}
    merged = {**{k: v for k, v in saved.items() if k in known}, **explicit}
    merged["out_dir"] = explicit.get("out_dir") or str(Path(path).parent)  # the run folder may have moved
    return ckpt, merged


def evaluation_setup(path, flags: dict | None = None, flag: str = "--eval-only"):
    """A checkpoint, rebuilt with its test data as trained -> (cfg, model, task) for evaluate(); `flags`
    (TrainConfig names, e.g. test_subset, device) may change how it is evaluated, never the model."""
    flags = dict(flags or {})
    extra = sorted(set(flags) - EVAL_ONLY_FLAGS)
    if extra:
        fail(f"{flag} evaluates a checkpoint as trained; it takes only "
             f"{', '.join('--' + f.replace('_', '-') for f in sorted(EVAL_ONLY_FLAGS))}; got --{extra[0].replace('_', '-')}")
    ckpt = checkpoint_or_fail(path, flag, MODEL_KEYS + ("train_config",))
    known = {f.name for f in fields(TrainConfig)} - {"out_dir", "resume"}
    cfg = resolve_config({**{k: v for k, v in ckpt["train_config"].items() if k in known}, **flags}, announce=False)
    try:
        device = pick_device(cfg.device)
    except ValueError as e:
        fail(f"--device: {e}")
    model, task, *_ = build(cfg, 0, 1, device, ckpt)
    (model.head if cfg.probe else model).load_state_dict(ckpt["model"])
    return cfg, model.to(device).eval(), task


def eval_only(explicit: dict) -> dict:
    """--eval-only CKPT: the training loop's evaluation at --eval-depths; reads the file, writes nothing."""
    path = explicit["eval_only"]
    cfg, model, task = evaluation_setup(path, explicit)
    summary, line = summarise(cfg, model, evaluate_depths(model, task, eval_depth_list(cfg, model)))
    say(f"{path}: {line}")
    return {"arch": cfg.arch, **summary}


def main(argv=None) -> dict:
    explicit = vars(build_parser().parse_args(argv))
    if explicit.pop("list_archs", False):
        print("\n".join(sorted(revit.PRESETS) + sorted(alternet.PRESETS)))
        return {}
    if explicit.get("probe") in DENSE_PROBES:  # probes.py's own settings and loop, single process
        import probes  # floor 3: imported only when the run is handed to it
        return probes.run(probes.config_from_flags(explicit))
    if explicit.get("eval_only"):
        return eval_only(explicit)
    resume_ckpt = None
    if explicit.get("resume"):
        resume_ckpt, explicit = resume_config(explicit)
    if explicit.get("backbone"):  # a probe is named after its backbone, which must be a vision model
        arch = checkpoint_or_fail(explicit["backbone"], "--backbone")["arch"]
        if preset_module(arch) is not revit:
            fail(f"--backbone {explicit['backbone']} is a checkpoint of {arch}, not a vision model of revit.py")
        explicit.setdefault("arch", arch)
    cfg = resolve_config(explicit, announce=resume_ckpt is None)
    if cfg.out_dir:
        RunFolder(cfg.out_dir).check(fresh=resume_ckpt is None, overwrite=cfg.overwrite)
    try:
        return train(cfg, resume_ckpt)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
