"""What train.py refuses before it reads or writes anything: every TrainConfig value against its range
or choices (`check_config`), and a checkpoint to resume against the run it would continue
(`check_resume`). A failure is one line naming the flag (lib/cli.fail); nothing has been touched yet.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict

import torch
import torch.nn as nn

import revit
from lib.checkpoint import fit_problem, preset_module
from lib.cli import MAX_DEPTH, MAX_DEPTH_REASON, fail, parse_depths, parse_model_args, path_problem, say
from lib.data import TEXT_DATASETS
from lib.tasks import DENSE_PROBES, PROBES


def closed(low, high, shown: str = ""):
    """A rule: low <= value <= high (shown: how the range reads in the error)."""
    return (lambda v: low <= v <= high), f"in {shown or f'{low:,}..{high:,}'}"


def above(low, high, shown: str):
    """A rule: low < value <= high."""
    return (lambda v: low < v <= high), f"in {shown}"


# Every number flag has a finite range, checked when parsed. The upper bounds are ours (a user would not
# hit them by intent): a typo is refused instead of overflowing, allocating for hours, or sending a
# library into a loop that never ends (Python's betavariate with alpha 1e308 does not return).
BATCH = 1 << 20  # examples in one step or evaluation batch (ImageNet recipes use 2,048-4,096)
COUNT = 10 ** 9  # steps, intervals, subset sizes
RULES = {
    **dict.fromkeys(("batch_size", "eval_batch_size", "grad_accum"), closed(1, BATCH)),
    **dict.fromkeys(("lr_batch",), closed(0, BATCH)),
    **dict.fromkeys(("max_steps", "warmup_steps", "train_subset", "test_subset", "eval_interval", "save_interval",
                     "stop_at_step", "eval_iters"), closed(0, COUNT)),
    "log_interval": closed(1, COUNT),
    "epochs": closed(0, 100_000),
    "warmup_epochs": closed(0, 100_000, "[0, 100000]"),
    "repeated_aug": closed(1, 64),
    "workers": closed(1, 256),
    "patch_size": closed(1, 1024),
    "block_size": closed(1, 1 << 16),
    "num_experts": closed(1, 1024),
    "depth": (lambda v: 0 < v <= MAX_DEPTH, f"in 1..{MAX_DEPTH} {MAX_DEPTH_REASON}"),
    "seed": (lambda v: 0 <= v < 2 ** 32, "in 0..2**32-1"),  # data orders: seed * 1_000_003 + epoch
    "lr": above(0, 10, "(0, 10]"),
    **dict.fromkeys(("min_lr", "warmup_lr", "weight_decay", "color_jitter"), closed(0, 10, "[0, 10]")),
    "grad_clip": closed(0, 1e6, "[0, 1e6]"),
    "gpu_memory": above(0, 1e6, "(0, 1e6] GB"),
    "router_lr_scale": above(0, 1000, "(0, 1000]"),
    **dict.fromkeys(("mixup", "cutmix"), closed(0, 100, "[0, 100]")),
    **dict.fromkeys(("beta1", "beta2"), ((lambda v: 0 <= v < 1), "in [0, 1)")),
    **dict.fromkeys(("label_smoothing", "mix_prob", "mix_switch_prob", "drop_path", "depth_drop"),
                    closed(0, 1, "[0, 1]")),
}
ANY_NUMBER = 10 ** 9  # a number flag without a rule of its own: finite and at most this in size
CHOICES = {"loss": ("ce", "bce"), "tokenizer": ("byte", "gpt2"), "probe_pool": ("cls", "mean"),
           "probe": ("", *PROBES), "compile_backend": ("inductor", "eager", "aot_eager")}


def check_config(cfg) -> None:
    """Every value against its allowed range or choices, before anything is read or written."""
    if cfg.probe in DENSE_PROBES:  # their own loop on cached features, in the tool that owns them
        fail(f"--probe {cfg.probe} is a dense probe: python -m tools.probes --probe {cfg.probe} "
             f"--backbone CKPT (train.py trains the linear classification probe, --probe cls)")
    for name, value in asdict(cfg).items():
        flag = "--" + name.replace("_", "-")
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if isinstance(value, float) and not math.isfinite(value):
            fail(f"{flag} must be a finite number; got {value}")
        if name in RULES and value is not None and not RULES[name][0](value):
            fail(f"{flag} must be {RULES[name][1]}; got {shown_number(value)}")
        if number and abs(value) > ANY_NUMBER:
            fail(f"{flag} must be at most {ANY_NUMBER:,} in size; got {shown_number(value)}")
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
    if cfg.teacher.startswith("hub:") and not cfg.download:  # torch.hub fetches and runs a repository's code
        fail(f"--teacher {cfg.teacher} is fetched from torch.hub (it downloads and runs facebookresearch/dinov2's "
             f"hubconf.py): give --download to allow it")
    if cfg.teacher and not cfg.teacher.startswith("hub:") and path_problem(cfg.teacher, "file"):
        fail(f"--teacher {cfg.teacher}: {path_problem(cfg.teacher, 'file')} (a checkpoint of this project, "
             f"or hub:dinov2_vitb14)")
    parse_depths(cfg.eval_depths)
    module = preset_module(cfg.arch)
    parse_model_args(cfg.model_args, module.ViTConfig if module is revit else module.AlterNetConfig)


# What a checkpoint never decides: the files a run reads, whether it downloads, the teacher it loads
# (hub:NAME runs a repository's code). --eval-only, --resume and the tools take these from the command
# line only; a saved value that differs is shown in an `override:` line.
COMMAND_LINE_ONLY = {"data": "", "data_dir": "", "download": False, "teacher": ""}


def command_line_only(saved: dict, explicit: dict, flag: str, needed: tuple) -> dict:
    """A saved train_config whose COMMAND_LINE_ONLY values are the command line's (or the defaults).
    `needed`: those the run cannot do without (--resume: its data and teacher; --eval-only: its data),
    which must then be given again; the others fall back to their defaults."""
    taken = dict(saved)
    for name, default in COMMAND_LINE_ONLY.items():
        was, given = saved.get(name, default), explicit.get(name, default)
        option = "--" + name.replace("_", "-")
        if was != given and was and name in needed and name not in explicit:
            fail(f"{flag}: the run used {option} {was}; give {option} again (a checkpoint never names the "
                 f"files read or the teacher loaded: they come from the command line)")
        if was != given:
            say(f"override: {name}={given!r} (the checkpoint's {was!r} is not used: files, downloads and "
                f"teachers come from the command line)")
        taken[name] = given
    return taken


def shown_number(value) -> str:
    """A number as an error shows it: a 400-digit integer as 1e+400-ish, not 400 digits."""
    text = str(value)
    return text if len(text) <= 24 else f"{text[:6]}...({len(text)} digits)"


def check_resume(cfg, ckpt: dict, trainable: nn.Module, optimizer, augment,
                 total_steps: int) -> None:
    """What set-up applies from a resumed checkpoint, checked in full against the rebuilt run without
    changing it (the optimizer state as load_state_dict and the next step would take it, every RNG state
    as set_rng_state would): a failure here leaves the run folder and its log as they were."""
    flag = f"--resume {cfg.resume}"
    if ckpt["step"] > total_steps:
        fail(f"{flag} is at step {ckpt['step']}, past this run's {total_steps} steps; give a larger "
             f"--max-steps or --epochs (the checkpoint is left as it is)")
    may_skip = cfg.ddp_find_unused or getattr(trainable.config, "ffn", "merge") != "merge" if \
        hasattr(trainable, "config") else cfg.ddp_find_unused  # routed experts: some get no gradient
    problem = (fit_problem(trainable.state_dict(), ckpt["model"], cfg.arch)
               or optimizer_problem(ckpt["optimizer"], optimizer, ckpt["step"], may_skip)
               or rng_problem(ckpt["rng"], augment))
    if problem:
        fail(f"{flag}: {problem}")


ADAM_STATE = {"step", "exp_avg", "exp_avg_sq"}  # what AdamW keeps per parameter (+ max_exp_avg_sq: amsgrad)


def number_at_least_zero(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0


ADAM_GROUP = {  # the hyperparameters load_state_dict restores with each group: name -> (check, allowed)
    **dict.fromkeys(("lr", "eps", "weight_decay"), (number_at_least_zero, "a number >= 0")),
    "betas": (lambda v: isinstance(v, (tuple, list)) and len(v) == 2 and all(
        number_at_least_zero(b) and b < 1 for b in v), "two numbers in [0, 1)"),
    **dict.fromkeys(("amsgrad", "maximize"), (lambda v: isinstance(v, bool), "True or False")),
}


def optimizer_problem(saved: dict, optimizer, step: int, may_skip: bool) -> str | None:
    """A saved AdamW state against the run's optimizer: the same groups and hyperparameters (of the same
    types, betas in [0, 1)), parameter ids as state_dict numbers them, and per parameter the state AdamW
    keeps, in the parameter's shape and a float dtype. Parameters without state: refused after the first
    step unless the model routes (`may_skip`: an expert no batch picked has none), then an override line."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    groups = saved["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in optimizer.param_groups]:
        return "its optimizer state does not fit the model (parameter groups differ)"
    if [i for g in groups for i in g["params"]] != list(range(len(params))):
        return "its optimizer state does not fit the model (parameter ids are not 0.." f"{len(params) - 1})"
    for g in groups:
        for key, (ok, allowed) in ADAM_GROUP.items():
            if not ok(g.get(key)):
                return f"its optimizer's {key} is {g.get(key, 'missing')!r}; AdamW takes {allowed}"
    for index, state in saved["state"].items():
        known = isinstance(index, int) and 0 <= index < len(params) and isinstance(state, dict)
        if not known or not ADAM_STATE <= set(state) <= ADAM_STATE | {"max_exp_avg_sq"}:
            return f"its optimizer state does not fit the model (entry {index!r})"
        shapes = {tuple(v.shape) for k, v in state.items() if torch.is_tensor(v) and k != "step"}
        floats = all(torch.is_tensor(v) and v.is_floating_point() for k, v in state.items() if k != "step")
        if shapes - {tuple(params[index].shape)} or not floats or not step_ok(state["step"]):
            return f"its optimizer state does not fit the model (entry {index!r})"
    missing = len(params) - len(saved["state"])
    if missing and step > 0 and not may_skip:
        return (f"its optimizer state covers {len(saved['state'])} of {len(params)} parameters (every one "
                f"has state after a step): an edited or partial file")
    if missing and step > 0:
        say(f"override: {missing} of {len(params)} parameters have no optimizer state (routed experts no batch "
            f"picked yet); they start fresh")
    return None


def step_ok(step) -> bool:
    """AdamW's per-parameter step count: a number or a one-element tensor, >= 0."""
    if torch.is_tensor(step):
        return step.numel() == 1 and not step.is_complex() and bool(step >= 0)
    return isinstance(step, (int, float)) and not isinstance(step, bool) and step >= 0


def rng_problem(states: list, augment) -> str | None:
    """Whether each saved RNG state can be restored, tried on throwaway generators (not the run's)."""
    for rank, state in enumerate(states):
        try:
            torch.Generator().set_state(state["torch"])
            random.Random().setstate(state["python"])
            if "augment_batch" in state:
                random.Random().setstate(state["augment_batch"])
        except (RuntimeError, ValueError, TypeError, OverflowError) as e:
            return f"its rng state of rank {rank} cannot be restored ({' '.join(str(e).split())[:120]})"
        if augment is not None and "augment" not in state:
            return "its rng holds no augmentation state (an image run saves one)"
    return None
