"""What train.py refuses before it reads or writes anything: every TrainConfig value against its range
or choices (`check_config`; a resumed or evaluated checkpoint: lib/resume.py). A failure is one line
naming the flag (lib/cli.fail); nothing has been touched yet.
"""

from __future__ import annotations

import math
from dataclasses import asdict

import revit
from lib.checkpoint import preset_module
from lib.cli import MAX_DEPTH, MAX_DEPTH_REASON, fail, parse_depths, parse_model_args, path_problem
from lib.data import TEXT_DATASETS
from lib.tasks import DENSE_PROBES, PROBES


def closed(low, high, shown: str = ""):
    """A rule: low <= value <= high (shown: how the range reads in the error)."""
    return (lambda v: low <= v <= high), f"in {shown or f'{low:,}..{high:,}'}"


# Every number flag has a finite range, checked when parsed. The upper bounds are ours (a user would not
# hit them by intent): a typo is refused instead of overflowing, allocating for hours, or sending a
# library into a loop that never ends (Python's betavariate with alpha 1e308 does not return).
BATCH = 1 << 20  # examples in one step or evaluation batch (ImageNet recipes use 2,048-4,096)
COUNT = 10 ** 9  # steps, intervals, subset sizes
RULES = {
    **dict.fromkeys(("batch_size", "eval_batch_size", "grad_accum"), closed(1, BATCH)),
    "lr_batch": closed(0, BATCH),
    **dict.fromkeys(("max_steps", "warmup_steps", "train_subset", "test_subset", "eval_interval",
                     "save_interval", "stop_at_step", "eval_iters"), closed(0, COUNT)),
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
    "lr": ((lambda v: 0 < v <= 10), "in (0, 10]"),
    "gpu_memory": ((lambda v: 0 < v <= 1e6), "in (0, 1e6] GB"),
    **dict.fromkeys(("min_lr", "warmup_lr", "weight_decay", "color_jitter"), closed(0, 10, "[0, 10]")),
    "grad_clip": closed(0, 1e6, "[0, 1e6]"),
    **dict.fromkeys(("mixup", "cutmix"), closed(0, 100, "[0, 100]")),
    "router_lr_scale": ((lambda v: 0 < v <= 1000), "in (0, 1000]"),  # ψ's lr multiplier (ours)
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
        if number and name not in RULES and abs(value) > ANY_NUMBER:
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


def shown_number(value) -> str:
    """A number as an error shows it: a 400-digit integer as 1e+400-ish, not 400 digits."""
    return str(value) if len(str(value)) <= 24 else f"{str(value)[:6]}...({len(str(value))} digits)"


def cpu_time_note(arch: str, seconds_per_step: float, steps: int) -> str | None:
    """On a CPU, one line with the estimated time of the run; above an hour, the CPU-sized preset."""
    hours = seconds_per_step * steps / 3600
    if hours < 1:  # nothing to say about a run that fits a coffee break
        return None
    mini = "alternet-tiny" if arch.startswith("alternet") else "revit-mini"
    return (f"note: on this CPU the run takes about {hours:.1f} h "
            f"({steps} steps x {seconds_per_step:.1f} s); "
            f"{mini} is the CPU-sized preset (python train.py --arch {mini}); a GPU runs this one")
