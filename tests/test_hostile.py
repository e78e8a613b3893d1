"""Hostile inputs, one table per entry point (train.py, analyze.py, probes.py; export.py's is in
test_export.py, the data readers' in test_data.py): each must end in the one line it names, run no
code from a file, leave every file of every run as it was, and never score a non-finite model."""
import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import alternet
import revit
from tools import analyze
from tools import probes
import train

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--no-progress", "--train-subset", "256", "--test-subset", "64", "--batch-size", "32", "--patch-size", "7",
        "--depth", "2", "--model-args", "dim=32,heads=2,ffn_dim=64", "--log-interval", "1"]


def one_line(main, argv, prog) -> str:
    """The exit message of main(argv): `prog: error: ...`, one line, never torch's weights_only advice."""
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    message = str(e.value.code)
    assert message.startswith(f"{prog}: error: ") and "\n" not in message, message
    assert "weights_only" not in message and "Traceback" not in message
    return message


def contents(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


class WritesMarker:
    """What a hostile pickle holds: unpickling it would create `path`."""
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, fashion_mnist_dir):
    """Run A (4 steps; snapshot.pt is a copy of its step-2 checkpoint) and run B (another run, 1 step)."""
    base = tmp_path_factory.mktemp("runs")
    common = ["--data-dir", str(fashion_mnist_dir), *TINY]
    train.main(["--out-dir", str(base / "A"), *common, "--max-steps", "4", "--stop-at-step", "2"])
    shutil.copy(base / "A" / "ckpt.pt", base / "A" / "snapshot.pt")
    train.main(["--resume", str(base / "A" / "ckpt.pt"), "--no-progress"])
    train.main(["--out-dir", str(base / "B"), *common, "--max-steps", "1", "--seed", "1"])
    return base


def edited(runs, tmp_path, name, edit) -> Path:
    """A copy of run A's checkpoint with one part edited by `edit(ckpt)`."""
    ckpt = torch.load(runs / "A" / "ckpt.pt", weights_only=True)
    edit(ckpt)
    torch.save(ckpt, tmp_path / name)
    return tmp_path / name


def set_nan(ckpt):
    next(iter(ckpt["model"].values())).view(-1)[0] = float("nan")


EDITS = {  # name: (edit of run A's checkpoint, the line --resume / --eval-only must print)
    "step_negative": (lambda c: c.update(step=-5), "its step must be an integer >= 0; got -5"),
    "step_text": (lambda c: c.update(step="five"), "its step must be an integer >= 0; got 'five'"),
    "model_string": (lambda c: c.update(model="x"), "its model must be a dict of named tensors"),
    "rng_empty": (lambda c: c.update(rng={}), "its rng must be a list of RNG states"),
    "optimizer_empty": (lambda c: c.update(optimizer={}), "its optimizer must be an optimizer state dict"),
    "train_config_text": (lambda c: c.update(train_config="x"), "its train_config must be a dict"),
    "train_config_types": (lambda c: c["train_config"].update(lr="fast"), "its train_config has lr='fast': lr takes float"),
    "nan_weights": (set_nan, "its weights are not finite (cls_token holds NaN or inf)"),
    "nan_optimizer": (lambda c: c["optimizer"]["state"][0]["exp_avg"].fill_(float("inf")),
                      "its weights are not finite (optimizer state 0.exp_avg holds NaN or inf)"),
    "arch_number": (lambda c: c.update(arch=12345), "its arch must be a preset name (a string); got 12345"),
    "arch_unknown": (lambda c: c.update(arch="revit-huge"), "checkpoint of unknown arch 'revit-huge'"),
    "depth_huge": (lambda c: c["model_config"].update(depth=10 ** 9), "model_config has depth=1000000000; at most 256"),
    "dim_other": (lambda c: (c["model_config"].update(dim=64, heads=2), c["train_config"].update(
        model_args="dim=64,heads=2,ffn_dim=64")), "its weights do not fit revit-mini"),
    "config_bad": (lambda c: c["model_config"].update(heads=0), "its model_config does not build revit-mini: heads=0"),
    "optimizer_misfit": (lambda c: c["optimizer"]["state"][0].update(exp_avg=torch.zeros(3)),
                         "its optimizer state does not fit the model (entry 0)"),
    # dtypes a float weight cannot hold, tensors that are not plain data, values that are not finite
    "complex_nan": (lambda c: c["model"].update(cls_token=torch.full_like(c["model"]["cls_token"], complex(
        float("nan"), 0), dtype=torch.complex64)), "1 wrongly typed tensors (cls_token complex64 for float32)"),
    "int8_weights": (lambda c: c["model"].update(cls_token=c["model"]["cls_token"].to(torch.int8)),
                     "1 wrongly typed tensors (cls_token int8 for float32)"),
    "bool_weights": (lambda c: c["model"].update(cls_token=c["model"]["cls_token"].bool()),
                     "1 wrongly typed tensors (cls_token bool for float32)"),
    "sparse_weights": (lambda c: c["model"].update(cls_token=c["model"]["cls_token"].to_sparse()),
                       "its tensor cls_token is a sparse tensor"),
    "quantized_weights": (lambda c: c["model"].update(cls_token=torch.quantize_per_tensor(
        c["model"]["cls_token"], 0.1, 0, torch.qint8)), "its tensor cls_token is a quantized tensor"),
    "meta_weights": (lambda c: c["model"].update(cls_token=c["model"]["cls_token"].to("meta")),
                     "its tensor cls_token is a meta tensor (no data)"),
    "stride_zero_in_a_large_storage": (lambda c: c["model"].update(pos_embed=torch.zeros(
        c["model"]["pos_embed"].numel())[:1].expand(c["model"]["pos_embed"].shape)),
        "its tensor pos_embed is of shape [1, 16, 32] over 2048 bytes of storage"),
    "stride_zero": (lambda c: c["model"].update(pos_embed=torch.zeros(1).expand(c["model"]["pos_embed"].shape)),
                    "its tensor pos_embed is of shape [1, 16, 32] over 4 bytes of storage"),
    "nan_metric": (lambda c: c["metrics"].update(val_loss=float("nan")),
                   "its metrics is not finite (metrics.val_loss holds NaN or inf)"),
    "complex_metric": (lambda c: c["metrics"].update(val_loss=complex(0, float("inf"))),
                       "its metrics is not finite (metrics.val_loss holds NaN or inf)"),
    # a saved value train.py refuses is the checkpoint's, not a flag the user typed
    "saved_eval_batch": (lambda c: c["train_config"].update(eval_batch_size=-5), "ckpt.pt: its saved "
                         "train_config is refused: --eval-batch-size must be in 1..1,048,576; got -5"),
    "saved_depth_drop": (lambda c: c["train_config"].update(depth_drop=2.0), "ckpt.pt: its saved train_config "
                         "is refused: --depth-drop must be in 0..1; got 2.0"),
    "data_path": (lambda c: c["train_config"].update(data="/etc/passwd"), "the run used --data /etc/passwd; give "
                  "--data again"),
    # loop state (--resume only), checked before the run folder is touched
    "optimizer_half": (lambda c: [c["optimizer"]["state"].pop(i) for i in list(c["optimizer"]["state"])[::2]],
                       "its optimizer state covers 12 of 24 parameters"),
    "optimizer_no_sq": (lambda c: c["optimizer"]["state"][0].pop("exp_avg_sq"),
                        "its optimizer state does not fit the model (entry 0)"),
    "optimizer_int_state": (lambda c: c["optimizer"]["state"][0].update(exp_avg=torch.zeros(
        c["optimizer"]["state"][0]["exp_avg"].shape, dtype=torch.int64)),
        "its optimizer state does not fit the model (entry 0)"),
    "optimizer_ids": (lambda c: c["optimizer"]["param_groups"][0].update(params=[
        -1] + c["optimizer"]["param_groups"][0]["params"][1:]), "parameter ids are not 0..23"),
    "rng_torch_size": (lambda c: c["rng"][0].update(torch=torch.zeros(10, dtype=torch.uint8)),
                       "its rng state of rank 0 cannot be restored"),
    "rng_python_values": (lambda c: c["rng"][0].update(python=(3, ("x",) * 625, None)),
                          "its rng state of rank 0 cannot be restored"),
    "scaler_zero": (lambda c: c.update(scaler=dict(scale=0.0, growth_factor=2.0, backoff_factor=0.5,
                                                   growth_interval=2000, _growth_tracker=0)),
                    "its scaler must be fp16's GradScaler state (_growth_tracker, backoff_factor, growth_factor"),
}
LOOP_STATE = ("step_negative", "step_text", "rng_empty", "optimizer_empty", "optimizer_misfit", "nan_optimizer",
              "optimizer_half", "optimizer_no_sq", "optimizer_int_state",
              "optimizer_ids", "rng_torch_size", "rng_python_values", "scaler_zero")


