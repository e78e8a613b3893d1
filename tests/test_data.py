"""data.py: the readers of the built-in data sets, the default text corpus, batches and augmentation."""
import pickle
import re
from pathlib import Path

import pytest
import torch

import data


def test_fashion_mnist_reader(fashion_mnist_dir):
    (xtr, ytr), (xte, yte), classes = data.load_fashion_mnist(Path(fashion_mnist_dir))
    assert xtr.shape == (60000, 1, 28, 28) and xte.shape == (10000, 1, 28, 28) and xtr.dtype == torch.uint8
    assert classes == 10 and set(ytr.unique().tolist()) == set(range(10)) and len(yte) == 10000
    assert torch.bincount(ytr).tolist() == [6000] * 10  # the official split is balanced


def test_cifar_pickle_reader(tmp_path):
    images = torch.randint(0, 256, (2, 3 * 32 * 32), dtype=torch.uint8)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(tmp_path / name, "wb") as f:
            pickle.dump({b"data": images.tolist(), b"labels": [3, 7]}, f)  # the real files hold numpy arrays
    (xtr, ytr), (xte, yte), classes = data.load_cifar(tmp_path, 10)
    assert xtr.shape == (10, 3, 32, 32) and ytr.tolist() == [3, 7] * 5 and classes == 10
    assert torch.equal(xte[1].flatten(), images[1])  # row-major channel planes, as the archive stores them


def test_not_an_idx_file(tmp_path):
    (tmp_path / "x.gz").write_bytes(b"")
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x00\x00\x09\x01" + bytes(8))
    with pytest.raises(ValueError, match="not an uint8 IDX file"):
        data.read_idx(bad)


def test_text_folder_bytes_and_split(tmp_path):
    (tmp_path / "a.txt").write_text("héllo " * 50, encoding="utf-8")
    (tmp_path / "b.txt").write_text("world " * 50, encoding="utf-8")
    train_tokens, val_tokens, tokens_per_byte, vocab = data.load_text(path=str(tmp_path))
    assert vocab == 256 and tokens_per_byte == 1.0 and int(train_tokens.max()) < 256
    assert len(train_tokens) == int(0.9 * (len(train_tokens) + len(val_tokens)))
    assert bytes(train_tokens[:2].tolist()) == "h\u00e9".encode()[:2]


def test_empty_or_binary_text_is_refused(tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="holds no text"):
        data.read_text(path=str(tmp_path / "empty.txt"))
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="not UTF-8"):
        data.read_text(path=str(tmp_path / "bin.txt"))


def test_gpt2_tokenizer_needs_tiktoken():
    try:
        import tiktoken  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="pip install tiktoken"):
            data.tokenize("hello", "gpt2")
    else:
        tokens, per_byte, vocab = data.tokenize("hello world", "gpt2")
        assert vocab == 50257 and 0 < per_byte < 1


def test_grammar_corpus_is_deterministic_english_with_agreement():
    a = data.grammar_corpus(20_000)
    assert a == data.grammar_corpus(20_000) and len(a) >= 20_000 and a != data.grammar_corpus(20_000, seed=1)
    assert a.isascii() and " that " in a and a.count(".") > 100
    assert not re.search(r"\b[Aa] [aeiou]", a)  # "an old cat", never "a old cat"
    number = {w: i for pairs in (data.NOUNS, data.TRANSITIVE, data.INTRANSITIVE) for pair in pairs
              for i, w in enumerate(pair)}
    nouns, verbs = {w for p in data.NOUNS for w in p}, {w for p in data.TRANSITIVE + data.INTRANSITIVE for w in p}
    simple = [re.findall(r"[a-z]+", s.lower()) for s in a.split(".") if " that " not in s]
    pairs = [(next(w for w in s if w in nouns), next(w for w in s if w in verbs)) for s in simple if s]
    assert len(pairs) > 100 and all(number[n] == number[v] for n, v in pairs)  # subject-verb agreement


def test_missing_data_explains_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "data_roots", lambda data_dir="": [tmp_path])
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist.*--download"):
        data.find_builtin("fashion-mnist", str(tmp_path), download=False)


def test_text_windows_reach_the_last_start():
    """Every valid window start 0 .. len - T - 1 is drawn, the last one included."""
    block, tokens = 4, torch.arange(7)  # starts 0, 1, 2 give a window and its next-token targets
    seen = set()
    batches = data.text_batches(tokens, 16, block, seed=0, rank=0, world=1, start_step=0)
    for _ in range(8):
        _, x, y = next(batches)
        assert torch.equal(y, x + 1) and x.shape == (16, block)
        seen |= set(x[:, 0].tolist())
    assert seen == {0, 1, 2}


def test_data_order_is_a_function_of_seed_and_epoch():
    a, b = data.epoch_order(100, 0, 3, 1), data.epoch_order(100, 0, 3, 1)
    assert torch.equal(a, b) and not torch.equal(a, data.epoch_order(100, 0, 4, 1))
    assert sorted(a.tolist()) == list(range(100))
    repeated = data.epoch_order(99, 0, 0, 3)
    assert len(repeated) == 99 and torch.equal(repeated[0::3], repeated[1::3])


def test_augment_shapes_and_soft_targets():
    images, labels = torch.randint(0, 256, (16, 1, 28, 28), dtype=torch.uint8), torch.arange(16) % 10
    table6 = dict(random_crop=True, three_augment=True, color_jitter=0.3, mixup=0.8, cutmix=1.0, label_smoothing=0.1)
    gray = data.ImageData(None, None, 10, 1, 28, [0.286], [0.353])
    augment = data.Augment(gray, torch.device("cpu"), 0, **table6)
    for _ in range(4):  # both mixup and cutmix branches
        x, targets = augment(images, labels)
        assert x.shape == (16, 1, 28, 28) and torch.isfinite(x).all()
        assert targets.shape == (16, 10) and torch.allclose(targets.sum(1), torch.ones(16))
    rgb = data.Augment(data.ImageData(None, None, 100, 3, 32, [0.5] * 3, [0.25] * 3), torch.device("cpu"), 1, **table6)
    x, targets = rgb(torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8), torch.arange(8))
    assert x.shape == (8, 3, 32, 32) and torch.isfinite(x).all() and targets.shape == (8, 100)
    x, targets = data.Augment(gray, torch.device("cpu"), 0)(images[:4], labels[:4])  # all off: normalise only
    assert torch.allclose(x, (images[:4].float() / 255 - 0.286) / 0.353)
    assert torch.equal(targets, torch.nn.functional.one_hot(labels[:4], 10).float())
