"""`python sample.py CKPT`: text from a trained AlterNet checkpoint, with per-token iteration marks.

The checkpoint is a tiny AlterNet trained for 2 steps by train.main on a small ASCII text written
to a temporary folder (vocab_size 128, so bytes >= 128 are outside its vocabulary). The script is
run as a user runs it (a subprocess); the table of hostile inputs calls sample.main in-process (the
same code path, without a Python start-up per row) and checks the one line each must print.
"""
import contextlib
import dataclasses
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import revit
import sample
import train
from lib.checkpoint import atomic_save, load_model, primitive

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
    """A vision checkpoint of this project: the wrong kind for sample.py."""
    model = revit.create_model("revit-mini")
    path = tmp_path_factory.mktemp("revit") / "ckpt.pt"
    atomic_save({"arch": "revit-mini", "model_config": primitive(dataclasses.asdict(model.config)),
                 "model": dict(model.state_dict()), "train_config": dataclasses.asdict(train.TrainConfig()),
                 "step": 0}, path)
    return path


@pytest.fixture(scope="module")
def edited_checkpoint(checkpoint, tmp_path_factory):
    """The trained checkpoint with its model_config's max_depth edited to 10^9."""
    ckpt = torch.load(checkpoint, weights_only=True)
    ckpt["model_config"]["max_depth"] = 10 ** 9
    path = tmp_path_factory.mktemp("edited") / "ckpt.pt"
    atomic_save(ckpt, path)
    return path


@pytest.fixture(scope="module")
def fixed_checkpoint(checkpoint, tmp_path_factory):
    """The trained checkpoint as Model I (halting=False): the same network without its halt heads."""
    ckpt = torch.load(checkpoint, weights_only=True)
    ckpt["model_config"]["halting"] = False
    ckpt["model"] = {k: v for k, v in ckpt["model"].items() if "halt_head" not in k}
    path = tmp_path_factory.mktemp("fixed") / "ckpt.pt"
    atomic_save(ckpt, path)
    return path


