"""Train reViT / ViT / Raptor on images and AlterNet on text: one loop, single process or torchrun.

    python train.py                                      # quick start: revit-mini, Fashion-MNIST, CPU minutes
    python train.py --arch revit-s --dataset cifar10     # any preset of revit.py or alternet.py
    torchrun --nproc_per_node 8 train.py --arch revit-b --data /imagenet --compile
    python train.py --arch alternet-tiny                 # bytes of the built-in corpus (data.grammar_corpus)
    python train.py --arch alternet-tiny --data tinyshakespeare.txt     # or --dataset tinyshakespeare
    python train.py --eval-only out/run/ckpt.pt --eval-depths 2,4,8     # evaluate, no training

Top to bottom: the config (defaults, recipes, flags), the schedule, `train_step`, evaluation and
checkpoints, the loop, the command line. The process set-up and what a config builds are lib/build.py;
what --resume and --eval-only read, lib/resume.py.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from lib import tasks
from lib.build import adamw, build, setup, wrap
from lib.checkpoint import RunFolder, primitive, provenance, unwrap
from lib.boundary import check_config, fail, family_of, preset_module, preset_names
from lib.cli import (broadcast, cpu_time_note, dataclass_parser, device_options, non_finite_place, opt,
                     run_main, say)
from lib.data import IMAGE_DATASETS, TEXT_DATASETS


# --- config: the defaults are the quick start (revit-mini, Fashion-MNIST, a CPU, ~88% in minutes) ---


@dataclass
class TrainConfig:
    # model
    arch: str = opt("revit-mini", "preset name from revit.PRESETS or alternet.PRESETS (see --list-archs)")
    patch_size: int | None = opt(None, "override the preset's patch size (auto: adapted to small images)")
    depth: int | None = opt(None, "override the reference recurrent depth L / number of blocks (AlterNet: D)")
    num_experts: int | None = opt(None, "override E, the experts of reViT's bank (or of AlterNet's block)")
    drop_path: float | None = opt(None, "override the per-block stochastic depth rate")
    depth_drop: float | None = opt(None, "reViT's elastic depth: drop rate of whole steps (paper: 0.3)")
    model_args: str = opt("", "any other model config fields, e.g. 'dim=128,heads=4' (see revit.ViTConfig)")
    # data
    dataset: str = opt("", f"{' | '.join(IMAGE_DATASETS + TEXT_DATASETS)} (imagenet: an ImageFolder at "
                           "--data; planted: lib/planted.py's depth task; text: your --data) "
                           "(auto: fashion-mnist; language models: grammar)")
    data: str = opt("", "your data: an ImageFolder root with train/ and val/, or a UTF-8 text file / folder")
    data_dir: str = opt("", "built-in data sets' folder (auto: ./data, $REVIT_DATA_DIR, /usr/share/datasets)")
    download: bool = opt(False, "download a built-in data set into the data dir if no search location has it")
    tokenizer: str = opt("byte", "text only: byte (vocab 256) | gpt2 (tiktoken BPE, vocab 50257)")
    block_size: int | None = opt(None, "text only: training sequence length (auto: the model's max length)")
    train_subset: int = opt(0, "use only the first N training examples (a folder's: spread; 0: all)")
    test_subset: int = opt(0, "evaluate on only the first N test examples (a folder's: spread; 0: all)")
    workers: int = opt(8, "ImageFolder only: data-loading worker processes per rank")
    # optimisation
    recipe: str = opt("", "imagenet | cifar | text | probe: settings over these defaults (auto: by data)")
    epochs: int | None = opt(15, "training epochs")
    max_steps: int = opt(0, "optimizer steps to train; overrides --epochs when > 0")
    batch_size: int = opt(256, "GLOBAL batch per optimizer step, over all ranks and accumulation steps")
    grad_accum: int | None = opt(None, "micro-steps per optimizer step (auto: the fewest whose estimated "
                                       "peak memory fits the device; 1 where no plan is made)")
    gpu_memory: float | None = opt(None, "GB per device the run must fit in (auto: the GPU's, or the RAM; "
                                         "CPU runs of small models are checked only if given)")
    lr: float | None = opt(3e-3, "peak learning rate at --lr-batch examples (None in a recipe: by width)")
    lr_batch: int = opt(256, "linear scale rule: peak lr = lr * batch_size / lr_batch (0: use lr as given)")
    min_lr: float = opt(1e-5, "final learning rate of the cosine schedule")
    warmup_epochs: float = opt(0.5, "linear warmup length in epochs")
    warmup_steps: int | None = opt(None, "warmup length in optimizer steps; overrides --warmup-epochs")
    warmup_lr: float = opt(1e-6, "learning rate at the start of warmup")
    weight_decay: float = opt(0.05, "AdamW weight decay (never on biases, norms, no_weight_decay())")
    beta1: float = opt(0.9, "AdamW beta1, in [0, 1)")
    beta2: float = opt(0.999, "AdamW beta2, in [0, 1)")
    grad_clip: float = opt(1.0, "clip the global gradient norm to this value (0: off)")
    router_lr_scale: float = opt(1.0, "the router (psi) trains at lr x this, no decay (1: the paper's lr)")
    # loss and augmentation (on the device)
    loss: str = opt("ce", "ce | bce (DeiT III: binary cross-entropy on binarised mixup/cutmix targets)")
    label_smoothing: float = opt(0.0, "label smoothing of the one-hot targets")
    mixup: float = opt(0.0, "mixup Beta(alpha, alpha) parameter (0: off)")
    cutmix: float = opt(0.0, "cutmix Beta(alpha, alpha) parameter (0: off)")
    mix_prob: float = opt(1.0, "probability of applying mixup or cutmix to a batch")
    mix_switch_prob: float = opt(0.5, "probability of cutmix instead of mixup when both are on")
    random_crop: bool = opt(False, "random crop after reflect-padding by image_size/8, and horizontal flip")
    three_augment: bool = opt(False, "DeiT III 3-Augment: per image one of grayscale, solarize, blur")
    color_jitter: float = opt(0.0, "brightness/contrast/saturation jitter strength (0: off)")
    repeated_aug: int = opt(1, "repeated augmentation: each image appears this many times per epoch (1: off)")
    # evaluation, elastic depth, distillation, probes
    eval_depths: str = opt("", "depths for the final evaluation, e.g. 4,8,12 (reViT / Raptor)")
    eval_only: str = opt("", "evaluate this checkpoint at --eval-depths and exit; nothing trained or written")
    eval_interval: int = opt(0, "evaluate and checkpoint every N optimizer steps (0: every epoch; text: 500)")
    eval_batch_size: int = opt(256, "batch per rank for evaluation")
    eval_iters: int = opt(0, "text only: evaluate on at most this many validation batches (0: all)")
    teacher: str = opt("", "distillation: a checkpoint of this project, or hub:dinov2_vitb14 (--download)")
    probe: str = opt("", "cls: a linear probe of a frozen --backbone (dense probes: python -m tools.probes)")
    probe_pool: str = opt("cls", "probe input: cls (final class token, out['pre_logits']) | mean (patches)")
    backbone: str = opt("", "probe mode: checkpoint of the frozen backbone")
    # system
    out_dir: str = opt("", "folder of ckpt.pt and metrics.jsonl (auto: out/<arch>-<time>; --resume: its own)")
    overwrite: bool = opt(False, "start a new run in an --out-dir that holds one (its files are replaced)")
    resume: str = opt("", "continue the run saved in this checkpoint (same arch; config taken from it)")
    save_interval: int = opt(0, "also checkpoint every N optimizer steps (0: at evaluations and the end)")
    stop_at_step: int = opt(0, "stop (as if killed) after this optimizer step, checkpointing first")
    seed: int = opt(0, "random seed: model init, data order, augmentation")
    device: str = opt("auto", "auto | cpu | cuda | cuda:N | mps (Apple silicon)")
    precision: str = opt("auto", "auto | bf16 | fp16 | fp32 autocast (auto: bf16 on a CUDA GPU that has it, "
                                 "fp16 with a gradient scaler on one without, fp32 on the CPU and MPS)")
    compile: bool = opt(False, "torch.compile the model (CUDA, or CPU with a C++ compiler)")
    compile_backend: str = opt("inductor", "inductor (generated kernels) | eager (graph capture only)")
    ddp_find_unused: bool = opt(False, "DDP find_unused_parameters (if some parameters may get no gradient)")
    log_interval: int = opt(10, "write a metrics line every N optimizer steps")
    progress: bool = opt(True, "show a tqdm progress bar")


TABLE6 = dict(epochs=300, batch_size=2048, lr=None, lr_batch=2048, warmup_epochs=5.0, loss="bce", mixup=0.8,
              cutmix=1.0, random_crop=True, three_augment=True, color_jitter=0.3, repeated_aug=3)
RECIPES = {  # name: (source, TrainConfig overrides applied over the quick-start defaults)
    "imagenet": ("reViT paper (arXiv 2610.12448) Table 6, the DeiT III recipe", TABLE6),
    "cifar": ("Table 6 shortened for 50k small images",
              dict(TABLE6, epochs=100, batch_size=256, warmup_epochs=5.0, repeated_aug=1, color_jitter=0.0)),
    "text": ("language-model schedule sized for the CPU presets (our choice; the AlterNet paper's Table 2 "
             "settings, arXiv 2611.08741, come with its presets through alternet.RECIPES)",
             dict(max_steps=2000, batch_size=32, warmup_steps=100, lr=None, lr_batch=0, weight_decay=0.1,
                  beta2=0.95, eval_interval=500,
                  ddp_find_unused=True)),  # top-k routing: the experts a batch does not pick get no gradient
    "probe": ("linear probe: only a head trains, so no augmentation and no decay", dict(weight_decay=0.0)),
}
RECIPE_OF = {"cifar10": "cifar", "cifar100": "cifar", "imagenet": "imagenet",
             **dict.fromkeys(TEXT_DATASETS, "text")}


def resolve_config(explicit: dict, announce: bool = True, typed=None) -> TrainConfig:
    """Quick-start defaults <- the recipe(s) <- the flags given; prints what applies, then checks it all.
    `typed`: the flags of the command line (default: all of `explicit`), which the family rule judges."""
    show = say if announce else (lambda line: None)
    arch, data = explicit.get("arch", TrainConfig.arch), explicit.get("data")
    family = family_of(arch)
    recipe_data = {"imagenet": "imagenet", "cifar": "cifar10"}.get(explicit.get("recipe"))  # its own data
    images = "imagenet" if data else recipe_data or "fashion-mnist"
    dataset = explicit.get("dataset") or (("text" if data else "grammar") if family == "language" else images)
    if dataset not in IMAGE_DATASETS + TEXT_DATASETS:
        fail(f"unknown --dataset {dataset!r}; choose one of {', '.join(IMAGE_DATASETS + TEXT_DATASETS)}")
    if (family == "language") != (dataset in TEXT_DATASETS):
        kind = "text" if family != "language" else "images"
        fail(f"--arch {arch} is a {family} model but --dataset {dataset} is {kind}")
    recipe = explicit.get("recipe") or ("probe" if explicit.get("probe") else RECIPE_OF.get(dataset, ""))
    if recipe and recipe not in RECIPES:
        fail(f"unknown --recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
    source, values = RECIPES[recipe] if recipe else ("the TrainConfig defaults", {})
    show(f"recipe: {recipe or 'quick start'} -- {source}" + "".join(f" {k}={v}" for k, v in values.items()))
    paper = getattr(preset_module(arch), "RECIPES", {}).get(arch, {})  # the AlterNet paper's presets
    if paper:
        show(f"recipe: {arch} -- alternet.RECIPES, the AlterNet paper's settings"
             + "".join(f" {k}={v}" for k, v in paper.items()))
    values = {**values, **paper, "dataset": dataset}
    if not explicit.get("dataset"):
        show(f"override: dataset={dataset} (auto: {'the built-in corpus, ' if dataset == 'grammar' else ''}"
             f"{family} preset{', --data given' if data else f', --recipe {recipe}' if recipe_data else ''})")
    for name, value in explicit.items():
        if values[name] != value if name in values else value != getattr(TrainConfig, name):
            show(f"override: {name}={value} (--{'no-' if value is False else ''}{name.replace('_', '-')})")
    cfg = TrainConfig(**{**values, **explicit})
    check_config(cfg, explicit if typed is None else typed)
    return cfg


# --- the schedule (the optimizer, AdamW and its groups: lib/build.py) ---


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
            cfg.lr, why = (3e-3, "Table 6, width >= 768 (B/L)") if width >= 768 else \
                (4e-3, "Table 6, width < 768 (S)")
        say(f"override: lr={cfg.lr} (auto: {why})")
    peak = cfg.lr * cfg.batch_size / cfg.lr_batch if cfg.lr_batch else cfg.lr
    return dict(warmup_steps=min(warmup, total), total_steps=total, warmup_lr=min(cfg.warmup_lr, peak),
                min_lr=min(cfg.min_lr, peak), peak_lr=peak, name="warmup-cosine")


def lr_at(step: int, peak: float, sched: dict) -> float:
    """Linear warmup from warmup_lr, then cosine to min_lr, by optimizer step (DeiT steps per epoch;
    per-step is the smooth version of the same curve)."""
    warmup, total = sched["warmup_steps"], sched["total_steps"]
    if step < warmup:
        return sched["warmup_lr"] + (peak - sched["warmup_lr"]) * step / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return sched["min_lr"] + 0.5 * (peak - sched["min_lr"]) * (1 + math.cos(math.pi * progress))


# --- one optimizer step ---


@dataclass
class Run:
    """What the step, the evaluation and the checkpoints read and change. `forward` is `model` as the step
    calls it (compiled and/or DDP-wrapped); `scaler` is fp16's gradient scaler (a no-op otherwise)."""
    cfg: TrainConfig
    device: torch.device
    model: nn.Module
    forward: nn.Module
    task: object
    augment: object
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    sched: dict
    folder: RunFolder
    rank: int = 0
    world: int = 1
    step: int = 0
    metrics: dict = field(default_factory=dict)

    @property
    def trainable(self) -> nn.Module:  # a probe trains (and saves) only its head
        return self.model.head if self.cfg.probe else self.model

    def params(self) -> int:
        return sum(p.numel() for p in self.trainable.parameters())


