"""bench.py: the FLOP count against torch's flop_counter, the paper's table cells, well-formed rows.

No timing assertions: the bench functions run on tiny configs and we check the shape of what
they return, never how fast anything was.
"""
import argparse
import io
import json
import math
import os
import re
import subprocess
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

import bench
import revit
from lib import budget, cli, moe

FAST = settings(max_examples=10, deadline=None)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def tiny_config(**overrides):
    cfg = dict(image_size=8, patch_size=4, in_channels=3, num_classes=5, dim=16, heads=2, ffn_dim=24, depth=3)
    cfg.update(overrides)
    return cfg


# --- the analytic count equals flop_counter on the real module ---


@FAST
@given(arch=st.sampled_from(["vit", "raptor", "revit-e1", "revit", "revit-e2"]),
       heads=st.integers(1, 3), head_dim=st.integers(2, 6), hidden=st.integers(4, 40),
       depth=st.integers(2, 4), grid=st.integers(1, 3), patch=st.integers(1, 3), classes=st.integers(1, 7))
def test_analytic_count_equals_flop_counter(arch, heads, head_dim, hidden, depth, grid, patch, classes):
    name = {"vit": "vit-mini", "raptor": "raptor-mini-k2", "revit-e1": "revit-mini-e1", "revit": "revit-mini",
            "revit-e2": "revit-mini-e2"}[arch]
    cfg = tiny_config(dim=heads * head_dim, heads=heads, ffn_dim=hidden, depth=depth, patch_size=patch,
                      image_size=grid * patch, num_classes=classes)
    model, counted = bench.count_preset(name, **cfg)
    c = model.config
    macs = bench.analytic_macs(c)
    tokens = c.num_patches + 1
    # flop_counter also counts the attention products, 2 matmuls of T x T x d per step
    assert counted["attention"] == c.depth * 4 * tokens ** 2 * c.dim
    rest = counted["total"] - counted["attention"] - counted["router"]
    if arch in ("revit", "revit-e2"):
        router = 2 * (c.router_hidden + c.router_hidden * c.num_experts)
        assert counted["router"] % router == 0 and counted["router"] > 0
        assert macs["merge"] == c.depth * c.num_experts * bench.expert_params(c.dim, c.ffn_dim)
        # the only FLOPs beyond the rule: Eq. 9's diversity loss, if the forward computes it (E^2 P MACs)
        diversity = 2 * c.num_experts ** 2 * bench.expert_params(c.dim, c.ffn_dim)
        assert rest - 2 * macs["total"] in (0, diversity)
    else:
        assert counted["router"] == 0
        assert rest == 2 * macs["total"]


def test_lora_analytic_count_equals_flop_counter():
    model, counted = bench.count_preset("revit-mini-lora", **tiny_config(lora_rank=3))
    macs = bench.analytic_macs(model.config, lora_rank=3)
    assert macs["lora"] > 0
    assert counted["total"] - counted["attention"] == 2 * macs["total"]
    folded = bench.counted_flops(revit.fold(moe.create_model("revit-mini-lora", **tiny_config(lora_rank=3))))
    assert folded["total"] - folded["attention"] == 2 * bench.analytic_macs(model.config)["total"]


# --- the paper's cells (Table 1, Table 10) ---


def test_params_table_equals_paper_cells():
    rows = {(r["table"], r["name"]): r for r in bench.bench_params(with_counter=False)["rows"]}
    for name, (params, gflops) in bench.PAPER_TABLE1.items():
        row = rows["1", name]
        assert round(row["gflops_t198"], 1) == gflops, name  # every GFLOPs cell, counted over N + 2 tokens
        if name in ("revit-b", "revit-l"):  # the documented difference: our count of the described model
            assert round(row["params_m"], 1) == {"revit-b": 22.8, "revit-l": 39.8}[name]
        else:
            assert round(row["params_m"], 1) == params, name
    # over the model's own N + 1 tokens the S cells still match; B and L come out lower, as stated
    assert round(rows["1", "vit-s"]["gflops"], 1) == 8.5 and round(rows["1", "revit-s"]["gflops"], 1) == 8.6
    assert round(rows["1", "vit-b"]["gflops"], 1) == 33.7 and round(rows["1", "vit-l"]["gflops"], 1) == 119.3
    for name, (params, online, folded) in bench.PAPER_TABLE10.items():
        row = rows["10", name]
        assert round(row["gflops_online_t198"], 1) == online, name
        assert round(row["gflops_folded_t198"], 1) == folded, name
    lora = rows["10", "lora-s"]
    assert (round(lora["lora_shared_m"], 2), round(lora["lora_adapters_m"], 2)) == (2.53, 4.72)  # 7.3 = 2.53 + 4.72
    assert round(rows["10", "revit-s"]["params_m"], 1) == 6.1


