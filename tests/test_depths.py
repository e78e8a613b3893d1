"""depths.py: one checkpoint at every depth. Its accuracy is train.py's evaluation, exactly; the rows are
well formed, the trade-off marks right, the deployed form runs like the model; bad input is one line.

No timing assertions: only the shape of what the tool returns.
"""
import argparse
import dataclasses
import io
import json
import sys
from contextlib import redirect_stdout

import pytest
import torch
from hypothesis import given, settings, strategies as st

from lib import moe
from tools import depths
import bench
import revit
import train
from lib import cli
from lib.cli import pyplot

FAST = settings(max_examples=10, deadline=None)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def tiny_config(**overrides):
    """A 3-step model on 8x8 RGB images, 5 classes."""
    return {**dict(image_size=8, patch_size=4, in_channels=3, num_classes=5, dim=16, heads=2, ffn_dim=24, depth=3),
            **overrides}


def run_cli(argv):
    """depths.main with its stdout captured -> (result, printed lines)."""
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        result = depths.main(argv)
    return result, buffer.getvalue().strip().splitlines()


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, fashion_mnist_dir):
    """A 2-step revit-mini at L = 2, and the training loop's own evaluation at depths 2, 3, 4."""
    out = tmp_path_factory.mktemp("tiny")
    with redirect_stdout(io.StringIO()):
        summary = train.main(["--arch", "revit-mini", "--max-steps", "2", "--train-subset", "256", "--test-subset",
                              "96", "--batch-size", "64", "--model-args", "dim=16,heads=2,ffn_dim=24,depth=2",
                              "--data-dir", str(fashion_mnist_dir), "--eval-depths", "2,3,4", "--no-progress",
                              "--out-dir", str(out)])
    return summary


DEPTH_COLUMNS = ("acc", "loss", "gflops", "deployed_ms_b1", "dynamic_ms_b1", "deployed_ms_bn", "dynamic_ms_bn",
                 "pareto", "reference")


def test_depths_rows_equal_the_training_evaluation(tiny_checkpoint, tmp_path):
    result, lines = run_cli([tiny_checkpoint["checkpoint"], "--device", "cpu", "--batch", "2",
                             "--warmup", "0", "--repeats", "1", "--out", str(tmp_path)])
    rows = result["rows"]
    assert [r["depth"] for r in rows] == [2, 3, 4]  # default 2 ... 2L
    for r in rows:
        assert all(r[key] is not None for key in DEPTH_COLUMNS), r
        assert r["acc"] == tiny_checkpoint["depths"][str(r["depth"])]["acc"]  # train.py's evaluation, exactly
        assert r["deployed_form"] == "folded" and r["gflops"] > 0
    assert [r["reference"] for r in rows] == [True, False, False]
    assert (rows[0]["relative_latency"], rows[0]["relative_latency_ci95"]) == (1, [1, 1])  # itself, by definition
    assert any(r["pareto"] for r in rows) and "reference (depth 2)" in result["best"]
    assert rows[0]["gflops"] < rows[1]["gflops"] < rows[2]["gflops"]  # one more step each
    assert json.loads((tmp_path / "depths.json").read_text()) == json.loads(cli.json_text(result))
    if pyplot() is not None:
        assert (tmp_path / "depths.png").stat().st_size > 0
        assert lines[-1] == f"wrote {tmp_path / 'depths.json'} and {tmp_path / 'depths.png'}"
    else:
        assert lines[-1] == (f"wrote {tmp_path / 'depths.json'} (no depths.png: matplotlib is not installed; "
                             f"pip install -r requirements-extra.txt)")
    assert any(line.startswith("| depth | top-1 % |") for line in lines)  # the table, as a table


