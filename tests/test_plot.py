"""python -m tools.plot RUN [RUN...]: the loss and accuracy curves of runs, read from their metrics.jsonl."""
import json

import pytest

import train
from tools import plot


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


def test_plot_says_a_file_that_is_no_log_is_not_a_run(tmp_path):
    """A checkpoint or a weights file given as RUN: named as what it is not, not as a log short of a line."""
    (tmp_path / "m.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}" + bytes(range(256)))
    with pytest.raises(SystemExit) as stopped:
        plot.main([str(tmp_path / "m.safetensors")])
    assert str(stopped.value) == (f"python -m tools.plot: error: RUN {tmp_path / 'm.safetensors'} is not a "
                                  f"training run's log: give a run folder of train.py or its metrics.jsonl")


def test_plot_draws_accuracy_in_percent_beside_a_language_runs_bits_per_byte(piped_run, tmp_path,
                                                                              monkeypatch):
    """A vision run with a language run: loss, val accuracy (%) and bits/byte, each run where it has one."""
    pytest.importorskip("matplotlib")
    (tmp_path / "lm").mkdir()
    (tmp_path / "lm" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n'
                                                   '{"step": 2, "loss": 1.5, "eval": {"val_bpb": 2.25}}\n')
    figures = []
    monkeypatch.setattr(plot, "save_png", lambda fig, path: figures.append(fig))
    plot.main([str(piped_run[0]), str(tmp_path / "lm"), "--out", str(tmp_path / "c.png")])
    loss, accuracy, bits = figures[0].axes
    assert [ax.get_title() for ax in figures[0].axes] == ["loss", "val acc (%)", "bits/byte"]
    vision = sorted(plot.read_curves(str(piped_run[0]))["val_acc"].items())
    assert list(accuracy.lines[0].get_ydata()) == [100 * acc for _, acc in vision]
    assert len(accuracy.lines) == 1
    assert list(bits.lines[0].get_ydata()) == [2.25] and len(bits.lines) == 1


def test_plot_names_a_missing_run_once(tmp_path):
    """A missing run file, or a run folder without metrics.jsonl: its path once, then what is wrong."""
    for run, path in ((tmp_path / "nope", tmp_path / "nope"), (tmp_path, tmp_path / "metrics.jsonl")):
        with pytest.raises(SystemExit) as stopped:
            plot.main([str(run)])
        assert str(stopped.value) == f"python -m tools.plot: error: RUN {path}: no such file"


def test_plot_reads_a_language_run_by_its_bits_per_byte(tmp_path):
    out = tmp_path / "lm"
    train.main(["--arch", "alternet-tiny", "--out-dir", str(out), "--no-progress", "--max-steps", "4",
                "--batch-size", "4", "--block-size", "32", "--eval-iters", "2", "--eval-interval", "2",
                "--log-interval", "1"])
    curves = plot.read_curves(str(out))
    assert sorted(curves["train_loss"]) == [1, 2, 3, 4] and sorted(curves["val_bpb"]) == [2, 4]


@pytest.mark.parametrize("scores", ["[0.5, 0.7]", "0.5", "null"])
def test_plot_refuses_an_eval_that_is_not_metrics_by_name_in_one_line(tmp_path, scores):
    """train.py logs {"step": N, "eval": {"val_loss": ...}}; another shape was a traceback."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n'
                                            f'{{"step": 2, "loss": 1.5, "eval": {scores}}}\n')
    with pytest.raises(SystemExit) as stopped:
        plot.main([str(tmp_path), "--out", str(tmp_path / "c.png")])
    assert str(stopped.value) == (f"python -m tools.plot: error: RUN {tmp_path}/metrics.jsonl line 2: its "
                                  f"eval is {scores}, not the metrics by name that train.py logs")
    assert not (tmp_path / "c.png").exists()


def with_loss(run, folder, loss):
    """A copy of a run's metrics.jsonl, its first training loss replaced by `loss` -> that line's number."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    n = next(i for i, record in enumerate(records) if "loss" in record)
    records[n]["loss"] = loss
    (folder / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return n + 1


@pytest.mark.parametrize("loss", [1.7e308, -1e308, 10 ** 400], ids=["1.7e308", "-1e308", "10**400"])
def test_plot_refuses_a_number_beyond_float32_in_one_line(piped_run, tmp_path, loss):
    """A run logs float32 losses; a larger number (an edited file, another program's) overflowed
    matplotlib's axis scaling in a traceback."""
    line = with_loss(piped_run[0], tmp_path, loss)
    with pytest.raises(SystemExit) as stopped:
        plot.main([str(tmp_path), "--out", str(tmp_path / "c.png")])
    assert str(stopped.value) == (f"python -m tools.plot: error: RUN {tmp_path}/metrics.jsonl "
                                  f"line {line} holds a number beyond float32's ±3.4e38, which no run logs")
    assert not (tmp_path / "c.png").exists()


def test_plot_draws_a_loss_at_the_float32_limit(piped_run, tmp_path):
    pytest.importorskip("matplotlib")
    with_loss(piped_run[0], tmp_path, 3.4028234663852886e38)
    assert plot.main([str(tmp_path)]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_skips_a_line_of_a_number_python_will_not_read_as_a_torn_one(piped_run, tmp_path):
    """An integer of over 4,300 digits is json.loads' ValueError, not a JSONDecodeError."""
    text = (piped_run[0] / "metrics.jsonl").read_text()
    (tmp_path / "metrics.jsonl").write_text(text + '{"step": 9, "loss": 1' + "0" * 5000 + "}\n")
    assert plot.read_curves(str(tmp_path)) == plot.read_curves(str(piped_run[0]))
