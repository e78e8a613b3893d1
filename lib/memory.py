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
  weights and the gradients (saved tensors, the backward's transients, autocast's bf16 / fp16
  copies of the weights). Measured with the preset's real width, heads, experts and vocabulary on two small
  micro-batches of N1 < N2 tokens (language: one sequence of 8 and of 16 tokens, fewer if one chunk
  of the loss is shorter; vision: 1 and 2 images) at two small depths (2 and 3), then extrapolated:
  - along the tokens N = B x T, op by op: both runs execute the same ops, and after op t the live
    bytes are a_t + N b_t (every tensor's size is affine in N), so the peak at any N is the maximum
    over t of those lines. A single line through the two peaks would not do: at small N the peak
    sits where a constant (a weight-sized gradient) dominates, and the slope there is too small.
  - along the depth, linearly (a loop saves the same tensors at every step).
  No T^2 term: F.scaled_dot_product_attention runs fused kernels that never materialise the T x T
  scores (flash / memory-efficient on CUDA, flash on CPU), so the live bytes are affine in T too.
- the loss (language models): AlterNet decodes and scores C = alternet.loss_chunk_tokens(V) tokens
  at a time (~670 at V = 50,257), each chunk recomputed in backward, so beyond the per-token tensors
  (in the activations) the loss holds one chunk's logits and their gradients at a time, whatever
  N and D. Modelled as loss(N) = extra(min(N, C)), where extra(n) is the part of a one-chunk
  measurement that grows with the vocabulary: the model's peak minus that of the same model with a
  16-token vocabulary, both measured at n <= C tokens (so in a single chunk: the same ops at both
  sizes) and extrapolated op by op in n, as above; the most of the measured depths, not
  extrapolated along D. Added on top of the activations' peak: the last iteration's chunks are
  the first thing backward recomputes, when nearly every activation is still saved.
- dtype: measured under the run's autocast (train.py's --precision): bf16 on a CUDA GPU that has it,
  fp16 on one that does not, fp32 for a CPU run (bench.py memory measures a GPU run, with CPU
  autocast on a CPU: --precision); the line says which. fp16's gradient scaler unscales in place.
- the probe (LiveBytes, on any device) counts every tensor storage an op creates while it lives:
  exact for what the dispatcher sees, not the process's RSS; peak_bytes reads
  torch.cuda.max_memory_allocated on CUDA.
Not counted: a distillation teacher, torch.compile's own savings (the estimate is for eager
mode, an upper bound), the CUDA context and allocator fragmentation (the fit keeps 10% free).

Also here, measured rather than predicted: a model's inference memory on a CPU (`cpu_memory_of`, the
peak RSS of a fresh process; bench.py latency and tools/depths.py use it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import json
import os
import subprocess
import sys
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import alternet
import revit
from lib.boundary import fail, parse_model_args, preset_module
from lib.cli import broadcast, device_options, say
from lib.data import TEXT_DATASETS

GB = 1e9
USABLE = 0.9  # of a device's memory a run may plan to use (our choice: context, fragmentation, workspaces)


# --- the probe: peak bytes of the tensors an operation sequence creates ---


