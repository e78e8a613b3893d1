"""A checkpoint without its training state as a .safetensors file (the weights shipped in weights/): no
pickle; the arch, the model config, train.py's config and the metrics are JSON in its metadata, so every
command that reads a trained model (lib/checkpoint.load_checkpoint) takes one in place of a ckpt.pt, as it
takes a compact or folded export of a checkpoint (tools.export carries its arch and train_config).
"""
from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError, safe_open
from safetensors.torch import save

WEIGHTS_FORMAT = "revit.checkpoint"
WEIGHTS_PARTS = ("model_config", "train_config", "metrics")  # JSON in the file's metadata, with "arch"
# tools.export's files made from a checkpoint: a part's metadata key, all JSON (the model config is "config")
EXPORT_PARTS = {"arch": "arch", "model_config": "config", "train_config": "train_config"}
EXPORT_FORMATS = ("revit.compact", "revit.folded")


def save_weights(ckpt: dict, path) -> None:
    """A checkpoint (train.py's ckpt.pt, loaded) as such a file."""
    metadata = {"format": WEIGHTS_FORMAT, "arch": ckpt["arch"],
                **{k: json.dumps(ckpt.get(k, {}), allow_nan=False) for k in WEIGHTS_PARTS}}
    tensors = {k: v.clone().contiguous() for k, v in ckpt["model"].items()}  # tied weights: one copy each
    Path(path).write_bytes(save(tensors, metadata=metadata))  # the umask's mode (save_file's is 0600)


def read_safetensors(path) -> tuple[dict, dict]:
    """(tensors, metadata) of any safetensors file; else ValueError."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise ValueError(f"not a readable safetensors file ({' '.join(str(e).split())[:200]})") from None


def read_weights(path) -> dict:
    """save_weights' file, or a compact / folded export of a checkpoint (weights, no training state), as a
    checkpoint dict (load_checkpoint checks it as any other); else ValueError."""
    model, metadata = read_safetensors(path)
    kind = metadata.get("format")
    if kind not in (WEIGHTS_FORMAT, *EXPORT_FORMATS):
        raise ValueError(f"a safetensors file of format {kind!r}; expected a checkpoint's weights "
                         f"(weights/) or a compact or folded export of tools.export")
    parts = {k: k for k in WEIGHTS_PARTS} if kind == WEIGHTS_FORMAT else EXPORT_PARTS
    try:
        values = {part: json.loads(metadata[key]) for part, key in parts.items()}
    except (KeyError, ValueError, RecursionError):
        made = "" if kind == WEIGHTS_FORMAT else " (tools.export writes them when it reads a checkpoint)"
        raise ValueError(f"its metadata needs {', '.join(parts.values())} as JSON{made}") from None
    return {"model": model, "arch": metadata.get("arch"), **values}
