"""bench.py: the numbers a user compares, for reViT (arXiv 2610.12448) against its baselines.

    python bench.py params      # parameters and GFLOPs/image at S/B/L 224² (paper Tables 1 and 10)
    python bench.py latency     # inference latency and memory, the protocol of the paper's Table 7
    python bench.py train       # training-step throughput (img/s) and MFU
    python bench.py check       # the first minutes on a GPU within --budget: Table 7, training, tests, a run
    python bench.py memory --arch alternet-50m   # peak memory per GPU of a training recipe, before the run

Each prints markdown tables, then its results as one JSON line (--out: also to a file). CUDA when present
(torch.compile, bf16: the paper's setting), else the CPU (fp32, smaller sizes). Rows are timed interleaved
round-robin, so background load hits every row alike; "vs DeiT III" is the median per-round ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import itertools
import json
import math
import os
import platform
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import alternet
import revit
import train
from lib import budget, data, memory, moe  # moe: the comparison mechanisms (§4.3, App. B)
from lib.boundary import check_numbers, fail, output_problem
from lib.cli import (DEVICES, PRECISIONS, ArgumentParser, f, git_commit, json_text, markdown, pick_device,
                     run_main, write_json)

HERE = os.path.dirname(os.path.abspath(__file__))

# --- the paper's cells (Table 1: params M, GFLOPs/image; Table 10: LoRA-S r=64) ---

PAPER_TABLE1 = {
    "vit-s": (22.1, 8.5), "raptor-s": (7.9, 8.5), "revit-s": (6.1, 8.6),
    "vit-b": (86.6, 33.9), "raptor-b": (29.9, 33.9), "revit-b": (23.6, 34.3),
    "vit-l": (304.4, 119.9), "raptor-l": (52.4, 119.9), "revit-l": (40.9, 121.5),
}
PAPER_TABLE10 = {  # compact params (M), GFLOPs online, GFLOPs folded
    "vit-s": (22.1, 8.5, 8.5), "lora-s": (7.3, 10.4, 8.5), "revit-s": (6.1, 8.6, 8.5),
}
LORA_RANK = 64  # Table 10: rank-64 updates on qkv, attention out, fc1, fc2 at each of the L depths
TABLE_NAMES = {"vit": "DeiT III", "raptor": "Raptor k=4", "revit": "reViT E=4"}

# Dense bf16 tensor-core peaks (FLOP/s) for MFU; the first substring of the device name that matches wins.
PEAK_BF16_FLOPS = [("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12),
                   ("A100", 312e12), ("L40S", 362e12), ("L4", 121e12)]

# --- device, environment, timing ---


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast(device: torch.device):
    """bf16 autocast on CUDA (the paper's setting); CPU stays in fp32."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def environment(device: torch.device) -> dict:
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "python": platform.python_version(), "device": str(device),
           "cpu": cpu_model_name(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    commit = git_commit(HERE) or recorded_commit(HERE)
    if commit:
        env["git"] = commit
    return env


def cpu_model_name() -> str:
    names = []
    with contextlib.suppress(OSError, UnicodeDecodeError), open("/proc/cpuinfo") as fh:  # Linux
        names = [line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")]
    return (names or [platform.processor() or "unknown"])[0]


def recorded_commit(folder: str) -> str | None:
    """The commit in folder/.commit (git-ignored): a copy of the working tree run where there is no git."""
    with contextlib.suppress(OSError, UnicodeDecodeError), open(os.path.join(folder, ".commit")) as fh:
        text = fh.read(200).strip()
        if re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?", text):
            return f"{text} (from .commit)"
    return None


def peak_of(gpu_name: str) -> float | None:
    """A GPU's dense bf16 peak by its name; None where unknown (a CPU's: SKU, clocks, sharing; no guess)."""
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in gpu_name), None)


def quartiles(values: list[float]) -> tuple:
    if len(values) == 1:
        return (values[0],) * 3
    return tuple(statistics.quantiles(values, n=4, method="inclusive"))


def summary(seconds: list[float]) -> dict:
    ms = sorted(1e3 * s for s in seconds)
    q1, _, q3 = quartiles(ms)
    return {"median_ms": statistics.median(ms), "q1_ms": q1, "q3_ms": q3, "min_ms": ms[0], "max_ms": ms[-1],
            "repeats": len(ms)}


def paired_ratio(times: list[float], reference: list[float], target: float = 0.03) -> dict:
    """The per-round ratios (both rows timed in the same round, under the same load): their median, IQR and
    a 95% percentile-bootstrap interval of the median (ratio_pm: its half-width); repeats_needed: rounds
    for an interval of +-target, from the 1/sqrt(n) shrinking of its width."""
    ratios = [a / b for a, b in zip(times, reference)]
    q1, _, q3 = quartiles(ratios)
    rng, resamples = random.Random(0), 2000  # seeded: the same data give the same interval
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    low, high = medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]
    half = (high - low) / 2
    needed = math.ceil(len(ratios) * (half / target) ** 2) if half > 0 else len(ratios)
    return {"ratio": statistics.median(ratios), "ratio_q1": q1, "ratio_q3": q3, "ratio_ci95": [low, high],
            "ratio_pm": half, "repeats": len(ratios), "repeats_needed": max(needed, 2)}


def compiled_graphs() -> int:
    """How many graphs torch.compile has built so far in this process (0 before any compile)."""
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    return dynamo_utils.counters["stats"]["unique_graphs"] if dynamo_utils else 0


def time_interleaved(fns: dict, device: torch.device, warmup: int, repeats: int, iters: int) -> dict:
    """Seconds per call of each fn, `repeats` values each, after at least `warmup` rounds (and one), more (up
    to 10) until a round compiles no new graph (torch.compile can recompile on the 2nd or 3rd call)."""
    for round_ in range(max(warmup, 1) + 10):
        before = compiled_graphs()
        for fn in fns.values():
            fn()
        if round_ + 1 >= warmup and compiled_graphs() == before:
            break
    synchronize(device)
    return timed_rounds(fns, device, repeats, iters)


def timed_rounds(fns: dict, device: torch.device, repeats: int, iters: int, first: int = 0,
                 times: dict | None = None) -> dict:
    """Round r (from `first`) times `iters` calls of each fn, from a rotated position, synced once, without
    garbage collection; appended to `times`. "recompiled": the rows whose timed regions compiled something."""
    labels = list(fns)
    times = times or {label: [] for label in labels}
    recompiled = set(times.pop("recompiled", []))
    gc.collect()
    gc.disable()
    try:
        for r in range(first, first + repeats):
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                fn, graphs = fns[label], compiled_graphs()
                start = time.perf_counter()
                for _ in range(iters):
                    fn()
                synchronize(device)
                times[label].append((time.perf_counter() - start) / iters)
                if compiled_graphs() != graphs:
                    recompiled.add(label)
    finally:
        gc.enable()
    times["recompiled"] = sorted(recompiled)
    return times


def resolve_ratio(fns, times, device, iters, target, max_repeats, pair=("reViT fixed", "DeiT III")) -> dict:
    """More interleaved rounds until pair[0] / pair[1] is known to +- target, or max_repeats rounds in all."""
    if not target or not all(label in fns for label in pair):
        return times
    while True:
        done = len(times[pair[1]])
        ratio = paired_ratio(times[pair[0]], times[pair[1]], target)
        if ratio["ratio_pm"] <= target or done >= max_repeats:
            return times
        more = min(max_repeats - done, max(ratio["repeats_needed"] - done, 2))
        times = timed_rounds(fns, device, more, iters, first=done, times=times)


def time_rows(labels, build, batch: int, device, warmup: int, repeats: int, iters: int, first: str,
              reference="DeiT III", on_row=None, resolve=None, max_repeats=0) -> tuple:
    """(rows, times): build(label) -> (model, one call, the row's fields); each call runs once (first_call;
    then on_row(label, row, False)), then all are timed together (resolve: see resolve_ratio)."""
    fns, rows = {}, {}
    for label in labels:
        model, fns[label], fields = build(label)
        rows[label] = {"model": label, "batch": batch, **fields}
        rows[label].update(first_call(fns[label], model, device, first))
        if on_row:
            on_row(label, rows[label], False)
    times = time_interleaved(fns, device, warmup, repeats, iters)
    times = resolve_ratio(fns, times, device, iters, resolve, max_repeats)
    for label, row in rows.items():
        row.update({**summary(times[label]), **paired_ratio(times[label], times[reference]),
                    "recompiled_while_timed": label in times["recompiled"]})
        row["images_per_s"] = 1e3 * batch / row["median_ms"]
    return list(rows.values()), times