def test_merge_is_counted_as_multiply_adds():
    """reViT-B/L online reproduce 34.3/121.5 only with 2 FLOPs per merge multiply-add."""
    for size, paper in (("b", 34.3), ("l", 121.5)):
        with torch.device("meta"):
            c = revit.create_model(f"revit-{size}").config
        macs = bench.analytic_macs(c, extra_tokens=1)
        assert round(2 * macs["total"] / 1e9, 1) == paper
        assert round((2 * macs["total"] - macs["merge"]) / 1e9, 1) != paper


# --- bench functions return well-formed rows (tiny configs, no timing assertions) ---

ROW_KEYS = {"model", "median_ms", "q1_ms", "q3_ms", "min_ms", "max_ms", "ratio", "ratio_q1", "ratio_q3",
            "images_per_s", "params_m"}


def test_latency_rows_are_well_formed():
    result = bench.bench_latency(size="mini", batches=(1, 2), modes=("eager",), warmup=1, repeats=2, memory=False)
    rows = result["rows"]
    assert [(r["model"], r["batch"]) for r in rows] == [(m, b) for b in (1, 2) for m in bench.LATENCY_MODELS]
    for r in rows:
        assert ROW_KEYS <= set(r) and r["repeats"] == 2 and r["mode"] == "eager"
        assert 0 < r["min_ms"] <= r["q1_ms"] <= r["median_ms"] <= r["q3_ms"] <= r["max_ms"]
        assert r["ratio"] > 0 and (r["ratio"] == 1.0) == (r["model"] == "DeiT III")
    folded = next(r for r in rows if r["model"] == "reViT folded")
    dynamic = next(r for r in rows if r["model"] == "reViT dynamic")
    assert folded["params_m"] > dynamic["params_m"]  # folded stores L FFNs, the compact model E
    json.dumps(result)


def test_cpu_memory_row_in_fresh_process():
    row = bench.cpu_memory("mini", "reViT dynamic", batch=1, calls=1, processes=1)
    assert row["memory_mib"] > 0 and "fresh process" in row["memory_method"]


def test_train_rows_are_well_formed():
    result = bench.bench_train(size="mini", batch=4, warmup=0, repeats=2, peak=1e12)
    rows = {r["model"]: r for r in result["rows"]}
    assert {"DeiT III", "reViT fixed", "reViT elastic 0.3"} <= set(rows)
    assert set(bench.token_dispatch_presets("mini")) <= set(rows)  # the U = 1 baselines when revit.py has them
    for r in rows.values():
        assert ROW_KEYS <= set(r) and r["forward_gflops_per_image"] > 0 and 0 < r["mfu"] < 1
    assert rows["reViT elastic 0.3"]["forward_gflops_per_image"] < rows["reViT fixed"]["forward_gflops_per_image"]
    assert rows["reViT elastic 0.3"]["ratio_vs_fixed"]["ratio"] > 0
    json.dumps(result)



def test_compiled_train_rows_add_an_eager_fixed_depth_row(monkeypatch):
    """Elastic depth's step loop runs eagerly: where the rows are compiled, it is also compared against an
    eager fixed-depth row. (Compilation itself stands aside here: dynamo takes minutes on a loaded CPU.)"""
    compiled_rows = []
    monkeypatch.setattr(bench, "maybe_compile", lambda model, compiled, **kw: compiled_rows.append(compiled) or model)
    assert bench.train_models("mini", compiled=True)["reViT fixed, eager"] == ("revit-mini", {}, False)
    assert "reViT fixed, eager" not in bench.train_models("mini")
    result = bench.bench_train(size="mini", batch=4, warmup=0, repeats=2, compiled=True,
                               labels=("DeiT III", "reViT elastic 0.3", "reViT fixed", "reViT fixed, eager"))
    rows = {r["model"]: r for r in result["rows"]}
    assert compiled_rows == [True, True, True, False]
    assert rows["reViT fixed, eager"]["compiled"] is False and rows["reViT fixed"]["compiled"] is True
    assert rows["reViT elastic 0.3"]["ratio_vs_fixed_eager"]["ratio"] > 0


def test_alternet_train_rows_compare_compiled_with_eager(monkeypatch):
    """AlterNet's step as train.py takes it (the model's own loss); compiled, beside an eager row and their
    paired ratio. (Compilation stands aside, as above.)"""
    compiled_rows = []
    monkeypatch.setattr(bench, "maybe_compile", lambda model, compiled, **kw: compiled_rows.append(compiled) or model)
    assert bench.train_models("mini", compiled=True)["AlterNet eager"] == ("alternet-tiny", {}, False)
    result = bench.bench_train(size="mini", batch=2, warmup=0, repeats=2, compiled=True, peak=1e12,
                               labels=("DeiT III", "AlterNet", "AlterNet eager"))
    rows = {r["model"]: r for r in result["rows"]}
    assert compiled_rows == [True, True, False] and rows["AlterNet"]["compiled"] is True
    assert rows["AlterNet"]["ratio_vs_eager"]["ratio"] > 0 and 0 < rows["AlterNet eager"]["mfu"] < 1
    assert rows["AlterNet"]["forward_gflops_per_image"] > 0.1  # one window of 128 tokens through 6 iterations
    assert "AlterNet compiled vs eager: " in bench.result_markdown({"command": "train", "rows": result["rows"], "settings": {}})