@pytest.mark.parametrize("name", list(EDITS))
def test_edited_checkpoints_are_refused_before_anything_is_written(runs, tmp_path, name):
    """Each as the checkpoint of its own run folder: a resume would continue (and cut) that folder's log."""
    edit, needle = EDITS[name]
    path = edited(runs, tmp_path, "ckpt.pt", edit)
    (tmp_path / "metrics.jsonl").write_text((runs / "A" / "metrics.jsonl").read_text())  # a log to protect
    before = contents(tmp_path)
    message = one_line(train.main, ["--resume", path], "train.py")
    assert needle in message and "--lr" not in message and "Last good" not in message, message
    assert contents(tmp_path) == before  # the log was not cut, nothing was written
    if name not in LOOP_STATE:  # an evaluation reads no loop state
        assert needle in one_line(train.main, ["--eval-only", path], "train.py")
    assert contents(tmp_path) == before


def test_a_resume_takes_the_optimizer_settings_from_its_config_not_the_file(runs, tmp_path):
    """The optimizer's lr, betas and decay come from the run's config: edited ones in the file change nothing."""
    ckpt = torch.load(runs / "A" / "snapshot.pt", weights_only=True)  # step 2 of 4
    for group in ckpt["optimizer"]["param_groups"]:
        group.update(betas=(2.0, 2.0), lr="fast", eps=-1.0, weight_decay=5.0)
    torch.save(ckpt, tmp_path / "edited.pt")
    for name, path in (("plain", runs / "A" / "snapshot.pt"), ("edited", tmp_path / "edited.pt")):
        assert train.main(["--resume", str(path), "--out-dir", str(tmp_path / name), "--no-progress"])["step"] == 4
    plain, edited_ = (torch.load(tmp_path / name / "ckpt.pt", weights_only=True) for name in ("plain", "edited"))
    assert all(torch.equal(plain["model"][k], edited_["model"][k]) for k in plain["model"])


def test_a_flag_given_now_is_named_as_the_flag_and_may_replace_a_refused_saved_value(runs, tmp_path, capsys):
    """The user's own bad flag is reported as theirs; their good one replaces an edited saved value."""
    path = edited(runs, tmp_path, "ckpt.pt", lambda c: c["train_config"].update(eval_batch_size=-5))
    message = one_line(train.main, ["--eval-only", str(runs / "A" / "ckpt.pt"), "--eval-batch-size", "0"], "train.py")
    assert message == "train.py: error: --eval-batch-size must be in 1..1,048,576; got 0", message
    assert train.main(["--eval-only", str(path), "--eval-batch-size", "64"])["depths"]