def maybe_compile(model, compiled: bool, dynamic: bool | None = False, mode: str | None = None,
                  backend: str = "inductor"):
    """torch.compile(model) when asked. dynamic=False: static shapes (inference at fixed batches); None:
    torch's automatic dynamic shapes. mode "reduce-overhead": CUDA graphs."""
    if not compiled:
        return model
    import torch._dynamo.config as dynamo_config
    # one compiled variant per (model, batch size): more than dynamo's default cache allows per code object
    dynamo_config.recompile_limit = max(64, dynamo_config.recompile_limit)
    return torch.compile(model, dynamic=dynamic, mode=mode, backend=backend)


def first_call(fn, model, device, key: str) -> dict:
    """Run fn once: its wall time (compilation included) under `key`; on CUDA the runtime memory as in the
    paper's Table 7: the weights, what this call left allocated (reViT's merged-weight cache, optimizer
    state) and the peak of one more call (activations, workspace), not compile-time autotuning buffers."""
    cuda = device.type == "cuda"
    for dtype in (torch.float32, torch.bfloat16) if cuda else ():  # cuBLAS's workspace: not the row's
        torch.ones(64, 64, device=device, dtype=dtype) @ torch.ones(64, 64, device=device, dtype=dtype)
    synchronize(device)
    allocated, start = torch.cuda.memory_allocated(device) if cuda else 0, time.perf_counter()
    fn()
    synchronize(device)
    out = {key: time.perf_counter() - start}
    if not cuda:
        return out
    gc.collect()
    torch.cuda.empty_cache()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    now = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    synchronize(device)
    peak = weights + (now - allocated) + torch.cuda.max_memory_allocated(device) - now
    return {**out, "memory_mib": peak / 2 ** 20, "memory_method": "CUDA: weights + left allocated by the "
            "first call + max_memory_allocated growth over a second call"}


# --- counting parameters and FLOPs (the rule that reproduces the paper's Tables 1 and 10) ---


def expert_params(dim: int, hidden: int) -> int:
    """P_FFN(d, r) = 2 r d^2 + (r + 1) d (paper App. A.5), with hidden = r d: one FFN's weights and biases."""
    return 2 * dim * hidden + hidden + dim


def analytic_macs(config: revit.ViTConfig, extra_tokens: int = 0, online: bool = True,
                  lora_rank: int = 0) -> dict:
    """Multiply-adds per image of the linear layers, by the paper's rule, over T = N + 1 (+ extra_tokens)
    tokens: per step qkv 3d^2, out-projection d^2 and FFN 2 d d_ff per token; the patch embedding and the
    head. online: reViT's per-step merge of E experts (E * P, Eq. 2, shared by the batch); folded weights
    cost nothing per image. lora_rank: layer-wise LoRA online on qkv, out, fc1, fc2 (r (d_in + d_out))."""
    c = config
    tokens = c.num_patches + 1 + extra_tokens
    d, hidden = c.dim, c.ffn_dim
    macs = {"patch_embed": c.num_patches * c.in_channels * c.patch_size ** 2 * d,
            "attention_linear": c.depth * tokens * 4 * d * d,
            "ffn": c.depth * tokens * 2 * d * hidden,
            "head": d * c.num_classes,
            "merge": 0, "lora": 0}
    if online and c.arch == "revit" and c.num_experts > 1:
        macs["merge"] = c.depth * c.num_experts * expert_params(d, hidden)
    if online and lora_rank:
        macs["lora"] = c.depth * tokens * lora_params_per_token(c, lora_rank)
    macs["total"] = sum(macs.values())
    return macs


def lora_params_per_token(config, rank: int) -> int:
    """One depth's rank-r LoRA factors on qkv (d -> 3d), out (d -> d), fc1 and fc2 (d <-> d_ff)."""
    d, hidden = config.dim, config.ffn_dim
    return rank * ((d + 3 * d) + (d + d) + 2 * (d + hidden))


def counted_flops(model: torch.nn.Module, depth: int | None = None) -> dict:
    """torch.utils.flop_counter on one batch-1 forward (at `depth`) on the model's device (meta: free): total
    = linear layers and merge (the paper's rule) + attention products + router + other. Gradients stay on:
    the counter's module tracker trips over parameter views made under no_grad (LoRA)."""
    c = model.config
    device = next(model.parameters()).device
    images = torch.zeros(1, c.in_channels, c.image_size, c.image_size, device=device)
    counter = FlopCounterMode(display=False)
    # the counter has no formula for the CPU flash-attention kernel; the math backend is plain matmuls
    with counter, sdpa_kernel(SDPBackend.MATH):
        model(images) if depth is None else model(images, depth=depth)
    by_module = counter.get_flop_counts()
    # the score and value products: SDPA, or the batched matmuls it decomposes into (meta device)
    attention = sum(n for k in by_module if k.endswith(".attn") for op, n in by_module[k].items()
                    if "scaled_dot_product" in str(op) or str(op).endswith(".bmm"))
    router = sum(n for k in by_module if k.endswith(".router") for n in by_module[k].values())
    return {"total": counter.get_total_flops(), "attention": attention, "router": router,
            "by_op": {str(op): n for op, n in by_module.get("Global", {}).items()}}


def count_preset(name: str, **overrides) -> tuple:
    """(model, counted_flops) of a preset counted online (reViT merges every call): on the meta device,
    or on the CPU where the forward needs real data (token dispatch sorts and splits tokens)."""
    if moe.PRESETS[name].get("arch") == "revit":
        overrides.setdefault("merge_cache", False)
    try:
        with torch.device("meta"):
            model = moe.create_model(name, **overrides).eval()
        return model, counted_flops(model)
    except Exception:  # noqa: BLE001 - any failure on meta: count on a real CPU module instead
        model = moe.create_model(name, **overrides).eval()
        return model, counted_flops(model)


def token_dispatch_presets(size: str = "s") -> list[str]:
    """The paper's token-dispatch expert mechanisms (§4.3, App. B) at U = 1 (e.g. revit-s-qwen3-u1)."""
    return sorted(n for n in moe.PRESETS if n.startswith(f"revit-{size}-") and n.endswith("-u1")
                  and any(k in n for k in ("deepseek", "qwen3", "moeut")))


def bench_params(with_counter: bool = True) -> dict:
    """Table 1 rows at S/B/L, then Table 10 at S: params, analytic GFLOPs, counter GFLOPs."""
    rows = []
    for size, arch in itertools.product("sbl", TABLE_NAMES):
        name = f"{arch}-{size}"
        with torch.device("meta"):
            model = revit.create_model(name)
        c = model.config
        ours, paper_rule = analytic_macs(c), analytic_macs(c, extra_tokens=1)
        paper = PAPER_TABLE1.get(name, (None, None))
        row = {"table": "1", "name": name, "model": f"{TABLE_NAMES[arch]}-{size.upper()}",
               "params_m": model.num_params() / 1e6, "paper_params_m": paper[0],
               "gflops": 2 * ours["total"] / 1e9, "gflops_t198": 2 * paper_rule["total"] / 1e9,
               "gflops_folded": 2 * analytic_macs(c, online=False)["total"] / 1e9,
               "paper_gflops": paper[1], "macs": ours, "tokens": c.num_patches + 1}
        if with_counter:
            row.update(counter_columns(count_preset(name)[1], ours))
        rows.append(row)
    return {"rows": rows + table10_rows()}


def counter_columns(counted: dict, ours: dict) -> dict:
    linear = counted["total"] - counted["attention"] - counted["router"]
    return {"counter_gflops": counted["total"] / 1e9, "counter_linear_gflops": linear / 1e9,
            "counter_attention_gflops": counted["attention"] / 1e9, "counter_router_flops": counted["router"],
            # what the forward computes beyond the counting rule, router and attention (reViT: aux losses)
            "counter_other_flops": linear - 2 * ours["total"], "counter_by_op": counted["by_op"]}


