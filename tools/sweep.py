"""sweep.py: small-scale evidence with seeds and error bars, for reViT (arXiv 2610.12448).

    python -m tools.sweep                          # experts + elastic grids at d48-L12, 3 seeds per cell
    python -m tools.sweep --grids tying --regime d48-L6     # what tying the blocks costs at L = 6
    python -m tools.sweep --quick                  # the same code paths in seconds (tiny model, two steps a cell)
    python -m tools.sweep --shard 1/2 & python -m tools.sweep --shard 2/2; wait; python -m tools.sweep    # two processes

Each cell of a grid is one `python train.py ...` run per seed, in its own process (one thread unless
--threads or OMP_NUM_THREADS says otherwise), its output in OUT/runs/KEY/train.log. A finished run is
recorded in OUT/cells/KEY.json with the commit and torch version it was trained at; a sweep run again
reuses every finished cell with the same train.py command (whatever its file name), and a run killed
mid-way continues from its checkpoint. The tables (accuracy vs E: Table 5; accuracy vs inference
depth after elastic training: Fig. 2; mean ± std over seeds) are printed, written to OUT/quality.json
and drawn in OUT/quality_*.png. The last stdout line is the JSON document.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import statistics
import subprocess
import sys

import torch
from tqdm import tqdm

if not __package__:  # run as a file (python tools/sweep.py): the project's modules are not on the path
    sys.exit("tools/sweep.py: error: run it from the repository root as python -m tools.sweep")

import revit
from lib import tasks
from lib.checkpoint import load_model
from lib.boundary import MAX_DEPTH, InputError, check_numbers, fail, output_problem, path_problem
from lib.cli import f, git_commit, json_text, markdown, pick_device, pyplot, say, write_json
from lib.cli import run_main  # Ctrl-C: one line
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
# --quick: the same cells in seconds (a tiny model, two optimizer steps), for the test suite.
QUICK_REGIME = {"arch": "revit-mini", "max_steps": 2, "train_subset": 256, "test_subset": 128, "batch_size": 64,
                "depth": 3, "model_args": "dim=16,heads=2,ffn_dim=24"}
# {size}: the regime's preset size (revit-mini -> mini); {eval_depths}: 2, 3, 4, L, 1.5L, 2L of the regime's L.
GRIDS = {
    "experts": {  # paper Table 5 (E = 1 ... 8) with Table 1's untied ViT and Raptor
        "ViT (untied)": {"arch": "vit-{size}"},
        "Raptor k=2": {"arch": "raptor-{size}-k2"},
        **{f"reViT E={e}": {"num_experts": e} for e in (1, 2, 4, 8)},
        # not in the paper: a fixed depth prior that starts expert e dominant near s = e/(E-1) (ViTConfig.router_prior)
        "reViT E=4, depth prior 8": {"num_experts": 4, "model_args": "router_prior=8"},
    },
    "elastic": {  # paper Fig. 2: after elastic-depth training (§3.2, rate 0.3), accuracy at other depths
        "depth-programmed": {"depth_drop": 0.3, "eval_depths": "{eval_depths}"},
        "feature-only": {"depth_drop": 0.3, "eval_depths": "{eval_depths}", "model_args": "ffn=feature"},
    },
    "tying": {  # what tying the L blocks into one costs (untied ViT vs E = 1), narrower and deeper than the regime
        "regime: ViT": {"arch": "vit-{size}"},
        "regime: E=1": {"num_experts": 1},
        "d=32: ViT": {"arch": "vit-{size}", "model_args": "dim=32,heads=2,ffn_dim=64"},
        "d=32: E=1": {"num_experts": 1, "model_args": "dim=32,heads=2,ffn_dim=64"},
        "2L: ViT": {"arch": "vit-{size}", "depth": "{double_depth}"},
        "2L: E=1": {"num_experts": 1, "depth": "{double_depth}"},
    },
    "quickstart": {  # the quick start's size and schedule (revit-mini: d = 96, L = 6, 15 epochs): does the prior help?
        "revit-mini": {"epochs": 15, "depth": 6, "model_args": "dim=96,heads=3,ffn_dim=192"},
        "revit-mini, depth prior 8": {"epochs": 15, "depth": 6,
                                      "model_args": "dim=96,heads=3,ffn_dim=192,router_prior=8"},
    },
}
# The planted-depth task (train.py --dataset planted, lib/planted.PlantedTask: regress LN(f_4 ∘ ... ∘ f_1(x)) per
# token, distinct fixed random maps f_t): every cell sets its own data, depth and patch, whatever the regime.
PLANTED_ARGS = "dim=48,heads=3,ffn_dim=96"
PLANTED = {"dataset": "planted", "depth": 4, "patch_size": 4, "epochs": 8, "model_args": PLANTED_ARGS}
ELASTIC = {**PLANTED, "depth_drop": 0.3, "eval_depths": "2,3,4,5,6,7,8"}  # elastic training, scored at L = 2 ... 8
# Distillation (§4.2, App. A.3, Eq. 5): the regime's untied ViT is the teacher of each seed; students match its
# final post-norm tokens; then a linear probe (--probe cls) of each frozen model. {runs}: this sweep's run folders.
TEACHER = "{runs}/distill-teacher-vit-untied-seed{seed}/ckpt.pt"
GRIDS.update({
    "planted": {  # a task that needs a different function at each of its 4 steps, by construction
        "ViT (untied)": {**PLANTED, "arch": "vit-{size}"},
        "reViT E=1": {**PLANTED, "num_experts": 1},
        "reViT E=4": {**PLANTED, "num_experts": 4},
        "reViT E=4, depth prior 8": {**PLANTED, "num_experts": 4,
                                     "model_args": PLANTED["model_args"] + ",router_prior=8"},
    },
    "planted-lr": {  # the planted task with psi at lr x m: does a larger router lr find the program?
        f"reViT E=4, router lr x{m}": {**PLANTED, "num_experts": 4, "router_lr_scale": m} for m in (10, 30)
    },
    # Table 3's comparison on the planted task: content routing beside the depth-programmed merge, each
    # router at the paper's lr and at x30 (the planted-lr grid's setting for psi)
    "planted-table3": {
        "feature-only": {**PLANTED, "model_args": PLANTED_ARGS + ",ffn=feature"},
        "feature-only, router lr x30": {**PLANTED, "model_args": PLANTED_ARGS + ",ffn=feature",
                                        "router_lr_scale": 30},
        "SMEAR": {**PLANTED, "model_args": PLANTED_ARGS + ",ffn=smear"},
        "SMEAR, router lr x30": {**PLANTED, "model_args": PLANTED_ARGS + ",ffn=smear", "router_lr_scale": 30},
        # at U = 1 DeepSeek-V3 routes K = 1 expert with its gate renormalised to 1: no gradient reaches its
        # router, so a faster router lr changes nothing (lib/moe.py's MOE_TABLE)
        "DeepSeek-V3 U=1": {**PLANTED, "arch": "revit-{size}-deepseek"},
        "Raptor k=2": {**PLANTED, "arch": "raptor-{size}-k2"},
        "Raptor k=4": {**PLANTED, "arch": "raptor-{size}-k4"},  # one stored block per planted map
    },
    # Fig. 2's question on the planted task: depth drop 0.3 at L = 4, each checkpoint scored at L = 2 ... 8
    "planted-elastic": {
        "reViT E=4, router lr x30": {**ELASTIC, "num_experts": 4, "router_lr_scale": 30},
        "reViT E=4, depth prior 8": {**ELASTIC, "num_experts": 4, "model_args": PLANTED_ARGS + ",router_prior=8"},
        "feature-only": {**ELASTIC, "num_experts": 4, "model_args": PLANTED_ARGS + ",ffn=feature"},
        "reViT E=1": {**ELASTIC, "num_experts": 1},
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
        **{f"probe: student E={e}": {"probe": "cls", "backbone": f"{{runs}}/distill-student-e-{e}-seed{{seed}}/ckpt.pt"}
           for e in (1, 4, 8)},
    },
    "long": {  # does the saddle resolve with a longer schedule? 15 epochs, the gate spread logged every epoch
        "reViT E=1, 15 epochs": {"num_experts": 1, "epochs": 15},
        "reViT E=4, 15 epochs": {"num_experts": 4, "epochs": 15},
    },
})
DEFAULT_GRIDS = "experts,elastic"


class SweepError(ValueError):
    """Bad input to the sweep, a failed cell or an unreadable cell file: main reports it as one line."""


# --- cells: a regime and a grid entry -> train.py's command line ---


def regime_depth(regime: dict) -> int:
    return regime.get("depth") or revit.PRESETS[regime["arch"]]["depth"]


def regime_eval_depths(regime: dict) -> list[int]:
    depth = regime_depth(regime)
    return sorted({2, 3, 4, depth, (3 * depth + 1) // 2, 2 * depth})


def merge_model_args(base: str, extra: str) -> str:
    """'dim=48,heads=3' + 'dim=32,ffn=feature' -> 'dim=32,heads=3,ffn=feature': the cell's value wins."""
    pairs = dict(item.split("=", 1) for text in (base, extra) for item in text.split(",") if item)
    return ",".join(f"{key}={value}" for key, value in pairs.items())


