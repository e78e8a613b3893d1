"""bench.py: the numbers a user compares, for reViT against its baselines (issue 6).

    python bench.py params      # parameters and GFLOPs/image at S/B/L 224² (paper Tables 1 and 10, SPEC §1.9)
    python bench.py latency     # inference latency and memory, the protocol of the paper's Table 7
    python bench.py train       # training-step throughput (img/s) and MFU
    python bench.py latency --out latency.json   # also write the JSON document to a file

Each subcommand prints markdown tables, then the full results as ONE JSON document on the
last stdout line. The device is picked automatically (CUDA when present, else CPU); CPU
runs use smaller defaults, printed with the results. How we measure, and why:

- FLOPs are counted analytically with the paper's rule (2 FLOPs per multiply-add of the
  linear layers incl. patch embedding and head; attention score/value products not counted;
  reViT adds the per-step merge of E experts of P parameters, E*P multiply-adds) and
  cross-checked against torch.utils.flop_counter on the real module, built on the meta
  device (no memory, no time). The counter also counts the attention products, the router
  and whatever else a forward computes; the tables show each term.
- Timing: warm-up first (until torch.compile stops building graphs); each timed region runs
  `iters` calls and synchronizes the device once, at its end (a no-op on CPU); regions of all
  rows are interleaved round-robin, so background load hits every row alike; the ratio column
  is the median over repeats of the per-round ratio against DeiT III timed in the same round.
  We report median, IQR and min-max.
- CUDA: bf16 autocast and torch.compile (the paper's setting); CPU: fp32, eager and compiled.
- Memory is total runtime memory, as in the paper's Table 7: weights, what stays allocated
  after the first call (reViT's merged-weight cache), and the peak of activations/workspace.
  CUDA: weights + allocated growth of the first call + max_memory_allocated growth over a second
  call. CPU: a fresh process per row (so no row reuses another's freed memory uncounted); a
  narrow 2-step model of the same family runs first to load kernels and thread pools; then
  peak RSS (VmHWM, reset via /proc/self/clear_refs once the model is built) minus the RSS
  before the model was built. CPU memory is measured in eager mode.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import revit

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
PEAK_BF16_FLOPS = [("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12),
                   ("L40S", 362e12), ("L4", 121e12)]

# --- device, environment, timing ---


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast(device: torch.device):
    """bf16 autocast on CUDA (the paper's setting); CPU stays in fp32."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def cpu_model_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or "unknown"


def environment(device: torch.device) -> dict:
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "python": platform.python_version(), "device": str(device),
           "cpu": cpu_model_name(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        env["git"] = commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return env


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None  # CPU peaks depend on SKU, clocks and sharing: we do not guess
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in name), None)


def summary(seconds: list[float]) -> dict:
    """Median, quartiles and range of a list of per-call times, in ms."""
    ms = sorted(1e3 * s for s in seconds)
    q1, _, q3 = statistics.quantiles(ms, n=4, method="inclusive") if len(ms) > 1 else (ms[0],) * 3
    return {"median_ms": statistics.median(ms), "q1_ms": q1, "q3_ms": q3, "min_ms": ms[0], "max_ms": ms[-1],
            "repeats": len(ms)}


def paired_ratio(times: list[float], reference: list[float]) -> dict:
    """Median and IQR of per-round ratios: both rows were timed in the same round, under the same load."""
    ratios = [a / b for a, b in zip(times, reference)]
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else (ratios[0],) * 3
    return {"ratio": statistics.median(ratios), "ratio_q1": q1, "ratio_q3": q3}


def compiled_graphs() -> int:
    """How many graphs torch.compile has built so far in this process (0 before any compile)."""
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    return dynamo_utils.counters["stats"]["unique_graphs"] if dynamo_utils else 0


def time_interleaved(fns: dict, device: torch.device, warmup: int, repeats: int, iters: int) -> dict:
    """Seconds per call for each fn, `repeats` values each.

    Warm-up: at least `warmup` rounds over all fns (and one), more (up to 10) until a whole round
    compiles no new graph: torch.compile can recompile on the 2nd or 3rd call (guards on caches),
    and rows sharing code (ReViT.forward) can evict each other's graphs. Then round r times one
    region of `iters` calls of every fn, starting at a rotated position; the device is synchronized
    once at the end of each region (the previous region's end already synchronized its start).
    A row whose timed regions still compiled something is flagged in the result's "recompiled".
    """
    labels = list(fns)
    for round_ in range(max(warmup, 1) + 10):
        before = compiled_graphs()
        for label in labels:  # round-robin too: compiled rows sharing code can evict each other's graphs
            fns[label]()
        if round_ + 1 >= warmup and compiled_graphs() == before:
            break
    synchronize(device)
    times = {label: [] for label in labels}
    recompiled = set()
    for r in range(repeats):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            fn, graphs = fns[label], compiled_graphs()
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            synchronize(device)
            times[label].append((time.perf_counter() - start) / iters)
            if compiled_graphs() != graphs:
                recompiled.add(label)
    times["recompiled"] = sorted(recompiled)
    return times


