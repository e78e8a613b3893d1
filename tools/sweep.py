"""sweep.py: small-scale evidence with seeds and error bars, for reViT (arXiv 2610.12448).

    python -m tools.sweep                          # experts + elastic grids at d48-L12, 3 seeds per cell
    python -m tools.sweep --grids tying --regime d48-L6     # what tying the blocks costs at L = 6
    python -m tools.sweep --quick                  # the same code paths on a tiny model (a minute or two)
    python -m tools.sweep --shard 1/2 & python -m tools.sweep --shard 2/2; wait; python -m tools.sweep

Each cell of a grid is one `python train.py ...` run per seed, in its own process (one thread unless
--threads or OMP_NUM_THREADS says otherwise), its output in OUT/runs/KEY/train.log. A finished run is
recorded in OUT/cells/KEY.json with the commit and torch version it was trained at; a sweep run again
reuses every finished cell with the same train.py command, and a run killed mid-way continues from its
checkpoint. The tables (RESULTS.md's, lib/tables.py: accuracy vs E, Table 5; accuracy vs inference
depth after elastic training, Fig. 2; mean ± std over seeds) are printed, written to OUT/quality.json and
drawn in OUT/quality_*.png. The last stdout line is the JSON document.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys

import torch

if not __package__:  # run as a file (python tools/sweep.py): the project's modules are not on the path
    sys.exit("tools/sweep.py: error: run it from the repository root as python -m tools.sweep")

import revit
from lib import tables, tasks
from lib.checkpoint import load_model
from lib.boundary import MAX_DEPTH, check_numbers, fail, outputs_problem
from lib.cli import ArgumentParser, git_commit, json_text, pick_device, pyplot, run_main, say, write_json
from tools.depths import progress
from tools.plot import save_png

PROG = "python -m tools.sweep"  # how it runs: from the repository root, as a module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
TRAIN_COMMAND = (sys.executable, os.path.join(ROOT, "train.py"))  # what a cell runs, before its flags

# A regime: train.py flags ({field: value}) shared by every cell; each cell below overrides a few fields
# (its model_args are merged into the regime's, the cell's value winning). Fashion-MNIST at width 48, 7x7
# patches, 3 epochs, one thread per run. At L = 6 tying the six blocks costs the untied ViT 1.4 +- 0.4
# points; at L = 12 (the default, ~3 min a run) 2.7 +- 0.1 (`--grids tying --regime d48-L6`): there an
# expert bank has something to recover.
REGIMES = {
    "d48-L12": {"arch": "revit-mini", "epochs": 3, "depth": 12, "model_args": "dim=48,heads=3,ffn_dim=96"},
    "d48-L6": {"arch": "revit-mini", "epochs": 3, "model_args": "dim=48,heads=3,ffn_dim=96"},
}
# --quick: the same cells on a tiny model (two optimizer steps each), for the test suite.
QUICK_REGIME = {"arch": "revit-mini", "max_steps": 2, "train_subset": 256, "test_subset": 128,
                "batch_size": 64, "depth": 3, "model_args": "dim=16,heads=2,ffn_dim=24"}


def merge_model_args(base: str, extra: str) -> str:
    """'dim=48,heads=3' + 'dim=32,ffn=feature' -> 'dim=32,heads=3,ffn=feature': the cell's value wins."""
    pairs = dict(item.split("=", 1) for text in (base, extra) for item in text.split(",") if item)
    return ",".join(f"{key}={value}" for key, value in pairs.items())


def planted(model_args: str = "", **fields) -> dict:
    """A cell of the planted-depth task (train.py --dataset planted, lib/planted.PlantedTask: regress
    LN(f_4 ∘ ... ∘ f_1(x)) per token, distinct fixed random maps f_t): its own data, depth, patch and width,
    whatever the regime; `model_args` are added to its width's."""
    return {"dataset": "planted", "depth": 4, "patch_size": 4, "epochs": 8, **fields,
            "model_args": merge_model_args("dim=48,heads=3,ffn_dim=96", model_args)}


