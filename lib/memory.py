"""Peak memory per device of a training run, before it starts (train.py plans --grad-accum with it;
`python bench.py memory --arch PRESET [--gpus N]` prints it), and a model's inference memory on a CPU.

One device's peak in a DDP training step (each device: the whole model, 1/devices of the batch, split
again into grad_accum micro-batches), under the run's autocast (bf16, fp16, or fp32 on a CPU):
- weights, gradients, AdamW state: counted (fp32 under autocast; AdamW's exp_avg and exp_avg_sq; DDP's
  gradient buckets, one more copy of the gradients);
- activations: measured by LiveBytes at the preset's real width and vocabulary on two small micro-batches
  at depths 2 and 3, extrapolated op by op along the tokens (peak_line) and linearly along the depth (a
  loop saves the same tensors at every step). No T^2 term: scaled_dot_product_attention's fused kernels
  never hold the T x T scores;
- the loss (AlterNet): one chunk of alternet.loss_chunk_tokens(V) tokens' logits at a time (Profile.loss).
Not counted: a distillation teacher, torch.compile's savings (an upper bound for eager mode), the CUDA
context and fragmentation (the plan keeps 10% free).
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from lib.boundary import fail, model_overrides
from lib.cli import broadcast, device_options, say
from lib.data import TEXT_DATASETS

GB = 1e9
USABLE = 0.9  # of a device's memory a run may plan to use (our choice: context, fragmentation, workspaces)


# --- the probe: peak bytes of the tensors an operation sequence creates ---


class LiveBytes(TorchDispatchMode):
    """The bytes of every tensor storage an aten op creates, alive after each op (`timeline`). An output
    that shares an input's storage (a view, an in-place op) is not new memory; one whose schema only says it
    MAY alias (aten.to under inference mode) is, unless it does: a dtype cast is a copy. Exact for what the
    dispatcher sees (not a kernel's scratch); what is older than the mode not counted."""

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
        if key not in self.sizes:
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
    """Peak bytes allocated while fn() runs beyond those before: LiveBytes on a CPU, the allocator on CUDA."""
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
    """Bytes per device of the weights and buffers, the gradients (DDP's buckets too) and AdamW's state."""
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
    """The model of `config` at `depth` with `changes`, training, arbitrary weights and zero gradients
    (backward adds into them, as every micro-step after the first does). Built on meta: no init, no RNG."""
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
    """Live bytes after each op of one forward + backward, under autocast to `dtype` (None: fp32)."""
    config = model.config
    generator = torch.Generator(device).manual_seed(0)

    def step():
        with torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext():
            if is_language(config):
                shape = (batch, seq_len)
                tokens = torch.randint(config.vocab_size, shape, generator=generator, device=device)
                loss = model(tokens, targets=tokens)["loss"]
            else:
                shape = (batch, config.in_channels, config.image_size, config.image_size)
                out = model(torch.randn(shape, generator=generator, device=device), return_states=True)
                labels = torch.zeros(batch, dtype=torch.long, device=device)
                loss = F.cross_entropy(out["logits"].float(), labels) + sum(out["aux_losses"].values())
        loss.backward()

    return live_bytes(step)


def peak_line(n1: int, live1: list, n2: int, live2: list):
    """tokens -> a step's peak bytes. Two runs at N1 < N2 tokens execute the same ops and every tensor is
    affine in N, so after op t the live bytes are a_t + N b_t, and the peak at any N is the max of those
    lines (at small N a weight-sized constant sets it). Runs that differ in their ops: one line through
    their peaks, a lower bound."""
    if len(live1) != len(live2):
        live1, live2 = [max(live1)], [max(live2)]
    slopes = [(b - a) / (n2 - n1) for a, b in zip(live1, live2)]
    offsets = [a - n1 * k for a, k in zip(live1, slopes)]
    return lambda tokens: max(a + tokens * b for a, b in zip(offsets, slopes))


@dataclasses.dataclass
class Profile:
    """{depth: peak_line} at two small depths, for the model and (language) with a SMALL_VOCAB vocabulary."""
    model: dict
    small_vocabulary: dict | None
    precision: str  # the dtype the measurement ran in: "bf16 autocast" | "fp16 autocast" | "fp32"
    tokens_per_sample: int | None  # a vision model's 1 + patches; None: a language model's seq_len
    loss_chunk: int | None = None  # tokens per chunk of a language model's loss (alternet.loss_chunk_tokens)

    def activations(self, tokens: int, depth: int) -> float:
        """Linear in the depth through the peaks at the measured depths."""
        lines = sorted((self.small_vocabulary or self.model).items())  # one depth where L <= 2
        (d1, line1), (d2, line2) = lines[0], lines[-1]
        at1, at2 = line1(tokens), line2(tokens)
        return max(0.0, at1 + (at2 - at1) * (depth - d1) / (d2 - d1 or 1))

    def loss(self, tokens: int, depth: int) -> float:
        """What grows with the vocabulary, for one chunk of min(tokens, C) tokens, the most of the measured
        depths (a chunk is freed before the next is decoded). 0 for a vision model: its logits are tiny."""
        if self.small_vocabulary is None:
            return 0.0
        n = min(tokens, self.loss_chunk)
        return max(0.0, *(self.model[d](n) - self.small_vocabulary[d](n) for d in self.model))


AUTOCAST_NAMES = {torch.bfloat16: "bf16 autocast", torch.float16: "fp16 autocast"}
SMALL_VOCAB = 16  # the loss is what a measurement loses when the vocabulary shrinks to this
_PROFILES: dict = {}


def measure(config, device: torch.device, dtype, seq_len: int | None = None) -> Profile:
    """The Profile of `config` on `device` under `dtype` autocast: language, one sequence of T/2 and of T
    tokens, T = min(16, seq_len, C) (at least 2); vision, 1 and 2 images; depths min(L, 2), min(L, 3).
    Cached; the RNGs are left as they were."""
    language = is_language(config)
    chunk = alternet.loss_chunk_tokens(config.vocab_size) if language else None
    length = max(2, min(16, seq_len or config.seq_len, chunk)) if language else config.num_patches + 1
    key = (repr(config), str(device), dtype, length, chunk)
    if key not in _PROFILES:
        shapes = [(1, max(1, length // 2)), (1, length)] if language else [(1, length), (2, length)]
        variants = {"model": {}, **({"small_vocabulary": {"vocab_size": SMALL_VOCAB}} if language else {})}
        lines = {name: {} for name in variants}
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for depth in sorted({min(2, depth_of(config)), min(3, depth_of(config))}):
                for name, changes in variants.items():
                    model = reduced_model(config, device, depth, **changes)
                    runs = [(b * t, step_timeline(model, b, t, device, dtype)) for b, t in shapes]
                    lines[name][depth] = peak_line(*runs[0], *runs[1])
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
        parts = dict(weights=self.weights, grads=self.grads, AdamW=self.optimizer,
                     activations=self.activations, loss=self.loss)
        shape = f"{self.batch} x {self.seq_len}" if self.seq_len else f"{self.batch}"
        sizes = ", ".join(f"{name} {value / GB:.2f}" for name, value in parts.items())
        return (f"~{self.total / GB:.1f} GB peak per device ({sizes}; {self.precision}, batch {shape} over "
                f"{self.devices} device(s) x accum {self.grad_accum} = micro-batch {self.micro_batch})")


def estimate(model: nn.Module, profile: Profile, batch: int, seq_len: int | None, devices: int = 1,
             grad_accum: int = 1) -> Memory:
    """The peak per device of `model` trained at `batch` per optimizer step; `profile` from measure()."""
    seq_len = seq_len if profile.tokens_per_sample is None else None  # None: images
    tokens = batch // (devices * grad_accum) * (seq_len or profile.tokens_per_sample)
    depth = depth_of(model.config)
    return Memory(**model_bytes(model, devices), activations=profile.activations(tokens, depth),
                  loss=profile.loss(tokens, depth), precision=profile.precision, batch=batch, seq_len=seq_len,
                  devices=devices, grad_accum=grad_accum)


def device_memory_gb(device: torch.device) -> float | None:
    """A GPU's memory in GB; a CPU's: the RAM shared by its local ranks (None where the OS does not say)."""
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
    """The estimate at grad_accum, or (None) at the fewest micro-steps whose peak fits USABLE x budget_gb;
    ValueError naming what would fit otherwise."""
    for accum in [grad_accum] if grad_accum else accumulations(batch, devices):
        memory = estimate(model, profile, batch, seq_len, devices, accum)
        if memory.total <= USABLE * budget_gb * GB:
            return memory
    needs = estimate(model, profile, batch, seq_len, devices, grad_accum or 1).line()
    hints = " or ".join(how_to_fit(model, profile, batch, seq_len, devices, budget_gb, grad_accum))
    raise ValueError(f"needs {needs}, more than {USABLE:.0%} of {budget_gb:g} GB; "
                     f"{'to fit: ' + hints if hints else 'no accumulation, GPU count or context fits'}")


def how_to_fit(model: nn.Module, profile: Profile, batch: int, seq_len: int | None, devices: int,
               budget_gb: float, grad_accum: int | None) -> list[str]:
    """The changes that make a run fit: more accumulation, more GPUs (DDP), a shorter context."""
    usable, hints = USABLE * budget_gb * GB, []
    counted = sum(model_bytes(model, devices).values())
    if counted > usable:
        hints.append(f"a smaller model (weights, gradients and AdamW state alone take {counted / GB:.1f} GB)")
    more = (estimate(model, profile, batch, seq_len, devices, a) for a in accumulations(batch, devices)
            if a > (grad_accum or 1))
    fitting = next((m for m in more if m.total <= usable), None)
    if grad_accum and fitting:
        hints.append(f"--grad-accum {fitting.grad_accum} ({fitting.total / GB:.1f} GB)")
    for gpus in (2, 4, 8, 16, 32, 64):
        if gpus > devices and batch % (gpus * (grad_accum or 1)) == 0:
            memory = estimate(model, profile, batch, seq_len, gpus, grad_accum or 1)
            if memory.total <= usable:
                hints.append(f"{gpus} GPUs (torchrun --nproc_per_node {gpus}: {memory.total / GB:.1f} GB "
                             "each)")
                break
    while seq_len and seq_len > 16:
        seq_len //= 2
        memory = min((estimate(model, profile, batch, seq_len, devices, a)
                      for a in accumulations(batch, devices)), key=lambda m: (m.total > usable, m.grad_accum))
        if memory.total <= usable:
            hints.append(f"a shorter context: --block-size {seq_len} (accum {memory.grad_accum}, "
                         f"{memory.total / GB:.1f} GB)")
            break
    return hints


# --- inference memory on a CPU: peak RSS in a fresh process (bench.py latency) ---
#
# On a CPU only the process's resident set says what a model holds, and a process's freed heap stays
# resident: so each model is measured in a fresh process (`python -m lib.memory rss SPEC`), as the growth
# of VmHWM after the model is built. Linux only (/proc); elsewhere a row says so.


def cpu_memory_of(specs: list[dict], batch: int, calls: int = 2, processes: int = 2) -> list[dict]:
    """Peak RSS of each model (spec: its config dict and fold), in `processes` fresh processes
    each: the smallest is reported (fragmentation only adds), all are kept."""
    if not os.path.exists("/proc/self/clear_refs"):  # what _memory_worker measures with
        return [{"memory_error": "peak RSS is measured on Linux only (/proc)"}] * len(specs)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: `-m lib.memory`
    results = []
    for spec in specs:
        payload = json.dumps({**spec, "batch": batch, "calls": calls})
        runs = [subprocess.run([sys.executable, "-m", "lib.memory", "rss", payload], capture_output=True,
                               text=True, cwd=root, timeout=900) for _ in range(processes)]
        failed = [(run.stderr.strip().splitlines() or ["the measuring process died"])[-1]
                  for run in runs if run.returncode != 0]
        if failed:
            results.append({"memory_error": failed[0]})
            continue
        values = [json.loads(run.stdout.strip().splitlines()[-1]) for run in runs]
        results.append({"memory_mib": min(values), "memory_mib_all": values,
                        "memory_method": f"fresh process: peak VmHWM - RSS before the model (incl. weights), "
                                         f"min over {processes} processes"})
    return results


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def folded_config(config: revit.ViTConfig) -> revit.ViTConfig:
    """The config of the plain ViT that revit.fold(model) returns at the model's own depth."""
    return dataclasses.replace(config, arch="vit", depth_drop=0.0, raptor_blocks=1)


def _memory_worker(spec: dict) -> float:
    """RSS before the model, then the peak over its forward calls; the input is allocated first (not
    counted), the peak reset once the model is built (construction temporaries do not count)."""
    torch.manual_seed(0)
    torch.set_num_threads(1)  # one heap arena: multi-threaded allocation made peaks vary by 30%
    c = revit.ViTConfig(**spec["config"])
    images = torch.randn(spec["batch"], c.in_channels, c.image_size, c.image_size)
    # Prime the runtime (thread pool, kernel libraries, lazily loaded code) with a narrow, 2-step
    # model of the same family on the same input, so their one-off RSS is not charged to the row.
    primer = revit.build_model(dataclasses.replace(c, dim=8 * c.heads, ffn_dim=16 * c.heads, depth=2,
                                                   raptor_blocks=1)).eval()
    with torch.inference_mode():
        primer(images)
    del primer
    gc.collect()
    before = _rss_kib("VmRSS")
    if spec["fold"]:
        # the plain ViT revit.fold builds (same shapes; values do not change memory): folding a real
        # reViT here would leave its freed heap in the RSS baseline
        model = revit.VisionTransformer(folded_config(c)).eval()
    else:
        model = revit.build_model(c).eval()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    with torch.inference_mode():
        for _ in range(spec["calls"]):
            model(images)
    return (_rss_kib("VmHWM") - before) / 1024  # MiB


# --- train.py's plan: a run's peak memory per device and the --grad-accum that fits it ---

GPT2_VOCAB = 50257  # GPT-2's BPE (language.tokenize): known before tiktoken loads


def fit_run(cfg, model: nn.Module | None, device, world: int, ckpt: dict | None,
            skip_below: int = 0) -> None:
    """cfg.grad_accum None becomes the fewest micro-steps whose peak per device fits (an `override:` line), a
    given one is checked; then one `memory:` line, or one error line saying what would fit. Skipped below
    `skip_below` parameters; only said where the OS does not tell its RAM. model None: the language model
    of cfg (or ckpt), built on the meta device."""
    auto, cfg.grad_accum = cfg.grad_accum is None, cfg.grad_accum or 1
    if model is None:
        vocab = {"vocab_size": GPT2_VOCAB} if cfg.tokenizer == "gpt2" else {}
        overrides = ckpt["model_config"] if ckpt else {**vocab, **model_overrides(cfg)}
        try:
            with torch.device("meta"):
                model = alternet.create_model(cfg.arch, **overrides)
        except (ValueError, TypeError):
            return  # build() reports a bad --model-args in one line
    if sum(p.numel() for p in model.parameters()) < skip_below:
        return
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
    print(json.dumps(_memory_worker(json.loads(sys.argv[2]))))
