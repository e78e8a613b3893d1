"""What train.py, bench.py and the tools (tools/: probes, analyze, export, depths, sweep) share on the command
line: one-line user errors (`InputError`, `fail`), flags generated from a config dataclass, the
--eval-depths and --model-args parsers, the bounds and path checks every tool applies before it reads or
writes (`MAX_DEPTH`, `path_problem`, `output_problem`), the device and torchrun's process group
(`pick_device`, `device_options`, `init_distributed`, `broadcast`),
markdown tables, strict JSON and the commit (`markdown`, `write_json`, `git_commit`), and optional matplotlib (`pyplot`). Imports
nothing of the project.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import errno
import json
import math
import os
import stat
import subprocess
import sys
import typing
from dataclasses import field, fields
from pathlib import Path

import torch
from tqdm import tqdm


# --- one-line errors and rank-0 output ---


class InputError(ValueError):
    """Bad input to a tool (a flag, a checkpoint), found before any work: its main reports it with `fail`."""


def fail(message: str, prog: str | None = None):
    """A user error: one line `prog: error: message` on stderr, non-zero exit, no traceback. prog: the
    script being run (train.py when imported by a test or a notebook)."""
    raise SystemExit(f"{prog or script_name()}: error: {message}")


def run_main(main, what_is_kept: str):
    """A command's entry point: Ctrl-C ends it in one line saying what is kept, never a traceback."""
    try:
        return main()
    except KeyboardInterrupt:
        raise SystemExit(f"{script_name()}: stopped by Ctrl-C; {what_is_kept}") from None


def script_name() -> str:
    """The command being run, as its user typed it: `train.py`, `bench.py`, or `python -m tools.NAME`."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name.startswith(("tools.", "lib.")):
        return f"python -m {spec.name}"
    name = os.path.basename(sys.argv[0])
    return name if name.endswith(".py") and name != "__main__.py" else "train.py"


def say(line: str) -> None:
    """Print on rank 0 only (torchrun starts one process per GPU), above a progress bar (tqdm.write): piped
    output never glues a line to the bar."""
    if os.environ.get("RANK", "0") == "0":
        tqdm.write(line, file=sys.stdout)
        sys.stdout.flush()


# --- flags: generated from a dataclass, and the two small languages they share ---


def opt(default, help: str):
    """A dataclass field with its --help text: the one source of a flag's default and description."""
    return field(default=default, metadata={"help": help})


