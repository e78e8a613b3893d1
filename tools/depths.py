"""Choose your depth: one checkpoint's accuracy and cost at every depth it can run at.

reViT (arXiv 2610.12448, §3.2, §4.4) at depths 2 ... 2L; AlterNet (arXiv 2611.08741) at every iteration cap
D' <= D and halting threshold; the planted-depth task by its test MSE (lower is better).

    python -m tools.depths out/revit-mini-<time>/ckpt.pt                  # depths 2 ... 2L, table, plot
    python -m tools.depths CKPT --depths 2,4,6,8 --test-subset 2000       # some depths, on 2,000 test images
    python -m tools.depths out/alternet-tiny-<time>/ckpt.pt --test-subset 32   # caps x thresholds
    python -m tools.depths CKPT --depths 2,4 --thresholds 0.5               # AlterNet: caps 2, 4 (and D)

Accuracy (bits per byte, MSE) is train.py's evaluation. Each row is timed in the same rounds as the
reference (the trained depth), so a busy machine slows both; the table marks the Pareto rows, and the last
line names the smallest depth as good as the reference and whether it is faster beyond the timing spread.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import statistics
import sys
from collections import namedtuple

import torch
from tqdm import tqdm

if not __package__:  # run as a file (python tools/depths.py): the project's modules are not on the path
    sys.exit("tools/depths.py: error: run it from the repository root as python -m tools.depths")

import alternet
import bench
from lib import moe
import revit
import train
from lib.checkpoint import load_model
from lib.boundary import MAX_DEPTH, check_numbers, closed, fail, outputs_problem, parse_depths
from lib.cli import ArgumentParser, f, markdown, non_finite_place, pick_device, pyplot, write_json
from lib.cli import run_main  # Ctrl-C: one line
from tools.plot import save_png

PROG = "python -m tools.depths"  # how it runs: from the repository root, as a module


def evaluation_task(args, ckpt: dict, device: torch.device):
    """CKPT's test data (or text) as train.py evaluates it; --data and --data-dir are the command line's,
    never the checkpoint's, and --depths decides the depths."""
    if ckpt["arch"] in moe.PRESETS and (ckpt.get("train_config") or {}).get("teacher"):
        fail("CKPT was trained by distillation (no classifier head): depths reports top-1 accuracy", PROG)
    given = {"test_subset": args.test_subset, "data": args.data, "data_dir": args.data_dir}
    flags = {"device": str(device), "download": False, "progress": False, "eval_depths": "",
             **{k: v for k, v in given.items() if v}}
    try:
        return train.evaluation_setup(args.checkpoint, flags, flag="CKPT")[2]
    except SystemExit as e:  # train.py's one-line error, under this tool's name
        fail(str(e.code).partition(": error: ")[2] or str(e.code), PROG)


# --- vision: every depth, in the form a user deploys and in the compact form ---


def single_depth(config) -> str | None:
    """What runs only at its trained depth: an untied ViT, layer-wise LoRA (one adapter per trained step)."""
    if config.arch == "vit":
        return "an untied ViT"
    return "layer-wise LoRA (one adapter per trained step)" if getattr(config, "ffn", "") == "lora" else None


def depth_list(given: list[int], model) -> list[int]:
    """--depths and the reference depth L; default 2 ... 2L (a ViT or layer-wise LoRA: L only)."""
    c, kind, listed = model.config, single_depth(model.config), ",".join(map(str, given))
    if kind and given not in ([], [c.depth]):
        fail(f"--depths {listed}: {kind} runs only its own depth {c.depth}", PROG)
    return sorted(set(given or ([c.depth] if kind else range(2, 2 * c.depth + 1))) | {c.depth})


def cap_list(given: list[int], lm) -> list[int]:
    """--depths as AlterNet's iteration caps D' and the trained D; default 1 ... D."""
    d = lm.config.max_depth
    if max(given, default=d) > d:
        fail(f"--depths {','.join(map(str, given))}: AlterNet's caps D' run 1..{d} (CKPT's D)", PROG)
    return sorted(set(given or range(1, d + 1)) | {d})


