"""memory.py: the CPU probe counts live tensors exactly, the extrapolation from reduced sizes predicts
a larger measured step within 15%, the counted parts equal what AdamW allocates, and train.py /
bench.py act on the estimate (gradient accumulation to fit, or a one-line stop saying what fits).

Also: AlterNet's loss memory must not grow with the iterations D (the D full-vocabulary logit tensors
of a naive PonderNet loss grow it ~4x from D = 2 to D = 8).
"""
import io
import json
from contextlib import redirect_stdout

import pytest
import torch
from hypothesis import given, settings, strategies as st

import alternet
import bench
from lib import build, memory
import revit
import train

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


# --- the probe: peak bytes of live tensors, against a hand count ---


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4096), st.booleans()), min_size=1, max_size=12))
def test_probe_peak_equals_a_hand_count(program):
    """A random program of allocations (n floats each) and frees of the oldest live tensor; views and
    in-place ops in between allocate nothing, nor does a tensor older than the probe. The reference adds
    and subtracts the sizes by hand."""
    live, reference_live, reference_peak = [], 0, 0
    older = torch.zeros(4096)

    def run():
        nonlocal reference_live, reference_peak
        for n, free_oldest in program:
            t = torch.empty(n)  # 4 n bytes
            t.add_(1.0)
            t[: n // 2].mul_(2.0)  # a view, in place: no new storage
            older[:n].add_(t)
            live.append(t)
            del t  # the list holds the only reference
            reference_live += 4 * n
            reference_peak = max(reference_peak, reference_live)
            if free_oldest:
                reference_live -= 4 * live.pop(0).numel()

    assert memory.peak_bytes(run, CPU) == reference_peak


def test_probe_counts_what_autograd_keeps():
    """exp saves its output for backward: forward holds x.exp() and y, the sum's result is one float."""
    x = torch.randn(1000, requires_grad=True)
    timeline = memory.live_bytes(lambda: x.exp().mul(2.0).sum().backward())
    assert max(timeline) >= 2 * 4000 and timeline[-1] <= 4000 + 8  # only x.grad (and a scalar) survive



def test_probe_counts_a_dtype_cast_under_inference_mode():
    """Inference mode dispatches aten.to undecomposed, whose schema says its output MAY alias the input:
    a cast to another dtype is a copy all the same (a bf16 bank cast to fp32 at every step, say), a cast
    to the same dtype is the input itself."""
    x = torch.zeros(1000, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert memory.peak_bytes(lambda: x.to(torch.float32), CPU) == 4000
        assert memory.peak_bytes(lambda: x.to(torch.bfloat16), CPU) == 0
    assert memory.peak_bytes(lambda: x.float(), CPU) == 4000

# --- the counted parts are what AdamW and DDP hold ---


def test_counted_parts_equal_adamw_state_after_a_step():
    model = revit.create_model("revit-mini", dim=32, heads=2, ffn_dim=48)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1, 28, 28)).sum().backward()
    optimizer.step()
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t.dim() > 0)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    counted = memory.model_bytes(model)
    assert counted["optimizer"] == state and counted["grads"] == grads
    assert memory.model_bytes(model, devices=8)["grads"] == 2 * grads  # DDP's buckets


# --- the prediction: measured small, extrapolated to a larger step, checked by measuring it ---


@pytest.mark.parametrize("config, batch, seq_len", [
    (alternet.AlterNetConfig(**alternet.PRESETS["alternet-tiny"]), 4, 128),
    (revit.ViTConfig(**revit.PRESETS["revit-mini"]), 8, None)])
def test_prediction_within_15_percent_of_the_measured_step(config, batch, seq_len):
    """Measured at 1-2 samples of <= 16 tokens (language) and depths 2, 3; predicted at the preset's full
    depth and a larger batch; then that step measured. The RNG is left as it was."""
    rng = torch.get_rng_state()
    predicted, measured, model = predict_and_measure(config, batch, seq_len)
    assert torch.equal(torch.get_rng_state(), rng)
    assert abs(predicted.activations + predicted.loss - measured) / measured <= 0.15
    assert predicted.total == pytest.approx(sum(memory.model_bytes(model).values()) + predicted.activations
                                            + predicted.loss)


def predict_and_measure(config, batch: int, seq_len: int | None):
    """The estimate from measure() (fp32) at the config's full depth, the peak of that step measured, the model."""
    profile = memory.measure(config, CPU, None, seq_len)
    model = memory.reduced_model(config, CPU, memory.depth_of(config))
    measured = max(memory.step_timeline(model, batch, seq_len, CPU, None))
    return memory.estimate(model, profile, batch, seq_len), measured, model