def cell_argv(regime: dict, cell: dict, seed: int, runs: str = "runs") -> list[str]:
    """train.py's command line for one cell and seed: the regime, then the cell's fields ({runs}: the sweep's
    run folders, where a cell finds another's checkpoint)."""
    fill = {"size": regime["arch"].split("-", 1)[1], "eval_depths": ",".join(map(str, regime_eval_depths(regime))),
            "double_depth": 2 * regime_depth(regime), "seed": seed, "runs": runs}
    values = dict(regime)
    for key, value in cell.items():
        value = value.format(**fill) if isinstance(value, str) else value
        values[key] = merge_model_args(values.get(key, ""), value) if key == "model_args" else value
    values["seed"] = seed
    argv = []
    for key, value in values.items():
        flag = key.replace("_", "-")
        argv += ([f"--{flag}" if value else f"--no-{flag}"] if isinstance(value, bool) else [f"--{flag}", str(value)])
    return argv


def flag_groups(argv: list[str]) -> list[tuple]:
    """['--a', '1', '--b'] -> [('--a', '1'), ('--b',)], sorted: the command whatever the order of its flags."""
    groups = []
    for word in argv:
        if word.startswith("--") or not groups:
            groups.append([])
        groups[-1].append(word)
    return sorted(map(tuple, groups))