def test_only_a_routed_expert_may_resume_without_optimizer_state(tmp_path):
    """AlterNet routes each sequence to one expert: an expert no batch picked has no AdamW state yet, and a
    resume says so. Any other parameter gets a gradient at every step, so a checkpoint without its state is
    an edited or partial file: refused before the run folder is touched."""
    run = tmp_path / "run"
    train.main(["--arch", "alternet-tiny", "--dataset", "grammar", "--out-dir", str(run), "--no-progress",
                "--max-steps", "3", "--batch-size", "2", "--block-size", "16", "--eval-iters", "1",
                "--eval-batch-size", "2", "--model-args",
                "dim=32,heads=2,ffn_dim=64,max_depth=3,seq_len=32,num_experts=4,min_depth_warmup=0"])
    ckpt = torch.load(run / "ckpt.pt", weights_only=True)
    params = sum(len(g["params"]) for g in ckpt["optimizer"]["param_groups"])
    assert 0 < params - len(ckpt["optimizer"]["state"]) < params // 2  # an unpicked expert, here
    del ckpt["optimizer"]["state"][0]  # the token embedding, which every batch reaches
    torch.save(ckpt, run / "ckpt.pt")
    before = contents(run)
    message = one_line(train.main, ["--resume", run / "ckpt.pt", "--max-steps", "5"], "train.py")
    assert f"its optimizer state covers {len(ckpt['optimizer']['state'])} of {params} parameters, none for " \
        in message and "only a routed expert no sequence picked" in message
    assert "experts." not in message.split("none for ")[1].split(" ")[0], message
    assert contents(run) == before


def test_a_distilled_student_killed_mid_run_resumes(runs, tmp_path, fashion_mnist_dir, capsys):
    """Eq. 5 trains a student on its teacher's final tokens: its class head gets no gradient, so AdamW never
    makes its state. A student's checkpoint is whole without it, and a run stopped mid-way continues."""
    common = ["--teacher", runs / "A" / "ckpt.pt", "--data-dir", fashion_mnist_dir, *TINY]
    train.main([str(a) for a in ["--out-dir", tmp_path / "student", *common, "--max-steps", "4", "--stop-at-step", "2"]])
    capsys.readouterr()
    summary = train.main(["--resume", str(tmp_path / "student" / "ckpt.pt"), "--teacher", str(runs / "A" / "ckpt.pt"),
                          "--no-progress"])
    assert summary["step"] == 4
    assert "override: 2 of " in capsys.readouterr().out  # the head's weight and bias start fresh, said so


def set_huge(ckpt):
    ckpt["model"]["cls_token"].fill_(3e38)  # finite, but the first LayerNorm's sum of squares overflows


@pytest.mark.parametrize("edit, needle", [
    (set_nan, "its weights are not finite (cls_token holds NaN or inf)"),
    (set_huge, "its weights are finite but its output is not (NaN or inf on an example input): a diverged run"),
])
def test_non_finite_weights_are_refused_by_every_reader(runs, tmp_path, fashion_mnist_dir, edit, needle):
    """One check in the loader: no tool evaluates, distils from, probes, exports or continues a diverged
    model, nor one whose finite weights give NaN outputs."""
    from tools import depths, export
    nan = edited(runs, tmp_path, "nan.pt", edit)
    common = ["--data-dir", fashion_mnist_dir, "--out-dir", tmp_path / "out", *TINY, "--max-steps", "1"]
    needle = f"{nan}: {needle}"
    for argv in (["--teacher", nan, *common], ["--probe", "cls", "--backbone", nan, *common], ["--eval-only", nan]):
        assert needle in one_line(train.main, argv, "train.py")
    assert needle in one_line(analyze.main, [nan, "--data-dir", fashion_mnist_dir], "python -m tools.analyze")
    assert needle in one_line(probes.main, ["--backbone", nan, "--data-dir", fashion_mnist_dir], "train.py")
    assert needle in one_line(depths.main, [nan, "--data-dir", fashion_mnist_dir], "python -m tools.depths")
    assert needle in one_line(export.main, [nan, "--format", "compact", "--out", tmp_path / "x.safetensors"],
                              "python -m tools.export")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nan.pt"]


def test_resume_never_writes_into_another_run(runs):
    before = {name: contents(runs / name) for name in ("A", "B")}
    message = one_line(train.main, ["--resume", runs / "A" / "ckpt.pt", "--out-dir", runs / "B"], "train.py")
    assert f"--out-dir {runs / 'B'} holds a run other than --resume" in message and "--overwrite" in message
    message = one_line(train.main, ["--resume", runs / "A" / "snapshot.pt"], "train.py")  # the default folder is A
    assert f"its own checkpoint is {runs / 'A' / 'ckpt.pt'}" in message and "new --out-dir" in message
    assert {name: contents(runs / name) for name in ("A", "B")} == before


def test_a_snapshot_continues_in_a_new_folder(runs, tmp_path):
    before = contents(runs / "A")
    summary = train.main(["--resume", str(runs / "A" / "snapshot.pt"), "--out-dir", str(tmp_path / "C"),
                          "--no-progress"])
    assert summary["step"] == 4 and (tmp_path / "C" / "ckpt.pt").is_file()
    assert contents(runs / "A") == before


def test_resume_past_the_last_step_is_refused(runs):
    before = contents(runs / "A")
    message = one_line(train.main, ["--resume", runs / "A" / "ckpt.pt", "--max-steps", "2"], "train.py")
    assert "it is at step 4, past this run's 2 steps; give a larger --max-steps" in message
    assert contents(runs / "A") == before


