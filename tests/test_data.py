"""data.py: the readers of the built-in data sets, the default text corpus, batches and augmentation."""
import gzip
import os
import pickle
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lib import data, language


def test_fashion_mnist_reader(fashion_mnist_dir):
    (xtr, ytr), (xte, yte), classes = data.load_fashion_mnist(Path(fashion_mnist_dir))
    assert xtr.shape == (60000, 1, 28, 28) and xte.shape == (10000, 1, 28, 28) and xtr.dtype == torch.uint8
    assert classes == 10 and set(ytr.unique().tolist()) == set(range(10)) and len(yte) == 10000
    assert torch.bincount(ytr).tolist() == [6000] * 10  # the official split is balanced


def test_not_an_idx_file(tmp_path):
    (tmp_path / "x.gz").write_bytes(b"")
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x00\x00\x09\x01" + bytes(8))
    with pytest.raises(ValueError, match="not an uint8 IDX file"):
        data.read_idx(bad)


def test_text_folder_bytes_and_split(tmp_path):
    (tmp_path / "a.txt").write_text("héllo " * 50, encoding="utf-8")
    (tmp_path / "b.txt").write_text("world " * 50, encoding="utf-8")
    train_tokens, val_tokens, tokens_per_byte, vocab = language.load_text(path=str(tmp_path))
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
            language.tokenize("hello", language.text_codec("gpt2"))
    else:  # its files cached: the encoding loads offline; not cached: one line asking for --download
        try:
            tokens, per_byte, vocab = language.tokenize("hello world", language.text_codec("gpt2"))
        except ValueError as e:
            assert "with --download" in str(e)
        else:
            assert vocab == 50257 and 0 < per_byte < 1


def test_the_gpt2_tokenizer_reaches_the_network_only_with_download(fetching_tiktoken):
    """tiktoken fetches its encoding files when they are not cached: a tokenizer named by a checkpoint or a
    flag must not make that fetch without --download (a stand-in tiktoken tries to connect)."""
    with pytest.raises(ValueError, match="it fetches its files once, with --download"):
        language.tokenize("hello", language.text_codec("gpt2"))
    assert fetching_tiktoken == ["no --download"]  # refused before any lookup or connection


def test_an_evaluations_sample_is_decoded_by_the_tokenizer_the_run_built(tmp_path, monkeypatch, capsys):
    """The tokenizer is built once, by language.build (gpt2's means tiktoken's files, offline): the sample
    printed at every evaluation decodes with that one, never builds another."""
    import train
    (tmp_path / "a.txt").write_text("the cats that sleep run. " * 80)
    cfg = train.TrainConfig(arch="alternet-tiny", dataset="text", data=str(tmp_path / "a.txt"), block_size=16,
                            batch_size=4, max_steps=1)
    model, task, *_ = language.build(cfg, 0, 1, torch.device("cpu"), None)
    monkeypatch.setattr(language, "text_codec", lambda *args: pytest.fail("the tokenizer was built again"))
    task.sample_tokens = 8
    task.print_sample(model.eval(), None)
    assert re.fullmatch(r"sample: 'the cats that sl.*' -> '.*' \(\d\.\d\d iterations per token\)\n",
                        capsys.readouterr().out)


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
    # find_builtin serves commands without --download too (tools.analyze): the hint names one that has it
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist.*train.py --download"):
        data.find_builtin("fashion-mnist", str(tmp_path), download=False)


def test_a_cut_archive_leaves_no_data_that_looks_whole(tmp_path, monkeypatch):
    """--download of a CIFAR archive cut short: one error, and no half-extracted folder a later run would
    take for the data set (the archive's members land in a staging folder first)."""
    import io
    import random
    import tarfile
    whole = io.BytesIO()
    with tarfile.open(fileobj=whole, mode="w:gz") as tar:
        for name in ("test_batch", "data_batch_1"):
            member = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            member.size = 200_000
            tar.addfile(member, io.BytesIO(random.randbytes(member.size)))
    monkeypatch.setattr(data, "data_roots", lambda data_dir="": [tmp_path])
    monkeypatch.setattr(data, "fetch", lambda url, path: path.write_bytes(whole.getvalue()[:300_000]))
    with pytest.raises(FileNotFoundError, match="cifar10 not found.*the download failed"):
        data.find_builtin("cifar10", str(tmp_path), download=True)
    assert not (tmp_path / "cifar-10-batches-py").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["cifar-10-python.tar.gz"]  # no staging folder left


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