def test_train_quick_protocol_prints_the_ratio_with_its_spread():
    result, lines = run_cli(["train", "--quick", "--device", "cpu", "--rows", "reViT fixed"])
    rows = {r["model"]: r for r in result["rows"]}
    assert list(rows) == ["DeiT III", "reViT fixed"]
    fixed = rows["reViT fixed"]
    low, high = fixed["ratio_ci95"]
    assert low <= fixed["ratio"] <= high and fixed["ratio_pm"] == pytest.approx((high - low) / 2)
    assert 3 <= fixed["repeats"] <= 6 and fixed["repeats_needed"] >= 2  # --quick: 3 rounds, at most 6
    assert (fixed["ratio_pm"] <= 0.03) or fixed["repeats"] == 6  # resolved, or stopped at --max-repeats
    settings = result["settings"]
    assert settings["threads"] == torch.get_num_threads() and settings["resolve"] == 0.03
    assert any(line.startswith("reViT fixed / DeiT III: ") and " ± " in line for line in lines)
    with pytest.raises(SystemExit, match="--rows must name some of DeiT III, reViT fixed"):
        run_cli(["train", "--quick", "--device", "cpu", "--rows", "reViT huge"])


def test_every_listed_row_can_be_chosen_by_its_name():
    """--rows is split on commas, yet a listed name may hold one: "reViT fixed, eager" (compiled rows)."""
    known = list(bench.train_models("mini", compiled=True))
    for joined in (",".join(known), ", ".join(known), "reViT fixed, eager"):
        args = bench.build_parser().parse_args(["train", "--quick", "--compile", "--rows", joined])
        bench.check_flags(args, torch.device("cpu"))
        assert args.rows == (known if joined != "reViT fixed, eager" else ["reViT fixed, eager"])


MISTYPED = [(["memory", "--arch", "revit-mini", "--batchsize", "4"], "--batch-size"),
            (["train", "--quik"], "--quick")]


@pytest.mark.parametrize("argv, closest", MISTYPED)
def test_a_mistyped_flag_gets_the_closest_flag_of_its_subcommand(argv, closest, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    error = capsys.readouterr().err
    assert error.startswith(f"bench.py {argv[0]}: error: unrecognized arguments: --")
    assert error.endswith(f"; did you mean {closest}?\n") and error.count("\n") == 1


def test_paired_ratio_interval_and_rounds_needed():
    same = bench.paired_ratio([2.0] * 5, [1.0] * 5)
    assert same["ratio"] == 2.0 and same["ratio_ci95"] == [2.0, 2.0] and same["ratio_pm"] == 0
    spread = [1.0, 1.2] * 10
    wide = bench.paired_ratio(spread, [1.0] * 20, target=0.03)
    low, high = wide["ratio_ci95"]
    assert low <= wide["ratio"] <= high and low >= 1.0 and high <= 1.2
    # the interval's width shrinks as 1/sqrt(n): four times the rounds for half the width
    assert wide["repeats_needed"] == math.ceil(20 * (wide["ratio_pm"] / 0.03) ** 2)
    assert bench.paired_ratio(spread, [1.0] * 20) == wide  # seeded bootstrap: the same data, the same interval


def test_resolve_ratio_stops_when_resolved_or_at_max_repeats():
    fns = {"DeiT III": lambda: None, "reViT fixed": lambda: None}
    times = {"DeiT III": [1.0, 1.0, 1.0], "reViT fixed": [1.0, 1.5, 2.0], "recompiled": []}
    device = torch.device("cpu")
    assert bench.resolve_ratio(fns, dict(times), device, 1, 0.9, 100)["DeiT III"] == [1.0] * 3  # already resolved
    grown = bench.resolve_ratio(fns, {k: list(v) for k, v in times.items()}, device, 1, 1e-12, 8)
    assert len(grown["DeiT III"]) == len(grown["reViT fixed"]) == 8 and grown["recompiled"] == []


def test_time_interleaved_calls_and_rotation():
    calls = []
    fns = {k: (lambda k=k: calls.append(k)) for k in "abc"}
    times = bench.time_interleaved(fns, torch.device("cpu"), warmup=1, repeats=3, iters=2)
    assert times.pop("recompiled") == []
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3, "c": 3}
    assert calls[:3] == list("abc")                               # warm-up round (nothing compiled: no extra)
    assert calls[3:9:2] == list("abc") and calls[9:15:2] == list("bca")  # rotated rounds of 2 calls each


