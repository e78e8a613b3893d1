"""sweep.py: train.py per cell over seeds, in its own process; cached cells, mean ± std, shards, resume.

The arithmetic of the tables runs against a stand-in train script (accuracy from the seed, no torch);
the real train.py runs only where the test is about it (--quick sizes, a few runs).
"""
import io
import json
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from lib import tables
from tools import sweep
import train

ROOT = Path(__file__).resolve().parent.parent

FAKE_TRAIN = """
import json, os, sys
argv = sys.argv[1:]
value = lambda flag: argv[argv.index(flag) + 1]
out = value("--out-dir") if "--out-dir" in argv else os.path.dirname(value("--resume"))
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "calls.jsonl"), "a") as fh:
    fh.write(json.dumps({"argv": argv, "threads": os.environ.get("OMP_NUM_THREADS")}) + "\\n")
if "--fail" in os.environ.get("FAKE_TRAIN", ""):
    sys.exit("train.py: error: --batch-size 100000 is larger than the training set")
acc = 0.80 + 0.02 * value("--arch").startswith("vit") + 0.01 * int(value("--seed"))
with open(os.path.join(out, "metrics.jsonl"), "a") as fh:
    fh.write(json.dumps({"event": "start", "step": 0}) + "\\n")
    fh.write(json.dumps({"step": 5, "loss": 1.0}) + "\\n")
    fh.write(json.dumps({"event": "final", "arch": value("--arch"), "params": 1, "reference_depth": 6,
                         "test_acc": acc, "test_loss": 0.5, "depths": {}, "minutes": 0.1}) + "\\n")
print("done")
"""