def run_script(*args):
    """`python sample.py ARGS` as a user runs it: (return code, stdout, stderr)."""
    result = subprocess.run([sys.executable, str(ROOT / "sample.py"), *map(str, args)], capture_output=True,
                            cwd=ROOT, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return result.returncode, result.stdout.decode(), result.stderr.decode()


def test_script_samples_reproducibly_with_iteration_marks(checkpoint):
    flags = [checkpoint, "--prompt", "the king", "--max-new-tokens", "12", "--seed", "3", "--num-samples", "2",
             "--show-iterations"]
    code, printed, errors = run_script(*flags)
    assert code == 0 and errors == "", errors
    assert run_script(*flags)[1] == printed  # a fixed seed repeats
    first, second = printed.split("---------------\n")
    for block in (first, second):
        text, marks, mean = block[:-1].rsplit("\n", 2)  # the sample may hold newlines of its own
        assert text.startswith("the king") and len(marks) == 12 and set(marks) <= set("123")
        assert mean == f"mean iterations per generated token: {sum(map(int, marks)) / 12:.2f}"


def test_iteration_marks_equal_generate(checkpoint, capsys):
    flags = ["--prompt", "a river", "--max-new-tokens", "30", "--seed", "7", "--halt-threshold", "0.1",
             "--temperature", "1.0", "--top-k", "20", "--show-iterations"]
    [(text, used)] = sample.main([str(checkpoint), *flags])
    lines = capsys.readouterr().out.split("\n")[-3:-1]
    model, _ = load_model(checkpoint, flag="CKPT")
    torch.manual_seed(7)
    ids, iterations = model.generate(torch.tensor([list(b"a river")]), 30, halt_threshold=0.1, temperature=1.0,
                                     top_k=20, return_iterations=True)
    assert bytes(ids[0].tolist()).decode() == text and iterations[0].tolist() == used
    assert lines[-2] == "".join(str(n) for n in used) and len(used) == 30
    assert lines[-1] == f"mean iterations per generated token: {sum(used) / 30:.2f}"


def test_ctrl_c_prints_the_sample_so_far(checkpoint, monkeypatch, capsys):
    """Ctrl-C while sampling: the tokens generated so far (an uninterrupted run's first ones) are printed,
    then one line saying how many."""
    import alternet
    flags = [str(checkpoint), "--prompt", "the", "--max-new-tokens", "10", "--seed", "5"]
    [(full, _)] = sample.main(flags)
    capsys.readouterr()
    generate, calls = alternet.AlterNet.generate, []
    def interrupted(*args, **kwargs):  # Ctrl-C during the 5th token
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return generate(*args, **kwargs)
    monkeypatch.setattr(alternet.AlterNet, "generate", interrupted)
    with pytest.raises(SystemExit) as stopped:
        sample.main(flags)
    assert str(stopped.value) == ("sample.py: stopped by Ctrl-C after 4 of 10 new tokens (printed above); "
                                  "nothing is written")
    assert capsys.readouterr().out == full[:len("the") + 4] + "\n"


def test_max_depth_is_respected(checkpoint, capsys):
    flags = [str(checkpoint), "--prompt", "the", "--max-new-tokens", "20"]
    (_, full), = sample.main(flags)
    (_, capped), = sample.main([*flags, "--max-depth", "2"])
    (_, one), = sample.main([*flags, "--max-depth", "1"])
    assert max(full) == 3 and max(capped) == 2 and set(one) == {1}


def test_top_k_may_name_the_whole_vocabulary(checkpoint, capsys):
    (_, used), = sample.main([str(checkpoint), "--top-k", "128", "--max-new-tokens", "2"])  # vocab_size=128
    assert len(used) == 2


def test_a_fixed_depth_model_runs_every_iteration_and_takes_no_threshold(fixed_checkpoint, capsys):
    """As forward and generate: Model I has no halting rule. Without the flag it runs all D iterations; given
    --halt-threshold it says why, in one line (it is never silently dropped): generate's own contract."""
    (_, used), = sample.main([str(fixed_checkpoint), "--prompt", "the", "--max-new-tokens", "8"])
    assert set(used) == {3}
    with pytest.raises(SystemExit, match=r"halt_threshold must be None, .* with halting=False \(fixed depth\)"):
        sample.main([str(fixed_checkpoint), "--prompt", "the", "--halt-threshold", "0.5"])


HOSTILE = [  # (arguments after CKPT, or a whole argument list; the one line sample.py must print)
    (["{revit}"], r"CKPT .*ckpt.pt is a checkpoint of 'revit-mini', not of an AlterNet"),
    (["{tmp}/none.pt"], "CKPT .*none.pt: no such file"),
    (["{tmp}"], "CKPT .*: a folder, not a file"),
    (["{tmp}/text.pt"], "CKPT .*text.pt: "),
    (["{edited}"], r"CKPT .*ckpt.pt: its model_config has max_depth=1000000000; at most 256"),
    (["{ckpt}", "--prompt", "café"], r"--prompt 'café' has tokens outside this model's vocabulary \(ids 0..127; "
                                     r"the prompt has 195\)"),
    (["{ckpt}", "--prompt", "\udcff\udcfe"], r"--prompt '\\udcff\\udcfe' is not UTF-8 text"),
    (["{ckpt}", "--prompt", ""], "--prompt '' encodes to no tokens"),
    (["{ckpt}", "--max-new-tokens", str(10 ** 12)], "--max-new-tokens must be in 0..100,000; got 1000000000000"),
    (["{ckpt}", "--max-new-tokens", "-1"], "--max-new-tokens must be in 0..100,000"),
    (["{ckpt}", "--max-depth", "0"], "--max-depth must be in 1..256; got 0"),
    (["{ckpt}", "--max-depth", str(10 ** 9)], "--max-depth must be in 1..256; got 1000000000"),
    (["{ckpt}", "--temperature", "-1"], r"--temperature must be 0 \(greedy\) or in \[0.001, 100\]"),
    (["{ckpt}", "--temperature", "nan"], r"--temperature must be a finite number; got nan"),
    (["{ckpt}", "--temperature", "1e-320"], r"--temperature must be 0 \(greedy\) or in \[0.001, 100\]"),
    (["{ckpt}", "--halt-threshold", "1.5"], r"--halt-threshold must be in \(0, 1\]"),
    (["{ckpt}", "--halt-threshold", "nan"], "--halt-threshold must be a finite number; got nan"),
    (["{ckpt}", "--top-k", "500"], r"^sample.py: error: --top-k must be in 1..128 \(this model's vocabulary\); "
                                   r"got 500$"),
    (["{ckpt}", "--top-k", "0"], "--top-k must be in 1..1,048,576"),
    (["{ckpt}", "--num-samples", "0"], "--num-samples must be in 1..1,000"),
    (["{ckpt}", "--num-samples", str(10 ** 6)], "--num-samples must be in 1..1,000"),
    (["{ckpt}", "--seed", "-1"], "--seed must be in 0..4,294,967,295; got -1"),
    (["{ckpt}", "--device", "gpu"], "--device 'gpu': not a device"),
]


@pytest.mark.parametrize("args, message", HOSTILE, ids=[f"{i}" for i in range(len(HOSTILE))])
def test_hostile_inputs_get_one_line(checkpoint, revit_checkpoint, edited_checkpoint, tmp_path, args, message):
    (tmp_path / "text.pt").write_text("not a checkpoint")
    names = dict(ckpt=checkpoint, revit=revit_checkpoint, edited=edited_checkpoint, tmp=tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        sample.main([a.format(**names) for a in args])
    error = str(exit_info.value.code)
    assert error.startswith("sample.py: error: ") and "\n" not in error
    assert re.search(message, error), error


def test_script_errors_are_one_line_without_traceback(checkpoint, edited_checkpoint):
    code, _, errors = run_script(checkpoint, "--max-depth", "0")
    assert code != 0 and errors.strip() == "sample.py: error: --max-depth must be in 1..256; got 0"
    # bytes that are not UTF-8, as a shell passes them ($'\xff\xfe')
    result = subprocess.run([sys.executable, str(ROOT / "sample.py"), str(checkpoint), "--prompt", b"\xff\xfe"],
                            capture_output=True, cwd=ROOT, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    errors = result.stderr.decode()
    assert result.returncode != 0 and "Traceback" not in errors and errors.count("\n") == 1
    assert errors.startswith("sample.py: error: --prompt ") and "is not UTF-8 text" in errors


def test_a_checkpoint_naming_gpt2_cannot_make_tiktoken_fetch(checkpoint, tmp_path, fetching_tiktoken):
    """tiktoken fetches its encoding files when they are not cached: a checkpoint whose train_config names the
    gpt2 tokenizer must not make sample.py reach the network (a stand-in tiktoken tries to connect)."""
    ckpt = torch.load(checkpoint, weights_only=True)
    ckpt["train_config"]["tokenizer"] = "gpt2"
    path = tmp_path / "gpt2.pt"
    atomic_save(ckpt, path)
    with pytest.raises(SystemExit) as exit_info:
        sample.main([str(path)])
    error = str(exit_info.value.code)
    assert error.startswith("sample.py: error: the gpt2 tokenizer needs") and "\n" not in error, error
    assert fetching_tiktoken == ["no --download"]  # refused before any lookup or connection


def test_a_diverged_model_is_one_line_whichever_check_finds_it(checkpoint, tmp_path, monkeypatch, capsys):
    """Finite weights near float32's limit: the loader's example input finds them (load_model). A model that
    overflows only on some prompt reaches the sampler: logits that are not finite are a ValueError there (no
    answer for argmax or multinomial), sample.py's one line, and no sample in train.py's evaluation."""
    import alternet
    from lib.language import LanguageTask
    ckpt = torch.load(checkpoint, weights_only=True)
    for weight in ckpt["model"].values():
        weight.fill_(1e30) if weight.is_floating_point() else None
    atomic_save(ckpt, tmp_path / "huge.pt")
    with pytest.raises(SystemExit, match=r"^sample.py: error: CKPT .*huge.pt: its weights are finite but its "
                                         r"output is not \(NaN or inf on an example input\)"):
        sample.main([str(tmp_path / "huge.pt")])
    for logits in (torch.tensor([[0.0, float("nan")]]), torch.tensor([[float("inf"), 0.0]])):
        for temperature in (0.0, 0.8):
            with pytest.raises(ValueError, match="next-token logits are not finite"):
                alternet.sample_next_token(logits, temperature, None)
    def refused(*args):  # as the sampler refuses a bad argument
        raise ValueError("temperature must be >= 0, got -1")
    monkeypatch.setattr(alternet, "sample_next_token", refused)
    with pytest.raises(SystemExit, match=r"^sample.py: error: CKPT .*ckpt.pt: temperature must be >= 0"):
        sample.main([str(checkpoint)])  # any ValueError of the sampler: one line naming the checkpoint
    model, _ = load_model(checkpoint, flag="CKPT")
    task = LanguageTask(train.TrainConfig(), torch.zeros(40, dtype=torch.long), 1.0, 16, torch.device("cpu"),
                        contextlib.nullcontext)
    task.print_sample(model, None)
    assert capsys.readouterr().out.startswith("sample: none (temperature must be >= 0")
