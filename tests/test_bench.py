"""bench.py: the FLOP count against torch's flop_counter, the paper's table cells, well-formed rows.

No timing assertions: the bench functions run on tiny configs and we check the shape of what
they return, never how fast anything was.
"""
import io
import json
import math
from contextlib import redirect_stdout

import pytest
import torch
from hypothesis import given, settings, strategies as st

import bench
from lib import cli, moe
import revit

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
    assert "AlterNet compiled vs eager: " in bench.train_markdown({"rows": result["rows"], "settings": {"summary": ""}})


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
        result = bench.main(["params", "--sizes", "s", "--no-counter", "--out", str(out)])
    lines = buffer.getvalue().strip().splitlines()
    assert lines[0].startswith("## ") and any(line.startswith("| DeiT III-S |") for line in lines)
    assert json.loads(lines[-1]) == json.loads(out.read_text())
    assert json.loads(lines[-1])["command"] == result["command"] == "params"


def test_every_flag_has_help():
    parser = bench.build_parser()
    for sub in parser._subparsers._group_actions[0].choices.values():
        for action in sub._actions:
            assert action.help, (sub.prog, action.dest)


# --- check (tests/test_check.py tests its plan): the first line of an error ---


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
    (["latency", "--batches", "0"], "--batches must be comma-separated integers in 1..65,536, e.g. 1,8; got '0'"),
    (["latency", "--batches", "1,-4"], "--batches must be comma-separated integers in 1..65,536"),
    (["latency", "--batches", "a,b"], "--batches must be comma-separated integers in 1..65,536"),
    (["latency", "--batches", "1,,8"], "--batches must be comma-separated integers"),
    (["latency", "--batches", "9" * 5000], "--batches must be comma-separated integers in 1..65,536"),
    (["latency", "--repeats", "0"], "--repeats must be in 1..10,000; got 0"),
    (["latency", "--iters", "0"], "--iters must be in 1..10,000; got 0"),
    (["latency", "--warmup", "-1"], "--warmup must be in 0..1,000; got -1"),
    (["latency", "--modes", "turbo"], "--modes must be comma-separated of eager, compiled, reduce-overhead"),
    (["latency", "--modes", "reduce-overhead"], "--modes reduce-overhead times CUDA graphs: it needs a CUDA device"),
    (["latency", "--threads", "0"], "--threads must be in 1..1,024; got 0"),
    (["latency", "--out", "{dir}"], "--out {dir} is a folder; give a file"),
    (["params", "--sizes", "s,xxl"], "--sizes must be comma-separated of s, b, l; got 's,xxl'"),
    (["params", "--out", "{file}/params.json"], "--out {file}/params.json cannot be created: {file} is a file, not a folder"),
    (["train", "--batch", "0"], "--batch must be in 1..65,536; got 0"),
    (["train", "--peak-tflops", "nan"], "--peak-tflops must be a finite number; got nan"),
    (["train", "--peak-tflops", "inf"], "--peak-tflops must be a finite number; got inf"),
    (["train", "--peak-tflops", "-3"], "--peak-tflops must be in 0.001..100,000; got -3.0"),
    (["train", "--peak-tflops", "1e308"], "--peak-tflops must be in 0.001..100,000; got 1e+308"),
    (["train", "--peak-tflops", "1e-320"], "--peak-tflops must be in 0.001..100,000; got 1e-320"),
    (["check", "--quick", "--threads", "0"], "--threads must be in 1..1,024; got 0"),
    (["check", "--quick", "--out", "{file}"], "--out {file} is a file; give a folder"),
    (["check", "--quick", "--out", "{file}/report"], "--out {file}/report cannot be created: {file} is a file, not a folder"),
    (["check", "--budget", "5"], "--budget must be in 10..86,400; got 5.0"),
    (["check", "--budget", "nan"], "--budget must be a finite number; got nan"),
    (["check", "--part", "latency:x"], "--part must be latency:BATCH, train-step or elastic; got 'latency:x'"),
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
