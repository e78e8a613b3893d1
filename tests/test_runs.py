"""A run records what made it and shows its loss, and its curves can be drawn: the `start` event of
metrics.jsonl (commit, torch, device, command line), the training-loss lines when no bar is on screen,
lines that never glue to the bar in piped output, and `python -m tools.plot`.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lib import cli
from tools import plot

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--arch", "revit-mini", "--device", "cpu", "--train-subset", "256", "--test-subset", "128",
        "--batch-size", "32", "--patch-size", "7", "--depth", "2",
        "--model-args", "dim=32,heads=2,ffn_dim=64", "--max-steps", "8", "--log-interval", "2",
        "--eval-interval", "4"]


@pytest.fixture(scope="module")
def piped_run(tmp_path_factory, fashion_mnist_dir):
    """A tiny run with its progress bar on (the default), stdout and stderr piped into one stream."""
    out = tmp_path_factory.mktemp("runs") / "piped"
    argv = [sys.executable, str(ROOT / "train.py"), *TINY, "--data-dir", str(fashion_mnist_dir),
            "--out-dir", str(out)]
    done = subprocess.run(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:]
    return out, done.stdout


def test_the_start_event_names_the_commit_torch_device_and_command(piped_run):
    out, _ = piped_run
    start = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert start["event"] == "start"
    assert start["commit"] == (cli.git_commit(str(ROOT)) or "unknown")
    assert start["torch"] == torch.__version__ and start["device"] == "cpu"
    assert start["command"].startswith(f"python {ROOT / 'train.py'} --arch revit-mini --device cpu")
    assert f"--out-dir {out}" in start["command"]


def test_piped_output_shows_the_loss_on_lines_of_their_own(piped_run):
    """What a terminal or `less` shows of each line is what follows its last carriage return: a log line
    printed beside tqdm's bar (which ends in no newline) would show the bar glued in front of it."""
    _, output = piped_run
    shown = [line.split("\r")[-1] for line in output.splitlines()]
    assert [line.split(":")[0] for line in shown if ": loss " in line] == [f"step {s}" for s in (2, 4, 6, 8)]
    assert sum(line.startswith("step 4: val_acc") for line in shown) == 1
    assert shown[-1].startswith("done: revit-mini")


def test_no_progress_prints_the_loss_every_log_interval(tmp_path, fashion_mnist_dir, capsys):
    import train
    train.main([*TINY, "--data-dir", str(fashion_mnist_dir), "--out-dir", str(tmp_path / "run"),
                "--no-progress"])
    losses = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in losses if "loss" in r}
    printed = [line for line in capsys.readouterr().out.splitlines() if ": loss " in line]
    expected = [f"step {s}: loss {losses[s]:.4f}" for s in (2, 4, 6, 8)]
    assert [line.split(",")[0] for line in printed] == expected
    assert all(line.endswith(" images/s") for line in printed)


def test_plot_draws_the_curves_of_several_runs(piped_run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out, _ = piped_run
    written = plot.main([str(out), str(out / "metrics.jsonl"), "--out", str(tmp_path / "c.png")])
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out == f"wrote {written} (2 run(s))\n"
    assert plot.read_curves(str(out))["val_acc"].keys() == {4, 8}


def test_plot_without_matplotlib_says_so_in_one_line(piped_run, tmp_path, monkeypatch):
    monkeypatch.setattr(plot, "pyplot", lambda: None)
    with pytest.raises(SystemExit) as stopped:
        plot.main([str(piped_run[0]), "--out", str(tmp_path / "c.png")])
    assert str(stopped.value) == ("python -m tools.plot: error: matplotlib is not installed, so no figure "
                                  "(pip install -r requirements-extra.txt)")
    assert not (tmp_path / "c.png").exists()


def test_plot_refuses_a_file_without_training_loss(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"event": "start", "step": 0}\n'
                                            '{"step": 1, "eval": {"val_acc": 0.5}}\n')
    with pytest.raises(SystemExit, match="holds no training-loss line"):
        plot.main([str(tmp_path)])


# --- resume says what it continues ---


def test_a_complete_run_resumed_with_nothing_new_says_so_and_trains_nothing(tmp_path, fashion_mnist_dir,
                                                                             capsys):
    import train
    out = tmp_path / "run"
    train.main([*TINY, "--data-dir", str(fashion_mnist_dir), "--out-dir", str(out), "--no-progress"])
    before = {name: (out / name).read_bytes() for name in ("ckpt.pt", "metrics.jsonl")}
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        train.main(["--resume", str(out / "ckpt.pt"), "--data-dir", str(fashion_mnist_dir), "--no-progress"])
    assert stopped.value.code in (0, None)
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"--resume {out / 'ckpt.pt'}: the run is complete (step 8 of 8); nothing to train. Extend it with a "
        f"larger --max-steps or --epochs, or evaluate it with --eval-only {out / 'ckpt.pt'}")
    assert {name: (out / name).read_bytes() for name in before} == before


def test_extending_a_run_says_how_its_schedule_changes(tmp_path, fashion_mnist_dir, capsys):
    import train
    out = tmp_path / "run"
    train.main([*TINY, "--data-dir", str(fashion_mnist_dir), "--out-dir", str(out), "--no-progress"])
    saved = torch.load(out / "ckpt.pt", weights_only=True)["scheduler"]
    capsys.readouterr()
    summary = train.main(["--resume", str(out / "ckpt.pt"), "--data-dir", str(fashion_mnist_dir),
                          "--no-progress", "--max-steps", "12", "--lr", "1e-3"])
    peak = torch.load(out / "ckpt.pt", weights_only=True)["scheduler"]["peak_lr"]  # --lr scaled by the batch
    before = train.lr_at(8, saved["peak_lr"], saved)
    longer = train.lr_at(8, saved["peak_lr"], {**saved, "total_steps": 12})
    overrides = [line for line in capsys.readouterr().out.splitlines() if line.startswith("override:")]
    assert overrides[-2:] == [
        f"override: total_steps=12 (the checkpoint's: 8; --max-steps / --epochs): the lr at step 8 goes from "
        f"{before:.3g} to {longer:.3g}, and the run continues to step 12",
        f"override: peak_lr={peak:g} (the checkpoint's: {saved['peak_lr']:g}; --lr / --lr-batch): the lr at "
        f"step 8 goes from {before:.3g} to {before:.3g}"]  # at the cosine's end: min_lr whatever the peak
    assert longer > 10 * before and summary["step"] == 12


def test_plot_reads_a_language_run_by_its_bits_per_byte(tmp_path):
    import train
    out = tmp_path / "lm"
    train.main(["--arch", "alternet-tiny", "--out-dir", str(out), "--no-progress", "--max-steps", "4",
                "--batch-size", "4", "--block-size", "32", "--eval-iters", "2", "--eval-interval", "2",
                "--log-interval", "1"])
    curves = plot.read_curves(str(out))
    assert sorted(curves["train_loss"]) == [1, 2, 3, 4] and sorted(curves["val_bpb"]) == [2, 4]
