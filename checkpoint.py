"""Checkpoints and run folders: the floor that train.py and every tool (probes.py, analyze.py,
export.py, bench.py, sample.py) read checkpoints through, without importing the trainer.

A checkpoint of this project is a dict of tensors and plain values, loaded with weights_only=True:
arch, model_config and model (the weights) rebuild a model (`load_model`); train_config, optimizer,
scheduler, step, rng and metrics continue a run (train.py --resume). A linear probe saves only its
head, with arch "linear-probe". Writes are atomic (`atomic_save`); reading errors are one line.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
from pathlib import Path

import torch
import torch.nn as nn

import alternet
import revit
from cli import fail


# --- reading and writing checkpoints: atomic save, one loader with one error path ---

MODEL_KEYS = ("arch", "model_config", "model")  # what rebuilds a model
RESUME_KEYS = MODEL_KEYS + ("train_config", "optimizer", "step", "rng")  # what continues a run


def atomic_save(obj: dict, path: Path) -> None:
    """Write to a temp file in the same folder, then os.replace: a crash never leaves a torn file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        torch.save(obj, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def unreadable(error: Exception) -> str:
    """Why torch.load refused a file, in one line. Its refusal of a file that holds arbitrary Python
    objects is reduced to the reason: its advice to load with weights_only=False is never passed on
    (that would run code stored in the file)."""
    text = " ".join(str(error).split())
    if "Unsupported global: GLOBAL " in text:  # a pickled Python object: never loaded, never run
        stored = text.split("GLOBAL ", 1)[1].split()[0]
        return (f"it stores the Python object {stored}, which a safe load refuses "
                "(files of this project hold only tensors and plain values)")
    if "WeightsUnpickler error:" in text:
        return f"not a PyTorch file ({text.split('WeightsUnpickler error:', 1)[1].split(' Check the')[0].strip()})"
    return f"not a PyTorch file ({text.split('. ')[0][:200] or 'empty or cut short'})"


def load_checkpoint(path, flag: str = "checkpoint", keys=MODEL_KEYS) -> dict:
    """A checkpoint of this project as a dict (tensors and plain values only: weights_only=True).
    ValueError with one line naming the flag, the file and what is wrong."""
    if not Path(path).is_file():
        raise ValueError(f"{flag} {path}: {'a folder, not a checkpoint file' if Path(path).is_dir() else 'no such file'}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- truncated, empty, not a torch file, pickled objects, ...
        raise ValueError(f"{flag} {path}: {unreadable(e)}") from None
    missing = [k for k in keys if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise ValueError(f"{flag} {path}: not a {'training ' if 'optimizer' in keys else ''}checkpoint of this "
                         f"project (missing {', '.join(missing)})")
    return ckpt


def preset_module(arch: str):
    """revit or alternet, whichever defines preset `arch`; None if neither does."""
    return revit if arch in revit.PRESETS else alternet if arch in alternet.PRESETS else None


def load_model(path, device="cpu", flag: str = "checkpoint"):
    """Rebuild a trained model from a checkpoint of this project -> (model in eval mode, ckpt dict).
    ValueError with one line naming the flag, the file and what is wrong."""
    ckpt = load_checkpoint(path, flag)
    arch = ckpt["arch"]
    if arch == "linear-probe":
        raise ValueError(f"{flag} {path} is a linear-probe head, not a model; its backbone is "
                         f"{ckpt['model_config'].get('backbone')}")
    module = preset_module(arch)
    if module is None:
        raise ValueError(f"{flag} {path}: checkpoint of unknown arch {arch!r} (not a preset of revit.py or alternet.py)")
    try:
        model = module.create_model(arch, **ckpt["model_config"])
    except (ValueError, TypeError) as e:
        raise ValueError(f"{flag} {path}: its model_config does not build {arch}: {e}") from None
    try:
        missing, unexpected = model.load_state_dict(ckpt["model"], strict=False)
    except RuntimeError as e:  # shapes that differ
        raise ValueError(f"{flag} {path}: its weights do not fit {arch}: {' '.join(str(e).split())[:300]}") from None
    for problem, names in (("missing", missing), ("unexpected", unexpected)):
        if names:
            raise ValueError(f"{flag} {path}: its weights do not fit {arch}: {len(names)} {problem} tensors "
                             f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")
    return model.to(device).eval(), ckpt


def load_vision_model(path, flag: str, device="cpu") -> tuple[nn.Module, dict]:
    """A checkpoint of this project that holds a vision model of revit.py -> (model in eval mode, ckpt).
    Every problem with the file is a ValueError of one line naming `flag`, the file and what is wrong."""
    model, ckpt = load_model(path, device, flag)
    if not isinstance(model, revit.ViTBase):
        raise ValueError(f"{flag} {path}: holds the language model {ckpt['arch']}; "
                         "this tool reads the vision models of revit.py (reViT, ViT, Raptor, the MoE baselines)")
    return model, ckpt


def checkpoint_or_fail(path, flag, keys=MODEL_KEYS) -> dict:
    """load_checkpoint for a command line: its ValueError becomes the one-line exit."""
    try:
        return load_checkpoint(path, flag, keys)
    except ValueError as e:
        fail(str(e))


def model_or_fail(path, flag) -> nn.Module:
    """load_model for a command line: its ValueError becomes the one-line exit."""
    try:
        return load_model(path, flag=flag)[0]
    except ValueError as e:
        fail(str(e))


# --- what a checkpoint holds besides weights: plain values, the plain module, RNG states ---


def primitive(value):
    """Config values as plain Python (checkpoints load with weights_only=True)."""
    if isinstance(value, dict):
        return {k: primitive(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(primitive(v) for v in value)
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under DDP and torch.compile wrappers (what checkpoints store)."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def rng_state(augment, device: torch.device) -> dict:
    """Every random stream of this process: torch's CPU generator, Python's, the generator of `device`
    (this rank's GPU only: a machine that resumes may have another number of GPUs) and the
    augmentation's (on `device`). Resume repeats them."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "device_type": device.type}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    elif device.type == "mps":
        state["mps"] = torch.mps.get_rng_state()
    if augment is not None:
        state["augment"] = augment.generator.get_state()
        state["augment_batch"] = augment.batch_rng.getstate()
    return state


def set_rng_state(state: dict | None, augment, device: torch.device, seed: int) -> list[str]:
    """Restore what `rng_state` saved, on `device`. A stream whose saved state cannot apply here (saved on
    another device type, or None: by another number of ranks) is reseeded with `seed` instead, so the
    run continues deterministically but not bit-for-bit. -> the names of the reseeded streams."""
    if state is None:
        torch.manual_seed(seed)  # every device's generator
        random.seed(seed)
        if augment is not None:
            augment.generator.manual_seed(seed)
            augment.batch_rng.seed(seed)
        return ["all"]
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    reseeded = []
    if device.type in ("cuda", "mps") and not applied(lambda: set_device_rng_state(state, device)):
        seed_device(device, seed)
        reseeded.append(device.type)
    if augment is not None:
        augment.batch_rng.setstate(state["augment_batch"])
        same_type = state.get("device_type", device.type) == device.type  # older files: the state's size decides
        if not (same_type and applied(lambda: augment.generator.set_state(state["augment"]))):
            augment.generator.manual_seed(seed)  # CPU generator states are 5,056 bytes, CUDA's 16
            reseeded.append("augmentation")
    return reseeded


def applied(restore) -> bool:
    """Whether a saved generator state could be restored (False: missing, or of another generator)."""
    try:
        restore()
    except (KeyError, IndexError, RuntimeError, TypeError):  # RuntimeError: "RNG state is wrong size"
        return False
    return True


def set_device_rng_state(state: dict, device: torch.device) -> None:
    saved = state[device.type]
    if isinstance(saved, (list, tuple)):  # older files: one state per visible GPU (get_rng_state_all)
        saved = saved[device.index or 0]
    if device.type == "cuda":
        torch.cuda.set_rng_state(saved, device)
    else:
        torch.mps.set_rng_state(saved)


def seed_device(device: torch.device, seed: int) -> None:
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)
    else:
        torch.mps.manual_seed(seed)


# --- the run folder: ckpt.pt, metrics.jsonl, and a lock ---


class RunFolder:
    """A run's folder: ckpt.pt, metrics.jsonl and .lock, held (fcntl.flock) while a process trains there."""

    def __init__(self, path):
        self.path = Path(path)
        self.ckpt, self.metrics = self.path / "ckpt.pt", self.path / "metrics.jsonl"
        self.lock = self.log_file = None

    def check(self, fresh: bool, overwrite: bool) -> None:
        """Before any work, without writing: can the folder be written, is it free for a new run?"""
        existing = next(p for p in (self.path, *self.path.absolute().parents) if p.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            fail(f"--out-dir {self.path}: {existing} is not a writable folder")
        if fresh and not overwrite and (self.ckpt.exists() or self.metrics.exists()):
            fail(f"--out-dir {self.path} already holds a run; continue it with --resume {self.ckpt}, choose "
                 f"another --out-dir, or replace it with --overwrite")

    def open(self, fresh: bool, overwrite: bool, resume_step: int | None) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self.lock = open(self.path / ".lock", "w")
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fail(f"--out-dir {self.path} is in use by another training process; choose another --out-dir")
        except OSError as e:
            fail(f"--out-dir {self.path} is not writable: {e.strerror or e}")
        self.check(fresh, overwrite)  # again, now that no other process can start a run here
        for stale in self.path.glob(f".{self.ckpt.name}.tmp*"):  # saves interrupted by a kill
            stale.unlink()
        if fresh:
            self.ckpt.unlink(missing_ok=True)
            self.metrics.unlink(missing_ok=True)
        elif self.metrics.exists():  # the steps after the checkpoint will be logged again
            kept = [line for line in self.metrics.read_text().splitlines() if logged_by(line, resume_step)]
            self.metrics.write_text("".join(line + "\n" for line in kept))
        self.log_file = open(self.metrics, "a")

    def log(self, record: dict, is_main: bool) -> None:
        if is_main and self.log_file is not None:
            try:
                self.log_file.write(json.dumps(primitive(record)) + "\n")
                self.log_file.flush()
            except OSError as e:
                fail(f"cannot write {self.metrics}: {e.strerror or e}")

    def close(self) -> None:
        for handle in (self.log_file, self.lock):  # closing the lock file releases the lock
            if handle is not None:
                handle.close()


def logged_by(line: str, step: int) -> bool:
    """Whether a metrics.jsonl line was written before the checkpoint of `step` (torn lines are not)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return False
    return record.get("event") != "final" and record.get("step", 0) <= step