@pytest.fixture
def fake_train(tmp_path, monkeypatch):
    """sweep runs a stand-in for train.py; -> a function returning the calls it received."""
    script = tmp_path / "fake" / "train.py"
    script.parent.mkdir()
    script.write_text(FAKE_TRAIN)
    monkeypatch.setattr(sweep, "TRAIN_COMMAND", (sys.executable, str(script)))
    calls = script.parent / "calls.jsonl"
    return lambda: [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []


def run_cli(argv):
    """sweep.main with its stdout captured -> (result, printed lines)."""
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        result = sweep.main(argv)
    return result, buffer.getvalue().strip().splitlines()


# --- cells: command lines and the cache ---


def test_cell_argv_merges_the_regime_and_the_cell():
    regime = {"arch": "revit-mini", "epochs": 15, "model_args": "dim=64"}
    argv = sweep.cell_argv(regime, sweep.GRIDS["elastic"]["feature-only"], seed=2)
    assert argv == ["--arch", "revit-mini", "--epochs", "15", "--model-args", "dim=64,ffn=feature",
                    "--depth-drop", "0.3", "--eval-depths", "2,3,4,6,9,12", "--seed", "2"]
    assert sweep.cell_argv(regime, sweep.GRIDS["experts"]["Raptor k=2"], 0)[:2] == ["--arch", "raptor-mini-k2"]


def test_model_args_of_a_cell_override_the_regimes():
    assert sweep.merge_model_args("dim=48,heads=3,ffn_dim=96", "dim=32,ffn=feature") == \
        "dim=32,heads=3,ffn_dim=96,ffn=feature"
    assert sweep.merge_model_args("", "router_prior=8") == "router_prior=8"


def test_run_cell_reuses_a_finished_cell_of_the_same_command(tmp_path, fake_train):
    first = sweep.run_cell("cell", ["--arch", "vit-mini", "--seed", "0"], str(tmp_path))
    again = sweep.run_cell("cell", ["--arch", "vit-mini", "--seed", "0"], str(tmp_path))
    changed = sweep.run_cell("cell", ["--arch", "vit-mini", "--seed", "1"], str(tmp_path))
    assert len(fake_train()) == 2 and not first["cached"] and again["cached"] and not changed["cached"]
    assert again["result"] == first["result"] and first["result"]["step"] == 5
    assert all(call["threads"] == "1" for call in fake_train())  # one thread per run unless asked otherwise
    assert "done" in (tmp_path / "runs" / "cell" / "train.log").read_text()  # the run's output, in its log


def test_a_cached_cell_is_found_whatever_the_order_of_its_flags(tmp_path, fake_train):
    sweep.run_cell("a", ["--arch", "vit-mini", "--seed", "0", "--epochs", "2"], str(tmp_path))
    again = sweep.run_cell("b", ["--epochs", "2", "--seed", "0", "--arch", "vit-mini"], str(tmp_path))
    other = sweep.run_cell("c", ["--epochs", "2", "--seed", "1", "--arch", "vit-mini"], str(tmp_path))
    assert again["cached"] and not other["cached"]


def test_a_cell_records_the_commit_and_torch_it_was_trained_at(tmp_path, fake_train, monkeypatch):
    import torch
    record = sweep.run_cell("cell", ["--arch", "vit-mini", "--seed", "0"], str(tmp_path))
    saved = json.loads((tmp_path / "cells" / "cell.json").read_text())
    assert saved["torch"] == torch.__version__ and saved["commit"] == record["commit"]
    if (ROOT / ".git").exists():
        commit = saved["commit"].removesuffix("-dirty")
        assert len(commit) == 40 and all(c in "0123456789abcdef" for c in commit)
    monkeypatch.setattr(sweep, "ROOT", str(tmp_path))  # outside any git repository: no commit to name
    assert sweep.run_cell("cell", ["--arch", "vit-mini", "--seed", "1"], str(tmp_path))["commit"] is None


def test_a_cell_written_before_commits_were_recorded_is_still_read(tmp_path, fake_train):
    committed = json.loads((ROOT / "results/quality/d48-L12/cells/quickstart-revit-mini-seed0.json").read_text())
    assert "commit" not in committed
    (tmp_path / "cells").mkdir()
    (tmp_path / "cells" / "old.json").write_text(json.dumps(committed))
    record = sweep.run_cell("other-name", committed["argv"], str(tmp_path))
    assert record["cached"] and record["result"] == committed["result"] and fake_train() == []


def test_the_committed_quality_json_renders_its_tables():
    result = json.loads((ROOT / "results/quality/d48-L12/quality.json").read_text())
    table = sweep.quality_markdown(result)  # RESULTS.md's tables (lib/tables.py)
    assert "| reViT E=4 |" in table and "| depth 12 (trained) |" in table and "| depth 2 | depth 3 |" in table


def test_shards_split_the_runs_and_the_last_pass_builds_the_table(tmp_path, fake_train):
    argv = ["--device", "cpu", "--grids", "tying", "--out", str(tmp_path)]
    first, lines = run_cli(argv + ["--shard", "1/2"])
    assert sum("pending (another shard)" in line for line in lines) == 9 and first["rows"] == []  # 18 runs, 9 each
    second, _ = run_cli(argv + ["--shard", "2/2"])
    assert len(list((tmp_path / "cells").glob("*.json"))) == 18 and len(second["rows"]) == 6
    assert len(fake_train()) == 18
    gaps = {setting: gap for setting, _, _, gap in tables.tying_grid(second["rows"])[1]}
    assert gaps == {"regime": "+2.00 ± 0.82", "d=32": "+2.00 ± 0.82", "2L": "+2.00 ± 0.82"}  # s.e. sqrt(2/3) %


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_bar_over_the_runs_on_a_terminal_never_glues_to_the_lines_of_stdout(tmp_path, fake_train, monkeypatch):
    monkeypatch.setattr("sys.stderr", Terminal())
    _, lines = run_cli(["--device", "cpu", "--grids", "tying", "--out", str(tmp_path)])
    assert [line.split("]")[0] for line in lines[:18]] == [f"[{i}/18" for i in range(1, 19)]
    assert "runs: " in sys.stderr.getvalue() and not any("\r" in line or "runs: " in line for line in lines)
    monkeypatch.setattr("sys.stderr", Terminal())
    run_cli(["--device", "cpu", "--grids", "tying", "--out", str(tmp_path), "--no-progress"])
    assert sys.stderr.getvalue() == ""


def test_a_cell_killed_before_its_first_checkpoint_starts_over(tmp_path, fake_train):
    run_dir = tmp_path / "runs" / "cell"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"event": "start", "step": 0}\n')  # no ckpt.pt yet
    sweep.run_cell("cell", ["--arch", "vit-mini", "--seed", "0"], str(tmp_path))
    argv = fake_train()[0]["argv"]
    assert "--resume" not in argv and argv[argv.index("--out-dir") + 1] == str(run_dir) and "--overwrite" in argv


