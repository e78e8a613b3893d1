"""A checkpoint's preset: its arch names the model its config builds (lib/checkpoint.load_model). The
other checks of a loaded checkpoint's values are lib/boundary.py's; their names stay importable here.
"""

from __future__ import annotations

import ast
import dataclasses

from lib.boundary import (diverged, fit_problem, non_finite, plain_values, stored_problem,  # noqa: F401
                          weights_problem)


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
