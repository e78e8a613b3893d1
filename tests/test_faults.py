"""A long run's faults: divergence, run folders shared or reused, interrupted saves, a full disk, and
every bad file or value a user can pass -- each a one-line error, never a traceback, nothing lost."""
import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lib import data
from lib.checkpoint import RunFolder, lock
import train

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--no-progress", "--train-subset", "256", "--test-subset", "64", "--batch-size", "32",
        "--patch-size", "7", "--depth", "2", "--model-args", "dim=32,heads=2,ffn_dim=64",
        "--log-interval", "1"]


def run(tmp_path, fashion_mnist_dir, *args, name="run"):
    out = tmp_path / name
    return train.main(["--data-dir", str(fashion_mnist_dir), "--out-dir", str(out), *TINY, *args]), out


def error(*argv) -> str:
    with pytest.raises(SystemExit) as e:
        train.main(list(argv))
    assert e.value.code not in (0, None)
    message = str(e.value.code)
    assert message.startswith("train.py: error: ") and "\n" not in message
    return message


def steps_logged(out):
    records = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return [r["step"] for r in records if "loss" in r]


# --- divergence: checked before optimizer.step(), nothing non-finite written ---


def nan_gradients_after(step, monkeypatch):
    """From optimizer step `step` on, a finite loss whose gradient is NaN (sqrt'(0) * 0)."""
    real_loss = train.classification_loss
    counter = {"calls": 0}

    def loss(logits, targets, kind):
        value = real_loss(logits, targets, kind)
        counter["calls"] += 1
        if counter["calls"] > step:
            value = value + torch.sqrt(0 * logits.sum())  # forward + 0, backward NaN
        return value

    monkeypatch.setattr(train, "classification_loss", loss)


@pytest.mark.parametrize("clip", ["1.0", "0"])
def test_nan_gradient_with_finite_loss_stops_before_the_step(tmp_path, fashion_mnist_dir, monkeypatch, clip):
    nan_gradients_after(2, monkeypatch)
    with pytest.raises(SystemExit) as e:
        run(tmp_path, fashion_mnist_dir, "--max-steps", "6", "--save-interval", "1", "--grad-clip", clip)
    message = str(e.value)
    assert "non-finite gradient norm nan (loss" in message and "at step 2;" in message
    assert f"Last good checkpoint: {tmp_path / 'run' / 'ckpt.pt'} (step 2)" in message
    assert ("--grad-clip 1.0" in message) == (clip == "0")  # the hint fits: clipping suggested only when off
    ckpt = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)
    assert ckpt["step"] == 2 and all(torch.isfinite(t).all() for t in ckpt["model"].values())
    assert steps_logged(tmp_path / "run") == [1, 2]


def test_non_finite_weights_are_never_saved(tmp_path, fashion_mnist_dir, monkeypatch):
    real_step = train.train_step

    def step_then_break(run_, inputs, targets):
        record = real_step(run_, inputs, targets)
        if run_.step == 3:
            with torch.no_grad():
                next(run_.model.parameters()).fill_(float("inf"))
        return record

    monkeypatch.setattr(train, "train_step", step_then_break)
    with pytest.raises(SystemExit, match=r"weights became non-finite at step 3 .*not saved. Last good "
                                         r"checkpoint: .*ckpt\.pt \(step 2\)"):
        run(tmp_path, fashion_mnist_dir, "--max-steps", "6", "--save-interval", "1")
    assert torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)["step"] == 2


# --- run folders ---


def test_a_used_folder_is_refused_unless_overwrite(tmp_path, fashion_mnist_dir):
    _, out = run(tmp_path, fashion_mnist_dir, "--max-steps", "1")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    message = error("--data-dir", str(fashion_mnist_dir), "--out-dir", str(out), *TINY, "--max-steps", "2")
    assert f"--out-dir {out} already holds a run" in message and "--overwrite" in message
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    (out / "ckpt.pt").unlink()  # a run stopped before its first checkpoint: no --resume to suggest
    message = error("--data-dir", str(fashion_mnist_dir), "--out-dir", str(out), *TINY, "--max-steps", "2")
    assert "stopped before its first checkpoint" in message and "--resume" not in message
    summary, _ = run(tmp_path, fashion_mnist_dir, "--max-steps", "2", "--overwrite")
    assert summary["step"] == 2 and steps_logged(out) == [1, 2]


