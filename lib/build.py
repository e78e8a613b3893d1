"""What a run's config builds before its first step (train.py's set-up, --eval-only, tools/depths.py):
the data, model and task of each kind of run (`build`), and the gradient-accumulation micro-steps whose
peak memory fits the device (`fit_in_memory`). Each kind's module is imported by the runs of that kind
only: the language model and its task (lib/language.py), the planted task (lib/planted.py), the memory
planner (lib/memory.py).
"""

from __future__ import annotations

import torch.nn as nn

from lib import tasks
from lib.data import TEXT_DATASETS


def build(cfg, rank: int, world: int, device, ckpt: dict | None):
    """Data, model and task of train.py's config -> (model, task, batches(start_step), augment,
    steps_per_epoch): images (lib/tasks.py), the planted task (lib/planted.py) or text (lib/language.py).
    A resumed or evaluated checkpoint `ckpt` supplies the model config."""
    if cfg.dataset in TEXT_DATASETS:
        from lib import language
        return language.build(cfg, rank, world, device, ckpt)
    if cfg.dataset == "planted":  # a regression task of our own
        from lib import planted
        return planted.build(cfg, rank, world, device, ckpt)
    return tasks.build(cfg, rank, world, device, ckpt)


MEASURED_FROM = 20_000_000  # parameters: smaller models on a CPU skip the estimate, unless --gpu-memory


def fit_in_memory(cfg, model: nn.Module | None, device, world: int, ckpt: dict | None = None) -> None:
    """Before the first step: the fewest --grad-accum micro-steps whose expected peak memory per device
    fits (lib/memory.py). Skipped for probes, distillation and CPU runs of models under MEASURED_FROM
    parameters without --gpu-memory (measuring would dominate their start-up). model None: the language
    model of cfg (or ckpt), sized on the meta device before the text is read."""
    unasked = device.type != "cuda" and cfg.gpu_memory is None  # a CPU run that names no memory budget
    small = model is not None and sum(p.numel() for p in model.parameters()) < MEASURED_FROM
    if cfg.probe or cfg.teacher or (unasked and small):
        cfg.grad_accum = cfg.grad_accum or 1
        return
    from lib import memory
    memory.fit_run(cfg, model, device, world, ckpt, MEASURED_FROM if unasked else 0)
