"""The boundary: every flag and path a user may type is checked here, once, before any work; a failure is
one line naming the flag or the file (`fail`). Number flags: `RANGES`. Outputs: only new files or the
command's own (`output_problem`). Checkpoints are read as data by lib/checkpoint.py, data files by
lib/data.py; nothing reaches the network without --download.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import math
import os
import stat
import sys
import typing
from pathlib import Path


import revit
from revit import MAX_DEPTH

# --- one-line errors ---


def fail(message: str, prog: str | None = None):
    """A user error: one line `prog: error: message` on stderr, non-zero exit, no traceback."""
    raise SystemExit(f"{prog or script_name()}: error: {message}")


def or_fail(check, *args, **kwargs):
    """check(*args, **kwargs), its ValueError (a loader's, --device's) as the one-line exit."""
    try:
        return check(*args, **kwargs)
    except ValueError as e:
        fail(str(e))


def script_name() -> str:
    """The command being run, as its user typed it: `train.py`, `bench.py`, or `python -m tools.NAME`."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name.startswith(("tools.", "lib.")):
        return f"python -m {spec.name}"
    name = os.path.basename(sys.argv[0])
    return name if name.endswith(".py") and name != "__main__.py" else "train.py"


# --- number flags: one table for every entry point ---


def closed(low, high):
    return (lambda v: low <= v <= high), f"in {low:,}..{high:,}"


def above(low, high):
    return (lambda v: low < v <= high), f"in ({low:,}, {high:,}]"


# The upper bounds are ours, far above any use: a typo is refused instead of overflowing, allocating for
# hours or training forever (Python's betavariate with alpha 1e308 does not even return).
BATCH = 1 << 20  # examples in one step or evaluation batch (ImageNet recipes use 2,048-4,096)
COUNT = 10 ** 9  # steps, intervals, subset sizes, images
REPEATS = 10_000  # timed rounds, perturbations, permutations
RANGES = {  # a flag's name (train.py, bench.py, sample.py, tools/) -> (test, what it allows)
    **dict.fromkeys(("batch_size", "eval_batch_size", "grad_accum", "top_k", "seq_len"), closed(1, BATCH)),
    **dict.fromkeys(("num_images", "intervention_images"), closed(2, BATCH)),  # CKA centres over >= 2 images
    "lr_batch": closed(0, BATCH),
    **dict.fromkeys(("max_steps", "warmup_steps", "train_subset", "test_subset", "eval_interval",
                     "save_interval", "stop_at_step", "eval_iters"), closed(0, COUNT)),
    "log_interval": closed(1, COUNT),
    "max_new_tokens": closed(0, 100_000),
    **dict.fromkeys(("epochs", "warmup_epochs"), closed(0, 100_000)),
    **dict.fromkeys(("repeats", "iters", "new_tokens"), closed(1, REPEATS)),
    **dict.fromkeys(("random_perturbations", "num_permutations", "gradient_batches"), closed(0, REPEATS)),
    "warmup": closed(0, 1000),
    "max_repeats": closed(2, REPEATS),
    **dict.fromkeys(("batch", "batches"), closed(1, 65536)),  # bench.py's
    "repeated_aug": closed(1, 64),
    "workers": closed(1, 256),
    "threads": closed(1, 1024),
    "gpus": closed(1, 1 << 16),
    "seeds": closed(1, 100),  # each seed is a training run per sweep cell
    "num_samples": closed(1, 1000),
    "opset": closed(14, 20),  # ONNX: attention exports as of 14; the TorchScript exporter writes up to 20
    "patch_size": closed(1, 1024),
    "block_size": closed(1, 1 << 16),
    "num_experts": closed(1, 1024),
    **dict.fromkeys(("depth", "max_depth"), closed(1, MAX_DEPTH)),  # the deepest preset has 24 steps
    "seed": closed(0, 2 ** 32 - 1),  # data orders: seed * 1_000_003 + epoch
    "lr": above(0, 10),
    "gpu_memory": above(0, 10 ** 6),  # GB
    "peak_tflops": closed(0.001, 100_000),  # today's GPUs: 100 to 2,000 dense bf16 TFLOP/s
    "budget": closed(10, 86400),  # seconds
    "resolve": ((lambda v: 0 <= v < 1), "in [0, 1)"),
    "temperature": ((lambda v: v == 0 or 1e-3 <= v <= 100), "0 (greedy) or in [0.001, 100]"),
    "halt_threshold": above(0, 1),
    **dict.fromkeys(("min_lr", "warmup_lr", "weight_decay", "color_jitter"), closed(0, 10)),
    "grad_clip": closed(0, 10 ** 6),
    **dict.fromkeys(("mixup", "cutmix"), closed(0, 100)),
    "router_lr_scale": above(0, 1000),  # ψ's lr multiplier (ours)
    **dict.fromkeys(("beta1", "beta2"), ((lambda v: 0 <= v < 1), "in [0, 1)")),
    **dict.fromkeys(("label_smoothing", "mix_prob", "mix_switch_prob", "drop_path", "depth_drop"),
                    closed(0, 1)),
}
ANY_NUMBER = closed(-COUNT, COUNT)  # a number flag without a rule of its own