def test_overwrite_replaces_a_run_only_once_the_new_one_has_saved(tmp_path, fashion_mnist_dir, monkeypatch):
    """--overwrite sets the old run aside until the new run's first checkpoint: a Ctrl-C or crash before it
    puts the old run back, and so does the next run in the folder after a kill (no clean-up at all)."""
    _, out = run(tmp_path, fashion_mnist_dir, "--max-steps", "2")
    files = lambda: {p.name: p.read_bytes() for p in out.iterdir() if p.name != ".lock"}  # noqa: E731
    before, real_step = files(), train.train_step

    def interrupted(run_, inputs, targets):
        raise KeyboardInterrupt

    def stopped_overwrite():
        with pytest.raises(SystemExit, match="stopped by Ctrl-C at step 0; no checkpoint was written yet"):
            run(tmp_path, fashion_mnist_dir, "--max-steps", "3", "--overwrite")

    monkeypatch.setattr(train, "train_step", interrupted)
    stopped_overwrite()
    assert files() == before
    with monkeypatch.context() as kill:
        kill.setattr(RunFolder, "settle", lambda self: None)
        stopped_overwrite()
    stopped_overwrite()
    assert files() == before
    seen = []  # the folder before each step

    def watched(run_, inputs, targets):
        seen.append(sorted(files()))
        return real_step(run_, inputs, targets)

    monkeypatch.setattr(train, "train_step", watched)
    summary, _ = run(tmp_path, fashion_mnist_dir, "--max-steps", "3", "--save-interval", "1", "--overwrite")
    assert summary["step"] == 3 and steps_logged(out) == [1, 2, 3]
    assert seen[0] == [".ckpt.pt.old", ".metrics.jsonl.old", "metrics.jsonl"]  # the old run, set aside
    assert seen[1] == sorted(files()) == ["ckpt.pt", "metrics.jsonl"]  # deleted at the first checkpoint


def test_two_processes_cannot_share_a_folder(tmp_path, fashion_mnist_dir):
    out = tmp_path / "run"
    out.mkdir()
    with open(out / ".lock", "w") as other_process:  # flock: per open file, so this acts as another process
        lock(other_process)
        message = error("--data-dir", str(fashion_mnist_dir), "--out-dir", str(out), *TINY,
                        "--max-steps", "1")
    assert "is in use by another training process" in message
    assert sorted(p.name for p in out.iterdir()) == [".lock"]


def test_resume_cuts_the_log_back_and_removes_stale_temp_files(tmp_path, fashion_mnist_dir, monkeypatch):
    real_step = train.train_step

    def killed_at_5(run_, inputs, targets):
        if run_.step == 4:
            raise KeyboardInterrupt("kill -9")
        return real_step(run_, inputs, targets)

    monkeypatch.setattr(train, "train_step", killed_at_5)
    with pytest.raises(SystemExit) as e:  # Ctrl-C: one line saying where the run continues
        run(tmp_path, fashion_mnist_dir, "--max-steps", "6", "--save-interval", "3")
    monkeypatch.setattr(train, "train_step", real_step)
    out = tmp_path / "run"
    assert str(e.value) == (f"train.py: stopped by Ctrl-C at step 4; resume with --resume {out / 'ckpt.pt'} "
                            f"(its step 3)")
    assert steps_logged(out) == [1, 2, 3, 4]  # the checkpoint holds step 3
    (out / ".ckpt.pt.tmp12345").write_bytes(b"half a checkpoint")
    train.main(["--resume", str(out / "ckpt.pt"), "--no-progress"])
    assert steps_logged(out) == [1, 2, 3, 4, 5, 6]  # each step once
    assert not list(out.glob(".ckpt.pt.tmp*"))