class LiveBytes(TorchDispatchMode):
    """Counts every tensor storage an aten op creates, from its creation until it is freed, and records
    the bytes alive after each op (`timeline`; its maximum is the peak). Outputs that alias an input
    (views, in-place ops, per the op's schema) and storages already counted are not new memory. Exact
    for what the dispatcher sees (a kernel's internal scratch buffers are not); the weights and anything
    older than the mode are not counted. Works on any device. An op whose schema only says it MAY alias
    (aten.to, which inference mode dispatches undecomposed) is new memory unless its output shares an
    input's storage: a dtype cast is a copy."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.sizes = {}  # id(storage) -> bytes, for the storages alive now
        self.timeline = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        inputs = {t.untyped_storage().data_ptr() for t in tensors}
        for i, value in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
            if not isinstance(value, torch.Tensor):
                continue
            may_alias = i < len(returns) and returns[i].alias_info is not None
            if not (may_alias and value.untyped_storage().data_ptr() in inputs):
                self.count(value.untyped_storage())
        self.timeline.append(self.live)
        return out

    def count(self, storage) -> None:
        key = id(storage)  # the storage's Python object lives exactly as long as the storage
        if key in self.sizes:
            return
        self.sizes[key] = storage.nbytes()
        self.live += self.sizes[key]
        weakref.finalize(storage, self.free, key)

    def free(self, key) -> None:
        self.live -= self.sizes.pop(key)


def live_bytes(fn) -> list:
    """The bytes alive after each op of fn(), beyond what was alive before it (LiveBytes)."""
    probe = LiveBytes()
    with probe:
        fn()
    return probe.timeline


def peak_bytes(fn, device: torch.device) -> int:
    """Peak bytes allocated while fn() runs, beyond what was allocated before: LiveBytes's exact count
    on a CPU (not the process's RSS), the caching allocator's max_memory_allocated on CUDA."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    return max(live_bytes(fn), default=0)


# --- counted: weights, gradients, AdamW state ---


def model_bytes(model: nn.Module, devices: int = 1) -> dict:
    """Bytes per device of the weights (parameters + buffers), the gradients (with DDP's buckets when
    devices > 1) and AdamW's state (exp_avg, exp_avg_sq). Works on a model built on the meta device."""
    params = list(model.parameters())  # a tied weight once
    trained = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    weights = sum(t.numel() * t.element_size() for t in [*params, *model.buffers()])
    return dict(weights=weights, grads=trained * (2 if devices > 1 else 1), optimizer=2 * trained)


@functools.lru_cache(maxsize=None)
def preset_parameters(name: str) -> int:
    """Parameters of a preset of alternet.py or revit.py (built once on the meta device, then cached)."""
    with torch.device("meta"):
        model = (preset_module(name) or revit).create_model(name)
    return sum(p.numel() for p in model.parameters())


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
        model = alternet.AlterNet(config) if language else revit.build_model(config)
    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.01)  # any finite value: what is allocated depends on shapes only
            p.grad = torch.zeros_like(p)
        for b in model.buffers():
            b.zero_()
    return model.train()


def step_timeline(model: nn.Module, batch: int, seq_len: int, device: torch.device, dtype) -> list:
    """Live bytes after each op of one training forward + backward (batch samples; seq_len tokens for a
    language model) beyond the weights and gradients, under autocast to `dtype` (None: fp32)."""
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

    return live_bytes(step)


@dataclasses.dataclass
class PeakLine:
    """Peak bytes of a training step as a function of the tokens N of its micro-batch. Two measured runs
    at N1 < N2 execute the same ops in the same order, and each op's live bytes are affine in N: the
    peak at any N is max over the ops t of (a_t + N b_t), exact where the op sequence is the same.
    (When the two runs differ in their ops, one line through the two peaks: a lower bound, since a
    maximum of lines is convex.)"""
    offsets: list
    slopes: list

    def __call__(self, tokens: int) -> float:
        return max(a + tokens * b for a, b in zip(self.offsets, self.slopes))

    @classmethod
    def through(cls, n1: int, live1: list, n2: int, live2: list) -> "PeakLine":
        if len(live1) != len(live2):
            live1, live2 = [max(live1)], [max(live2)]
        slopes = [(b - a) / (n2 - n1) for a, b in zip(live1, live2)]
        return cls([a - n1 * k for a, k in zip(live1, slopes)], slopes)