class CallsOsSystem:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_a_pickled_call_is_reported_as_what_it_is(tmp_path):
    """torch words this refusal differently ("unsupported GLOBAL posix.system whose module posix is blocked")."""
    marker = tmp_path / "pwned"
    torch.save({"model": CallsOsSystem(f"touch {marker}")}, tmp_path / "call.pt")
    message = one_line(train.main, ["--eval-only", tmp_path / "call.pt"], "train.py")
    assert f"it stores the Python object {os.system.__module__}.system, which a safe load refuses" in message
    assert not marker.exists()


@pytest.mark.parametrize("argv, needle", [
    (["--eval-depths", "2,,4"], "--eval-depths must be comma-separated integers"),
    (["--eval-depths", "100000"], "--eval-depths must be in 1..256"),
    (["--depth", "1000000000"], "--depth must be in 2..256 for reViT"),
    (["--model-args", "depth=1000000000"], "--model-args depth=1000000000; at most 256"),
    (["--arch", "alternet-tiny", "--model-args", "max_depth=100000", "--max-steps", "1"], "max_depth=100000; at most 256"),
    (["--seed", str(2 ** 70)], "--seed must be in 0..4,294,967,295"),
    (["--max-steps", str(10 ** 20)], "--max-steps must be in 0..1,000,000,000"),
    (["--epochs", "1000000"], "--epochs must be in 0..100,000"),
    (["--model-args", "num_experts=100000000"], "num_experts must be an integer in 1..1024"),
    (["--resume", "{tmp}/loop.pt"], "--resume {tmp}/loop.pt: cannot be read (Too many levels"),
    (["--resume", "{tmp}/fifo.pt"], "--resume {tmp}/fifo.pt: not a regular file"),
    (["--eval-only", "{tmp}"], "--eval-only {tmp}: a folder, not a file"),
    (["--teacher", "{tmp}/fifo.pt"], "--teacher {tmp}/fifo.pt: not a regular file"),
    (["--data-dir", "{tmp}/loop.pt"], "--data-dir {tmp}/loop.pt: cannot be read (Too many levels"),
    (["--data-dir", "{tmp}/fifo.pt"], "--data-dir {tmp}/fifo.pt: a file, not a folder"),
    (["--out-dir", "{tmp}/fifo.pt/run"], "cannot be created: {tmp}/fifo.pt is a file, not a folder"),
    # every number flag has a finite range (no overflow, no library loop that never returns)
    (["--mixup", "1e308"], "--mixup must be in 0..100; got 1e+308"),
    (["--cutmix", "101"], "--cutmix must be in 0..100"),
    (["--batch-size", str(10 ** 12)], "--batch-size must be in 1..1,048,576"),
    (["--arch", "alternet-tiny", "--batch-size", str(10 ** 12), "--gpu-memory", "1", "--max-steps", "1"],
     "--batch-size must be in 1..1,048,576"),
    (["--gpu-memory", "1e308"], "--gpu-memory must be in (0, 1,000,000]"),
    (["--lr-batch", str(10 ** 400)], "--lr-batch must be in 0..1,048,576; got 100000...(401 digits)"),
    (["--warmup-epochs", "1e308"], "--warmup-epochs must be in 0..100,000"),
    (["--eval-batch-size", str(10 ** 400)], "--eval-batch-size must be in 1..1,048,576"),
    (["--repeated-aug", str(10 ** 400)], "--repeated-aug must be in 1..64"),
    (["--lr", "1e38"], "--lr must be in (0, 10]; got 1e+38"),
    (["--lr", "1e400"], "--lr must be a finite number; got inf"),
    (["--train-subset", str(10 ** 30)], "--train-subset must be in 0..1,000,000,000"),
    (["--model-args", "dim=32,dim=64"], "--model-args names dim twice"),
    (["--teacher", "hub:dinov2_vitb14"], "--teacher hub:dinov2_vitb14 is fetched from torch.hub"),
])
def test_train_flags_and_paths(tmp_path, argv, needle):
    (tmp_path / "loop.pt").symlink_to(tmp_path / "loop.pt")
    os.mkfifo(tmp_path / "fifo.pt")  # reading it would wait forever
    before = sorted(tmp_path.iterdir())
    message = one_line(train.main, [a.format(tmp=tmp_path) for a in argv], "train.py")
    assert needle.format(tmp=tmp_path) in message, message
    assert sorted(tmp_path.iterdir()) == before


@pytest.mark.parametrize("argv, needle", [
    (["--arch", "alternet-tiny", "--depth-drop", "0.3"], "--depth-drop applies to reViT (revit-*) only, not to "
                                                         "alternet-tiny"),
    (["--arch", "alternet-tiny", "--patch-size", "4"], "--patch-size applies to ViT (vit-*), Raptor"),
    (["--arch", "alternet-tiny", "--drop-path", "0.1"], "--drop-path applies to ViT (vit-*), Raptor"),
    (["--arch", "alternet-tiny", "--eval-depths", "2,4"], "--eval-depths applies to ViT (vit-*), Raptor"),
    (["--arch", "vit-mini", "--num-experts", "8"], "--num-experts applies to reViT (revit-*), AlterNet"),
    (["--arch", "vit-mini", "--depth-drop", "0.3"], "--depth-drop applies to reViT (revit-*) only"),
    (["--arch", "vit-mini", "--model-args", "router_prior=8"], "--model-args router_prior=8 applies to reViT"),
    (["--arch", "raptor-mini", "--model-args", "z_loss_weight=0"], "--model-args z_loss_weight=0 applies to"),
    (["--arch", "revit-mini", "--model-args", "raptor_blocks=2"], "raptor_blocks=2 applies to Raptor (raptor-*)"),
    (["--arch", "revit-mini", "--model-args", "arch='vit',depth_drop=0.1"], "depth_drop=0.1 applies to reViT"),
    (["--arch", "alternet-tiny", "--depth", "3", "--model-args", "max_depth=4"],
     "--model-args max_depth=4: max_depth is 3, set by --depth"),
])
def test_a_model_flag_the_model_never_reads_is_refused(tmp_path, fashion_mnist_dir, argv, needle):
    """Refused in one line naming the flag and the models that read it, not echoed as an override and dropped."""
    small = ["--max-steps", "1", "--batch-size", "8", "--data-dir", fashion_mnist_dir,
             "--out-dir", tmp_path / "run"]  # flags every model reads
    message = one_line(train.main, argv + small, "train.py")
    assert needle in message, message
    assert not (tmp_path / "run").exists()