def table10_rows() -> list[dict]:
    """Table 10 at S: DeiT III, tied block + layer-wise LoRA r=64 (the E = 1 reViT plus L rank-r sets:
    analytic, and the module's own count), reViT."""
    with torch.device("meta"):
        vit_s, revit_s, tied = (revit.create_model(n) for n in ("vit-s", "revit-s", "revit-s-e1"))
        lora_module = moe.create_model("revit-s-lora").num_params()
    c = revit_s.config
    shared, adapters = tied.num_params(), c.depth * lora_params_per_token(c, LORA_RANK)
    folded = analytic_macs(c, 1, online=False)  # 12 dense depth-specific FFNs: the DeiT III count
    rows = []
    for key, label, params, online in [
            ("vit-s", "DeiT III-S/16", vit_s.num_params(), analytic_macs(vit_s.config, 1)),
            ("lora-s", f"Tied ViT-S/16 + LoRA r={LORA_RANK}", lora_module,
             analytic_macs(vit_s.config, 1, lora_rank=LORA_RANK)),
            ("revit-s", "reViT-S/16 E=4", revit_s.num_params(), analytic_macs(c, 1))]:
        paper = PAPER_TABLE10[key]
        row = {"table": "10", "name": key, "model": label, "params_m": params / 1e6,
               "paper_params_m": paper[0], "gflops_online_t198": 2 * online["total"] / 1e9,
               "gflops_folded_t198": 2 * folded["total"] / 1e9,
               "paper_gflops_online": paper[1], "paper_gflops_folded": paper[2]}
        if key == "lora-s":
            row.update(lora_shared_m=shared / 1e6, lora_adapters_m=adapters / 1e6)
        rows.append(row)
    return rows


# --- latency and memory (paper Table 7) ---

LATENCY_MODELS = {  # label -> (arch, overrides, folded): DeiT III and reViT in three deployment forms (§3.1)
    "DeiT III": ("vit", {}, False), "reViT dynamic": ("revit", {"merge_cache": False}, False),
    "reViT cached": ("revit", {}, False), "reViT folded": ("revit", {}, True),
}


def latency_models(size: str, **model_args) -> dict:
    """LATENCY_MODELS, the reViT forms sharing one set of weights. dynamic: each step's merged FFN rebuilt at
    every call (as the paper measured); cached: built once and reused; folded: revit.fold, a plain ViT."""
    torch.manual_seed(0)
    deit = revit.create_model(f"vit-{size}", **model_args)
    cached = revit.create_model(f"revit-{size}", **model_args)
    dynamic = revit.create_model(f"revit-{size}", **model_args, merge_cache=False)
    dynamic.load_state_dict(cached.state_dict())
    return {"DeiT III": deit, "reViT dynamic": dynamic, "reViT cached": cached,
            "reViT folded": revit.fold(cached)}


def bench_latency(size="s", batches=(1, 8), modes=("eager",), device="cpu", warmup=2, repeats=7, iters=1,
                  memory=True, dtype="float32", backend="inductor", on_row=None, model_args=None) -> dict:
    """modes: eager, compiled, reduce-overhead (compiled with CUDA graphs: batch 1 is launch-bound without
    them). dtype: the weights and images, cast once (bfloat16 on CUDA: no per-call cast under autocast).
    on_row: see time_rows. model_args: config overrides of every model (bench.py check's tiny sizes)."""
    device, weights = torch.device(device), getattr(torch, dtype)
    rows = []
    for mode, batch in itertools.product(modes, batches):
        models = latency_models(size, **(model_args or {}))  # fresh: each first call builds its caches
        c = models["DeiT III"].config
        images = torch.randn(batch, c.in_channels, c.image_size, c.image_size, device=device, dtype=weights)

        def build(label):
            model = models[label].to(device, weights).eval()
            run = maybe_compile(model, mode != "eager", mode=None if mode == "compiled" else mode,
                                backend=backend)
            fields = {"mode": mode, "image_size": c.image_size, "params_m": model.num_params() / 1e6}
            return model, inference_call(run, images, device, mixed=weights == torch.float32), fields
        group, _ = time_rows(models, build, batch, device, warmup, repeats, iters, "first_call_s",
                             on_row=on_row)
        for row in group:  # group[0]: DeiT III at this mode and batch
            if memory and device.type == "cpu" and dtype == "float32":  # eagerly, in a fresh process
                row.update(cpu_memory(size, row["model"], batch))
                row["memory_method"] += "" if mode == "eager" else " (eager)"
            if "memory_mib" in row and "memory_mib" in group[0]:
                row["memory_ratio"] = row["memory_mib"] / group[0]["memory_mib"]
            if on_row:
                on_row(row["model"], row, True)
        rows += group
    return {"rows": rows}


def inference_call(run, images, device, mixed: bool = True):
    """run: a model, or any callable of the images (e.g. functools.partial(model, depth=6)). mixed: under
    autocast on CUDA (fp32 weights); False for weights already in bf16."""
    def call():
        with torch.inference_mode(), autocast(device) if mixed else contextlib.nullcontext():
            return run(images)
    return call


@functools.cache  # once for every mode
def cpu_memory(size: str, label: str, batch: int, calls: int = 2, processes: int = 2) -> dict:
    """Peak RSS of one latency row in a fresh process (lib/memory.cpu_memory_of)."""
    arch, overrides, fold = LATENCY_MODELS[label]
    config = dataclasses.asdict(revit.ViTConfig(**{**revit.PRESETS[f"{arch}-{size}"], **overrides}))
    return memory.cpu_memory_of([{"config": config, "fold": fold}], batch, calls, processes)[0]


# --- training step (img/s, MFU) ---


PAIRED = (  # bench_train's other paired ratios: (key, row, against, what it says)
    ("ratio_vs_fixed", "reViT elastic 0.3", "reViT fixed", "elastic 0.3 vs fixed depth"),
    ("ratio_vs_fixed_eager", "reViT elastic 0.3", "reViT fixed, eager",
     "elastic 0.3 vs fixed depth run eagerly (as elastic's loop)"),
    ("ratio_vs_eager", "AlterNet", "AlterNet eager", "AlterNet compiled vs eager"))


def train_models(size: str, compiled: bool = False) -> dict:
    """label -> (preset, overrides, compiled). Elastic depth runs its step loop eagerly (revit.py), so where
    the rows are compiled an eager fixed-depth row is added: against it, elastic depth's cost is the
    method's, not the missing compilation's."""
    rows = {"DeiT III": ("vit-" + size, {}, compiled), "reViT fixed": ("revit-" + size, {}, compiled),
            "reViT elastic 0.3": ("revit-" + size, {"depth_drop": 0.3}, compiled),
            **{name: (name, {}, compiled) for name in token_dispatch_presets(size)},
            # AlterNet (arXiv 2611.08741): the byte-level preset at every size, `batch` windows of its seq_len
            "AlterNet": ("alternet-tiny", {}, compiled)}
    if compiled:
        rows.update({"reViT fixed, eager": ("revit-" + size, {}, False),
                     "AlterNet eager": ("alternet-tiny", {}, False)})
    return rows


def forward_flops(name: str, overrides: dict) -> float:
    """Model FLOPs of one image's forward for MFU: the flop_counter total (linear, attention, merge, aux);
    elastic depth runs (1 - p) of the steps on average, so its recurrent part is scaled by that."""
    drop = overrides.get("depth_drop", 0.0)
    model, counted = count_preset(name, **{k: v for k, v in overrides.items() if k != "depth_drop"})
    macs = analytic_macs(model.config)
    fixed = 2 * (macs["patch_embed"] + macs["head"])
    return fixed + (1.0 - drop) * (counted["total"] - fixed)


