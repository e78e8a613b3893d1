"""Peak memory per device of a training run, before it starts: weights + gradients + AdamW state,
counted, plus activations and the loss, measured at reduced sizes and extrapolated.

    python bench.py memory --arch alternet-50m                  # Table 2's recipe on one 80 GB GPU
    python bench.py memory --arch alternet-350m --gpus 8        # per GPU under torchrun (DDP)
    python bench.py memory --arch revit-b --batch-size 2048 --gpus 8 --gpu-memory 80

train.py prints the same estimate at start and raises --grad-accum until the run fits.

The model of one device's peak (a training step of DDP: every device holds the whole model and
a 1/devices share of the batch, split again into grad_accum micro-batches):
- weights, gradients, AdamW state: counted. Parameters and gradients stay fp32 under autocast
  (autocast casts per op, so there are no separate master weights); AdamW keeps exp_avg and
  exp_avg_sq (2 x the parameters); DDP adds its gradient buckets (one more copy of the gradients).
- activations: what a forward + backward of one micro-batch holds at its peak beyond the
  weights and the gradients (saved tensors, the backward's transients, autocast's bf16 copies of
  the weights). Measured with the preset's real width, heads, experts and vocabulary, at two small
  micro-batches (1 and 2 samples) and two small depths l1 < l2, then: affine in the tokens N = B x T
  per depth (a constant + N x bytes-per-token), both linear in the depth (a loop saves the same
  tensors every iteration). Attention adds no T^2 term: F.scaled_dot_product_attention runs fused
  kernels that never materialise the T x T scores (flash / memory-efficient on CUDA, flash on CPU).
- the loss (language models): the part of the same measurement that grows with the vocabulary,
  i.e. the measurement minus that of the same model with a 256-token vocabulary; same model.
  A loss computed in chunks of C tokens is over-estimated when C exceeds the 2 x 64 tokens measured.
- dtype: measured under the target's autocast (bf16 on CUDA unless --no-bf16; fp32 on a CPU),
  on CPU with CPU autocast when the target is a GPU; say which in the line (`bf16 autocast`).
- a CPU measurement is exact: every tensor storage an op creates is counted while it lives
  (LiveBytes below), not the process's RSS; a CUDA one reads torch.cuda.max_memory_allocated.
Not counted: a distillation teacher, torch.compile's own savings (the estimate is for eager
mode, an upper bound), the CUDA context and allocator fragmentation (the fit keeps 10% free).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import alternet
import revit

GB = 1e9
USABLE = 0.9  # of a device's memory a run may plan to use (our choice: context, fragmentation, workspaces)
SMALL_VOCAB = 256  # the loss is what a measurement loses when the vocabulary shrinks to this


# --- the probe: peak bytes of the tensors an operation sequence creates ---


class LiveBytes(TorchDispatchMode):
    """Counts every tensor storage an aten op creates, from its creation until it is freed; `peak` is
    the most bytes alive at once. Outputs that alias an input (views, in-place ops, per the op's
    schema) and storages already counted are not new memory. Exact for what the dispatcher sees (a
    kernel's internal scratch buffers are not); the weights and anything older than the mode are not
    counted."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.sizes = {}  # id(storage) -> bytes, for the storages alive now

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        for i, value in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
            aliases = i < len(returns) and returns[i].alias_info is not None
            if isinstance(value, torch.Tensor) and not aliases:
                self.count(value.untyped_storage())
        return out

    def count(self, storage) -> None:
        key = id(storage)  # the storage's Python object lives exactly as long as the storage
        if key in self.sizes:
            return
        self.sizes[key] = storage.nbytes()
        self.live += self.sizes[key]
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self.free, key)

    def free(self, key) -> None:
        self.live -= self.sizes.pop(key)


def peak_bytes(fn, device: torch.device) -> int:
    """Peak bytes allocated while fn() runs, beyond what was allocated before: exact on a CPU
    (LiveBytes), torch.cuda.max_memory_allocated on CUDA."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    probe = LiveBytes()
    with probe:
        fn()
    return probe.peak


# --- counted: weights, gradients, AdamW state ---


def model_bytes(model: nn.Module, devices: int = 1) -> dict:
    """Bytes per device of the weights (parameters + buffers), the gradients (with DDP's buckets when
    devices > 1) and AdamW's state (exp_avg, exp_avg_sq). Works on a model built on the meta device."""
    params = list(model.parameters())  # a tied weight once
    trained = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    weights = sum(t.numel() * t.element_size() for t in [*params, *model.buffers()])
    return dict(weights=weights, grads=trained * (2 if devices > 1 else 1), optimizer=2 * trained)


# --- measured: activations and the loss, at reduced sizes ---


def is_language(config) -> bool:
    return isinstance(config, alternet.AlterNetConfig)


def depth_of(config) -> int:
    """L: AlterNet's iterations D, a vision model's blocks / recurrent steps."""
    return config.max_depth if is_language(config) else config.depth