def test_a_language_model_given_as_teacher_is_named_as_such(tmp_path, fashion_mnist_dir):
    lm = alternet.create_model("alternet-tiny", dim=16, heads=2, ffn_dim=16, num_experts=2, seq_len=8)
    torch.save({"model": lm.state_dict(), "arch": "alternet-tiny", "model_config": dataclasses.asdict(lm.config)},
               tmp_path / "language.pt")
    message = one_line(train.main, ["--teacher", tmp_path / "language.pt", "--max-steps", "1", "--train-subset",
                                    "64", "--test-subset", "32", "--batch-size", "8", "--data-dir",
                                    fashion_mnist_dir, "--out-dir", tmp_path / "run"], "train.py")
    assert f"--teacher {tmp_path}/language.pt: holds the language model alternet-tiny" in message, message


def test_model_args_a_model_never_reads_pass_where_they_are_the_presets():
    """A saved config carries every field: those a ViT never reads, at the preset's values, are no override."""
    saved = dataclasses.asdict(revit.create_model("vit-mini").config)
    cfg = train.resolve_config({"arch": "vit-mini", "model_args": ",".join(f"{k}={v!r}" for k, v in saved.items())})
    assert "router_prior=0.0" in cfg.model_args


def hostile_cifar(root: Path, marker: Path) -> Path:
    """A CIFAR-10 folder whose data_batch_1 would create `marker` if unpickled with pickle.load."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name in ["test_batch"] + [f"data_batch_{i}" for i in range(1, 6)]:
        torch.save({}, folder / name)  # present; data_batch_1 is read first
    import pickle
    (folder / "data_batch_1").write_bytes(pickle.dumps({b"data": WritesMarker(marker), b"labels": [0]}))
    return root


def test_a_data_folder_runs_no_code(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    data_dir = hostile_cifar(tmp_path / "data", marker)
    needle = "not a CIFAR python archive (it refers to the Python object io.open"
    argv = ["--arch", "revit-mini", "--dataset", "cifar10", "--out-dir", tmp_path / "out", "--max-steps", "1"]
    assert needle in one_line(train.main, [*argv, "--data-dir", data_dir], "train.py")
    monkeypatch.setenv("REVIT_DATA_DIR", str(data_dir))
    monkeypatch.chdir(tmp_path)
    assert needle in one_line(train.main, argv, "train.py")
    checkpoint = tmp_path / "model.pt"
    model = __import__("revit").create_model("revit-mini", image_size=32, in_channels=3, patch_size=8, dim=16,
                                             heads=2, ffn_dim=16, depth=2)
    torch.save({"model": model.state_dict(), "arch": "revit-mini", "model_config": model.config.__dict__},
               checkpoint)
    assert needle in one_line(analyze.main, [checkpoint, "--dataset", "cifar10", "--data-dir", data_dir],
                              "python -m tools.analyze")
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, needle", [
    (["--depth", "100000"], "--depth must be in 2..256"),
    (["--intervention-images", "64"], "--intervention-images must be <= 16 (--num-images"),
    (["--random-perturbations", "1000000000"], "--random-perturbations must be in 0..10,000"),
    (["--seed", "-1"], "--seed must be in 0..4,294,967,295"),
    (["--batch-size", str(10 ** 400)], "--batch-size must be in 1..1,048,576"),
    (["--out", "{tmp}/file/analysis"], "cannot be created: {tmp}/file is a file, not a folder"),
    (["--data-dir", "{tmp}/loop"], "--data-dir {tmp}/loop: cannot be read (Too many levels"),
])
def test_analyze_flags(runs, tmp_path, fashion_mnist_dir, extra, needle):
    (tmp_path / "file").write_text("a file")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    argv = [runs / "A" / "ckpt.pt", "--data-dir", fashion_mnist_dir, "--num-images", "16",
            *[a.format(tmp=tmp_path) for a in extra]]
    assert needle.format(tmp=tmp_path) in one_line(analyze.main, argv, "python -m tools.analyze")
    assert not (runs / "A" / "analysis").exists()


def test_analyze_clamps_the_default_intervention_subset_to_num_images():
    args = analyze.build_parser().parse_args(["ckpt.pt", "--num-images", "16"])
    analyze.check_args(args)
    assert args.intervention_images == 16


@pytest.mark.parametrize("extra, needle", [
    (["--depth", "1000000000"], "--depth must be in 1..256"),
    (["--eval-depths", "3,100000"], "--eval-depths must be in 1..256"),
    (["--out-dir", "{tmp}/file/out"], "--out-dir {tmp}/file/out cannot be created: {tmp}/file is a file"),
    (["--probe-cache", "{tmp}/file"], "--probe-cache {tmp}/file is a file; give a folder"),
    (["--seed", str(2 ** 70)], "--seed must be in 0..4,294,967,295"),
])
def test_probes_flags(runs, tmp_path, extra, needle):
    (tmp_path / "file").write_text("a file")
    argv = ["--backbone", runs / "A" / "ckpt.pt", *[a.format(tmp=tmp_path) for a in extra]]
    assert needle.format(tmp=tmp_path) in one_line(probes.main, argv, "train.py")


def test_command_line_refusal_of_a_diverged_checkpoint_is_one_line(runs, tmp_path):
    nan = edited(runs, tmp_path, "nan.pt", set_nan)
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), "--eval-only", str(nan)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [f"train.py: error: --eval-only {nan}: its weights are not finite "
                                                  "(cls_token holds NaN or inf): a diverged run; use an earlier checkpoint"]


def test_an_edited_feature_cache_entry_is_recomputed(runs, tmp_path, fashion_mnist_dir):
    argv = ["--backbone", str(runs / "A" / "ckpt.pt"), "--data-dir", str(fashion_mnist_dir), "--train-subset", "64",
            "--test-subset", "32", "--max-steps", "2", "--batch-size", "16", "--probe-cache", str(tmp_path / "cache"),
            "--no-download"]
    first = probes.main(argv)
    from safetensors.torch import save_file
    entries = sorted((tmp_path / "cache").glob("*.safetensors"))
    for entry in entries:  # planted entries under the right names: wrong shape, or non-finite
        save_file({"features": torch.full((2, 3), float("nan"))}, str(entry))
    again = probes.main(argv)
    assert again["test_miou"] == first["test_miou"] and again["depths"] == first["depths"]


# --- what no entry point does: overwrite a run, fetch, read a path a checkpoint names, score NaN ---


@pytest.mark.parametrize("tool, argv, needle", [
    ("export", ["{A}/ckpt.pt", "--format", "compact", "--out", "{A}/.lock"], "--out {A}/.lock is a file of a training run (.lock)"),
    ("export", ["{A}/ckpt.pt", "--format", "compact", "--out", "{A}/snapshot.pt"], "--out {A}/snapshot.pt already exists and is not a file this project can recognise as its own output"),
    ("export", ["{A}/ckpt.pt", "--format", "onnx", "--out", "{tmp}/notes.txt"], "--out {tmp}/notes.txt already exists and is not a file this project can recognise as its own output"),
    ("export", ["{A}/ckpt.pt", "--format", "compact", "--out", "{B}/metrics.jsonl"], "is a file of a training run (metrics.jsonl)"),
    ("bench", ["check", "--device", "cpu", "--out", "{B}"], "--out {B} holds a training run (ckpt.pt)"),
    ("bench", ["check", "--device", "cpu"], "cannot be created: {tmp}/out is a file, not a folder"),
    ("probes", ["--backbone", "{A}/ckpt.pt", "--out-dir", "{B}"], "--out-dir {B} holds a training run"),
    ("analyze", ["{A}/ckpt.pt", "--out", "{B}"], "--out {B} holds a training run"),
    ("depths", ["{A}/ckpt.pt", "--out", "{B}/.lock"], "--out {B}/.lock is a file; give a folder"),
    ("depths", ["{A}/snapshot.pt", "--out", "{tmp}/d"], "depths.json already exists and is not a file this project can recognise as its own output"),
    ("probes", ["--backbone", "{A}/ckpt.pt", "--out-dir", "{tmp}/d"], "--out-dir {tmp}/d: its probe_heads.safetensors already "
     "exists and is not a file this project can recognise as its own output"),  # the heads of an earlier probe
])
def test_no_tool_overwrites_a_run(runs, tmp_path, monkeypatch, tool, argv, needle):
    """The one output check of train.py, in every tool: a run's files, lock and folder are refused, and so is
    any file the project did not write (a saved checkpoint, a user's notes); the default output path is
    checked as a given one (here: ./out is a file)."""
    from tools import depths, export
    import bench
    mains = {"export": (export.main, "python -m tools.export"), "bench": (bench.main, "bench.py"),
             "probes": (probes.main, "train.py"), "analyze": (analyze.main, "python -m tools.analyze"),
             "depths": (depths.main, "python -m tools.depths")}
    (tmp_path / "out").write_text("a file where the default output folder would go")
    (tmp_path / "notes.txt").write_text("a user's notes")
    (tmp_path / "d").mkdir()
    shutil.copy(runs / "A" / "snapshot.pt", tmp_path / "d" / "depths.json")  # a checkpoint under that name
    shutil.copy(runs / "A" / "snapshot.pt", tmp_path / "d" / "probe_heads.safetensors")
    monkeypatch.chdir(tmp_path)
    before = {name: contents(runs / name) for name in ("A", "B")}
    fill = dict(A=runs / "A", B=runs / "B", tmp=tmp_path)
    main, prog = mains[tool]
    message = one_line(main, [a.format(**fill) for a in argv], prog)
    assert needle.format(**fill) in message, message
    assert {name: contents(runs / name) for name in ("A", "B")} == before
    assert (tmp_path / "notes.txt").read_text() == "a user's notes"


def test_a_path_at_the_file_system_root_is_one_line():
    """/ has no parents: the output rule still finds the folder a path would be created in."""
    from tools import depths
    assert "CKPT /nonexistent.pt: no such file" in one_line(depths.main, ["/nonexistent.pt"], "python -m tools.depths")


def test_a_checkpoint_never_fetches_downloads_or_names_a_path(runs, tmp_path, monkeypatch, capsys):
    """download=True and a data folder in train_config: --eval-only scores the weights with the command
    line's data (override lines), never the network; a hub teacher is asked for again, never loaded."""
    monkeypatch.setattr(torch.hub, "load", lambda *a, **k: pytest.fail("torch.hub.load called"))
    from lib import data
    monkeypatch.setattr(data, "fetch", lambda *a: pytest.fail("tried to download"))
    path = edited(runs, tmp_path, "crafted.pt", lambda c: c["train_config"].update(
        download=True, data_dir=str(tmp_path / "elsewhere")))
    summary = train.main(["--eval-only", str(path), "--no-progress"])
    assert 0 <= summary["test_acc"] <= 1
    out = capsys.readouterr().out
    assert "override: download=False" in out and "override: data_dir=''" in out
    taught = edited(runs, tmp_path, "taught.pt", lambda c: c["train_config"].update(teacher="hub:dinov2_vitb14"))
    for flag in ("--resume", "--eval-only"):
        message = one_line(train.main, [flag, taught], "train.py")
        assert "the run used --teacher hub:dinov2_vitb14; give --teacher again" in message


@pytest.mark.parametrize("value", [None, [1, 2]])
def test_a_train_config_that_is_not_a_dict_is_one_line_in_every_tool(runs, tmp_path, fashion_mnist_dir, value):
    from tools import depths
    import sample
    path = edited(runs, tmp_path, "odd.pt", lambda c: c.update(train_config=value))
    needle = f"its train_config must be a dict of train.py's settings; got {'None' if value is None else 'list'}"
    assert needle in one_line(analyze.main, [path, "--data-dir", fashion_mnist_dir], "python -m tools.analyze")
    assert needle in one_line(depths.main, [path], "python -m tools.depths")
    assert needle in one_line(sample.main, [path], "sample.py")
    assert needle in one_line(probes.main, ["--backbone", path], "train.py")


def test_every_float_and_complex_dtype_is_under_the_finiteness_rule():
    from lib.checkpoint import non_finite, plain_values
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128):
        for bad in (float("nan"), float("inf"), complex(0, float("nan"))):
            if bad.imag and not dtype.is_complex:
                continue
            t = torch.zeros(3, dtype=dtype)
            t[1] = bad
            assert "w holds NaN or inf" in non_finite(list(plain_values({"model": {"w": t}}))), (dtype, bad)
        assert non_finite(list(plain_values({"model": {"w": torch.ones(3, dtype=dtype)}}))) is None