def bench_train(size="s", batch=8, device="cpu", compiled=False, warmup=1, repeats=5, iters=1, peak=None,
                labels=None, resolve=None, max_repeats=200, backend="inductor", reference="DeiT III",
                on_row=None, model_args=None) -> dict:
    """Training-step time of the rows of train_models (labels: only these), timed together (time_rows)."""
    device = torch.device(device)
    specs = {k: (name, {**overrides, **({} if name in alternet.PRESETS else model_args or {})}, compile_row)
             for k, (name, overrides, compile_row) in train_models(size, compiled).items()
             if labels is None or k in labels}

    def build(label):
        name, overrides, compile_row = specs[label]
        torch.manual_seed(0)
        model, fn, flops = train_step(name, overrides, batch, device, compile_row, backend)
        return model, fn, {"preset": name, "overrides": overrides, "params_m": model.num_params() / 1e6,
                           "compiled": compile_row, "forward_gflops_per_image": flops / 1e9,
                           "reference": reference}
    rows, times = time_rows(specs, build, batch, device, warmup, repeats, iters, "first_step_s", reference,
                            on_row, resolve, max_repeats)
    by_label = {r["model"]: r for r in rows}
    for r in rows if peak else ():
        r["mfu"] = 3 * r["forward_gflops_per_image"] * 1e9 * batch / (r["median_ms"] / 1e3) / peak
    for key, row, versus, _ in PAIRED:
        if row in by_label and versus in by_label:
            by_label[row][key] = paired_ratio(times[row], times[versus])
    for row in rows if on_row else ():
        on_row(row["model"], row, True)
    return {"rows": rows}


def train_step(name, overrides, batch, device, compiled, backend) -> tuple:
    """(model, one optimizer step, forward FLOPs per example) of a preset as train.py trains it: reViT and
    its baselines on random images (task loss + the already-weighted aux losses); AlterNet on `batch` random
    windows of seq_len tokens, random_length_fraction of them cut short (fixed here), its own loss."""
    language = name in alternet.PRESETS
    model = (alternet if language else moe).create_model(name, **overrides).to(device).train()
    run, c = maybe_compile(model, compiled, dynamic=None, backend=backend), model.config
    if language:
        g = torch.Generator().manual_seed(0)
        windows = torch.randint(0, c.vocab_size, (batch, c.seq_len + 1), generator=g).to(device)
        lengths = alternet.training_lengths(batch, c.seq_len, c.random_length_fraction, g).to(device)
        loss = lambda: run(windows[:, :-1], targets=windows[:, 1:], lengths=lengths)["loss"]  # noqa: E731
        with FlopCounterMode(display=False) as counter:
            model(windows[:1, :-1], targets=windows[:1, 1:])
        return model, optimizer_step(model, loss, device), counter.get_total_flops()
    images = torch.randn(batch, c.in_channels, c.image_size, c.image_size, device=device)
    labels = torch.randint(0, max(c.num_classes, 1), (batch,), device=device)

    def loss():
        out = run(images, return_states=True)
        return F.cross_entropy(out["logits"].float(), labels) + sum(out["aux_losses"].values())
    return model, optimizer_step(model, loss, device), forward_flops(name, overrides)


