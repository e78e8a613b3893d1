"""train.py: the loop end-to-end on real (subsets of) Fashion-MNIST and tinyshakespeare, exact resume,
DDP = single process, atomic checkpoints, NaN handling, distillation, probes and CLI errors.

Models are tiny (width 32, 16 tokens) so the whole file runs in well under three minutes on 2 cores.
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import revit
import train

ROOT = Path(__file__).resolve().parent.parent
TINY_VISION = "dim=32,heads=2,ffn_dim=64"


def run(tmp_path, fashion_mnist_dir, *args, name="run", arch="revit-mini"):
    """train.main on a 512-image subset with a tiny model; returns (summary, out_dir)."""
    out = tmp_path / name
    argv = ["--arch", arch, "--data-dir", str(fashion_mnist_dir), "--out-dir", str(out), "--no-progress",
            "--train-subset", "512", "--test-subset", "256", "--batch-size", "32", "--patch-size", "7",
            "--depth", "4", "--model-args", TINY_VISION, "--log-interval", "1", *args]
    return train.main(argv), out


def metrics(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def step_losses(out_dir):
    return {r["step"]: r["loss"] for r in metrics(out_dir) if "loss" in r}


# --- data and augmentation ---


def test_fashion_mnist_reader(fashion_mnist_dir):
    (xtr, ytr), (xte, yte), classes = train.load_fashion_mnist(Path(fashion_mnist_dir))
    assert xtr.shape == (60000, 1, 28, 28) and xte.shape == (10000, 1, 28, 28) and xtr.dtype == torch.uint8
    assert classes == 10 and set(ytr.unique().tolist()) == set(range(10)) and len(yte) == 10000
    assert torch.bincount(ytr).tolist() == [6000] * 10  # the official split is balanced


def test_cifar_pickle_reader(tmp_path):
    import pickle
    images = torch.randint(0, 256, (2, 3 * 32 * 32), dtype=torch.uint8)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(tmp_path / name, "wb") as f:
            pickle.dump({b"data": images.tolist(), b"labels": [3, 7]}, f)  # the real files hold numpy arrays
    (xtr, ytr), (xte, yte), classes = train.load_cifar(tmp_path, 10)
    assert xtr.shape == (10, 3, 32, 32) and ytr.tolist() == [3, 7] * 5 and classes == 10
    assert torch.equal(xte[1].flatten(), images[1])  # row-major channel planes, as the archive stores them


def test_text_folder_bytes_and_split(tmp_path):
    (tmp_path / "a.txt").write_text("héllo " * 50, encoding="utf-8")
    (tmp_path / "b.txt").write_text("world " * 50, encoding="utf-8")
    cfg = train.TrainConfig(dataset="text", data=str(tmp_path))
    train_tokens, val_tokens, tokens_per_byte, vocab = train.load_text(cfg, is_main=True)
    assert vocab == 256 and tokens_per_byte == 1.0 and int(train_tokens.max()) < 256
    assert len(train_tokens) == int(0.9 * (len(train_tokens) + len(val_tokens)))
    assert bytes(train_tokens[:2].tolist()) == "h\u00e9".encode()[:2]


def test_missing_data_explains_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setattr(train, "data_roots", lambda cfg: [tmp_path])
    cfg = train.TrainConfig(dataset="fashion-mnist", data_dir=str(tmp_path), download=False)
    with pytest.raises(SystemExit, match="apt-get install dataset-fashion-mnist"):
        train.find_builtin(cfg, "fashion-mnist", is_main=True)


def test_augment_shapes_and_soft_targets(fashion_mnist_dir):
    (xtr, ytr), _, _ = train.load_fashion_mnist(Path(fashion_mnist_dir))
    cfg = train.TrainConfig(label_smoothing=0.1)  # Table 6 augmentation: crop, flip, 3-Augment, jitter, mix
    data = train.ImageData(None, None, 10, 1, 28, [0.286], [0.353])
    augment = train.Augment(cfg, data, torch.device("cpu"), seed=0)
    for _ in range(4):  # both mixup and cutmix branches
        x, targets = augment(xtr[:16], ytr[:16])
        assert x.shape == (16, 1, 28, 28) and torch.isfinite(x).all()
        assert targets.shape == (16, 10) and torch.allclose(targets.sum(1), torch.ones(16))
    rgb = train.Augment(cfg, train.ImageData(None, None, 100, 3, 32, [0.5] * 3, [0.25] * 3), torch.device("cpu"), 1)
    x, targets = rgb(torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8), torch.arange(8))
    assert x.shape == (8, 3, 32, 32) and torch.isfinite(x).all() and targets.shape == (8, 100)
    plain = train.Augment(train.TrainConfig(mixup=0, cutmix=0, random_crop=False, three_augment=False,
                                            color_jitter=0), data, torch.device("cpu"), seed=0)
    x, targets = plain(xtr[:4], ytr[:4])
    assert torch.allclose(x, (xtr[:4].float() / 255 - 0.286) / 0.353)
    assert torch.equal(targets, torch.nn.functional.one_hot(ytr[:4], 10).float())


def test_data_order_is_a_function_of_seed_and_epoch():
    a, b = train.epoch_order(100, 0, 3, 1), train.epoch_order(100, 0, 3, 1)
    assert torch.equal(a, b) and not torch.equal(a, train.epoch_order(100, 0, 4, 1))
    assert sorted(a.tolist()) == list(range(100))
    repeated = train.epoch_order(99, 0, 0, 3)
    assert len(repeated) == 99 and torch.equal(repeated[0::3], repeated[1::3])


# --- the loop ---


@pytest.mark.parametrize("arch", ["vit-mini", "raptor-mini", "revit-mini"])
def test_loop_runs_end_to_end(tmp_path, fashion_mnist_dir, arch):
    extra = [] if arch == "vit-mini" else ["--eval-depths", "2,6"]
    summary, out = run(tmp_path, fashion_mnist_dir, "--max-steps", "4", *extra, arch=arch)
    assert 0.0 <= summary["test_acc"] <= 1.0 and summary["params"] > 0 and summary["step"] == 4
    if arch != "vit-mini":
        assert set(summary["depths"]) == {"4", "2", "6"}
    model, ckpt = train.load_model(out / "ckpt.pt")  # the CONTRACT helper: rebuild + load
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
    decay, no_decay = train.param_groups(model, 0.05)
    names = {id(p): n for n, p in model.named_parameters()}
    excluded = {names[id(p)] for p in no_decay["params"]}
    assert {"cls_token", "pos_embed", "block.mlp.router.2.weight"} <= excluded
    assert all(p.ndim >= 2 for p in decay["params"]) and no_decay["weight_decay"] == 0.0


def test_warmup_cosine_schedule():
    sched = dict(warmup_steps=10, total_steps=110, warmup_lr=1e-6, min_lr=1e-5)
    assert train.lr_at(0, 1e-3, sched) == pytest.approx(1e-6)
    assert train.lr_at(10, 1e-3, sched) == pytest.approx(1e-3)
    assert train.lr_at(60, 1e-3, sched) == pytest.approx((1e-3 + 1e-5) / 2)
    assert train.lr_at(110, 1e-3, sched) == pytest.approx(1e-5)


def test_resume_matches_uninterrupted_run(tmp_path, fashion_mnist_dir):
    """Every source of randomness on: elastic depth, drop-path, crop/flip, 3-Augment, mixup/cutmix."""
    recipe = ["--max-steps", "6", "--depth-drop", "0.3", "--drop-path", "0.1", "--mixup", "0.8",
              "--cutmix", "1.0", "--three-augment", "--color-jitter", "0.3", "--eval-interval", "2"]
    straight, out_a = run(tmp_path, fashion_mnist_dir, *recipe, name="straight")
    _, out_b = run(tmp_path, fashion_mnist_dir, *recipe, "--stop-at-step", "3", name="killed")
    assert torch.load(out_b / "ckpt.pt", weights_only=True)["step"] == 3
    resumed = train.main(["--resume", str(out_b / "ckpt.pt"), "--no-progress"])
    a, b = step_losses(out_a), step_losses(out_b)
    assert [a[s] for s in range(1, 7)] == [b[s] for s in range(1, 7)]  # bit-for-bit
    assert straight["test_acc"] == resumed["test_acc"]
    state_a = torch.load(out_a / "ckpt.pt", weights_only=True)
    state_b = torch.load(out_b / "ckpt.pt", weights_only=True)
    for name, tensor in state_a["model"].items():
        assert torch.equal(tensor, state_b["model"][name]), name


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_two_processes_match_single_process(tmp_path, fashion_mnist_dir):
    """torchrun, gloo, 2 ranks x 16 images == 1 process x 32 images (same global batch)."""
    args = ["--arch", "revit-mini", "--data-dir", str(fashion_mnist_dir), "--no-progress",
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


# --- checkpoints and failures ---


def test_atomic_save_survives_a_crash(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    train.atomic_save({"step": 1, "w": torch.ones(3)}, path)
    real_save = torch.save

    def crash(obj, f, *args, **kwargs):  # write half a file, then die
        real_save(obj, f, *args, **kwargs)
        with open(f, "r+b") as handle:
            handle.truncate(20)
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError):
        train.atomic_save({"step": 2, "w": torch.zeros(3)}, path)
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
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, fashion_mnist_dir, "--max-steps", "6", "--save-interval", "1")
    monkeypatch.setattr(torch, "save", real_save)
    model, ckpt = train.load_model(tmp_path / "run" / "ckpt.pt")
    assert ckpt["step"] == 2


def test_nan_loss_stops_and_keeps_the_good_checkpoint(tmp_path, fashion_mnist_dir, monkeypatch):
    real_loss = train.ClassificationTask.loss

    def loss(self, model, images, labels):
        value, parts = real_loss(self, model, images, labels)
        return (value * float("nan") if len(step_losses(tmp_path / "run")) >= 2 else value), parts

    monkeypatch.setattr(train.ClassificationTask, "loss", loss)
    with pytest.raises(SystemExit, match=r"non-finite loss nan at step 2 .*ckpt\.pt \(step 2\)"):
        run(tmp_path, fashion_mnist_dir, "--max-steps", "6", "--save-interval", "1")
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


# --- language model ---


def test_language_model_loop(tmp_path, shakespeare_path):
    out = tmp_path / "lm"
    summary = train.main(["--arch", "alternet-tiny", "--data", str(shakespeare_path), "--out-dir", str(out),
                          "--no-progress", "--max-steps", "3", "--batch-size", "4", "--block-size", "32",
                          "--eval-iters", "2", "--eval-batch-size", "4",
                          "--model-args", "dim=32,heads=2,ffn_dim=64,max_depth=3,min_depth_warmup=1"])
    assert set(summary["fixed_depth_bpb"]) == {"1", "2", "3"}
    assert 1.0 <= summary["mean_iterations"] <= 3.0 and summary["val_bpb"] > 0
    model, ckpt = train.load_model(out / "ckpt.pt")
    assert ckpt["arch"] == "alternet-tiny" and model.config.max_depth == 3


# --- command-line errors: clear message, non-zero exit, nothing overwritten ---


def test_cli_errors(tmp_path, fashion_mnist_dir, capsys):
    def error(*argv):
        with pytest.raises(SystemExit) as e:
            train.main(["--data-dir", str(fashion_mnist_dir), "--out-dir", str(tmp_path / "x"), *argv])
        assert e.value.code not in (0, None)
        return str(e.value.code) + capsys.readouterr().err

    assert "valid names:" in error("--arch revit-xl".split()[0], "revit-xl") and "revit-mini" in error("--arch", "nope")
    assert "--lr must be > 0" in error("--lr", "-1")
    assert "--data-dir /no/such/dir does not exist" in error("--data-dir", "/no/such/dir")
    assert "only its own depth" in error("--arch", "vit-mini", "--eval-depths", "4,8", "--max-steps", "1")
    assert "unknown --dataset" in error("--dataset", "mnist")
    assert "invalid int value" in error("--epochs", "ten")  # argparse: exit code 2
    assert not (tmp_path / "x").exists()


def test_resume_of_another_arch_is_refused(tmp_path, fashion_mnist_dir):
    _, out = run(tmp_path, fashion_mnist_dir, "--max-steps", "1")
    before = (out / "ckpt.pt").read_bytes()
    with pytest.raises(SystemExit, match="checkpoint of revit-mini, not vit-mini"):
        train.main(["--resume", str(out / "ckpt.pt"), "--arch", "vit-mini"])
    with pytest.raises(SystemExit, match="--depth cannot change on --resume"):
        train.main(["--resume", str(out / "ckpt.pt"), "--depth", "8"])
    assert (out / "ckpt.pt").read_bytes() == before


def test_command_line_exit_code(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), "--arch", "nope"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "unknown --arch 'nope'; valid names:" in result.stderr
    assert list(tmp_path.iterdir()) == []