def maybe_compile(model, compiled: bool):
    if not compiled:
        return model
    import torch._dynamo.config as dynamo_config
    # one compiled variant per (model, batch size): more than dynamo's default cache allows per code object
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(64, getattr(dynamo_config, name)))
    return torch.compile(model, dynamic=False)


# --- counting parameters and FLOPs (SPEC §1.9) ---


def expert_params(dim: int, hidden: int) -> int:
    """P(d, r) = 2 r d^2 + (r + 1) d of SPEC §1.8, with hidden = r d: one FFN's weights and biases."""
    return 2 * dim * hidden + hidden + dim


def analytic_macs(config: revit.ViTConfig, extra_tokens: int = 0, online: bool = True,
                  lora_rank: int = 0) -> dict:
    """Multiply-adds per image (batch 1) of the linear layers, by the paper's counting rule.

    tokens T = N + 1 (+ extra_tokens). Per step: qkv 3d^2 and out-projection d^2 per token, FFN
    2 d d_ff per token. Patch embedding is a linear map of each C p^2 patch; the head runs once.
    online: reViT rebuilds its merged FFN each step (E * P multiply-adds, Eq. 2), shared by the
    whole batch; folded / cached weights cost nothing per image. lora_rank: layer-wise LoRA
    evaluated online, x A_t then B_t on each of qkv, out, fc1, fc2 (r (d_in + d_out) per token).
    """
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
        macs["lora"] = c.depth * tokens * lora_rank * ((d + 3 * d) + (d + d) + 2 * (d + hidden))
    macs["total"] = sum(macs.values())
    return macs


def lora_params(config: revit.ViTConfig, rank: int = LORA_RANK) -> tuple[int, int]:
    """(shared model, adapters) of the tied block + layer-wise LoRA: the E = 1 reViT plus L rank-r sets."""
    with torch.device("meta"):
        shared = revit.create_model("revit-s-e1", **_size_fields(config)).num_params()
    d, hidden = config.dim, config.ffn_dim
    adapters = config.depth * rank * ((d + 3 * d) + (d + d) + 2 * (d + hidden))
    return shared, adapters


def _size_fields(config) -> dict:
    names = ("image_size", "patch_size", "in_channels", "num_classes", "dim", "heads", "ffn_dim", "depth")
    return {name: getattr(config, name) for name in names}


def counted_flops(model: torch.nn.Module) -> dict:
    """torch.utils.flop_counter on one batch-1 forward, split by where the FLOPs happen.

    The model is run on its own device (build it on "meta" to count for free); models whose
    forward needs data (token dispatch sorts tokens) must be built on the CPU. Gradients stay
    enabled: the counter's module tracker trips over parameter views made under no_grad (LoRA).
    total = linear layers and merge (what the paper counts) + attention products + router + other.
    """
    c = model.config
    device = next(model.parameters()).device
    images = torch.zeros(1, c.in_channels, c.image_size, c.image_size, device=device)
    counter = FlopCounterMode(display=False)
    # the counter has no formula for the CPU flash-attention kernel; the math backend is plain matmuls
    with counter, sdpa_kernel(SDPBackend.MATH):
        model(images)
    by_module = counter.get_flop_counts()
    module_total = lambda name: sum(by_module[name].values())
    # the score and value products: SDPA, or the batched matmuls it decomposes into (meta device)
    attention = sum(n for k in by_module if k.endswith(".attn") for op, n in by_module[k].items()
                    if "scaled_dot_product" in str(op) or str(op).endswith(".bmm"))
    router = sum(module_total(k) for k in by_module if k.endswith(".router"))
    ffn = sum(module_total(k) for k in by_module if k.endswith(".mlp") and ".mlp." not in k)
    return {"total": counter.get_total_flops(), "attention": attention, "router": router, "ffn_module": ffn,
            "by_op": {str(op): n for op, n in by_module.get("Global", {}).items()}}


def count_preset(name: str, **overrides) -> tuple:
    """(model, counted_flops) of a preset counted online (reViT merges every call): on the meta device,
    or on the CPU where the forward needs real data (token dispatch sorts and splits tokens)."""
    if revit.PRESETS[name].get("arch") == "revit":
        overrides.setdefault("merge_cache", False)
    try:
        with torch.device("meta"):
            model = revit.create_model(name, **overrides).eval()
        return model, counted_flops(model)
    except Exception:  # noqa: BLE001 - any failure on meta: count on a real CPU module instead
        model = revit.create_model(name, **overrides).eval()
        return model, counted_flops(model)


def moe_presets(size: str = "s") -> list[str]:
    """Issue 5's expert mechanisms at U = 1 (e.g. revit-s-qwen3-u1), when revit.py has them."""
    return sorted(n for n in revit.PRESETS if n.startswith(f"revit-{size}-") and n.endswith("-u1"))


def token_dispatch_presets(size: str = "s") -> list[str]:
    return [n for n in moe_presets(size) if any(k in n for k in ("deepseek", "qwen3", "moeut"))]


def nominal_budget(model) -> float | None:
    """The nominal FFN budget U the module states for itself (issue 5's `revit.ffn_budget`), if any."""
    budget = getattr(revit, "ffn_budget", None)
    try:
        return float(budget(model)) if budget else None
    except (AttributeError, TypeError):
        return None