def optimizer_step(model, loss, device):
    """One optimizer step as train.py takes it: AdamW, then train.after_optimizer_step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05, fused=device.type == "cuda")
    step = [0]

    def call():
        if hasattr(model, "set_step"):
            model.set_step(step[0])
        with autocast(device):
            value = loss()
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        optimizer.step()
        train.after_optimizer_step(model)
        step[0] += 1
    return call


# --- targets: ours, against the paper's Table 7 (dynamic 1.13x / 1.39x latency, 0.52x memory) ---


def latency_targets(rows: list[dict]) -> list[dict]:
    """cached <= 1.03x at every batch; folded 1.00x within noise; dynamic <= 1.10x at the largest batch;
    dynamic memory at batch 1 <= 0.55x (the compact deployment the paper measured)."""
    out, largest = [], max((r["batch"] for r in rows), default=0)
    for r in rows:
        name, tag = r["model"], f"{r['mode']}, batch {r['batch']}"
        noise = max(0.02, (r["ratio_q3"] - r["ratio_q1"]) / 2)
        if name == "reViT cached":
            out.append(target(f"reViT cached <= 1.03x DeiT III ({tag})", r["ratio"], r["ratio"] <= 1.03))
        if name == "reViT folded":
            out.append(target(f"reViT folded = 1.00x +- noise {noise:.2f} ({tag})", r["ratio"],
                              abs(r["ratio"] - 1.0) <= noise))
        if name == "reViT dynamic" and r["batch"] == largest > 1:
            out.append(target(f"reViT dynamic <= 1.10x DeiT III ({tag})", r["ratio"], r["ratio"] <= 1.10))
        first_mode = r["mode"] == rows[0]["mode"]
        if name == "reViT dynamic" and r["batch"] == 1 and "memory_ratio" in r and first_mode:
            out.append(target("reViT dynamic memory <= 0.55x DeiT III (batch 1)", r["memory_ratio"],
                              r["memory_ratio"] <= 0.55))
    return out


def train_targets(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        if r["model"] == "reViT fixed":
            out.append(target("train step reViT fixed <= 1.10x DeiT III", r["ratio"], r["ratio"] <= 1.10))
        for key, how in (("ratio_vs_fixed", ""), ("ratio_vs_fixed_eager", ", eager")):  # its loop is eager
            if r["model"] == "reViT elastic 0.3" and key in r:
                ratio = r[key]["ratio"]
                out.append(target(f"train step elastic 0.3 <= fixed depth{how}", ratio, ratio <= 1.0))
    return out


def target(text, value, ok):
    return {"target": text, "value": value, "met": bool(ok)}


# --- output ---


def params_markdown(result: dict) -> str:
    rows = result["rows"]
    out = ["## Parameters and GFLOPs/image, 224², 1000 classes, batch 1 (paper Table 1)\n", markdown(
        [r for r in rows if r["table"] == "1"], [
            ("model", f("model", "{}")), ("params (M)", f("params_m")), ("paper", f("paper_params_m", "{}")),
            ("GFLOPs T=197", f("gflops")), ("GFLOPs T=198", f("gflops_t198")),
            ("paper", f("paper_gflops", "{}")), ("folded", f("gflops_folded")),
            ("flop_counter linear+merge", f("counter_linear_gflops", "{:.3f}")),
            ("+ attention", f("counter_attention_gflops", "{:.3f}")), ("+ router + other (MFLOPs)",
             lambda r: f"{r['counter_router_flops'] / 1e6:.3f} + {r['counter_other_flops'] / 1e6:.1f}"),
            ("= flop_counter total", f("counter_gflops", "{:.3f}"))])]
    out += ["\n## Depth-specific parameterizations at S/16 (paper Table 10), GFLOPs with T=198\n", markdown(
        [r for r in rows if r["table"] == "10"], [
            ("model", f("model", "{}")), ("compact params (M)", f("params_m")),
            ("paper", f("paper_params_m", "{}")),
            ("GFLOPs online / folded",
             lambda r: f"{r['gflops_online_t198']:.2f} / {r['gflops_folded_t198']:.2f}"),
            ("paper", lambda r: f"{r['paper_gflops_online']} / {r['paper_gflops_folded']}")])]
    lora = next(r for r in rows if r["name"] == "lora-s")
    out.append(f"\nLoRA-S: shared model {lora['lora_shared_m']:.2f}M + adapters {lora['lora_adapters_m']:.2f}"
               f"M (paper 2.53M + 4.72M; the module's count: {lora['params_m']:.2f}M).")
    return "\n".join(out + [COUNTING_NOTE])


COUNTING_NOTE = (
    "\nCounting rule (ours; it reproduces every GFLOPs cell of Tables 1 and 10 over T=198 tokens, one more "
    "than our 196 patches + class token): 2 FLOPs per multiply-add of the linear layers, patch embedding and "
    "head; attention products not counted; reViT's merge (Eq. 2) as E*P multiply-adds per step (counted as "
    "FLOPs, reViT-B/L would be 34.1/120.7). flop_counter equals the T=197 count once the attention products, "
    "the router and reViT's diversity loss (2 E^2 P FLOPs, 'other') are set aside. reViT-B/L count "
    "22.8M/39.8M params, not the paper's 23.6/40.9: the architecture as described has no room for more "
    "(RESULTS.md).")

# The columns of a latency row and of a training-step row, in `bench.py latency | train` and in check.md
LATENCY_COLUMNS = [
    ("params (M)", f("params_m")), ("latency ms (median)", f("median_ms")),
    ("IQR", lambda r: f"{r['q1_ms']:.2f}–{r['q3_ms']:.2f}"),
    ("min–max", lambda r: f"{r['min_ms']:.2f}–{r['max_ms']:.2f}"),
    ("vs DeiT III", lambda r: f"{r['ratio']:.3f} ({r['ratio_q1']:.3f}–{r['ratio_q3']:.3f})"),
    ("img/s", f("images_per_s", "{:.1f}")), ("memory (MiB)", f("memory_mib", "{:.1f}")),
    ("mem vs DeiT", f("memory_ratio", "{:.2f}")), ("1st call s", f("first_call_s", "{:.1f}"))]
TRAIN_COLUMNS = [
    ("params (M)", f("params_m")), ("step ms (median)", f("median_ms")),
    ("IQR", lambda r: f"{r['q1_ms']:.1f}–{r['q3_ms']:.1f}"),
    ("vs (95% CI)", lambda r: f"{r['reference']}: {ratio_text(r)}"),
    ("img/s", f("images_per_s", "{:.1f}")), ("fwd GFLOPs/img", f("forward_gflops_per_image")),
    ("MFU", lambda r: f"{100 * r['mfu']:.1f}%" if "mfu" in r else "unknown"),
    ("memory (MiB)", f("memory_mib", "{:.0f}")), ("1st step s", f("first_step_s", "{:.1f}"))]
NOTES = {
    "latency": "vs DeiT III: median (IQR) over repeats of the per-round ratio, both timed in the same round. "
               "Memory: on CUDA always; on a CPU the peak RSS of a fresh process per row, eager (bench.py "
               "latency).",
    "train": "vs: the median per-round ratio ± the half-width of its 95% bootstrap interval. MFU = 3 x "
             "forward FLOPs (flop_counter: linear, attention, merge, aux; elastic: recurrent part x 0.7) x "
             "img/s / peak bf16 FLOP/s; 'unknown' where the device's peak is not in the table (a CPU's)."}


def result_markdown(result: dict) -> str:
    """`bench.py latency`'s or `train`'s report: its settings, rows, paired ratios, notes and targets."""
    kind, rows = result["command"], result["rows"]
    title, columns = {"latency": ("Inference latency and memory", [("mode", f("mode", "{}")), (
        "batch", f("batch", "{}"))] + LATENCY_COLUMNS), "train": ("Training step", TRAIN_COLUMNS)}[kind]
    settings = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in result["settings"].items() if v is not None)
    text = [f"## {title} ({settings})\n", markdown(rows, [("model", f("model", "{}"))] + columns)]
    recompiled = [f"{r['model']} ({r.get('mode', 'train')}, batch {r['batch']})" for r in rows
                  if r.get("recompiled_while_timed")]
    if recompiled:
        text.append(f"\ntorch.compile built new graphs inside timed regions of: {', '.join(recompiled)}.")
    text += [f"\n{what}: {ratio_text(r[key])}" for key, *_, what in PAIRED for r in rows if key in r]
    text += [f"\nreViT fixed / DeiT III: {ratio_text(r)}: median of {r['repeats']} paired rounds, 95% "
             f"bootstrap interval; +-{result['settings'].get('resolve') or 0.03} needs about "
             f"{r['repeats_needed']} rounds at this spread." for r in rows
             if kind == "train" and r["model"] == "reViT fixed"]
    text += [f"\n{NOTES[kind]}", targets_markdown(result.get("targets", []))]
    return "\n".join(line for line in text if line)


def ratio_text(r: dict) -> str:
    """'1.062 ± 0.021 (1.041–1.083)': the median per-round ratio ± half its 95% interval; the interval."""
    low, high = r["ratio_ci95"]
    return f"{r['ratio']:.3f} ± {r['ratio_pm']:.3f} ({low:.3f}–{high:.3f})"


def targets_markdown(targets: list[dict]) -> str:
    if not targets:
        return ""
    return "\n\n### Targets (ours, against the paper's Table 7)\n\n" + markdown(targets, [
        ("target", f("target", "{}")), ("measured", f("value", "{:.3f}")),
        ("met", lambda r: "yes" if r["met"] else "**no**")])


def environment_line(env: dict) -> str:
    return (f"{env['date']} · torch {env['torch']} · {env.get('gpu', env['cpu'])} · "
            f"{env['cpu_count']} CPUs, {env['torch_threads']} threads · git {env.get('git', '?')}")


# --- check: the first minutes on a GPU, an ordered list of parts within --budget (python bench.py check) ---

# Sizes. full (CUDA): S/16 at 224², as the paper's Table 7, inductor; latency with bf16 weights and images
# cast once, training under bf16 autocast with fused AdamW. tiny (the CPU): the same parts and
# code paths at tiny sizes, fp32, dynamo's eager backend (graph capture and guards, no code generation).
TINY_MODELS = dict(dim=32, heads=2, ffn_dim=64, depth=2)  # dynamo traces each of the L steps: few of them
CHECK_SIZES = {
    "full": dict(
        backend="inductor", batches=(1, 64),
        latency=dict(size="s", warmup=5, repeats=10, iters=10, dtype="bfloat16"),
        train=dict(size="s", batch=128, warmup=3, repeats=8, iters=3),
        run=["--arch", "revit-s", "--max-steps", "100", "--log-interval", "10"]),  # eager
    "tiny": dict(
        backend="eager", batches=(1, 4),
        latency=dict(size="mini", warmup=1, repeats=3, iters=2, dtype="float32", model_args=TINY_MODELS),
        train=dict(size="mini", batch=4, warmup=1, repeats=3, iters=1, model_args=TINY_MODELS),
        run=["--arch", "revit-mini", "--max-steps", "4", "--train-subset", "512", "--test-subset", "256",
             "--batch-size", "64", "--log-interval", "2", "--model-args", "dim=32,heads=2,ffn_dim=64",
             "--depth", "2"]),
}
CHECK_FILES = ("check.json", "check.md", "check.log")  # all a check writes into --out
STEP_ROWS = {"train-step": ["DeiT III", "reViT fixed"],  # the training-step parts' rows, the reference first
             "elastic": ["reViT fixed, eager", "reViT elastic 0.3"]}
DATA_TESTS = ["tests/test_train.py", "tests/test_analyze.py"]  # gpu-marked: training, resume, analysis


def run_check(args, device) -> dict:
    """The parts in turn (lib/budget.run_plan); --part runs one part in this process (as the parts do)."""
    sizes_name = "full" if device.type == "cuda" else "tiny"
    sizes = CHECK_SIZES[sizes_name]
    if args.part:
        return check_part(args.part, device, sizes)
    os.makedirs(args.out, exist_ok=True)  # checked by check_flags (a given one or the default)
    run_dir = tempfile.mkdtemp(prefix="revit-check-run-")  # the train.py run's, removed after it
    parts = check_parts(args, device, sizes, run_dir)
    header = {"command": "check", "env": environment(device), "sizes": sizes_name, "budget_s": args.budget,
              "compile_backend": sizes["backend"], "kinds": {p.name: p.kind for p in parts}}
    report = budget.Report(args.out, header, check_markdown, check_row_line(header["kinds"]))
    print(f"bench.py check on {device} ({sizes_name} sizes), budget {args.budget:.0f} s, report in "
          f"{args.out}", flush=True)
    try:
        with open(os.path.join(args.out, "check.log"), "w") as log:
            budget.run_plan(parts, args.budget, report, log)
    except budget.Stopped as stop:
        print(check_markdown(report.document()) + "\n" + json_text(report.document()), flush=True)
        raise SystemExit(f"bench.py check: stopped ({stop}); {args.out} holds every finished row") from None
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    print("\n" + check_markdown(report.document()), flush=True)
    return report.document()


def check_parts(args, device, sizes: dict, run_dir: str) -> list:
    """The parts, most important first (the paper's Table 7 first), each with its share of the budget and
    the least share worth starting it with (our choice, from CPU compile times until a GPU run measures
    them). A part that cannot run here (no data; GPU tests on a CPU) has no process, only its reason."""
    cuda = device.type == "cuda"
    here = [sys.executable, os.path.join(HERE, "bench.py"), "check", "--device",  # cuda:N: their only GPU
            device.type, "--part"]
    data_dir = ["--data-dir", os.path.abspath(args.data_dir)] if args.data_dir else []
    run = [sys.executable, os.path.join(HERE, "train.py"), *sizes["run"], *data_dir, "--out-dir", run_dir,
           "--no-progress", "--compile-backend", sizes["backend"]]
    no_data, env = data_problem(args.data_dir), part_env(device, args.data_dir)
    gpu_tests = dict(blocked=no_data) if cuda else dict(
        blocked="these tests are marked gpu (they need a CUDA GPU)", blocked_status="skipped")
    small, large = sizes["batches"]

    def part(name, kind, share, floor, argv, rows=(), **fields):
        argv = None if fields.get("blocked") else argv
        return budget.Part(name, argv, list(rows), share, floor * args.budget, kind=kind, env=env, **fields)
    return [
        part(f"latency, batch {small}", "latency", 0.30, 0.12, here + ["latency-small"], LATENCY_MODELS),
        part(f"latency, batch {large}", "latency", 0.22, 0.08, here + ["latency-large"], LATENCY_MODELS),
        part("training step", "train", 0.20, 0.10, here + ["train-step"], STEP_ROWS["train-step"]),
        part("correctness", "tests", 0.10, 0.05, tests_argv(device, ["tests/test_device.py::TestOnDevice"])),
        part("train.py run", "run", 0.07, 0.03, run, ["train.py run"], blocked=no_data,
             finish=train_run_rows(run_dir, sizes, device)),
        part("training step, elastic depth", "train", 0.05, 0.03, here + ["elastic"], STEP_ROWS["elastic"]),
        part("GPU tests that need the data", "tests", 0.06, 0.04,
             tests_argv(device, DATA_TESTS, gpu_only=True), **gpu_tests)]


def part_env(device, data_dir: str) -> dict:
    """Rows as they come (unbuffered), the GPU tests on (conftest.py hides the GPUs otherwise), the data for
    the tests' fixture, bench.py importable (pytest -p bench); not the caller's PYTEST_ADDOPTS."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env.update(PYTHONUNBUFFERED="1", REVIT_GPU_TESTS="1" if device.type == "cuda" else "0",
               PYTHONPATH=os.pathsep.join([HERE, *filter(None, [env.get("PYTHONPATH")])]))
    if device.type == "cuda" and device.index is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(device.index)
    if data_dir:
        env["REVIT_DATA_DIR"] = os.path.abspath(data_dir)
    return env


