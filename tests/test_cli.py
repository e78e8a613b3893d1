"""Conventions users of nanoGPT and timm rely on: a typo in a preset name gets a suggestion, --help's
defaults say what happens, every --device defaults to auto, and the extra an image folder needs is listed.
"""
import argparse
import re
import sys
from pathlib import Path

import pytest

import bench
import sample
import train
from lib import data
from tools import analyze, depths, probes, sweep

ROOT = Path(__file__).resolve().parent.parent
PARSERS = {"train.py": train.build_parser, "sample.py": sample.sample_parser, "bench.py": bench.build_parser,
           "tools.analyze": analyze.build_parser, "tools.depths": depths.build_parser,
           "tools.probes": probes.build_parser, "tools.sweep": sweep.build_parser}  # export: no --device


def actions(parser: argparse.ArgumentParser):
    """Every action of a parser and of its subcommands' parsers (bench.py latency, memory, ...)."""
    for action in parser._actions:
        yield action
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from actions(sub)


@pytest.mark.parametrize("typo, suggested", [("revit-tiny", "revit-mini"), ("vit-mni", "vit-mini"),
                                             ("alternet-tny", "alternet-tiny"), ("REVIT-MINI", "revit-mini")])
def test_an_unknown_arch_suggests_the_closest_presets(typo, suggested):
    with pytest.raises(SystemExit) as stopped:
        train.main(["--arch", typo])
    message = str(stopped.value)
    assert message.startswith(f"train.py: error: unknown --arch {typo!r}; did you mean {suggested} ")
    assert message.endswith("python train.py --list-archs prints all names") and "\n" not in message


def test_a_name_like_no_preset_gets_no_suggestion():
    with pytest.raises(SystemExit,
                       match=r"unknown --arch 'zzz'; python train.py --list-archs prints all names$"):
        train.main(["--arch", "zzz"])


def test_help_says_none_for_a_flag_that_is_off_and_auto_for_one_chosen_for_you():
    """An empty default shows as auto only where the help says what auto picks ("auto: ...")."""
    shown = {action.dest: action.help for action in train.build_parser()._actions if action.help}
    for dest in ("resume", "eval_only", "teacher", "backbone"):
        assert shown[dest].endswith("[default: none]"), dest
    for dest in ("out_dir", "grad_accum", "data_dir", "device"):
        assert shown[dest].endswith("[default: auto]"), dest
    for dest, text in shown.items():
        if text.endswith("[default: auto]") and dest != "device":
            assert "auto:" in text, dest


def test_help_lists_every_data_set_train_py_takes():
    shown = {action.dest: action.help for action in train.build_parser()._actions if action.help}
    listed = shown["dataset"].split(" (")[0].split(" | ")
    assert listed == [*data.IMAGE_DATASETS, *data.TEXT_DATASETS]  # planted too, as README runs it


def test_an_override_line_names_the_flag_as_typed(capsys):
    train.resolve_config({"progress": False, "random_crop": True})
    printed = capsys.readouterr().out
    assert "override: progress=False (--no-progress)" in printed
    assert "override: random_crop=True (--random-crop)" in printed


@pytest.mark.parametrize("name", PARSERS)
def test_every_device_flag_defaults_to_auto(name):
    found = [a for a in actions(PARSERS[name]()) if "--device" in a.option_strings]
    defaults = {a.default for a in found} - {argparse.SUPPRESS}  # train.py: TrainConfig's, below
    assert found and defaults <= {"auto"}, (name, defaults)
    if name == "train.py":
        assert train.TrainConfig().device == "auto"


def test_sample_help_shows_its_defaults():
    parser = sample.sample_parser()
    shown = {a.dest: parser._get_formatter()._expand_help(a) for a in parser._actions if a.help}
    for dest, default in [("max_new_tokens", "200"), ("temperature", "0.8"), ("seed", "1337"),
                          ("num_samples", "1"), ("device", "auto")]:
        assert f"[default: {default}" in shown[dest], dest