def train_step(run: Run, inputs, targets) -> dict:
    """One optimizer step: augment, forward, cross-entropy + the model's auxiliary losses (reViT: Eqs. 6, 8,
    9; distillation, Eq. 5, and language modelling: `run.task.loss`), backward; then the divergence guard
    (loss and gradient norm finite, before optimizer.step()), clip, step. fp16: an overflow skips the step."""
    cfg, model, scaler = run.cfg, run.model, run.scaler
    lr = lr_at(run.step, run.sched["peak_lr"], run.sched)
    for group in run.optimizer.param_groups:
        group["lr"] = lr * group["lr_scale"] if "lr_scale" in group else lr  # lr_scale: psi's own group
    if hasattr(model, "set_step"):
        model.set_step(run.step)
    parts_sum, loss_sum = {}, torch.zeros((), device=run.device)
    micro = list(zip(inputs.chunk(cfg.grad_accum), targets.chunk(cfg.grad_accum)))
    for i, (x, y) in enumerate(micro):
        sync = i == len(micro) - 1 or run.world == 1
        with (contextlib.nullcontext() if sync else run.forward.no_sync()):
            if run.task.loss is None:  # the default: supervised classification
                x, y = run.augment(x.to(run.device, non_blocking=True), y.to(run.device))  # y: soft targets
                with run.task.autocast():
                    out = run.forward(x, return_states=True)
                task = classification_loss(out["logits"].float(), y, cfg.loss)
                aux = out.get("aux_losses", {})
                loss, parts = task + sum(aux.values()), {"task": task, **aux}
            else:
                loss, parts = run.task.loss(run.forward, x, y)
            scaler.scale(loss / cfg.grad_accum).backward()  # without fp16 the loss itself
        loss_sum += loss.detach() / cfg.grad_accum
        for k, v in parts.items():
            parts_sum[k] = parts_sum.get(k, 0.0) + v.detach() / cfg.grad_accum
    if run.world > 1:
        dist.all_reduce(loss_sum)
        loss_sum /= run.world
    scaler.unscale_(run.optimizer)  # fp16: the true gradients, for the norm and the clip
    # max_norm inf: the norm without clipping (the guard needs it either way); grads are all-reduced
    grad_norm = torch.nn.utils.clip_grad_norm_(run.trainable.parameters(), cfg.grad_clip or math.inf)
    loss_value, norm_value = torch.stack([loss_sum.float(), grad_norm.float()]).tolist()  # one device sync
    overflow = scaler.is_enabled() and math.isfinite(loss_value) and not math.isfinite(norm_value)
    if not (math.isfinite(loss_value) and math.isfinite(norm_value) or overflow):
        fail(divergence_message(run, loss_value, norm_value))
    scaler.step(run.optimizer)  # fp16: skipped where the gradients overflowed; else optimizer.step()
    scaler.update()  # fp16: the scale halves after an overflow, doubles after 2,000 steps without one
    run.optimizer.zero_grad(set_to_none=True)
    after_optimizer_step(model)
    run.step += 1
    return {"step": run.step, "loss": loss_value, "lr": lr, "grad_norm": None if overflow else norm_value,
            **parts_sum}