@dataclasses.dataclass
class Profile:
    """What a model's training step holds beyond its weights and gradients: {depth: PeakLine} at two
    small depths, for the model and (language) for the same model with a SMALL_VOCAB vocabulary."""
    model: dict
    small_vocabulary: dict | None
    precision: str  # the dtype the measurement ran in: "bf16 autocast" | "fp16 autocast" | "fp32"
    tokens_per_sample: int | None  # a vision model's 1 + patches; None: a language model's seq_len
    loss_chunk: int | None = None  # tokens per chunk of a language model's loss (alternet.loss_chunk_tokens)

    def activations(self, tokens: int, depth: int) -> float:
        return along_depth(self.small_vocabulary or self.model, tokens, depth)

    def loss(self, tokens: int, depth: int) -> float:
        """The part that grows with the vocabulary, of one chunk of min(tokens, C) tokens at most; the
        most of the measured depths, whatever `depth` (a chunk is freed before the next one is
        decoded). 0 for a vision model: its class logits are tiny."""
        if self.small_vocabulary is None:
            return 0.0
        n = min(tokens, self.loss_chunk)
        return max(0.0, *(self.model[d](n) - self.small_vocabulary[d](n) for d in self.model))


def along_depth(lines: dict, tokens: int, depth: int) -> float:
    """Linear in the depth through the peaks at the measured depths (a loop saves the same tensors
    at every step)."""
    (d1, line1), (d2, line2) = sorted(lines.items())[0], sorted(lines.items())[-1]
    at1, at2 = line1(tokens), line2(tokens)
    return max(0.0, at1 + (at2 - at1) * (depth - d1) / (d2 - d1 or 1))


AUTOCAST_NAMES = {torch.bfloat16: "bf16 autocast", torch.float16: "fp16 autocast"}
SMALL_VOCAB = 16  # the loss is what a measurement loses when the vocabulary shrinks to this
_PROFILES: dict = {}


