"""A checkpoint is data: plain dense finite tensors of the model's names and shapes, and an arch that
names the model its config builds. The checks of what a reader loads (lib/checkpoint.load_model, resume,
export), imported by the readers only: a training run that loads nothing does not import them.
"""

from __future__ import annotations

import ast
import cmath
import dataclasses

import torch


IDENTITY_FIELDS = ("arch",)  # what a preset's name says the model is: vit, raptor or revit (--model-args
# may change anything else, e.g. ffn=feature on revit-mini)
FLAG_FIELDS = ("depth", "num_experts", "patch_size", "drop_path", "depth_drop")  # train.py's flags for them
DATA_FIELDS = ("image_size", "in_channels", "num_classes", "patch_size", "vocab_size")  # set from the data


def preset_problem(ckpt: dict, config, fields: dict) -> str | None:
    """A checkpoint whose arch (a preset of `fields` over the defaults of `config`'s class) names another
    preset than its model config (and its train_config) builds: the preset's sizes, as the saved
    --model-args and flags changed them, are the model config's."""
    arch, preset = ckpt["arch"], {**{f.name: f.default for f in dataclasses.fields(config)}, **fields}
    for name in IDENTITY_FIELDS:
        if name in preset and ckpt["model_config"].get(name, preset[name]) != preset[name]:
            return (f"its model_config has {name}={ckpt['model_config'][name]!r}, but {arch} has {name}="
                    f"{preset[name]!r}: its arch names another preset")
    saved = ckpt.get("train_config") if isinstance(ckpt.get("train_config"), dict) else {}
    trained = saved.get("arch", arch)
    if trained != arch:
        return f"its arch is {arch!r} but its train_config trained {trained!r}: its arch names another preset"
    if not saved or not saved.get("model_args") or not isinstance(saved["model_args"], str):
        return None  # no command line to rebuild it from
    built = {**fields, **{k: saved[k] for k in FLAG_FIELDS if saved.get(k) is not None}, **literal_pairs(
        saved.get("model_args", ""))}
    for name in (name for name in fields if name not in DATA_FIELDS):  # in the preset's order
        if as_list(ckpt["model_config"].get(name, built[name])) != as_list(built[name]):
            return (f"its model_config has {name}={ckpt['model_config'][name]!r}, but {arch} with its train_config's "
                    f"flags builds {name}={built[name]!r}: its arch names another preset")
    return None


def literal_pairs(text: str) -> dict:
    """'dim=48,heads=3' -> {'dim': 48, 'heads': 3}: a saved --model-args, read without exiting (train.py
    checked it when the run started; an edited one is compared as its text says)."""
    pairs = {}
    for item in filter(None, (s.strip() for s in text.split(",")[:1000])):
        key, _, value = (s.strip() for s in item.partition("="))
        try:
            pairs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
            pairs[key] = value
    return pairs


def as_list(value):
    return list(value) if isinstance(value, tuple) else value


# --- a checkpoint is data: plain dense tensors, finite, of the model's names and shapes ---


def plain_values(obj):
    """(place, value) of every value in a checkpoint that is not a dict, list or tuple ("model.cls_token",
    "metrics.val_loss"), each container visited once: a file of shared references is read in the time
    of its size."""
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
    """The first tensor of the file that is not plain data: sparse, meta (no data), quantized, or one whose
    storage is smaller than its shape claims (a stride-0 view: a small file that expands to gigabytes)."""
    for place, t in values:
        if not torch.is_tensor(t):
            continue
        what = ("a sparse tensor" if t.layout != torch.strided else "a meta tensor (no data)" if t.is_meta
                else "a quantized tensor" if t.is_quantized else storage_problem(t))
        if what:
            return f"its tensor {shown(place)} is {what}; checkpoints of this project hold plain dense tensors"
    return None