# --- cell files: what a finished run left, read back with every field checked ---


def read_cell(path: str) -> dict:
    """A cell record from its JSON file; a torn or edited file is a SweepError naming it (a FIFO is refused
    before it is opened: reading one would wait forever)."""
    problem = path_problem(path, "file")
    if problem:
        raise SweepError(f"{path}: {problem}; move it away to re-run the cell")
    try:
        with open(path) as fh:
            cell = json.load(fh)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise SweepError(f"{path}: not a readable cell record ({type(e).__name__}: {e}); delete it to re-run "
                         f"the cell") from None
    problem = cell_problem(cell)
    if problem:
        raise SweepError(f"{path}: not a cell record ({problem}); delete it to re-run the cell")
    return cell


# What a cell record may hold: each number finite and in its range (a file is data: an edited 1e308 is not
# printed as "inf%"), depths as the boundary allows them, and a key that names a file in cells/, never a path.
RESULT_RANGES = {"test_acc": (0, 1), "test_mse": (0, 1e9), "test_distill_mse": (0, 1e9), "params": (0, 1e12),
                 "reference_depth": (1, MAX_DEPTH), "minutes": (0, 1e7)}
CELL_KEY = re.compile(r"[a-z0-9-]{1,200}")  # quality_rows' keys


def cell_problem(cell) -> str | None:
    """What is wrong with a cell record's structure, or None. Older cells lack commit/torch: still valid."""
    def number(v, low=-math.inf, high=math.inf):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and low <= v <= high
    if not isinstance(cell, dict):
        return f"a JSON {type(cell).__name__}, not an object"
    if not isinstance(cell.get("argv"), list) or not all(isinstance(a, str) for a in cell["argv"]):
        return "argv must be a list of strings"
    result = cell.get("result")
    if not isinstance(result, dict):
        return "result must be an object"
    metric = metric_of(result)
    for key in ("test_" + metric, "params", "reference_depth", "minutes"):
        if not number(result.get(key), *RESULT_RANGES[key]):
            low, high = RESULT_RANGES[key]
            return f"result.{key} must be a finite number in {low:g}..{high:g}; got {result.get(key)!r:.40}"
    depths, (low, high) = result.get("depths", {}), RESULT_RANGES["test_" + metric]
    if not isinstance(depths, dict) or not all(isinstance(v, dict) and number(v.get(metric), low, high)
                                               for v in depths.values()):
        return f"result.depths must map depths to {{\"{metric}\": number in {low:g}..{high:g}}}"
    if not all(re.fullmatch(r"[0-9]{1,3}", d) and 1 <= int(d) <= MAX_DEPTH for d in depths):
        return f"result.depths keys must be depths (integers in 1..{MAX_DEPTH})"
    gates = cell.get("gates")
    if gates and not (isinstance(gates, dict) and number(gates.get("gate_spread"), 0, 1)
                      and isinstance(gates.get("dominant_expert"), list)
                      and all(type(e) is int for e in gates["dominant_expert"])):
        return "gates must be null, {} or {gate_spread: 0..1, dominant_expert: a list of expert indices}"
    if not all(isinstance(cell.get(k), (str, type(None))) for k in ("commit", "torch")):
        return "commit and torch must be strings"
    trace = cell.get("gate_trace", [])
    if not isinstance(trace, list) or not all(isinstance(p, list) and len(p) == 2 and all(map(number, p))
                                              for p in trace):
        return "gate_trace must be a list of [step, gate spread] pairs"
    if not isinstance(cell.get("key"), str) or not CELL_KEY.fullmatch(cell["key"]):
        return "key must be a cell's name (a-z, 0-9 and -), never a path"
    return None