# --- the real train.py, at --quick sizes ---


def test_quick_sweep_and_resume(tmp_path, fashion_mnist_dir, monkeypatch):
    monkeypatch.setitem(sweep.QUICK_REGIME, "data_dir", str(fashion_mnist_dir))
    # one seed: the arithmetic over seeds is checked above, against the stand-in
    argv = ["--quick", "--device", "cpu", "--out", str(tmp_path), "--grids", "elastic", "--seeds", "1"]
    result, lines = run_cli(argv)
    rows = {r["cell"]: r for r in result["rows"]}
    assert set(rows) == set(sweep.GRIDS["elastic"])
    for r in rows.values():
        assert len(r["acc"]["values"]) == 1 and r["acc"]["std"] == 0
        assert list(r["depths"]) == ["2", "3", "4", "5", "6"]  # 2, 3, 4, L, 1.5L, 2L at L = 3, as JSON keys them
    assert len(list((tmp_path / "cells").glob("*.json"))) == 2
    table = "\n".join(lines[:-1])
    assert "| depth-programmed |" in table and "±" in table and "| depth 3 (trained) |" in table
    assert json.loads(lines[-1]) == json.loads((tmp_path / "quality.json").read_text())
    # each run in its own process, its output in its own log
    assert "done: revit-mini" in (tmp_path / "runs" / "elastic-feature-only-seed0" / "train.log").read_text()
    # the gates of each seed's checkpoint: a spread and a dominant-expert path for depth-only gates, none otherwise
    assert rows["depth-programmed"]["gate_spread"]["mean"] >= 0 and len(rows["depth-programmed"]["dominant_expert"][0]) == 3
    assert rows["feature-only"]["gate_spread"] is None
    again, lines_again = run_cli(argv)  # every cell cached: no training, the same table
    assert again["rows"] == result["rows"]
    assert sum("(cached)" in line for line in lines_again) == 2
    if sweep.pyplot() is not None:
        assert {p.name for p in tmp_path.glob("*.png")} == {"quality_depths.png", "quality_gates.png"}  # gates: the spread of every evaluation


