"""Data for train.py: images (Fashion-MNIST, CIFAR-10/100 through an allow-list unpickler, ImageFolder
trees), text (UTF-8 files, tinyshakespeare, grammar_corpus()) and the DeiT III batch augmentation of the
reViT paper's Table 6 (arXiv 2610.12448). A bad file is a ValueError / FileNotFoundError naming it; nothing
here touches the network unless asked (`download=True`).
"""

from __future__ import annotations

import gzip
import io
import itertools
import math
import os
import pickle
import random
import shutil
import tarfile
import tempfile
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from einops import rearrange

from lib.boundary import fail


# --- where the built-in data sets live ---

IMAGE_DATASETS = ("fashion-mnist", "cifar10", "cifar100", "imagenet", "planted")  # train.py --dataset
TEXT_DATASETS = ("grammar", "tinyshakespeare", "text")  # ... text: an AlterNet preset's

URLS = {
    "fashion-mnist": "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
    "cifar10": "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
    "cifar100": "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
    "tinyshakespeare": "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/"
                       "input.txt",
}
FMNIST_FILES = ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"]
BUILTIN = {  # name: (subfolder, the file that marks it, how to get it)
    "fashion-mnist": ("fashion-mnist", "t10k-labels-idx1-ubyte.gz",
                      f"`apt-get install dataset-fashion-mnist`, or download {', '.join(FMNIST_FILES)} "
                      f"from {URLS['fashion-mnist']}"),
    "cifar10": ("cifar-10-batches-py", "test_batch", f"download and unpack {URLS['cifar10']}"),
    "cifar100": ("cifar-100-python", "test", f"download and unpack {URLS['cifar100']}"),
    "tinyshakespeare": ("", "tinyshakespeare.txt", f"download {URLS['tinyshakespeare']} as "
                                                   "tinyshakespeare.txt"),
}
NORMALISATION = {  # per-channel mean, std of the training set
    "fashion-mnist": ([0.2860], [0.3530]),
    "cifar10": ([0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]),
    "cifar100": ([0.5071, 0.4865, 0.4409], [0.2673, 0.2564, 0.2762]),
    "imagenet": ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    "planted": ([128 / 255] * 3, [48 / 255] * 3),  # the bytes' offset and scale (lib/data.planted_images)
}


def data_roots(data_dir: str = "") -> list[Path]:
    """The search order: data_dir (default ./data), $REVIT_DATA_DIR, Debian's /usr/share/datasets."""
    roots = [Path(data_dir or "data")]
    if os.environ.get("REVIT_DATA_DIR"):
        roots.append(Path(os.environ["REVIT_DATA_DIR"]))
    return roots + [Path("/usr/share/datasets")]


def find_builtin(name: str, data_dir: str = "", download: bool = False) -> Path:
    """The folder holding data set `name`: search the roots, else download when asked, else explain."""
    subfolder, marker, how = BUILTIN[name]
    for root in data_roots(data_dir):
        for folder in (root / subfolder, root):
            if (folder / marker).exists():
                return folder
    target, where = Path(data_dir or "data"), ", ".join(map(str, data_roots(data_dir)))
    failed = " (or let train.py --download fetch it, or point --data-dir at a folder that has it)"
    if download:
        try:
            download_builtin(name, target)
            return target / subfolder
        except (OSError, EOFError, tarfile.TarError) as e:  # EOFError, TarError: a cut archive
            failed = f" (the download failed: {e})"
    raise FileNotFoundError(f"{name} not found in {where}. To get it: {how}, into {target}/{failed}")


def fetch(url: str, path: Path) -> None:
    """Download to a temp name, then rename: an interrupted download never looks like data."""
    tmp = path.with_name(path.name + ".part")
    with urllib.request.urlopen(url, timeout=60) as response, open(tmp, "wb") as f:
        f.write(response.read())
    os.replace(tmp, path)