def classification_loss(logits, targets, kind: str) -> torch.Tensor:
    """Cross-entropy against soft (mixed, smoothed) targets (B, classes), or DeiT III's binary form."""
    if kind == "bce":  # DeiT III: binarise the mixed targets, then per-class binary cross-entropy
        return F.binary_cross_entropy_with_logits(logits, targets.gt(0.0).to(logits.dtype))
    return torch.sum(-targets * F.log_softmax(logits, dim=-1), dim=-1).mean()


def after_optimizer_step(model: nn.Module) -> None:
    """Updates without a gradient after optimizer.step() (Part II: DeepSeek-V3's bias, ReMoE's L1 control)."""
    for module in model.modules():
        if hasattr(module, "after_optimizer_step"):
            module.after_optimizer_step()


def divergence_message(run: Run, loss: float, grad_norm: float) -> str:
    what = f"non-finite loss {loss}" if not math.isfinite(loss) else \
        f"non-finite gradient norm {grad_norm} (loss {loss:.4g})"
    hints = [f"a lower --lr (peak now {run.sched['peak_lr']:.3g})",
             f"a longer warmup (--warmup-steps, now {run.sched['warmup_steps']})" if run.cfg.grad_clip else
             "--grad-clip 1.0"]
    if device_options(run.device.type, run.cfg.precision)["autocast_dtype"] is not None:
        hints.append("--precision fp32")
    return (f"{what} at step {run.step}; stopped before the optimizer step, nothing saved. Last good "
            f"checkpoint: {run.folder.last_good()}. Try {' or '.join(hints)}")