ELASTIC = {"depth_drop": 0.3, "eval_depths": "2,3,4,5,6,7,8"}  # elastic training, scored at L = 2 ... 8
# Distillation (§4.2, App. A.3, Eq. 5): the regime's untied ViT is the teacher of each seed; students match
# its final post-norm tokens; then a linear probe (--probe cls) of each frozen model. {runs}: the run folders.
TEACHER = "{runs}/distill-teacher-vit-untied-seed{seed}/ckpt.pt"
# {size}: the regime's preset size (revit-mini -> mini); {eval_depths}: 2, 3, 4, L, 1.5L, 2L of its L.
GRIDS = {
    "experts": {  # paper Table 5 (E = 1 ... 8) with Table 1's untied ViT and Raptor
        "ViT (untied)": {"arch": "vit-{size}"},
        "Raptor k=2": {"arch": "raptor-{size}-k2"},
        **{f"reViT E={e}": {"num_experts": e} for e in (1, 2, 4, 8)},
        # not in the paper: a fixed depth prior, expert e dominant near s = e/(E-1) (ViTConfig.router_prior)
        "reViT E=4, depth prior 8": {"num_experts": 4, "model_args": "router_prior=8"},
    },
    "elastic": {  # paper Fig. 2: after elastic-depth training (§3.2, rate 0.3), accuracy at other depths
        "depth-programmed": {"depth_drop": 0.3, "eval_depths": "{eval_depths}"},
        "feature-only": {"depth_drop": 0.3, "eval_depths": "{eval_depths}", "model_args": "ffn=feature"},
    },
    "tying": {  # what tying the L blocks into one costs (untied ViT vs E = 1), narrower and deeper too
        "regime: ViT": {"arch": "vit-{size}"},
        "regime: E=1": {"num_experts": 1},
        "d=32: ViT": {"arch": "vit-{size}", "model_args": "dim=32,heads=2,ffn_dim=64"},
        "d=32: E=1": {"num_experts": 1, "model_args": "dim=32,heads=2,ffn_dim=64"},
        "2L: ViT": {"arch": "vit-{size}", "depth": "{double_depth}"},
        "2L: E=1": {"num_experts": 1, "depth": "{double_depth}"},
    },
    "quickstart": {  # the quick start's size and schedule (d = 96, L = 6, 15 epochs): does the prior help?
        "revit-mini": {"epochs": 15, "depth": 6, "model_args": "dim=96,heads=3,ffn_dim=192"},
        "revit-mini, depth prior 8": {"epochs": 15, "depth": 6,
                                      "model_args": "dim=96,heads=3,ffn_dim=192,router_prior=8"},
    },
    "planted": {  # a task that needs a different function at each of its 4 steps, by construction
        "ViT (untied)": planted(arch="vit-{size}"),
        "reViT E=1": planted(num_experts=1),
        "reViT E=4": planted(num_experts=4),
        "reViT E=4, depth prior 8": planted("router_prior=8", num_experts=4),
    },
    "planted-lr": {  # the planted task with psi at lr x m: does a larger router lr find the program?
        f"reViT E=4, router lr x{m}": planted(num_experts=4, router_lr_scale=m) for m in (10, 30)
    },
    # Table 3's comparison on the planted task: content routing beside the depth-programmed merge, each
    # router at the paper's lr and at x30 (the planted-lr grid's setting for psi)
    "planted-table3": {
        "feature-only": planted("ffn=feature"),
        "feature-only, router lr x30": planted("ffn=feature", router_lr_scale=30),
        "SMEAR": planted("ffn=smear"),
        "SMEAR, router lr x30": planted("ffn=smear", router_lr_scale=30),
        # at U = 1 DeepSeek-V3 routes K = 1 expert with its gate renormalised to 1: no gradient reaches its
        # router, so a faster router lr changes nothing (lib/moe.py's MOE_TABLE)
        "DeepSeek-V3 U=1": planted(arch="revit-{size}-deepseek"),
        "Raptor k=2": planted(arch="raptor-{size}-k2"),
        "Raptor k=4": planted(arch="raptor-{size}-k4"),  # one stored block per planted map
    },
    # Fig. 2's question on the planted task: depth drop 0.3 at L = 4, each checkpoint scored at L = 2 ... 8
    "planted-elastic": {
        "reViT E=4, router lr x30": planted(num_experts=4, router_lr_scale=30, **ELASTIC),
        "reViT E=4, depth prior 8": planted("router_prior=8", num_experts=4, **ELASTIC),
        "feature-only": planted("ffn=feature", num_experts=4, **ELASTIC),
        "reViT E=1": planted(num_experts=1, **ELASTIC),
    },
    "router-lr": {  # psi in its own AdamW group at lr x m (train.py --router-lr-scale; m = 1: the paper);
        # the new cells first: E = 4 and E = 1 are also the experts grid's cells (the same flags)
        "reViT E=4, router lr x10": {"num_experts": 4, "router_lr_scale": 10},
        "reViT E=4, router lr x30": {"num_experts": 4, "router_lr_scale": 30},
        "reViT E=4": {"num_experts": 4},
        "reViT E=1": {"num_experts": 1},
    },
    "distill": {  # rows in order: the teachers, the students (Eq. 5), then the probes of every frozen model
        "teacher: ViT (untied)": {"arch": "vit-{size}"},
        **{f"student E={e}": {"num_experts": e, "teacher": TEACHER} for e in (1, 4, 8)},
        "probe: teacher": {"probe": "cls", "backbone": TEACHER},
        **{f"probe: student E={e}": {"probe": "cls",
                                     "backbone": f"{{runs}}/distill-student-e-{e}-seed{{seed}}/ckpt.pt"}
           for e in (1, 4, 8)},
    },
    "long": {  # does the saddle resolve with a longer schedule? 15 epochs, the gate spread logged every epoch
        "reViT E=1, 15 epochs": {"num_experts": 1, "epochs": 15},
        "reViT E=4, 15 epochs": {"num_experts": 4, "epochs": 15},
    },
}
DEFAULT_GRIDS = "experts,elastic"