def reduced_model(config, device: torch.device, depth: int, **changes) -> nn.Module:
    """The model of `config` at `depth` with `changes`, on `device`, in training mode, with arbitrary
    weights (memory does not depend on them) and zero gradients allocated, so that backward adds into
    them as every micro-step after the first does. Built on the meta device first: no init, no RNG."""
    language = is_language(config)
    config = dataclasses.replace(config, **changes, **({"max_depth": depth} if language else
                                                       {"depth": depth, "depth_drop": 0.0}))
    with torch.device("meta"):
        model = alternet.AlterNet(config) if language else revit.MODELS[config.arch](config)
    model.to_empty(device=device)
    generator = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.02, 0.02, generator=generator)
            p.grad = torch.zeros_like(p)
        for b in model.buffers():
            b.zero_()
    return model.train()


def step_peak(model: nn.Module, batch: int, seq_len: int, device: torch.device, dtype) -> int:
    """Peak bytes of one training forward + backward (batch samples; seq_len tokens for a language
    model) beyond the weights and gradients, under autocast to `dtype` (None: fp32)."""
    config = model.config
    generator = torch.Generator(device).manual_seed(0)

    def step():
        with torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext():
            if is_language(config):
                tokens = torch.randint(config.vocab_size, (batch, seq_len), generator=generator, device=device)
                loss = model(tokens, targets=tokens)["loss"]
            else:
                shape = (batch, config.in_channels, config.image_size, config.image_size)
                out = model(torch.randn(shape, generator=generator, device=device), return_states=True)
                labels = torch.zeros(batch, dtype=torch.long, device=device)
                loss = F.cross_entropy(out["logits"].float(), labels) + sum(out["aux_losses"].values())
        loss.backward()

    return peak_bytes(step, device)


@dataclasses.dataclass
class Fit:
    """bytes(N, L) = (constant + constant_per_depth L) + N (per_token + per_token_per_depth L): affine in
    the tokens N of a micro-batch, each coefficient linear in the depth L (a loop of L steps)."""
    constant: float
    constant_per_depth: float
    per_token: float
    per_token_per_depth: float

    def __call__(self, tokens: int, depth: int) -> float:
        per_token = self.per_token + self.per_token_per_depth * depth
        return max(0.0, self.constant + self.constant_per_depth * depth + tokens * per_token)


def fit(measured: dict) -> Fit:
    """The Fit through {(tokens, depth): bytes} at two token counts x one or two depths."""
    (n1, n2), depths = sorted({n for n, _ in measured}), sorted({d for _, d in measured})
    lines = []  # (constant, per_token) at each measured depth
    for d in depths:
        per_token = (measured[n2, d] - measured[n1, d]) / (n2 - n1)
        lines.append((measured[n1, d] - n1 * per_token, per_token))
    (c1, k1), (c2, k2) = lines[0], lines[-1]
    span = depths[-1] - depths[0] or 1
    return Fit(c1 - (c2 - c1) / span * depths[0], (c2 - c1) / span, k1 - (k2 - k1) / span * depths[0], (k2 - k1) / span)


@dataclasses.dataclass
class Profile:
    """What a model family's training step holds beyond its weights, as functions of (tokens, depth)."""
    activations: Fit
    loss: Fit
    precision: str  # the dtype the measurement ran in: "bf16 autocast" | "fp32"
    tokens_per_sample: int | None  # a vision model's 1 + patches; None: a language model's seq_len


SMALL_VOCAB = 16  # the loss is what a measurement loses when the vocabulary shrinks to this
_PROFILES: dict = {}


def measure(config, device: torch.device, dtype, seq_len: int | None = None) -> Profile:
    """Activations and loss of `config`'s training step, measured on `device` under autocast to `dtype`
    at micro-batches of 1 and 2 samples of T tokens (language: T = min(64, seq_len); vision: 1 + patches)
    and depths min(L, 2), min(L, 3). Cached per (config, device, dtype, T); the global RNG (and CUDA's)
    is left as it was."""
    language = is_language(config)
    short = min(64, seq_len or config.seq_len) if language else config.num_patches + 1
    key = (repr(config), str(device), dtype, short)
    if key in _PROFILES:
        return _PROFILES[key]
    shapes = [(1, short), (2, short)]
    variants = {"model": {}, "small vocabulary": {"vocab_size": SMALL_VOCAB}} if language else {"model": {}}
    measured = {name: {} for name in variants}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for depth in sorted({min(2, depth_of(config)), min(3, depth_of(config))}):
            for name, changes in variants.items():
                model = reduced_model(config, device, depth, **changes)
                for batch, length in shapes:
                    measured[name][batch * length, depth] = step_peak(model, batch, length, device, dtype)
                del model
    if language:
        loss = {key: value - measured["small vocabulary"][key] for key, value in measured["model"].items()}
        fits = fit(measured["small vocabulary"]), fit(loss)
    else:
        fits = fit(measured["model"]), Fit(0.0, 0.0, 0.0, 0.0)  # vision: the class logits are in the activations
    profile = Profile(*fits, "bf16 autocast" if dtype == torch.bfloat16 else "fp32", None if language else short)
    _PROFILES[key] = profile
    return profile


