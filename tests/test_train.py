"""train.py: the loop end-to-end on real (subsets of) Fashion-MNIST and the built-in text corpus, exact
resume, DDP = single process, recipes, evaluation without training, distillation, probes, device choices.
Faults (divergence, run folders, bad files and values) are in test_faults.py.

Models are tiny (width 32, 16 tokens) so the whole file runs in well under three minutes on 2 cores.
"""
import contextlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lib import checkpoint
from lib import build, cli, resume
import revit
import train
from conftest import RECORDED_RUN  # the shared recorded run's flags
from torch.optim.optimizer import register_optimizer_step_pre_hook

ROOT = Path(__file__).resolve().parent.parent
TINY_VISION = "dim=32,heads=2,ffn_dim=64"


def run(tmp_path, fashion_mnist_dir, *args, name="run", arch="revit-mini"):
    """train.main on a 512-image subset with a tiny model; returns (summary, out_dir)."""
    out = tmp_path / name
    argv = ["--arch", arch, "--data-dir", str(fashion_mnist_dir), "--out-dir", str(out), "--no-progress",
            "--device", "cpu", "--train-subset", "512", "--test-subset", "256", "--batch-size", "32",
            "--patch-size", "7", "--depth", "4", "--model-args", TINY_VISION, "--log-interval", "1", *args]
    return train.main(argv), out