# --- cells: a regime and a grid entry -> train.py's command line ---


def cell_argv(regime: dict, cell: dict, seed: int, runs: str = "runs") -> list[str]:
    """train.py's command line for one cell and seed: the regime, then the cell's fields ({runs}: the
    sweep's run folders, where a cell finds another's checkpoint)."""
    depth = regime.get("depth") or revit.PRESETS[regime["arch"]]["depth"]
    eval_depths = sorted({2, 3, 4, depth, (3 * depth + 1) // 2, 2 * depth})
    fill = {"size": regime["arch"].split("-", 1)[1], "double_depth": 2 * depth,
            "eval_depths": ",".join(map(str, eval_depths)), "seed": seed, "runs": runs}
    values = dict(regime)
    for key, value in cell.items():
        value = value.format(**fill) if isinstance(value, str) else value
        values[key] = merge_model_args(values.get(key, ""), value) if key == "model_args" else value
    values["seed"] = seed
    return [word for key, value in values.items() for word in (f"--{key.replace('_', '-')}", str(value))]


def flag_pairs(argv: list[str]) -> list[tuple]:
    """['--b', '2', '--a', '1'] -> [('--a', '1'), ('--b', '2')]: the command whatever its flags' order."""
    return sorted(zip(argv[::2], argv[1::2]))


# --- cell records: what a finished run left, read back as data ---


def within(low, high):
    return lambda v: type(v) in (int, float) and low <= v <= high  # NaN fails; true and false are no numbers


def number(low, high) -> tuple:
    return within(low, high), f"a number in {low:g}..{high:g}"


def list_of(test):
    return lambda v: isinstance(v, list) and all(map(test, v))


# what a cell scores: top-1 accuracy, the planted task's MSE or distillation's
SCORES = {"acc": number(0, 1), "mse": number(0, 1e9), "distill_mse": number(0, 1e9)}
CELL_KEY = re.compile(r"[a-z0-9-]{1,200}")  # quality_rows' keys: a file name in cells/, never a path
DEPTH_KEY = re.compile(r"[1-9][0-9]{0,2}")  # ASCII digits only: never "٤" or 5,000 digits
RECORD = {  # a cell record's fields (result.NAME: its result's) -> (test, what it must be); null = absent
    "result.params": number(0, 1e12),
    "result.reference_depth": number(1, MAX_DEPTH),
    "result.minutes": number(0, 1e7),
    "key": (lambda v: isinstance(v, str) and CELL_KEY.fullmatch(v),
            "a cell's name (a-z, 0-9 and -), never a path"),
    "argv": (lambda v: list_of(lambda word: isinstance(word, str))(v) and len(v) % 2 == 0,
             "a list of strings: flags and their values"),
    **dict.fromkeys(("commit", "torch"), (lambda v: isinstance(v, (str, type(None))),
                                          "a string or null (older cells have none)")),
    "gates": (lambda g: not g or isinstance(g, dict) and within(0, 1)(g.get("gate_spread"))
              and list_of(lambda e: type(e) is int)(g.get("dominant_expert")),
              "null, {} or {gate_spread: 0..1, dominant_expert: a list of expert indices}"),
    "gate_trace": (lambda t: t is None or list_of(lambda p: isinstance(p, list) and len(p) == 2
                                                  and within(0, 1e12)(p[0]) and within(0, 1)(p[1]))(t),
                   "a list of [step, gate spread] pairs"),
}


def metric_of(result: dict) -> str:
    return next((m for m in SCORES if f"test_{m}" in result), "acc")


def cell_problem(cell) -> str | None:
    """The first rule of RECORD a cell record breaks, in words, or None. A file is data: an edited 1e308 is
    never printed as "inf%", and its key never names a path."""
    if not isinstance(cell, dict) or not isinstance(cell.get("result"), dict):
        return f"a cell record is a JSON object holding a result object; got a JSON {type(cell).__name__}"
    metric = metric_of(cell["result"])
    score, what = SCORES[metric]
    depths = (lambda d: d is None or isinstance(d, dict) and all(
        DEPTH_KEY.fullmatch(k) and int(k) <= MAX_DEPTH and isinstance(v, dict) and score(v.get(metric))
        for k, v in d.items()), f"a map of depths (1..{MAX_DEPTH}) to {{{metric}: {what}}}")
    rules = {"result.test_" + metric: (score, what), "result.depths": depths, **RECORD}
    for field, (test, what) in rules.items():
        section, _, name = field.rpartition(".")
        value = (cell[section] if section else cell).get(name)
        if not test(value):
            return f"{field} must be {what}; got {value!r:.40}"
    return None


def read_cell(path: str) -> dict:
    """A cell record from its JSON file, every field checked; a torn or edited file is one line."""
    try:
        with open(path) as fh:
            cell = json.load(fh)
        problem = cell_problem(cell)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        problem = f"not a readable cell record ({type(e).__name__}: {e})"
    if problem:
        fail(f"{path}: {problem}; delete it to re-run the cell", PROG)
    return cell


def cached_cell(key: str, argv: list[str], out_dir: str) -> dict | None:
    """A finished run of this command: cells/KEY.json, else any cell (of another grid) with the same flags."""
    own = os.path.join(out_dir, "cells", f"{key}.json")
    for path in sorted(glob.glob(os.path.join(out_dir, "cells", "*.json")), key=lambda p: (p != own, p)):
        cached = read_cell(path)
        if flag_pairs(cached["argv"]) == flag_pairs(argv):
            return {**cached, "cached": True}
    return None


# --- running a cell: python train.py in its own process ---


def run_cell(key: str, argv: list[str], out_dir: str, threads: int = 1) -> dict:
    """`python train.py ARGV` in its own process (output: runs/KEY/train.log) unless cached_cell has it;
    -> its record, written to cells/KEY.json with the commit and torch it was trained at."""
    cached = cached_cell(key, argv, out_dir)
    if cached:
        return cached
    run_dir = os.path.join(out_dir, "runs", key)
    os.makedirs(run_dir, exist_ok=True)
    checkpoint, log_path = os.path.join(run_dir, "ckpt.pt"), os.path.join(run_dir, "train.log")
    # a run killed mid-way continues from its last checkpoint; one killed before any checkpoint starts over
    where = ["--resume", checkpoint] if os.path.exists(checkpoint) else ["--out-dir", run_dir, "--overwrite"]
    with open(log_path, "a") as log:
        done = subprocess.run([*TRAIN_COMMAND, *argv, *where, "--no-progress"], stdout=log,
                              stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": str(threads)},
                              cwd=ROOT)
    if done.returncode != 0:
        fail(f"cell {key} (python train.py {' '.join(argv)}): {failure_line(log_path)}", PROG)
    result, trace = run_metrics(run_dir)
    has_gates = os.path.exists(checkpoint) and "--probe" not in argv  # a probe's checkpoint is a head
    gates = tasks.gate_summary(load_model(checkpoint)[0]) if has_gates else None
    trace = {"gate_trace": trace + [[result["step"], gates["gate_spread"]]]} if gates else {}
    record = {"key": key, "argv": argv, "result": result, "gates": gates, **trace, "commit": git_commit(ROOT),
              "torch": torch.__version__, "threads": threads}
    write_json(record, os.path.join(out_dir, "cells", f"{key}.json"))
    return {**record, "cached": False}


def failure_line(log_path: str) -> str:
    """train.py's one-line error (after 'error: '), else the last line of the log and where the log is."""
    with open(log_path, errors="replace") as fh:
        last = ([line.strip() for line in fh if line.strip()] or ["no output"])[-1]
    return last.partition(": error: ")[2] or f"{last} (full output: {log_path})"


def run_metrics(run_dir: str) -> tuple[dict, list]:
    """A finished run's metrics.jsonl -> what train.main returns (its final record, last step, checkpoint)
    and [step, gate spread] at each evaluation (train.py logs it for reViT with E > 1)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        records = [json.loads(line) for line in fh]
    final = [{k: v for k, v in r.items() if k != "event"} for r in records if r.get("event") == "final"][-1]
    step = max(r["step"] for r in records if isinstance(r.get("step"), int))
    trace = [[r["step"], r["gate_spread"]] for r in records if "eval" in r and "gate_spread" in r]
    return {**final, "step": step, "checkpoint": os.path.abspath(os.path.join(run_dir, "ckpt.pt")),
            "out_dir": os.path.abspath(run_dir)}, trace


# --- rows: each cell over its seeds ---


def mean_std(values: list[float]) -> dict:
    return {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "values": values}


def quality_rows(args, grids: list[str], regime: dict, out_dir: str, shard: tuple) -> list[dict]:
    """Each cell over its seeds. With shard (K, N) this process trains only every N-th run, starting at the
    K-th, so N processes (or machines sharing out_dir) split a sweep; a cell with a seed still to run is
    'pending'. A line per run, and a bar over the runs on stderr when it is a terminal."""
    runs = [(grid, name, seed) for grid in grids for name in GRIDS[grid] for seed in range(args.seeds)]
    cells = {}
    for index, (grid, name, seed) in enumerate(progress(runs, args, "runs"), 1):
        key = re.sub(r"[^a-z0-9]+", "-", f"{grid} {name} seed{seed}".lower()).strip("-")
        argv = cell_argv(regime, GRIDS[grid][name], seed, os.path.join(out_dir, "runs"))
        mine = (index - 1) % shard[1] == shard[0] - 1
        record = run_cell(key, argv, out_dir, args.threads) if mine else cached_cell(key, argv, out_dir)
        cells.setdefault((grid, name), []).append(record)
        say(f"[{index}/{len(runs)}] {grid} / {name} / seed {seed}: " + (
            "pending (another shard)" if record is None else score_text(record["result"])
            + (" (cached)" if record["cached"] else f" ({record['result']['minutes']:.1f} min)")))
    return [quality_row(grid, name, seeds) for (grid, name), seeds in cells.items() if None not in seeds]


def score_text(result: dict) -> str:
    metric = metric_of(result)
    score = result["test_" + metric]
    return f"top-1 {100 * score:.2f}%" if metric == "acc" else f"{metric} {score:.5f}"


def quality_row(grid: str, name: str, records: list[dict]) -> dict:
    """One cell over its seeds: mean ± std of its score (and at each evaluated depth), the gates' spread, and
    the commits its seeds were trained at (None: a cell recorded before commits were)."""
    results, spec = [r["result"] for r in records], GRIDS[grid][name]
    depths = [sorted(map(int, r.get("depths") or {})) for r in results]  # JSON's keys: strings
    if any(seen != depths[0] for seen in depths):  # an edited or mixed cell
        fail(f"cell {grid} / {name}: its seeds were evaluated at different depths "
             f"({', '.join(map(str, depths))}); delete its cells/*.json to re-run it", PROG)
    gates, traces = [r.get("gates") for r in records], [r.get("gate_trace") for r in records]
    metric = metric_of(results[0])  # acc for classification; the planted task and distillation score an MSE
    return {"grid": grid, "cell": name, "num_experts": spec.get("num_experts"),
            "variant": "model_args" in spec,  # e.g. the depth prior: a point beside the E line, not on it
            "params": results[0]["params"], "reference_depth": results[0]["reference_depth"],
            "metric": metric, metric: mean_std([r["test_" + metric] for r in results]),
            "depths": {str(d): mean_std([r["depths"][str(d)][metric] for r in results]) for d in depths[0]},
            "gate_spread": mean_std([g["gate_spread"] for g in gates]) if all(gates) else None,
            "dominant_expert": [g["dominant_expert"] for g in gates] if all(gates) else None,
            "gate_traces": traces if None not in traces else None,
            "minutes": sum(r["minutes"] for r in results),
            "commits": sorted({r.get("commit") for r in records}, key=str)}


# --- tables and plots ---


def quality_markdown(result: dict) -> str:
    """The sweep's tables (run_sweep's result, or OUT/quality.json), as RESULTS.md shows them."""
    out = [f"## Quality sweep: {result['seeds']} seeds per cell, regime `{' '.join(result['regime_argv'])}`"]
    for grid in dict.fromkeys(r["grid"] for r in result["rows"]):
        columns, cells = tables.GRIDS[grid]([r for r in result["rows"] if r["grid"] == grid])
        out += [f"\n### Grid {grid}\n", tables.markdown_table(columns, cells)]
    out.append(f"\n{sum(r['minutes'] for r in result['rows']):.1f} training minutes in all (cached cells "
               f"count their original run); cells in {result['out_dir']}/cells.")
    return "\n".join(out)


def figures(rows: list[dict]) -> dict:
    """quality_KIND.png's KIND -> (how to draw it, the rows it shows; none: no figure): accuracy vs E with
    error bars (Table 5's shape), the score vs inference depth with bands after elastic training (Fig. 2's),
    and the gate spread during training."""
    grid = lambda name: [r for r in rows if r["grid"] == name]  # noqa: E731
    untied = next((r for r in grid("planted") if r["cell"] == "ViT (untied)"), None)
    return {"experts": (draw_experts, grid("experts")), "depths": (draw_elastic, grid("elastic")),
            "planted-depths": (lambda ax, rows: draw_elastic(ax, rows, untied), grid("planted-elastic")),
            "gates": (draw_gate_traces, [r for r in rows if r["gate_traces"]])}


def plot_quality(result: dict, folders: list[tuple]) -> list[str]:
    """Each of figures() written to every (folder, pattern)."""
    plt = pyplot()
    if plt is None:
        return []
    paths = []
    for kind, (draw, chosen) in figures(result["rows"]).items():
        if chosen:
            fig, ax = plt.subplots(figsize=(5, 3.6), dpi=120)
            draw(ax, chosen)
            ax.legend(fontsize=7)
            fig.tight_layout()
            for folder, pattern in folders:
                paths.append(os.path.join(folder, pattern.format(kind=kind)))
                save_png(fig, paths[-1])
            plt.close(fig)
    return paths


def draw_experts(ax, experts: list[dict]) -> None:
    bank = [r for r in experts if r["num_experts"] and not r["variant"]]  # the E line: the paper's router
    ax.errorbar([r["num_experts"] for r in bank], [100 * r["acc"]["mean"] for r in bank],
                yerr=[100 * r["acc"]["std"] for r in bank], fmt="o-", capsize=3, label="reViT")
    for r, marker in zip([r for r in experts if r["num_experts"] and r["variant"]], "*Ds"):
        ax.errorbar([r["num_experts"]], [100 * r["acc"]["mean"]], yerr=[100 * r["acc"]["std"]], fmt=marker,
                    markersize=9, capsize=3, label=r["cell"])
    for r, style in zip([r for r in experts if not r["num_experts"]], ("--", ":", "-.")):
        mean, std = 100 * r["acc"]["mean"], 100 * r["acc"]["std"]
        ax.axhline(mean, ls=style, color="gray", label=r["cell"])
        ax.axhspan(mean - std, mean + std, color="gray", alpha=0.15)
    ax.set_xscale("log", base=2)
    ax.set_xticks([r["num_experts"] for r in bank], labels=[str(r["num_experts"]) for r in bank])
    ax.set(xlabel="experts E", ylabel="top-1 accuracy (%)", title="accuracy vs E (mean ± std over seeds)")


def draw_gate_traces(ax, rows: list[dict]) -> None:
    """The gate spread (max - min of the gate matrix) at each evaluation: does a program form, and when?"""
    for i, r in enumerate(rows):
        for seed, trace in enumerate(r["gate_traces"]):
            ax.plot(*zip(*trace), "o-", markersize=3, color=f"C{i % 10}", alpha=0.8,
                    label=f"{r['grid']}: {r['cell']}" if seed == 0 else None)
    ax.set(xlabel="optimizer step", ylabel="gate spread (0 = flat)", ylim=(0, 1),
           title="gate spread during training, each seed")


def draw_elastic(ax, elastic: list[dict], reference: dict | None = None) -> None:
    """Each elastic checkpoint's score at every inference depth, with a band of one std over seeds;
    `reference` (a fixed-depth model) is one point at its own depth."""
    metric = elastic[0]["metric"]
    scale, label = (100, "top-1 accuracy (%)") if metric == "acc" else (1, "test MSE (lower is better)")
    for r in elastic:
        depths = sorted(map(int, r["depths"]))  # JSON's keys: strings
        mean, std = ([scale * r["depths"][str(d)][stat] for d in depths] for stat in ("mean", "std"))
        ax.plot(depths, mean, "o-", label=r["cell"])
        ax.fill_between(depths, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                        alpha=0.2)
    if reference:
        ax.errorbar([reference["reference_depth"]], [scale * reference[metric]["mean"]],
                    yerr=[scale * reference[metric]["std"]], fmt="k*", markersize=10, capsize=3,
                    label=f"{reference['cell']}, trained at L = {reference['reference_depth']}")
    ax.axvline(elastic[0]["reference_depth"], ls=":", color="gray")
    ax.set(xlabel="inference depth", ylabel=label, title="after elastic training (mean ± std)")


# --- command line ---


def run_sweep(args) -> dict:
    check_numbers(vars(args), PROG)  # --seeds and --threads (its default: $OMP_NUM_THREADS)
    try:
        device = str(pick_device(args.device))
    except ValueError as e:  # a device this machine does not have
        fail(str(e), PROG)
    grids = [g.strip() for g in args.grids.split(",") if g.strip()]
    shard = re.fullmatch(r"(\d+)/(\d+)", args.shard.strip())
    out_dir = args.out or ("out/quality-quick" if args.quick else f"out/quality/{args.regime}")
    outputs = ["quality.json", *(f"quality_{kind}.png" for kind in figures([]))]
    problem = (f"--grids must name some of {', '.join(GRIDS)}; got {args.grids!r}"
               if not grids or not set(grids) <= set(GRIDS)
               else f"--shard takes K/N with 1 <= K <= N (e.g. 1/2); got {args.shard!r}"
               if not (shard and 1 <= int(shard[1]) <= int(shard[2]))
               else outputs_problem("--out", out_dir, outputs))
    if problem:
        fail(problem, PROG)
    regime = dict(QUICK_REGIME if args.quick else REGIMES[args.regime], device=device)
    args.seeds = args.seeds or (2 if args.quick else 3)
    rows = quality_rows(args, grids, regime, out_dir, (int(shard[1]), int(shard[2])))
    result = {"command": "quality", "quick": args.quick, "regime_name": args.regime, "regime": regime,
              "seeds": args.seeds, "grids": grids, "regime_argv": cell_argv(regime, {}, 0)[:-2],
              "out_dir": out_dir, "rows": rows}
    name = "quick" if args.quick else args.regime  # a smoke run never overwrites a real sweep's pictures
    folders = [(out_dir, "quality_{kind}.png")]
    folders += [(os.path.join(ROOT, "assets"), f"quality-{name}-{{kind}}.png")] if args.assets else []
    result["plots"] = plot_quality(result, folders)
    print(quality_markdown(result))
    write_json(result, os.path.join(out_dir, "quality.json"))
    return result


def build_parser() -> argparse.ArgumentParser:
    omp = os.environ.get("OMP_NUM_THREADS", "")
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grids", default=DEFAULT_GRIDS,
                   help=f"which grids (of {', '.join(GRIDS)}; default {DEFAULT_GRIDS})")
    p.add_argument("--regime", default="d48-L12", choices=list(REGIMES),
                   help="the flags every cell shares (tools/sweep.py REGIMES; default d48-L12)")
    p.add_argument("--seeds", type=int, help="seeds per cell (default 3; --quick 2)")
    p.add_argument("--out", help="folder of finished cells (resumes from it), runs, quality.json and plots "
                                 "(default out/quality/REGIME, --quick out/quality-quick)")
    p.add_argument("--quick", action="store_true", help="a smoke run: a tiny model, two steps a cell")
    p.add_argument("--assets", action="store_true", help="also write the plots to assets/")
    p.add_argument("--shard", default="1/1", help="K/N: train only every N-th run from the K-th (run N "
                   "processes on one --out folder to split a sweep; then once more for the table)")
    p.add_argument("--device", default="auto", help="train.py's --device for every cell")
    p.add_argument("--threads", type=int, default=int(omp) if omp.isdigit() else 1,
                   help="CPU threads per train.py run (default: $OMP_NUM_THREADS if set, else 1)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="a progress bar over the runs on stderr, when it is a terminal")
    return p


def main(argv=None) -> dict:
    result = run_sweep(build_parser().parse_args(argv))
    print(json_text(result))
    return result


if __name__ == "__main__":
    run_main(main, "finished cells are kept; the same command continues with the rest")