def test_mixup_and_cutmix_weigh_each_target_by_what_its_image_holds():
    """timm's batch mode (the DeiT III recipe): image i is mixed with image B-1-i and its target is
    lam y_i + (1 - lam) y_(B-1-i), lam the pixel weight (mixup) or the share of image i left after the box
    was clipped to the image (cutmix: not the sampled lam). Each image is one grey level and its partner's
    label differs, so lam is read from the pixels and compared with the targets."""
    B, smoothing = 10, 0.1
    levels = torch.arange(B) * 20 + 10
    images = levels.to(torch.uint8).view(B, 1, 1, 1).expand(B, 1, 28, 28).contiguous()
    labels = torch.arange(B)
    plain = data.ImageData(None, None, 10, 1, 28, [0.0], [1.0])
    own, partner = (levels.float() / 255).view(B, 1, 1, 1), (levels.flip(0).float() / 255).view(B, 1, 1, 1)
    smoothed = torch.eye(10) * (1 - smoothing) + smoothing / 10
    for kind in ("mixup", "cutmix"):
        augment = data.Augment(plain, torch.device("cpu"), 0, **{kind: 1.0}, label_smoothing=smoothing)
        for _ in range(6):
            x, targets = augment(images, labels)
            if kind == "mixup":
                lam = ((x - partner) / (own - partner)).flatten(1)
                assert torch.allclose(lam, lam[:1, :1].expand_as(lam), atol=1e-5)
                lam = lam[:, 0]
            else:
                from_own = torch.isclose(x, own.expand_as(x)).flatten(1).float().mean(1)
                from_partner = torch.isclose(x, partner.expand_as(x)).flatten(1).float().mean(1)
                assert torch.equal(from_own + from_partner, torch.ones(B))
                lam = from_own
            expected = lam[:, None] * smoothed[labels] + (1 - lam[:, None]) * smoothed[labels.flip(0)]
            torch.testing.assert_close(targets, expected, atol=1e-5, rtol=0)


# --- hostile data folders: nothing runs, every problem is one line naming the file ---


class WritesMarker:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


# data_batch_1 as Python 2 pickled it (protocol 2, str as SHORT_BINSTRING, numpy 1.x global names):
# {'data': uint8 array (2, 3072), 'labels': [1, 2]}, the layout of the official archive
PY2_PIXELS = bytes(range(256)) * 24
PY2_ARCHIVE = (b"\x80\x02}q\x00(U\x04dataq\x01cnumpy.core.multiarray\n_reconstruct\nq\x02cnumpy\nndarray\nq\x03K\x00"
               b"\x85U\x01b\x87Rq\x04(K\x01K\x02M\x00\x0c\x86cnumpy\ndtype\nq\x05U\x02u1K\x00K\x01\x87Rq\x06(K\x03U\x01|"
               b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb\x89T\x00\x18\x00\x00" + PY2_PIXELS +
               b"tbU\x06labelsq\x07]q\x08(K\x01K\x02eu.")


def test_cifar_python2_archive_is_read_without_numpy(tmp_path, monkeypatch):
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (tmp_path / name).write_bytes(PY2_ARCHIVE)
    monkeypatch.setitem(__import__("sys").modules, "numpy", None)  # never imported: arrays are read as bytes
    (xtr, ytr), (xte, yte), classes = data.load_cifar(tmp_path, 10)
    assert xtr.shape == (10, 3, 32, 32) and ytr.tolist() == [1, 2] * 5 and classes == 10
    assert torch.equal(xte.flatten(), torch.tensor(list(PY2_PIXELS), dtype=torch.uint8))  # planes, row-major


@pytest.mark.parametrize("protocol", [2, 5])
def test_cifar_archives_repickled_by_numpy_are_read(tmp_path, protocol):
    """numpy arrays pickled by Python 3 (protocol 2: bytes through _codecs.encode; 5: _frombuffer)."""
    np = pytest.importorskip("numpy")
    pixels = np.arange(2 * 3072, dtype=np.uint8).reshape(2, 3072)
    (tmp_path / "batch").write_bytes(pickle.dumps({b"data": pixels, b"labels": [4, 9]}, protocol=protocol))
    images, labels = data.read_cifar_batch(tmp_path / "batch", b"labels", 10)
    assert torch.equal(images.flatten(), torch.from_numpy(pixels).flatten()) and labels.tolist() == [4, 9]


def test_a_cifar_archive_that_pickles_code_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (tmp_path / name).write_bytes(pickle.dumps({b"data": WritesMarker(marker), b"labels": [0]}))
    with pytest.raises(ValueError) as info:
        data.load_cifar(tmp_path, 10)
    assert "data_batch_1: not a CIFAR python archive (it refers to the Python object io.open" in str(info.value)
    assert not marker.exists() and "\n" not in str(info.value)