def test_targets_judge_rows():
    def row(model, batch, ratio, memory=None):
        r = {"model": model, "mode": "eager", "batch": batch, "ratio": ratio, "ratio_q1": ratio, "ratio_q3": ratio}
        return r if memory is None else {**r, "memory_ratio": memory}
    rows = [row("DeiT III", 1, 1.0, 1.0), row("reViT cached", 1, 1.02), row("reViT folded", 1, 1.05),
            row("reViT dynamic", 1, 1.3, 0.5), row("reViT dynamic", 8, 1.12)]
    met = {t["target"].split(" (")[0]: t["met"] for t in bench.latency_targets(rows)}
    assert met == {"reViT cached <= 1.03x DeiT III": True, "reViT folded = 1.00x +- noise 0.02": False,
                   "reViT dynamic <= 1.10x DeiT III": False, "reViT dynamic memory <= 0.55x DeiT III": True}


def test_cli_prints_json_document_last(tmp_path):
    out = tmp_path / "params.json"
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        result = bench.main(["params", "--no-counter", "--out", str(out)])
    lines = buffer.getvalue().strip().splitlines()
    assert lines[0].startswith("## ") and any(line.startswith("| DeiT III-S |") for line in lines)
    assert json.loads(lines[-1]) == json.loads(out.read_text())
    assert json.loads(lines[-1])["command"] == result["command"] == "params"


def test_every_flag_has_help():
    parser = bench.build_parser()
    for sub in parser._subparsers._group_actions[0].choices.values():
        for action in sub._actions:
            assert action.help, (sub.prog, action.dest)
            if action.default not in (None, False, "auto", argparse.SUPPRESS):  # a default is shown
                assert "default" in action.help, (sub.prog, action.dest)


# --- check (its plan: the end of this file): the first line of an error ---


def run_cli(argv):
    """bench.main with its stdout captured -> (result, printed lines)."""
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        result = bench.main(argv)
    return result, buffer.getvalue().strip().splitlines()


CUDA_ERROR = ("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously "
              "reported at some other API call, so the stacktrace below might be incorrect.\nFor debugging consider "
              "passing CUDA_LAUNCH_BLOCKING=1\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n")


def test_the_first_informative_line_of_a_compile_failure():
    def failing_backend(graph_module, example_inputs):
        raise RuntimeError("no kernel for aten::frobnicate on this device")
    import torch._dynamo
    torch._dynamo.reset()
    with pytest.raises(Exception) as error:
        torch.compile(lambda x: x * 2 + 1, backend=failing_backend)(torch.ones(3))
    assert "TORCHDYNAMO_VERBOSE" in str(error.value)  # torch ends its message with this hint
    line = bench.first_informative_line(error.value)
    assert line.endswith("no kernel for aten::frobnicate on this device") and "\n" not in line
    assert bench.first_informative_line(RuntimeError(CUDA_ERROR)) == \
        "RuntimeError: CUDA error: an illegal memory access was encountered"


def test_peak_flops_table_names_the_h100_variants():
    assert bench.peak_of("NVIDIA H100 NVL") == 835e12 and bench.peak_of("NVIDIA H100 PCIe") == 756e12
    assert bench.peak_of("NVIDIA H100 80GB HBM3") == 989e12 and bench.peak_of("a CPU") is None


def test_latency_rows_with_bf16_weights():
    """The bf16 timing path of CUDA (weights and images cast once, no autocast), here on the CPU."""
    result = bench.bench_latency(size="mini", batches=(1,), modes=("eager",), warmup=0, repeats=1, memory=False,
                                 dtype="bfloat16")
    assert {r["model"] for r in result["rows"]} == set(bench.LATENCY_MODELS)
    assert all(r["median_ms"] > 0 for r in result["rows"])


# --- hostile inputs: one line each, before any work, nothing written ---

HOSTILE = [  # (argv, the one line's message); {file}: an existing file, {dir}: an existing folder
    (["latency", "--repeats", "0"], "--repeats must be in 1..10,000; got 0"),
    (["latency", "--iters", "0"], "--iters must be in 1..10,000; got 0"),
    (["latency", "--warmup", "-1"], "--warmup must be in 0..1,000; got -1"),
    (["latency", "--threads", "0"], "--threads must be in 1..1,024; got 0"),
    (["latency", "--out", "{dir}"], "--out {dir} is a folder; give a file"),
    (["latency", "--batches", "1", "0"], "--batches must be in 1..65,536; got 0"),
    (["params", "--out", "{file}/params.json"], "--out {file}/params.json cannot be created: {file} is a file, not a folder"),
    (["train", "--batch", "0"], "--batch must be in 1..65,536; got 0"),
    (["train", "--peak-tflops", "nan"], "--peak-tflops must be a finite number; got nan"),
    (["train", "--peak-tflops", "inf"], "--peak-tflops must be a finite number; got inf"),
    (["train", "--peak-tflops", "-3"], "--peak-tflops must be in 0.001..100,000; got -3.0"),
    (["train", "--peak-tflops", "1e308"], "--peak-tflops must be in 0.001..100,000; got 1e+308"),
    (["train", "--peak-tflops", "1e-320"], "--peak-tflops must be in 0.001..100,000; got 1e-320"),
    (["check", "--threads", "0"], "--threads must be in 1..1,024; got 0"),
    (["check", "--out", "{file}"], "--out {file} is a file; give a folder"),
    (["check", "--out", "{file}/report"], "--out {file}/report cannot be created: {file} is a file, not a folder"),
    (["check", "--budget", "5"], "--budget must be in 10..86,400; got 5.0"),
    (["check", "--budget", "nan"], "--budget must be a finite number; got nan"),
    (["memory", "--arch", "alternet-tiny", "--recipe", "imagenet"],
     "--recipe imagenet does not suit alternet-tiny, a language preset: use --recipe text"),
    (["memory", "--arch", "revit-mini", "--seq-len", "64"],
     "--seq-len is for language presets; revit-mini is a vision preset"),
]