def measure(config, device: torch.device, dtype, seq_len: int | None = None) -> Profile:
    """Activations and loss of `config`'s training step, measured on `device` under autocast to `dtype`
    at two micro-batches (language: one sequence of T/2 and of T tokens, T = min(16, seq_len, C) with C
    the loss's chunk, at least 2; vision: 1 and 2 images) and depths min(L, 2), min(L, 3). Cached per
    (config, device, dtype, T, C); the global RNG (and CUDA's) is left as it was."""
    language = is_language(config)
    chunk = alternet.loss_chunk_tokens(config.vocab_size) if language else None
    length = max(2, min(16, seq_len or config.seq_len, chunk)) if language else config.num_patches + 1
    key = (repr(config), str(device), dtype, length, chunk)
    if key not in _PROFILES:
        shapes = [(1, max(1, length // 2)), (1, length)] if language else [(1, length), (2, length)]
        variants = {"model": {}, "small_vocabulary": {"vocab_size": SMALL_VOCAB}} if language else {"model": {}}
        lines = {name: {} for name in variants}
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for depth in sorted({min(2, depth_of(config)), min(3, depth_of(config))}):
                for name, changes in variants.items():
                    model = reduced_model(config, device, depth, **changes)
                    runs = [(b * t, step_timeline(model, b, t, device, dtype)) for b, t in shapes]
                    lines[name][depth] = PeakLine.through(*runs[0], *runs[1])
                    del model
        _PROFILES[key] = Profile(lines["model"], lines.get("small_vocabulary"),
                                 AUTOCAST_NAMES.get(dtype, "fp32"), None if language else length, chunk)
    return _PROFILES[key]


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


def device_memory_gb(device: torch.device) -> float | None:
    """A device's memory in GB: a GPU's total; for a CPU, the machine's RAM shared by its local ranks
    (None where the OS does not say)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / GB
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    return ram / GB / int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


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


def how_to_fit(model: nn.Module, profile: Profile, batch: int, seq_len: int | None, devices: int,
               budget_gb: float, grad_accum: int | None) -> list[str]:
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


# --- inference memory on a CPU: peak RSS in a fresh process (bench.py latency, tools/depths.py) ---
#
# The CUDA allocator reports what a model holds (bench.cuda_memory); on a CPU only the process's resident
# set says it, and a process's freed heap stays resident: so each model is measured in a child of a fresh
# process, and the peak is the growth of VmHWM after the model is built.


def cpu_memory_of(specs: list[dict], batch: int, calls: int = 2, processes: int = 2) -> list[dict]:
    """Peak RSS of each model (spec: its config dict, fold, optional depth), `processes` times each.

    One fresh Python process imports torch once, then forks a child per measurement (memory_rows), so
    no measurement reuses another's freed heap. Heap fragmentation can only add to a peak, so we report
    the smallest; all values are kept.
    """
    if not (hasattr(os, "fork") and os.path.exists("/proc/self/status")):  # what memory_rows measures with
        return [{"memory_error": "peak RSS is measured on Linux only (fork, /proc)"}] * len(specs)
    payload = json.dumps([{**spec, "batch": batch, "calls": calls} for spec in specs for _ in range(processes)])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: `-m lib.memory` runs there
    out = subprocess.run([sys.executable, "-m", "lib.memory", "rss", payload], capture_output=True,
                         text=True, cwd=root, timeout=900)
    if out.returncode != 0:
        return [{"memory_error": out.stderr.strip().splitlines()[-1:]}] * len(specs)
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    results = []
    for i in range(len(specs)):
        group = measured[i * processes:(i + 1) * processes]
        failed = [g for g in group if "memory_error" in g]
        values = [g["memory_mib"] for g in group if "memory_mib" in g]
        results.append(failed[0] if failed else {
            "memory_mib": min(values), "memory_mib_all": values,
            "memory_method": group[0]["memory_method"] + f", min over {processes} processes"})
    return results


def memory_rows(specs: list[dict]) -> list[dict]:
    """Each spec measured by _memory_worker in its own child, forked from this (fresh) process:
    `python -m lib.memory rss PAYLOAD`, started by cpu_memory_of."""
    rows = []
    for spec in specs:
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: measure, report through the pipe, exit without cleanup
            os.close(read_end)
            try:
                row = _memory_worker(spec)
            except BaseException as e:  # noqa: BLE001 - reported as the row's error
                row = {"memory_error": f"{type(e).__name__}: {e}"}
            os.write(write_end, json.dumps(row).encode())
            os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end) as fh:
            text = fh.read()
        os.waitpid(pid, 0)
        rows.append(json.loads(text) if text else {"memory_error": "the measuring process died"})
    return rows


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"{field} not in /proc/self/status")


def folded_config(config: revit.ViTConfig) -> revit.ViTConfig:
    """The config of the plain ViT that revit.fold(model) returns at the model's own depth."""
    return dataclasses.replace(config, arch="vit", depth_drop=0.0, raptor_blocks=1)


def _memory_worker(spec: dict) -> dict:
    """In a fresh (forked) process: RSS before the model, then peak RSS over the forward calls.

    The input is allocated first (not counted); the peak is reset (clear_refs) after the model is
    built, so construction temporaries do not count, only what the model holds and its calls use.
    """
    torch.manual_seed(0)
    torch.set_num_threads(1)  # one heap arena: multi-threaded allocation made peaks vary by 30%
    c = revit.ViTConfig(**spec["config"])
    depth = spec.get("depth") or c.depth
    images = torch.randn(spec["batch"], c.in_channels, c.image_size, c.image_size)
    # Prime the runtime (thread pool, kernel libraries, lazily loaded code) with a narrow, 2-step
    # model of the same family on the same input, so their one-off RSS is not charged to the row.
    primer = model_of(dataclasses.replace(c, dim=8 * c.heads, ffn_dim=16 * c.heads, depth=2, raptor_blocks=1))
    with torch.inference_mode():
        primer(images)
    del primer
    gc.collect()
    before = _rss_kib("VmRSS")
    if spec["fold"]:
        # the plain ViT revit.fold builds (same shapes; values do not change memory): folding a real
        # reViT here would leave its freed heap in the RSS baseline
        model = revit.VisionTransformer(folded_config(dataclasses.replace(c, depth=depth))).eval()
    else:
        model = functools.partial(model_of(c), depth=depth) if c.arch != "vit" else model_of(c)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        method = "fresh process: peak VmHWM - RSS before the model (incl. weights)"
    except OSError:
        method = "fresh process: ru_maxrss - RSS before the model (peak may include model building)"
    with torch.inference_mode():
        for _ in range(spec["calls"]):
            model(images)
    peak = _rss_kib("VmHWM") if "VmHWM" in method else _ru_maxrss_kib()
    return {"memory_mib": (peak - before) / 1024, "memory_method": method}


def model_of(config: revit.ViTConfig) -> torch.nn.Module:
    """The module a config describes, in eval mode (what revit.create_model builds from a preset)."""
    return revit.build_model(config).eval()


def _ru_maxrss_kib() -> int:
    import resource  # Unix only, like /proc and fork: imported where the CPU measurement needs it
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss



# --- train.py's plan: a run's peak memory per device and the --grad-accum that fits it ---

GPT2_VOCAB = 50257  # GPT-2's BPE (language.tokenize): known before tiktoken loads


def fit_run(cfg, model: nn.Module | None, device, world: int, ckpt: dict | None, skip_below: int = 0) -> None:
    """train.py's run config `cfg`: cfg.grad_accum None becomes the fewest micro-steps whose peak per
    device fits (an `override:` line), a given one is checked; then one `memory:` line. Nothing is planned
    for an unmeasured small preset (below `skip_below` parameters) or an OS that does not say its RAM (the
    estimate is only said). model None: the language model of cfg (or ckpt), built on the meta device. A
    batch that cannot fit is one line saying what would."""
    auto, cfg.grad_accum = cfg.grad_accum is None, cfg.grad_accum or 1
    if model is None:
        if preset_parameters(cfg.arch) < skip_below:
            return
        vocab = {"vocab_size": GPT2_VOCAB} if cfg.tokenizer == "gpt2" else {}
        overrides = ckpt["model_config"] if ckpt else {
            **vocab, **parse_model_args(cfg.model_args, alternet.AlterNetConfig)}
        try:
            with torch.device("meta"):
                model = alternet.create_model(cfg.arch, **overrides)
        except (ValueError, TypeError):
            return  # build() reports a bad --model-args in one line
    budget = cfg.gpu_memory or device_memory_gb(device)
    seq_len = (cfg.block_size or model.config.seq_len) if cfg.dataset in TEXT_DATASETS else None
    dtype = device_options(device.type, cfg.precision)["autocast_dtype"]
    profile = measure(model.config, device, dtype, seq_len)
    if budget is None:  # an OS that does not say how much RAM it has: say, never stop
        say(f"memory: {estimate(model, profile, cfg.batch_size, seq_len, world, cfg.grad_accum).line()}")
        return
    try:
        planned = plan(model, profile, cfg.batch_size, seq_len, world, budget,
                       None if auto else cfg.grad_accum)
    except ValueError as e:
        fail(f"--arch {cfg.arch} at --batch-size {cfg.batch_size} on {world} device(s) of {budget:.3g} GB "
             f"{e}")
    accum = broadcast(planned.grad_accum, world)  # every rank steps alike
    if accum != cfg.grad_accum:
        say(f"override: grad_accum={accum} (auto: the fewest micro-steps whose peak fits {budget:.3g} GB "
            f"per device)")
        cfg.grad_accum = accum
    say(f"memory: {planned.line()}")


if __name__ == "__main__":  # internal: the fresh process cpu_memory_of starts
    if sys.argv[1:2] != ["rss"] or len(sys.argv) != 3:
        sys.exit("python -m lib.memory: error: internal use only (bench.py measures with it): "
                 "python -m lib.memory rss PAYLOAD")
    print(json.dumps(memory_rows(json.loads(sys.argv[2]))))