METRICS = ("acc", "mse", "distill_mse")  # what a cell scores: top-1; the planted task's MSE; distillation's


def metric_of(result: dict) -> str:
    """The cell's metric: acc (classification, probes), mse (the planted task) or distill_mse (a student)."""
    return next((m for m in METRICS if f"test_{m}" in result), "acc")


def cached_cell(key: str, argv: list[str], out_dir: str) -> dict | None:
    """A finished run of this command: cells/KEY.json, else any cell (of another grid) with the same flags."""
    paths = sorted(glob.glob(os.path.join(out_dir, "cells", "*.json")))
    own = os.path.join(out_dir, "cells", f"{key}.json")
    for path in ([own] if own in paths else []) + paths:
        cached = read_cell(path)
        if flag_groups(cached["argv"]) == flag_groups(argv):
            return {**cached, "cached": True}
    return None


def gate_summary(checkpoint_path: str) -> dict:
    """The trained gate matrix of a checkpoint in two numbers a table can hold (lib/tasks.gate_summary: the
    spread, max - min, and the dominant expert of each step; {} without depth-only gates)."""
    model, _ = load_model(checkpoint_path)
    return tasks.gate_summary(model)


def gate_trace(run_dir: str) -> list:
    """[step, gate spread] at each evaluation of the run (train.py logs it for reViT with E > 1), then the end."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        records = [json.loads(line) for line in fh]
    return [[r["step"], r["gate_spread"]] for r in records if "eval" in r and "gate_spread" in r]


def with_gates(record: dict, out_dir: str) -> dict:
    """Add gate_summary from the cell's checkpoint when the record lacks it and the run folder is here."""
    path = os.path.join(out_dir, "runs", record["key"], "ckpt.pt")
    if "gates" in record or not os.path.exists(path):
        return record
    record = {**record, "gates": gate_summary(path)}
    cell = {k: v for k, v in record.items() if k != "cached"}
    write_json(cell, os.path.join(out_dir, "cells", f"{record['key']}.json"))
    return record


# --- running a cell: python train.py in its own process ---


def code_version() -> dict:
    """The commit the cells are trained at (cli.git_commit: `-dirty` when tracked files outside results/ differ
    from it; None outside git) and the torch version."""
    return {"commit": git_commit(ROOT), "torch": torch.__version__}


def train_cell(key: str, argv: list[str], run_dir: str, threads: int) -> dict:
    """`python train.py ARGV` in its own process, stdout and stderr to run_dir/train.log; -> its summary
    (the metrics log's final record, with step, checkpoint and out_dir as train.main returns them)."""
    checkpoint = os.path.join(run_dir, "ckpt.pt")
    # a run killed mid-way continues from its last checkpoint; one killed before any checkpoint starts over
    where = ["--resume", checkpoint] if os.path.exists(checkpoint) else ["--out-dir", run_dir, "--overwrite"]
    log_path = os.path.join(run_dir, "train.log")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with open(log_path, "a") as log:
        done = subprocess.run([*TRAIN_COMMAND, *argv, *where, "--no-progress"], stdout=log, stderr=subprocess.STDOUT,
                              env=env, cwd=ROOT)
    if done.returncode != 0:
        raise SweepError(f"cell {key} (python train.py {' '.join(argv)}): {failure_line(log_path)}")
    return run_summary(run_dir)


def failure_line(log_path: str) -> str:
    """train.py's one-line error (after 'error: '), else the last line of the log and where the log is."""
    with open(log_path, errors="replace") as fh:
        lines = [line.strip() for line in fh if line.strip()]
    last = lines[-1] if lines else "no output"
    if ": error: " in last:
        return last.partition(": error: ")[2]
    return f"{last} (full output: {log_path})"


def run_summary(run_dir: str) -> dict:
    """What train.main returns for a finished run, from the run's metrics log."""
    steps, final = [], None
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        for record in map(json.loads, fh):
            steps += [record["step"]] if isinstance(record.get("step"), int) else []
            final = {k: v for k, v in record.items() if k != "event"} if record.get("event") == "final" else final
    if final is None:
        raise SweepError(f"{run_dir}/metrics.jsonl has no final record: the run did not finish")
    return {**final, "step": max(steps), "checkpoint": os.path.abspath(os.path.join(run_dir, "ckpt.pt")),
            "out_dir": os.path.abspath(run_dir)}