def bench_params(sizes=("s", "b", "l"), archs=("vit", "raptor", "revit"), with_counter: bool = True) -> dict:
    """Table 1 rows (+ Table 10 and issue 5's U = 1 rows at S): params, analytic GFLOPs, counter GFLOPs."""
    rows = []
    for size in sizes:
        for arch in archs:
            name = f"{arch}-{size}"
            with torch.device("meta"):
                model = revit.create_model(name)
            c = model.config
            ours, paper_rule = analytic_macs(c), analytic_macs(c, extra_tokens=1)
            folded = analytic_macs(c, online=False)
            paper = PAPER_TABLE1.get(name, (None, None))
            row = {"table": "1", "name": name, "model": f"{TABLE_NAMES[arch]}-{size.upper()}",
                   "params_m": model.num_params() / 1e6, "paper_params_m": paper[0],
                   "gflops": 2 * ours["total"] / 1e9, "gflops_t198": 2 * paper_rule["total"] / 1e9,
                   "gflops_folded": 2 * folded["total"] / 1e9, "paper_gflops": paper[1],
                   "macs": ours, "tokens": c.num_patches + 1}
            if with_counter:
                row.update(_counter_columns(count_preset(name)[1], ours))
            rows.append(row)
    if "s" in sizes:
        rows += _table10_rows(with_counter)
        for name in moe_presets("s") if with_counter else []:
            model, counted = count_preset(name)
            dense = 2 * analytic_macs(model.config, online=False)["ffn"]
            row = {"table": "MoE U=1", "name": name, "model": name, "params_m": model.num_params() / 1e6}
            if with_counter:
                row.update({"counter_gflops": counted["total"] / 1e9,
                            "counter_attention_gflops": counted["attention"] / 1e9,
                            "measured_u": counted["ffn_module"] / dense})
            nominal = nominal_budget(model)
            if nominal is not None:
                row["nominal_u"] = nominal
            rows.append(row)
    return {"rows": rows}


def _counter_columns(counted: dict, ours: dict) -> dict:
    linear = counted["total"] - counted["attention"] - counted["router"]
    return {"counter_gflops": counted["total"] / 1e9, "counter_linear_gflops": linear / 1e9,
            "counter_attention_gflops": counted["attention"] / 1e9, "counter_router_flops": counted["router"],
            # what the forward computes beyond the counting rule, router and attention (reViT: aux losses)
            "counter_other_flops": linear - 2 * ours["total"], "counter_by_op": counted["by_op"]}


def _table10_rows(with_counter: bool) -> list[dict]:
    """Table 10 at S: DeiT III, tied block + layer-wise LoRA r=64 (analytic; module when issue 5 lands), reViT."""
    with torch.device("meta"):
        vit_s, revit_s = revit.create_model("vit-s"), revit.create_model("revit-s")
    c = revit_s.config
    shared, adapters = lora_params(c)
    folded = analytic_macs(c, 1, online=False)  # 12 dense depth-specific FFNs: the DeiT III count
    rows = []
    for key, label, params, online in [
            ("vit-s", "DeiT III-S/16", vit_s.num_params(), analytic_macs(vit_s.config, 1)),
            ("lora-s", f"Tied ViT-S/16 + LoRA r={LORA_RANK}", shared + adapters,
             analytic_macs(vit_s.config, 1, lora_rank=LORA_RANK)),
            ("revit-s", "reViT-S/16 E=4", revit_s.num_params(), analytic_macs(c, 1))]:
        paper = PAPER_TABLE10[key]
        row = {"table": "10", "name": key, "model": label, "params_m": params / 1e6, "paper_params_m": paper[0],
               "gflops_online_t198": 2 * online["total"] / 1e9, "gflops_folded_t198": 2 * folded["total"] / 1e9,
               "paper_gflops_online": paper[1], "paper_gflops_folded": paper[2]}
        if key == "lora-s":
            row.update(lora_shared_m=shared / 1e6, lora_adapters_m=adapters / 1e6, source="analytic")
            if "revit-s-lora" in revit.PRESETS:  # issue 5's module: its own count, online and folded
                with torch.device("meta"):
                    row.update(source="module", params_m=revit.create_model("revit-s-lora").num_params() / 1e6)
                if with_counter:
                    counted = count_preset("revit-s-lora")[1]
                    folded_module = revit.fold(revit.create_model("revit-s-lora").eval())
                    row.update(counter_online_gflops=counted["total"] / 1e9,
                               counter_folded_gflops=counted_flops(folded_module)["total"] / 1e9)
        rows.append(row)
    return rows


# --- latency and memory (paper Table 7) ---


def latency_models(size: str) -> dict:
    """DeiT III and reViT in three deployment forms (SPEC §1.7), the reViT forms sharing one set of weights.

    dynamic: merge_cache=False, the merged FFN of each step is rebuilt on every call (as the paper measured);
    cached: merged FFNs built once per (depth, weights) and reused; folded: revit.fold, a plain ViT.
    """
    torch.manual_seed(0)
    deit = revit.create_model(f"vit-{size}")
    cached = revit.create_model(f"revit-{size}")
    dynamic = revit.create_model(f"revit-{size}", merge_cache=False)
    dynamic.load_state_dict(cached.state_dict())
    return {"DeiT III": deit, "reViT dynamic": dynamic, "reViT cached": cached, "reViT folded": revit.fold(cached)}


