"""Checkpoints and run folders, read by train.py and every tool without importing the trainer.

A checkpoint is a dict of tensors and plain values, loaded with weights_only=True: arch, model_config
and model rebuild a model (`load_model`); train_config, optimizer, scheduler, step, rng and metrics
continue a run (train.py --resume). A linear probe saves only its head (arch "linear-probe").
"""

from __future__ import annotations

import cmath
import json
import random
import re
import shlex
import sys
from pathlib import Path

try:  # the run folder's lock: flock on Unix, msvcrt.locking on Windows
    import fcntl
except ImportError:
    fcntl = None
try:
    import msvcrt
except ImportError:
    msvcrt = None

import torch
import torch.nn as nn

from lib.boundary import fail, is_safetensors, output_problem, path_problem, preset_module, too_deep
from lib.weights import read_weights  # the .safetensors files weights/ ships
from lib.cli import atomic_write, atomic_write_text, broadcast, git_commit, non_finite_place


# --- reading and writing checkpoints: atomic save, one loader with one error path ---

MODEL_KEYS = ("arch", "model_config", "model")  # what rebuilds a model
RESUME_KEYS = MODEL_KEYS + ("train_config", "optimizer", "step", "rng")  # what continues a run


def atomic_save(obj: dict, path: Path) -> None:
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def unreadable(error: Exception) -> str:
    """Why torch.load refused a file, in one line, never with its advice to load with weights_only=False
    (that would run code stored in the file)."""
    text = " ".join(str(error).split())
    stored = re.search(r"\bGLOBAL ([\w.]+)", text)
    if stored:  # a pickled Python object (a class, os.system, ...): never loaded, never run
        return (f"it stores the Python object {stored.group(1)}, which a safe load refuses "
                "(files of this project hold only tensors and plain values)")
    if "weights_only" in text or "Weights only load failed" in text or isinstance(error, KeyError):
        return "not a PyTorch file"  # JSON, ONNX, text: never the advice; a KeyError names just a byte
    return f"not a PyTorch file ({text.split('. ')[0][:200] or 'empty or cut short'})"


def load_checkpoint(path, flag: str = "checkpoint", keys=MODEL_KEYS) -> dict:
    """A checkpoint (weights_only=True) whose parts named in `keys` pass the rules below: their types,
    plain finite tensors, a model config that builds its arch and fits the weights. ValueError otherwise,
    one line naming the flag, the file and what is wrong."""
    ckpt, problem = None, path_problem(path, "file")
    if problem and (Path(path) / "ckpt.pt").is_file():  # a run folder
        problem += f"; give its checkpoint, {Path(path) / 'ckpt.pt'}"
    packed = not problem and is_safetensors(path)  # weights/'s files and tools.export's: no training state
    if not problem:
        try:
            ckpt = read_weights(path) if packed else torch.load(path, map_location="cpu", weights_only=True)
        except ValueError as e:  # read_weights: what is wrong with the file, in words
            problem = str(e)
        except Exception as e:  # noqa: BLE001 -- truncated, empty, not a torch file, pickled objects, ...
            problem = (f"{unreadable(e)}; expected a ckpt.pt written by train.py or a .safetensors from "
                       "weights/ or tools.export")
    missing = [k for k in keys if not isinstance(ckpt, dict) or k not in ckpt]
    values = [] if problem or missing else list(plain_values(ckpt))  # each container once, as stored
    what = "training checkpoint" if "optimizer" in keys else "checkpoint"
    hint = ("; a .safetensors file holds weights only: continue a run from its ckpt.pt"
            if packed and "optimizer" in keys else "")
    problem = (problem or missing and f"not a {what} of this project (missing {', '.join(missing)}){hint}"
               or structure_problem(ckpt, keys) or stored_problem(values) or config_problem(ckpt, keys)
               or non_finite(values))
    if problem:
        raise ValueError(f"{flag} {path}: {problem}")
    return ckpt


# --- a loaded checkpoint is data: plain dense tensors, finite, of the model's names and shapes ---