def run_cell(key: str, argv: list[str], out_dir: str, threads: int = 1, version: dict | None = None) -> dict:
    """One train.py run, unless a finished run of the same command line is cached (cached_cell)."""
    cached = cached_cell(key, argv, out_dir)
    if cached:
        return with_gates(cached, out_dir)
    run_dir = os.path.join(out_dir, "runs", key)
    os.makedirs(run_dir, exist_ok=True)
    version = version or code_version()
    result = train_cell(key, argv, run_dir, threads)
    checkpoint = os.path.join(run_dir, "ckpt.pt")
    gates = gate_summary(checkpoint) if os.path.exists(checkpoint) and "--probe" not in argv else None  # a head
    trace = gate_trace(run_dir) + ([[result["step"], gates["gate_spread"]]] if gates else [])
    record = {"key": key, "argv": argv, "result": result, "gates": gates, **({"gate_trace": trace} if gates else {}),
              **version, "threads": threads}
    os.makedirs(os.path.join(out_dir, "cells"), exist_ok=True)
    write_json(record, os.path.join(out_dir, "cells", f"{key}.json"))
    return {**record, "cached": False}


# --- rows: each cell over its seeds ---


def mean_std(values: list[float]) -> dict:
    return {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "values": values}


def quality_rows(grids: list[str], regime: dict, seeds: int, out_dir: str, shard: tuple = (1, 1),
                 threads: int = 1, progress: bool = False) -> list[dict]:
    """Each cell over seeds. With shard (K, N) this process trains only every N-th run, starting at the K-th,
    so N processes (or machines sharing out_dir) split a sweep; a cell with a seed still to run is 'pending'.
    A line per run, and with `progress` a bar over the runs on stderr when it is a terminal."""
    cells = [(grid, name, spec) for grid in grids for name, spec in GRIDS[grid].items()]
    rows, index, version = [], 0, code_version()
    bar = tqdm(total=len(cells) * seeds, desc="runs", disable=not progress or not sys.stderr.isatty(), leave=False)
    for grid, name, spec in cells:
        records = []
        for seed in range(seeds):
            key = re.sub(r"[^a-z0-9]+", "-", f"{grid} {name} seed{seed}".lower()).strip("-")
            argv = cell_argv(regime, spec, seed, os.path.join(out_dir, "runs"))
            index += 1
            mine = (index - 1) % shard[1] == shard[0] - 1
            record = run_cell(key, argv, out_dir, threads, version) if mine else cached_cell(key, argv, out_dir)
            records.append(record)
            bar.update()
            say(f"[{index}/{len(cells) * seeds}] {grid} / {name} / seed {seed}: " + (
                "pending (another shard)" if record is None else score_text(record["result"])
                + (" (cached)" if record["cached"] else f" ({record['result']['minutes']:.1f} min)")))
        if None not in records:
            rows.append(quality_row(grid, name, spec, records))
    bar.close()
    return rows


def score_text(result: dict) -> str:
    metric = metric_of(result)
    return f"top-1 {100 * result['test_acc']:.2f}%" if metric == "acc" else f"{metric} {result['test_' + metric]:.5f}"


def quality_row(grid: str, name: str, spec: dict, records: list[dict]) -> dict:
    """One cell over its seeds: mean ± std of accuracy (and at each evaluated depth), the gates' spread, and
    the commits its seeds were trained at (None: a cell recorded before commits were)."""
    results = [r["result"] for r in records]
    depths = sorted({int(d) for r in results for d in r.get("depths", {})})
    if any(sorted(map(int, r.get("depths", {}))) != depths for r in results):  # an edited or mixed cell
        raise SweepError(f"cell {grid} / {name}: its seeds were evaluated at different depths "
                         f"({', '.join(str(sorted(map(int, r.get('depths', {})))) for r in results)}); delete "
                         f"its cells/*.json to re-run it")
    gates = [r.get("gates") for r in records]
    metric = metric_of(results[0])  # acc for classification; the planted task and distillation score an MSE
    return {"grid": grid, "cell": name, "num_experts": spec.get("num_experts"),
            "variant": "model_args" in spec,  # e.g. the depth prior: a point beside the E line, not on it
            "params": results[0]["params"], "reference_depth": results[0]["reference_depth"],
            "metric": metric, metric: mean_std([r["test_" + metric] for r in results]),
            "depths": {d: mean_std([r["depths"][str(d)][metric] for r in results]) for d in depths},
            "gate_spread": mean_std([g["gate_spread"] for g in gates]) if all(gates) else None,
            "dominant_expert": [g["dominant_expert"] for g in gates] if all(gates) else None,
            "gate_traces": [r["gate_trace"] for r in records] if all("gate_trace" in r for r in records) else None,
            "minutes": sum(r["minutes"] for r in results),
            "commits": sorted({r.get("commit") for r in records}, key=str)}