LATENCY_SPECS = {  # how a fresh process rebuilds a row's model for the CPU memory measurement
    "DeiT III": ("vit", {}, False), "reViT dynamic": ("revit", {"merge_cache": False}, False),
    "reViT cached": ("revit", {}, False), "reViT folded": ("revit", {}, True),
}


def bench_latency(size="s", batches=(1, 8), modes=("eager",), device="cpu", warmup=2, repeats=7, iters=1,
                  memory=True, profile=False) -> dict:
    device = torch.device(device)
    rows = []
    for mode in modes:
        for batch in batches:
            models = latency_models(size)  # fresh per group: each row's first call builds its own caches
            c = models["DeiT III"].config
            images = torch.randn(batch, c.in_channels, c.image_size, c.image_size, device=device)
            fns, extra = {}, {}
            for label, model in models.items():
                model = model.to(device).eval()
                run = maybe_compile(model, mode == "compiled")
                fn = _inference_call(run, images, device)
                extra[label] = {"params_m": model.num_params() / 1e6, **first_call(fn, model, device, "first_call_s")}
                fns[label] = fn
            times = time_interleaved(fns, device, warmup, repeats, iters)
            for label in fns:
                row = {"model": label, "mode": mode, "batch": batch, "image_size": c.image_size, **extra[label],
                       **summary(times[label]), **paired_ratio(times[label], times["DeiT III"]),
                       "recompiled_while_timed": label in times["recompiled"]}
                row["images_per_s"] = 1e3 * batch / row["median_ms"]
                if memory and device.type == "cpu" and mode == "eager":
                    row.update(cpu_memory(size, label, batch))
                rows.append(row)
            if profile:
                for label, fn in fns.items():
                    print(f"\n### profile: {label}, {mode}, batch {batch}\n", flush=True)
                    print(profile_table(fn, device), flush=True)
    if memory and device.type == "cpu":  # CPU memory is measured eagerly; copy it onto the compiled rows
        eager = {(r["model"], r["batch"]): r for r in rows if r["mode"] == "eager"}
        for r in rows:
            source = eager.get((r["model"], r["batch"]))
            if r["mode"] != "eager" and source and "memory_mib" in source:
                r["memory_mib"], r["memory_method"] = source["memory_mib"], source["memory_method"] + " (eager)"
    for r in rows:
        ref = next(x for x in rows if x["model"] == "DeiT III" and x["mode"] == r["mode"] and x["batch"] == r["batch"])
        if "memory_mib" in r and "memory_mib" in ref:
            r["memory_ratio"] = r["memory_mib"] / ref["memory_mib"]
    return {"rows": rows}


def first_call(fn, model, device, key: str) -> dict:
    """Run fn once: its wall time (compilation included) under `key`, and on CUDA the memory figures."""
    start = time.perf_counter()
    allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    fn()
    synchronize(device)
    out = {key: time.perf_counter() - start}
    if device.type == "cuda":
        out.update(cuda_memory(fn, model, device, allocated))
    return out


def cuda_memory(fn, model, device, allocated_before_first_call: int) -> dict:
    """Total runtime memory of a model, as in the paper's Table 7: its weights, what its first call
    left allocated (reViT's merged-weight cache, optimizer state), and the peak of one more call
    (activations, workspace). Compile-time autotuning buffers of the first call are not counted."""
    gc.collect()
    torch.cuda.empty_cache()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    now = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    synchronize(device)
    peak = weights + (now - allocated_before_first_call) + torch.cuda.max_memory_allocated(device) - now
    return {"memory_mib": peak / 2 ** 20, "memory_method": "CUDA: weights + left allocated by the first "
            "call + max_memory_allocated growth over a second call"}


def _inference_call(model, images, device):
    def call():
        with torch.inference_mode(), autocast(device):
            return model(images)
    return call


def profile_table(fn, device, calls: int = 3, top: int = 15) -> str:
    """torch.profiler over a few calls: where the time goes, by op."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    fn()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        synchronize(device)
    sort = "cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=top)


def cpu_memory(size: str, label: str, batch: int, calls: int = 2, processes: int = 2) -> dict:
    """Peak RSS of one row, measured in `processes` fresh Python processes (see _memory_worker).

    Heap fragmentation can only add to a peak, so we report the smallest; all values are kept.
    """
    arch, overrides, fold = LATENCY_SPECS[label]
    spec = json.dumps({"preset": f"{arch}-{size}", "overrides": overrides, "fold": fold, "batch": batch,
                       "calls": calls})
    values = []
    for _ in range(processes):
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "_memory", spec], capture_output=True,
                             text=True, cwd=os.path.dirname(os.path.abspath(__file__)), timeout=900)
        if out.returncode != 0:
            return {"memory_error": out.stderr.strip().splitlines()[-1:]}
        row = json.loads(out.stdout.strip().splitlines()[-1])
        values.append(row["memory_mib"])
    return {"memory_mib": min(values), "memory_mib_all": values,
            "memory_method": row["memory_method"] + f", min over {processes} processes"}


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"{field} not in /proc/self/status")


def folded_config(config: revit.ViTConfig) -> revit.ViTConfig:
    """The config of the plain ViT that revit.fold(model) returns at the model's own depth."""
    return dataclasses.replace(config, arch="vit", ffn="merge", depth_drop=0.0, raptor_blocks=1)