def data_problem(data_dir: str) -> str:
    """'' when Fashion-MNIST is found where train.py looks, else the row's one-line reason."""
    try:
        data.find_builtin("fashion-mnist", data_dir)
        return ""
    except (FileNotFoundError, ValueError):
        where = ", ".join(map(str, data.data_roots(data_dir)))
        return (f"no Fashion-MNIST in {where}; copy its four .gz files into {data_dir or 'data'}/ "
                "(README: On a GPU)")


def step_precision(device) -> str:
    return "bf16 autocast, fp32 weights, fused AdamW, TF32 on" if device.type == "cuda" else "fp32, AdamW"


def check_part(key: str, device, sizes: dict) -> dict:
    """One part (PARTS) in this process: Table 7 at the small or large batch, DeiT III vs reViT fixed, or
    elastic vs fixed depth (both step loops eager). Each row is printed (lib/budget.emit) after its first
    call, then with its result; an error ends the process with its first line."""
    compiled, cuda = f"compiled ({sizes['backend']})", device.type == "cuda"
    if key.startswith("latency"):  # memory: CUDA's is always measured; a CPU's by bench.py latency, eagerly
        weights = "bf16" if sizes["latency"]["dtype"] == "bfloat16" else "fp32"
        precision, run = f"{weights} weights and images{', TF32 on' if cuda else ''}", functools.partial(
            bench_latency, batches=(sizes["batches"][PARTS.index(key)],), modes=("compiled",),
            memory=False, **sizes["latency"])
    else:
        labels = STEP_ROWS[key]
        precision, run = step_precision(device), functools.partial(
            bench_train, compiled=True, labels=labels, reference=labels[0],
            peak=peak_of(torch.cuda.get_device_name(device)) if cuda else None, **sizes["train"])
    eager = {"reViT fixed, eager": "eager", "reViT elastic 0.3": "stem and head compiled, step loop eager"}

    def on_row(label, row, final):
        fields = {k: v for k, v in row.items() if k != "overrides"}
        if not final:
            first = row.get("first_call_s", row.get("first_step_s", 0))
            fields["detail"] = f"first call {first:.1f} s (compilation included); timing"
        how = f"{precision}, {eager.get(label, compiled)}"
        budget.emit(label, status="ok" if final else "running", precision=how, **fields)
    try:
        run(device=device, backend=sizes["backend"], on_row=on_row)
    except Exception as e:  # noqa: BLE001 - the traceback to the log, its first line to the report
        traceback.print_exc(file=sys.stdout)
        raise SystemExit(f"error: {first_informative_line(e)}") from None
    return {"command": "check", "part": key}


# torch's trailing advice on an error, never the error itself (the report shows the first line that is not)
TORCH_HINTS = ("TORCHDYNAMO_VERBOSE", "TORCH_LOGS", "TORCH_USE_CUDA_DSA", "CUDA_LAUNCH_BLOCKING",
               "might be asynchronously reported", "suppress_errors", "You can suppress this exception")


def first_informative_line(error: BaseException) -> str:
    """'Type: line': the message's first line that is neither torch's advice nor a heading ("... raised:")."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    useful = [line for line in lines
              if not line.endswith("raised:") and not any(hint in line for hint in TORCH_HINTS)]
    return f"{type(error).__name__}: {(useful or lines or [''])[0]}"


# --- check: the parts run by pytest and by train.py, their rows from the tests' hook and the run's log ---


def tests_argv(device, files: list[str], gpu_only: bool = False) -> list[str]:
    """The files' cases for this device (gpu-marked on CUDA), or only the gpu-marked tests; each test's row
    printed by bench.py's pytest_runtest_logreport (-p bench, bench.py on the part's PYTHONPATH)."""
    marker = "gpu" if gpu_only or device.type == "cuda" else "not gpu"
    return [sys.executable, "-m", "pytest", "-p", "bench", "-p", "no:cacheprovider", "-q", "-m", marker,
            *(os.path.join(HERE, f) for f in files)]


def pytest_runtest_logreport(report) -> None:
    """pytest's hook in the check's test parts: a test's row as it ends (passed, failed, skipped, set-up or
    tear-down error), with its seconds and the first line of a failure or the reason of a skip."""
    if report.when != "call" and report.passed:
        return
    status = "ok" if report.passed or hasattr(report, "wasxfail") else report.outcome  # xfail: as planned
    crash = getattr(report.longrepr, "reprcrash", None)  # a failure's 'Error: message' line
    why = crash.message if crash else report.longrepr[2] if status == "skipped" else ""
    print()  # pytest -q's dots have no line end
    budget.emit(report.nodeid.split("::", 1)[1], status=status, seconds=report.duration,
                **({"detail": why.splitlines()[0][:200]} if why else {}))


def train_run_rows(run_dir: str, sizes: dict, device):
    """The train.py run's row from its metrics log, once it has ended (after a timeout: the steps it took)."""
    max_steps = int(sizes["run"][sizes["run"].index("--max-steps") + 1])

    def finish(status):
        with contextlib.suppress(OSError, ValueError), open(os.path.join(run_dir, "metrics.jsonl")) as fh:
            records = [json.loads(line) for line in fh if line.strip()]  # ValueError: a line cut by a kill
            final = next((r for r in records if r.get("event") == "final"), {})
            rates = [r["per_s"] for r in records if "per_s" in r] or [None]
            steps = max((r["step"] for r in records if isinstance(r.get("step"), int)), default=0)
            done = status == 0 and steps == max_steps and bool(final)
            return [("train.py run", {
                "steps": steps, "max_steps": max_steps, "test_acc": final.get("test_acc"),
                "images_per_s": statistics.median(rates[1:] or rates),  # the 1st interval holds the start
                "first_interval_images_per_s": rates[0], "minutes": final.get("minutes"),
                "precision": f"{step_precision(device)}, eager",
                **({"status": "ok"} if done else {"detail": f"{steps} of {max_steps} steps"})})]
        return []
    return finish