# --- evaluation and checkpoints ---


def evaluate(model: nn.Module, task, depths=(None,), rank: int = 0, world: int = 1) -> dict:
    """The one evaluation (the loop, --eval-only, tools/depths.py): {depth: metrics} on the task's test
    data; depth None is the reference depth (language models: the halted depth, and every fixed depth)."""
    return task.evaluate(unwrap(model), list(depths), rank, world)


def evaluate_run(run: Run, depths, what: str) -> dict:
    """evaluate() in the loop: a metric that is not a number (finite weights can score NaN) stops the run."""
    results, lr = evaluate(run.model, run.task, depths, run.rank, run.world), run.sched["peak_lr"]
    place = non_finite_place(results)
    if place:
        fail(f"{what} at step {run.step} gave a non-finite {place.removeprefix('None.')}; not logged, not "
             f"saved. Last good checkpoint: {run.folder.last_good()}. Try a lower --lr (peak now {lr:.3g})")
    return results


def save_checkpoint(run: Run) -> None:
    """What a run continues from, with every rank's random streams (RunFolder.save: finite weights only)."""
    cfg = run.cfg
    ckpt = {"model": dict(run.trainable.state_dict()),  # a plain dict: no _metadata past weights_only
            "arch": "linear-probe" if cfg.probe else cfg.arch,
            "model_config": primitive(dict(backbone=cfg.backbone, pool=cfg.probe_pool,
                                           backbone_sha256=run.model.backbone_sha256) if cfg.probe
                                      else asdict(run.model.config)),
            "teacher_sha256": getattr(run.task, "teacher_sha256", None),  # lib/tasks.same_file
            "train_config": asdict(cfg), "optimizer": run.optimizer.state_dict(),
            "scaler": run.scaler.state_dict(), "scheduler": dict(run.sched, step=run.step), "step": run.step,
            "metrics": primitive(run.metrics)}
    run.folder.save(ckpt, run.augment, run.device, run.rank, run.world,
                    f"Try a lower --lr (peak now {run.sched['peak_lr']:.3g})")