@pytest.mark.parametrize("chunk", [48, 6])
def test_prediction_of_a_loss_in_several_chunks_within_15_percent(monkeypatch, chunk):
    """AlterNet's loss decodes C = LOSS_CHUNK_LOGITS // V tokens at a time, so it holds one chunk's
    logits whatever the tokens. C shrunk here (48 > the 16 tokens measured; 6 < them, measured at 3 and 6)
    at V = 8192 and a tiny width, so that the chunk's logits are a large part of the step: 4 x 64 tokens
    run >= 6 chunks. A loss extrapolated linearly in the tokens (all 256 tokens' logits at once) predicts
    4-10x the measured step."""
    monkeypatch.setattr(alternet, "LOSS_CHUNK_LOGITS", chunk * 8192)
    config = alternet.AlterNetConfig(vocab_size=8192, seq_len=64, dim=16, heads=2, ffn_dim=32, num_experts=2,
                                     top_k=1, depth_dim=4, max_depth=4)
    predicted, measured, _ = predict_and_measure(config, 4, 64)
    assert alternet.loss_chunk_tokens(config.vocab_size) == chunk and 4 * 64 >= 5 * chunk
    assert predicted.loss > 0.2 * measured  # the loss matters here: a wrong model of it shows
    assert abs(predicted.activations + predicted.loss - measured) / measured <= 0.15


def test_alternet_loss_memory_does_not_grow_with_the_iterations():
    """At V = 50,257 and a tiny width the loss is nearly all of a training step's memory: from D = 2 to
    D = 8 iterations it must grow < 1.3x (one chunk of logits at a time, whatever D)."""
    config = alternet.AlterNetConfig(vocab_size=50257, seq_len=16, dim=16, heads=2, ffn_dim=16, num_experts=2,
                                     top_k=1, depth_dim=4, max_depth=8)
    peaks = {d: max(memory.step_timeline(memory.reduced_model(config, CPU, d), 2, 16, CPU, None)) for d in (2, 8)}
    assert peaks[8] / peaks[2] < 1.3, f"loss memory grows {peaks[8] / peaks[2]:.2f}x from D = 2 to D = 8"


# --- the plan: accumulation to fit, and what to change when nothing fits ---


TINY = dict(dim=32, heads=2, ffn_dim=64, max_depth=3)


def tiny_language_plan():
    """The model of run_train below (train.py measures the same config: the profile is cached)."""
    config = alternet.AlterNetConfig(**{**alternet.PRESETS["alternet-tiny"], **TINY})
    with torch.device("meta"):
        model = alternet.AlterNet(config)
    return model, memory.measure(config, CPU, None, 32)


def between(a: memory.Memory, b: memory.Memory) -> float:
    """A budget in GB under which a does not fit and b does."""
    return (a.total + b.total) / 2 / memory.USABLE / memory.GB


def test_plan_picks_the_fewest_micro_steps_that_fit_and_says_what_would_fit():
    model, profile = tiny_language_plan()
    one, two = (memory.estimate(model, profile, 8, 32, 1, a) for a in (1, 2))
    budget = between(one, two)
    assert memory.plan(model, profile, 8, 32, 1, budget).grad_accum == 2
    with pytest.raises(ValueError, match="--grad-accum 2") as e:
        memory.plan(model, profile, 8, 32, 1, budget, grad_accum=1)
    assert "2 GPUs (torchrun --nproc_per_node 2" in str(e.value) and "--block-size 16" in str(e.value)
    with pytest.raises(ValueError, match="a smaller model"):
        memory.plan(model, profile, 8, 32, 1, 1e-6)


def run_train(tmp_path, *flags):
    out = io.StringIO()
    with redirect_stdout(out):
        summary = train.main(["--arch", "alternet-tiny", "--out-dir", str(tmp_path / "lm"), "--no-progress",
                              "--max-steps", "2", "--batch-size", "8", "--block-size", "32", "--eval-iters", "1",
                              "--eval-batch-size", "4", "--model-args", ",".join(f"{k}={v}" for k, v in TINY.items()),
                              *flags])
    return summary, out.getvalue()


def test_train_raises_grad_accum_to_fit_the_device(tmp_path):
    model, profile = tiny_language_plan()
    budget = between(*(memory.estimate(model, profile, 8, 32, 1, a) for a in (1, 2)))
    summary, printed = run_train(tmp_path, "--gpu-memory", str(budget))
    assert "override: grad_accum=2 (auto: the fewest micro-steps whose peak fits" in printed
    assert "memory: ~" in printed and "x accum 2 = micro-batch 4)" in printed
    assert summary["step"] == 2 and torch.load(tmp_path / "lm" / "ckpt.pt")["train_config"]["grad_accum"] == 2


