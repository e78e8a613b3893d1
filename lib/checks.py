"""What train.py refuses before it reads or writes anything: every TrainConfig value against its range
or choices (`check_config`), and a checkpoint to resume against the run it would continue
(`check_resume`). A failure is one line naming the flag (lib/cli.fail); nothing has been touched yet.
"""

from __future__ import annotations

import math
from dataclasses import asdict

import torch
import torch.nn as nn

import revit
from lib.checkpoint import fit_problem, preset_module
from lib.cli import MAX_DEPTH, MAX_DEPTH_REASON, fail, parse_depths, parse_model_args, path_problem
from lib.data import TEXT_DATASETS
from lib.tasks import DENSE_PROBES, PROBES


GREATER_THAN_ZERO = ("batch_size", "grad_accum", "eval_batch_size", "log_interval", "repeated_aug", "lr",
                     "block_size", "patch_size", "depth", "num_experts", "workers", "router_lr_scale")
AT_LEAST_ZERO = ("epochs", "max_steps", "min_lr", "warmup_epochs", "warmup_steps", "warmup_lr",
                 "weight_decay", "grad_clip", "mixup", "cutmix", "train_subset", "test_subset",
                 "eval_interval", "save_interval", "stop_at_step", "color_jitter", "lr_batch", "eval_iters",
                 "seed")
RULES = {**dict.fromkeys(GREATER_THAN_ZERO, (lambda v: v > 0, "> 0")),
         **dict.fromkeys(AT_LEAST_ZERO, (lambda v: v >= 0, ">= 0")),
         **dict.fromkeys(("beta1", "beta2"), (lambda v: 0 <= v < 1, "in [0, 1)")),
         **dict.fromkeys(("label_smoothing", "mix_prob", "mix_switch_prob", "drop_path", "depth_drop"),
                         (lambda v: 0 <= v <= 1, "in [0, 1]")),
         "depth": (lambda v: 0 < v <= MAX_DEPTH, f"in 1..{MAX_DEPTH} {MAX_DEPTH_REASON}"),
         "seed": (lambda v: 0 <= v < 2 ** 32, "in 0..2**32-1"),  # data orders: seed * 1_000_003 + epoch
         # bounds a user would not hit by intent (our choice): a typo is refused, not run for centuries
         "epochs": (lambda v: 0 <= v <= 100_000, "in 0..100,000"),
         "max_steps": (lambda v: 0 <= v <= 10 ** 9, "in 0..1,000,000,000")}
CHOICES = {"loss": ("ce", "bce"), "tokenizer": ("byte", "gpt2"), "probe_pool": ("cls", "mean"),
           "probe": ("", *PROBES), "compile_backend": ("inductor", "eager", "aot_eager")}


def check_config(cfg) -> None:
    """Every value against its allowed range or choices, before anything is read or written."""
    if cfg.probe in DENSE_PROBES:  # their own loop on cached features, in the tool that owns them
        fail(f"--probe {cfg.probe} is a dense probe: python -m tools.probes --probe {cfg.probe} "
             f"--backbone CKPT (train.py trains the linear classification probe, --probe cls)")
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
    problem = cfg.data_dir and path_problem(cfg.data_dir, "folder")
    if problem:
        what = " does not exist" if problem == "no such folder" else ": " + problem
        fail(f"--data-dir {cfg.data_dir}{what} (omit it to search ./data, $REVIT_DATA_DIR and "
             f"/usr/share/datasets)")
    if cfg.data and path_problem(cfg.data, "folder") and path_problem(cfg.data, "file"):
        fail(f"--data {cfg.data}: {path_problem(cfg.data, 'file')}")
    if cfg.teacher and not cfg.teacher.startswith("hub:") and path_problem(cfg.teacher, "file"):
        fail(f"--teacher {cfg.teacher}: {path_problem(cfg.teacher, 'file')} (a checkpoint of this project, "
             f"or hub:dinov2_vitb14)")
    parse_depths(cfg.eval_depths)
    module = preset_module(cfg.arch)
    parse_model_args(cfg.model_args, module.ViTConfig if module is revit else module.AlterNetConfig)


def check_resume(cfg, ckpt: dict, trainable: nn.Module, optimizer, augment,
                 total_steps: int) -> None:
    """What set-up applies from a resumed checkpoint, checked against the rebuilt run without changing it:
    a failure here leaves the run folder as it was."""
    flag = f"--resume {cfg.resume}"
    if ckpt["step"] > total_steps:
        fail(f"{flag} is at step {ckpt['step']}, past this run's {total_steps} steps; give a larger "
             f"--max-steps or --epochs (the checkpoint is left as it is)")
    problem = fit_problem(trainable.state_dict(), ckpt["model"], cfg.arch)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    groups = ckpt["optimizer"]["param_groups"]
    sizes = [len(g["params"]) for g in optimizer.param_groups]
    if not problem and [len(g["params"]) for g in groups] != sizes:
        problem = "its optimizer state does not fit the model (parameter groups differ)"
    for index, state in ckpt["optimizer"]["state"].items() if not problem else ():
        shapes = {tuple(v.shape) for k, v in state.items() if torch.is_tensor(v) and k != "step"} \
            if isinstance(state, dict) else {None}
        known = isinstance(index, int) and 0 <= index < len(params)
        if not known or shapes - {tuple(params[index].shape)}:
            problem = f"its optimizer state does not fit the model (entry {index!r})"
            break
    if not problem and augment is not None and any("augment" not in r for r in ckpt["rng"]):
        problem = "its rng holds no augmentation state (an image run saves one)"
    if problem:
        fail(f"{flag}: {problem}")