def _memory_worker(spec: dict) -> dict:
    """In a fresh process: RSS before the model, then peak RSS over the forward calls.

    The input is allocated first (not counted); the peak is reset (clear_refs) after the model is
    built, so construction temporaries do not count, only what the model holds and its calls use.
    """
    torch.manual_seed(0)
    torch.set_num_threads(1)  # one heap arena: multi-threaded allocation made peaks vary by 30%
    c = revit.ViTConfig(**{**revit.PRESETS[spec["preset"]], **spec["overrides"]})
    images = torch.randn(spec["batch"], c.in_channels, c.image_size, c.image_size)
    # Prime the runtime (thread pool, kernel libraries, lazily loaded code) with a narrow, 2-step
    # model of the same family on the same input, so their one-off RSS is not charged to the row.
    primer = revit.create_model(spec["preset"], **spec["overrides"], dim=8 * c.heads, ffn_dim=16 * c.heads,
                                depth=2, raptor_blocks=1).eval()
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
        model = revit.create_model(spec["preset"], **spec["overrides"]).eval()
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


def _ru_maxrss_kib() -> int:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


# --- training step (img/s, MFU) ---


def train_models(size: str) -> dict:
    rows = {"DeiT III": ("vit-" + size, {}), "reViT fixed": ("revit-" + size, {}),
            "reViT elastic 0.3": ("revit-" + size, {"depth_drop": 0.3})}
    for name in token_dispatch_presets(size):
        rows[name] = (name, {})
    return rows


def forward_flops(name: str, overrides: dict) -> float:
    """Model FLOPs of one image's forward for MFU: the flop_counter total (linear, attention, merge, aux).

    Elastic depth runs (1 - p) of the steps on average, so its recurrent part is scaled by that.
    """
    drop = overrides.get("depth_drop", 0.0)
    model, counted = count_preset(name, **{k: v for k, v in overrides.items() if k != "depth_drop"})
    total = counted["total"]
    macs = analytic_macs(model.config)
    fixed = 2 * (macs["patch_embed"] + macs["head"])
    return fixed + (1.0 - drop) * (total - fixed)


def bench_train(size="s", batch=8, device="cpu", compiled=False, warmup=1, repeats=5, iters=1,
                peak=None, lr=1e-4, profile=False) -> dict:
    device = torch.device(device)
    specs = train_models(size)
    fns, extra = {}, {}
    for label, (name, overrides) in specs.items():
        torch.manual_seed(0)
        model = revit.create_model(name, **overrides).to(device).train()
        c = model.config
        images = torch.randn(batch, c.in_channels, c.image_size, c.image_size, device=device)
        labels = torch.randint(0, max(c.num_classes, 1), (batch,), device=device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05,
                                      fused=device.type == "cuda")
        fn = _train_step(model, maybe_compile(model, compiled), optimizer, images, labels, device)
        extra[label] = {"preset": name, "overrides": overrides, "params_m": model.num_params() / 1e6,
                        "forward_gflops_per_image": forward_flops(name, overrides) / 1e9,
                        **first_call(fn, model, device, "first_step_s")}
        fns[label] = fn
    times = time_interleaved(fns, device, warmup, repeats, iters)
    rows = []
    for label in fns:
        row = {"model": label, "batch": batch, "compiled": compiled, **extra[label], **summary(times[label]),
               **paired_ratio(times[label], times["DeiT III"]),
               "recompiled_while_timed": label in times["recompiled"]}
        row["images_per_s"] = 1e3 * batch / row["median_ms"]
        if peak:
            achieved = 3 * row["forward_gflops_per_image"] * 1e9 * batch / (row["median_ms"] / 1e3)
            row["mfu"] = achieved / peak
        rows.append(row)
    if "reViT elastic 0.3" in fns:
        vs_fixed = paired_ratio(times["reViT elastic 0.3"], times["reViT fixed"])
        next(r for r in rows if r["model"] == "reViT elastic 0.3")["ratio_vs_fixed"] = vs_fixed
    if profile:
        for label, fn in fns.items():
            print(f"\n### profile: train step, {label}, batch {batch}\n", flush=True)
            print(profile_table(fn, device), flush=True)
    return {"rows": rows}


def _train_step(model, run, optimizer, images, labels, device):
    """One optimizer step as train.py takes it: task loss + the already-weighted aux losses."""
    step = [0]

    def call():
        if hasattr(model, "set_step"):
            model.set_step(step[0])
        with autocast(device):
            out = run(images, return_states=True)
            loss = F.cross_entropy(out["logits"].float(), labels) + sum(out["aux_losses"].values())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if hasattr(model, "after_optimizer_step"):
            model.after_optimizer_step()
        step[0] += 1
    return call


# --- targets (issue 6) ---