def test_depths_bad_arguments_are_one_line_errors(tiny_checkpoint, tmp_path):
    probe = tmp_path / "probe.pt"
    torch.save({"arch": "linear-probe", "model_config": {"backbone": "backbone.pt"}, "model": {}}, probe)
    garbage = tmp_path / "garbage.pt"
    garbage.write_text("not a checkpoint")
    ckpt = tiny_checkpoint["checkpoint"]
    distilled = torch.load(ckpt, weights_only=True)
    distilled["train_config"]["teacher"] = "teacher.pt"  # as train.py --teacher saves it
    torch.save(distilled, tmp_path / "distilled.pt")
    cases = [([ckpt, "--depths", "1,2"], "--depths must be in 2..256; got '1,2'"),  # a vision model's range
             ([ckpt, "--depths", "2,300"], "--depths must be in 2..256; got '2,300'"),
             ([ckpt, "--depths", "two"], "--depths must be comma-separated integers"),
             ([ckpt, "--thresholds", "0.5"], "--thresholds: halting thresholds are AlterNet's; CKPT (revit-mini)"),
             ([str(tmp_path / "missing.pt")], "missing.pt: no such file"),  # checkpoint.load_model's messages
             ([str(probe)], "is a linear-probe head, not a model"),
             ([str(garbage)], "garbage.pt: not a PyTorch file"),
             ([str(tmp_path / "distilled.pt")], "was trained by distillation (no classifier head)"),
             ([ckpt, "--batch", "1"], "--batch must be in 2..65,536")]
    for argv, message in cases:
        with pytest.raises(SystemExit) as error:
            run_cli([*argv, "--device", "cpu"])
        text = str(error.value.code)
        assert text.startswith("python -m tools.depths: error: ") and message in text and "\n" not in text, text


def test_depths_alternet_caps_and_thresholds(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 60)
    with redirect_stdout(io.StringIO()):
        summary = train.main(["--arch", "alternet-tiny", "--data", str(text), "--max-steps", "2", "--batch-size",
                              "4", "--block-size", "16", "--eval-iters", "1", "--eval-batch-size", "8",
                              "--model-args", "dim=16,heads=2,ffn_dim=32,seq_len=16,max_depth=3,num_experts=2,"
                              "top_k=1,depth_dim=4", "--no-progress", "--out-dir", str(tmp_path / "run")])
    result, _ = run_cli([summary["checkpoint"], "--data", str(text), "--device", "cpu", "--test-subset", "4",
                         "--warmup", "0",
                         "--repeats", "1", "--new-tokens", "2", "--out", str(tmp_path)])
    rows = result["rows"]
    assert [(r["max_depth"], r["halt_threshold"]) for r in rows] == [(d, t) for d in (1, 2, 3) for t in (0.5, None)]
    for r in rows:
        assert r["bpb"] > 0 and 1 <= r["mean_iterations"] <= r["max_depth"] and r["ms_per_token"] > 0
    reference = next(r for r in rows if r["reference"])
    assert (reference["max_depth"], reference["halt_threshold"]) == (3, 0.5)
    # the training loop's causal metric: the same first 4 validation windows, halting at 0.5
    assert reference["bpb"] == pytest.approx(summary["val_causal_bpb"], rel=1e-5)
    assert all(r["bpb_metric"] == "alternet.causal_loss" for r in rows)
    with pytest.raises(SystemExit, match="--thresholds must be"):
        run_cli([summary["checkpoint"], "--device", "cpu", "--thresholds", "0,none"])
    # --depths chooses the caps (the trained D always): here cap 2 halting at 0.9, and the reference
    result, _ = run_cli([summary["checkpoint"], "--data", str(text), "--device", "cpu", "--test-subset", "4",
                         "--warmup", "0", "--repeats", "1", "--new-tokens", "2", "--depths", "2", "--thresholds",
                         "0.9", "--out", str(tmp_path)])
    assert [(r["max_depth"], r["halt_threshold"], r["reference"]) for r in result["rows"]] == [(2, 0.9, False),
                                                                                            (3, 0.9, True)]
    with pytest.raises(SystemExit, match=r"--depths 2,4: AlterNet's caps D' run 1..3 \(CKPT's D\)"):
        run_cli([summary["checkpoint"], "--data", str(text), "--device", "cpu", "--depths", "2,4"])
    with pytest.raises(SystemExit, match=r"--batch: a vision model's latency batch; CKPT \(alternet-tiny\) is "
                                         "timed at batch 1"):  # its latency is greedy generation at batch 1
        run_cli([summary["checkpoint"], "--data", str(text), "--device", "cpu", "--batch", "4"])


@FAST
@given(points=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=8))
def test_pareto_rows_dominate_the_rest(points):
    rows = [{"acc": a, "ms": c} for a, c in points]
    depths.mark_tradeoffs(rows, "acc", "ms", higher_is_better=True)
    front = [r for r in rows if r["pareto"]]
    assert front
    for r in rows:  # a row is off the front exactly when a front row is as good, as cheap and better in one
        dominated = any(o["acc"] >= r["acc"] and o["ms"] <= r["ms"] and (o["acc"], o["ms"]) != (r["acc"], r["ms"])
                        for o in front)
        assert dominated == (not r["pareto"])