def test_the_extra_an_image_folder_needs_is_listed_with_its_reason(tmp_path, monkeypatch):
    extras = (ROOT / "requirements-extra.txt").read_text()
    assert re.search(r"torchvision.*image folder", extras, re.S) and "pillow" in extras.lower()
    monkeypatch.setitem(sys.modules, "torchvision", None)  # as on a machine without it
    from lib import data
    with pytest.raises(ValueError, match="requirements-extra.txt"):
        data.FolderImages(tmp_path, 224, True, 0)


def test_an_image_folder_whose_val_classes_differ_from_train_is_refused(tmp_path, monkeypatch):
    """A label is a class folder's index: val/ with other folders would score against other classes."""
    from types import SimpleNamespace
    from lib import data
    classes = {"train": ["cat", "dog", "owl"], "val": ["cat", "owl"]}
    monkeypatch.setattr(data, "FolderImages", lambda root, *args: SimpleNamespace(
        dataset=SimpleNamespace(classes=classes[Path(root).name])))
    with pytest.raises(ValueError, match=r"val/ must hold the class folders of train/; 1 .*\(dog\)"):
        data.load_images("imagenet", data=str(tmp_path))


def test_an_output_replaces_only_an_earlier_output_of_the_project(tmp_path):
    """A command writes new files or its own: an earlier JSON report or figure is replaced; a user's notes,
    a saved checkpoint or a run's log never are."""
    import safetensors.torch
    import torch
    from lib.boundary import output_problem
    from lib.cli import write_json
    write_json({"step": 1}, tmp_path / "report.json")
    (tmp_path / "curves.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    safetensors.torch.save_file({"w": torch.ones(2)}, tmp_path / "export.st", metadata={"format": "timm"})
    for name in ("report.json", "curves.png", "export.st"):  # tools.export's files too
        assert output_problem(tmp_path / name) is None, name
    (tmp_path / "notes.md").write_text("# my notes\n")
    torch.save({"model": {}}, tmp_path / "model.json")
    safetensors.torch.save_file({"w": torch.ones(2)}, tmp_path / "weights.st",
                                metadata={"format": "revit.checkpoint"})  # a checkpoint's packed weights
    for name in ("notes.md", "model.json", "weights.st"):
        assert output_problem(tmp_path / name).startswith("already exists and is not a file this project "
                                                          "can recognise as its own output"), name
    write_json({"step": 1}, tmp_path / "metrics.jsonl")
    assert output_problem(tmp_path / "metrics.jsonl").startswith("is a file of a training run")


def test_a_text_run_builds_its_tokenizer_once(monkeypatch):
    """The tokenizer built to check --tokenizer (before the text is read) is the one that encodes the text."""
    import types
    import torch
    from lib import language
    built = []
    byte_like = types.SimpleNamespace(encode_ordinary=lambda text: list(text.encode()), n_vocab=256,
                                      decode=lambda ids: bytes(ids).decode())
    monkeypatch.setitem(sys.modules, "tiktoken", types.SimpleNamespace(
        get_encoding=lambda name: built.append(name) or byte_like))
    cfg = train.TrainConfig(arch="alternet-tiny", dataset="grammar", tokenizer="gpt2", max_steps=1)
    language.build(cfg, 0, 1, torch.device("cpu"), None)
    assert built == ["gpt2"]


@pytest.mark.parametrize("explicit, refused", [
    (dict(arch="alternet-tiny", mixup=0.8),
     "--mixup applies to ViT (vit-*), Raptor (raptor-*), reViT (revit-*) only, not to alternet-tiny"),
    (dict(arch="alternet-tiny", train_subset=64), "--train-subset applies to ViT (vit-*)"),
    (dict(arch="alternet-tiny", teacher="teacher.pt"), "--teacher applies to ViT (vit-*)"),
    (dict(arch="revit-mini", block_size=64), "--block-size applies to AlterNet (alternet-*) only, not to "
                                             "revit-mini"),
    (dict(arch="vit-mini", tokenizer="gpt2"), "--tokenizer applies to AlterNet (alternet-*) only"),
])
def test_a_training_flag_the_other_family_never_reads_is_refused(explicit, refused):
    """One table (lib/boundary.READ_BY) for model and training flags: a flag given to a run that never reads
    it is refused in one line, not echoed as an override and dropped; at its default it is not "given"."""
    with pytest.raises(SystemExit) as stopped:
        train.resolve_config({**explicit, "max_steps": 1}, announce=False)
    assert str(stopped.value).startswith(f"train.py: error: {refused}") and "\n" not in str(stopped.value)
    default = {name: getattr(train.TrainConfig, name) for name in explicit if name != "arch"}
    train.resolve_config({"arch": explicit["arch"], **default, "max_steps": 1}, announce=False)


def test_a_text_file_given_to_an_image_model_names_the_language_arch(tmp_path):
    (tmp_path / "book.txt").write_text("to be or not to be\n")
    language = r"a text file trains a language --arch \(alternet-\*\); revit-mini reads an image folder"
    with pytest.raises(SystemExit, match=r"^train.py: error: --data \S+book.txt is a file: " + language):
        train.resolve_config({"data": str(tmp_path / "book.txt"), "max_steps": 1}, announce=False)


@pytest.mark.parametrize("build, argv, said", [
    (train.build_parser, ["--max-stesp", "5"],
     "unrecognized arguments: --max-stesp 5; did you mean --max-steps?"),
    (train.build_parser, ["--seed=x"], "argument --seed: invalid int value: 'x'"),
    (train.build_parser, ["--zzzzzz"], "unrecognized arguments: --zzzzzz"),
    (probes.build_parser, ["--bakbone=a.pt"],
     "unrecognized arguments: --bakbone=a.pt; did you mean --backbone?"),
])
def test_a_mistyped_flag_is_one_line_with_the_closest_flag(capsys, build, argv, said):
    """README: a wrong flag is one line, not the usage (--help prints that), in every command whose flags
    come from lib/cli.dataclass_parser."""
    parser = build()
    with pytest.raises(SystemExit) as stopped:
        parser.parse_args(argv)
    assert stopped.value.code == 2 and capsys.readouterr().err == f"{parser.prog}: error: {said}\n"


@pytest.mark.parametrize("arch, depth, refused", [("revit-mini", 1, "--depth must be in 2..256 for reViT "
                                                                    "(s_t = t/(L-1) needs two steps); got 1"),
                                                  ("vit-mini", 0, "--depth must be in 1..256; got 0"),
                                                  ("alternet-tiny", 0, "--depth must be in 1..256; got 0")])
def test_depth_is_refused_as_the_chosen_arch_allows(arch, depth, refused):
    with pytest.raises(SystemExit, match=re.escape(f"train.py: error: {refused}") + "$"):
        train.resolve_config({"arch": arch, "depth": depth, "max_steps": 1}, announce=False)
    train.resolve_config({"arch": "vit-mini", "depth": 1, "max_steps": 1}, announce=False)  # one block


def test_a_depth_named_twice_in_eval_depths_is_refused():
    """Each depth is evaluated and shown once: a second 4 would be dropped without a word."""
    with pytest.raises(SystemExit, match=r"^train.py: error: --eval-depths must name each depth once; "
                                         r"got '4,2,4'$"):
        train.resolve_config({"eval_depths": "4,2,4", "max_steps": 1}, announce=False)


def test_a_subset_larger_than_the_data_set_says_it_takes_all(fashion_mnist_dir, capsys):
    import torch
    from lib import tasks
    cfg = train.resolve_config({"data_dir": str(fashion_mnist_dir), "test_subset": 20000, "train_subset": 512,
                                "max_steps": 1}, announce=False)
    tasks.build(cfg, 0, 1, torch.device("cpu"), None)
    printed = capsys.readouterr().out
    said = ("override: test_subset=10000 (fashion-mnist has 10,000 test images, fewer than "
            "--test-subset 20000)")
    assert said in printed and "train_subset" not in printed, printed