def plain_values(obj):
    """(place, value) of every value in a checkpoint that is not a dict, list or tuple ("model.cls_token"),
    each container visited once: a file of shared references is read in the time of its size."""
    stack, seen = [("", obj)], set()
    while stack:
        place, value = stack.pop()
        if not isinstance(value, (dict, list, tuple)):
            yield place, value
            continue
        if id(value) in seen:
            continue
        seen.add(id(value))
        items = value.items() if isinstance(value, dict) else enumerate(value)
        stack.extend((f"{place}.{str(k)[:40]}" if place else str(k)[:40], v) for k, v in items)


def stored_problem(values) -> str | None:
    """The first tensor that is not plain data: sparse, meta, quantized, or one whose storage holds fewer
    bytes than its shape claims or repeats (stride 0): a small file that expands to gigabytes."""
    for place, t in values:
        if not torch.is_tensor(t):
            continue
        what = ("a sparse tensor" if t.layout != torch.strided else "a meta tensor (no data)" if t.is_meta
                else "a quantized tensor" if t.is_quantized else None)
        if not what and t.numel():
            extent = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
            have = t.untyped_storage().nbytes()
            repeats = any(s <= 0 for n, s in zip(t.shape, t.stride()) if n > 1)
            if repeats or have < max(t.numel(), extent) * t.element_size():
                what = f"of shape {list(t.shape)} over {have} bytes of storage (its shape claims more)"
        if what:
            return (f"its tensor {shown(place)} is {what}; checkpoints of this project hold plain dense "
                    f"tensors")
    return None


def shown(place: str) -> str:
    """A value's place as messages name it: a weight by its name, optimizer state by its entry."""
    if place.startswith("optimizer.state."):
        return "optimizer state " + place.removeprefix("optimizer.state.")
    return place.removeprefix("model.")


def weights_problem(tensors: dict) -> str | None:
    """The loader's tensor checks for weights read from safetensors: plain and finite."""
    values = list(plain_values({"model": tensors}))
    return stored_problem(values) or non_finite(values)


def non_finite(values) -> str | None:
    """The first NaN / inf of the file, in a tensor of a float or complex dtype or in a number, in words."""
    for place, value in values:
        if torch.is_tensor(value):
            bad = (value.is_floating_point() or value.is_complex()) and not torch.isfinite(value).all()
        else:
            bad = isinstance(value, (float, complex)) and not cmath.isfinite(value)
        if bad:
            weights = place.startswith(("model.", "optimizer."))
            what = "weights are" if weights else f"{place.split('.')[0]} is"
            return (f"its {what} not finite ({shown(place)} holds NaN or inf): a diverged run; use an "
                    f"earlier checkpoint")
    return None