# --- the run: set-up, the loop, the final evaluation ---


def train(cfg: TrainConfig, resume_ckpt: dict | None) -> dict:
    """Set-up (every input is checked before the run folder, the first write), then the loop."""
    rank, world, device, options = setup(cfg)  # torchrun's ranks, the device, the seeds, the precision
    model, task, batches, augment, steps_per_epoch = build(cfg, rank, world, device, resume_ckpt,
                                                           plan_memory=True)
    sched = schedule(cfg, model, steps_per_epoch)
    model = model.to(device)
    optimizer = adamw(model.head if cfg.probe else model, cfg, sched["peak_lr"], options["fused_adamw"])
    # fp16 only: the loss scaled up so that small gradients do not flush to zero in fp16
    scaler = torch.amp.GradScaler(device.type, enabled=options["precision"] == "fp16")
    cfg.out_dir = broadcast(cfg.out_dir or f"out/{cfg.arch}-{time.strftime('%Y%m%d-%H%M%S')}", world)
    run = Run(cfg, device, model, model, task, augment, optimizer, scaler, sched,
              RunFolder(cfg.out_dir, cfg.resume), rank, world)
    if resume_ckpt is not None:  # checked in full, then loaded, before the run folder is touched
        from lib import resume  # what continues a saved run: imported by resumed runs only
        resume.continue_run(run, resume_ckpt, options["fused_adamw"])
        resume.continue_schedule(cfg.resume, resume_ckpt, sched, lr_at)  # what changes; a complete run stops
    else:  # each rank its own stream for drop-path / elastic depth / augmentation
        torch.manual_seed(cfg.seed + 1 + rank)
    if rank == 0:
        run.folder.open(fresh=resume_ckpt is None, overwrite=cfg.overwrite,
                        resume_step=resume_ckpt["step"] if resume_ckpt else None)
    run.forward = wrap(model, cfg, device, world)  # after loading: DDP starts from rank 0's weights
    say(f"{cfg.arch}: {run.params() / 1e6:.3f}M trainable parameters | {world} rank(s) on {device} | "
        f"{sched['total_steps']} steps ({steps_per_epoch or '-'} per epoch)"
        f"{f', resumed at step {run.step}' if resume_ckpt else ''} | "
        f"peak lr {sched['peak_lr']:.3g} after {sched['warmup_steps']} warmup steps | out {cfg.out_dir}")
    run.folder.log({"event": "resume" if resume_ckpt else "start", "step": run.step, "config": asdict(cfg),
                    "params": run.params(), "peak_lr": sched["peak_lr"], **provenance(device)}, rank == 0)
    try:
        return loop(run, batches, cfg.eval_interval or steps_per_epoch or 500)
    except KeyboardInterrupt:  # Ctrl-C: one line saying where the run continues, not a traceback
        where = "no checkpoint was written yet" if run.folder.saved_step is None else \
            f"resume with --resume {run.folder.ckpt} (its step {run.folder.saved_step})"
        raise SystemExit(f"train.py: stopped by Ctrl-C at step {run.step}; {where}") from None
    finally:
        run.folder.close()