def test_a_cell_killed_mid_run_resumes_from_its_checkpoint(tmp_path, fashion_mnist_dir):
    regime = dict(sweep.QUICK_REGIME, device="cpu", data_dir=str(fashion_mnist_dir), max_steps=3)
    argv = sweep.cell_argv(regime, sweep.GRIDS["experts"]["reViT E=1"], seed=0)
    run_dir = tmp_path / "runs" / "cell"
    with redirect_stdout(io.StringIO()):
        train.main(argv + ["--out-dir", str(run_dir), "--stop-at-step", "2", "--no-progress"])  # "killed" at step 2
    record = sweep.run_cell("cell", argv, str(tmp_path))
    events = [json.loads(line)["event"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
              if "event" in json.loads(line)]
    assert events == ["start", "resume", "final"] and not record["cached"] and record["result"]["step"] == 3


def test_a_failing_cell_is_a_one_line_error(tmp_path, fake_train, monkeypatch):
    monkeypatch.setenv("FAKE_TRAIN", "--fail")  # the stand-in ends as train.py does on bad input (cli.fail)
    with pytest.raises(SystemExit) as error:
        run_cli(["--quick", "--device", "cpu", "--grids", "elastic", "--seeds", "1", "--out", str(tmp_path)])
    text = str(error.value.code)
    assert text.startswith("python -m tools.sweep: error: cell elastic-depth-programmed-seed0 (python train.py --arch revit-mini")
    assert text.endswith("): --batch-size 100000 is larger than the training set") and "\n" not in text
    assert len(fake_train()) == 1 and not (tmp_path / "cells").exists()


# --- hostile inputs: one line each, nothing written ---

TORN = '{"key": "x", "argv": ["--seed", "0"], "result": {"test_acc": 0.8'
WRONG_TYPES = [([1, 2], "a cell record is a JSON object holding a result object; got a JSON list"),
               ({"argv": [], "result": {"test_acc": "high", "params": 1, "reference_depth": 2, "minutes": 1}},
                "result.test_acc must be a number in 0..1; got 'high'"),
               ({"argv": [], "result": {"test_acc": 0.5, "params": 1, "reference_depth": 2, "minutes": 1,
                                        "depths": {"two": {"acc": 0.5}}}}, "result.depths must be a map of depths (1..256)")]
GOOD = {"key": "x", "argv": [], "result": {"test_acc": 0.5, "params": 1, "reference_depth": 2, "minutes": 1}}
WRONG_TYPES += [  # the last adversary round: each refused by a rule of the record, not as a case of its own
    ({**GOOD, "argv": "--seed 0"}, "argv must be a list of strings"),
    ({**GOOD, "argv": ["--seed", "0", "--epochs"]}, "argv must be a list of strings: flags and their values"),
    ({**GOOD, "result": {**GOOD["result"], "test_acc": 1e308}}, "result.test_acc must be a number in 0..1; got 1e+308"),
    ({**GOOD, "result": {**GOOD["result"], "depths": {"\u0664": {"acc": 0.5}}}}, "result.depths must be a map of depths (1..256)"),
    ({**GOOD, "result": {**GOOD["result"], "depths": {"9" * 5000: {"acc": 0.5}}}}, "result.depths must be a map of depths (1..256)"),
    ({**GOOD, "result": {**GOOD["result"], "depths": {"2": {"acc": float("nan")}}}}, "result.depths must be a map"),
    ({**GOOD, "gate_trace": "rising"}, "gate_trace must be a list of [step, gate spread] pairs"),
    ({**GOOD, "key": "../../A"}, "key must be a cell's name (a-z, 0-9 and -), never a path"),
    ({**GOOD, "key": None}, "key must be a cell's name"),
    ({**GOOD, "gates": {"gate_spread": 0.5, "dominant_expert": ["0" * 9]}}, "gates must be null, {} or"),
    ({**GOOD, "gates": {"gate_spread": 1e308, "dominant_expert": [0]}}, "gates must be null, {} or"),
    ({**GOOD, "commit": {"sha": 1}}, "commit must be a string or null")]


@pytest.mark.parametrize("argv, message", [
    (["--grids", "table9"], "--grids must name some of experts, elastic, tying, quickstart, planted, planted-lr, "
                             "planted-table3, planted-elastic, router-lr, distill, long; got 'table9'"),
    (["--grids", ","], "--grids must name some of"),
    (["--seeds", "0"], "--seeds must be in 1..100; got 0"),
    (["--seeds", "101"], "--seeds must be in 1..100; got 101"),  # the bound itself (fails fast)
    (["--seeds", str(10**11)], "--seeds must be in 1..100; got 100000000000"),
    (["--threads", str(10**11)], "--threads must be in 1..1,024; got 100000000000"),
    (["--shard", "0/2"], "--shard takes K/N with 1 <= K <= N"),
    (["--shard", "3/2"], "--shard takes K/N"), (["--shard", "a/b"], "--shard takes K/N"),
    (["--threads", "0"], "--threads must be in 1..1,024; got 0"),
    (["--device", "tpu"], "--device 'tpu': not a device"),
])
def test_bad_flags_are_one_line_errors_before_any_work(argv, message, tmp_path, fake_train):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as error:
        run_cli(["--out", str(out), *argv])
    text = str(error.value.code)
    assert text.startswith("python -m tools.sweep: error: ") and message in text and "\n" not in text, text
    assert not out.exists() and fake_train() == []


def test_an_output_folder_that_cannot_be_written_is_a_one_line_error(tmp_path, fake_train):
    blocker = tmp_path / "a-file"
    blocker.write_text("keep")
    for out, message in [(blocker, "is a file; give a folder"), (blocker / "sub", "is a file, not a folder")]:
        with pytest.raises(SystemExit) as error:
            run_cli(["--device", "cpu", "--grids", "tying", "--out", str(out)])
        assert message in str(error.value.code) and "\n" not in str(error.value.code)
    assert blocker.read_text() == "keep" and fake_train() == []
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "quality.json").write_text("my notes")  # a user's file where the sweep writes
    with pytest.raises(SystemExit) as error:
        run_cli(["--device", "cpu", "--grids", "tying", "--out", str(tmp_path / "notes")])
    assert "its quality.json already exists and is not a file this project can recognise" in str(error.value.code)
    assert (tmp_path / "notes" / "quality.json").read_text() == "my notes" and fake_train() == []