@pytest.mark.parametrize("argv, message", HOSTILE, ids=[" ".join(a) for a, _ in HOSTILE])
def test_hostile_inputs_are_one_line_errors_before_any_work(argv, message, tmp_path):
    """Each bad flag: `bench.py: error: ...` on one line, and no file written or changed anywhere we look: an
    existing --out file, the working folder's files."""
    keep = tmp_path / "keep.json"
    keep.write_text("{}")
    (tmp_path / "dir").mkdir()
    names = {"file": str(keep), "dir": str(tmp_path / "dir")}
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as error:
        run_cli([word.format(**names) for word in argv] + ([] if argv[0] == "params" else ["--device", "cpu"]))
    text = str(error.value.code)
    assert text.startswith(f"bench.py: error: {message.format(**names)}"), text
    assert "\n" not in text
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert keep.read_text() == "{}"


def test_no_non_finite_number_is_written_as_json(tmp_path):
    result = {"rows": [{"loss": float("nan"), "acc": 0.5}, {"loss": float("inf")}], "mean": -float("inf")}
    path = tmp_path / "r.json"
    cli.write_json(result, str(path))
    text = path.read_text()
    saved = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert saved == {"rows": [{"loss": None, "acc": 0.5}, {"loss": None}], "mean": None,
                     "non_finite": ["rows.0.loss", "rows.1.loss", "mean"]}
    assert json.loads(cli.json_text(result)) == saved


# --- bench.py check, the first GPU run, proved by its CPU twin: the same plan at tiny sizes ---
# The GPU run gets one command with a fixed timeout and returns only the files it wrote, so what matters is
# what is on disk at any moment: every finished row, and a reason for every other one. Here README's GPU
# command runs on the CPU to the end; then it is killed part-way (SIGTERM, SIGKILL); then a part is made to
# run out of its time, with the data missing, in a plan whose parts are stand-in processes (seconds).

ROOT = Path(__file__).resolve().parent.parent
FINISHED = {"ok", "skipped"}


def readme_gpu_command() -> list[str]:
    """The flags of README's GPU check (the `bench.py check` line of its "On a GPU" section)."""
    section = (ROOT / "README.md").read_text().split("## On a GPU", 1)[1].split("\n## ", 1)[0]
    line = next(line for line in section.splitlines() if line.startswith("python bench.py check"))
    return line.split("python bench.py check", 1)[1].split("#")[0].split()