def loop(run: Run, batches, eval_every: int) -> dict:
    """The steps to the schedule's end: a line every --log-interval, an evaluation and a checkpoint every
    `eval_every`, and at the end the final evaluation."""
    cfg, total = run.cfg, run.sched["total_steps"]
    unit = "tokens" if cfg.dataset in TEXT_DATASETS else "images"
    screen = cfg.progress and sys.stdout.isatty()  # a bar on a terminal; piped or --no-progress: lines
    bar = tqdm(total=total, initial=run.step, disable=run.rank > 0 or not screen, dynamic_ncols=True)
    t_start = t0 = time.perf_counter()
    seen, start_step = 0, run.step
    for step, inputs, targets in (batches(run.step) if run.step < total else ()):
        assert step == run.step
        record = train_step(run, inputs, targets)
        seen += len(inputs) * run.world * (inputs.shape[1] if unit == "tokens" else 1)
        bar.update(1)
        if run.step == start_step + 1 and run.device.type == "cpu" and run.rank == 0:
            note = cpu_time_note(cfg.arch, time.perf_counter() - t_start, total - start_step)
            if note:
                say(note)
        if record["grad_norm"] is None:  # fp16: the scaler skipped the step, its gradients overflowed
            scale = run.scaler.get_scale()
            say(f"step {run.step}: fp16 gradients overflowed; the step was skipped, loss scale now {scale:g}")
            run.folder.log({"event": "overflow", "step": run.step, "loss_scale": scale}, run.rank == 0)
        if run.step % cfg.log_interval == 0 or run.step == total:
            parts = [k for k, v in record.items() if torch.is_tensor(v)]  # train_step leaves them on the
            if parts:  # device: read only for the steps logged, in one transfer
                record.update(zip(parts, torch.stack([record[k].float() for k in parts]).tolist()))
            rate = seen / max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}", per_s=f"{rate:.0f}")
            if not screen:  # no bar: a line to watch instead
                say(f"step {run.step}: loss {record['loss']:.4f}, lr {record['lr']:.2e}, {rate:.0f} {unit}/s")
            run.folder.log({**record, "per_s": rate}, run.rank == 0)
            t0, seen = time.perf_counter(), 0
        if run.step >= total or cfg.stop_at_step and run.step >= cfg.stop_at_step:
            break
        if run.step % eval_every == 0:  # at the reference depth: printed, logged, kept in the checkpoint
            results = evaluate_run(run, [None], "the evaluation")
            run.metrics = {"step": run.step, **{f"val_{k}": v for k, v in results[None].items()}}
            numbers = (f"{k} {v:.4f}" for k, v in run.metrics.items() if isinstance(v, float))
            gates = tasks.gate_summary(run.model)  # reViT, E > 1: does a depth program form? (Fig. 3)
            spread = f", gate spread {gates['gate_spread']:.4f}" if gates else ""
            say(f"step {run.step}: " + ", ".join(numbers) + spread)
            run.folder.log({"step": run.step, "eval": run.metrics, **gates}, run.rank == 0)
        if run.step % eval_every == 0 or cfg.save_interval and run.step % cfg.save_interval == 0:
            save_checkpoint(run)
    bar.close()
    if cfg.stop_at_step and cfg.stop_at_step <= run.step < total:
        save_checkpoint(run)
        say(f"stopped at step {run.step} as asked (--stop-at-step); continue with --resume {run.folder.ckpt}")
        return {"step": run.step, "checkpoint": str(run.folder.ckpt)}
    return finish(run, (time.perf_counter() - t_start) / 60)


