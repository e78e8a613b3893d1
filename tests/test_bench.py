"""bench.py: the FLOP count against torch's flop_counter, the paper's table cells, well-formed rows.

No timing assertions: the bench functions run on tiny configs and we check the shape of what
they return, never how fast anything was.
"""
import io
import json
from contextlib import redirect_stdout

import pytest
import torch
from hypothesis import given, settings, strategies as st

import bench
import revit

FAST = settings(max_examples=10, deadline=None)


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: on a shared machine two spinning OpenMP threads can be 20x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
    if "revit-mini-lora" not in revit.PRESETS:
        pytest.skip("layer-wise LoRA preset not in revit.py")
    model, counted = bench.count_preset("revit-mini-lora", **tiny_config(lora_rank=3))
    macs = bench.analytic_macs(model.config, lora_rank=3)
    assert macs["lora"] > 0
    assert counted["total"] - counted["attention"] == 2 * macs["total"]
    folded = bench.counted_flops(revit.fold(revit.create_model("revit-mini-lora", **tiny_config(lora_rank=3))))
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
    assert [(r["model"], r["batch"]) for r in rows] == [(m, b) for b in (1, 2) for m in bench.LATENCY_SPECS]
    for r in rows:
        assert ROW_KEYS <= set(r) and r["repeats"] == 2 and r["mode"] == "eager"
        assert 0 < r["min_ms"] <= r["q1_ms"] <= r["median_ms"] <= r["q3_ms"] <= r["max_ms"]
        assert r["ratio"] > 0 and (r["ratio"] == 1.0) == (r["model"] == "DeiT III")
    folded = next(r for r in rows if r["model"] == "reViT folded")
    dynamic = next(r for r in rows if r["model"] == "reViT dynamic")
    assert folded["params_m"] > dynamic["params_m"]  # folded stores L FFNs, the compact model E
    json.dumps(result)


def test_folded_config_is_what_fold_builds():
    model = revit.create_model("revit-mini", **tiny_config())
    assert bench.folded_config(model.config) == revit.fold(model).config


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