def check_process(out: Path, *flags: str, data_dir: str = "") -> subprocess.Popen:
    argv = [sys.executable, str(ROOT / "bench.py"), "check", "--device", "cpu", "--out", str(out), *flags]
    argv += ["--data-dir", data_dir] if data_dir else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def alive(pid: int) -> bool:
    """A process that runs (a zombie, dead but not yet reaped by whoever adopted it, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


def report(out: Path) -> dict:
    return json.loads((out / "check.json").read_text())


def test_readme_s_gpu_command_runs_every_part_on_the_cpu(tmp_path, fashion_mnist_dir):
    """README's command on the CPU, with this test's --out and data folder (--budget as README's: the parts
    take seconds here). Latency rows first; every row a result; only the three report files in --out."""
    flags = readme_gpu_command()
    assert flags == ["--budget", "420"], flags
    process = check_process(tmp_path, *flags, data_dir=str(fashion_mnist_dir))
    stdout, _ = process.communicate(timeout=900)
    doc = report(tmp_path)
    assert process.returncode == 0 and doc["ok"] and doc["complete"], stdout[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(bench.CHECK_FILES)
    rows = {(r["part"], r["row"]): r for r in doc["rows"]}
    assert [r["part"] for r in doc["rows"][:8]] == ["latency, batch 1"] * 4 + ["latency, batch 4"] * 4
    for (part, row), r in rows.items():
        assert r["status"] in FINISHED, r
        if part.startswith("latency") or part.startswith("training step"):
            assert r["median_ms"] > 0 and r["ratio"] > 0 and r["precision"], r
    assert rows[("training step, elastic depth", "reViT elastic 0.3")]["precision"].endswith("step loop eager")
    tests = [r for r in doc["rows"] if r["part"] == "correctness"]
    assert len(tests) == 7 and all(r["status"] == "ok" and "[cpu" in r["row"] for r in tests)
    run = rows[("train.py run", "train.py run")]
    assert run["steps"] == 4 and 0 <= run["test_acc"] <= 1 and run["images_per_s"] > 0
    assert rows[("GPU tests that need the data", "GPU tests that need the data")]["status"] == "skipped"
    printed = stdout.strip().splitlines()
    assert json.loads(printed[-1]) == doc  # the JSON document is the last line, as for every subcommand
    assert any(line.startswith("latency, batch 1: | reViT cached | 1 | ok | ") for line in printed)  # as it finished
    markdown = (tmp_path / "check.md").read_text()
    assert markdown.index("## latency, batch 1") < markdown.index("## training step") < markdown.index("## correctness")
    assert "| reViT dynamic | 1 | ok |" in markdown and "Report complete" in markdown


def test_a_check_killed_part_way_leaves_every_finished_row_on_disk(tmp_path):
    """SIGKILL (nothing to catch) once the first latency rows are written: they stay, in both files, the rows
    then running say so, and the part then running dies with the check (PR_SET_PDEATHSIG)."""
    process = check_process(tmp_path, "--budget", "600")
    deadline, finished = time.monotonic() + 300, []
    while not finished and time.monotonic() < deadline:  # both files hold the rows (json first, then markdown)
        time.sleep(0.2)
        assert process.poll() is None, process.stdout.read()
        if (tmp_path / "check.md").exists() and "| reViT folded | 1 | ok |" in (tmp_path / "check.md").read_text():
            finished = [r for r in report(tmp_path)["rows"] if r["status"] == "ok"]
    process.kill()
    process.communicate(timeout=60)
    doc = report(tmp_path)  # a whole JSON document: never a torn file
    kept = {(r["part"], r["row"]) for r in doc["rows"] if r["status"] == "ok"}
    assert {(r["part"], r["row"]) for r in finished} <= kept
    markdown = (tmp_path / "check.md").read_text()
    assert all(f"| {row} | 1 | ok |" in markdown for part, row in kept if part == "latency, batch 1")
    assert not doc["complete"] and {r["status"] for r in doc["rows"]} & {"running", "pending"}
    assert "NOT complete" in markdown
    started = [p for p in doc["parts"] if "pid" in p]
    time.sleep(0.5)
    assert started and not [p for p in started if alive(p["pid"])], started  # no part outlives the check


# --- the plan with stand-in parts: a timeout, absent data, the rest intact ---


def stand_in(rows: list[str], then: str = "") -> list[str]:
    """A part's process that prints an ok row for each label, then runs `then` (Python)."""
    lines = "".join(f"print({budget.ROW + json.dumps({'row': r, 'status': 'ok', 'median_ms': 1.0})!r})\n"
                    for r in rows)
    return [sys.executable, "-c", lines + then]


def test_a_part_out_of_time_is_a_row_that_says_so_and_the_rest_is_intact(tmp_path, monkeypatch, capsys):
    """The large-batch latency part prints two of its four rows and hangs: it is stopped at its timeout (its
    share of the budget), its two finished rows stay, the other two say it timed out; the parts after it
    run. With no data found, the train.py run is a row that says so, not a silent skip."""
    real_parts = bench.check_parts

    def stand_ins(args, device, sizes, run_dir):
        parts = real_parts(args, device, sizes, run_dir)
        for part in parts:
            if part.argv:
                hang = part.name == "latency, batch 4"
                part.argv = stand_in(part.rows[:2] if hang else part.rows or ["stand-in"],
                                     "import time; time.sleep(600)" if hang else "")
        return parts

    def no_data(name, data_dir="", download=False):
        raise FileNotFoundError(name)

    monkeypatch.setattr(bench, "check_parts", stand_ins)
    monkeypatch.setattr(bench.data, "find_builtin", no_data)
    start = time.monotonic()
    assert not bench.main(["check", "--device", "cpu", "--budget", "10", "--out", str(tmp_path)])["ok"]
    assert time.monotonic() - start < 10
    rows = {(r["part"], r["row"]): r for r in report(tmp_path)["rows"]}
    large = [rows[("latency, batch 4", label)] for label in bench.LATENCY_MODELS]
    assert [r["status"] for r in large] == ["ok", "ok", "timed out", "timed out"]
    timeout = next(p for p in report(tmp_path)["parts"] if p["part"] == "latency, batch 4")["timeout_s"]
    assert large[2]["detail"] == f"timed out after {timeout:.0f} s (its share of the budget)"
    stopped_after = next(p for p in report(tmp_path)["parts"] if p["part"] == "latency, batch 4")["seconds"]
    assert timeout >= 0.22 * 10 and abs(stopped_after - timeout) < 1  # at least its share; stopped on time
    assert all(rows[("latency, batch 1", label)]["status"] == "ok" for label in bench.LATENCY_MODELS)
    assert rows[("training step", "reViT fixed")]["status"] == rows[("correctness", "stand-in")]["status"] == "ok"
    no_data = rows[("train.py run", "train.py run")]
    assert no_data["status"] == "not run" and re.search(r"no Fashion-MNIST in .*copy its four \.gz files", no_data["detail"])
    markdown = (tmp_path / "check.md").read_text()
    assert "| reViT cached | – | **timed out**: timed out after" in markdown and "**not run**: no Fashion" in markdown
    assert "latency, batch 4: | reViT cached | – | **timed out**: timed out after" in capsys.readouterr().out