def check_numbers(values: dict, prog: str | None = None, **ranges) -> None:
    """Every number of `values` (flag name -> value) finite and in its range: RANGES, or `ranges` where a
    command allows less (depths.py's --batch >= 2); a list flag (nargs) has each of its numbers checked."""
    for name, value in ((n, v) for n, vs in values.items() for v in (vs if isinstance(vs, list) else [vs])):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        ok, allowed = ranges.get(name) or RANGES.get(name, ANY_NUMBER)
        finite = not isinstance(value, float) or math.isfinite(value)
        shown = str(value) if len(str(value)) <= 24 else f"{str(value)[:6]}...({len(str(value))} digits)"
        allowed = allowed if finite else "a finite number"
        if not (finite and ok(value)):  # a 400-digit integer is shown as its first digits and its length
            fail(f"--{name.replace('_', '-')} must be {allowed}; got {shown}", prog)


# --- train.py's flags: their choices and the flags that need one another ---

CHOICES = {"loss": ("ce", "bce"), "tokenizer": ("byte", "gpt2"), "probe_pool": ("cls", "mean"),
           "probe": ("", "cls"), "compile_backend": ("inductor", "eager", "aot_eager"),
           "precision": ("auto", "bf16", "fp16", "fp32")}
DENSE_PROBES = ("seg", "monodepth")  # per-patch heads on cached features: tools/probes.py's own loop


# --depth of reViT: its step t sits at s_t = t/(L-1) (arXiv 2610.12448, Eq. 1), which needs L >= 2
REVIT_DEPTH = (closed(2, MAX_DEPTH)[0], f"in 2..{MAX_DEPTH} for reViT (s_t = t/(L-1) needs two steps)")


def check_config(cfg, typed) -> None:
    """train.py's config before anything is read or written: numbers, choices, flags that need one another,
    and the flags `typed` on the command line that the model never reads (a saved config's are not judged)."""
    given_args = parse_model_args(cfg.model_args)
    module = preset_module(cfg.arch, given_args)  # revit, lib.moe or alternet
    vision = is_vision(module)
    fields = {f.name: f.default for f in dataclasses.fields(module.ViTConfig)} if vision else {}
    preset = {**fields, **module.PRESETS[cfg.arch]} if vision else {}  # a vision preset's config fields
    model = {**preset, **given_args}.get("arch") if vision else "alternet"  # --model-args may set arch=
    check_numbers(vars(cfg), **({"depth": REVIT_DEPTH} if model == "revit" else {}))
    data_dir = cfg.data_dir and path_problem(cfg.data_dir, "folder")
    what = " does not exist" if data_dir == "no such folder" else f": {data_dir}"
    data = cfg.data and path_problem(cfg.data, "folder") and path_problem(cfg.data, "file")  # file or folder
    hub = cfg.teacher.startswith("hub:") and not cfg.download  # torch.hub downloads and runs a repo's code
    choice = next((name for name, allowed in CHOICES.items() if getattr(cfg, name) not in allowed), None)
    for broken, message in [  # the choices, the flags that need one another, and the paths read
        (cfg.probe in DENSE_PROBES, f"--probe {cfg.probe} is a dense probe: python -m tools.probes --probe "
                                    f"{cfg.probe} --backbone CKPT (train.py trains the linear classification "
                                    f"probe, --probe cls)"),
        (choice, choice and f"--{choice.replace('_', '-')} must be one of "
                            f"{', '.join(c for c in CHOICES[choice] if c)}; got {getattr(cfg, choice)!r}"),
        (not vision and not cfg.max_steps, "text data trains by steps: give --max-steps"),
        (cfg.dataset == "text" and not cfg.data, "--dataset text needs --data FILE (the text to train on)"),
        (cfg.data and cfg.dataset not in ("", "imagenet", "text"),
         f"--data is read by --dataset imagenet or text; --dataset {cfg.dataset} is found under --data-dir"),
        (not cfg.max_steps and not cfg.epochs, "give --epochs or --max-steps (both are 0)"),
        (cfg.probe and not cfg.backbone, "--probe needs --backbone CHECKPOINT (the frozen model to probe)"),
        (cfg.probe and cfg.teacher, "--probe and --teacher cannot be combined"),
        (data_dir, f"--data-dir {cfg.data_dir}{what} (omit it to search ./data, $REVIT_DATA_DIR and "
                   f"/usr/share/datasets)"),
        (data, f"--data {cfg.data}: {data}"),
        (vision and cfg.data and os.path.isfile(cfg.data), f"--data {cfg.data} is a file: a text file "
         f"trains a language --arch (alternet-*); {cfg.arch} reads an image folder (train/, val/)"),
        (hub, f"--teacher {cfg.teacher} is fetched from torch.hub (it downloads and runs "
              f"facebookresearch/dinov2's hubconf.py): give --download to allow it")]:
        if broken:
            fail(message)
    parse_depths(cfg.eval_depths)
    model_args = parse_model_args(cfg.model_args, module.ViTConfig if vision else module.AlterNetConfig)
    check_read(cfg, typed, model, preset, model_args if vision else {})