def test_disk_full_at_save_names_the_file_and_the_last_good_checkpoint(tmp_path, fashion_mnist_dir,
                                                                        monkeypatch):
    real_save, calls = torch.save, []

    def full_disk(obj, f, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(SystemExit) as e:
        run(tmp_path, fashion_mnist_dir, "--max-steps", "6", "--save-interval", "1")
    ckpt = tmp_path / "run" / "ckpt.pt"
    assert str(e.value) == (f"train.py: error: cannot write {ckpt}: No space left on device. "
                            f"Last good checkpoint: {ckpt} (step 2)")


def test_disk_full_as_torch_reports_it_keeps_the_previous_checkpoint(tmp_path, fashion_mnist_dir,
                                                                      monkeypatch):
    """torch's zip writer reports a full disk as a RuntimeError, not an OSError."""
    real_save, calls = torch.save, []

    def full_disk(obj, f, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("[enforce fail at inline_container.cc:626] . PytorchStreamWriter failed "
                               "writing file data/3: file write failed")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(SystemExit) as e:
        run(tmp_path, fashion_mnist_dir, "--max-steps", "6", "--save-interval", "1")
    ckpt = tmp_path / "run" / "ckpt.pt"
    message = str(e.value)
    assert message.startswith(f"train.py: error: cannot write {ckpt}: [enforce fail") and "\n" not in message
    assert message.endswith(f"Last good checkpoint: {ckpt} (step 2)")
    assert torch.load(ckpt, weights_only=True)["step"] == 2 and not list(ckpt.parent.glob(".ckpt.pt.tmp*"))


def test_a_non_finite_evaluation_stops_the_run_and_is_never_written(tmp_path, fashion_mnist_dir, monkeypatch):
    """Finite weights can score NaN (a far too large step): like a non-finite loss, nothing of it is kept."""
    real = train.evaluate
    monkeypatch.setattr(train, "evaluate", lambda model, task, depths=(None,), *a: {
        d: {k: float("nan") for k in v} for d, v in real(model, task, depths, *a).items()})
    with pytest.raises(SystemExit) as e:
        run(tmp_path, fashion_mnist_dir, "--max-steps", "4", "--eval-interval", "2")
    assert str(e.value).startswith("train.py: error: the evaluation at step 2 gave a non-finite acc; not "
                                   "logged, not saved. Last good checkpoint: none written yet")
    log = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert "NaN" not in log and '"eval"' not in log and not (tmp_path / "run" / "ckpt.pt").exists()


def test_a_kill_while_resume_cuts_the_log_leaves_the_log_whole(tmp_path, fashion_mnist_dir, monkeypatch):
    """The log is cut by a rewrite to a temp file and a rename: a kill before the rename keeps the old log."""
    _, out = run(tmp_path, fashion_mnist_dir, "--max-steps", "4", "--stop-at-step", "2",
                 "--log-interval", "1")
    with open(out / "metrics.jsonl", "a") as log:  # steps after the checkpoint: the resume cuts them
        log.write('{"step": 3, "loss": 1.0}\n')
    before = (out / "metrics.jsonl").read_bytes()
    import lib.cli

    def killed(*args):
        raise KeyboardInterrupt("SIGKILL while the log is rewritten")

    monkeypatch.setattr(lib.cli.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        train.main(["--resume", str(out / "ckpt.pt"), "--no-progress"])
    monkeypatch.undo()
    assert (out / "metrics.jsonl").read_bytes() == before and not list(out.glob(".metrics.jsonl.tmp*"))
    train.main(["--resume", str(out / "ckpt.pt"), "--no-progress"])
    assert steps_logged(out) == [1, 2, 3, 4]


def test_an_unwritable_out_dir_is_found_before_training(tmp_path, fashion_mnist_dir, monkeypatch):
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setattr(data, "load_images", lambda *a, **k: pytest.fail("data loaded before the check"))
    message = error("--data-dir", str(fashion_mnist_dir), "--out-dir", str(tmp_path / "file" / "run"), *TINY)
    assert f"cannot be created: {tmp_path / 'file'} is a file, not a folder" in message


# --- one error path for every file a user passes ---


class Payload:
    def __reduce__(self):
        return (print, ("this must never run",))


@pytest.fixture
def bad_files(tmp_path):
    files = {name: tmp_path / f"{name}.pt" for name in ("garbage", "pickle", "keys", "missing")}
    files["garbage"].write_bytes(b"\x00not a checkpoint" * 10)
    torch.save({"arch": "revit-mini", "model": Payload()}, files["pickle"])
    torch.save({"arch": "revit-mini", "model_config": {}, "model": {}}, files["keys"])
    return files


def test_bad_resume_teacher_backbone_files_give_one_line(tmp_path, bad_files, fashion_mnist_dir):
    common = ["--data-dir", str(fashion_mnist_dir), "--out-dir", str(tmp_path / "x"), *TINY]
    expected = {"garbage": "not a PyTorch file", "pickle": "it stores the Python object",
                "missing": "no such file"}
    for kind, path in bad_files.items():
        for flag in ("--resume", "--teacher", "--backbone"):
            argv = [flag, str(path), *common] + (["--probe", "cls"] if flag == "--backbone" else [])
            message = error(*argv)
            assert f"{flag} {path}" in message and "weights_only" not in message, message
            if kind in expected:
                assert expected[kind] in message, message
    assert "not a training checkpoint of this project (missing train_config, optimizer, step, rng)" in \
        error("--resume", str(bad_files["keys"]))
    assert "its weights do not fit revit-mini: 24 missing tensors (cls_token, pos_embed" in error(
        "--teacher", str(bad_files["keys"]), *common)
    assert not (tmp_path / "x").exists()


TINY_LM = ["--arch", "alternet-tiny", "--no-progress", "--max-steps", "1", "--batch-size", "2",
           "--block-size", "16", "--eval-iters", "1", "--eval-batch-size", "2", "--model-args",
           "dim=32,heads=2,ffn_dim=32,max_depth=2,min_depth_warmup=0"]


@pytest.fixture(scope="module")
def language_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lm")
    train.main([*TINY_LM, "--out-dir", str(out)])
    return out


def test_probe_of_a_language_model_is_refused_without_download(language_run, monkeypatch):
    monkeypatch.setattr(data, "fetch", lambda *a: pytest.fail("tried to download"))
    message = error("--probe", "cls", "--backbone", str(language_run / "ckpt.pt"))
    assert "is a checkpoint of alternet-tiny, not a vision model" in message


def test_a_saved_flag_the_family_never_reads_is_not_refused_but_its_range_is(language_run, tmp_path):
    """The family rule judges what a user types: an AlterNet run saved with --workers 4 (never read, and
    once allowed) still evaluates; a saved value out of its range is still refused."""
    ckpt = torch.load(language_run / "ckpt.pt", weights_only=True)
    old = tmp_path / "old.pt"
    torch.save({**ckpt, "train_config": {**ckpt["train_config"], "workers": 4}}, old)
    assert train.main(["--eval-only", str(old)])["arch"] == "alternet-tiny"
    torch.save({**ckpt, "train_config": {**ckpt["train_config"], "workers": 1000}}, old)
    assert "its saved train_config is refused: --workers must be in 1..256" in error("--eval-only", str(old))


def test_test_subset_of_a_language_run_is_refused(language_run, tmp_path):
    """AlterNet evaluates --eval-iters batches of text: --test-subset (an image count) would be dropped."""
    message = error(*TINY_LM, "--test-subset", "4", "--out-dir", str(tmp_path / "x"))
    assert message.endswith("--test-subset applies to the image models only, not to alternet-tiny (it "
                            "evaluates --eval-iters batches of text)")
    resumed = error("--resume", str(language_run / "ckpt.pt"), "--test-subset", "4")
    assert "--test-subset applies to the image models only" in resumed


def test_resume_of_a_run_folder_names_its_checkpoint(language_run):
    message = error("--resume", str(language_run))
    assert message.endswith(f"--resume {language_run}: a folder, not a file; give its checkpoint, "
                            f"{language_run / 'ckpt.pt'}")


# --- every numeric flag validated up front ---


@pytest.mark.parametrize("argv, expected", [
    (["--beta1", "2"], "--beta1 must be in [0, 1); got 2.0"),
    (["--lr", "nan"], "--lr must be a finite number; got nan"),
    (["--lr", "-1"], "--lr must be in (0, 10]; got -1.0"),
    (["--warmup-steps", "-5"], "--warmup-steps must be in 0..1,000,000,000; got -5"),
    (["--mix-prob", "1.5"], "--mix-prob must be in 0..1; got 1.5"),
    (["--grad-clip", "inf"], "--grad-clip must be a finite number; got inf"),
    (["--model-args", "dim=abc"], "--model-args dim='abc': dim takes int"),
    (["--model-args", "depth=6.5"], "--model-args depth=6.5: depth takes int"),
    (["--model-args", "nonsense=1"], "--model-args nonsense: not a field of ViTConfig"),
    (["--loss", "mse"], "--loss must be one of ce, bce; got 'mse'"),
    (["--arch", "alternet-tiny", "--max-steps", "0"], "text data trains by steps: give --max-steps"),
    (["--arch", "alternet-tiny", "--dataset", "text", "--max-steps", "1"],
     "--dataset text needs --data FILE"),
    (["--dataset", "fashion-mnist", "--data", "."], "--data is read by --dataset imagenet or text; --dataset "
                                                    "fashion-mnist is found under --data-dir"),
])
def test_bad_values_are_refused_up_front(tmp_path, argv, expected):
    assert expected in error(*argv, "--out-dir", str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()


def test_empty_text_file(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    assert f"--data: {tmp_path / 'empty.txt'} holds no text" in error("--arch", "alternet-tiny", "--data",
                                                                     str(tmp_path / "empty.txt"))


def test_command_line_prints_one_line_and_no_traceback(tmp_path):
    (tmp_path / "GARBAGE").write_bytes(b"PK\x03\x04 torn zip")
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), "--resume", "GARBAGE"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "--resume GARBAGE: not a PyTorch file (" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["GARBAGE"]


def test_tests_collect_from_any_working_directory(tmp_path):
    """pytest finds the repository's configuration (the root on sys.path) from wherever it starts."""
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--co",
                             str(ROOT / "tests" / "test_data.py")], cwd=tmp_path, capture_output=True,
                            text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:]
    assert "error" not in result.stdout.lower().splitlines()[-1]


ENTRY_POINTS = ["train.py", "bench.py", "sample.py",  # (results/render.py imports only the standard library)
                *(f"-m tools.{name}" for name in ("analyze", "depths", "export", "probes", "sweep"))]
WITHOUT_UNIX = """
import os, runpy, sys
for name in ("fcntl", "resource", "msvcrt"):  # as on Windows (fcntl, resource) or Linux (msvcrt)
    sys.modules[name] = None  # `import fcntl` now raises ImportError
del os.fork
for entry in {entries}:
    sys.argv = [entry.split()[-1], "--help"]
    try:
        runpy.run_module(entry[3:], run_name="__main__") if entry.startswith("-m ") else \\
            runpy.run_path(entry, run_name="__main__")
    except SystemExit as e:
        assert e.code in (0, None), (entry, e.code)
    print("HELPED", entry, file=sys.stderr)
"""


def test_every_entry_point_helps_without_fcntl_or_fork():
    """Windows has neither fcntl nor os.fork (nor resource): every command's --help works without them."""
    result = subprocess.run([sys.executable, "-c", WITHOUT_UNIX.format(entries=ENTRY_POINTS)], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stderr.count("HELPED") == len(ENTRY_POINTS) and "usage:" in result.stdout


@pytest.mark.parametrize("model_args, expected", [
    ("num_classes=5", "--model-args num_classes=5: num_classes is 10, set by fashion-mnist"),
    ("in_channels=3", "--model-args in_channels=3: in_channels is 1, set by fashion-mnist"),
    ("depth=3", "--model-args depth=3: depth is 2, set by --depth"),
])
def test_what_the_data_or_a_flag_sets_is_not_changed_by_model_args(tmp_path, fashion_mnist_dir, model_args,
                                                                   expected):
    """A data property given again would fail mid-run; a flag given again would be silently overridden."""
    tiny = [a if a != "dim=32,heads=2,ffn_dim=64" else f"{a},{model_args}" for a in TINY]
    assert expected in error("--data-dir", str(fashion_mnist_dir), *tiny, "--out-dir", str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()


def test_a_vocabulary_that_misses_the_data_s_token_ids_is_refused(tmp_path):
    (tmp_path / "text.txt").write_text("some text to train on\n" * 50)
    assert "--model-args vocab_size=100: the data's token ids reach 120" in error(
        "--arch", "alternet-tiny", "--data", str(tmp_path / "text.txt"), "--max-steps", "1",
        "--model-args", "vocab_size=100", "--out-dir", str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()