def finish(run: Run, minutes: float) -> dict:
    """The final evaluation, at every --eval-depths: printed (`done: ...`), logged and saved."""
    cfg = run.cfg
    results = evaluate_run(run, tasks.eval_depths(cfg, run.model), "the final evaluation")
    summary, line = tasks.summarise(cfg, run.model, results)
    say(f"done: {cfg.arch} | {run.params() / 1e6:.3f}M params | {line} | {minutes:.1f} min")
    summary = {"arch": cfg.arch, "params": run.params(), **summary, "minutes": minutes}
    run.metrics = {"step": run.step, **summary}
    save_checkpoint(run)
    run.folder.log({"event": "final", **summary}, run.rank == 0)
    return {**summary, "step": run.step, "checkpoint": str(run.folder.ckpt), "out_dir": str(run.folder.path)}


# --- command line ---


def build_parser() -> argparse.ArgumentParser:
    parser = dataclass_parser(TrainConfig, __doc__.split("\n\n")[0], suppress_defaults=True)
    parser.add_argument("--list-archs", action="store_true", help="print the preset names and exit")
    return parser


def evaluation_setup(path, flags: dict | None = None, flag: str = "--eval-only"):
    """A checkpoint rebuilt with its test data -> (cfg, model, task) for evaluate() (lib/resume.py)."""
    from lib import resume  # what reads a saved run: imported by --eval-only, --resume and the tools only
    return resume.evaluation_setup(path, dict(flags or {}), flag, TrainConfig, resolve_config)


