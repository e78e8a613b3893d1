"""What train.py's config builds before the first step: the process (`setup`), data, model and task
(`build`), the micro-steps whose peak memory fits (`fit_in_memory`), the optimizer (`adamw`) and the
module the step calls (`wrap`)."""

from __future__ import annotations

import random

import torch
import torch.nn as nn

from lib import tasks
from lib.boundary import fail
from lib.cli import device_options, init_distributed, say
from lib.data import TEXT_DATASETS


def setup(cfg) -> tuple[int, int, torch.device, dict]:
    """--device, torchrun's ranks, the seeds, TF32 and what --precision auto picks -> (rank, world, device,
    device_options)."""
    rank, world, device = init_distributed(cfg.device)
    if cfg.batch_size % (world * (cfg.grad_accum or 1)):
        fail(f"--batch-size {cfg.batch_size} must be divisible by ranks x --grad-accum = "
             f"{world * (cfg.grad_accum or 1)}")
    options = device_options(device.type, cfg.precision)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    if options["tf32"]:  # TF32 for the float32 parts outside autocast
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if cfg.precision == "auto" and options["precision"] == "fp16":  # a T4, a V100: the free GPUs
        say(f"override: precision=fp16 (auto: {torch.cuda.get_device_name(device)} has no bf16; fp16 "
            f"autocast with a gradient scaler)")
    return rank, world, device, options


def build(cfg, rank: int, world: int, device, ckpt: dict | None, plan_memory: bool = False) -> tuple:
    """-> (model, task, batches, augment, steps_per_epoch) of images (lib/tasks.py, lib/planted.py) or text
    (lib/language.py, imported by text runs only; no augment, no epochs); `ckpt` gives the model config.
    batches(start_step) yields (step, inputs, targets) in an order set by the step alone (a resumed run sees
    the same batches). plan_memory: the memory gate, before the text is read (the config sets a language
    model's size) or after the images are."""
    language = cfg.dataset in TEXT_DATASETS
    if plan_memory and language:
        fit_in_memory(cfg, None, device, world, ckpt)
    if language:
        from lib import language as kind
    elif cfg.dataset == "planted":  # a regression task of our own
        from lib import planted as kind
    else:
        kind = tasks
    parts = kind.build(cfg, rank, world, device, ckpt)
    if plan_memory and not language:
        fit_in_memory(cfg, parts[0], device, world)
    return parts


def adamw(trainable: nn.Module, cfg, peak_lr: float, fused: bool) -> torch.optim.AdamW:
    """AdamW over param_groups at the peak lr (train_step sets each step's lr, times a group's lr_scale)."""
    if cfg.router_lr_scale != 1 and not router_parameters(trainable):
        fail(f"--router-lr-scale {cfg.router_lr_scale}: {cfg.arch} has no router (reViT with E >= 2 and "
             f"the routed mechanisms of lib/moe.py have one); leave it at 1")
    return torch.optim.AdamW(param_groups(trainable, cfg.weight_decay, cfg.router_lr_scale), lr=peak_lr,
                             betas=(cfg.beta1, cfg.beta2), fused=fused or None)


def param_groups(model: nn.Module, weight_decay: float, router_lr_scale: float = 1.0):
    """AdamW groups: decay a weight iff it is >= 2-D, not a bias (reViT's per-expert biases are 2-D) and
    not in the model's no_weight_decay() (class/position tokens, the reViT router's output layer).
    router_lr_scale m != 1 (ours; the paper trains psi at the one lr): psi of Eq. 1 in a third group at
    lr x m ("lr_scale") without decay; m = 1 keeps the two groups exactly."""
    exclude = set(getattr(model, "no_weight_decay", lambda: set())())
    router = {id(p) for p in router_parameters(model)} if router_lr_scale != 1 else set()
    decay, no_decay, psi = [], [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            decays = p.ndim >= 2 and not name.endswith("bias") and name not in exclude
            (psi if id(p) in router else decay if decays else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return groups + ([{"params": psi, "weight_decay": 0.0, "lr_scale": router_lr_scale}] if psi else [])


def router_parameters(model: nn.Module) -> list:
    """The parameters of the shared block's router: reViT's depth router psi (Eq. 1), or a comparison
    mechanism's content router (lib/moe.py); [] for a model without one."""
    router = getattr(getattr(getattr(model, "block", None), "mlp", None), "router", None)
    return list(router.parameters()) if isinstance(router, nn.Module) else []


MEASURED_FROM = 20_000_000  # parameters: smaller models on a CPU skip the estimate, unless --gpu-memory


def fit_in_memory(cfg, model: nn.Module | None, device, world: int, ckpt: dict | None = None) -> None:
    """The fewest --grad-accum micro-steps whose expected peak memory per device fits (lib/memory.py);
    skipped for probes, distillation and CPU runs of models under MEASURED_FROM parameters without
    --gpu-memory (measuring would dominate their start-up). model None: cfg's (or ckpt's) language model."""
    unasked = device.type != "cuda" and cfg.gpu_memory is None  # a CPU run that names no memory budget
    small = model is not None and sum(p.numel() for p in model.parameters()) < MEASURED_FROM
    if cfg.probe or cfg.teacher or (unasked and small):
        cfg.grad_accum = cfg.grad_accum or 1
        return
    from lib import memory
    memory.fit_run(cfg, model, device, world, ckpt, MEASURED_FROM if unasked else 0)


def wrap(model: nn.Module, cfg, device, world: int) -> nn.Module:
    """What the step calls: compile(DDP(model)), the order PyTorch documents, so that the compiled graph is
    split at DDP's gradient buckets and their all-reduce overlaps the backward."""
    forward = model
    if world > 1:
        device_ids = [device.index] if device.type == "cuda" else None
        forward = nn.parallel.DistributedDataParallel(forward, device_ids=device_ids,
                                                      find_unused_parameters=cfg.ddp_find_unused)
    return torch.compile(forward, backend=cfg.compile_backend) if cfg.compile else forward