def dataclass_parser(config_class, description: str, suppress_defaults: bool = False,
                     prog: str | None = None) -> argparse.ArgumentParser:
    """One flag per dataclass field (--snake_case -> --snake-case), its help from the field's metadata.
    suppress_defaults: unset flags stay absent from the namespace, so the caller sees what was given."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     argument_default=argparse.SUPPRESS if suppress_defaults else None)
    hints = typing.get_type_hints(config_class)
    for f in fields(config_class):
        kind = ([a for a in typing.get_args(hints[f.name]) if a is not type(None)] or [hints[f.name]])[0]
        flag = "--" + f.name.replace("_", "-")
        unset = "auto" if "auto:" in f.metadata["help"] else "none"  # chosen for you, or simply not used
        shown = unset if f.default is None or f.default == "" else f.default
        extra = {} if suppress_defaults else {"default": f.default}
        help_text = f"{f.metadata['help']} [default: {shown}]"
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text, **extra)
        else:
            parser.add_argument(flag, type=kind, metavar=kind.__name__.upper(), help=help_text, **extra)
    return parser


def parse_depths(text: str) -> list[int]:
    """--eval-depths '4,8,12' -> [4, 8, 12] (empty: []); each in 1..MAX_DEPTH."""
    items = [d.strip() for d in text.split(",")] if text.strip() else []
    try:
        depths = [int(d) for d in items]
    except ValueError:
        fail(f"--eval-depths must be comma-separated integers, e.g. 4,8,12; got {text!r}")
    if any(d < 1 for d in depths):
        fail(f"--eval-depths must be positive; got {text!r}")
    if any(d > MAX_DEPTH for d in depths):
        fail(f"--eval-depths must be <= {MAX_DEPTH} {MAX_DEPTH_REASON}; got {text!r}")
    return depths


def parse_model_args(text: str, config_class=None) -> dict:
    """'dim=128,heads=4' -> {'dim': 128, 'heads': 4}; with config_class, each name and type checked."""
    hints = typing.get_type_hints(config_class) if config_class else {}
    overrides = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep:
            fail(f"--model-args expects key=value pairs separated by commas; got {item!r}")
        if key in overrides:  # which one was meant? never the silent last-one-wins
            fail(f"--model-args names {key} twice; give each field once")
        with contextlib.suppress(ValueError, SyntaxError, MemoryError, RecursionError):
            value = ast.literal_eval(value)
        if hints and key not in hints:
            fail(f"--model-args {key}: not a field of {config_class.__name__}; fields: {', '.join(hints)}")
        if hints and not takes(hints[key], value):
            fail(f"--model-args {key}={value!r}: {key} takes {type_names(hints[key])}")
        if key in DEPTH_FIELDS and isinstance(value, int) and value > MAX_DEPTH:
            fail(f"--model-args {key}={value}: must be <= {MAX_DEPTH} {MAX_DEPTH_REASON}")
        overrides[key] = value
    return overrides


def takes(hint, value) -> bool:
    """Whether a field annotated `hint` (int, float, str, bool, X | None) takes `value`; a float field
    takes an int, an int field never takes a bool."""
    kinds = tuple(k for k in (typing.get_args(hint) or (hint,)) if isinstance(k, type))
    if isinstance(value, bool):
        return bool in kinds
    return isinstance(value, kinds) or float in kinds and type(value) is int


def type_names(hint) -> str:
    return " or ".join(k.__name__ for k in (typing.get_args(hint) or (hint,)) if isinstance(k, type))


def wrong_type(values: dict, config_class) -> str | None:
    """The first of `values` (a saved config) whose field in config_class does not take it, as
    'name=value: name takes int'; None when every known field fits (unknown names are ignored)."""
    hints = typing.get_type_hints(config_class)
    for name, value in values.items():
        if name in hints and not takes(hints[name], value):
            return f"{name}={value!r}: {name} takes {type_names(hints[name])}"
    return None


# --- bounds and paths: checked before anything is read or written ---

# Recurrent steps / blocks of any model, at training or evaluation. A bound against typos and edited
# files (a depth of 10**9 would allocate or loop for hours), far above any use (our choice): the
# deepest preset has 24 blocks, the papers extrapolate to a few times the trained depth.
MAX_DEPTH = 256
MAX_DEPTH_REASON = "(the deepest preset has 24 steps; a bound against typos)"
DEPTH_FIELDS = ("depth", "max_depth", "raptor_blocks")  # config fields that count steps or blocks


def check_depth(depth, flag: str, minimum: int = 2) -> None:
    """A depth given on the command line: ValueError naming the flag unless minimum <= depth <= MAX_DEPTH."""
    if depth is not None and depth < minimum:
        why = " (s_t = t/(L-1) needs two steps)" if minimum == 2 else ""
        raise ValueError(f"{flag} must be >= {minimum}{why}; got {depth}")
    if depth is not None and depth > MAX_DEPTH:
        raise ValueError(f"{flag} must be <= {MAX_DEPTH} {MAX_DEPTH_REASON}; got {depth}")


def too_deep(config: dict) -> str | None:
    """A saved model config (checkpoint, safetensors metadata) whose depth exceeds MAX_DEPTH, in words."""
    for name in DEPTH_FIELDS:
        if isinstance(config.get(name), int) and config[name] > MAX_DEPTH:
            return f"{name}={config[name]}; at most {MAX_DEPTH} {MAX_DEPTH_REASON}"
    return None


def path_problem(path, kind: str = "file") -> str | None:
    """Why `path` cannot be read as a `kind` ("file" or "folder"), in a few words; None when it can.
    A FIFO is refused before it is opened (reading one would wait forever)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symbolic link loop"
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return "a symbolic link to a missing target" if os.path.islink(path) else f"no such {kind}"
        return f"cannot be read ({e.strerror or e})"
    if stat.S_ISDIR(mode) != (kind == "folder"):
        return "a folder, not a file" if kind == "file" else "a file, not a folder"
    if kind == "file" and not stat.S_ISREG(mode):
        return f"a {'FIFO' if stat.S_ISFIFO(mode) else 'socket or device'}, not a regular file"
    readable = os.access(path, os.R_OK | (os.X_OK if kind == "folder" else 0))
    return None if readable else "not readable (permission denied)"