def main(argv=None) -> dict:
    explicit = vars(build_parser().parse_args(argv))
    if explicit.pop("list_archs", False):
        print("\n".join(preset_names()))
        return {}
    if explicit.get("eval_only") or explicit.get("resume"):
        from lib import resume  # what reads a saved run: imported by --eval-only, --resume and the tools only
    if explicit.get("eval_only"):  # the training loop's evaluation of a checkpoint; writes nothing
        return resume.evaluate_only(explicit, TrainConfig, resolve_config, evaluate)
    if explicit.get("resume"):  # the saved run's config, extended by the flags given now
        resume_ckpt, cfg = resume.resume_config(explicit, TrainConfig, resolve_config)
    else:
        if explicit.get("backbone"):  # a probe is named after its backbone
            explicit.setdefault("arch", tasks.backbone_arch(explicit["backbone"]))
        resume_ckpt, cfg = None, resolve_config(explicit)
    if explicit.get("test_subset") and cfg.dataset in TEXT_DATASETS:  # read by tools.depths, not by training
        fail(f"--test-subset applies to the image models only, not to {cfg.arch} (it evaluates --eval-iters "
             f"batches of text)")
    if cfg.out_dir:
        RunFolder(cfg.out_dir, cfg.resume).check(fresh=resume_ckpt is None, overwrite=cfg.overwrite)
    try:
        return train(cfg, resume_ckpt)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":  # Ctrl-C before training began (data, set-up); the loop reports its own step
    run_main(main, "training had not begun; no checkpoint written")