def test_a_cifar_archive_of_lists_is_refused_before_it_expands(tmp_path):
    """The archive's data is a uint8 array: lists (a shared-reference bomb, a self-loop, nested rows) are
    refused as they are, never expanded."""
    import pickle
    from lib import data
    looped = []
    looped.append(looped)
    for name, rows in (("bomb", [[0] * 3072] * 100_000), ("loop", looped), ("deep", [[[0] * 3072]]),
                       ("rows", [[7] * 3072] * 2)):
        (tmp_path / name).write_bytes(pickle.dumps({b"data": rows, b"labels": [0] * 2}, protocol=2))
        with pytest.raises(ValueError, match=f"{name}: not a CIFAR python archive .* N rows of 3072 bytes"):
            data.read_cifar_batch(tmp_path / name, b"labels", 10)


def test_sample_temperature_is_bounded():
    import sample
    for value in ("1e-320", "1e308", "-1"):  # refused before the checkpoint is read
        with pytest.raises(SystemExit, match="--temperature must be 0 \\(greedy\\) or in \\[0.001, 100\\]"):
            sample.main(["no-such.pt", "--temperature", value])


def render_module():
    """results/render.py (a script beside its data, not a package), as tests/test_results.py loads it."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("render", ROOT / "results" / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("template, needle", [
    ("{t.__class__.__init__.__globals__}", "is not a cell t[BLOCK][ROW][COLUMN]"),
    ("{t[quickstart].__class__}", "is not a cell"),
    ("{t[glance][0][0]}", "is not a cell"),  # a block of itself: it would render itself forever
    ("{t[quickstart][0][0]!r}", "a conversion !r"),
    ("{t[quickstart][0][0].__class__}", "is not a cell"),  # a cell, then an attribute of it
    ("{t[quickstart][0][0]:>{t[quickstart][0][1]}}", "the format spec"),
    ("{t[quickstart][999][0]}", "block quickstart has no row 999"),
])
def test_render_fills_only_named_cells(template, needle):
    render = render_module()
    with pytest.raises(SystemExit) as e:
        render.Glance().vformat(template, (), {"t": render.Cells()})
    assert str(e.value).startswith("results/render.py: results/glance.json: ") and needle in str(e.value)


def test_render_refuses_torn_json_and_data_formats(tmp_path, monkeypatch):
    render = render_module()
    monkeypatch.setattr(render, "HERE", str(tmp_path))
    (tmp_path / "torn.json").write_text('{"columns": ["a"], "rows": [[1')
    with pytest.raises(SystemExit, match=r"results/torn.json is not readable JSON \(JSONDecodeError"):
        render.load("torn.json")
    for fmt in ("{0.__class__}", "{x}", "{:{}}", "{"):
        with pytest.raises(SystemExit, match="is not one '\\{:SPEC\\}' field"):
            render.cell_text(1.5, fmt)
    assert render.cell_text(1.5, "{:.2f}%") == "1.50%"
    for number in ("NaN", "Infinity", "1e400"):  # nothing non-finite is rendered as "nan%"
        (tmp_path / "nan.json").write_text('{"columns": ["a"], "formats": ["{:.2f}%"], "rows": [[N]]}'.replace("N", number))
        with pytest.raises(SystemExit, match=f"results/nan.json is not readable JSON .*{number} is not a finite"):
            render.load("nan.json")
    (tmp_path / "long.json").write_text('{"provenance": {}, "columns": ["a"], "rows": [[1], [2, 3]]}')
    with pytest.raises(SystemExit, match="results/long.json: its row 1 has 2 cells for 1 columns"):
        render.render_table("long")


def test_a_failed_render_changes_no_document(tmp_path, monkeypatch):
    """RESULTS.md renders, README.md's glance fails: neither is written (all render before any is)."""
    render = render_module()
    for document in render.DOCUMENTS:
        (tmp_path / document).write_text((ROOT / document).read_text().replace("| ", "|  ", 1))
    before = contents(tmp_path)
    monkeypatch.setattr(render, "ROOT", str(tmp_path))
    monkeypatch.setattr(render, "render_glance", lambda name: render.refuse("a broken cell"))
    with pytest.raises(SystemExit, match="a broken cell"):
        render.main([])
    assert contents(tmp_path) == before