def storage_problem(t: torch.Tensor) -> str | None:
    """A tensor whose storage holds fewer bytes than its shape claims, or whose elements share storage
    (a stride 0 along a dimension of size > 1): what expands a small file on the first copy."""
    if t.numel() == 0:
        return None
    extent = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
    have = t.untyped_storage().nbytes()
    repeats = any(s <= 0 for n, s in zip(t.shape, t.stride()) if n > 1)
    if repeats or have < max(t.numel(), extent) * t.element_size():
        return f"of shape {list(t.shape)} over {have} bytes of storage (its shape claims more)"
    return None


def shown(place: str) -> str:
    """A value's place as messages name it: a weight by its name, optimizer state by its entry."""
    if place.startswith("model."):
        return place[len("model."):]
    return "optimizer state " + place[len("optimizer.state."):] if place.startswith("optimizer.state.") else place


def weights_problem(tensors: dict) -> str | None:
    """The loader's tensor checks for weights read from another format (safetensors): plain and finite."""
    values = list(plain_values({"model": tensors}))
    return stored_problem(values) or non_finite(values)


def non_finite(values) -> str | None:
    """The first NaN / inf of the file, in a tensor of any float or complex dtype or a number (weights,
    optimizer state, metrics, configs): nothing non-finite is evaluated, exported or trained on."""
    for place, value in values:
        if torch.is_tensor(value):
            bad = (value.is_floating_point() or value.is_complex()) and not torch.isfinite(value).all()
        else:
            bad = isinstance(value, (float, complex)) and not cmath.isfinite(value)
        if bad:
            what = "weights are" if place.startswith(("model.", "optimizer.")) else f"{place.split('.')[0]} is"
            return (f"its {what} not finite ({shown(place)} holds NaN or inf): a diverged run; use an earlier "
                    f"checkpoint")
    return None


def fit_problem(expected: dict, weights: dict, arch: str) -> str | None:
    """How `weights` differ from a model's state dict `expected` (names and shapes), or None."""
    problems = {"missing": [k for k in expected if k not in weights],
                "unexpected": [k for k in weights if k not in expected],
                "differently shaped": [f"{k} {list(weights[k].shape)} vs {list(v.shape)}" for k, v in expected.items()
                                       if k in weights and weights[k].shape != v.shape],
                "wrongly typed": [f"{k} {str(weights[k].dtype)[6:]} for {str(v.dtype)[6:]}" for k, v in expected.items()
                                  if k in weights and not holds(v.dtype, weights[k].dtype)]}
    for problem, names in problems.items():
        if names:
            return (f"its weights do not fit {arch}: {len(names)} {problem} tensors "
                    f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")
    return None


def holds(expected: torch.dtype, given: torch.dtype) -> bool:
    """Whether a tensor of `given` dtype loads into one of `expected` without loss of kind: a float weight
    takes only floats (int8 would be rounded, bool become 1.0, complex lose its imaginary part)."""
    return given.is_floating_point if expected.is_floating_point else given == expected


@torch.no_grad()
def diverged(model: torch.nn.Module) -> str | None:
    """Finite weights whose output is not (weights near float32's limit overflow in the first matmul): the
    model on one seeded input, an image of N(0, 1) pixels or a few tokens. Every reader refuses it, as
    a NaN weight: nothing evaluates, samples from, probes, distils from or exports such a model."""
    device, c = next(model.parameters()).device, model.config
    if hasattr(c, "image_size"):  # a vision model of revit.py
        seeded = torch.Generator().manual_seed(0)
        out = model(torch.randn(1, c.in_channels, c.image_size, c.image_size, generator=seeded).to(device))
    else:  # AlterNet: the logits of a few tokens
        out = model(torch.zeros(1, min(8, c.seq_len), dtype=torch.long, device=device))["logits"]
    if torch.isfinite(out).all():
        return None
    return ("its weights are finite but its output is not (NaN or inf on an example input): a diverged run; "
            "use an earlier checkpoint")
