"""What train.py refuses before it reads or writes anything: every number flag against lib/boundary's table,
the choices of its string flags, and the flags that need one another (a resumed or evaluated checkpoint:
lib/resume.py). A failure is one line naming the flag; nothing has been touched yet.
"""

from __future__ import annotations

from dataclasses import asdict

import revit
from lib.boundary import check_numbers, fail, parse_depths, parse_model_args, path_problem
from lib.checkpoint import preset_module
from lib.data import TEXT_DATASETS
from lib.tasks import DENSE_PROBES, PROBES

CHOICES = {"loss": ("ce", "bce"), "tokenizer": ("byte", "gpt2"), "probe_pool": ("cls", "mean"),
           "probe": ("", *PROBES), "compile_backend": ("inductor", "eager", "aot_eager"),
           "precision": ("auto", "bf16", "fp16", "fp32")}


def check_config(cfg) -> None:
    """Every value against its allowed range or choices, before anything is read or written."""
    if cfg.probe in DENSE_PROBES:  # their own loop on cached features, in the tool that owns them
        fail(f"--probe {cfg.probe} is a dense probe: python -m tools.probes --probe {cfg.probe} "
             f"--backbone CKPT (train.py trains the linear classification probe, --probe cls)")
    check_numbers(asdict(cfg))
    for name, choices in CHOICES.items():
        if getattr(cfg, name) not in choices:
            flag = "--" + name.replace("_", "-")
            fail(f"{flag} must be one of {', '.join(c for c in choices if c)}; got {getattr(cfg, name)!r}")
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


def cpu_time_note(arch: str, seconds_per_step: float, steps: int) -> str | None:
    """On a CPU, one line with the estimated time of the run; above an hour, the CPU-sized preset."""
    hours = seconds_per_step * steps / 3600
    if hours < 1:  # nothing to say about a run that fits a coffee break
        return None
    mini = "alternet-tiny" if arch.startswith("alternet") else "revit-mini"
    return (f"note: on this CPU the run takes about {hours:.1f} h "
            f"({steps} steps x {seconds_per_step:.1f} s); "
            f"{mini} is the CPU-sized preset (python train.py --arch {mini}); a GPU runs this one")