def test_smallest_depth_within_half_a_point_is_faster_only_beyond_the_timing_spread():
    """The headline from fixed per-round timings (each row timed in the same rounds as the reference):
    faster or slower only where the 95% interval of the paired ratio lies beyond 1 +- 5%."""
    reference = [3.6, 3.7, 3.5, 3.6, 3.8, 3.6, 3.7]
    rows = [{"depth": d, "acc": a, "reference": d == 6} for d, a in [(2, 0.80), (4, 0.897), (6, 0.900), (8, 0.901)]]

    def best(depth_4_times):
        for row, times in zip(rows, ([1.0] * 7, depth_4_times, reference, [4.8] * 7)):
            paired = bench.paired_ratio(times, reference)
            row.update(relative_latency=paired["ratio"], relative_latency_ci95=paired["ratio_ci95"])
        return depths.smallest_within(rows, "depth", "acc", 0.005, True, "points", scale=100)

    assert best([1.9] * 7) == "depth 4: −0.3 points, 1.89× faster than the reference (depth 6)"
    assert best([7.2] * 7) == "depth 4: −0.3 points, 2.00× slower than the reference (depth 6)"
    # a median 10% faster, but the rounds disagree (a busy machine): neither faster nor slower
    noisy = [1.8, 3.9, 3.4, 3.2, 4.5, 3.9, 2.6]
    assert best(noisy).startswith("depth 4: −0.3 points, as fast as the reference (depth 6) within 5% and the "
                                  "timing spread (95% interval of the latency ratio: ")
    assert best([t - 0.1 for t in reference]).startswith("depth 4: −0.3 points, as fast")  # 3% faster each round
    rows[1]["acc"] = 0.8
    assert best(noisy) == "no smaller depth is within 0.5 points of the reference (depth 6)"


def test_a_lower_is_better_headline_says_which_way_the_metric_moved():
    """The planted task's MSE and AlterNet's bits/byte: the smallest row within the tolerance *above* the
    reference, and a + that reads as worse, a − as better."""
    rows = [{"depth": d, "mse": m, "reference": d == 6, "relative_latency": 0.5, "relative_latency_ci95": [0.4, 0.6]}
            for d, m in [(2, 0.400), (4, 0.303), (6, 0.300)]]
    assert depths.smallest_within(rows, *depths.HEADLINE["planted"][:7]) == \
        "depth 4: +0.003 MSE (worse), 2.00× faster than the reference (depth 6)"
    rows[1]["mse"] = 0.296
    assert depths.smallest_within(rows, *depths.HEADLINE["planted"][:7]).startswith("depth 4: −0.004 MSE (better), ")
    caps = [{"max_depth": r["depth"], "bpb": r["mse"] + 2, **{k: r[k] for k in list(r)[2:]}} for r in rows]
    assert depths.smallest_within(caps, *depths.HEADLINE["language"][:7]).startswith("cap D' 4: −0.004 bits/byte (better)")


def test_depths_of_a_planted_checkpoint_is_its_test_mse_by_depth(tmp_path):
    """The planted-depth task is scored by MSE (train.py's --eval-only), not accuracy: the table, the Pareto
    marks and the headline read it as lower is better."""
    with redirect_stdout(io.StringIO()):
        summary = train.main(["--dataset", "planted", "--arch", "revit-mini", "--depth", "2", "--patch-size", "4",
                              "--model-args", "dim=48,heads=3,ffn_dim=32", "--max-steps", "2", "--batch-size", "16",
                              "--train-subset", "32", "--test-subset", "16", "--eval-depths", "3", "--no-progress",
                              "--device", "cpu", "--out-dir", str(tmp_path / "run")])
    result, lines = run_cli([summary["checkpoint"], "--device", "cpu", "--depths", "2,3", "--test-subset", "16",
                             "--batch", "2", "--warmup", "0", "--repeats", "1", "--resolve", "0", "--out", str(tmp_path)])
    rows = result["rows"]
    assert result["family"] == "planted" and [r["depth"] for r in rows] == [2, 3]
    assert [r["mse"] for r in rows] == [summary["depths"][str(d)]["mse"] for d in (2, 3)]  # train.py's, exactly
    assert "| depth | test MSE (lower is better) |" in "\n".join(lines)
    expected = depths.smallest_within(rows, "depth", "mse", 0.005, False, "MSE")
    assert result["best"] == expected and "MSE" in expected and "points" not in expected