def latency_targets(rows: list[dict]) -> list[dict]:
    """cached <= 1.03x at every batch; folded 1.00x within noise; dynamic <= 1.10x at the largest batch;
    dynamic memory at batch 1 <= 0.55x (the compact deployment the paper measured)."""
    out = []
    largest = max(r["batch"] for r in rows)
    for r in rows:
        name, tag = r["model"], f"{r['mode']}, batch {r['batch']}"
        noise = max(0.02, (r["ratio_q3"] - r["ratio_q1"]) / 2)
        if name == "reViT cached":
            out.append(_target(f"reViT cached <= 1.03x DeiT III ({tag})", r["ratio"], r["ratio"] <= 1.03))
        if name == "reViT folded":
            out.append(_target(f"reViT folded = 1.00x +- noise {noise:.2f} ({tag})", r["ratio"],
                               abs(r["ratio"] - 1.0) <= noise))
        if name == "reViT dynamic" and r["batch"] == largest > 1:
            out.append(_target(f"reViT dynamic <= 1.10x DeiT III ({tag})", r["ratio"], r["ratio"] <= 1.10))
        if name == "reViT dynamic" and r["batch"] == 1 and "memory_ratio" in r and r["mode"] == rows[0]["mode"]:
            out.append(_target("reViT dynamic memory <= 0.55x DeiT III (batch 1)", r["memory_ratio"],
                               r["memory_ratio"] <= 0.55))
    return out


def train_targets(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        if r["model"] == "reViT fixed":
            out.append(_target("train step reViT fixed <= 1.10x DeiT III", r["ratio"], r["ratio"] <= 1.10))
        if r["model"] == "reViT elastic 0.3":
            ratio = r["ratio_vs_fixed"]["ratio"]
            out.append(_target("train step elastic 0.3 <= fixed depth", ratio, ratio <= 1.0))
    return out


def _target(text, value, ok):
    return {"target": text, "value": value, "met": bool(ok)}


# --- output ---


def markdown(rows: list[dict], columns: list[tuple]) -> str:
    """columns: (header, function of a row -> str)."""
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_cell(fn, r) for _, fn in columns) + " |")
    return "\n".join(lines)


def _cell(fn, row):
    try:
        return fn(row)
    except (KeyError, TypeError):
        return "–"


def f(key, fmt="{:.2f}"):
    return lambda r: fmt.format(r[key])


def print_params(result: dict) -> None:
    rows = result["rows"]
    print("## Parameters and GFLOPs/image, 224², 1000 classes, batch 1 (paper Table 1)\n")
    print(markdown([r for r in rows if r["table"] == "1"], [
        ("model", f("model", "{}")), ("params (M)", f("params_m")), ("paper", f("paper_params_m", "{}")),
        ("GFLOPs T=197", f("gflops")), ("GFLOPs T=198", f("gflops_t198")), ("paper", f("paper_gflops", "{}")),
        ("folded", f("gflops_folded")), ("flop_counter linear+merge", f("counter_linear_gflops", "{:.3f}")),
        ("+ attention", f("counter_attention_gflops", "{:.3f}")), ("+ router + other (MFLOPs)",
         lambda r: f"{r['counter_router_flops'] / 1e6:.3f} + {r['counter_other_flops'] / 1e6:.1f}"),
        ("= flop_counter total", f("counter_gflops", "{:.3f}"))]))
    print("\n## Depth-specific parameterizations at S/16 (paper Table 10), GFLOPs with T=198\n")
    print(markdown([r for r in rows if r["table"] == "10"], [
        ("model", f("model", "{}")), ("compact params (M)", f("params_m")), ("paper", f("paper_params_m", "{}")),
        ("GFLOPs online / folded", lambda r: f"{r['gflops_online_t198']:.2f} / {r['gflops_folded_t198']:.2f}"),
        ("paper", lambda r: f"{r['paper_gflops_online']} / {r['paper_gflops_folded']}"),
        ("source", lambda r: r.get("source", "module"))]))
    lora = next(r for r in rows if r["name"] == "lora-s")
    print(f"\nLoRA-S: shared model {lora['lora_shared_m']:.2f}M + adapters {lora['lora_adapters_m']:.2f}M "
          f"(paper 2.53M + 4.72M); source: {lora['source']}.")
    moe = [r for r in rows if r["table"] == "MoE U=1"]
    if moe:
        print("\n## Expert mechanisms at U = 1, S/16 (issue 5 presets): real cost against nominal U\n")
        print(markdown(moe, [("preset", f("name", "{}")), ("params (M)", f("params_m")),
                             ("flop_counter GFLOPs", f("counter_gflops", "{:.3f}")),
                             ("attention", f("counter_attention_gflops", "{:.3f}")),
                             ("measured U", f("measured_u", "{:.3f}")), ("module's nominal U", f("nominal_u", "{:.3f}"))]))
    else:
        print("\n(Expert-mechanism presets revit-s-*-u1 not in revit.PRESETS yet: their rows appear when they are.)")
    print("\nCounting rule (SPEC §1.9): 2 FLOPs per multiply-add of the linear layers, patch embedding and head; "
          "attention score/value products not counted; reViT online adds its per-step merge as E*P multiply-adds "
          "(2 E P FLOPs; as FLOPs instead of MACs reViT-B/L would be 34.1/120.7, not 34.3/121.5). T=197 is "
          "our token count (196 patches + class token). The paper's GFLOPs are reproduced in every cell with "
          "T=198, one more token (as a DeiT with a distillation token has); with T=197, B/L give 33.7/119.3 "
          "and reViT-B/L 34.2/120.9, LoRA-S online 10.3. flop_counter on the real module (meta device, "
          "reViT with merge_cache=False so the merge is counted) equals the T=197 analytic count exactly "
          "once its attention products (4 T^2 d per step), the router and, for reViT, the diversity loss its "
          "inference forward computes (2 E^2 P FLOPs; 'other') are set aside. Params: reViT-B/L count "
          "22.8M/39.8M here vs the paper's 23.6/40.9: the architecture as described (shared block, E full "
          "FFNs, 1-16-E router, stem, head) has no room for the extra 0.8M/1.1M.")


