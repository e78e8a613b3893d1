"""What train.py, bench.py and the tools share on the command line: flags from a config dataclass, the
device and torchrun's process group, markdown tables, strict JSON written atomically, the commit, and
optional matplotlib. What a user may type or load is checked in lib/boundary.py.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import subprocess
import sys
import typing
from dataclasses import field, fields
from pathlib import Path

import torch
from tqdm import tqdm

from lib.boundary import fail, or_fail, script_name
from lib.tables import markdown_table


# --- one-line errors and rank-0 output ---


def run_main(main, what_is_kept: str):
    """A command's entry point: Ctrl-C ends it in one line saying what is kept, never a traceback."""
    try:
        return main()
    except KeyboardInterrupt:
        raise SystemExit(f"{script_name()}: stopped by Ctrl-C; {what_is_kept}") from None


def say(line: str) -> None:
    """Print on rank 0 only (torchrun starts one process per GPU), above a progress bar (tqdm.write)."""
    if os.environ.get("RANK", "0") == "0":
        tqdm.write(line, file=sys.stdout)
        sys.stdout.flush()


def cpu_time_note(arch: str, seconds_per_step: float, steps: int) -> str | None:
    """On a CPU, one line with the estimated time of the run; above an hour, the CPU-sized preset."""
    hours = seconds_per_step * steps / 3600
    if hours < 1:  # nothing to say about a run that fits a coffee break
        return None
    mini = "alternet-tiny" if arch.startswith("alternet") else "revit-mini"
    return (f"note: on this CPU the run takes about {hours:.1f} h ({steps} steps x {seconds_per_step:.1f} s);"
            f" {mini} is the CPU-sized preset (python train.py --arch {mini}); a GPU runs this one")


# --- flags: generated from a dataclass ---


def opt(default, help: str):
    """A dataclass field with its --help text: the one source of a flag's default and description."""
    return field(default=default, metadata={"help": help})


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line, `prog: error: ...` (no usage above it: --help shows
    it), an unknown flag with the closest known one."""

    def error(self, message: str):
        words = message.split()[2:] if message.startswith("unrecognized arguments: ") else []
        flags = [w.split("=")[0] for w in words if w.startswith("--")]
        close = flags and difflib.get_close_matches(flags[0], self._option_string_actions, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        self.exit(2, f"{self.prog}: error: {message}{hint}\n")


def dataclass_parser(config_class, description: str, suppress_defaults: bool = False,
                     prog: str | None = None) -> argparse.ArgumentParser:
    """One flag per dataclass field (--snake_case -> --snake-case), its help from the field's metadata.
    suppress_defaults: unset flags stay absent from the namespace (the caller sees what was given)."""
    parser = ArgumentParser(prog=prog, description=description,
                            argument_default=argparse.SUPPRESS if suppress_defaults else None)
    hints = typing.get_type_hints(config_class)
    for f in fields(config_class):
        kind = ([a for a in typing.get_args(hints[f.name]) if a is not type(None)] or [hints[f.name]])[0]
        flag = "--" + f.name.replace("_", "-")
        unset = "auto" if "auto:" in f.metadata["help"] else "none"  # chosen for you, or simply not used
        shown = unset if f.default is None or f.default == "" else f.default
        extra = {} if suppress_defaults else {"default": f.default}
        parse_as = ({"action": argparse.BooleanOptionalAction} if kind is bool
                    else {"type": kind, "metavar": kind.__name__.upper()})
        parser.add_argument(flag, help=f"{f.metadata['help']} [default: {shown}]", **parse_as, **extra)
    return parser


# --- devices: what differs on CUDA is decided by one function of the device type ---


DEVICES = "auto, cpu, cuda, cuda:N or mps"


def pick_device(name: str = "auto") -> torch.device:
    """--device: auto (CUDA when present, else the CPU), cpu, cuda, cuda:N, or mps (asked for by name, as in
    nanoGPT). ValueError naming the flag for a device this machine does not have."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = torch.device("meta")  # not a device at all
    cuda, count = device.type == "cuda", torch.cuda.device_count() if torch.cuda.is_available() else 0
    for broken, problem in [
        (device.type not in ("cpu", "cuda", "mps") or not cuda and device.index not in (None, 0),
         f"{name!r}: not a device of this project; use {DEVICES}"),
        (cuda and not count, f"{name}: CUDA is not available on this machine (use --device cpu)"),
        (cuda and (device.index or 0) >= count, f"{name}: this machine has {count} CUDA device(s), cuda:0 to "
                                                f"cuda:{count - 1}"),
        (device.type == "mps" and not torch.backends.mps.is_available(),
         f"{name}: Apple's MPS is not available on this machine (use --device cpu)")]:
        if broken:
            raise ValueError(f"--device {problem}")
    return device


PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}  # --precision: the autocast dtype


def device_options(device_type: str, precision: str = "auto") -> dict:
    """What differs by device type, as data. --precision auto: bf16 autocast on a CUDA GPU that computes in
    bf16, fp16 with a gradient scaler on one that does not (a T4, a V100), float32 elsewhere; a named
    precision applies on every device. MPS (our choice): fused AdamW and the data on the device."""
    cuda, mps = device_type == "cuda", device_type == "mps"
    if precision == "auto":  # emulated bf16 (a T4 has none in hardware) is not what auto picks
        precision = ("bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16") if cuda \
            else "fp32"
    return {"fused_adamw": cuda or mps, "tf32": cuda, "ddp_backend": "nccl" if cuda else "gloo",
            "autocast_dtype": PRECISIONS[precision], "precision": precision, "data_on_device": cuda or mps}


def init_distributed(device_name: str):
    """--device, and the process group torchrun asks for. -> (rank, world, device)."""
    device = or_fail(pick_device, device_name)
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
    return markdown_table([h for h, _ in columns], [[_cell(fn, r) for _, fn in columns] for r in rows])


def _cell(fn, row):
    try:
        return fn(row)
    except (KeyError, TypeError):
        return "–"


def f(key, fmt="{:.2f}"):
    """A column of markdown(): row[key], formatted."""
    return lambda r: fmt.format(r[key])


def write_json(result: dict, path: str) -> None:
    atomic_write_text(path, json_text(result) + "\n")


def atomic_write(path, write):
    """Every file the project writes (and its missing parents): `write(temp_path)` beside it, then
    os.replace: a kill leaves the old file or the new one, never a torn one. The temporary name keeps the
    suffix, which some writers read. Returns what `write` returns."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)  # the boundary checked they can be made
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}{path.suffix}")
    try:
        result = write(tmp)
        with open(tmp, "rb+") as file:
            os.fsync(file.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return result


def atomic_write_text(path, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text))


def json_text(result: dict) -> str:
    """One line of strict JSON: a non-finite number becomes null, its place listed under "non_finite"."""
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
    """The commit checked out in `folder`, "-dirty" when a tracked file outside results/ differs; None
    outside git."""
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