def test_each_row_is_timed_in_rounds_of_its_own_with_the_reference_each_first_in_turn():
    """Every call timed in one rotation put the reference always after the batch-n call (it ran slower there:
    0.95-0.99 against itself); the compared call and the reference alternate instead, the rest after."""
    calls, row = [], {"reference": False}
    fns = {name: lambda name=name: calls.append(name) for name in ("row", "batch n")}
    args = argparse.Namespace(warmup=0, repeats=4, iters=1, max_repeats=4)
    times = depths.timed_against_reference(fns, lambda: calls.append("ref"), "row", row, args, torch.device("cpu"))
    pairs = [tuple(calls[i:i + 2]) for i in range(0, 10, 2)]  # a warm-up round, then 4 timed rounds
    assert pairs == [("row", "ref"), ("row", "ref"), ("ref", "row"), ("row", "ref"), ("ref", "row")]
    assert calls[10:] == ["batch n"] * 5 and len(times["batch n"]) == 4
    calls.clear()

    def reference():
        calls.append("ref")
    depths.timed_against_reference({"row": reference}, reference, "row", row, args, torch.device("cpu"))
    assert calls == ["ref"] * 5 and (row["relative_latency"], row["relative_latency_ci95"]) == (1, [1, 1])


def test_the_help_describes_the_tool_in_a_whole_sentence():
    description = depths.build_parser().description
    assert description.endswith(".") and "§" not in description, description


def test_only_the_headlines_row_is_timed_again_until_its_ratio_is_resolved():
    rows = [{"depth": d, "acc": a, "reference": d == 6, "relative_latency": 1.0, "relative_latency_ci95": [0, 9]}
            for d, a in [(2, 0.80), (4, 0.899), (6, 0.900)]]
    calls = []
    args = argparse.Namespace(warmup=0, repeats=3, iters=1, resolve=0.03, max_repeats=10)
    depths.resolve_headline(rows, "vision", lambda r: lambda: calls.append(r["depth"]), lambda: None, args,
                            torch.device("cpu"))
    assert set(calls) == {4} and 1 + 3 <= len(calls) <= 1 + 10  # depth 4; a warm-up call, 3 to 10 rounds
    assert rows[1]["relative_latency_ci95"] != [0, 9] and rows[0]["relative_latency_ci95"] == [0, 9]
    calls.clear()
    depths.resolve_headline(rows, "vision", lambda r: lambda: calls.append(r["depth"]), lambda: None,
                            argparse.Namespace(**{**vars(args), "resolve": 0}), torch.device("cpu"))
    assert calls == []  # --resolve 0: the rounds of the table only


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("stderr, flag, shown", [(Terminal, "--progress", True), (Terminal, "--no-progress", False),
                                                 (io.StringIO, "--progress", False)])  # piped: never a bar
def test_progress_is_a_bar_on_a_terminal_and_never_in_piped_output(monkeypatch, capsys, stderr, flag, shown):
    args = depths.build_parser().parse_args(["x.pt", flag])
    monkeypatch.setattr("sys.stderr", stderr())
    assert list(depths.progress(range(3), args, "depths")) == [0, 1, 2]
    assert ("depths: " in sys.stderr.getvalue()) == shown and capsys.readouterr().out == ""


@pytest.mark.parametrize("name, form", [("vit-mini", "model"), ("raptor-mini-k2", "folded"), ("revit-mini", "folded"),
                                        ("revit-mini-e1", "folded"), ("revit-mini-lora", "folded"),
                                        ("revit-mini-smear", "model"), ("revit-mini-qwen3", "model")])
