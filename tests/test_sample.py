"""`python alternet.py sample CKPT`: text from a trained checkpoint, with per-token iteration marks.

The checkpoint is a tiny AlterNet trained for 2 steps by train.main on a small ASCII text written
to a temporary folder (vocab_size 128, so bytes >= 128 are outside its vocabulary).
"""
import dataclasses
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import alternet
import revit
import train
from checkpoint import atomic_save, load_model, primitive

ROOT = Path(__file__).resolve().parent.parent


def ascii_corpus(n_sentences=300, seed=0):
    words = "the a king queen sword crown river stone speaks runs falls rises and but slowly".split()
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(3, 8))) + "." for _ in range(n_sentences))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sample")
    text = folder / "corpus.txt"
    text.write_text(ascii_corpus())
    train.main(["--arch", "alternet-tiny", "--data", str(text), "--out-dir", str(folder / "run"), "--no-progress",
                "--max-steps", "2", "--batch-size", "4", "--block-size", "16", "--eval-iters", "1",
                "--eval-batch-size", "2", "--model-args",
                "dim=32,heads=2,ffn_dim=64,max_depth=3,seq_len=32,vocab_size=128,min_depth_warmup=0"])
    return folder / "run" / "ckpt.pt"


@pytest.fixture(scope="module")
def revit_checkpoint(tmp_path_factory):
    """A vision checkpoint of this project: the wrong kind for `sample`."""
    model = revit.create_model("revit-mini")
    path = tmp_path_factory.mktemp("revit") / "ckpt.pt"
    atomic_save({"arch": "revit-mini", "model_config": primitive(dataclasses.asdict(model.config)),
                       "model": dict(model.state_dict()), "train_config": dataclasses.asdict(train.TrainConfig()),
                       "step": 0}, path)
    return path


def sample(checkpoint, capsys, *flags):
    samples = alternet.main(["sample", str(checkpoint), *flags])
    return samples, capsys.readouterr().out


def test_fixed_seed_is_reproducible(checkpoint, capsys):
    flags = ["--prompt", "the king", "--max-new-tokens", "24", "--seed", "3", "--num-samples", "2"]
    first, printed = sample(checkpoint, capsys, *flags)
    again, printed_again = sample(checkpoint, capsys, *flags)
    assert first == again and printed == printed_again
    assert len(first) == 2 and printed.count("---------------") == 1
    assert all(text.startswith("the king") for text, _ in first)
    other, _ = sample(checkpoint, capsys, *flags[:-4], "--seed", "4", "--num-samples", "2")
    assert other != first


def test_iteration_marks_equal_generate(checkpoint, capsys):
    flags = ["--prompt", "a river", "--max-new-tokens", "30", "--seed", "7", "--halt-threshold", "0.1",
             "--temperature", "1.0", "--top-k", "20", "--show-iterations"]
    [(text, used)], printed = sample(checkpoint, capsys, *flags)
    model, _ = load_model(checkpoint, flag="CKPT")
    prompt = torch.tensor([list(b"a river")])
    torch.manual_seed(7)
    ids, iterations = model.generate(prompt, 30, halt_threshold=0.1, temperature=1.0, top_k=20,
                                     return_iterations=True)
    assert bytes(ids[0].tolist()).decode() == text and iterations[0].tolist() == used
    marks = "".join(str(n) for n in used)
    lines = printed.splitlines()
    assert lines[-2] == marks and len(marks) == 30
    assert lines[-1] == f"mean iterations per generated token: {sum(used) / 30:.2f}"


def test_max_depth_is_respected(checkpoint, capsys):
    flags = ["--prompt", "the", "--max-new-tokens", "20", "--show-iterations"]
    (_, full), = sample(checkpoint, capsys, *flags)[0]
    (_, capped), = sample(checkpoint, capsys, *flags, "--max-depth", "2")[0]
    (_, one), = sample(checkpoint, capsys, *flags, "--max-depth", "1")[0]
    assert max(full) == 3 and max(capped) == 2 and set(one) == {1}


@pytest.mark.parametrize("make_flags, message", [
    (lambda ckpt, rv, tmp: [str(rv)], "CKPT .*ckpt.pt is a checkpoint of 'revit-mini', not of an AlterNet"),
    (lambda ckpt, rv, tmp: [str(tmp / "none.pt")], "CKPT .*none.pt"),
    (lambda ckpt, rv, tmp: [str(ckpt), "--prompt", "café"], "--prompt 'café' has tokens outside this model's "
                                                             r"vocabulary \(ids 0..127; the prompt has 195\)"),
    (lambda ckpt, rv, tmp: [str(ckpt), "--max-depth", "0"], "--max-depth must be >= 1, got 0"),
    (lambda ckpt, rv, tmp: [str(ckpt), "--temperature", "-1"], "--temperature must be >= 0"),
    (lambda ckpt, rv, tmp: [str(ckpt), "--halt-threshold", "1.5"], r"--halt-threshold must be in \(0, 1\]"),
    (lambda ckpt, rv, tmp: [str(ckpt), "--top-k", "500"], "--top-k must be <= vocab_size=128"),
    (lambda ckpt, rv, tmp: [str(ckpt), "--prompt", ""], "--prompt must not be empty"),
])
def test_bad_arguments_give_one_line_errors(checkpoint, revit_checkpoint, tmp_path, make_flags, message):
    with pytest.raises(SystemExit) as exit_info:
        alternet.main(["sample", *make_flags(checkpoint, revit_checkpoint, tmp_path)])
    error = str(exit_info.value.code)
    assert error.startswith("alternet.py sample: error: ") and "\n" not in error
    assert re.search(message, error), error


def test_cli_prints_no_traceback(checkpoint):
    result = subprocess.run([sys.executable, str(ROOT / "alternet.py"), "sample", str(checkpoint), "--max-depth", "0"],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip() == "alternet.py sample: error: --max-depth must be >= 1, got 0"


def test_script_samples_from_a_trained_checkpoint(checkpoint):
    """Run as a script the module is __main__, while the checkpoint loader builds `alternet.AlterNet`:
    a real checkpoint must still be accepted (this once failed only outside the in-process tests)."""
    result = subprocess.run([sys.executable, str(ROOT / "alternet.py"), "sample", str(checkpoint), "--prompt", "the",
                             "--max-new-tokens", "5", "--seed", "1", "--show-iterations"],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("the") and "mean iterations per generated token" in result.stdout