# --- check: the report (check.md; every row a result or a one-line reason; latency first) ---


def check_markdown(doc: dict) -> str:
    env, kinds = doc["env"], doc["kinds"]
    state = ("complete: every row is a result or a reason" if doc["complete"] else
             "NOT complete: rows marked pending or running had not finished when this file was written")
    gpu = f" ({env['gpu']})" if "gpu" in env else ""
    verdict = "all passed" if doc["ok"] else "see the rows not ok"
    out = [f"# bench.py check: {env['device']}{gpu}, {doc['sizes']} sizes, budget {doc['budget_s']:.0f} s\n",
           environment_line(env), f"\nReport {state}; {verdict}.\n"]
    for part, kind in kinds.items():
        rows = [r for r in doc["rows"] if r["part"] == part]
        note = f"\n{NOTES[kind]}" if kind in NOTES else ""
        out += [f"## {part}\n", markdown(rows, CHECK_COLUMNS[kind]), note, ""]
    if doc["sizes"] == "full":  # ours, against the paper's Table 7, on the rows that finished
        done = {kind: [r for r in doc["rows"] if r["status"] == "ok" and kinds[r["part"]] == kind]
                for kind in ("latency", "train")}
        judged = latency_targets(done["latency"]) + train_targets(done["train"])
        out.append(targets_markdown(judged).lstrip("\n") + "\n")
    out += ["## The plan (most important first; each part its own process and timeout)\n",
            markdown(doc["parts"], [("part", f("part", "{}")), ("timeout s", f("timeout_s", "{:.0f}")),
                                    ("used s", f("seconds", "{:.1f}")), ("status", f("status", "{}")),
                                    ("detail", f("detail", "{}"))])]
    return "\n".join(out)


def status_cell(r: dict) -> str:
    text = r["status"] if r["status"] in ("ok", "running", "pending") else f"**{r['status']}**"
    return text + (f": {r['detail']}" if r.get("detail") and r["status"] != "ok" else "")


CHECK_ROW = [("model", f("row", "{}")), ("batch", f("batch", "{}")), ("status", status_cell)]
PRECISION = [("precision", f("precision", "{}"))]
CHECK_COLUMNS = {
    "latency": CHECK_ROW + LATENCY_COLUMNS + PRECISION,
    "train": CHECK_ROW + TRAIN_COLUMNS + PRECISION,
    "tests": [("test", f("row", "{}")), ("status", status_cell), ("s", f("seconds", "{:.1f}"))],
    "run": [("status", status_cell), ("steps", f("steps", "{}")),
            ("img/s (after the 1st interval)", f("images_per_s", "{:.0f}")),
            ("1st interval img/s (with the start)", f("first_interval_images_per_s", "{:.0f}")),
            ("test acc %", lambda r: f"{100 * r['test_acc']:.2f}"), ("minutes", f("minutes", "{:.2f}")),
            *PRECISION],
}


def check_row_line(kinds: dict):
    """The line printed as each row gets its result: its part, then its row of check.md."""
    return lambda r: f"{r['part']}: {markdown([r], CHECK_COLUMNS[kinds[r['part']]]).splitlines()[-1]}"


# --- command line ---

PROG = "bench.py"
DEFAULTS = {  # (command, on CUDA) -> what unset flags become: Table 7's sizes on CUDA, smaller on a CPU
    ("latency", False): dict(size="s", batches=(1, 8), modes=("eager", "compiled"), warmup=2, repeats=7,
                             iters=1),
    ("latency", True): dict(size="s", batches=(1, 64), modes=("compiled", "reduce-overhead"), warmup=10,
                            repeats=30, iters=20),  # reduce-overhead: compiled with CUDA graphs
    ("train", False): dict(size="s", batch=8, compile=False, warmup=1, repeats=10, iters=1, resolve=0.03,
                           max_repeats=60),
    ("train", True): dict(size="s", batch=128, compile=True, warmup=5, repeats=20, iters=5, resolve=0.03,
                          max_repeats=200),
}
QUICK = dict(size="mini", batch=4, compile=False, warmup=0, repeats=3, iters=1, resolve=0.03, max_repeats=6)
PARTS = ("latency-small", "latency-large", "train-step", "elastic")  # check --part: what its processes run


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=PROG, description=__doc__.split("\n")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    parser.commands = sub.choices  # name -> its parser

    def command(name, text, out="also write the JSON results to this file", device=True):
        p = sub.add_parser(name, help=text)
        if device:
            device_flags(p)
        if out:
            p.add_argument("--out", help=out)
        return p
    params = command("params", "parameters and GFLOPs/image at S/B/L (paper Tables 1 and 10)", device=False)
    params.add_argument("--no-counter", action="store_true", help="skip the flop_counter cross-check")
    lat = command("latency", "inference latency and memory, DeiT III vs reViT dynamic/cached/folded")
    tr = command("train", "training-step throughput and MFU")
    for name, p in (("latency", lat), ("train", tr)):
        p.add_argument("--size", choices=["s", "b", "l", "mini"], help="model size of the presets "
                       "(vit-SIZE, revit-SIZE; default s = ViT-S/16 at 224²)")
        cpu, cuda = DEFAULTS[name, False], DEFAULTS[name, True]
        timing_flags(p, *(f"CPU {cpu[key]}, CUDA {cuda[key]}" for key in ("warmup", "repeats", "iters")))
    lat.add_argument("--batches", type=int, nargs="+", help="batch sizes (CPU: 1 8; CUDA: 1 64, Table 7)")
    lat.add_argument("--modes", nargs="+", choices=["eager", "compiled", "reduce-overhead"],
                     help="eager, compiled, reduce-overhead: compiled with CUDA graphs (CPU: eager compiled)")
    tr.add_argument("--batch", type=int, help="batch size (CPU 8, CUDA 128)")
    tr.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="torch.compile the model (CUDA default on, CPU off)")
    tr.add_argument("--peak-tflops", type=float, help="device peak for MFU (default: table for known GPUs)")
    tr.add_argument("--resolve", type=float, help="add paired rounds until reViT fixed / DeiT III is known "
                                                  "to +- this (95%% interval; default 0.03; 0: --repeats)")
    tr.add_argument("--max-repeats", type=int, help="at most this many paired rounds (CPU 60, CUDA 200)")
    tr.add_argument("--rows", help="comma-separated rows to time (default all; DeiT III always)")
    tr.add_argument("--quick", action="store_true", help="seconds: mini size, batch 4, few rounds")
    check = command("check", "the first minutes on a GPU within a time budget: Table 7 latency and memory, "
                             "training step, correctness, a short train.py run; rows written as they finish",
                    out="folder for check.md, check.json and check.log (default: out/check-TIME), new")
    check.add_argument("--budget", type=float, default=420.0, help="seconds for the whole check (default "
                       "420); parts run most important first, each its share")
    check.add_argument("--data-dir", default="", help="where Fashion-MNIST is (default: train.py's search)")
    check.add_argument("--part", choices=PARTS, help="run one part in this process (the check's parts do)")
    mem = command("memory", "expected peak memory per GPU of a preset x recipe x batch x GPUs, measured at "
                            "reduced sizes on this machine (lib/memory.py)", out=None)
    mem.add_argument("--arch", required=True, help="a preset of revit.py or alternet.py")
    mem.add_argument("--recipe", help="train.py's --recipe (default: alternet.RECIPES, Table 2; imagenet, "
                                      "Table 6)")
    mem.add_argument("--batch-size", type=int, help="global batch per optimizer step (default: the recipe's)")
    mem.add_argument("--grad-accum", type=int, help="micro-steps per step (default: the fewest that fit)")
    mem.add_argument("--gpus", type=int, default=1, help="GPUs under torchrun (DDP; default 1)")
    mem.add_argument("--gpu-memory", type=float, default=80.0, help="GB per GPU (default 80)")
    mem.add_argument("--seq-len", type=int, help="language presets: the context (default: the recipe's)")
    mem.add_argument("--precision", choices=PRECISIONS, default="bf16",
                     help="autocast (default bf16; train.py's auto: bf16 where the GPU has it, else fp16)")
    return parser