# Who reads a flag of train.py or a field of --model-args: a value given to a model that never reads it is
# refused, not echoed as an override and dropped. A name not listed: every vision model. AlterNet reads
# --num-experts as its E and --depth as its D, alternet.AlterNetConfig's num_experts and max_depth.
MODEL_NAMES = {"vit": "ViT (vit-*)", "raptor": "Raptor (raptor-*)", "revit": "reViT (revit-*)",
               "alternet": "AlterNet (alternet-*)"}
REVIT_ONLY = ("num_experts", "depth_drop", "router_hidden", "router_temperature", "router_prior",
              "balance_weight", "z_loss_weight", "diversity_weight", "merge_cache", "expert_ffn_fraction")
# The model flags that set a config field, per family: flag -> the field it sets.
VISION_FLAGS = {name: name for name in ("patch_size", "depth", "num_experts", "drop_path", "depth_drop")}
ALTERNET_FLAGS = {"num_experts": "num_experts", "depth": "max_depth"}
VISION_MODELS = ("vit", "raptor", "revit")
# The training flags one family never reads: images' loss, augmentation, subset, loader, teacher and probe;
# text's tokens. (--test-subset is also tools.depths' count of text windows.)
IMAGE_ONLY = ("loss", "label_smoothing", "mixup", "cutmix", "mix_prob", "mix_switch_prob", "random_crop",
              "three_augment", "color_jitter", "repeated_aug", "train_subset", "workers", "teacher", "probe",
              "probe_pool", "backbone")
TEXT_ONLY = ("tokenizer", "block_size", "eval_iters")
READ_BY = {**dict.fromkeys(REVIT_ONLY, ("revit",)), "raptor_blocks": ("raptor",),
           **dict.fromkeys(TEXT_ONLY, ("alternet",))}
READ_BY.update({name: READ_BY.get(name, VISION_MODELS) + ("alternet",) for name in ALTERNET_FLAGS})
READ_FLAGS = (*VISION_FLAGS, "eval_depths", *IMAGE_ONLY, *TEXT_ONLY)  # the flags of train.py READ_BY checks


def check_read(cfg, typed, model: str, preset: dict, model_args: dict) -> None:
    """Refuses the first flag `typed` (unlike its default), or --model-args field unlike the preset's (a saved
    config carries every field), that cfg's `model` never reads."""
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    given = [(name, "--" + name.replace("_", "-")) for name in READ_FLAGS
             if name in typed and getattr(cfg, name) != defaults[name]]
    given += [(name, f"--model-args {name}={value}") for name, value in model_args.items()
              if value != preset[name]]
    for name, flag in given:
        readers = READ_BY.get(name, VISION_MODELS)
        if model not in readers:
            fail(f"{flag} applies to {', '.join(MODEL_NAMES[m] for m in readers)} only, not to {cfg.arch}")