ROWS = "not a CIFAR python archive (a dict of b'data', N rows of 3072 bytes (uint8), and b'labels', a list of N"


@pytest.mark.parametrize("edit, needle", [
    (lambda a: a.replace(b"(K\x01K\x02eu.", b"(K\x01eu."), ROWS),
    (lambda a: a.replace(b"(K\x01K\x02eu.", b"(K\x01K\neu."), ROWS),
    (lambda a: a.replace(b"(K\x01K\x02eu.", b"(]q\t(K\x01eK\x02eu."), ROWS),
    (lambda a: a.replace(b"U\x02u1", b"U\x02i1"), ROWS),  # int8
    (lambda a: a.replace(b"M\x00\x0c\x86", b"M\x00\x06\x86"), ROWS),  # rows of 1536
    (lambda a: a.replace(b"K\x02M\x00\x0c", b"K\x03M\x00\x0c"), ROWS),  # 3 rows, the bytes of 2
    (lambda a: pickle.dumps({b"data": [[0] * 3072], b"labels": [0]}), ROWS),  # the official files: arrays
    (lambda a: pickle.dumps({b"data": "pixels", b"labels": [0]}), ROWS),
    (lambda a: pickle.dumps({b"labels": [0]}), ROWS),
    (lambda a: pickle.dumps([1, 2, 3]), "not a CIFAR python archive"),
])
def test_cifar_archives_with_wrong_contents(tmp_path, edit, needle):
    (tmp_path / "batch").write_bytes(edit(PY2_ARCHIVE))
    with pytest.raises(ValueError, match=re.escape(needle)):
        data.read_cifar_batch(tmp_path / "batch", b"labels", 10)


def test_torn_cifar_archive(tmp_path):
    (tmp_path / "batch").write_bytes(PY2_ARCHIVE[:500])
    with pytest.raises(ValueError, match="batch: not a CIFAR python archive"):
        data.read_cifar_batch(tmp_path / "batch", b"labels", 10)


def idx_bytes(count, stored):
    return b"\x00\x00\x08\x01" + count.to_bytes(4, "big") + bytes(stored)


@pytest.mark.parametrize("make, needle", [
    (lambda p: p.write_bytes(bytes(range(256)) * 4), "cannot be read (Not a gzipped file"),
    (lambda p: p.write_bytes(gzip.compress(idx_bytes(100, 100))[:-12]), "cannot be read (Compressed file ended"),
    (lambda p: p.write_bytes(gzip.compress(idx_bytes(100, 60))), "header (100) counts the 60 bytes it holds"),
    (lambda p: p.write_bytes(gzip.compress(b"\x00\x00\x08\x09")), "not an uint8 IDX file of 1 to 4 dimensions whose header"),
    (lambda p: p.write_bytes(gzip.compress(idx_bytes(0, 0))), "header (0) counts the 0 bytes"),
    (lambda p: p.symlink_to(p), "cannot be read (Too many levels"),
    (lambda p: p.mkdir(), "cannot be read (Is a directory)"),
])
def test_bad_idx_files_are_one_line(tmp_path, make, needle):
    make(tmp_path / "x.gz")
    with pytest.raises(ValueError) as info:
        data.read_idx(tmp_path / "x.gz")
    assert needle in str(info.value) and "\n" not in str(info.value) and str(tmp_path / "x.gz") in str(info.value)


def test_a_fashion_mnist_folder_of_random_files(tmp_path):
    for name in data.FMNIST_FILES:
        (tmp_path / name).write_bytes(bytes(range(256)))
    with pytest.raises(ValueError, match="train-images-idx3-ubyte.gz: cannot be read"):
        data.load_images("fashion-mnist", data_dir=str(tmp_path))


def test_a_data_file_larger_than_the_bound_is_refused(tmp_path, monkeypatch):
    """Every reader reads through read_file, which stops at MAX_FILE_BYTES (shrunk here to 100 bytes)."""
    monkeypatch.setattr(data, "MAX_FILE_BYTES", 100)
    (tmp_path / "big.txt").write_text("x" * 101)
    with pytest.raises(ValueError, match=r"big.txt: larger than 100 bytes"):
        data.read_text(path=str(tmp_path / "big.txt"))
    (tmp_path / "big.txt").write_text("x" * 100)
    assert data.read_text(path=str(tmp_path / "big.txt")) == "x" * 100