def deployed_model(model, depth: int) -> tuple:
    """What a user deploys at `depth` -> (module, depth argument): revit.fold's plain ViT where the model
    folds (Raptor, reViT with a depth-only gate; paper §3.1), else the model itself (with its merge cache)."""
    c = model.config
    if c.arch == "raptor" or (c.arch == "revit" and getattr(c, "depth_programmed", True)):
        return revit.fold(model, depth), None
    return model, None if c.arch == "vit" else depth


def runner(module, depth_arg):
    return functools.partial(module, depth=depth_arg) if depth_arg else module


def vision_depth_rows(model, task, depths, args, device, family: str) -> list[dict]:
    """One row per depth: train.py's accuracy, GFLOPs per image and latency per image of the deployed form
    and of the dynamic one (the compact checkpoint at that depth: reViT merges its experts on every call,
    as the paper's Table 7 measured)."""
    c = model.config
    merges = c.arch == "revit" and getattr(c, "ffn", "merge") == "merge" and c.num_experts > 1
    dynamic = copy_module(model, merge_cache=False) if merges else model
    shape = (c.in_channels, c.image_size, c.image_size)
    inputs = {batch: torch.randn(batch, *shape, device=device) for batch in (1, args.batch)}
    module, depth_arg = deployed_model(model, c.depth)
    if module is model and c.arch != "vit":  # the reference's own merge cache: no row's depth evicts it
        module = copy_module(model)
    reference, rows = bench.inference_call(runner(module, depth_arg), inputs[1], device), []
    for depth in progress(depths, args, "depths"):
        key = None if depth == c.depth else depth  # None: the reference depth
        row = {"depth": depth, "reference": depth == c.depth, "batch": args.batch,
               **train.evaluate(model, task, [key])[key]}
        refuse_non_finite(row, f"depth {depth}", "; choose --depths without it")
        module, depth_arg = deployed_model(model, depth)
        row["deployed_form"] = "folded" if module is not model else "model"
        row["gflops"] = bench.counted_flops(module, depth_arg)["total"] / 1e9
        forms = {"deployed": runner(module, depth_arg),
                 "dynamic": runner(dynamic, None if c.arch == "vit" else depth)}
        fns = {(form, batch): bench.inference_call(run, x, device)
               for batch, x in inputs.items() for form, run in forms.items()}
        if row["reference"]:
            fns["deployed", 1] = reference
        times = timed_against_reference(fns, reference, ("deployed", 1), row, args, device)
        for form, batch in fns:
            ms = statistics.median(times[form, batch]) * 1e3 / batch
            row[f"{form}_ms_b{'1' if batch == 1 else 'n'}"] = ms
        rows.append(row)

    def deployed_call(row):
        return bench.inference_call(runner(*deployed_model(model, row["depth"])), inputs[1], device)
    resolve_headline(rows, family, deployed_call, reference, args, device)
    return rows


def timed_against_reference(fns: dict, reference, compared, row: dict, args, device, resolve=0.0) -> dict:
    """Seconds per call of each fn; fns[compared] timed in rounds of its own with the reference, each first
    in every other round (resolve > 0: more rounds until their ratio is known to +- resolve), the other fns
    in rounds after them. row["relative_latency"]: the median of the per-round ratios fns[compared] /
    reference and its 95% bootstrap interval (both timed under the same load); the reference's own: 1.
    Why a pair: in one rotation of every fn, the reference always ran right after the batch-n call, which
    slows the next call (its caches evicted): the reference measured against itself read 0.95-0.99."""
    alone = fns[compared] is reference  # the reference row: one call, its ratio to itself 1 by definition
    pair = {compared: fns[compared], **({} if alone else {"reference": reference})}
    times = bench.time_interleaved(pair, device, args.warmup, args.repeats, args.iters)
    times = bench.resolve_ratio(pair, times, device, args.iters, resolve, args.max_repeats,
                                pair=(compared, "reference"))
    rest = {label: fn for label, fn in fns.items() if label != compared}
    times.update(bench.time_interleaved(rest, device, args.warmup, args.repeats, args.iters) if rest else {})
    paired = bench.paired_ratio(times[compared], times[compared if alone else "reference"])
    row.update(relative_latency=paired["ratio"], relative_latency_ci95=paired["ratio_ci95"])
    return times


def progress(items, args, what: str):
    """A progress bar on stderr when it is a terminal (piped output stays clean)."""
    return tqdm(items, desc=what, disable=not args.progress or not sys.stderr.isatty(), leave=False)