RUN_FILES = ("ckpt.pt", "metrics.jsonl", ".lock")  # what train.py keeps in a run folder
SAVED_FILE_MAGIC = (b"PK\x03\x04", b"\x80")  # torch.save's zip archive, a pickle: a checkpoint or a model


def output_problem(path, kind: str = "file", runs_ok: bool = False) -> str | None:
    """Why `path` cannot be written as a `kind` ("file" or "folder"), worded to follow the path ("PATH is a
    file; give a folder"), or None (parent folders are created). The one check of every output path: no
    command overwrites what it did not create, so a run's files, any saved model and (unless `runs_ok`) a
    folder holding a run are refused, as are paths of the other kind or under an unwritable ancestor."""
    problem = place_problem(path, kind)
    return problem or (None if runs_ok and kind == "folder" else run_problem(Path(path), kind))


def outputs_problem(flag: str, folder, names, runs_ok: bool = False) -> str | None:
    """output_problem of an output folder and of each file `names` a command writes into it, as the whole
    one-line message ("--out F: its depths.png is a symbolic link ..."); None when all can be written."""
    problem = output_problem(folder, "folder", runs_ok)
    if problem:
        return f"{flag} {folder} {problem}"
    for name in names:
        problem = output_problem(Path(folder) / name, "file")
        if problem:
            return f"{flag} {folder}: its {name} {problem}"
    return None


def run_problem(path: Path, kind: str) -> str | None:
    """A path whose writing would overwrite a training run or a saved model, in words; None otherwise."""
    if kind == "folder":
        held = [name for name in RUN_FILES if os.path.lexists(path / name)]
        return f"holds a training run ({held[0]}); choose another folder" if held else None
    if not os.path.lexists(path):
        return None
    if path.name in RUN_FILES or path.name.startswith(".lock"):
        return f"is a file of a training run ({path.name}); choose another path"
    try:
        with open(path, "rb") as f:  # a regular file (place_problem): reading its first bytes cannot hang
            saved = f.read(4).startswith(SAVED_FILE_MAGIC)
    except OSError:
        saved = False
    return "already holds a saved checkpoint or model (never overwritten); choose another path" if saved else None


def place_problem(path, kind: str) -> str | None:
    """output_problem's part that asks only whether `path` can be written as a `kind`."""
    path = Path(path)
    if path.is_symlink() and not path.exists():
        return "is a broken symbolic link or a symbolic link loop"
    if path.is_symlink() and kind == "file":  # written through or replaced: never
        return f"is a symbolic link (to {os.readlink(path)}); give the file itself or another path"
    if path.exists():
        if path.is_dir() != (kind == "folder"):
            return f"is a {'file' if kind == 'folder' else 'folder'}; give a {kind}"
        if kind == "file" and not path.is_file():
            return "is not a regular file (a FIFO, socket or device)"
        if not os.access(path, os.W_OK | (os.X_OK if kind == "folder" else 0)):
            return "is not writable"
    for parent in path.absolute().parents:
        if parent.is_symlink() and not parent.exists():
            return f"cannot be created: {parent} is a broken symbolic link or a symbolic link loop"
        if parent.exists():
            if not parent.is_dir():
                return f"cannot be created: {parent} is a file, not a folder"
            if not os.access(parent, os.W_OK | os.X_OK):
                return f"cannot be created: {parent} is not a writable folder"
            return None
    return None


# --- devices: what differs on CUDA is decided by one function of the device type ---


DEVICES = "auto, cpu, cuda, cuda:N or mps"