def model_overrides(cfg, data: dict | None = None) -> dict:
    """A model's config overrides: the data's properties, the model flags given, then --model-args, which
    may set none of them again: a data property would fail mid-run, a flag be overridden silently."""
    model_args = parse_model_args(cfg.model_args)
    flags = VISION_FLAGS if is_vision(preset_module(cfg.arch, model_args)) else ALTERNET_FLAGS
    overrides, set_by = dict(data or {}), dict.fromkeys(data or {}, cfg.dataset)
    for flag, name in flags.items():
        if getattr(cfg, flag) is not None:
            overrides[name], set_by[name] = getattr(cfg, flag), "--" + flag.replace("_", "-")
    twice = next((name for name in model_args if name in overrides), None)
    if twice:  # never last-one-wins
        fail(f"--model-args {twice}={model_args[twice]}: {twice} is {overrides[twice]}, "
             f"set by {set_by[twice]}")
    return {**overrides, **model_args}


def preset_module(arch: str, config=None):
    """The module (revit, lib.moe or alternet) that builds preset `arch` with `config`, or None."""
    if arch in revit.PRESETS and not set(config if isinstance(config, dict) else ()) - VISION_FIELDS:
        return revit
    import alternet
    if arch in alternet.PRESETS:
        return alternet
    from lib import moe
    return moe if arch in moe.PRESETS else None


VISION_FIELDS = {f.name for f in dataclasses.fields(revit.ViTConfig)}


def is_vision(module) -> bool:
    return module is not None and module.__name__ in ("revit", "lib.moe")


def family_of(arch: str) -> str:
    """'vision' or 'language' for a preset name (or the error naming the closest presets)."""
    module = preset_module(arch)
    if module is None:
        close = difflib.get_close_matches(arch.lower(), preset_names(), n=3, cutoff=0.6)
        fail(f"unknown --arch {arch!r}; " + (f"did you mean {' or '.join(close)}? " if close else "")
             + "python train.py --list-archs prints all names")
    return "vision" if is_vision(module) else "language"


def preset_names() -> list[str]:
    import alternet
    from lib import moe  # the comparison mechanisms' presets (and revit's)
    return sorted(moe.PRESETS) + sorted(alternet.PRESETS)


# --- the two small languages of flags: depth lists and model arguments ---


def parse_depths(text: str, flag: str = "--eval-depths", minimum: int = 1,
                 prog: str | None = None) -> list[int]:
    """'4,8,12' -> [4, 8, 12] (empty: []); each in minimum..MAX_DEPTH, and named once."""
    items = [d.strip() for d in text.split(",")] if text.strip() else []
    numbers = all(d.lstrip("-").isdigit() for d in items)  # then 6 digits at most: never a 5,000-digit int
    in_range = numbers and all(len(d) <= 6 and minimum <= int(d) <= MAX_DEPTH for d in items)
    depths = [int(d) for d in items] if in_range else []
    problem = ("be comma-separated integers, e.g. 4,8,12" if not numbers
               else f"be in {minimum}..{MAX_DEPTH}" if not in_range
               else "name each depth once" if len(set(depths)) < len(depths)  # a second would be dropped
               else None)
    if problem:
        fail(f"{flag} must {problem}; got {text[:80]!r}", prog)
    return depths


def parse_model_args(text: str, config_class=None) -> dict:
    """'dim=128,heads=4' -> {'dim': 128, 'heads': 4}; with config_class, each name and type checked."""
    hints = typing.get_type_hints(config_class) if config_class else {}
    overrides = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = (s.strip() for s in item.partition("="))
        with contextlib.suppress(ValueError, SyntaxError, MemoryError, RecursionError):
            value = ast.literal_eval(value)
        problem = ("expects key=value pairs separated by commas; got " + repr(item) if not sep
                   else f"names {key} twice; give each field once" if key in overrides  # never last-one-wins
                   else f"{key}: not a field of {config_class.__name__}; fields: {', '.join(hints)}"
                   if hints and key not in hints
                   else (hints and wrong_type({key: value}, config_class)) or too_deep({key: value}))
        if problem:
            fail(f"--model-args {problem}")
        overrides[key] = value
    return overrides


def wrong_type(values: dict, config_class) -> str | None:
    """The first known field of a saved config whose value config_class does not take (a float field takes
    an int, an int never a bool), in words, or None."""
    hints = typing.get_type_hints(config_class)
    for name, value in values.items():
        if name not in hints:
            continue
        kinds = tuple(k for k in (typing.get_args(hints[name]) or (hints[name],)) if isinstance(k, type))
        takes = isinstance(value, kinds) or float in kinds and type(value) is int
        if not (bool in kinds if isinstance(value, bool) else takes):
            return f"{name}={value!r}: {name} takes {' or '.join(k.__name__ for k in kinds)}"
    return None