def download_builtin(name: str, target: Path) -> None:
    print(f"downloading {name} into {target} ...")
    folder = target / BUILTIN[name][0] if name == "fashion-mnist" else target  # the archives hold theirs
    folder.mkdir(parents=True, exist_ok=True)
    if name == "fashion-mnist":
        for file in FMNIST_FILES:
            fetch(URLS[name] + file, folder / file)
    elif name == "tinyshakespeare":
        fetch(URLS[name], target / "tinyshakespeare.txt")
    else:
        fetch(URLS[name], target / Path(URLS[name]).name)
        staging = Path(tempfile.mkdtemp(dir=target, prefix=".extracting-"))  # torn: never looks like data
        try:
            with tarfile.open(target / Path(URLS[name]).name) as tar:
                tar.extractall(staging, filter="data")
            os.replace(staging / BUILTIN[name][0], target / BUILTIN[name][0])
        finally:
            shutil.rmtree(staging)


# --- the readers: every data file's bytes come through read_file ---


MAX_FILE_BYTES = 1 << 30  # a data file, decompressed: 6x CIFAR-10's whole training set (our bound)


def read_file(path: Path) -> bytes:
    """The bytes of a data file (.gz decompressed), at most MAX_FILE_BYTES; ValueError naming the file."""
    try:
        with (gzip.open(path) if path.suffix == ".gz" else open(path, "rb")) as f:
            raw = f.read(MAX_FILE_BYTES + 1)
        if len(raw) <= MAX_FILE_BYTES:
            return raw
        reason = f"larger than {MAX_FILE_BYTES:,} bytes (our bound for a data file)"
    except (OSError, EOFError, zlib.error) as e:  # BadGzipFile is an OSError; a cut-short .gz an EOFError
        reason = f"cannot be read ({getattr(e, 'strerror', None) or str(e) or 'cut short'})"
    raise ValueError(f"{path}: {reason}")


def read_idx(path: Path) -> torch.Tensor:
    """IDX format (LeCun): 2 zero bytes, dtype code 0x08 (uint8), rank, big-endian dims, data."""
    raw = read_file(path)
    rank = raw[3] if raw[:3] == b"\x00\x00\x08" and len(raw) >= 4 else 0
    header = 4 + 4 * rank
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(rank)]
    if not 1 <= rank <= 4 or not 0 < math.prod(dims) == len(raw) - header:  # frombuffer refuses b""
        raise ValueError(f"{path} is not an uint8 IDX file of 1 to 4 dimensions whose header "
                         f"({'x'.join(map(str, dims)) or 'none'}) counts the {len(raw) - header} bytes "
                         "it holds")
    return torch.frombuffer(bytearray(raw[header:]), dtype=torch.uint8).view(*dims)


def load_fashion_mnist(folder: Path):
    """-> ((train images (N, 1, 28, 28) uint8, labels), (test images, labels), 10)."""
    def split(prefix):
        images = read_idx(Path(folder) / f"{prefix}-images-idx3-ubyte.gz")
        labels = read_idx(Path(folder) / f"{prefix}-labels-idx1-ubyte.gz")
        if images.shape[1:] != (28, 28) or labels.shape != images.shape[:1] or labels.max() > 9:
            raise ValueError(f"{folder}: the {prefix} files are not Fashion-MNIST (28x28 images, one "
                             f"label 0-9 per image); got images {tuple(images.shape)}, labels "
                             f"{tuple(labels.shape)}")
        return images.unsqueeze(1), labels.long()  # (N, 1, 28, 28)
    return split("train"), split("t10k"), 10


class Stored:
    """What an allowed global of a CIFAR archive builds (a numpy array or dtype), kept as plain data: its
    arguments and its pickled state. numpy is never imported and nothing of the file is called."""

    def __init__(self, *args):
        self.args, self.state = args, None

    def __setstate__(self, state):
        self.state = state

    @classmethod
    def from_buffer(cls, buffer, dtype, shape, order="C"):
        """numpy 2's protocol-5 array (_frombuffer), kept as protocol 2 stores one."""
        array = cls()
        array.state = (1, shape, dtype, order != "C", buffer)
        return array


ALLOWED = {  # every global a CIFAR archive may name (numpy 1.x's and 2.x's module names); nothing else loads
    ("numpy.core.multiarray", "_reconstruct"): Stored, ("numpy._core.multiarray", "_reconstruct"): Stored,
    ("numpy.core.numeric", "_frombuffer"): Stored.from_buffer,
    ("numpy._core.numeric", "_frombuffer"): Stored.from_buffer,
    ("numpy", "ndarray"): Stored, ("numpy", "dtype"): Stored,
    ("_codecs", "encode"): lambda text, encoding: text.encode("latin1"),  # bytes, as Python 3 pickles them
}


class ArchiveUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in ALLOWED:  # a class, os.system, ...: refused before it is looked up
            raise pickle.UnpicklingError(f"it refers to the Python object {module}.{name}, which a data "
                                         "archive never holds (refused, nothing run)")
        return ALLOWED[(module, name)]


def read_cifar_batch(path: Path, label_key: bytes, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One file of the archive -> (images (N, 3, 32, 32) uint8, labels (N,) int64)."""
    raw = read_file(path)
    reason = (f"a dict of {b'data'!r}, N rows of 3072 bytes (uint8), and {label_key!r}, a list of N labels "
              f"in 0..{classes - 1}")
    try:
        batch = ArchiveUnpickler(io.BytesIO(raw), encoding="bytes").load()  # the archive is Python 2's
        _, (n, width), dtype, fortran, pixels = batch[b"data"].state  # a C-ordered uint8 array (n, 3072)
        labels = batch[label_key]
        if (dtype.args[0] in ("u1", b"u1") and not fortran and width == 3072 and len(pixels) == 3072 * n > 0
                and type(labels) is list and len(labels) == n  # a flat list: it cannot expand
                and all(type(y) is int and 0 <= y < classes for y in labels)):
            images = torch.frombuffer(bytearray(pixels), dtype=torch.uint8).view(n, 3, 32, 32)
            return images, torch.tensor(labels)
    except pickle.UnpicklingError as e:  # torn, or a global off the allow-list (refused, nothing run)
        reason = " ".join(str(e).split())[:200]
    except Exception:  # noqa: BLE001 -- whatever else a crafted pickle raises, the file is unusable
        pass
    raise ValueError(f"{path}: not a CIFAR python archive ({reason})")


def load_cifar(folder: Path, classes: int):
    """The official python archives -> ((train (N, 3, 32, 32) uint8, labels), (test ...), classes)."""
    label_key = b"labels" if classes == 10 else b"fine_labels"

    def read(names):
        images, labels = zip(*(read_cifar_batch(Path(folder) / name, label_key, classes) for name in names))
        return torch.cat(images), torch.cat(labels)
    if classes == 10:
        return read([f"data_batch_{i}" for i in range(1, 6)]), read(["test_batch"]), 10
    return read(["train"]), read(["test"]), 100


class TensorImages:
    """A whole image data set as uint8 tensors (N, C, H, W); batches are index gathers."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.labels)

    def batches(self, index_batches):
        for idx in index_batches:
            idx = idx.to(self.images.device)  # a set on the GPU is gathered there (a no-op on the CPU)
            yield self.images[idx], self.labels[idx]


class FolderImages:
    """An ImageFolder tree read by torchvision (resize/crop on CPU workers; the rest on the device)."""

    def __init__(self, root: Path, image_size: int, train: bool, workers: int, subset: int = 0):
        try:
            import torchvision.transforms.v2 as T
            from torchvision.datasets import ImageFolder
        except ImportError:
            raise ValueError("an image folder needs Pillow and the torchvision release of your torch "
                             "(requirements-extra.txt says which)") from None
        bicubic = T.InterpolationMode.BICUBIC
        if train:  # 3-Augment's RandomResizedCrop (scale 0.08-1, bicubic); flips etc. run on the device
            resize = [T.RandomResizedCrop(image_size, scale=(0.08, 1.0), interpolation=bicubic)]
        else:  # evaluation crop ratio 1.0 (Table 6): resize the short side, centre crop
            resize = [T.Resize(image_size, interpolation=bicubic), T.CenterCrop(image_size)]
        self.dataset = ImageFolder(str(root), transform=T.Compose([T.PILToTensor(), *resize]),
                                   loader=read_rgb)  # a bad file: a ValueError naming it
        self.dataset.samples = spread(self.dataset.samples, subset)  # --train-subset / --test-subset
        self.workers = workers

    def __len__(self):
        return len(self.dataset)

    def batches(self, index_batches):
        batches = [idx.tolist() for idx in index_batches]
        loader = torch.utils.data.DataLoader(self.dataset, batch_sampler=batches, num_workers=self.workers,
                                             pin_memory=torch.cuda.is_available())
        try:
            yield from loader
        except ValueError as e:  # read_rgb's, rebuilt here from a worker's traceback: its last line
            fail(f"--data {str(e).splitlines()[-1].removeprefix('ValueError: ')}")


def spread(files: list, n: int) -> list:
    """n of the files, evenly spaced (0: all): a folder's are sorted by class, its first n few classes."""
    n = min(n, len(files)) or len(files)
    return [files[i * len(files) // n] for i in range(n)]


def read_rgb(path: str):
    """An image folder's file as RGB (as torchvision's loader), or a ValueError naming the file."""
    from PIL import Image
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except Exception as e:  # noqa: BLE001 -- PIL's OSError (truncated), SyntaxError, DecompressionBomb...
        raise ValueError(f"{path}: not a readable image ({e})") from None


@dataclass
class ImageData:
    train: object
    test: object
    num_classes: int
    channels: int
    image_size: int
    mean: list
    std: list


def load_images(dataset: str, data: str = "", data_dir: str = "", download: bool = False,
                train_subset: int = 0, test_subset: int = 0, workers: int = 8) -> ImageData:
    """A built-in data set (found under data_dir and the other roots), or an ImageFolder root `data`
    with train/ and val/ (dataset "imagenet")."""
    if dataset == "imagenet":
        if not data:
            raise ValueError("imagenet needs the folder: --data ROOT (an ImageFolder tree with train/ and "
                             "val/)")
        # a missing train/ or val/: ImageFolder's FileNotFoundError names it; 224: Table 6's resolution
        train, test = (FolderImages(Path(data) / split, 224, split == "train", workers, n)
                       for split, n in (("train", train_subset), ("val", test_subset)))
        if train.dataset.classes != test.dataset.classes:  # a label must name the same class in both
            differ = sorted(set(train.dataset.classes) ^ set(test.dataset.classes))
            raise ValueError(f"{data}: val/ must hold the class folders of train/; {len(differ)} are in only "
                             f"one of them ({', '.join(differ[:3])}{', ...' if len(differ) > 3 else ''})")
        return ImageData(train, test, len(train.dataset.classes), 3, 224, *NORMALISATION["imagenet"])
    if dataset == "planted":
        return planted_images(train_subset or PLANTED["train"], test_subset or PLANTED["test"])
    folder = find_builtin(dataset, data_dir, download)
    (xtr, ytr), (xte, yte), classes = (load_fashion_mnist(folder) if dataset == "fashion-mnist" else
                                       load_cifar(folder, 10 if dataset == "cifar10" else 100))
    train, test = slice(train_subset or None), slice(test_subset or None)  # the first N; 0: all of it
    return ImageData(TensorImages(xtr[train], ytr[train]), TensorImages(xte[test], yte[test]), classes,
                     xtr.shape[1], xtr.shape[-1], *NORMALISATION[dataset])


# The planted-depth task (lib/planted.PlantedTask): 16x16x3 "images" generated here from a fixed seed (no
# file, no download); each 4x4x3 patch is one token vector of 48 numbers, x = A z on a random
# `rank`-dimensional subspace (z standard normal, A fixed), stored as bytes 128 + 48 x (clipped at 2.7 sigma):
# a low-dimensional input, so that learning the maps, not the sample count, is what the models compete on.
PLANTED = dict(image_size=16, channels=3, patch_size=4, rank=6, train=8192, test=2048, seed=35)


def planted_images(train: int, test: int) -> ImageData:
    """The planted task's inputs: the same bytes on every machine (one generator, train then test).
    Labels are zeros; the target is a function of the input (lib/planted.PlantedTask)."""
    g = torch.Generator().manual_seed(PLANTED["seed"])
    size, channels, patch, rank = (PLANTED[k] for k in ("image_size", "channels", "patch_size", "rank"))
    grid, n_train, n = size // patch, PLANTED["train"], PLANTED["train"] + PLANTED["test"]
    basis = torch.randn(channels * patch * patch, rank, generator=g) / math.sqrt(rank)  # A: unit-variance
    tokens = torch.randn(n, grid * grid, rank, generator=g) @ basis.T  # (n, patches, C p²)
    x = rearrange(tokens, "n (gy gx) (c py px) -> n c (gy py) (gx px)", gy=grid, c=channels, py=patch)
    images = (128 + 48 * x).round().clamp(0, 255).to(torch.uint8)
    xtr, xte = images[:min(train, n_train)], images[n_train:n_train + min(test, PLANTED["test"])]
    train, test = (TensorImages(x, torch.zeros(len(x), dtype=torch.long)) for x in (xtr, xte))
    return ImageData(train, test, 0, channels, size, *NORMALISATION["planted"])


def epoch_order(n: int, seed: int, epoch: int, repeats: int) -> torch.Tensor:
    """The sample order of one epoch: a function of (seed, epoch) only, so a resumed run sees the same
    data. Repeated augmentation (DeiT) draws n/repeats images and shows each `repeats` times; copies
    are adjacent and the rank split is strided, so they land on different ranks."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=g)
    return perm[:math.ceil(n / repeats)].repeat_interleave(repeats)[:n]  # repeats 1: perm itself


def image_batches(images, batch_size: int, seed: int, repeats: int, rank: int, world: int, start_step: int):
    """Yield (step, images uint8, labels) for this rank from `start_step` on, forever."""
    steps_per_epoch = len(images) // batch_size
    step = start_step
    while True:
        epoch, first = divmod(step, steps_per_epoch)
        order = epoch_order(len(images), seed, epoch, repeats)
        if isinstance(images, TensorImages):  # one copy per epoch to the data's device, not one per batch
            order = order.to(images.images.device)
        index_batches = [order[s * batch_size:(s + 1) * batch_size][rank::world]  # strided rank split
                         for s in range(first, steps_per_epoch)]
        for x, labels in images.batches(index_batches):
            yield step, x, labels
            step += 1


# --- text ---

# The default corpus: English-like sentences from a small fixed grammar. Chosen over the
# repository's own source files because it is the same bytes on every machine and at every
# commit (numbers stay comparable across versions), needs no file or network, and has what a
# looped model should find worth extra iterations: subject-verb agreement across nested relative
# clauses ("the dogs that the old cat sees run."), a dependency whose distance varies.
NOUNS = [("cat", "cats"), ("dog", "dogs"), ("child", "children"), ("teacher", "teachers"),
         ("bird", "birds"), ("farmer", "farmers"), ("king", "kings"), ("sailor", "sailors"),
         ("mouse", "mice"), ("poet", "poets")]
TRANSITIVE = [("sees", "see"), ("chases", "chase"), ("likes", "like"), ("helps", "help"),
              ("follows", "follow"), ("knows", "know"), ("finds", "find"), ("calls", "call")]
INTRANSITIVE = [("sleeps", "sleep"), ("runs", "run"), ("sings", "sing"), ("waits", "wait"),
                ("laughs", "laugh")]
ADJECTIVES = ["small", "old", "happy", "red", "quiet", "brave", "tired", "clever"]
ADVERBS = ["today", "again", "slowly", "at night", "in the garden", "by the river"]
DETERMINERS = {0: ["the", "a", "every", "this"], 1: ["the", "some", "two", "these", "many"]}


def grammar_sentence(rng: random.Random, nesting: int = 2) -> str:
    def noun_phrase(depth):
        plural = rng.random() < 0.5
        words = [rng.choice(DETERMINERS[plural])]
        if rng.random() < 0.4:
            words.append(rng.choice(ADJECTIVES))
        words.append(NOUNS[rng.randrange(len(NOUNS))][plural])
        if words[0] == "a" and words[1][0] in "aeiou":
            words[0] = "an"
        if depth < nesting and rng.random() < 0.35:  # relative clause: subject or object gap
            if rng.random() < 0.5:
                words += ["that", *verb_phrase(plural, depth + 1)]
            else:
                inner, inner_plural = noun_phrase(depth + 1)
                words += ["that", *inner, rng.choice(TRANSITIVE)[inner_plural]]
        return words, plural

    def verb_phrase(plural, depth):
        if rng.random() < 0.5:
            return [rng.choice(INTRANSITIVE)[plural]] + ([rng.choice(ADVERBS)] if rng.random() < 0.3 else [])
        return [rng.choice(TRANSITIVE)[plural], *noun_phrase(depth)[0]]

    subject, plural = noun_phrase(0)
    sentence = " ".join(subject + verb_phrase(plural, 0))
    return sentence[0].upper() + sentence[1:] + "."


def grammar_corpus(num_chars: int = 1_000_000, seed: int = 0) -> str:
    """The default text corpus: deterministic paragraphs of grammar_sentence(), about num_chars long."""
    rng, paragraphs, size = random.Random(seed), [], 0
    while size < num_chars:
        paragraph = " ".join(grammar_sentence(rng) for _ in range(rng.randint(3, 8)))
        paragraphs.append(paragraph)
        size += len(paragraph) + 1
    return "\n".join(paragraphs)


def read_text(corpus: str = "grammar", path: str = "", data_dir: str = "", download: bool = False) -> str:
    """The training text: a UTF-8 file or folder of .txt files (`path`), else the named corpus."""
    if not path and corpus == "grammar":
        return grammar_corpus()
    path = Path(path or find_builtin(corpus, data_dir, download) / BUILTIN[corpus][1])
    files = sorted(path.rglob("*.txt")) if path.is_dir() else [path]
    try:
        text = "\n".join(read_file(f).decode() for f in files)
        if text.strip():
            return text
        reason = "holds no text (no .txt file, or only whitespace)"
    except UnicodeDecodeError as e:
        reason = f"is not UTF-8 text ({e})"
    raise ValueError(f"{path} {reason}")


def text_batches(tokens: torch.Tensor, batch_size: int, block_size: int, seed: int, rank: int, world: int,
                 start_step: int):
    """Random windows (B, T) and their next tokens; the windows of step s come from a generator
    seeded by (seed, s). Every start 0 .. len - T - 1 can be drawn (the last one included)."""
    for step in itertools.count(start_step):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(len(tokens) - block_size, (batch_size,), generator=g)[rank::world]
        windows = torch.stack([tokens[s:s + block_size + 1] for s in starts.tolist()])  # (b, T+1)
        yield step, windows[:, :-1], windows[:, 1:]


# --- batch augmentation on the device (DeiT III 3-Augment, mixup / cutmix) ---


class Augment:
    """uint8 images (B, C, H, W), labels (B,) -> normalised float images, soft targets (B, classes).
    Per-image randomness from a torch.Generator on the device, per-batch (mixup/cutmix) from a python
    Random; train.py saves both in checkpoints."""

    def __init__(self, data: ImageData, device, seed: int, *, random_crop=False, three_augment=False,
                 color_jitter=0.0, mixup=0.0, cutmix=0.0, mix_prob=1.0, mix_switch_prob=0.5,
                 label_smoothing=0.0):
        self.num_classes, self.label_smoothing = data.num_classes, label_smoothing
        self.random_crop, self.three_augment_on, self.color_jitter = random_crop, three_augment, color_jitter
        self.mixup, self.cutmix, self.mix_prob, self.mix_switch = mixup, cutmix, mix_prob, mix_switch_prob
        self.mean = torch.tensor(data.mean, device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(data.std, device=device).view(1, -1, 1, 1)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.batch_rng = random.Random(seed)

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std

    def rand(self, *shape):
        return torch.rand(*shape, generator=self.generator, device=self.generator.device)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor):
        x = images.float() / 255
        if self.random_crop:
            x = self.crop_and_flip(x)
        if self.three_augment_on:
            x = self.three_augment(x)
        if self.color_jitter:
            x = self.jitter(x, self.color_jitter)
        x = self.normalise(x)
        targets = F.one_hot(labels, self.num_classes).float()
        targets = targets * (1 - self.label_smoothing) + self.label_smoothing / self.num_classes
        return self.mix(x, targets)

    def crop_and_flip(self, x):
        b, _, h, w = x.shape
        pad = max(1, h // 8)  # 4 px at 32x32, 3 px at 28x28
        padded = F.pad(x, (pad, pad, pad, pad), mode="reflect")
        oy, ox = ((self.rand(b) * (2 * pad + 1)).long() for _ in "yx")  # (B,) crop offsets, y first
        rows = (oy[:, None] + torch.arange(h, device=x.device))[:, None, :, None]  # (B, 1, H, 1)
        cols = (ox[:, None] + torch.arange(w, device=x.device))[:, None, None, :]  # (B, 1, 1, W)
        batch, chans = torch.arange(b, device=x.device), torch.arange(x.shape[1], device=x.device)
        x = padded[batch[:, None, None, None], chans[None, :, None, None], rows, cols]  # (B, C, H, W)
        flip = (self.rand(b) < 0.5)[:, None, None, None]
        return torch.where(flip, x.flip(3), x)

    @staticmethod
    def grayscale(x):
        if x.shape[1] == 1:
            return x
        weights = torch.tensor([0.299, 0.587, 0.114], device=x.device).view(1, 3, 1, 1)
        return (x * weights).sum(1, keepdim=True).expand_as(x)

    def blur(self, x, sigma):
        """Gaussian blur with a per-image sigma: separable conv, one kernel per image (grouped)."""
        b, c, h, w = x.shape
        radius = min(6, (h - 1) // 2)  # 3 * max sigma, capped so reflect padding fits
        offsets = torch.arange(-radius, radius + 1, device=x.device).float()
        kernel = torch.exp(-offsets[None] ** 2 / (2 * sigma[:, None] ** 2))  # (B, k)
        kernel = (kernel / kernel.sum(1, keepdim=True)).repeat_interleave(c, 0)  # (B*C, k)
        y = F.pad(x.reshape(1, b * c, h, w), (radius,) * 4, mode="reflect")
        y = F.conv2d(y, kernel[:, None, :, None], groups=b * c)  # vertical
        y = F.conv2d(y, kernel[:, None, None, :], groups=b * c)  # horizontal
        return y.view(b, c, h, w)

    def three_augment(self, x):
        """DeiT III: one of {grayscale, solarize, gaussian blur sigma in [0.1, 2]} per image."""
        choice = (self.rand(x.shape[0]) * 3).long()[:, None, None, None]
        sigma = 0.1 + 1.9 * self.rand(x.shape[0])
        solarized = torch.where(x >= 0.5, 1 - x, x)  # PIL solarize threshold 128
        blurred = self.blur(x, sigma)
        return torch.where(choice == 0, self.grayscale(x), torch.where(choice == 1, solarized, blurred))

    def jitter(self, x, strength):
        """ColorJitter(b, c, s) with factors in [1-strength, 1+strength], in a fixed order."""
        b = x.shape[0]
        factor = lambda: (1 + strength * (2 * self.rand(b) - 1)).view(b, 1, 1, 1)  # noqa: E731
        x = (x * factor()).clamp(0, 1)                                                     # brightness
        mean = self.grayscale(x).mean((1, 2, 3), keepdim=True)
        x = (mean + factor() * (x - mean)).clamp(0, 1)                                     # contrast
        gray = self.grayscale(x)
        return (gray + factor() * (x - gray)).clamp(0, 1)                                  # saturation

    def mix(self, x, targets):
        """Batch mixup / cutmix with the flipped batch as partner (timm's 'batch' mode)."""
        rng = self.batch_rng
        if not (self.mixup or self.cutmix) or rng.random() >= self.mix_prob:
            return x, targets
        use_cutmix = self.cutmix > 0 and (self.mixup == 0 or rng.random() < self.mix_switch)
        alpha = self.cutmix if use_cutmix else self.mixup
        lam = rng.betavariate(alpha, alpha)
        if use_cutmix:
            h, w = x.shape[-2:]
            cut_h, cut_w = int(h * math.sqrt(1 - lam)), int(w * math.sqrt(1 - lam))
            cy, cx = rng.randrange(h), rng.randrange(w)
            y0, y1 = max(cy - cut_h // 2, 0), min(cy + cut_h // 2, h)
            x0, x1 = max(cx - cut_w // 2, 0), min(cx + cut_w // 2, w)
            x = x.clone()
            x[:, :, y0:y1, x0:x1] = x.flip(0)[:, :, y0:y1, x0:x1]
            lam = 1 - (y1 - y0) * (x1 - x0) / (h * w)  # the area actually pasted
        else:
            x = lam * x + (1 - lam) * x.flip(0)
        return x, lam * targets + (1 - lam) * targets.flip(0)