@pytest.mark.parametrize("content, message", [(TORN, "not a readable cell record (JSONDecodeError")]
                         + [(json.dumps(value), text) for value, text in WRONG_TYPES])
def test_a_damaged_cell_file_is_a_one_line_error(content, message, tmp_path, fake_train):
    cells = tmp_path / "cells"
    cells.mkdir()
    (cells / "damaged.json").write_text(content)
    with pytest.raises(SystemExit) as error:
        run_cli(["--device", "cpu", "--grids", "tying", "--out", str(tmp_path)])
    text = str(error.value.code)
    assert text.startswith(f"python -m tools.sweep: error: {cells / 'damaged.json'}: ") and message in text, text
    assert "delete it to re-run the cell" in text and "\n" not in text
    assert (cells / "damaged.json").read_text() == content and fake_train() == []
    assert not (tmp_path / "quality.json").exists()


def test_a_cell_whose_seeds_were_evaluated_at_different_depths_is_refused(tmp_path, fake_train):
    """An edited (or mixed) cell: seed 1 claims an extra depth. Averaging it with seeds that lack that depth
    would print a mean of one seed as a mean of three; the table is refused in one line naming the cell."""
    argv = ["--device", "cpu", "--grids", "tying", "--out", str(tmp_path)]
    run_cli(argv)
    path = tmp_path / "cells" / "tying-regime-e-1-seed1.json"
    record = json.loads(path.read_text())
    record["result"]["depths"] = {"4": {"acc": 0.5}}
    path.write_text(json.dumps(record))
    before = {p.name: p.read_bytes() for p in (tmp_path / "cells").iterdir()}
    with pytest.raises(SystemExit) as error:
        run_cli(argv)
    text = str(error.value.code)
    assert "cell tying / regime: E=1: its seeds were evaluated at different depths ([], [4], [])" in text, text
    assert "\n" not in text and {p.name: p.read_bytes() for p in (tmp_path / "cells").iterdir()} == before
    assert len(fake_train()) == 18  # nothing re-trained


def test_every_committed_cell_passes_the_record_rules():
    cells = sorted(ROOT.glob("results/quality/*/cells/*.json"))
    assert len(cells) > 100 and all(sweep.read_cell(str(path))["key"] == path.stem for path in cells)