def too_deep(config: dict) -> str | None:
    """A model config (--model-args, a checkpoint, safetensors metadata) deeper than MAX_DEPTH, in words."""
    for name in ("depth", "max_depth", "raptor_blocks"):  # the fields that count steps or blocks
        if isinstance(config.get(name), int) and config[name] > MAX_DEPTH:
            return f"{name}={config[name]}; at most {MAX_DEPTH}"
    return None


# --- files: read as data, written only when new or our own ---


def path_problem(path, kind: str = "file") -> str | None:
    """Why `path` cannot be read as a `kind` ("file" or "folder"), in a few words; None when it can."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        missing = isinstance(e, FileNotFoundError)
        return f"no such {kind}" if missing else f"cannot be read ({e.strerror or e})"
    if stat.S_ISDIR(mode) != (kind == "folder"):
        return "a folder, not a file" if kind == "file" else "a file, not a folder"
    if kind == "file" and not stat.S_ISREG(mode):  # a FIFO or a device: reading it could wait forever
        return "not a regular file"
    readable = os.access(path, os.R_OK | (os.X_OK if kind == "folder" else 0))
    return None if readable else "not readable (permission denied)"


RUN_FILES = ("ckpt.pt", "metrics.jsonl", ".lock")  # what train.py keeps in a run folder
# How the files this project writes begin (strict JSON, PNG, PDF, SVG, ONNX's ir_version; analyze's CSV
# tables): an existing file is replaced only when it is one of them, a command's own earlier output. A
# user's notes.txt, a saved checkpoint or model (a zip or a pickle) is never overwritten.
OUTPUT_STARTS = (b'{"', b'{\n "', b"\x89PNG", b"%PDF", b"<?xml", b"\x08",
                 b"state,", b"step,s,", b"student_state,")
OWN_FORMATS = ("revit.folded", "revit.compact", "timm", "revit.probe_heads")  # safetensors: export's, probes'


def output_problem(path, kind: str = "file", runs_ok: bool = False) -> str | None:
    """Why `path` cannot be written as a `kind` ("file" or "folder"), worded to follow the path, or None
    (parent folders are created). Never over a run's files, a file the project did not write or (unless
    `runs_ok`) a run."""
    path = Path(path)
    if path.exists() and path.is_dir() != (kind == "folder"):
        return f"is a {'file' if kind == 'folder' else 'folder'}; give a {kind}"
    if path.exists() and not os.access(path, os.W_OK):
        return "is not writable"
    parent = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())
    if not path.exists() and not parent.is_dir():
        return f"cannot be created: {parent} is a file, not a folder"
    if not path.exists() and not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: {parent} is not a writable folder"
    if kind == "folder":
        held = [name for name in RUN_FILES if not runs_ok and (path / name).exists()]
        return f"holds a training run ({held[0]}); choose another folder" if held else None
    if path.exists() and path.name in RUN_FILES:
        return f"is a file of a training run ({path.name}); choose another path"
    if path.is_file() and not is_own_output(path):
        return ("already exists and is not a file this project can recognise as its own output (never "
                "overwritten): remove it or choose another path")
    return None


def is_own_output(path: Path) -> bool:
    """One of OUTPUT_STARTS, or a safetensors file of OWN_FORMATS (a checkpoint's packed weights are not)."""
    with open(path, "rb") as f:
        if f.read(16).startswith(OUTPUT_STARTS):
            return True
    if not is_safetensors(path):
        return False
    from safetensors import SafetensorError, safe_open  # reads the header, no tensor
    try:
        with safe_open(str(path), framework="numpy") as f:
            return (f.metadata() or {}).get("format") in OWN_FORMATS
    except (SafetensorError, OSError):  # named .safetensors or begins as one, but is not
        return False


def is_safetensors(path) -> bool:
    """Named .safetensors, or begins as one (an 8-byte header length, then its JSON): a renamed file
    (an export written as m.compact) is read as what it is."""
    if Path(path).suffix == ".safetensors":
        return True
    if path_problem(path):  # missing, a folder, a FIFO: its reader says so
        return False
    with open(path, "rb") as f:
        return f.read(9)[8:] == b"{"


def outputs_problem(flag: str, folder, names, runs_ok: bool = False) -> str | None:
    """output_problem of an output folder and of each file `names` in it, as the whole one-line message."""
    problem = output_problem(folder, "folder", runs_ok)
    if problem:
        return f"{flag} {folder} {problem}"
    for name in names:
        problem = output_problem(Path(folder) / name, "file")
        if problem:
            return f"{flag} {folder}: its {name} {problem}"
    return None