# --- the estimate, and the gradient accumulation that fits ---


@dataclasses.dataclass
class Memory:
    """The expected peak of one device, in bytes, and the run it is for."""
    weights: float
    grads: float
    optimizer: float
    activations: float
    loss: float
    precision: str
    batch: int  # global, per optimizer step
    seq_len: int | None  # a language model's context; None for images
    devices: int
    grad_accum: int

    @property
    def micro_batch(self) -> int:
        return self.batch // (self.devices * self.grad_accum)

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.loss

    def line(self) -> str:
        """~41.2 GB peak per device (weights 0.2, grads 0.2, AdamW 0.4, activations 38.1, loss 2.3; ...)."""
        shape = f"{self.batch} x {self.seq_len}" if self.seq_len else f"{self.batch}"
        return (f"~{self.total / GB:.1f} GB peak per device (weights {self.weights / GB:.2f}, grads "
                f"{self.grads / GB:.2f}, AdamW {self.optimizer / GB:.2f}, activations {self.activations / GB:.2f}, "
                f"loss {self.loss / GB:.2f}; {self.precision}, batch {shape} over {self.devices} device(s) x accum "
                f"{self.grad_accum} = micro-batch {self.micro_batch})")


def estimate(model: nn.Module, profile: Profile, batch: int, seq_len: int | None, devices: int = 1,
             grad_accum: int = 1) -> Memory:
    """The peak per device of `model` trained at `batch` per optimizer step (split over devices, then
    into grad_accum micro-batches); `profile` from measure()."""
    micro = batch // (devices * grad_accum)
    tokens = micro * (seq_len if profile.tokens_per_sample is None else profile.tokens_per_sample)
    depth = depth_of(model.config)
    return Memory(**model_bytes(model, devices), activations=profile.activations(tokens, depth),
                  loss=profile.loss(tokens, depth), precision=profile.precision, batch=batch,
                  seq_len=seq_len if profile.tokens_per_sample is None else None, devices=devices,
                  grad_accum=grad_accum)


def accumulations(batch: int, devices: int) -> list[int]:
    """The gradient accumulations that split batch evenly over devices: 1, 2, ... up to micro-batch 1."""
    return [a for a in range(1, batch // devices + 1) if batch % (devices * a) == 0]


def plan(model: nn.Module, profile: Profile, batch: int, seq_len: int | None, devices: int, budget_gb: float,
         grad_accum: int | None = None) -> Memory:
    """The estimate at grad_accum, or (None) at the fewest micro-steps whose peak fits USABLE x budget_gb.
    ValueError when nothing fits, naming what would (more accumulation, more GPUs, a shorter context)."""
    for accum in [grad_accum] if grad_accum else accumulations(batch, devices):
        memory = estimate(model, profile, batch, seq_len, devices, accum)
        if memory.total <= USABLE * budget_gb * GB:
            return memory
    first = estimate(model, profile, batch, seq_len, devices, grad_accum or 1)
    hints = how_to_fit(model, profile, batch, seq_len, devices, budget_gb, grad_accum)
    raise ValueError(f"needs {first.line()}, more than {USABLE:.0%} of {budget_gb:g} GB; "
                     f"{'to fit: ' + ' or '.join(hints) if hints else 'no accumulation, GPU count or context fits'}")


def how_to_fit(model, profile, batch, seq_len, devices, budget_gb, grad_accum) -> list[str]:
    """The changes that make a run fit: more accumulation, more GPUs (DDP), a shorter context."""
    usable, hints = USABLE * budget_gb * GB, []
    counted = sum(model_bytes(model, devices).values())
    if counted > usable:
        hints.append(f"a smaller model (weights, gradients and AdamW state alone take {counted / GB:.1f} GB)")
    fitting = [m for m in (estimate(model, profile, batch, seq_len, devices, a) for a in accumulations(batch, devices)
                           if a > (grad_accum or 1)) if m.total <= usable]
    if grad_accum and fitting:
        hints.append(f"--grad-accum {fitting[0].grad_accum} ({fitting[0].total / GB:.1f} GB)")
    for gpus in (2, 4, 8, 16, 32, 64):
        if gpus > devices and batch % (gpus * (grad_accum or 1)) == 0:
            memory = estimate(model, profile, batch, seq_len, gpus, grad_accum or 1)
            if memory.total <= usable:
                hints.append(f"{gpus} GPUs (torchrun --nproc_per_node {gpus}: {memory.total / GB:.1f} GB each)")
                break
    while seq_len and seq_len > 16:
        seq_len //= 2
        memory = min((estimate(model, profile, batch, seq_len, devices, a) for a in accumulations(batch, devices)),
                     key=lambda m: (m.total > usable, m.grad_accum))
        if memory.total <= usable:
            hints.append(f"a shorter context: --block-size {seq_len} (accum {memory.grad_accum}, "
                         f"{memory.total / GB:.1f} GB)")
            break
    return hints