def fit_problem(expected: dict, weights: dict, arch: str) -> str | None:
    """How `weights` differ from a model's state dict `expected` in names, shapes or dtypes, or None. A float
    weight takes only floats: int8 would be rounded, bool become 1.0, complex lose its imaginary part."""
    both = [(k, weights[k], v) for k, v in expected.items() if k in weights]
    problems = {"missing": [k for k in expected if k not in weights],
                "unexpected": [k for k in weights if k not in expected],
                "differently shaped": [f"{k} {list(w.shape)} vs {list(v.shape)}" for k, w, v in both
                                       if w.shape != v.shape],
                "wrongly typed": [f"{k} {str(w.dtype)[6:]} for {str(v.dtype)[6:]}" for k, w, v in both
                                  if not holds(v.dtype, w.dtype)]}
    for problem, names in problems.items():
        if names:
            return (f"its weights do not fit {arch}: {len(names)} {problem} tensors "
                    f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")
    return None


def holds(expected: torch.dtype, given: torch.dtype) -> bool:
    return given.is_floating_point if expected.is_floating_point else given == expected


@torch.no_grad()
def diverged(model: torch.nn.Module) -> str | None:
    """Finite weights whose output on one seeded input is not (near float32's limit the first matmul
    overflows): every reader refuses it, as a NaN weight."""
    device, c = next(model.parameters()).device, model.config
    if hasattr(c, "image_size"):  # a vision model of revit.py
        seeded = torch.Generator().manual_seed(0)
        out = model(torch.randn(1, c.in_channels, c.image_size, c.image_size, generator=seeded).to(device))
    else:  # AlterNet: the logits of a few tokens
        out = model(torch.zeros(1, min(8, c.seq_len), dtype=torch.long, device=device))["logits"]
    if torch.isfinite(out).all():
        return None
    return "its weights are finite but its output is not (NaN or inf on an example input): a diverged run"


def count(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0


SCALER_STATE = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
# What each part of a checkpoint must be: a file edited or written by other code fails here, by name.
PARTS = {
    "arch": (lambda v: isinstance(v, str), "a preset name (a string)"),
    "model_config": (lambda v: isinstance(v, dict), "a dict of config fields"),
    "model": (lambda v: isinstance(v, dict) and all(isinstance(k, str) and torch.is_tensor(t)
                                                    for k, t in v.items()), "a dict of named tensors"),
    "train_config": (lambda v: isinstance(v, dict), "a dict of train.py's settings"),
    "optimizer": (lambda v: isinstance(v, dict) and isinstance(v.get("state"), dict)
                  and isinstance(v.get("param_groups"), list) and all(isinstance(g, dict) and isinstance(
                      g.get("params"), list) for g in v["param_groups"]),
                  "an optimizer state dict (state, param_groups)"),
    "step": (lambda v: isinstance(v, int) and count(v), "an integer >= 0"),
    "rng": (lambda v: isinstance(v, list) and len(v) > 0 and all(isinstance(r, dict) for r in v),
            "a list of RNG states, one per rank (torch, python, ...)"),
    "metrics": (lambda v: isinstance(v, dict), "a dict"),
    "scaler": (lambda v: v == {} or isinstance(v, dict) and set(v) == SCALER_STATE
               and all(map(count, v.values())) and v["scale"] > 0,
               f"fp16's GradScaler state ({', '.join(sorted(SCALER_STATE))}: numbers >= 0, scale > 0) "
               f"or {{}}"),
}


def structure_problem(ckpt: dict, keys) -> str | None:
    """Each part the caller needs, and train_config and metrics (tools read them) when present."""
    for key in dict.fromkeys((*keys, "train_config", "metrics", "scaler")):
        if key in ckpt and key in PARTS and not PARTS[key][0](ckpt[key]):
            got = repr(ckpt[key]) if not isinstance(ckpt[key], (dict, list)) else type(ckpt[key]).__name__
            return f"its {key} must be {PARTS[key][1]}; got {got[:80]}"
    return None


def config_problem(ckpt: dict, keys) -> str | None:
    """The model config under a new model's rules, by building it on the meta device (no memory, no RNG);
    then the weights must fit it exactly."""
    if "model_config" not in keys or ckpt["arch"] == "linear-probe":
        return None
    arch, config = ckpt["arch"], ckpt["model_config"]
    module = preset_module(arch, config)
    if module is None:
        return f"checkpoint of unknown arch {arch!r} (not a preset of revit.py or alternet.py)"
    deep = too_deep(config)
    if deep:
        return f"its model_config has {deep}"
    try:
        with torch.device("meta"):
            model = module.create_model(arch, **config)
    except (ValueError, TypeError) as e:
        return f"its model_config does not build {arch}: {e}"
    return fit_problem(model.state_dict(), ckpt["model"], arch) if "model" in keys else None


def load_model(path, device="cpu", flag: str = "checkpoint", vision: bool = False):
    """A trained model from a checkpoint (with `vision`, one of revit.py's) -> (model in eval mode, ckpt);
    ValueError as load_checkpoint."""
    ckpt = load_checkpoint(path, flag)
    arch, config = ckpt["arch"], ckpt["model_config"]
    module = preset_module(arch, config)
    problem = (f"is a linear-probe head, not a model; its backbone is {config.get('backbone')}"
               if arch == "linear-probe" else
               f"holds the language model {arch}; this tool reads the vision models of revit.py (reViT, ViT, "
               f"Raptor, the MoE baselines)" if vision and module.__name__ == "alternet" else None)
    if not problem:
        model = module.create_model(arch, **config)
        model.load_state_dict(ckpt["model"])  # names and shapes checked by load_checkpoint
        model = model.to(device).eval()
        problem = diverged(model)
    if problem:
        raise ValueError(f"{flag} {path}: {problem}")
    return model, ckpt


def load_vision_model(path, flag: str, device="cpu") -> tuple[nn.Module, dict]:
    return load_model(path, device, flag, vision=True)


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
    ddp = nn.parallel.DistributedDataParallel
    while isinstance(model, ddp) or hasattr(model, "_orig_mod"):
        model = model.module if isinstance(model, ddp) else model._orig_mod
    return model


def rng_state(augment, device: torch.device) -> dict:
    """Every random stream of this process: torch's CPU generator, Python's, this rank's device's (a
    machine that resumes may have another number of GPUs) and the augmentation's. Resume repeats them."""
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
    """Restore what `rng_state` saved, on `device`; a stream whose state cannot apply here (another device
    type; None: another number of ranks) is reseeded with `seed`. -> the reseeded streams' names."""
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
        same_type = state.get("device_type", device.type) == device.type  # older files: its size decides
        if not (same_type and applied(lambda: augment.generator.set_state(state["augment"]))):
            augment.generator.manual_seed(seed)  # CPU generator states are 5,056 bytes, CUDA's 16
            reseeded.append("augmentation")
    return reseeded


def applied(restore) -> bool:
    try:  # False: a state missing, or of another generator
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


def provenance(device) -> dict:
    """What made a run, for its `start` event: the commit, torch's version, the device, the command line."""
    return {"commit": git_commit(str(Path(__file__).resolve().parent.parent)) or "unknown",
            "torch": torch.__version__, "device": str(device),
            "command": shlex.join(["python", *sys.argv])}


class RunFolder:
    """A run's folder: ckpt.pt, metrics.jsonl and .lock, held while a process trains there. A resume from
    the folder's own ckpt.pt continues its log; otherwise the folder must hold no run (or --overwrite)."""

    def __init__(self, path, resume: str = ""):
        self.path = Path(path)
        self.ckpt, self.metrics = self.path / "ckpt.pt", self.path / "metrics.jsonl"
        self.aside = [(path, path.with_name(f".{path.name}.old")) for path in (self.ckpt, self.metrics)]
        self.resume = resume
        self.lock = self.log_file = None
        self.saved_step = None  # the step of the checkpoint this run last wrote (or resumed from)

    def continues_run(self) -> bool:
        return bool(self.resume) and self.ckpt.exists() and self.ckpt.resolve() == Path(self.resume).resolve()

    def check(self, fresh: bool, overwrite: bool) -> None:
        """Before any work, without writing: can the folder be written, is it free for this run?"""
        taken = not overwrite and (self.ckpt.exists() or self.metrics.exists())
        problem = output_problem(self.path, "folder", runs_ok=True) or (
            f"already holds a run; " + (f"continue it with --resume {self.ckpt}, " if self.ckpt.exists() else
                                        "it stopped before its first checkpoint: ")
            + "choose another --out-dir, or replace it with --overwrite" if taken and fresh else
            f"holds a run other than --resume {self.resume} (its own checkpoint is {self.ckpt}); continuing "
            f"here would overwrite {self.ckpt.name} and cut {self.metrics.name}: give the run a new "
            f"--out-dir, or replace the folder's run with --overwrite" if taken and not self.continues_run()
            else None)
        if problem:
            fail(f"--out-dir {self.path} {problem}")

    def open(self, fresh: bool, overwrite: bool, resume_step: int | None) -> None:
        self.check(fresh, overwrite)  # the default --out-dir too: its .lock is opened next
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self.lock = open(self.path / ".lock", "a")  # "a": never truncates what is there
            lock(self.lock)
        except OSError as e:  # with the lock file open, another process holds its lock
            busy = "is in use by another training process; choose another --out-dir"
            fail(f"--out-dir {self.path} " + (busy if self.lock else f"is not writable: {e.strerror or e}"))
        self.settle()  # what a killed run set aside: back (or deleted) before the folder is checked again
        self.check(fresh, overwrite)  # again, now that no other process can start a run here
        for stale in [*self.path.glob(".ckpt.pt.tmp*"), *self.path.glob(".metrics.jsonl.tmp*")]:
            stale.unlink()  # saves and log rewrites interrupted by a kill
        if fresh or not self.continues_run():  # a new run, or a resumed one moved here: the folder's run is
            for path, old in self.aside:  # set aside until this run's first checkpoint (settle)
                if path.exists():
                    path.replace(old)
        elif self.metrics.exists():  # the steps after the checkpoint will be logged again
            kept = [line for line in self.metrics.read_text().splitlines() if logged_by(line, resume_step)]
            atomic_write_text(self.metrics, "".join(line + "\n" for line in kept))  # a kill keeps the old log
        self.log_file = open(self.metrics, "a")

    def save(self, ckpt: dict, augment, device, rank: int, world: int, hint: str) -> None:
        """train.py's checkpoint with every rank's random streams, written by rank 0 only with finite weights
        (else the reason, then `hint`); the outcome is broadcast, so every rank stops with its reason."""
        rngs = [rng_state(augment, device)] if world == 1 else [None] * world
        if world > 1:
            torch.distributed.all_gather_object(rngs, rng_state(augment, device))
        problem = broadcast(self.write({**ckpt, "rng": rngs}, hint) if rank == 0 else None, world)
        if problem:
            fail(problem)
        self.saved_step = ckpt["step"]

    def write(self, ckpt: dict, hint: str) -> str | None:
        """Rank 0's part of save: the file, or the one-line reason it was not written."""
        bad = [k for k, v in ckpt["model"].items() if v.is_floating_point() and not torch.isfinite(v).all()]
        if bad:
            return (f"weights became non-finite at step {ckpt['step']} ({bad[0]}); not saved. Last good "
                    f"checkpoint: {self.last_good()}. {hint}")
        try:
            atomic_save(ckpt, self.ckpt)
        except (OSError, RuntimeError) as e:  # torch's writer reports a full disk as a RuntimeError
            reason = getattr(e, "strerror", None) or " ".join(str(e).split())[:200]
            return f"cannot write {self.ckpt}: {reason}. Last good checkpoint: {self.last_good()}"
        self.settle()  # the run set aside is replaced now
        return None

    def last_good(self) -> str:
        return f"{self.ckpt} (step {self.saved_step})" if self.saved_step is not None else "none written yet"

    def log(self, record: dict, is_main: bool) -> None:
        if is_main and self.log_file is not None:
            try:  # strict JSON: a NaN is never written (the loop stops before; this is the last guard)
                self.log_file.write(json.dumps(primitive(record), allow_nan=False) + "\n")
                self.log_file.flush()
            except (ValueError, OSError) as e:
                fail(f"cannot write {self.metrics}: {e.strerror or e}" if isinstance(e, OSError) else
                     f"{non_finite_place(record)} of step {record.get('step')} is not finite; not written to "
                     f"{self.metrics}")

    def settle(self) -> None:
        """The run that open set aside (--overwrite): deleted once this run has saved a checkpoint, else put
        back, so that a stop before then loses nothing (after a kill, the next open in the folder does it)."""
        saved = self.ckpt.exists()
        for path, old in self.aside:
            if old.exists() and saved:
                old.unlink()
            elif old.exists():
                old.replace(path)

    def close(self) -> None:
        if self.log_file is not None:
            self.log_file.close()
        if self.lock is not None:  # the process that opened the folder settles it, then releases the lock
            self.settle()
            self.lock.close()


def lock(handle) -> None:
    """Take the open file's exclusive lock without waiting (OSError if another process holds it). A platform
    with neither Unix's flock nor Windows' msvcrt runs unlocked."""
    if fcntl is not None:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    elif msvcrt is not None:
        msvcrt.locking(handle.fileno(), msvcrt.LK_NBLCK, 1)


def logged_by(line: str, step: int) -> bool:
    """Whether a metrics.jsonl line was written before the checkpoint of `step` (torn lines are not)."""
    try:
        record = json.loads(line)
        return record.get("event") != "final" and record.get("step", 0) <= step
    except (json.JSONDecodeError, AttributeError, TypeError):  # AttributeError: not a dict
        return False
