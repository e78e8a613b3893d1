"""What train.py and the tools (probes.py, analyze.py, export.py, bench.py) share on the command line:
one-line user errors (`fail`), flags generated from a config dataclass, the --eval-depths and
--model-args parsers, the device (`pick_device`, `device_options`) and optional matplotlib (`pyplot`).
Imports nothing of the project.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import os
import sys
import typing
from dataclasses import field, fields

import torch


# --- one-line errors and rank-0 output ---


def fail(message: str, prog: str | None = None):
    """A user error: one line `prog: error: message` on stderr, non-zero exit, no traceback. prog: the
    script being run (train.py when imported by a test or a notebook)."""
    raise SystemExit(f"{prog or script_name()}: error: {message}")


def script_name() -> str:
    name = os.path.basename(sys.argv[0])
    return name if name.endswith(".py") and name != "__main__.py" else "train.py"


def say(line: str) -> None:
    """Print on rank 0 only (torchrun starts one process per GPU)."""
    if os.environ.get("RANK", "0") == "0":
        print(line, flush=True)


# --- flags: generated from a dataclass, and the two small languages they share ---


def opt(default, help: str):
    """A dataclass field with its --help text: the one source of a flag's default and description."""
    return field(default=default, metadata={"help": help})


def dataclass_parser(config_class, description: str, suppress_defaults: bool = False) -> argparse.ArgumentParser:
    """One flag per dataclass field (--snake_case -> --snake-case), its help from the field's metadata.
    suppress_defaults: unset flags stay absent from the namespace, so the caller sees what was given."""
    parser = argparse.ArgumentParser(description=description,
                                     argument_default=argparse.SUPPRESS if suppress_defaults else None)
    hints = typing.get_type_hints(config_class)
    for f in fields(config_class):
        kind = ([a for a in typing.get_args(hints[f.name]) if a is not type(None)] or [hints[f.name]])[0]
        flag = "--" + f.name.replace("_", "-")
        shown = "auto" if f.default is None or f.default == "" else f.default
        extra = {} if suppress_defaults else {"default": f.default}
        help_text = f"{f.metadata['help']} [default: {shown}]"
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text, **extra)
        else:
            parser.add_argument(flag, type=kind, metavar=kind.__name__.upper(), help=help_text, **extra)
    return parser


def parse_depths(text: str) -> list[int]:
    """--eval-depths '4,8,12' -> [4, 8, 12] (empty: [])."""
    try:
        depths = [int(d) for d in text.split(",") if d.strip()]
    except ValueError:
        fail(f"--eval-depths must be comma-separated integers, e.g. 4,8,12; got {text!r}")
    if any(d < 1 for d in depths):
        fail(f"--eval-depths must be positive; got {text!r}")
    return depths


def parse_model_args(text: str, config_class=None) -> dict:
    """'dim=128,heads=4' -> {'dim': 128, 'heads': 4}; with config_class, each name and type checked."""
    hints = typing.get_type_hints(config_class) if config_class else {}
    overrides = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep:
            fail(f"--model-args expects key=value pairs separated by commas; got {item!r}")
        with contextlib.suppress(ValueError, SyntaxError):
            value = ast.literal_eval(value)
        if hints and key not in hints:
            fail(f"--model-args {key}: not a field of {config_class.__name__}; fields: {', '.join(hints)}")
        kinds = tuple(k for k in (typing.get_args(hints[key]) or (hints[key],)) if isinstance(k, type)) if hints else ()
        wrong = kinds and (not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds)
        if wrong and not (float in kinds and type(value) is int):
            fail(f"--model-args {key}={value!r}: {key} takes {' or '.join(k.__name__ for k in kinds)}")
        overrides[key] = value
    return overrides


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