def test_deployed_model_runs_like_the_model_at_that_depth(name, form):
    model = moe.create_model(name, **tiny_config(num_classes=5, image_size=8, patch_size=4)).eval()
    depth = model.config.depth if name in ("vit-mini", "revit-mini-lora") else 5
    module, depth_arg = depths.deployed_model(model, depth)
    assert (module is not model) == (form == "folded")
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        expected = model(x) if depth == model.config.depth else model(x, depth=depth)
        got = module(x) if depth_arg is None else module(x, depth=depth_arg)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_depths_of_a_vit_checkpoint_is_its_single_row(tiny_checkpoint, tmp_path):
    """A checkpoint of the untied ViT on the same data (weights saved as train.py saves them)."""
    ckpt = torch.load(tiny_checkpoint["checkpoint"], weights_only=True)
    vit = revit.create_model("vit-mini", **{**tiny_config(), "image_size": 28, "patch_size": 7, "in_channels": 1,
                                            "num_classes": 10})
    path = tmp_path / "vit.pt"
    saved = {**ckpt["train_config"], "arch": "vit-mini", "model_args": "dim=16,heads=2,ffn_dim=24,depth=3"}
    torch.save({**ckpt, "arch": "vit-mini", "model": vit.state_dict(), "train_config": saved,
                "model_config": dataclasses.asdict(vit.config)}, path)
    result, _ = run_cli([str(path), "--device", "cpu", "--batch", "2", "--warmup", "0",
                         "--repeats", "1", "--out", str(tmp_path)])
    assert [(r["depth"], r["reference"], r["deployed_form"]) for r in result["rows"]] == [(3, True, "model")]
    assert result["best"] == "an untied ViT runs only its own depth 3"
    with pytest.raises(SystemExit, match="an untied ViT runs only its own depth 3"):
        run_cli([str(path), "--device", "cpu", "--depths", "2,3"])


HOSTILE = [  # (argv, the one line's message); {file}: an existing file used as a folder
    (["{ckpt}", "--new-tokens", "0"], "--new-tokens must be in 1..10,000; got 0"),
    (["{ckpt}", "--new-tokens", "-3"], "--new-tokens must be in 1..10,000; got -3"),
    (["{ckpt}", "--batch", "1"], "--batch must be in 2..65,536; got 1"),
    (["{ckpt}", "--test-subset", "-1"], "--test-subset must be in 0..1,000,000,000; got -1"),
    (["{ckpt}", "--test-subset", str(10 ** 30)], "--test-subset must be in 0..1,000,000,000; got 100000...(31 digits)"),
    (["{ckpt}", "--resolve", "1e308"], "--resolve must be in [0, 1); got 1e+308"),
    (["{ckpt}", "--max-repeats", "1"], "--max-repeats must be in 2..10,000; got 1"),
    (["{ckpt}", "--thresholds", "0,none"], "--thresholds must be comma-separated values in (0, 1]"),
    (["{ckpt}", "--out", "{file}/sub"], "--out {file}/sub cannot be created: {file} is a file, not a folder"),
    (["{ckpt}", "--out", "{file}"], "--out {file} is a file; give a folder"),
]


@pytest.mark.parametrize("argv, message", HOSTILE, ids=[" ".join(a) for a, _ in HOSTILE])
def test_hostile_inputs_are_one_line_errors_before_any_work(argv, message, tmp_path):
    """Each bad flag: `python -m tools.depths: error: ...` on one line, before the checkpoint is read, and nothing written in
    the checkpoint's folder (the default output) or to an existing file."""
    run = tmp_path / "run"
    run.mkdir()
    ckpt = run / "ckpt.pt"
    ckpt.write_bytes(b"not read: the flags are checked first")
    keep = tmp_path / "keep.json"
    keep.write_text("{}")
    names = {"ckpt": str(ckpt), "file": str(keep)}
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as error:
        run_cli([word.format(**names) for word in argv] + ["--device", "cpu"])
    text = str(error.value.code)
    assert text.startswith(f"python -m tools.depths: error: {message.format(**names)}"), text
    assert "\n" not in text
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert keep.read_text() == "{}" and ckpt.read_bytes().startswith(b"not read")