# --- boundaries the rules put a value on, and definitions on inputs where their wrong twins differ ---


@pytest.mark.parametrize("flag, edge, beyond", [("--batch-size", 1 << 20, (1 << 20) + 1), ("--lr", 10.0, 10.000001),
                                                ("--mixup", 100.0, 100.01), ("--repeated-aug", 64, 65),
                                                ("--eval-batch-size", 1 << 20, (1 << 20) + 1)])
def test_a_number_on_its_bound_is_taken_and_one_past_it_refused(flag, edge, beyond):
    name = flag[2:].replace("-", "_")
    assert getattr(train.resolve_config({name: edge}, announce=False), name) == edge
    with pytest.raises(SystemExit, match=f"{flag} must be in"):
        train.resolve_config({name: beyond}, announce=False)


def test_a_float_weight_takes_every_float_dtype_and_nothing_else():
    from lib.checkpoint import fit_problem
    expected = {"w": torch.zeros(2, 3)}
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        assert fit_problem(expected, {"w": torch.zeros(2, 3, dtype=dtype)}, "m") is None, dtype
    for dtype in (torch.int8, torch.int64, torch.bool, torch.complex64, torch.uint8):
        assert "1 wrongly typed tensors" in fit_problem(expected, {"w": torch.zeros(2, 3, dtype=dtype)}, "m")
    assert "wrongly typed" in fit_problem({"n": torch.zeros(2, dtype=torch.long)}, {"n": torch.zeros(2)}, "m")