def read_quality(path: str) -> dict:
    """OUT/quality.json as quality_markdown and plot_quality take it (JSON keys the depths as strings)."""
    with open(path) as fh:
        result = json.load(fh)
    for row in result["rows"]:
        row["depths"] = {int(d): stats for d, stats in row["depths"].items()}
    return result


# --- tables and plots ---


def pm(stats: dict) -> str:
    """'88.12 ± 0.20 [88.0 88.3 88.1]': mean ± std over seeds, then the per-seed values, in %."""
    seeds = " ".join(f"{100 * v:.1f}" for v in stats["values"])
    return f"{100 * stats['mean']:.2f} ± {100 * stats['std']:.2f} [{seeds}]"


def gate_cell(row: dict, template: str) -> str:
    """A gate column of the table: '–' for models without depth-only gates (ViT, Raptor, E = 1)."""
    if not row["gate_spread"]:
        return "–"
    return template.format(**row["gate_spread"], path="".join(map(str, row["dominant_expert"][0])))


def tying_gaps(rows: list[dict]) -> list[dict]:
    """Pair each setting's 'S: ViT' and 'S: E=1' rows; the gap is the difference of the means ± its standard error."""
    cells = {r["cell"]: r for r in rows}
    pairs = []
    for setting in dict.fromkeys(name.split(":")[0] for name in cells):
        vit, tied = cells.get(f"{setting}: ViT"), cells.get(f"{setting}: E=1")
        if vit and tied:
            gap = 100 * (vit["acc"]["mean"] - tied["acc"]["mean"])
            se = 100 * math.sqrt(sum(r["acc"]["std"] ** 2 / len(r["acc"]["values"]) for r in (vit, tied)))
            pairs.append({"setting": setting, "vit": vit["acc"], "tied": tied["acc"], "gap": f"{gap:+.2f} ± {se:.2f}"})
    return pairs


def score(row: dict) -> str:
    """The row's metric over seeds: top-1 in % (pm), or an MSE to four decimals, with the per-seed values."""
    stats = row[row.get("metric", "acc")]
    if row.get("metric", "acc") == "acc":
        return "top-1 " + pm(stats)
    seeds = " ".join(f"{v:.4f}" for v in stats["values"])
    return f"{row['metric']} {stats['mean']:.4f} ± {stats['std']:.4f} [{seeds}]"


SCORE_COLUMNS = [("cell", f("cell", "{}")), ("params", f("params", "{:,}")), ("mean ± std [per seed]", score),
                 ("gate spread (0 = flat)", lambda r: gate_cell(r, "{mean:.2f} ± {std:.2f}")),
                 ("dominant expert per step, seed 0", lambda r: gate_cell(r, "{path}"))]
TITLES = {"experts": "Accuracy against the expert count (paper Table 5, Table 1)",
          "elastic": "Accuracy at inference depths after elastic training (paper Fig. 2)",
          "quickstart": "At the quick start's size (d = 96, L = 6, 15 epochs)",
          "tying": "What tying the blocks costs: untied ViT vs one shared block (E = 1)"}


def grid_table(grid: str, rows: list[dict]) -> str:
    """One grid's table: accuracy at every depth (elastic), the cost of tying (pairs of rows), else a row per
    cell with its score over seeds and its gates."""
    if grid == "elastic":
        depths = sorted({d for r in rows for d in r["depths"]})
        return markdown(rows, [("cell", f("cell", "{}"))] + [
            (f"depth {d}" + (" (L)" if d == rows[0]["reference_depth"] else ""), lambda r, d=d: pm(r["depths"][d]))
            for d in depths])
    if grid == "tying":
        return markdown(tying_gaps(rows), [
            ("setting", f("setting", "{}")), ("ViT (untied)", lambda r: pm(r["vit"])),
            ("reViT E=1", lambda r: pm(r["tied"])), ("gap (points ± s.e.)", f("gap", "{}"))])
    return markdown(rows, SCORE_COLUMNS)