def test_sigterm_stops_the_running_part_and_leaves_a_report_that_says_so(tmp_path, monkeypatch):
    """The large-batch latency part prints two rows, waits until the report holds them, then SIGTERMs the check
    (as a command limit would) and hangs: the check stops that part (its process group), marks its other
    rows stopped and the later parts not run, writes the report and exits with the reason."""
    real_parts = bench.check_parts
    wait_then_stop = (f"import json, os, pathlib, signal, time\npath = pathlib.Path({str(tmp_path / 'check.json')!r})\n"
                      "while sum(r['status'] == 'ok' for r in json.loads(path.read_text())['rows']) < 6:\n"
                      "    time.sleep(0.05)\nos.kill(os.getppid(), signal.SIGTERM)\ntime.sleep(600)\n")

    def stand_ins(args, device, sizes, run_dir):
        parts = real_parts(args, device, sizes, run_dir)
        for part in (p for p in parts if p.argv):
            stop = part.name == "latency, batch 4"
            part.argv = stand_in(part.rows[:2] if stop else part.rows, wait_then_stop if stop else "")
        return parts

    monkeypatch.setattr(bench, "check_parts", stand_ins)
    with pytest.raises(SystemExit) as stopped:
        bench.main(["check", "--device", "cpu", "--budget", "60", "--out", str(tmp_path)])
    assert str(stopped.value.code).startswith("bench.py check: stopped (SIGTERM after ")
    doc = report(tmp_path)
    statuses = [r["status"] for r in doc["rows"] if r["part"] == "latency, batch 4"]
    assert statuses == ["ok", "ok", "stopped", "stopped"] and doc["complete"] and not doc["ok"]
    assert all(r["status"] == "ok" for r in doc["rows"] if r["part"] == "latency, batch 1")
    assert {r["status"] for r in doc["rows"][8:]} == {"not run"}
    stopped_part = next(p for p in doc["parts"] if p["part"] == "latency, batch 4")
    assert stopped_part["status"] == "stopped" and not alive(stopped_part["pid"])
    assert "| reViT cached | – | **stopped**: the check was stopped (SIGTERM" in (tmp_path / "check.md").read_text()


def test_a_part_not_started_for_lack_of_time_says_so():
    """The floor: a part whose time would be under it is not started, and its rows say how much was left."""
    out = budget.Report("/nonexistent", {}, str, str)
    out.write = lambda: None
    parts = [budget.Part("slow", stand_in([], "import time; time.sleep(600)"), ["a"], share=0.5),
             budget.Part("next", stand_in(["b"]), ["b"], share=0.5, floor=100.0)]
    with open(os.devnull, "w") as log:
        budget.run_plan(parts, 2, out, log)
    assert [r["status"] for r in out.rows] == ["timed out", "not run"]
    assert out.rows[1]["detail"] == "1 s of the 2 s budget left for it, it needs 100 s"


def test_an_out_folder_holding_another_check_s_report_is_refused_and_left_as_it_is(tmp_path):
    (tmp_path / "check.json").write_text("{}")
    (tmp_path / "ckpt.pt").write_bytes(b"another run's")
    with pytest.raises(SystemExit) as error:
        bench.main(["check", "--device", "cpu", "--out", str(tmp_path)])
    assert str(error.value.code) == (f"bench.py: error: --out {tmp_path} already holds check.json (another "
                                     "check's report); choose another --out")
    assert (tmp_path / "check.json").read_text() == "{}" and (tmp_path / "ckpt.pt").read_bytes() == b"another run's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["check.json", "ckpt.pt"]