def print_latency(result: dict) -> None:
    print(f"## Inference latency and memory ({result['settings']['summary']})\n")
    print(markdown(result["rows"], [
        ("model", f("model", "{}")), ("mode", f("mode", "{}")), ("batch", f("batch", "{}")),
        ("params (M)", f("params_m")), ("latency ms (median)", f("median_ms")),
        ("IQR", lambda r: f"{r['q1_ms']:.2f}–{r['q3_ms']:.2f}"), ("min–max", lambda r: f"{r['min_ms']:.2f}–{r['max_ms']:.2f}"),
        ("vs DeiT III", lambda r: f"{r['ratio']:.3f} ({r['ratio_q1']:.3f}–{r['ratio_q3']:.3f})"),
        ("img/s", f("images_per_s", "{:.1f}")), ("memory (MiB)", f("memory_mib", "{:.1f}")),
        ("mem vs DeiT", f("memory_ratio", "{:.2f}")), ("1st call s", f("first_call_s", "{:.1f}"))]))
    print("\nvs DeiT III: median (IQR) over repeats of the per-round ratio, both timed in the same round.")
    _print_recompiled(result["rows"])


def print_train(result: dict) -> None:
    print(f"## Training step ({result['settings']['summary']})\n")
    print(markdown(result["rows"], [
        ("model", f("model", "{}")), ("params (M)", f("params_m")), ("step ms (median)", f("median_ms")),
        ("IQR", lambda r: f"{r['q1_ms']:.1f}–{r['q3_ms']:.1f}"),
        ("vs DeiT III", lambda r: f"{r['ratio']:.3f} ({r['ratio_q1']:.3f}–{r['ratio_q3']:.3f})"),
        ("img/s", f("images_per_s", "{:.1f}")), ("fwd GFLOPs/img", f("forward_gflops_per_image")),
        ("MFU", lambda r: f"{100 * r['mfu']:.1f}%" if "mfu" in r else "unknown"),
        ("memory (MiB)", f("memory_mib", "{:.0f}"))]))
    _print_recompiled(result["rows"])
    elastic = next((r for r in result["rows"] if "ratio_vs_fixed" in r), None)
    if elastic:
        v = elastic["ratio_vs_fixed"]
        print(f"\nelastic 0.3 vs fixed depth: {v['ratio']:.3f} ({v['ratio_q1']:.3f}–{v['ratio_q3']:.3f})")
    print("\nMFU = 3 x forward FLOPs (flop_counter: linear, attention, merge, aux; elastic: recurrent part x 0.7) "
          "x img/s / peak bf16 FLOP/s; 'unknown' where the device's peak is not in the table (always on CPU).")


def _print_recompiled(rows):
    flagged = [f"{r['model']} ({r.get('mode', 'train')}, batch {r['batch']})" for r in rows
               if r.get("recompiled_while_timed")]
    if flagged:
        print("torch.compile built new graphs inside timed regions of: " + ", ".join(flagged) + ".")


def print_targets(targets: list[dict]) -> None:
    if targets:
        print("\n## Targets (issue 6)\n")
        print(markdown(targets, [("target", f("target", "{}")), ("measured", f("value", "{:.3f}")),
                                 ("met", lambda r: "yes" if r["met"] else "**no**")]))


# --- command line ---

CPU_DEFAULTS = {"latency": dict(batches="1,8", modes="eager,compiled", warmup=2, repeats=7, iters=1),
                "train": dict(batch=8, compile=False, warmup=1, repeats=5, iters=1)}