def refuse_non_finite(row: dict, where: str, hint: str = "") -> None:
    """As train.py --eval-only: a row that overflowed (finite weights, a depth not trained) is never kept."""
    place = non_finite_place(row)
    if place:
        fail(f"CKPT: its evaluation at {where} gave a non-finite {place} (finite weights that diverge there)"
             f"{hint}; nothing written", PROG)


def copy_module(model, **changes):
    """A second module in eval mode, same weights (config `changes` leave the parameters as they are)."""
    copy = type(model)(dataclasses.replace(model.config, **changes)).to(next(model.parameters()).device)
    copy.load_state_dict(model.state_dict())
    return copy.eval()


# --- the pick: the Pareto rows and the smallest depth that is as good ---


def mark_tradeoffs(rows: list[dict], quality: str, cost: str, higher_is_better: bool) -> None:
    """Flag the Pareto-optimal rows: no other row is at least as good and as cheap, and better in one."""
    sign = 1 if higher_is_better else -1
    for r in rows:
        r["pareto"] = not any(sign * o[quality] >= sign * r[quality] and o[cost] <= r[cost] and
                              (sign * o[quality] > sign * r[quality] or o[cost] < r[cost]) for o in rows)


def smallest_good(rows, size_key: str, quality: str, tolerance: float, higher_is_better: bool) -> tuple:
    """(the reference row, the smallest row whose quality is within `tolerance` of the reference's)."""
    ref = next(r for r in rows if r["reference"])
    sign = 1 if higher_is_better else -1
    good = min((r for r in rows if sign * (r[quality] - ref[quality]) >= -tolerance),
               key=lambda r: (r[size_key], r["relative_latency"]))
    return ref, good


def resolve_headline(rows, family: str, call_of, reference, args, device) -> None:
    """The headline's row timed again beside the reference until their latency ratio is known to +-
    --resolve: the one comparison the last line states."""
    ref, good = smallest_good(rows, *HEADLINE[family][:4])
    if good is not ref and args.resolve:
        timed_against_reference({"row": call_of(good)}, reference, "row", good, args, device, args.resolve)


# the headline of each family, smallest_within's arguments; label: the quality's table column and plot axis
Headline = namedtuple("Headline", "size quality tolerance higher_is_better unit scale name label")
# planted: its target is layer-normed (unit variance per token), so 0.005 MSE is half a percent of it
HEADLINE = {"vision": Headline("depth", "acc", 0.005, True, "points", 100, "depth", "top-1 %"),
            "planted": Headline("depth", "mse", 0.005, False, "MSE", 1, "depth",
                                "test MSE (lower is better)"),
            "language": Headline("max_depth", "bpb", 0.01, False, "bits/byte", 1, "cap D'", "bits/byte")}
SAME_SPEED = 0.05  # a latency ratio this close to 1 is "as fast": smaller gaps flip with the load of a CPU


def smallest_within(rows, size_key: str, quality: str, tolerance: float, higher_is_better: bool, unit: str,
                    scale: float = 1.0, name: str = "depth") -> str:
    """"depth 4: −0.3 points, 1.90× faster than the reference (depth 6)": faster or slower only where the
    95% interval of the paired latency ratio lies beyond 1 ± SAME_SPEED."""
    ref, good = smallest_good(rows, size_key, quality, tolerance, higher_is_better)

    def setting(row):  # AlterNet's rows: a cap and a halting threshold
        threshold = f" at halt threshold {row['halt_threshold'] or 'none'}" if "halt_threshold" in row else ""
        return f"{name} {row[size_key]}{threshold}"
    if good is ref:
        return f"no smaller {name} is within {scale * tolerance:g} {unit} of the reference ({setting(ref)})"
    change = scale * (good[quality] - ref[quality])
    delta = f"{change:+.{1 if scale > 1 else 3}f}".replace("-", "−")
    # lower is better (bits/byte, MSE): a bare + reads as a gain, so say which way it moved
    moved = "" if higher_is_better or not change else " (worse)" if change > 0 else " (better)"
    ratio, (low, high) = good["relative_latency"], good["relative_latency_ci95"]
    than = f"the reference ({setting(ref)})"
    timing = (f"{1 / ratio:.2f}× faster than {than}" if high < 1 - SAME_SPEED else
              f"{ratio:.2f}× slower than {than}" if low > 1 + SAME_SPEED else
              f"as fast as {than} within {SAME_SPEED:.0%} and the timing spread (95% interval of the latency "
              f"ratio: {low:.2f}–{high:.2f})")
    return f"{setting(good)}: {delta} {unit}{moved}, {timing}"