def test_a_checkpoint_at_step_0_resumes_without_optimizer_state(runs, tmp_path):
    """Before its first step AdamW holds no state: only after it is missing state an edited file."""
    path = edited(runs, tmp_path, "step0.pt", lambda c: (c.update(step=0), c["optimizer"]["state"].clear()))
    summary = train.main(["--resume", str(path), "--out-dir", str(tmp_path / "run"), "--no-progress"])
    assert summary["step"] == 4


def test_depth_bounds_take_their_edges():
    """The depth bound of every flag and saved config: MAX_DEPTH is allowed, one more is not; a minimum."""
    from lib.boundary import MAX_DEPTH, check_numbers, closed, parse_depths, too_deep
    assert parse_depths(f"1,{MAX_DEPTH}") == [1, MAX_DEPTH] and parse_depths("2", "--depths", 2) == [2]
    with pytest.raises(SystemExit, match=f"--eval-depths must be in 1..{MAX_DEPTH}"):
        parse_depths(str(MAX_DEPTH + 1))
    with pytest.raises(SystemExit, match="--depths must be in 2..256"):
        parse_depths("1", "--depths", 2)
    check_numbers({"depth": 2}, depth=closed(2, MAX_DEPTH))
    check_numbers({"depth": MAX_DEPTH}, depth=closed(2, MAX_DEPTH))
    for depth in (1, MAX_DEPTH + 1):
        with pytest.raises(SystemExit, match="--depth must be in 2..256"):
            check_numbers({"depth": depth}, depth=closed(2, MAX_DEPTH))
    assert too_deep({"depth": MAX_DEPTH}) is None and too_deep({"max_depth": MAX_DEPTH + 1})
    assert train.resolve_config({"seed": 2 ** 32 - 1}, announce=False).seed == 2 ** 32 - 1
    with pytest.raises(SystemExit, match="--seed must be in 0..4,294,967,295"):
        train.resolve_config({"seed": 2 ** 32}, announce=False)


# --- Ctrl-C: every command ends in one line saying what is kept, never a traceback ---

CTRL_C = """import argparse, runpy, sys
def interrupted(*args, **kwargs):
    raise KeyboardInterrupt  # Ctrl-C while the command reads its flags: the first thing each one does
argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = interrupted
sys.argv = [{argv0!r}]
runpy.{runner}({target!r}, run_name="__main__"{alter})
"""


@pytest.mark.parametrize("target", ["train.py", "bench.py", "sample.py", "tools.analyze", "tools.depths",
                                    "tools.export", "tools.probes", "tools.sweep"])
def test_ctrl_c_ends_every_command_in_one_line(target):
    as_file = target.endswith(".py")
    code = CTRL_C.format(argv0=target if as_file else "-m", runner="run_path" if as_file else "run_module",
                         target=target, alter="" if as_file else ", alter_sys=True")  # as python -m does
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    name = target if as_file else f"python -m {target}"
    assert done.returncode == 1 and done.stdout == "", done.stderr[-2000:]
    assert done.stderr.startswith(f"{name}: stopped by Ctrl-C; ") and done.stderr.count("\n") == 1, done.stderr