def pick_device(name: str = "auto") -> torch.device:
    """--device: auto (CUDA when present, else the CPU), cpu, cuda, cuda:N, or mps (Apple silicon, asked
    for by name as in nanoGPT: some ops fall back to the CPU there). ValueError naming the flag for a
    device this machine does not have."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r}: not a device; use {DEVICES}") from None
    if device.type not in ("cpu", "cuda", "mps") or device.type != "cuda" and device.index not in (None, 0):
        raise ValueError(f"--device {name!r}: not a device of this project; use {DEVICES}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine (use --device cpu)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise ValueError(f"--device {name}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {name}: Apple's MPS is not available on this machine (use --device cpu)")
    return device


def device_options(device_type: str, bf16: bool = True) -> dict:
    """What differs by device type, as data (a CPU test checks them with device_type="cuda" or "mps").
    MPS (our choice): fused AdamW and the data set on the device, as on CUDA; float32 without autocast
    (bf16 there needs a recent macOS, fp16 a gradient scaler); gloo for torchrun; no TF32."""
    cuda, mps = device_type == "cuda", device_type == "mps"
    return {"fused_adamw": cuda or mps, "tf32": cuda, "ddp_backend": "nccl" if cuda else "gloo",
            "autocast_dtype": torch.bfloat16 if cuda and bf16 else None, "data_on_device": cuda or mps}


def init_distributed(device_name: str):
    """--device, and the process group torchrun asks for (it sets RANK/WORLD_SIZE/LOCAL_RANK): nccl on CUDA,
    gloo on CPU. -> (rank, world, device)."""
    try:
        device = pick_device(device_name)
    except ValueError as e:
        fail(str(e))
    if "RANK" not in os.environ:
        return 0, 1, device
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if device.type == "cuda":
        if local >= torch.cuda.device_count():  # set_device would fail with "invalid device ordinal"
            fail(f"torchrun started local rank {local}, but this machine has {torch.cuda.device_count()} "
                 f"CUDA device(s): use at most that many --nproc_per_node, or --device cpu")
        torch.cuda.set_device(local)
        device = torch.device(f"cuda:{local}")
    torch.distributed.init_process_group(device_options(device.type)["ddp_backend"])
    return rank, world, device


def broadcast(obj, world: int):
    """Rank 0's `obj` on every rank (torchrun); the object itself in a single process."""
    if world == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


# --- output: markdown tables on stdout, strict JSON on disk ---


def markdown(rows: list[dict], columns: list[tuple]) -> str:
    """columns: (header, function of a row -> str); a cell whose key is missing shows as "–"."""
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_cell(fn, r) for _, fn in columns) + " |")
    return "\n".join(lines)


def _cell(fn, row):
    try:
        return fn(row)
    except (KeyError, TypeError):
        return "–"


def f(key, fmt="{:.2f}"):
    """A column of markdown(): row[key], formatted."""
    return lambda r: fmt.format(r[key])


def write_json(result: dict, path: str) -> None:
    """Strict JSON (json_text), written atomically: an interrupted run never leaves a torn file."""
    atomic_write_text(path, json_text(result) + "\n")


def atomic_write_text(path, text: str) -> None:
    """Every rewrite of a file the project owns: a temp file, then os.replace (a kill leaves old or new)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def json_text(result: dict) -> str:
    """One line of strict JSON. JSON has no NaN or infinity, and no non-finite number is reported as a
    result: each becomes null, and its place is listed under "non_finite" (e.g. "rows.3.loss")."""
    places = []
    clean = finite_or_null(result, "", places)
    if places:
        clean["non_finite"] = places
    return json.dumps(clean, default=str, separators=(",", ":"), allow_nan=False)


def non_finite_place(value) -> str | None:
    """The first place of a non-finite number in a result ("depths.2.miou"), or None."""
    places = []
    finite_or_null(value, "", places)
    return places[0] if places else None


def finite_or_null(value, place: str, places: list):
    if isinstance(value, float) and not math.isfinite(value):
        places.append(place.lstrip("."))
        return None
    if isinstance(value, dict):
        return {k: finite_or_null(v, f"{place}.{k}", places) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v, f"{place}.{i}", places) for i, v in enumerate(value)]
    return value


def git_commit(folder: str) -> str | None:
    """The commit checked out in `folder`, with "-dirty" when a tracked file outside results/ differs from it;
    None outside git. What every measurement records as the version of the code that made it."""
    def git(*words):
        return subprocess.run(["git", *words], cwd=folder, capture_output=True, text=True, timeout=30)
    try:
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results")
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") if head.returncode == 0 else None


# --- figures: matplotlib is an optional extra ---


def pyplot():
    """matplotlib's pyplot with a file-only backend, or None when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