def test_a_depth_whose_evaluation_is_not_finite_is_refused_before_anything_is_written(tiny_checkpoint, tmp_path,
                                                                                     monkeypatch):
    """Finite weights can overflow at a depth they were not trained at (here: depth 3, stood in for): that
    row's loss is never scored, marked or written; the line names the depth and how to leave it out."""
    evaluate = train.evaluate

    def nan_at_three(model, task, depths=(None,)):
        return {d: dict(r, loss=float("nan")) if d == 3 else r for d, r in evaluate(model, task, depths).items()}

    monkeypatch.setattr(train, "evaluate", nan_at_three)
    with pytest.raises(SystemExit) as error:
        run_cli([tiny_checkpoint["checkpoint"], "--device", "cpu", "--batch", "2", "--warmup", "0", "--repeats", "1",
                 "--out", str(tmp_path / "out")])
    assert str(error.value.code) == ("python -m tools.depths: error: CKPT: its evaluation at depth 3 gave a non-finite "
                                     "loss (finite weights that diverge there); choose --depths without it; nothing "
                                     "written")
    assert not (tmp_path / "out").exists()


def test_pareto_rows_of_a_lower_is_better_metric_with_ties():
    """Bits per byte (lower is better) against milliseconds: the rule flips with the metric. A row as good as
    another and slower, or as fast and worse, is off the front (dominated in one, equal in the other); two
    identical rows both stay on it (neither is better in one)."""
    points = [(1.0, 2.0), (1.0, 3.0), (0.8, 3.0), (1.2, 1.0), (1.2, 1.0), (0.9, 5.0)]
    rows = [{"bpb": bpb, "ms": ms} for bpb, ms in points]
    depths.mark_tradeoffs(rows, "bpb", "ms", higher_is_better=False)
    # (1.0, 3.0): as good as (1.0, 2.0) and slower, as fast as (0.8, 3.0) and worse; (0.9, 5.0): (0.8, 3.0)
    assert [r["pareto"] for r in rows] == [True, False, True, True, True, False]


def test_an_alternet_headline_names_the_halting_threshold_of_each_setting_it_compares():
    """AlterNet's rows are a cap and a halting threshold: the last line names both, for the row it picked
    and for the reference, not a bare cap that two rows share."""
    rows = [{"max_depth": d, "halt_threshold": t, "bpb": bpb, "reference": (d, t) == (3, 0.5),
             "relative_latency": r, "relative_latency_ci95": [r - 0.05, r + 0.05]}
            for d, t, bpb, r in [(2, 0.5, 2.5, 0.6), (2, None, 2.305, 0.7), (3, 0.5, 2.3, 1.0), (3, None, 2.29, 1.2)]]
    assert depths.smallest_within(rows, *depths.HEADLINE["language"][:7]) == \
        "cap D' 2 at halt threshold none: +0.005 bits/byte (worse), 1.43× faster than the reference (cap D' 3 at " \
        "halt threshold 0.5)"
    rows[1]["bpb"] = 2.4
    assert depths.smallest_within(rows, *depths.HEADLINE["language"][:7]) == \
        "no smaller cap D' is within 0.01 bits/byte of the reference (cap D' 3 at halt threshold 0.5)"


@pytest.mark.parametrize("family, quality", [("vision", "acc"), ("planted", "mse"), ("language", "bpb")])
def test_the_plot_names_the_metric_as_the_table_does(monkeypatch, family, quality):
    """depths.png's y axis and the table's column of the quality: one label per family (HEADLINE)."""
    if pyplot() is None:
        pytest.skip("matplotlib is not installed (an optional extra)")
    row = {"depth": 2, "max_depth": 2, quality: 0.5, "reference": True, "pareto": True, "relative_latency": 1.0,
           "relative_latency_ci95": [1.0, 1.0], "deployed_form": "folded", "gflops": 0.1, "mean_iterations": 1.5,
           "ms_per_token": 1.0, "bpb_metric": "alternet.causal_loss",
           **dict.fromkeys(("deployed_ms_b1", "dynamic_ms_b1", "deployed_ms_bn", "dynamic_ms_bn"), 1.0),
           **({"halt_threshold": 0.5} if family == "language" else {})}
    result = {"family": family, "rows": [row], "arch": "x", "checkpoint": "x.pt", "best": "",
              "settings": dict(batch=2, new_tokens=2, test_images=8, repeats=1, iters=1)}
    axes = []
    monkeypatch.setattr(depths, "save_png", lambda fig, path: axes.append(fig.axes[0].get_ylabel()))
    depths.plot_depths(result, "unused.png")
    header = depths.depths_markdown(result).split("\n")[2]
    column = [cell.strip() for cell in header.split("|")][3 if family == "language" else 2]
    assert axes == [column] and column == {"vision": "top-1 %", "planted": "test MSE (lower is better)",
                                           "language": "bits/byte"}[family]
