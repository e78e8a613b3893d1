"""Training curves of one or more runs, read from their metrics.jsonl: the training loss (solid) and the
validation loss (dots) by step, and beside them the validation accuracy in percent (vision runs) and the bits
per byte (language runs). Needs matplotlib (requirements-extra.txt).

    python -m tools.plot out/revit-mini-<time> [out/vit-mini-<time> ...] [--out curves.png]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

if not __package__:  # run as a file (python tools/plot.py): the project's modules are not on the path
    sys.exit("tools/plot.py: error: run it from the repository root as python -m tools.plot")

from lib.boundary import fail, output_problem, path_problem
from lib.cli import ArgumentParser, atomic_write, pyplot, run_main

PROG = "python -m tools.plot"
PANELS = {"val_acc": ("val acc (%)", 100), "val_bpb": ("bits/byte", 1)}  # beside the loss: (title, scale)
FLOAT32_MAX = 3.4028234663852886e38  # a run's losses are float32; near 1e308 matplotlib's axes overflow


def read_curves(run: str) -> dict:
    """{"train_loss": {step: loss}, "val_loss": ..., "val_acc" / "val_bpb": ...} of a run folder (or its
    metrics.jsonl); a step logged twice keeps its last value."""
    path = Path(run) / "metrics.jsonl" if Path(run).is_dir() else Path(run)
    problem = path_problem(path)
    if problem:
        fail(f"RUN {path}: {problem}", PROG)
    curves, logged = {"train_loss": {}}, False
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        try:
            record = json.loads(line)
        except ValueError:  # JSONDecodeError, or an integer of over 4,300 digits
            continue  # a torn last line of a killed run
        logged = logged or isinstance(record, dict)
        if isinstance(record, dict) and record.get("event") == "final":  # the last evaluation, last step
            scores = {k.replace("test_", "val_", 1): v for k, v in record.items()  # vision's: test_*
                      if k.startswith(("test_", "val_"))}
            record = {"step": max(curves["train_loss"], default=0), "eval": scores}
        if not isinstance(record, dict) or not isinstance(record.get("step"), int) or "event" in record:
            continue
        step, scores = record["step"], record.get("eval", {})
        if not isinstance(scores, dict):  # train.py logs its evaluation as {"val_loss": 0.41, ...}
            fail(f"RUN {path} line {n}: its eval is {json.dumps(scores)[:40]}, not the metrics by name "
                 "that train.py logs", PROG)
        for key, value in [("train_loss", record.get("loss")), *scores.items()]:
            if isinstance(value, (int, float)):
                if abs(step) > FLOAT32_MAX or abs(value) > FLOAT32_MAX:
                    fail(f"RUN {path} line {n} holds a number beyond float32's ±3.4e38, which no run "
                         "logs", PROG)
                curves.setdefault(key, {})[step] = value
    if not logged:  # a checkpoint, a weights file, a picture: no line of a log
        fail(f"RUN {path} is not a training run's log: give a run folder of train.py or its metrics.jsonl",
             PROG)
    if not curves["train_loss"]:
        fail(f"RUN {path} holds no training-loss line (train.py logs one every --log-interval)", PROG)
    return curves


def draw(plt, runs: dict, out: Path) -> None:
    panels = [key for key in PANELS if any(key in c for c in runs.values())]  # each that any run logs
    fig, axes = plt.subplots(1, 1 + len(panels), figsize=(6 + 5 * len(panels), 4), squeeze=False)
    loss_ax, beside = axes[0][0], list(zip(axes[0][1:], panels))
    for name, curves in runs.items():
        line, = loss_ax.plot(*zip(*sorted(curves["train_loss"].items())), label=f"{name} train", lw=1)
        if "val_loss" in curves:
            loss_ax.plot(*zip(*sorted(curves["val_loss"].items())), "o--", color=line.get_color(), ms=3,
                         label=f"{name} val")
        for ax, key in beside:
            if key in curves:
                steps, values = zip(*sorted(curves[key].items()))
                ax.plot(steps, [PANELS[key][1] * v for v in values], "o-", color=line.get_color(), ms=3,
                        label=name)
    loss_ax.set(xlabel="step", ylabel="loss", title="loss")
    for ax, key in beside:
        ax.set(xlabel="step", ylabel=PANELS[key][0], title=PANELS[key][0])
    for ax in axes[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    try:
        save_png(fig, out)
    finally:
        plt.close(fig)


def save_png(fig, path) -> None:
    """Every figure the tools write: a temp file, then os.replace (written whole or not at all)."""
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))


def main(argv=None) -> Path:
    parser = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN", help="a run folder of train.py (or metrics.jsonl)")
    parser.add_argument("--out", default="", help="the PNG [default: curves.png beside the first RUN]")
    args = parser.parse_args(argv)
    folders = [Path(run) if Path(run).is_dir() else Path(run).parent for run in args.runs]
    runs = {}
    for run, folder in zip(args.runs, folders):
        runs[folder.name if folder.name not in runs else run] = read_curves(run)
    out = Path(args.out) if args.out else folders[0] / "curves.png"
    problem = output_problem(out, "file")
    if problem:
        fail(f"--out {out} {problem}", PROG)
    plt = pyplot()
    if plt is None:
        fail("matplotlib is not installed, so no figure (pip install -r requirements-extra.txt)", PROG)
    draw(plt, runs, out)
    print(f"wrote {out} ({len(runs)} run(s))")
    return out


if __name__ == "__main__":
    run_main(main, "the figure is written whole or not at all")