# --- language: every iteration cap D' <= D and halting threshold ---


def causal_scores(lm, task, windows, cap: int, threshold, device) -> dict:
    """Bits per byte and mean iterations per position, each position routed and halted on its own prefix
    as in generation (alternet.causal_loss)."""
    ce = iterations = 0.0
    for chunk in windows.split(task.cfg.eval_batch_size):
        chunk = chunk.to(device)
        with torch.inference_mode(), bench.autocast(device):
            causal = alternet.causal_loss(lm, chunk[:, :-1], chunk[:, 1:], max_depth=cap,
                                          halt_threshold=threshold)
        ce, iterations = ce + float(causal["ce"].sum()), iterations + float(causal["iterations"].sum())
    tokens = windows[:, 1:].numel()
    return {"bpb": ce / tokens * task.tokens_per_byte / math.log(2), "mean_iterations": iterations / tokens}


def language_depth_rows(lm, task, caps, args, device) -> list[dict]:
    """Rows over caps D' (default 1 .. D) and halting thresholds: causal bits per byte, mean iterations,
    latency per generated token (greedy, batch 1), each setting timed in the same rounds as the reference."""
    n, t = (len(task.val) - 1) // task.block_size, task.block_size  # train.py's validation windows (n, T+1)
    windows = task.val[:n * t + 1].unfold(0, t + 1, t)[:args.test_subset or n]
    thresholds = (args.thresholds or THRESHOLDS) if lm.config.halting else [None]
    prompt = windows[:1, :min(16, windows.shape[1] - 1)].to(device)

    def generate(cap, threshold):
        with torch.inference_mode(), bench.autocast(device):
            return lm.generate(prompt, max_new_tokens=args.new_tokens, halt_threshold=threshold,
                               max_depth=cap, temperature=0)

    reference = (lm.config.max_depth, thresholds[0])
    settings = [(cap, threshold) for cap in caps for threshold in thresholds]
    rows = []
    for cap, threshold in progress(settings, args, "caps"):
        rows.append({"max_depth": cap, "halt_threshold": threshold,
                     "reference": (cap, threshold) == reference,
                     **causal_scores(lm, task, windows, cap, threshold, device)})
        refuse_non_finite(rows[-1], f"cap D'={cap}, threshold {threshold}")
    fns = {setting: functools.partial(generate, *setting) for setting in settings}
    for setting, row in zip(settings, rows):
        times = timed_against_reference({"row": fns[setting]}, fns[reference], "row", row, args, device)
        row.update(ms_per_token=statistics.median(times["row"]) * 1e3 / args.new_tokens,
                   bpb_metric="alternet.causal_loss")
    call_of = lambda r: fns[r["max_depth"], r["halt_threshold"]]  # noqa: E731
    resolve_headline(rows, "language", call_of, fns[reference], args, device)
    return rows


THRESHOLDS = [0.5, None]  # --thresholds' default: halting at 0.5 (the reference), and every iteration