def image_folder(root: Path, classes=("cat", "dog"), per_class=3) -> Path:
    """An ImageFolder tree root/{train,val}/CLASS/N.jpg of small JPEGs."""
    Image = pytest.importorskip("PIL.Image", reason="Pillow not installed (requirements-extra.txt)")
    for split in ("train", "val"):
        for name in classes:
            (root / split / name).mkdir(parents=True)
            for i in range(per_class):
                Image.new("RGB", (12, 10), (40 * i, 90, 0)).save(root / split / name / f"{i}.jpg")
    return root


def test_an_image_folder_subset_spreads_over_its_classes(tmp_path):
    """Folder files are sorted by class: N of them spread evenly (the built-in sets' first N are mixed)."""
    pytest.importorskip("torchvision", reason="an image folder needs torchvision (requirements-extra.txt)")
    root = image_folder(tmp_path)
    whole = data.load_images("imagenet", data=str(root), workers=1)
    images = data.load_images("imagenet", data=str(root), train_subset=4, test_subset=2, workers=1)
    assert (len(whole.train), len(whole.test), len(images.train), len(images.test)) == (6, 6, 4, 2)
    assert images.train.dataset.samples == [whole.train.dataset.samples[i] for i in (0, 1, 3, 4)]
    assert images.test.dataset.samples == [whole.test.dataset.samples[i] for i in (0, 3)]  # cat/0, dog/0


def test_load_images_gives_each_folder_split_its_subset(tmp_path, monkeypatch):
    """Where torchvision is not installed: the subset each split of the folder is given, and how
    FolderImages spreads it over the class-sorted files (its torchvision part replaced)."""
    from types import SimpleNamespace
    monkeypatch.setattr(data, "FolderImages", lambda root, size, train, workers, subset: SimpleNamespace(
        dataset=SimpleNamespace(classes=["cat"]), subset=subset))
    images = data.load_images("imagenet", data=str(tmp_path), train_subset=4, test_subset=2)
    assert (images.train.subset, images.test.subset) == (4, 2)
    assert data.load_images("imagenet", data=str(tmp_path)).train.subset == 0


@given(st.integers(1, 300), st.integers(0, 400))
@settings(max_examples=60, deadline=None)
def test_a_folder_subset_is_evenly_spaced_over_the_class_sorted_files(size, n):
    files = list(range(size))  # stand-ins for (path, class) pairs, sorted by class
    picked, n = data.spread(files, n), min(n, size) or size  # 0: all of them
    assert len(picked) == n and picked[0] == 0
    gaps = {b - a for a, b in zip(picked, picked[1:])}
    assert gaps <= {size // n, -(-size // n)}  # no stretch of the files skipped


def truncate(path: Path) -> Path:
    path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])
    return path


def test_an_unreadable_image_is_a_value_error_naming_it(tmp_path):
    root = image_folder(tmp_path)
    cut, junk = truncate(root / "train" / "cat" / "1.jpg"), root / "train" / "dog" / "2.jpg"
    junk.write_bytes(b"not an image")
    assert data.read_rgb(str(root / "train" / "cat" / "0.jpg")).size == (12, 10)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(cut))}: not a readable image \(.+\)$"):
        data.read_rgb(str(cut))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(junk))}: not a readable image \(cannot identify"):
        data.read_rgb(str(junk))


class Files(list):
    """Paths read by data.read_rgb one per item, as torchvision's ImageFolder reads them (it is optional)."""

    def __getitem__(self, i):
        return torch.tensor(data.read_rgb(super().__getitem__(i)).size)


def test_an_unreadable_image_read_by_a_worker_ends_in_one_line_naming_it(tmp_path):
    """A DataLoader worker's error reaches the main process as its traceback: the one line is its last."""
    root = image_folder(tmp_path)
    cut = truncate(root / "train" / "dog" / "1.jpg")
    folder = data.FolderImages.__new__(data.FolderImages)
    folder.dataset, folder.workers = Files(sorted(map(str, (root / "train").rglob("*.jpg")))), 1
    with pytest.raises(SystemExit) as stopped:
        list(folder.batches([torch.arange(3), torch.arange(3, 6)]))
    assert re.fullmatch(rf"\S+: error: --data {re.escape(str(cut))}: not a readable image \(.+\)",
                        str(stopped.value))


def test_an_unreadable_image_in_an_image_folder_stops_training_in_one_line(tmp_path):
    pytest.importorskip("torchvision", reason="an image folder needs torchvision (requirements-extra.txt)")
    root = image_folder(tmp_path)
    cut = truncate(root / "train" / "cat" / "2.jpg")
    images = data.load_images("imagenet", data=str(root), workers=2)
    with pytest.raises(SystemExit, match=rf"^train.py: error: --data {re.escape(str(cut))}: not a readable"):
        list(images.train.batches([torch.arange(6)]))