def test_a_read_only_working_folder_is_one_line_before_anything_runs(tmp_path, monkeypatch):
    """The default --out (out/check-TIME) lies under the working folder: where that folder cannot be written
    (a read-only mount; root passes chmod, so the kernel's answer is stood in for), one line, nothing made."""
    import lib.cli
    read_only = tmp_path.resolve()
    real_access = os.access
    monkeypatch.setattr(lib.cli.os, "access", lambda path, mode: real_access(path, mode) and not (
        mode & os.W_OK and Path(path).resolve() == read_only))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(bench.COMMANDS, "check", lambda *a: pytest.fail("the check started"))
    with pytest.raises(SystemExit) as error:
        bench.main(["check", "--device", "cpu"])
    assert re.fullmatch(rf"bench.py: error: --out out/check-\d{{8}}-\d{{6}} cannot be created: {read_only} is not "
                        "a writable folder", str(error.value.code)), error.value.code
    assert list(tmp_path.iterdir()) == []


def test_the_commit_comes_from_a_file_where_there_is_no_git(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "git_commit", lambda folder: None)
    monkeypatch.setattr(bench, "HERE", str(tmp_path))
    assert "git" not in bench.environment(bench.torch.device("cpu"))
    (tmp_path / ".commit").write_text("0123abc" * 5 + "01234-dirty\n")
    assert bench.environment(bench.torch.device("cpu"))["git"] == "0123abc" * 5 + "01234-dirty (from .commit)"
    (tmp_path / ".commit").write_text("not a commit; rm -rf /\n")
    assert "git" not in bench.environment(bench.torch.device("cpu"))


def test_the_gpu_report_reads_real_rows_and_judges_them_against_table_7(tmp_path):
    """check.md at full sizes (what the GPU run returns), from rows bench_latency and bench_train really emit
    (here on the CPU, tiny): every column fills, and the targets against the paper's Table 7 appear."""
    rows = []

    def collect(part):
        return lambda label, row, final: rows.append({"part": part, "row": label, "status": "ok", **row}) if final \
            else None

    cpu = bench.torch.device("cpu")
    bench.bench_latency(size="mini", batches=(1,), modes=("compiled",), warmup=0, repeats=2, backend="eager",
                        memory=False, on_row=collect("latency, batch 1"), model_args=bench.TINY_MODELS)
    for r in rows:
        r.update(memory_mib=10.0, memory_ratio=0.5)  # measured on CUDA only
    bench.bench_train(size="mini", batch=2, labels=["DeiT III", "reViT fixed"], warmup=0, repeats=2,
                      on_row=collect("training step"), model_args=bench.TINY_MODELS)
    kinds = {"latency, batch 1": "latency", "training step": "train"}
    doc = {"env": bench.environment(cpu), "sizes": "full", "budget_s": 420.0, "tf32": "TF32 on", "kinds": kinds,
           "parts": [], "rows": rows, "complete": True, "ok": True}
    text = bench.check_markdown(doc)
    assert "| reViT cached | 1 | ok | " in text and "| 10.0 | 0.50 |" in text and "| reViT fixed | 2 | ok | " in text
    assert "### Targets (ours, against the paper's Table 7)" in text and "reViT dynamic memory <= 0.55x" in text
    assert "train step reViT fixed <= 1.10x DeiT III" in text


def test_the_gpu_plan(tmp_path, fashion_mnist_dir):
    """What the parts of a CUDA check run (built here without a GPU: nothing is started): full sizes, most
    important first, inductor, the gpu-marked tests, the GPU the check was given as each part's only one."""
    args = bench.build_parser().parse_args(["check", "--device", "cuda:1", "--data-dir", str(fashion_mnist_dir)])
    parts = bench.check_parts(args, bench.torch.device("cuda", 1), bench.CHECK_SIZES["full"], str(tmp_path))
    assert [p.name for p in parts] == ["latency, batch 1", "latency, batch 64", "training step", "correctness",
                                       "train.py run", "training step, elastic depth", "GPU tests that need the data"]
    assert abs(sum(p.share for p in parts) - 1) < 1e-9 and all(0 < p.floor < p.share * 420 for p in parts)
    assert all(p.argv and not p.blocked for p in parts)
    assert parts[0].argv[-4:] == ["--device", "cuda", "--part", "latency-small"] and parts[1].argv[-1] == "latency-large"
    markers = [b for a, b in zip(parts[3].argv, parts[3].argv[1:]) if a == "-m"]  # python -m pytest ... -m gpu
    assert markers == ["pytest", "gpu"] and parts[6].argv[-2:] == [
        str(ROOT / "tests" / "test_train.py"), str(ROOT / "tests" / "test_analyze.py")]
    assert parts[0].env["CUDA_VISIBLE_DEVICES"] == "1" and parts[0].env["REVIT_GPU_TESTS"] == "1"
    assert parts[0].env["REVIT_DATA_DIR"] == str(fashion_mnist_dir)
    run = parts[4].argv
    assert run[run.index("--arch") + 1] == "revit-s" and run[run.index("--data-dir") + 1] == str(fashion_mnist_dir)
    assert run[run.index("--out-dir") + 1] == str(tmp_path) and "--compile-backend" in run