def parse_thresholds(text: str) -> list:
    """--thresholds: 'none' (run every iteration up to the cap) and values in (0, 1]."""
    try:
        values = [None if t.strip().lower() == "none" else float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = []
    if not values or any(v is not None and not 0 < v <= 1 for v in values):
        fail(f"--thresholds must be comma-separated values in (0, 1] or 'none'; got {text!r}", PROG)
    return values


# --- output: the table, the plot, the run ---


PAIRED = ("latency ÷ ref: each row timed in the same rounds as the reference, the median of the per-round "
          "ratios (batch 1) and its 95% bootstrap interval; pareto: no other row is both as good and as "
          "fast.")


def depths_markdown(result: dict) -> str:
    rows, s, label = result["rows"], result["settings"], HEADLINE[result["family"]].label
    mark = lambda r: ("**ref** " if r["reference"] else "") + ("pareto" if r["pareto"] else "")  # noqa: E731
    relative = ("latency ÷ ref (95%)", lambda r: "{:.2f} ({:.2f}–{:.2f})".format(r["relative_latency"],
                                                                                *r["relative_latency_ci95"]))
    if result["family"] == "language":
        table = markdown(rows, [
            ("cap D'", f("max_depth", "{}")),
            ("halt threshold", lambda r: f"{r['halt_threshold'] or 'none'}"),
            (label, f("bpb", "{:.4f}")), ("mean iterations", f("mean_iterations")),
            ("ms/token", f("ms_per_token", "{:.3f}")), relative, ("", mark)])
        note = (f"bits/byte: {rows[0]['bpb_metric']}; latency: greedy generation of {s['new_tokens']} "
                f"tokens, batch 1; {PAIRED}")
    else:
        form = rows[0]["deployed_form"]
        quality = f("mse", "{:.5f}") if result["family"] == "planted" else lambda r: f"{100 * r['acc']:.2f}"
        table = markdown(rows, [
            ("depth", f("depth", "{}")), (label, quality),
            ("GFLOPs/img", f("gflops", "{:.4f}")), (f"ms/img b1 ({form})", f("deployed_ms_b1", "{:.3f}")),
            ("ms/img b1 dynamic", f("dynamic_ms_b1", "{:.3f}")),
            (f"ms/img b{s['batch']}", f("deployed_ms_bn", "{:.3f}")),
            (f"ms/img b{s['batch']} dynamic", f("dynamic_ms_bn", "{:.3f}")), relative, ("", mark)])
        note = (f"test images: {s['test_images']}; latency per image, median of at least {s['repeats']} x "
                f"{s['iters']} calls; {form}: what a user deploys at that depth; dynamic: the compact "
                f"checkpoint at that depth (reViT merges its experts on every call); {PAIRED}")
    title = f"## Choose your depth: {result['checkpoint']} ({result['arch']})"
    return f"{title}\n\n{table}\n\n{note}\n\n{result['best']}"


def plot_depths(result: dict, path: str) -> str | None:
    """Accuracy (or bits/byte) against latency, one point per depth (cap), the reference ringed."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.6), dpi=120)
    language = result["family"] == "language"
    x_key = "ms_per_token" if language else "deployed_ms_b1"
    headline = HEADLINE[result["family"]]
    groups = {}
    for r in result["rows"]:
        groups.setdefault(r.get("halt_threshold", "deployed"), []).append(r)
    for name, rows in groups.items():
        ys = [r[headline.quality] * headline.scale for r in rows]
        ax.plot([r[x_key] for r in rows], ys, "o-", label=f"threshold {name}" if language else None)
        for r, y in zip(rows, ys):
            ax.annotate(str(r[headline.size]), (r[x_key], y), textcoords="offset points", xytext=(4, 4),
                        fontsize=7)
            if r["reference"]:
                ax.plot([r[x_key]], [y], "o", ms=11, mfc="none", mec="k")
    ax.set_xlabel("ms per generated token" if language else "ms per image (deployed, batch 1)")
    ax.set_ylabel(headline.label)
    ax.set_title(f"{result['arch']}: {'iteration cap' if language else 'depth'} vs cost", fontsize=9)
    if language:
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)
    return path


def run_depths(args, model, ckpt: dict, device) -> dict:
    if args.thresholds and not getattr(model.config, "halting", False):
        fail(f"--thresholds: halting thresholds are AlterNet's; CKPT ({ckpt['arch']}) has no halting", PROG)
    task = evaluation_task(args, ckpt, device)
    family = ("language" if ckpt["arch"] not in moe.PRESETS else
              "planted" if (ckpt.get("train_config") or {}).get("dataset") == "planted" else "vision")
    settings = {k: getattr(args, k) for k in ("batch", "warmup", "repeats", "iters", "new_tokens",
                                              "test_subset", "resolve", "max_repeats")}
    if family == "language":
        rows = language_depth_rows(model, task, cap_list(args.depths, model), args, device)
    else:
        rows = vision_depth_rows(model, task, depth_list(args.depths, model), args, device, family)
        settings["test_images"] = len(task.data.test)
    mark_tradeoffs(rows, HEADLINE[family].quality, "relative_latency", HEADLINE[family].higher_is_better)
    kind = family != "language" and single_depth(model.config)
    best = f"{kind} runs only its own depth {model.config.depth}" if kind else \
        smallest_within(rows, *HEADLINE[family][:7])  # all but the label
    result = {"command": "depths", "checkpoint": args.checkpoint, "arch": ckpt["arch"], "family": family,
              "settings": settings, "rows": rows, "best": best, "env": bench.environment(device)}
    result["plot"] = plot_depths(result, os.path.join(args.out, "depths.png"))  # atomic_write makes --out
    print(depths_markdown(result) + "\n\n" + bench.environment_line(result["env"]))
    write_json(result, os.path.join(args.out, "depths.json"))
    picture = f"and {result['plot']}" if result["plot"] else \
        "(no depths.png: matplotlib is not installed; pip install -r requirements-extra.txt)"
    print(f"wrote {os.path.join(args.out, 'depths.json')} {picture}")
    return result


# --- command line ---

DEFAULTS = {"cpu": dict(batch=16, warmup=1, repeats=5, iters=1, max_repeats=60),
            "cuda": dict(batch=64, warmup=10, repeats=20, iters=10, max_repeats=200)}


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="CKPT", help="a checkpoint written by train.py (vision or AlterNet)")
    bench.device_flags(p)
    p.add_argument("--depths", default="", help=f"comma-separated depths, each in 2..{MAX_DEPTH} (default 2 "
                   "... 2L; a ViT: L); AlterNet: its iteration caps D', each in 1..D (default 1 ... D)")
    p.add_argument("--test-subset", type=int, default=0,
                   help="the first N test images / validation windows (default: the checkpoint's test set)")
    p.add_argument("--batch", type=int,
                   help="vision: the larger latency batch (CPU 16, CUDA 64); batch 1 always")
    bench.timing_flags(p, "CPU 1, CUDA 10", "CPU 5, CUDA 20", "CPU 1, CUDA 10")
    p.add_argument("--resolve", type=float, default=0.03, help="more paired rounds of the headline's row and "
                   "the reference until their latency ratio is known to +- this (default 0.03; 0: none)")
    p.add_argument("--max-repeats", type=int, help="at most this many paired rounds (CPU 60, CUDA 200)")
    p.add_argument("--thresholds", help="AlterNet: halting thresholds in (0, 1] or none (every iteration up "
                   "to the cap); the first is the reference (default 0.5,none)")
    p.add_argument("--new-tokens", type=int, default=16, help="AlterNet: tokens generated per latency call")
    p.add_argument("--out", help="folder for depths.json and depths.png (default: the checkpoint's folder)")
    p.add_argument("--data", default="", help="the run's --data, if it had one (paths come from the "
                   "command line, never from the checkpoint)")
    p.add_argument("--data-dir", default="", help="where the built-in data sets are (train.py's)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="a progress bar on stderr, when it is a terminal")
    return p


def main(argv=None) -> dict:
    """Every flag checked (lib/boundary.py), those of one family once CKPT is read, then the table."""
    args = build_parser().parse_args(argv)
    check_numbers(vars(args), PROG, batch=closed(2, 65536))  # the flags given (batch 1 is always measured)
    args.thresholds = None if args.thresholds is None else parse_thresholds(args.thresholds)
    args.out = args.out or os.path.dirname(os.path.abspath(args.checkpoint))
    problem = outputs_problem("--out", args.out, ("depths.json", "depths.png"), runs_ok=True)  # beside a run
    if problem:
        fail(problem, PROG)
    try:
        device = pick_device(args.device)
        model, ckpt = load_model(args.checkpoint, device, "CKPT")
    except ValueError as e:  # the one line of the device or the checkpoint's reader
        fail(str(e), PROG)
    vision = ckpt["arch"] in moe.PRESETS
    # vision depths from 2 (s_t = t/(L-1) needs two steps); AlterNet's iteration caps from 1
    args.depths = parse_depths(args.depths, "--depths", 2 if vision else 1, PROG)
    if args.batch and not vision:  # before the defaults fill it in
        fail(f"--batch: a vision model's latency batch; CKPT ({ckpt['arch']}) is timed at batch 1", PROG)
    defaults = DEFAULTS["cuda" if device.type == "cuda" else "cpu"]
    vars(args).update({k: v for k, v in defaults.items() if getattr(args, k) is None})
    if args.threads:
        torch.set_num_threads(args.threads)
    return run_depths(args, model, ckpt, device)


if __name__ == "__main__":
    run_main(main, "every file it writes is written whole or not at all")