def quality_markdown(result: dict) -> str:
    """The sweep's tables, from run_sweep's result or read_quality(OUT/quality.json)."""
    out = [f"## Quality sweep: {result['seeds']} seeds per cell, regime `{' '.join(result['regime_argv'])}`"]
    for grid in dict.fromkeys(r["grid"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["grid"] == grid]
        out += [f"\n### {TITLES.get(grid, f'Grid {grid}')}\n", grid_table(grid, rows)]
    out.append(f"\n{sum(r['minutes'] for r in result['rows']):.1f} training minutes in all (cached cells "
               f"count their original run); cells in {result['out_dir']}/cells.")
    return "\n".join(out)


def plot_quality(result: dict, folders: list[tuple]) -> list[str]:
    """accuracy vs E with error bars (Table 5 shape) and accuracy vs inference depth with bands (Fig. 2),
    written to each (folder, file-name pattern with {kind})."""
    plt = pyplot()
    if plt is None:
        return []
    figures = {}
    experts = [r for r in result["rows"] if r["grid"] == "experts"]
    if experts:
        figures["experts"] = plot_experts(plt, experts)
    for grid, kind in (("elastic", "depths"), ("planted-elastic", "planted-depths")):
        elastic = [r for r in result["rows"] if r["grid"] == grid]
        untied = [r for r in result["rows"] if r["grid"] == "planted" and r["cell"] == "ViT (untied)"]
        if elastic:
            figures[kind] = plot_elastic(plt, elastic, untied[0] if grid == "planted-elastic" and untied else None)
    traced = [r for r in result["rows"] if r.get("gate_traces")]
    if traced:
        figures["gates"] = plot_gate_traces(plt, traced)
    paths = []
    for kind, fig in figures.items():
        fig.tight_layout()
        for folder, pattern in folders:
            os.makedirs(folder, exist_ok=True)
            paths.append(os.path.join(folder, pattern.format(kind=kind)))
            save_png(fig, paths[-1])
        plt.close(fig)
    return paths


def plot_experts(plt, experts: list[dict]):
    fig, ax = plt.subplots(figsize=(5, 3.6), dpi=120)
    bank = [r for r in experts if r["num_experts"] and not r.get("variant")]  # the E line: paper's router
    ax.errorbar([r["num_experts"] for r in bank], [100 * r["acc"]["mean"] for r in bank],
                yerr=[100 * r["acc"]["std"] for r in bank], fmt="o-", capsize=3, label="reViT")
    for r, marker in zip([r for r in experts if r["num_experts"] and r.get("variant")], "*Ds"):
        ax.errorbar([r["num_experts"]], [100 * r["acc"]["mean"]], yerr=[100 * r["acc"]["std"]], fmt=marker,
                    markersize=9, capsize=3, label=r["cell"])
    for r, style in zip([r for r in experts if not r["num_experts"]], ("--", ":", "-.")):
        mean, std = 100 * r["acc"]["mean"], 100 * r["acc"]["std"]
        ax.axhline(mean, ls=style, color="gray", label=r["cell"])
        ax.axhspan(mean - std, mean + std, color="gray", alpha=0.15)
    ax.set_xscale("log", base=2)
    ax.set_xticks([r["num_experts"] for r in bank], labels=[str(r["num_experts"]) for r in bank])
    ax.set(xlabel="experts E", ylabel="top-1 accuracy (%)", title="accuracy vs E (mean ± std over seeds)")
    ax.legend(fontsize=7)
    return fig


def plot_gate_traces(plt, rows: list[dict]):
    """The gate spread (max - min of the gate matrix) at every evaluation of each seed's run: does a program
    form, and is it still forming at the end?"""
    fig, ax = plt.subplots(figsize=(5, 3.6), dpi=120)
    for r, color in zip(rows, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4):
        for i, trace in enumerate(r["gate_traces"]):
            ax.plot([step for step, _ in trace], [spread for _, spread in trace], "o-", markersize=3, color=color,
                    alpha=0.8, label=f"{r['grid']}: {r['cell']}" if i == 0 else None)
    ax.set(xlabel="optimizer step", ylabel="gate spread (0 = flat)", ylim=(0, 1),
           title="gate spread during training, each seed")
    ax.legend(fontsize=7)
    return fig


def plot_elastic(plt, elastic: list[dict], reference: dict | None = None):
    """The score of each elastic checkpoint at every inference depth, with a band of one std over seeds;
    `reference` (a fixed-depth model) is one point at its own depth."""
    metric = elastic[0].get("metric", "acc")
    scale, label = (100, "top-1 accuracy (%)") if metric == "acc" else (1, "test MSE (lower is better)")
    fig, ax = plt.subplots(figsize=(5, 3.6), dpi=120)
    for r in elastic:
        depths = sorted(r["depths"], key=int)
        mean = [scale * r["depths"][d]["mean"] for d in depths]
        std = [scale * r["depths"][d]["std"] for d in depths]
        ax.plot([int(d) for d in depths], mean, "o-", label=r["cell"])
        ax.fill_between([int(d) for d in depths], [m - s for m, s in zip(mean, std)],
                        [m + s for m, s in zip(mean, std)], alpha=0.2)
    if reference:
        ax.errorbar([reference["reference_depth"]], [scale * reference[metric]["mean"]],
                    yerr=[scale * reference[metric]["std"]], fmt="k*", markersize=10, capsize=3,
                    label=f"{reference['cell']}, trained at L = {reference['reference_depth']}")
    ax.axvline(elastic[0]["reference_depth"], ls=":", color="gray")
    ax.set(xlabel="inference depth", ylabel=label, title="after elastic training (mean ± std)")
    ax.legend(fontsize=7)
    return fig


# --- command line ---


def parse_shard(text: str) -> tuple:
    match = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not match or not 1 <= int(match[1]) <= int(match[2]):
        raise SweepError(f"--shard takes K/N with 1 <= K <= N (e.g. 1/2); got {text!r}")
    return int(match[1]), int(match[2])


def parse_grids(text: str) -> list[str]:
    grids = [g.strip() for g in text.split(",") if g.strip()]
    unknown = sorted(set(grids) - set(GRIDS))
    if unknown or not grids:
        raise SweepError(f"--grids must name some of {', '.join(GRIDS)}; got {text!r}")
    return grids


def thread_count(threads: int | None) -> int:
    """--threads, else OMP_NUM_THREADS when the user set it, else one thread per run."""
    if threads is None:
        threads = int(os.environ["OMP_NUM_THREADS"]) if os.environ.get("OMP_NUM_THREADS", "").isdigit() else 1
    check_numbers({"threads": threads}, PROG)
    return threads


def run_sweep(args) -> dict:
    check_numbers(vars(args), PROG)
    try:
        device = pick_device(args.device)
    except ValueError as e:
        raise SweepError(str(e)) from None
    regime = dict(QUICK_REGIME if args.quick else REGIMES[args.regime], device=str(device))
    grids, shard, threads = parse_grids(args.grids), parse_shard(args.shard), thread_count(args.threads)
    seeds = args.seeds or (2 if args.quick else 3)
    out_dir = args.out or ("out/quality-quick" if args.quick else f"out/quality/{args.regime}")
    problem = output_problem(out_dir, "folder")
    if problem:
        raise InputError(f"--out {out_dir} {problem}")
    rows = quality_rows(grids, regime, seeds, out_dir, shard, threads, args.progress)
    result = {"command": "quality", "quick": args.quick, "regime_name": args.regime, "regime": regime,
              "seeds": seeds, "grids": grids,
              "regime_argv": cell_argv(regime, {}, 0)[:-2], "out_dir": out_dir, "rows": rows}
    name = "quick" if args.quick else args.regime  # a smoke run never overwrites a real sweep's pictures
    folders = [(out_dir, "quality_{kind}.png")] + ([(os.path.join(ROOT, "assets"), f"quality-{name}-{{kind}}.png")]
                                                   if args.assets else [])
    result["plots"] = plot_quality(result, folders)
    print(quality_markdown(result))
    write_json(result, os.path.join(out_dir, "quality.json"))
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grids", default=DEFAULT_GRIDS, help=f"which grids (of {', '.join(GRIDS)}; default {DEFAULT_GRIDS})")
    p.add_argument("--regime", default="d48-L12", choices=list(REGIMES),
                   help="the flags every cell shares (tools/sweep.py REGIMES; default d48-L12)")
    p.add_argument("--seeds", type=int, help="seeds per cell (default 3; --quick 2)")
    p.add_argument("--out", help="folder of finished cells (resumes from it), runs, quality.json and plots "
                                 "(default out/quality/REGIME, --quick out/quality-quick)")
    p.add_argument("--quick", action="store_true", help="a smoke run in seconds: tiny model, two steps per cell")
    p.add_argument("--assets", action="store_true", help="also write the plots to assets/")
    p.add_argument("--shard", default="1/1", help="K/N: train only every N-th run from the K-th (run N processes "
                                                  "on one --out folder to split a sweep; then once more for the table)")
    p.add_argument("--device", default="auto", help="train.py's --device for every cell: auto, cpu, cuda or cuda:N")
    p.add_argument("--threads", type=int, help="CPU threads per train.py run (default: $OMP_NUM_THREADS if set, else 1)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="a progress bar over the runs on stderr, when it is a terminal")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    try:
        result = run_sweep(args)
    except (SweepError, InputError) as e:  # bad input, a failed cell, a damaged cell file: one line
        fail(str(e), PROG)
    print(json_text(result))
    return result


if __name__ == "__main__":
    run_main(main, "finished cells are kept; the same command continues with the rest")