CUDA_DEFAULTS = {"latency": dict(batches="1,64", modes="compiled", warmup=10, repeats=30, iters=20),
                 "train": dict(batch=128, compile=True, warmup=5, repeats=20, iters=5)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p):
        p.add_argument("--out", help="also write the JSON results to this file")
        p.add_argument("--device", default="auto", help="auto (CUDA when available, else CPU), cpu or cuda")
        p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")

    p = sub.add_parser("params", help="parameters and GFLOPs/image at S/B/L (paper Tables 1 and 10)")
    p.add_argument("--out", help="also write the JSON results to this file")
    p.add_argument("--sizes", default="s,b,l", help="comma-separated model sizes (s, b, l)")
    p.add_argument("--no-counter", action="store_true", help="skip the flop_counter cross-check")

    for name, text in [("latency", "inference latency and memory, DeiT III vs reViT dynamic/cached/folded"),
                       ("train", "training-step throughput and MFU")]:
        p = sub.add_parser(name, help=text)
        common(p)
        p.add_argument("--size", default="s", choices=["s", "b", "l", "mini", "mini32"],
                       help="model size of the presets (vit-SIZE, revit-SIZE); s = ViT-S/16 at 224²")
        p.add_argument("--warmup", type=int, help="untimed calls first (CPU 2/1, CUDA 10/5 for latency/train)")
        p.add_argument("--repeats", type=int, help="timed regions per row (CPU 7/5, CUDA 30/20)")
        p.add_argument("--iters", type=int, help="calls per timed region (CPU 1, CUDA 20/5)")
        p.add_argument("--profile", action="store_true", help="also print a torch.profiler op table per row")
    lat, train = sub.choices["latency"], sub.choices["train"]
    lat.add_argument("--batches", help="comma-separated batch sizes (CPU 1,8; CUDA 1,64 as in Table 7)")
    lat.add_argument("--modes", help="comma-separated: eager, compiled (CPU both; CUDA compiled)")
    lat.add_argument("--no-memory", action="store_true", help="skip the memory measurement")
    train.add_argument("--batch", type=int, help="batch size (CPU 8, CUDA 128)")
    train.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                       help="torch.compile the model (CUDA default on, CPU off)")
    train.add_argument("--peak-tflops", type=float, help="device peak for MFU (default: table for known GPUs)")

    return parser


def resolve(args, device) -> dict:
    """Fill unset flags with the device's defaults; say which were defaults."""
    defaults = (CUDA_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS)[args.command]
    used = {}
    for key, value in defaults.items():
        flag = "compile" if key == "compile" else key
        if getattr(args, flag, None) is None:
            setattr(args, flag, value)
            used[key] = value
    return used


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_memory"]:  # internal: one CPU memory row, in the fresh process cpu_memory starts
        result = _memory_worker(json.loads(argv[1]))
        print(json.dumps(result))
        return result
    args = build_parser().parse_args(argv)
    if args.command == "params":
        result = {"command": "params", **bench_params(tuple(args.sizes.split(",")), with_counter=not args.no_counter)}
        result["env"] = environment(torch.device("cpu"))
        print_params(result)
    else:
        device = pick_device(args.device)
        if args.threads:
            torch.set_num_threads(args.threads)
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        defaults = resolve(args, device)
        env = environment(device)
        precision = "bf16 autocast" if device.type == "cuda" else "fp32"
        if args.command == "latency":
            batches = tuple(int(b) for b in args.batches.split(","))
            modes = tuple(args.modes.split(","))
            settings = {"size": args.size, "batches": batches, "modes": modes, "warmup": args.warmup,
                        "repeats": args.repeats, "iters": args.iters, "precision": precision,
                        "defaults_used": defaults}
            result = {"command": "latency", "env": env, "settings": settings,
                      **bench_latency(args.size, batches, modes, device, args.warmup, args.repeats, args.iters,
                                      memory=not args.no_memory, profile=args.profile)}
            result["targets"] = latency_targets(result["rows"]) if args.size == "s" else []
            settings["summary"] = (f"{args.size.upper()}, {precision}, batches {list(batches)}, {'/'.join(modes)}, "
                                   f"warm-up {args.warmup}, {args.repeats} repeats x {args.iters} calls")
            print_latency(result)
        else:
            peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(device)
            settings = {"size": args.size, "batch": args.batch, "compiled": args.compile, "warmup": args.warmup,
                        "repeats": args.repeats, "iters": args.iters, "precision": precision,
                        "peak_flops": peak, "defaults_used": defaults,
                        "token_dispatch_presets": token_dispatch_presets(args.size)}
            result = {"command": "train", "env": env, "settings": settings,
                      **bench_train(args.size, args.batch, device, args.compile, args.warmup, args.repeats,
                                    args.iters, peak, profile=args.profile)}
            result["targets"] = train_targets(result["rows"]) if args.size == "s" else []
            settings["summary"] = (f"{args.size.upper()}, {precision}, batch {args.batch}, "
                                   f"{'compiled' if args.compile else 'eager'}, AdamW, warm-up {args.warmup}, "
                                   f"{args.repeats} repeats x {args.iters} steps")
            print_train(result)
        if device.type == "cpu" and defaults:
            print(f"\nCPU-sized defaults used: {defaults} (CUDA defaults: {CUDA_DEFAULTS[args.command]}).")
        if device.type == "cpu":
            print("GPU numbers: run the same command on a CUDA machine (bf16 autocast + torch.compile).")
        print_targets(result.get("targets", []))
        print(f"\n{env['date']} · torch {env['torch']} · {env.get('gpu', env['cpu'])} · "
              f"{env['cpu_count']} CPUs, {env['torch_threads']} threads · git {env.get('git', '?')}")
    text = json.dumps(result, default=str, separators=(",", ":"))
    if getattr(args, "out", None):
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
