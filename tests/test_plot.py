"""python -m tools.plot RUN [RUN...]: the loss and accuracy curves of runs, read from their metrics.jsonl."""
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


def test_plot_reads_a_language_run_by_its_bits_per_byte(tmp_path):
    out = tmp_path / "lm"
    train.main(["--arch", "alternet-tiny", "--out-dir", str(out), "--no-progress", "--max-steps", "4",
                "--batch-size", "4", "--block-size", "32", "--eval-iters", "2", "--eval-interval", "2",
                "--log-interval", "1"])
    curves = plot.read_curves(str(out))
    assert sorted(curves["train_loss"]) == [1, 2, 3, 4] and sorted(curves["val_bpb"]) == [2, 4]