def device_flags(p):
    p.add_argument("--device", default="auto", help=f"{DEVICES} (auto: CUDA when available, else CPU)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")


def timing_flags(p, warmup: str, repeats: str, iters: str):
    p.add_argument("--warmup", type=int, help=f"untimed calls first ({warmup})")
    p.add_argument("--repeats", type=int, help=f"timed regions per row ({repeats})")
    p.add_argument("--iters", type=int, help=f"calls per timed region ({iters})")


def check_flags(args, device) -> dict:
    """Every subcommand's flags before any work: DEFAULTS for unset ones (returned), RANGES, --rows, --out."""
    defaults = {**DEFAULTS.get((args.command, device.type == "cuda"), {}),
                **(QUICK if args.command == "train" and args.quick else {})}
    defaults = {k: v for k, v in defaults.items() if getattr(args, k, None) is None}
    vars(args).update(defaults)
    check_numbers(vars(args), PROG)
    if args.command == "train" and args.rows:
        known, rows = train_models(args.size, args.compile), []
        for name in (t.strip() for t in args.rows.split(",")):
            if rows and f"{rows[-1]}, {name}" in known:  # a listed name holding ", ": "reViT fixed, eager"
                rows[-1] += f", {name}"
            else:
                rows.append(name)
        if not set(rows) <= set(known):
            fail(f"--rows must name some of {', '.join(known)}; got {args.rows[:80]!r}", PROG)
        args.rows = rows
    check = args.command == "check"
    if check and not args.part and not args.out:  # the default is checked like a given one
        args.out = f"out/check-{time.strftime('%Y%m%d-%H%M%S')}"
    out = getattr(args, "out", None)
    # only new files, or a command's own: another check's report, a run's files and a model stay as they are
    held = [name for name in CHECK_FILES if out and check and os.path.lexists(os.path.join(out, name))]
    problem = (f"already holds {held[0]} (another check's report); choose another --out" if held
               else out and output_problem(out, "folder" if check else "file"))
    if problem:
        fail(f"--out {out} {problem}", PROG)
    return defaults


def run_params(args, device) -> dict:
    return {"command": "params", **bench_params(with_counter=not args.no_counter)}


def run_latency(args, device) -> dict:
    dtype = "bfloat16" if device.type == "cuda" else "float32"  # CUDA: cast once, no per-call autocast
    settings = {k: getattr(args, k) for k in ("size", "batches", "modes", "warmup", "repeats", "iters")}
    return {"command": "latency", "settings": {**settings, "precision": f"{dtype} weights"},
            **bench_latency(**settings, device=device, dtype=dtype)}


def run_train(args, device) -> dict:
    peak = args.peak_tflops * 1e12 if args.peak_tflops else (
        peak_of(torch.cuda.get_device_name(device)) if device.type == "cuda" else None)
    labels = ["DeiT III", *(r for r in args.rows if r != "DeiT III")] if args.rows else None
    settings = {k: getattr(args, k) for k in ("size", "batch", "warmup", "repeats", "iters", "resolve",
                                              "max_repeats")}
    precision = "bf16 autocast" if device.type == "cuda" else "fp32"
    return {"command": "train", "settings": {
        **settings, "compiled": args.compile, "precision": precision, "optimizer": "AdamW",
        "threads": torch.get_num_threads(), "peak_flops": peak, "rows": labels},
        **bench_train(**settings, device=device, compiled=args.compile, peak=peak, labels=labels)}


def run_memory(args, device) -> dict:
    """The estimate of lib/memory.py for a GPU run under bf16 (or --precision) autocast, as train.py's."""
    language = args.arch in alternet.PRESETS
    if language and args.recipe not in (None, "text"):  # else train.py asks for --max-steps, not a flag here
        fail(f"--recipe {args.recipe} does not suit {args.arch}, a language preset: use --recipe text", PROG)
    if not language and args.seq_len is not None:
        fail(f"--seq-len is for language presets; {args.arch} is a vision preset (tokens: its patches)", PROG)
    explicit = {"arch": args.arch, **({"recipe": args.recipe} if args.recipe else {}),
                **({} if language else {"dataset": "imagenet"})}
    cfg = train.resolve_config(explicit, announce=False)  # an unknown --arch: one line, with suggestions
    with torch.device("meta"):
        model = (alternet if language else moe).create_model(args.arch)
    batch = args.batch_size or cfg.batch_size
    seq_len = (args.seq_len or cfg.block_size or model.config.seq_len) if language else None
    if language and seq_len > model.config.seq_len:
        fail(f"--seq-len {seq_len} exceeds {args.arch}'s seq_len {model.config.seq_len}", PROG)
    if batch % (args.gpus * (args.grad_accum or 1)):
        fail(f"--batch-size {batch} must be divisible by --gpus x --grad-accum", PROG)
    profile = memory.measure(model.config, device, PRECISIONS[args.precision], seq_len)
    recipe = args.recipe or train.RECIPE_OF.get(cfg.dataset, "")
    recipe += " + alternet.RECIPES (Table 2)" if args.arch in alternet.RECIPES else ""
    settings = {"arch": args.arch, "recipe": recipe, "batch_size": batch, "seq_len": seq_len,
                "gpus": args.gpus, "gpu_memory_gb": args.gpu_memory, "measured_on": str(device)}
    try:
        estimate, how_to_fit = memory.plan(model, profile, batch, seq_len, args.gpus, args.gpu_memory,
                                           args.grad_accum), None
    except ValueError as e:
        estimate = memory.estimate(model, profile, batch, seq_len, args.gpus, args.grad_accum or 1)
        how_to_fit = str(e)
    rows = [("weights", estimate.weights), ("gradients", estimate.grads), ("AdamW state", estimate.optimizer),
            ("activations", estimate.activations), ("loss", estimate.loss), ("total", estimate.total)]
    print(f"{args.arch}, recipe {recipe}: {estimate.line()}\n\n| per device | GB |\n|---|---|")
    print("\n".join(f"| {name} | {value / memory.GB:.2f} |" for name, value in rows))
    print(f"\nfits {memory.USABLE:.0%} of {args.gpu_memory:g} GB: "
          f"{'no -- ' + how_to_fit if how_to_fit else 'yes'}")
    return {"command": "memory", "settings": settings, "grad_accum": estimate.grad_accum,
            "micro_batch": estimate.micro_batch, "precision": estimate.precision,
            "bytes": dict(rows), "fits": how_to_fit is None, "how_to_fit": how_to_fit}


COMMANDS = {"params": run_params, "latency": run_latency, "train": run_train, "check": run_check,
            "memory": run_memory}
REPORTS = {"params": params_markdown, "latency": result_markdown, "train": result_markdown}  # then --out
TARGETS = {"latency": latency_targets, "train": train_targets}  # ours, at S/16 (Table 7's size) only


def main(argv=None) -> dict:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # matched against the subcommand's flags (bench.py's own are -h alone)
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        device = pick_device(getattr(args, "device", "cpu"))
    except ValueError as e:  # --device: one line, as argparse reports its own errors
        fail(str(e), PROG)
    defaults = check_flags(args, device)
    if device.type == "cuda":  # TF32 for float32 parts outside autocast (test_device.py's TestOnDevice: off)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    result = COMMANDS[args.command](args, device)
    if args.command in TARGETS:
        result["targets"] = TARGETS[args.command](result["rows"]) if args.size == "s" else []
    if args.command in REPORTS:
        print(REPORTS[args.command](result))
        result["env"] = environment(device)
    if args.command in TARGETS:
        result["settings"]["defaults_used"] = defaults
        if device.type == "cpu":
            print(f"\nCPU-sized defaults used: {defaults}; GPU numbers: the same command on a CUDA machine.")
        print("\n" + environment_line(result["env"]))
    if args.command in REPORTS and args.out:
        write_json(result, args.out)
    print(json_text(result))
    return result


if __name__ == "__main__":
    result = run_main(main, "every report it writes is written whole or not at all")
    sys.exit(0 if result.get("ok", True) else 1)