def metrics(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def step_losses(out_dir):
    return {r["step"]: r["loss"] for r in metrics(out_dir) if "loss" in r}


# --- the loop ---


@pytest.mark.parametrize("arch", ["vit-mini", "raptor-mini", "revit-mini"])
def test_loop_runs_end_to_end(tmp_path, fashion_mnist_dir, arch, capsys):
    extra = [] if arch == "vit-mini" else ["--eval-depths", "2,6"]
    summary, out = run(tmp_path, fashion_mnist_dir, "--max-steps", "4", *extra, arch=arch)
    assert "4 steps (" in (printed := capsys.readouterr().out) and "after 4 warmup steps" in printed  # cut short
    assert 0.0 <= summary["test_acc"] <= 1.0 and summary["params"] > 0 and summary["step"] == 4
    if arch != "vit-mini":
        assert set(summary["depths"]) == {"4", "2", "6"}
    model, ckpt = checkpoint.load_model(out / "ckpt.pt")  # rebuild + load, as the tools do
    assert ckpt["arch"] == arch and ckpt["step"] == 4 and ckpt["model_config"]["image_size"] == 28
    assert not any(k.startswith(("_orig_mod", "module.")) for k in ckpt["model"])
    assert all(torch.isfinite(p).all() for p in model.parameters())
    logged = metrics(out)
    assert logged[0]["event"] == "start" and logged[-1]["event"] == "final"
    assert [r["step"] for r in logged if "loss" in r] == [1, 2, 3, 4]


def test_table6_recipe_runs(tmp_path, fashion_mnist_dir):
    """BCE on binarised mixup/cutmix targets, 3-Augment, jitter, elastic depth, grad accumulation."""
    summary, out = run(tmp_path, fashion_mnist_dir, "--max-steps", "3", "--loss", "bce", "--mixup", "0.8",
                       "--cutmix", "1.0", "--three-augment", "--color-jitter", "0.3", "--depth-drop", "0.3",
                       "--grad-accum", "2", "--repeated-aug", "3")
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert ckpt["model_config"]["depth_drop"] == 0.3 and ckpt["train_config"]["loss"] == "bce"
    assert all(k in metrics(out)[1] for k in ("balance", "z_loss", "diversity"))  # aux losses logged


def test_weight_decay_groups():
    model = revit.create_model("revit-mini")
    decay, no_decay = build.param_groups(model, 0.05)
    names = {id(p): n for n, p in model.named_parameters()}
    excluded = {names[id(p)] for p in no_decay["params"]}
    assert {"cls_token", "pos_embed", "block.mlp.router.2.weight", "block.mlp.fc1_bias"} <= excluded
    assert all(p.ndim >= 2 for p in decay["params"]) and no_decay["weight_decay"] == 0.0


SMALL_VISION = dict(dim=32, heads=2, ffn_dim=64, image_size=32, patch_size=16)
SMALL_LANGUAGE = dict(vocab_size=64, seq_len=16, dim=32, heads=2, ffn_dim=32, depth_dim=8)


def test_no_bias_is_decayed_for_any_preset():
    """Biases are never decayed, whatever their shape (reViT's per-expert biases are (E, d_ff))."""
    import alternet
    from lib import moe  # every preset: the comparison mechanisms' too
    models = [(name, moe.create_model(name, **SMALL_VISION)) for name in moe.PRESETS]
    models += [(name, alternet.create_model(name, **SMALL_LANGUAGE)) for name in alternet.PRESETS]
    for name, model in models:
        decay, _ = build.param_groups(model, 0.05)
        decayed = {id(p) for p in decay["params"]}
        for pname, p in model.named_parameters():
            if pname.endswith("bias"):
                assert id(p) not in decayed, (name, pname)
        assert decay["params"], name


class SquaredError:
    """A task for train_step alone: the summed squared error of a linear map."""

    def loss(self, forward, x, y):
        return ((forward(x) - y) ** 2).sum(), {}


@pytest.mark.parametrize("clip", [0.0, 1e9, 0.25])
def test_gradient_clipping_scales_the_whole_gradient_to_its_max_norm(clip):
    """--grad-clip c: the step uses g min(1, c / ||g||), ||g|| the norm over every parameter at once, and the
    log records ||g|| before clipping; 0 clips nothing. Seen through SGD, whose update is -lr times the gradient."""
    import types
    torch.manual_seed(0)
    model, x, y = torch.nn.Linear(4, 3), torch.randn(8, 4), torch.randn(8, 3)
    before = [p.detach().clone() for p in model.parameters()]
    grads = torch.autograd.grad(((model(x) - y) ** 2).sum(), list(model.parameters()))
    norm = torch.cat([g.flatten() for g in grads]).norm().item()
    max_norm = clip * norm  # 0.25: a quarter of this gradient's norm
    cfg = types.SimpleNamespace(grad_accum=1, grad_clip=max_norm, probe=None)
    sched = dict(warmup_steps=0, total_steps=1, warmup_lr=0.1, min_lr=0.1, peak_lr=0.1)  # lr 0.1 at step 0
    run = train.Run(cfg, torch.device("cpu"), model, model, SquaredError(), None,
                    torch.optim.SGD(model.parameters(), lr=0.1), torch.amp.GradScaler("cpu", enabled=False), sched,
                    None)
    record = train.train_step(run, x, y)
    scale = min(1.0, max_norm / (norm + 1e-6)) if clip else 1.0
    assert record["grad_norm"] == pytest.approx(norm, rel=1e-6)
    for p, p0, g in zip(model.parameters(), before, grads):
        torch.testing.assert_close(p.detach(), p0 - 0.1 * scale * g, rtol=1e-5, atol=1e-6)


def test_warmup_cosine_schedule():
    sched = dict(warmup_steps=10, total_steps=110, warmup_lr=1e-6, min_lr=1e-5)
    assert train.lr_at(0, 1e-3, sched) == pytest.approx(1e-6)
    assert train.lr_at(10, 1e-3, sched) == pytest.approx(1e-3)
    assert train.lr_at(60, 1e-3, sched) == pytest.approx((1e-3 + 1e-5) / 2)
    assert train.lr_at(110, 1e-3, sched) == pytest.approx(1e-5)


@pytest.mark.parametrize("dataset, width, lr", [("grammar", 256, 1e-3), ("grammar", 264, 3e-4),
                                               ("fashion-mnist", 384, 4e-3), ("fashion-mnist", 768, 3e-3)])
def test_the_automatic_lr_at_the_widths_that_decide_it(dataset, width, lr, capsys):
    """The lr a recipe leaves open, from the width, on each boundary: Table 6 (arXiv 2610.12448) gives 4e-3
    to S (width 384) and 3e-3 to B (width 768) and L; a byte-level AlterNet up to width 256 trains at 1e-3
    (our choice for the CPU presets), wider ones at the AlterNet paper's 3e-4."""
    from types import SimpleNamespace
    cfg = train.TrainConfig(dataset=dataset, lr=None, lr_batch=0, max_steps=10, warmup_steps=0)
    assert train.schedule(cfg, SimpleNamespace(config=SimpleNamespace(dim=width)), None)["peak_lr"] == lr
    assert f"override: lr={lr} (auto: " in capsys.readouterr().out


@pytest.mark.parametrize("image_size, kept", [(28, True), (21, False), (35, True), (30, False)])
def test_a_preset_patch_is_kept_down_to_four_patches_a_side(image_size, kept):
    """Small images get a finer grid only when the preset's patch (revit-mini: 7) would leave fewer than 4
    patches a side or does not divide the image: 28 px (4 x 4 patches, Fashion-MNIST) keeps it."""
    from lib import data, tasks
    images = data.ImageData(None, None, 10, 1, image_size, [0.5], [0.5])
    overrides = tasks.vision_overrides(train.TrainConfig(arch="revit-mini"), images)
    assert ("patch_size" not in overrides) == kept, overrides


def test_resume_matches_uninterrupted_run(tmp_path, fashion_mnist_dir, capsys):
    """Every source of randomness on: elastic depth, drop-path, crop/flip, 3-Augment, mixup/cutmix."""
    recipe = ["--max-steps", "6", "--depth-drop", "0.3", "--drop-path", "0.1", "--mixup", "0.8",
              "--cutmix", "1.0", "--three-augment", "--color-jitter", "0.3", "--eval-interval", "2"]
    straight, out_a = run(tmp_path, fashion_mnist_dir, *recipe, name="straight")
    _, out_b = run(tmp_path, fashion_mnist_dir, *recipe, "--stop-at-step", "3", name="killed")
    assert torch.load(out_b / "ckpt.pt", weights_only=True)["step"] == 3
    capsys.readouterr()
    resumed = train.main(["--resume", str(out_b / "ckpt.pt"), "--no-progress"])
    assert "6 steps (16 per epoch), resumed at step 3 |" in capsys.readouterr().out  # where it continues
    a, b = step_losses(out_a), step_losses(out_b)
    assert [a[s] for s in range(1, 7)] == [b[s] for s in range(1, 7)]  # bit-for-bit
    assert straight["test_acc"] == resumed["test_acc"]
    state_a = torch.load(out_a / "ckpt.pt", weights_only=True)
    state_b = torch.load(out_b / "ckpt.pt", weights_only=True)
    for name, tensor in state_a["model"].items():
        assert torch.equal(tensor, state_b["model"][name]), name


def test_resume_reseeds_the_random_streams_a_checkpoint_cannot_restore(tmp_path, fashion_mnist_dir, capsys):
    """A checkpoint from another device type (the augmentation generator's state is 16 bytes on CUDA,
    5,056 on the CPU) or from another number of ranks: resumed deterministically, said in one line."""
    _, out = run(tmp_path, fashion_mnist_dir, "--max-steps", "4", "--three-augment", "--depth-drop", "0.3",
                 "--stop-at-step", "2")
    saved = torch.load(out / "ckpt.pt", weights_only=True)
    from_gpu = dict(saved["rng"][0], device_type="cuda", augment=torch.zeros(16, dtype=torch.uint8),
                    cuda=[torch.zeros(16, dtype=torch.uint8)] * 8)  # 8 GPUs, older format: one state each
    cases = {"from_gpu": ([from_gpu], "reseeded (augmentation; seed 3): the checkpoint's states were saved "
                                      "on cuda, they do not apply on cpu"),
             "two_ranks": (saved["rng"] * 2, "reseeded (all; seed 3): the checkpoint was saved by 2 rank(s), "
                                             "this run has 1")}
    for name, (rngs, line) in cases.items():
        losses = []
        for _ in range(2 if name == "from_gpu" else 1):  # twice: the reseeded run is deterministic
            checkpoint.atomic_save(dict(saved, rng=rngs), out / "ckpt.pt")
            capsys.readouterr()
            assert train.main(["--resume", str(out / "ckpt.pt"), "--no-progress"])["step"] == 4
            assert f"override: random streams {line}; the run continues deterministically" in capsys.readouterr().out
            losses.append([step_losses(out)[s] for s in (3, 4)])
        assert losses[0] == losses[-1], name


def test_rng_state_of_this_gpu_only(monkeypatch):
    """A CUDA checkpoint holds the state of the rank's own GPU; a state that does not fit (older files
    of an 8-GPU machine hold 8, a CPU generator's is 5,056 bytes) is picked or reseeded, never a traceback."""
    calls = []

    def set_state(state, device):
        if state.numel() != 16:
            raise RuntimeError("RNG state is wrong size")
        calls.append(("set", state[0].item(), device))

    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: torch.full((16,), 5, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_state)
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: calls.append(("seed", seed)))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    gpu = torch.device("cuda:1")
    state = checkpoint.rng_state(None, gpu)
    assert state["device_type"] == "cuda" and state["cuda"].shape == (16,)  # one state, not one per GPU
    assert checkpoint.set_rng_state(state, None, gpu, seed=7) == [] and calls == [("set", 5, gpu)]
    eight = [torch.full((16,), i, dtype=torch.uint8) for i in range(8)]
    calls.clear()
    assert checkpoint.set_rng_state(dict(state, cuda=eight), None, gpu, seed=7) == [] and calls == [("set", 1, gpu)]
    calls.clear()
    assert checkpoint.set_rng_state(dict(state, cuda=eight[:1]), None, gpu, seed=7) == ["cuda"]  # 1 GPU saved
    cpu_sized = dict(state, cuda=torch.get_rng_state())
    assert checkpoint.set_rng_state(cpu_sized, None, gpu, seed=7) == ["cuda"] and calls == [("seed", 7)] * 2
    calls.clear()
    assert checkpoint.set_rng_state(state, None, torch.device("cpu"), seed=7) == [] and calls == []


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_two_processes_match_single_process(tmp_path, fashion_mnist_dir):
    """torchrun, gloo, 2 ranks x 16 images == 1 process x 32 images (same global batch)."""
    args = ["--arch", "revit-mini", "--data-dir", str(fashion_mnist_dir), "--no-progress", "--device", "cpu",
            "--train-subset", "512", "--test-subset", "256", "--batch-size", "32", "--patch-size", "7",
            "--depth", "4", "--model-args", TINY_VISION, "--max-steps", "3", "--mixup", "0", "--cutmix", "0",
            "--no-random-crop", "--no-three-augment", "--color-jitter", "0"]
    single, _ = train.main(args + ["--out-dir", str(tmp_path / "single")]), None
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(ROOT / "train.py"), *args, "--out-dir", str(tmp_path / "ddp")]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    a = torch.load(tmp_path / "single" / "ckpt.pt", weights_only=True)
    b = torch.load(tmp_path / "ddp" / "ckpt.pt", weights_only=True)
    assert len(b["rng"]) == 2  # one RNG state per rank
    for name, tensor in a["model"].items():
        torch.testing.assert_close(b["model"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    assert abs(json.loads((tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()[-1])["test_acc"]
               - single["test_acc"]) < 1e-6


def test_the_suite_runs_on_the_cpu_by_default():
    """conftest hides the GPUs before torch initialises CUDA (unless REVIT_GPU_TESTS=1): --device auto
    is the CPU in the tests and in the processes they start (torchrun's ranks above)."""
    assert cli.pick_device("auto") == torch.device("cpu")
    seen = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                          capture_output=True, text=True, timeout=60)
    assert seen.stdout.strip() == "0", seen.stderr[-2000:]


def test_more_ranks_than_gpus_is_one_line(monkeypatch):
    """torchrun with more processes per node than GPUs: refused before torch.cuda.set_device."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: pytest.fail(f"set_device({index})"))
    monkeypatch.setenv("RANK", "1"), monkeypatch.setenv("WORLD_SIZE", "2"), monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(SystemExit, match="local rank 1, but this machine has 1 CUDA device"):
        cli.init_distributed("cuda")


# --- checkpoints and failures ---


def test_atomic_save_survives_a_crash(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    checkpoint.atomic_save({"step": 1, "w": torch.ones(3)}, path)
    real_save = torch.save

    def crash(obj, f, *args, **kwargs):  # write half a file, then die
        real_save(obj, f, *args, **kwargs)
        with open(f, "r+b") as handle:
            handle.truncate(20)
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError):
        checkpoint.atomic_save({"step": 2, "w": torch.zeros(3)}, path)
    monkeypatch.setattr(torch, "save", real_save)
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["step"] == 1 and torch.equal(ckpt["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temp file left


def test_crash_during_checkpoint_keeps_last_good_one(tmp_path, fashion_mnist_dir, monkeypatch):
    real_save, calls = torch.save, []

    def save_then_crash(obj, f, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("killed during save")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_then_crash)
    with pytest.raises(SystemExit, match=r"stopped by Ctrl-C at step 3; resume with --resume .*\(its step 2\)"):
        run(tmp_path, fashion_mnist_dir, "--max-steps", "6", "--save-interval", "1")
    monkeypatch.setattr(torch, "save", real_save)
    model, ckpt = checkpoint.load_model(tmp_path / "run" / "ckpt.pt")
    assert ckpt["step"] == 2


def test_nan_loss_stops_and_keeps_the_good_checkpoint(tmp_path, fashion_mnist_dir, monkeypatch):
    real_loss = train.classification_loss

    def loss(logits, targets, kind):
        value = real_loss(logits, targets, kind)
        return value * float("nan") if len(step_losses(tmp_path / "run")) >= 2 else value

    monkeypatch.setattr(train, "classification_loss", loss)
    with pytest.raises(SystemExit, match=r"non-finite loss nan at step 2; .*ckpt\.pt \(step 2\)") as e:
        run(tmp_path, fashion_mnist_dir, "--max-steps", "6", "--save-interval", "1")
    assert "--grad-clip 1.0" not in str(e.value)  # clipping is already on: the hint says what else to try
    ckpt = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)
    assert ckpt["step"] == 2 and all(torch.isfinite(t).all() for t in ckpt["model"].values())


# --- distillation and probes ---


def test_distillation_loss_decreases(tmp_path, fashion_mnist_dir):
    _, teacher = run(tmp_path, fashion_mnist_dir, "--max-steps", "1", name="teacher", arch="vit-mini")
    summary, out = run(tmp_path, fashion_mnist_dir, "--max-steps", "12", "--teacher", str(teacher / "ckpt.pt"),
                       "--lr", "3e-3", "--lr-batch", "0", "--warmup-steps", "0", name="student")
    losses = [r["distill"] for r in metrics(out) if "distill" in r]
    assert sum(losses[-3:]) < 0.5 * sum(losses[:3])
    assert "test_distill_mse" in summary
    run(tmp_path, fashion_mnist_dir, "--max-steps", "2", "--overwrite", name="teacher", arch="vit-mini")  # retrained
    student = str(out / "ckpt.pt")
    for argv in (["--resume", student, "--max-steps", "14"], ["--eval-only", student]):  # other targets
        with pytest.raises(SystemExit, match="--teacher .* is not the file this run was trained on"):
            train.main([*argv, "--teacher", str(teacher / "ckpt.pt")])
        with pytest.raises(SystemExit, match="the run used --teacher .*; give --teacher again"):
            train.main(argv)  # not the accuracy of a head distillation never trained
    with pytest.raises(SystemExit, match="student tokens .* teacher tokens .* differ"):
        run(tmp_path, fashion_mnist_dir, "--max-steps", "1", "--teacher", str(teacher / "ckpt.pt"),
            "--patch-size", "4", name="bad")


@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_linear_probe_trains_only_the_head(tmp_path, fashion_mnist_dir, pool):
    _, backbone = run(tmp_path, fashion_mnist_dir, "--max-steps", "2", name="backbone")
    before = torch.load(backbone / "ckpt.pt", weights_only=True)["model"]
    summary, out = run(tmp_path, fashion_mnist_dir, "--max-steps", "3", "--probe", "cls", "--probe-pool", pool,
                       "--backbone", str(backbone / "ckpt.pt"), name="probe")
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert set(ckpt["model"]) == {"weight", "bias"} and summary["params"] == 32 * 10 + 10
    assert torch.equal(torch.load(backbone / "ckpt.pt", weights_only=True)["model"]["cls_token"], before["cls_token"])
    resumed = train.main(["--resume", str(out / "ckpt.pt"), "--max-steps", "4", "--no-progress"])
    assert resumed["step"] == 4
    run(tmp_path, fashion_mnist_dir, "--max-steps", "3", "--overwrite", name="backbone")  # trained on
    probe = str(out / "ckpt.pt")
    for argv in (["--resume", probe, "--max-steps", "5"], ["--eval-only", probe]):  # its head no longer fits
        with pytest.raises(SystemExit, match="--backbone .* is not the file this run was trained on"):
            train.main(argv)


# --- language model ---


TINY_LM = ["--max-steps", "3", "--batch-size", "4", "--block-size", "32", "--eval-iters", "2",
           "--eval-batch-size", "4", "--model-args", "dim=32,heads=2,ffn_dim=64,max_depth=3,min_depth_warmup=1"]


def test_language_model_loop_on_the_built_in_corpus(tmp_path, capsys):
    """No file, no network: the default corpus is generated by the repository (data.grammar_corpus)."""
    out = tmp_path / "lm"
    summary = train.main(["--arch", "alternet-tiny", "--out-dir", str(out), "--no-progress", *TINY_LM])
    assert set(summary["fixed_depth_bpb"]) == {"1", "2", "3"}
    assert 1.0 <= summary["mean_iterations"] <= 3.0 and summary["val_bpb"] > 0
    model, ckpt = checkpoint.load_model(out / "ckpt.pt")
    assert ckpt["arch"] == "alternet-tiny" and model.config.max_depth == 3
    assert ckpt["train_config"]["dataset"] == "grammar"
    printed = capsys.readouterr().out
    assert "recipe: text" in printed and "override: lr=0.001 (auto: width <= 256)" in printed


def test_alternet_reads_num_experts_and_depth_as_its_model_args_would(tmp_path):
    """--num-experts is AlterNet's E and --depth its D (max_depth): applied, as their override lines say."""
    tiny = [a.replace(",max_depth=3", "") for a in TINY_LM]
    train.main(["--arch", "alternet-tiny", "--out-dir", str(tmp_path), "--no-progress", "--num-experts", "2",
                "--depth", "3", *tiny])
    model, _ = checkpoint.load_model(tmp_path / "ckpt.pt")
    assert (model.config.num_experts, model.config.max_depth) == (2, 3)
    with pytest.raises(SystemExit, match=r"--eval-depths applies to ViT \(vit-\*\), Raptor .* not to alternet"):
        train.main(["--eval-only", str(tmp_path / "ckpt.pt"), "--eval-depths", "2", "--eval-iters", "1"])


def test_a_missing_tokenizer_names_the_arch_that_trains_with_it(fetching_tiktoken):
    with pytest.raises(SystemExit) as stopped:
        train.main(["--arch", "alternet-50m", "--max-steps", "1"])
    assert str(stopped.value).startswith("train.py: error: --tokenizer gpt2 (--arch alternet-50m trains with it): "
                                         "the gpt2 tokenizer needs tiktoken"), stopped.value


def test_language_model_on_tinyshakespeare(tmp_path, shakespeare_path):
    summary = train.main(["--arch", "alternet-tiny", "--data", str(shakespeare_path), "--out-dir",
                          str(tmp_path / "lm"), "--no-progress", *TINY_LM])
    assert summary["val_bpb"] > 0


# --- command-line errors: clear message, non-zero exit, nothing overwritten ---


def test_cli_errors(tmp_path, fashion_mnist_dir, capsys):
    def error(*argv):
        with pytest.raises(SystemExit) as e:
            train.main(["--data-dir", str(fashion_mnist_dir), "--out-dir", str(tmp_path / "x"), *argv])
        assert e.value.code not in (0, None)
        return str(e.value.code) + capsys.readouterr().err

    assert "did you mean revit-l" in error("--arch", "revit-xl") and "--list-archs" in error("--arch", "nope")
    assert "--lr must be in (0, 10]" in error("--lr", "-1")
    assert "--data-dir /no/such/dir does not exist" in error("--data-dir", "/no/such/dir")
    assert "only its own depth" in error("--arch", "vit-mini", "--eval-depths", "4,8", "--max-steps", "1")
    assert "unknown --dataset" in error("--dataset", "mnist")
    assert "imagenet needs the folder: --data" in error("--recipe", "imagenet", "--max-steps", "1",  # not Table 6
                                                        "--train-subset", "64", "--test-subset", "64")  # on F-MNIST
    assert "invalid int value" in error("--epochs", "ten")  # argparse: exit code 2
    assert not (tmp_path / "x").exists()


def test_resume_of_another_arch_is_refused(tmp_path, fashion_mnist_dir):
    _, out = run(tmp_path, fashion_mnist_dir, "--max-steps", "1")
    before = (out / "ckpt.pt").read_bytes()
    with pytest.raises(SystemExit, match="--arch cannot change on --resume .the checkpoint has 'revit-mini'"):
        train.main(["--resume", str(out / "ckpt.pt"), "--arch", "vit-mini"])
    with pytest.raises(SystemExit, match="--depth cannot change on --resume"):
        train.main(["--resume", str(out / "ckpt.pt"), "--depth", "8"])
    assert (out / "ckpt.pt").read_bytes() == before


def test_command_line_exit_code(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), "--arch", "nope"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "unknown --arch 'nope'; python train.py --list-archs" in result.stderr
    assert list(tmp_path.iterdir()) == []


# --- recipes: printed at start, every automatic choice included ---


def test_recipes_and_automatic_choices_are_printed(tmp_path, fashion_mnist_dir, capsys):
    run(tmp_path, fashion_mnist_dir, "--max-steps", "1", "--recipe", "imagenet", "--dataset", "fashion-mnist",
        "--batch-size", "32", name="a")  # the recipe on other data: by --dataset
    printed = capsys.readouterr().out
    assert "recipe: imagenet -- reViT paper (arXiv 2610.12448) Table 6" in printed and "epochs=300" in printed
    assert "override: batch_size=32 (--batch-size)" in printed
    assert "override: lr=0.004 (auto: Table 6, width < 768 (S))" in printed  # the recipe leaves lr to the width
    ckpt = torch.load(tmp_path / "a" / "ckpt.pt", weights_only=True)
    assert ckpt["train_config"]["lr"] == 0.004 and ckpt["train_config"]["three_augment"] is True
    train.main(["--data-dir", str(fashion_mnist_dir), "--out-dir", str(tmp_path / "b"), "--no-progress",
                "--train-subset", "64", "--test-subset", "32", "--batch-size", "32", "--max-steps", "1",
                "--model-args", TINY_VISION, "--depth", "2", "--arch", "revit-s"])
    printed = capsys.readouterr().out
    assert "recipe: quick start" in printed
    assert "override: patch_size=4 (auto: revit-s is a 224px preset with patch 16" in printed


def test_alternet_recipes_apply_over_the_text_recipe(monkeypatch, capsys):
    import alternet
    monkeypatch.setattr(alternet, "RECIPES", {"alternet-tiny": {"max_steps": 7, "beta2": 0.9}}, raising=False)
    cfg = train.resolve_config({"arch": "alternet-tiny", "batch_size": 8})
    printed = capsys.readouterr().out.splitlines()
    assert (cfg.max_steps, cfg.beta2, cfg.batch_size, cfg.weight_decay) == (7, 0.9, 8, 0.1)  # flag > preset > text
    assert printed[0].startswith("recipe: text") and printed[1] == \
        "recipe: alternet-tiny -- alternet.RECIPES, the AlterNet paper's settings max_steps=7 beta2=0.9"
    assert "override: batch_size=8 (--batch-size)" in printed


def test_cpu_run_prints_its_time_and_the_cpu_preset():
    note = train.cpu_time_note("revit-s", 7.2, 7020)
    assert "about 14.0 h" in note and "--arch revit-mini" in note
    assert train.cpu_time_note("alternet-350m", 60.0, 2000) .endswith("a GPU runs this one")
    assert "alternet-tiny" in train.cpu_time_note("alternet-350m", 60.0, 2000)
    assert train.cpu_time_note("revit-mini", 0.5, 3500) is None  # under an hour: nothing to say


# --- evaluation without training: the loop's own evaluation ---


def test_eval_only_matches_the_training_evaluation_and_leaves_the_file(tmp_path, fashion_mnist_dir):
    summary, out = run(tmp_path, fashion_mnist_dir, "--max-steps", "2", "--eval-depths", "2,6")
    before = (out / "ckpt.pt").read_bytes()
    result = train.main(["--eval-only", str(out / "ckpt.pt"), "--eval-depths", "2,6", "--data-dir",
                         str(fashion_mnist_dir)])
    assert (out / "ckpt.pt").read_bytes() == before and sorted(p.name for p in out.iterdir()) == \
        [".lock", "ckpt.pt", "metrics.jsonl"]
    assert result["test_acc"] == summary["test_acc"] and result["depths"] == summary["depths"]
    task_model, ckpt = checkpoint.load_model(out / "ckpt.pt")
    with pytest.raises(SystemExit, match="recurrent models need depth >= 2; got 1"):
        train.main(["--eval-only", str(out / "ckpt.pt"), "--eval-depths", "1,4", "--data-dir", str(fashion_mnist_dir)])
    torch.save({"weights": torch.ones(2)}, tmp_path / "other.pt")
    with pytest.raises(SystemExit, match=r"--eval-only .*other\.pt: not a checkpoint of this project \(missing arch"):
        train.main(["--eval-only", str(tmp_path / "other.pt")])
    with pytest.raises(SystemExit, match="--eval-only evaluates a checkpoint as trained; .* got --lr"):
        train.main(["--eval-only", str(out / "ckpt.pt"), "--lr", "0.1"])


# --- the CUDA-only choices, reached on a CPU through device_options ---


def test_device_options_decide_the_cuda_branches(monkeypatch):
    """--precision auto: bf16 on a GPU that computes in bf16, fp16 on one that only emulates it (a T4, whose
    is_bf16_supported() is True by emulation), fp32 on the CPU and MPS; a named precision on any device."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    cuda, cpu = cli.device_options("cuda"), cli.device_options("cpu")
    assert cuda == {"fused_adamw": True, "tf32": True, "ddp_backend": "nccl", "autocast_dtype": torch.bfloat16,
                    "precision": "bf16", "data_on_device": True}
    assert cpu == {"fused_adamw": False, "tf32": False, "ddp_backend": "gloo", "autocast_dtype": None,
                   "precision": "fp32", "data_on_device": False}
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert cli.device_options("cuda")["autocast_dtype"] == torch.float16  # a T4: fp16 and its scaler
    assert cli.device_options("cuda", "fp32")["autocast_dtype"] is None
    assert [cli.device_options("cpu", p)["autocast_dtype"] for p in ("bf16", "fp16")] == [torch.bfloat16,
                                                                                        torch.float16]
    assert cli.device_options("mps") == {"fused_adamw": True, "tf32": False, "ddp_backend": "gloo",
                                         "autocast_dtype": None, "precision": "fp32", "data_on_device": True}
    assert cli.pick_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            cli.pick_device("cuda")


def test_device_picker_refuses_what_the_machine_lacks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert cli.pick_device("auto") == torch.device("cuda") and cli.pick_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ValueError, match=r"^--device cuda:2: this machine has 2 CUDA device\(s\), cuda:0 to cuda:1$"):
        cli.pick_device("cuda:2")
    for name in ("meta", "xpu", "cpu:1"):
        with pytest.raises(ValueError, match=f"--device '{name}': not a device of this project; use auto, cpu, "):
            cli.pick_device(name)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device mps: Apple's MPS is not available on this machine"):
        cli.pick_device("mps")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert cli.pick_device("mps") == torch.device("mps")  # asked for by name; auto never picks it
    assert cli.pick_device("auto") == torch.device("cuda")


def test_a_failed_save_stops_every_rank(tmp_path):
    """Rank 0 cannot save (non-finite weights): rank 1 stops with the same line at once, instead of
    waiting at a barrier until the process group's timeout (20 s here; NCCL's default is 10 min)."""
    script = tmp_path / "save.py"
    script.write_text(f"""
import datetime, sys, types
from pathlib import Path
import torch, torch.distributed as dist
sys.path.insert(0, {str(ROOT)!r})
import revit, train
from lib import checkpoint
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
rank = dist.get_rank()
model = torch.nn.Linear(2, 2)
if rank == 0:
    torch.nn.init.constant_(model.weight, float("nan"))
cfg = train.TrainConfig(arch="vit-mini")
run = train.Run(cfg, torch.device("cpu"), model, model, None, None, torch.optim.SGD(model.parameters(), lr=0.1),
                torch.amp.GradScaler("cpu", enabled=False), {{"peak_lr": 0.1}},
                checkpoint.RunFolder(Path({str(tmp_path)!r})), rank, 2, step=5)
model.config = revit.ViTConfig()  # saved as the model's config (the save stops before writing)
try:
    train.save_checkpoint(run)
except SystemExit as e:
    print(f"rank {{rank}} stopped: {{e}}", flush=True)
dist.destroy_process_group()
""")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(script)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    for rank in (0, 1):
        assert f"rank {rank} stopped: save.py: error: weights became non-finite at step 5 (weight)" in result.stdout, \
            result.stdout[-2000:] + result.stderr[-2000:]
    assert not (tmp_path / "ckpt.pt").exists()


def test_cuda_choices_run_on_cpu(tmp_path, fashion_mnist_dir, monkeypatch):
    """Fused AdamW, the TF32 flags and bf16 autocast, as CUDA runs them, here on the CPU."""
    cuda = dict(cli.device_options("cuda", "bf16"), data_on_device=False)
    monkeypatch.setattr(build, "device_options", lambda device_type, precision="auto": cuda)
    seen, real_adamw = [], torch.optim.AdamW
    monkeypatch.setattr(torch.optim, "AdamW", lambda *a, **k: seen.append(k["fused"]) or real_adamw(*a, **k))
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        summary, _ = run(tmp_path, fashion_mnist_dir, "--max-steps", "2", "--eval-depths", "2")
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
    assert seen == [True] and 0 <= summary["test_acc"] <= 1


def test_precision_flag_and_auto_on_the_cpu(tmp_path, fashion_mnist_dir, capsys):
    """--precision takes auto, bf16, fp16 or fp32 (one line otherwise); auto is fp32 on a CPU: no autocast, no
    scaler state saved; bf16 named runs under CPU autocast. A checkpoint saved before --precision holds bf16
    (True: auto, False: fp32) and resumes."""
    with pytest.raises(SystemExit, match=r"--precision must be one of auto, bf16, fp16, fp32; got 'fp8'$"):
        train.main(["--precision", "fp8"])
    _, out = run(tmp_path, fashion_mnist_dir, "--max-steps", "2", "--stop-at-step", "1")
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert ckpt["train_config"]["precision"] == "auto" and ckpt["scaler"] == {}
    assert "fp16" not in capsys.readouterr().out
    _, bf16 = run(tmp_path, fashion_mnist_dir, "--max-steps", "1", "--precision", "bf16", name="bf16")
    assert step_losses(bf16)[1] != step_losses(out)[1]  # a named precision applies on the CPU: CPU autocast
    assert torch.load(bf16 / "ckpt.pt", weights_only=True)["scaler"] == {}  # bf16 needs no scaler
    old = {k: v for k, v in ckpt["train_config"].items() if k != "precision"}
    for flag, precision in ((False, "fp32"), (True, "auto")):
        saved = resume.saved_config(dict(ckpt, train_config=dict(old, bf16=flag)), "ckpt.pt", "--resume",
                                    train.TrainConfig)
        assert saved["precision"] == precision
    checkpoint.atomic_save(dict(ckpt, train_config=dict(old, bf16=True)), out / "ckpt.pt")  # before --precision
    assert train.main(["--resume", str(out / "ckpt.pt"), "--no-progress"])["step"] == 2
    assert torch.load(out / "ckpt.pt", weights_only=True)["train_config"]["precision"] == "auto"


def overflow_at(step: int, monkeypatch) -> None:
    """At optimizer step `step` (0-based) only, a finite loss whose gradients are NaN: what fp16 overflow does."""
    real_loss, calls = train.classification_loss, []

    def loss(logits, targets, kind):
        calls.append(1)
        value = real_loss(logits, targets, kind)
        return value + torch.sqrt(0 * logits.sum()) if len(calls) == step + 1 else value  # forward + 0, NaN grad

    monkeypatch.setattr(train, "classification_loss", loss)


def test_fp16_on_the_cpu_skips_an_overflow_and_resumes_its_scaler_bit_exactly(tmp_path, fashion_mnist_dir,
                                                                            monkeypatch, capsys):
    """--precision fp16 on a CPU (CPU autocast and torch.amp.GradScaler("cpu")): a step whose gradients
    overflow (the planted one at step 2, and any at the scaler's first scale, 2^16) is skipped, said in one
    line and one event, and the loss scale halves; the scaler's state is saved and restored, so a resumed
    run ends bit-for-bit where the uninterrupted one does."""
    fp16 = ["--precision", "fp16", "--max-steps", "4", "--eval-interval", "2"]
    overflow_at(1, monkeypatch)
    _, straight = run(tmp_path, fashion_mnist_dir, *fp16, name="straight")
    printed = capsys.readouterr().out
    events = [r for r in metrics(straight) if r.get("event") == "overflow"]
    skipped = [r["step"] for r in metrics(straight) if "loss" in r and r["grad_norm"] is None]
    assert 2 in skipped and [e["step"] for e in events] == skipped and printed.count("overflowed") == len(events)
    for i, event in enumerate(events):
        assert event["loss_scale"] == 2.0 ** (16 - i - 1)
        assert f"step {event['step']}: fp16 gradients overflowed; the step was skipped, loss scale now " \
               f"{event['loss_scale']:g}\n" in printed
    for stop in (2, 3):  # at 2 every step so far may have been skipped: AdamW has no state yet
        overflow_at(1, monkeypatch)
        _, killed = run(tmp_path, fashion_mnist_dir, *fp16, "--stop-at-step", str(stop), name=f"killed{stop}")
        saved, skips = torch.load(killed / "ckpt.pt", weights_only=True), sum(s <= stop for s in skipped)
        assert saved["scaler"]["scale"] == 2.0 ** (16 - skips)
        assert all(int(s["step"]) == stop - skips for s in saved["optimizer"]["state"].values())  # AdamW's
        train.main(["--resume", str(killed / "ckpt.pt"), "--no-progress"])
        a, b = (torch.load(out / "ckpt.pt", weights_only=True) for out in (straight, killed))
        assert a["scaler"] == b["scaler"] and a["scaler"]["_growth_tracker"] == 4 - skipped[-1]
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        assert step_losses(straight) == step_losses(killed)


def test_the_router_gates_and_merges_stay_fp32_under_fp16_autocast():
    """As under bf16 (App. A.5): revit.full_precision turns autocast off whatever its dtype."""
    model = revit.create_model("revit-mini", **dict(SMALL_VISION, num_experts=4)).eval()
    reference = model.gate_matrix(5)
    with torch.autocast("cpu", dtype=torch.float16):
        gates = model.gate_matrix(5)
        merged = model.block.mlp.merge(gates)
        logits = model(torch.randn(2, model.config.in_channels, 32, 32))
    assert gates.dtype == torch.float32 and all(w.dtype == torch.float32 for w in merged)
    torch.testing.assert_close(gates, reference, rtol=0, atol=0)
    assert logits.dtype == torch.float16  # the rest of the model did run in fp16


def test_a_training_step_reads_the_device_once(tmp_path, fashion_mnist_dir, monkeypatch):
    """train.py reads the device once per optimizer step (loss and gradient norm for the divergence guard,
    together); the loss parts stay on the device and are read only for the steps that are logged, in one
    read. (AdamW's own .item() reads its step counter, a CPU tensor: no wait for the GPU.)"""
    from torch.overrides import TorchFunctionMode
    reads, real_step = [], train.train_step

    class CountReads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            caller = sys._getframe(1).f_code.co_filename
            if func in (torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.__bool__) \
                    and Path(caller) == ROOT / "train.py":
                reads.append(func.__name__)
            return func(*args, **(kwargs or {}))

    def counted(run, inputs, targets):
        with CountReads():
            return real_step(run, inputs, targets)

    monkeypatch.setattr(train, "train_step", counted)
    _, out = run(tmp_path, fashion_mnist_dir, "--max-steps", "4", "--log-interval", "2")
    assert reads == ["tolist"] * 4  # the guard's, in train_step
    logged = [r for r in metrics(out) if "loss" in r]
    assert [r["step"] for r in logged] == [2, 4] and all(isinstance(r[k], float) for r in logged
                                                         for k in ("task", "balance", "z_loss", "diversity"))


def test_ddp_wraps_the_model_before_compile(monkeypatch):
    """compile(DDP(model)), the order PyTorch documents; the checkpoint still stores the plain module."""
    import torch.distributed as dist
    from torch._dynamo.eval_frame import OptimizedModule
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model = revit.create_model("revit-mini", **SMALL_VISION)
        forward = build.wrap(model, train.TrainConfig(compile=True), torch.device("cpu"), world=2)
        assert isinstance(forward, OptimizedModule)
        assert isinstance(forward._orig_mod, torch.nn.parallel.DistributedDataParallel)
        assert forward.no_sync is not None and checkpoint.unwrap(forward) is model
    finally:
        dist.destroy_process_group()


def test_data_on_the_device_is_gathered_with_an_index_there():
    """A data set on the GPU: the epoch's order goes to the device once, not an index per batch."""
    from lib import data
    from device_check import FAKE, OnFakeDevice
    seen = []
    with OnFakeDevice():
        images = data.TensorImages(torch.arange(40.0).view(10, 1, 2, 2).to(FAKE), torch.arange(10).to(FAKE))
        real_batches = images.batches
        images.batches = lambda indices: seen.extend(i.device for i in indices) or real_batches(indices)
        step, x, labels = next(data.image_batches(images, 4, seed=0, repeats=1, rank=0, world=1, start_step=0))
        assert (step, x.device, labels.device) == (0, FAKE, FAKE)
        assert torch.equal(x.cpu()[:, 0, 0, 0] / 4, labels.cpu().float())  # image i holds 4 i: the right rows
    assert seen and set(seen) == {FAKE}


@pytest.mark.skip(reason="nccl needs CUDA GPUs; the backend choice is checked by "
                         "test_device_options_decide_the_cuda_branches, DDP itself by the gloo test above")
def test_nccl_process_group():
    pass


def test_compile_runs_on_cpu(tmp_path, fashion_mnist_dir, monkeypatch):
    """--compile works on any device. The inductor backend takes minutes to compile on 2 cores, so the
    test traces with torch.compile's aot_eager backend: the same graph capture, forward and backward."""
    import functools
    calls = []
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **k: calls.append(model) or
                        functools.partial(real_compile, backend="aot_eager")(model, **k))
    summary, out = run(tmp_path, fashion_mnist_dir, "--max-steps", "2", "--compile")
    assert len(calls) == 1 and summary["step"] == 2
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert not any(k.startswith("_orig_mod") for k in ckpt["model"])  # the plain module is saved


# --- the tools' main paths with the model on a device: device_check's CPU stand-in for a GPU ---


def test_depth_evaluation_with_the_model_on_a_device(tmp_path, fashion_mnist_dir, monkeypatch):
    """--eval-only's path (the depth table of depths.py too): same numbers as on the CPU, and no
    tensor built on the CPU meets the model's (device_check raises where a GPU would)."""
    from device_check import FAKE, OnFakeDevice
    _, out = run(tmp_path, fashion_mnist_dir, "--max-steps", "1", "--eval-depths", "2")
    flags = {"eval_depths": "2,6", "data_dir": str(fashion_mnist_dir), "test_subset": 64}
    _, model, task = train.evaluation_setup(out / "ckpt.pt", flags)
    on_cpu = train.evaluate(model, task, [None, 2, 6])
    monkeypatch.setattr(resume, "pick_device", lambda name: FAKE)
    with OnFakeDevice():
        _, model, task = train.evaluation_setup(out / "ckpt.pt", flags)
        assert next(model.parameters()).device == FAKE
        on_device = train.evaluate(model, task, [None, 2, 6])
    assert on_device == on_cpu


def test_language_evaluation_with_the_model_on_a_device(tmp_path, monkeypatch):
    """The language task's evaluation (halted, every fixed depth, causal, the sample) on a device."""
    from device_check import FAKE, OnFakeDevice
    out = tmp_path / "lm"
    train.main(["--arch", "alternet-tiny", "--out-dir", str(out), "--no-progress", "--device", "cpu",
                *TINY_LM[:1], "1", *TINY_LM[2:]])
    flags = {"eval_iters": 1}
    _, model, task = train.evaluation_setup(out / "ckpt.pt", flags)
    on_cpu = train.evaluate(model, task, [None])
    monkeypatch.setattr(resume, "pick_device", lambda name: FAKE)
    with OnFakeDevice():
        _, model, task = train.evaluation_setup(out / "ckpt.pt", flags)
        on_device = train.evaluate(model, task, [None])
    assert on_device == on_cpu


def test_fold_and_its_check_with_the_model_on_a_device():
    """export.py's fold (revit.fold) and its verification, with the model on a device."""
    from tools import export
    from device_check import FAKE, OnFakeDevice
    from helpers import randomise
    with OnFakeDevice():
        model = randomise(revit.create_model("revit-mini", **SMALL_VISION, depth=4, num_experts=3)).eval().to(FAKE)
        vit = export.plain_vit(model, 6)
        assert next(vit.parameters()).device == FAKE
        assert export.check_fold(model, vit, 6) < 1e-4


# --- on a CUDA GPU: opt-in (REVIT_GPU_TESTS=1, see conftest.py) ---


@pytest.mark.gpu
def test_training_on_the_gpu(tmp_path, fashion_mnist_dir):
    """bf16 autocast, fused AdamW, TF32, the data set on the device, torch.compile (inductor)."""
    summary, out = run(tmp_path, fashion_mnist_dir, "--max-steps", "3", "--device", "cuda", "--compile",
                       "--depth-drop", "0.3", "--three-augment", "--eval-depths", "2")
    assert summary["step"] == 3 and 0 <= summary["test_acc"] <= 1
    assert all(torch.isfinite(t).all() for t in torch.load(out / "ckpt.pt", weights_only=True)["model"].values())


@pytest.mark.gpu
def test_fp16_training_on_the_gpu(tmp_path, fashion_mnist_dir, capsys):
    """--precision fp16, auto's choice on a GPU without bf16 (a T4, a V100): CUDA fp16 autocast and fused
    AdamW with the gradient scaler; its state is saved, each skipped step said, the weights stay finite."""
    summary, out = run(tmp_path, fashion_mnist_dir, "--max-steps", "6", "--device", "cuda", "--precision", "fp16",
                       "--eval-depths", "2")
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert summary["step"] == 6 and 0 <= summary["test_acc"] <= 1 and 0 < ckpt["scaler"]["scale"] <= 2.0 ** 16
    skipped = [r["step"] for r in metrics(out) if r.get("event") == "overflow"]
    assert capsys.readouterr().out.count("fp16 gradients overflowed") == len(skipped) < 6
    assert all(torch.isfinite(t).all() for t in ckpt["model"].values())


@pytest.mark.gpu
def test_a_cpu_run_resumes_on_the_gpu_and_back(tmp_path, fashion_mnist_dir, capsys):
    """The augmentation generator's state is 5,056 bytes on the CPU and 16 on CUDA: where a saved state
    cannot apply, it is reseeded and said so."""
    _, out = run(tmp_path, fashion_mnist_dir, "--max-steps", "6", "--three-augment", "--stop-at-step", "2")
    step4 = train.main(["--resume", str(out / "ckpt.pt"), "--device", "cuda", "--stop-at-step", "4",
                        "--no-progress"])
    assert step4["step"] == 4 and "override: " in capsys.readouterr().out
    done = train.main(["--resume", str(out / "ckpt.pt"), "--device", "cpu", "--no-progress"])
    assert done["step"] == 6 and 0 <= done["test_acc"] <= 1


def test_the_schedule_tells_cosine_from_linear_decay_and_warmup_from_its_off_by_ones():
    """Warmup-cosine where its usual wrong variants differ (a check at the ends and the midpoint alone passes a
    linear decay, which agrees there). A quarter and three quarters into the decay the cosine is (2 ± √2) / 4 of
    the way from min_lr to the peak, a linear decay 3/4 and 1/4. Inside the warmup the ramp is linear from
    warmup_lr at step 0 to the peak at step `warmup` (nanoGPT's (step + 1) / (warmup + 1) is a step off).
    min_lr and warmup_lr are large enough that leaving either out moves every value."""
    sched = dict(warmup_steps=4, total_steps=12, warmup_lr=0.1, min_lr=0.2, peak_lr=1.0)
    lr = [train.lr_at(step, 1.0, sched) for step in range(21)]
    assert lr[:5] == pytest.approx([0.1, 0.325, 0.55, 0.775, 1.0])  # 0.1 + 0.9 step / 4
    assert lr[6] == pytest.approx(0.2 + 0.8 * (2 + 2 ** 0.5) / 4)  # 2 of the 8 decay steps
    assert lr[8] == pytest.approx(0.6)
    assert lr[10] == pytest.approx(0.2 + 0.8 * (2 - 2 ** 0.5) / 4)
    assert lr[12:] == pytest.approx([0.2] * 9)  # min_lr at the end and after it, not back up the cosine


def test_the_schedule_scales_the_peak_linearly_with_the_batch_and_counts_warmup_in_steps():
    """DeiT's linear rule, peak = lr x batch / lr_batch, at a batch other than lr_batch (where every rule
    agrees): 4e-3 x 64 / 256 = 1e-3 (the square-root rule gives 2e-3). --warmup-epochs 0.5 of 7 steps an epoch
    is round(3.5) = 4 steps; min_lr and warmup_lr above the peak are lowered to it."""
    cfg = train.TrainConfig(dataset="fashion-mnist", lr=4e-3, lr_batch=256, batch_size=64, epochs=3,
                            warmup_epochs=0.5, warmup_lr=1e-6, min_lr=2e-3)
    sched = train.schedule(cfg, None, steps_per_epoch=7)
    assert sched["peak_lr"] == pytest.approx(1e-3)
    assert (sched["warmup_steps"], sched["total_steps"]) == (4, 21)
    assert (sched["warmup_lr"], sched["min_lr"]) == pytest.approx((1e-6, 1e-3))


def test_the_evaluation_averages_over_images_not_over_batches():
    """Accuracy and loss are sums over the test images divided by their count: with a last batch smaller
    than the others (5 images in batches of 2, 2, 1) the mean of the batches' means differs (the test
    checks it does), as it would on every test set whose size is not a multiple of --eval-batch-size."""
    from helpers import randomise
    from lib import data, tasks
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (5, 1, 8, 8), dtype=torch.uint8, generator=g)
    model = randomise(revit.create_model("vit-mini", image_size=8, patch_size=4, in_channels=1, num_classes=3,
                                         dim=16, heads=2, ffn_dim=24, depth=2)).eval()  # logits far apart
    test = data.ImageData(None, data.TensorImages(images, torch.zeros(5, dtype=torch.long)), 3, 1, 8,
                          [0.5], [0.25])
    x = (images.float() / 255 - 0.5) / 0.25
    with torch.no_grad():
        logits = model(x)
    labels = logits.argmax(-1)
    labels[3:] = (labels[3:] + 1) % 3  # right on the first three images, wrong on the last two
    test.test.labels = labels
    task = tasks.ClassificationTask(train.TrainConfig(eval_batch_size=2), test, torch.device("cpu"),
                                    data.Augment(test, torch.device("cpu"), 0), contextlib.nullcontext)
    scored = task.evaluate(model, [None], 0, 1)[None]
    losses = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    assert scored["acc"] == pytest.approx(3 / 5)  # the batches' means: (1 + 1/2 + 0) / 3 = 1/2
    assert scored["loss"] == pytest.approx(losses.mean().item(), rel=1e-5)
    by_batch = torch.stack([part.mean() for part in losses.split(2)]).mean().item()
    assert abs(by_batch - losses.mean().item()) > 1e-3


def test_bits_per_byte_are_nats_per_token_times_tokens_per_byte_over_ln_2():
    """bpb = CE (nats a token) x tokens a byte / ln 2, checked at a quarter token a byte (about GPT-2's BPE):
    at the byte tokenizer's 1 token a byte, multiplying by it and dividing by it agree."""
    import math
    from lib import language
    task = language.LanguageTask(None, None, 0.25, 4, torch.device("cpu"), contextlib.nullcontext)
    ln2 = math.log(2)
    # CE sums at [halted, depth 1, depth 2], iterations, tokens, sequences; causal CE, iterations, tokens;
    # the full-window CE
    stats = torch.tensor([20 * ln2, 40 * ln2, 10 * ln2, 3, 10, 2, 6 * ln2, 4.5, 3, 9 * ln2]).double()
    results = task.results(stats, 2)
    bpb = [float(results[key]["bpb"]) for key in (None, 1, 2)]
    assert bpb == pytest.approx([0.5, 1.0, 0.25])  # 2, 4 and 1 bits a token, 4 bytes a token
    assert float(results[None]["causal_bpb"]) == pytest.approx(0.5)
    assert float(results[None]["iterations"]) == pytest.approx(1.5)


class MeanSquaredError:
    """A task for train_step alone: the mean squared error of a linear map (a mean, as the cross-entropy)."""

    def loss(self, forward, x, y):
        return ((forward(x) - y) ** 2).mean(), {}


def test_gradient_accumulation_takes_the_step_and_logs_the_loss_of_the_whole_batch():
    """--grad-accum A: A micro-batches, each loss divided by A, give the step and the logged loss of the whole
    batch's mean loss. At A = 2, through SGD, whose update is -lr times the gradient (AdamW's update hardly
    changes when the gradient doubles: a missing 1 / A would not show through it)."""
    import types
    torch.manual_seed(0)
    model, x, y = torch.nn.Linear(4, 3), torch.randn(8, 4), torch.randn(8, 3)
    before = [p.detach().clone() for p in model.parameters()]
    whole = ((model(x) - y) ** 2).mean()
    grads = torch.autograd.grad(whole, list(model.parameters()))
    cfg = types.SimpleNamespace(grad_accum=2, grad_clip=0.0, probe=None)
    sched = dict(warmup_steps=0, total_steps=1, warmup_lr=0.1, min_lr=0.1, peak_lr=0.1)  # lr 0.1 at step 0
    run = train.Run(cfg, torch.device("cpu"), model, model, MeanSquaredError(), None,
                    torch.optim.SGD(model.parameters(), lr=0.1), torch.amp.GradScaler("cpu", enabled=False), sched,
                    None)
    record = train.train_step(run, x, y)
    assert record["loss"] == pytest.approx(whole.item(), rel=1e-6)
    for p, p0, g in zip(model.parameters(), before, grads):
        torch.testing.assert_close(p.detach(), p0 - 0.1 * g, rtol=1e-5, atol=1e-6)


# --- A resumed run steps with the optimizer implementation of the device it runs on, whatever device saved
# the checkpoint: torch's Optimizer.load_state_dict restores each saved group's `fused` flag with its
# hyperparameters, so a CPU checkpoint (fused=None) resumed on a GPU silently dropped fused AdamW, and a GPU
# checkpoint resumed on a CPU took CPU fused AdamW instead of the CPU runs' default (other numerics).
# Reproduced on the CPU: the GPU's choice is CPU fused AdamW (torch has one), through device_options.

REAL_OPTIONS = cli.device_options


@pytest.fixture
def fused_seen():
    """The `fused` flag of every optimizer step taken while the test runs."""
    seen = []
    handle = register_optimizer_step_pre_hook(
        lambda optimizer, args, kwargs: seen.append(optimizer.param_groups[0]["fused"]))
    yield seen
    handle.remove()


def fused_device(monkeypatch):
    """This CPU as a device whose choice is fused AdamW (CUDA's, in device_options)."""
    monkeypatch.setattr(build, "device_options", lambda kind, precision="auto": {
        **REAL_OPTIONS(kind, precision), "fused_adamw": True})


@pytest.mark.parametrize("saved_on_fused_device", [False, True])
def test_resume_applies_this_device_s_fused_choice(tmp_path, fashion_mnist_dir, monkeypatch, fused_seen,
                                                   saved_on_fused_device):
    with monkeypatch.context() as saving:
        if saved_on_fused_device:
            fused_device(saving)
        _, out = run(tmp_path, fashion_mnist_dir, "--max-steps", "4", "--stop-at-step", "2")
    saved = torch.load(out / "ckpt.pt", weights_only=False)["optimizer"]["param_groups"]
    assert {g["fused"] for g in saved} == ({True} if saved_on_fused_device else {None})
    if not saved_on_fused_device:
        fused_device(monkeypatch)  # resumed where fused AdamW is the choice
    summary = train.main(["--resume", str(out / "ckpt.pt"), "--no-progress"])
    assert summary["step"] == 4
    resumed = fused_seen[2:]
    assert len(resumed) == 2 and set(resumed) == ({None} if saved_on_fused_device else {True}), fused_seen


# --- a run records what made it, shows its loss, and says what a resume continues ---


def test_the_start_event_names_the_commit_torch_device_and_command(piped_run):
    out, _ = piped_run
    start = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert start["event"] == "start"
    assert start["commit"] == (cli.git_commit(str(ROOT)) or "unknown")
    assert start["torch"] == torch.__version__ and start["device"] == "cpu"
    assert start["command"].startswith(f"python {ROOT / 'train.py'} --arch revit-mini --device cpu")
    assert f"--out-dir {out}" in start["command"]


def test_piped_output_shows_the_loss_on_lines_of_their_own(piped_run):
    """A log (stdout and stderr piped into one file) holds lines only: tqdm's bar, redrawn with carriage
    returns, is for a terminal."""
    _, output = piped_run
    assert "\r" not in output and "it/s" not in output
    shown = output.splitlines()
    assert [line.split(":")[0] for line in shown if ": loss " in line] == [f"step {s}" for s in (2, 4, 6, 8)]
    assert sum(line.startswith("step 4: val_acc") for line in shown) == 1
    assert shown[-1].startswith("done: revit-mini")


def test_no_progress_prints_the_loss_every_log_interval(tmp_path, fashion_mnist_dir, capsys):
    train.main([*RECORDED_RUN, "--data-dir", str(fashion_mnist_dir), "--out-dir", str(tmp_path / "run"),
                "--no-progress"])
    losses = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in losses if "loss" in r}
    printed = [line for line in capsys.readouterr().out.splitlines() if ": loss " in line]
    expected = [f"step {s}: loss {losses[s]:.4f}" for s in (2, 4, 6, 8)]
    assert [line.split(",")[0] for line in printed] == expected
    assert all(line.endswith(" images/s") for line in printed)


def test_a_complete_run_resumed_with_nothing_new_says_so_and_trains_nothing(tmp_path, fashion_mnist_dir,
                                                                             capsys):
    out = tmp_path / "run"
    train.main([*RECORDED_RUN, "--data-dir", str(fashion_mnist_dir), "--out-dir", str(out), "--no-progress"])
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
    out = tmp_path / "run"
    train.main([*RECORDED_RUN, "--data-dir", str(fashion_mnist_dir), "--out-dir", str(out), "--no-progress"])
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