def test_train_stops_before_any_work_when_nothing_fits(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        run_train(tmp_path, "--gpu-memory", "0.000001")
    message = str(e.value.code)
    assert message.startswith("train.py: error: --arch alternet-tiny at --batch-size 8") and "\n" not in message
    assert "a smaller model (weights, gradients and AdamW state alone take" in message
    assert not (tmp_path / "lm").exists()
    with pytest.raises(SystemExit, match=r"--gpu-memory must be in \(0, 1,000,000\]; got -1.0"):
        run_train(tmp_path, "--gpu-memory", "-1")


# --- bench.py memory ---


def test_bench_memory_reports_every_part_and_the_fit(capsys):
    result = bench.main(["memory", "--arch", "alternet-tiny", "--batch-size", "8", "--seq-len", "32",
                         "--gpu-memory", "80"])
    printed = capsys.readouterr().out
    assert json.loads(printed.strip().splitlines()[-1])["command"] == "memory"
    assert result["fits"] and result["grad_accum"] == 1 and result["precision"] == "bf16 autocast"
    parts = result["bytes"]
    assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"))
    assert all(v >= 0 for v in parts.values()) and parts["loss"] > 0
    assert "| activations |" in printed and "fits 90% of 80 GB: yes" in printed
    assert printed.startswith("alternet-tiny, recipe text: ~")  # the recipe it is for, named
    with pytest.raises(SystemExit, match=r"bench.py: error: --gpus must be in 1..65,536; got 0"):
        bench.main(["memory", "--arch", "alternet-tiny", "--gpus", "0"])


def test_the_plan_and_bench_memory_measure_in_fp16(tmp_path):
    """--precision fp16 (auto's choice on a GPU without bf16): train.py's plan measures the step under fp16
    autocast and says so, and the run trains (CPU autocast, the CPU's gradient scaler); bench.py memory
    --precision fp16 measures the same way."""
    summary, printed = run_train(tmp_path, "--gpu-memory", "80", "--precision", "fp16")
    assert "; fp16 autocast, batch 8 x 32 over 1 device(s)" in printed and summary["step"] == 2
    result = bench.main(["memory", "--arch", "alternet-tiny", "--batch-size", "8", "--seq-len", "32",
                         "--precision", "fp16"])
    assert result["precision"] == "fp16 autocast" and result["fits"]


def test_small_cpu_runs_skip_the_measurement(monkeypatch):
    """train.py's tests run ~100 tiny CPU models: for them the estimate is one parameter count."""
    monkeypatch.setattr(memory, "measure", lambda *a, **k: pytest.fail("measured a tiny CPU run"))
    cfg = train.resolve_config({"arch": "alternet-tiny", "max_steps": 1}, announce=False)
    build.fit_in_memory(cfg, None, CPU, 1)
    assert cfg.grad_accum == 1


def test_device_memory_of_a_gpu_and_of_a_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: type("Properties", (), {"total_memory": 85_520_809_984})())
    assert memory.device_memory_gb(torch.device("cuda")) == pytest.approx(85.52, abs=0.01)  # an "80 GB" H100
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    ram = memory.device_memory_gb(CPU)
    assert ram is None or 0 < ram < 1e5


def test_folded_config_is_what_fold_builds():
    model = revit.create_model("revit-mini", image_size=8, patch_size=4, in_channels=1, num_classes=5, dim=16,
                               heads=2, ffn_dim=24, depth=4)
    assert memory.folded_config(model.config) == revit.fold(model).config


def test_rss_of_a_folded_and_a_compact_model_in_fresh_processes():
    """The folded ViT of a 12-step reViT stores 12 FFNs; the compact model, merging on every call, 4 experts
    and one merged FFN at a time: the folded one needs more."""
    config = dict(revit.PRESETS["revit-mini"], depth=12, dim=64, heads=2, ffn_dim=1024, merge_cache=False)
    compact, folded = memory.cpu_memory_of([{"config": config, "fold": False}, {"config": config, "fold": True}],
                                           batch=1, calls=1, processes=1)
    assert 0 < compact["memory_mib"] < folded["memory_mib"] and "fresh process" in folded["memory_method"]
    failed = memory.cpu_memory_of([{"config": {**config, "colour": 1}, "fold": False}], 1, 1, 1)[0]
    assert "unexpected keyword argument 'colour'" in failed["memory_error"]  # the process's last line
