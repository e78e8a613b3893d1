"""Ship a trained reViT: fold it at a chosen depth and write it for the tools people already use.

    python -m tools.export CHECKPOINT --depth L --format safetensors|onnx|timm|compact --out PATH

reViT (arXiv 2610.12448) §3.1: the merged FFNs depend only on depth, so once L is chosen they can be
computed once and the model becomes a plain ViT of L blocks (`revit.fold`). The formats:
- safetensors: the folded plain ViT, no pickle; its ViTConfig is stored as JSON metadata, so
  `load_safetensors(path)` rebuilds a `revit.VisionTransformer` without any other file.
- onnx: the folded graph (batch axis dynamic), checked with onnxruntime against PyTorch's
  outputs at export time when onnxruntime is installed (optional dependency).
- timm: a state dict in timm's VisionTransformer layout. A file ending in .safetensors is
  written as safetensors (timm's `load_checkpoint` reads both), anything else with torch.save.
- compact: the dynamic model itself (E experts + router) plus its config, what a user keeps to
  choose L later: `load_safetensors(path)` returns a `revit.ReViT`, and tools/export.py accepts the
  file in place of a checkpoint (`python -m tools.export model.safetensors --depth 8 --format onnx`).
Every folded export is checked against the dynamic model at that depth before it is written.

timm layout (timm/models/vision_transformer.py): our VisionTransformer already uses timm's names;
only the positions differ. We add positions to the patch tokens only (DeiT III); timm's
`vit_*` models keep a row for the class token (`no_embed_class=False`), so a model without
LayerScale (a folded reViT, Eq. 3) is written with a zero class-token row and loads strictly
into `timm.create_model("vit_small_patch16_224", ...)`. A model with LayerScale (the DeiT III
baselines vit-s/b/l) keeps patch-only positions and loads into `deit3_small_patch16_224`
(`no_embed_class=True`, ls1/ls2 gammas). `timm_model_args(config)` gives the exact name and
keyword arguments; the timm export prints them. The reverse, `load_timm_state_dict`, loads
either layout into a vit-s/b/l baseline (e.g. DeiT III weights as a distillation teacher).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

if not __package__:  # run as a file (python tools/export.py): the project's modules are not on the path
    sys.exit("tools/export.py: error: run it from the repository root as python -m tools.export")

import revit
from lib.checkpoint import import_moe_if_named, load_vision_model
from lib.boundary import (MAX_DEPTH, check_numbers, closed, diverged, fail, fit_problem, output_problem, path_problem,
                          too_deep, weights_problem)
from lib.weights import WEIGHTS_FORMAT
from lib.cli import run_main

PROG = "python -m tools.export"  # how it runs: from the repository root, as a module


FORMATS = ("safetensors", "onnx", "timm", "compact")
FORMAT_VERSION = "1"


# --- shape checks: every loader here goes through this, so a wrong file names its keys ---


def shape_report(model: nn.Module, state_dict: dict, limit: int = 8) -> str:
    """How state_dict differs from the model's, in one line (empty when they fit exactly)."""
    expected = model.state_dict()
    mismatched = [f"{k}: expected {list(v.shape)}, got {list(state_dict[k].shape)}"
                  for k, v in expected.items() if k in state_dict and state_dict[k].shape != v.shape]
    missing = [f"{k}: expected {list(v.shape)}" for k, v in expected.items() if k not in state_dict]
    unexpected = [f"{k}: {list(v.shape)}" for k, v in state_dict.items() if k not in expected]
    parts = []
    for title, items in (("shape mismatch", mismatched), ("missing", missing), ("unexpected", unexpected)):
        if items:
            more = [f"... and {len(items) - limit} more"] if len(items) > limit else []
            parts.append(f"{title} ({len(items)} keys): " + ", ".join(items[:limit] + more))
    return "; ".join(parts)


def load_weights(model: nn.Module, state_dict: dict, source: str) -> nn.Module:
    report = shape_report(model, state_dict)
    if report:
        c = model.config
        raise ValueError(f"{source} does not fit {type(model).__name__}(arch={c.arch}, dim={c.dim}, depth={c.depth}, "
                         f"image_size={c.image_size}, patch_size={c.patch_size}, "
                         f"num_classes={c.num_classes}): {report}")
    problem = fit_problem(model.state_dict(), state_dict, type(model).__name__)  # names and shapes fit: dtypes
    if problem:
        raise ValueError(f"{source}: {problem}")
    model.load_state_dict(state_dict)
    return model


def load_source(path) -> nn.Module:
    """export.py's input: a checkpoint of this project, or a compact / folded .safetensors -> model in eval mode.
    Either way its weights are plain, finite and of the model's dtypes (the loader's checks)."""
    if Path(path).suffix == ".safetensors" and not is_weights_file(path):
        problem = path_problem(path, "file")
        if problem:
            raise ValueError(f"checkpoint {path}: {problem}")
        model = load_safetensors(path)
        problem = diverged(model)  # as load_vision_model: finite weights whose output is not
        if problem:
            raise ValueError(f"checkpoint {path}: {problem}")
        return model
    return load_vision_model(path, "checkpoint")[0]


def is_weights_file(path) -> bool:
    """A checkpoint's weights (lib/checkpoint.save_weights, as weights/ ships), read as a checkpoint."""
    with contextlib.suppress(ValueError):
        return not path_problem(path, "file") and read_safetensors(path)[1].get("format") == WEIGHTS_FORMAT
    return False


def plain_vit(model: nn.Module, depth: int | None) -> revit.VisionTransformer:
    """The plain ViT that runs `model` at `depth`: fold a reViT / Raptor; an untied ViT already is one."""
    if isinstance(model, revit.VisionTransformer) and model.config.arch == "vit":
        if depth is not None and depth != model.config.depth:
            raise ValueError(f"depth={depth}: this is an untied ViT of depth {model.config.depth}; "
                             "only reViT and Raptor models can be exported at another depth")
        return model.eval()
    return revit.fold(model.eval(), depth).eval()


def example_images(config: revit.ViTConfig, batch: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, config.in_channels, config.image_size, config.image_size, generator=g)


class VerificationError(RuntimeError):
    """An export whose outputs differ from the model's: a bug to report, not a user error."""


def check_close(expected: torch.Tensor, got: torch.Tensor, what: str) -> float:
    """Max abs difference; fails when it exceeds a float32 tolerance relative to the output scale."""
    diff = (expected.float() - got.float()).abs().max().item()
    tolerance = 1e-4 * max(1.0, expected.abs().max().item())
    if not diff <= tolerance:
        raise VerificationError(f"{what}: outputs differ by {diff:.3g} (tolerance {tolerance:.3g})")
    return diff


@torch.no_grad()
def check_fold(model: nn.Module, vit: revit.VisionTransformer, depth: int | None) -> float:
    """Folding changes no number (§3.1): folded and dynamic outputs agree to float tolerance."""
    images = example_images(vit.config, batch=2).to(next(vit.parameters()).device)
    return check_close(model(images, depth=depth), vit(images), f"folded model vs dynamic model at depth {depth}")


# --- safetensors: folded ViT or compact dynamic model, config in the metadata ---


def save_safetensors(model: nn.Module, path, kind: str, **extra) -> None:
    """kind "folded" (a plain ViT) or "compact" (any model of revit.py, e.g. the dynamic reViT)."""
    metadata = {"format": f"revit.{kind}", "format_version": FORMAT_VERSION,
                "config": json.dumps(asdict(model.config))}
    metadata.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in extra.items()})
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(path), metadata=metadata)


def read_safetensors(path) -> tuple[dict, dict]:
    """(tensors, metadata) of any safetensors file."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
    except SafetensorError as e:
        raise ValueError(f"{path} is not a readable safetensors file: {e}") from e


def load_safetensors(path, model: nn.Module | None = None) -> nn.Module:
    """Rebuild the model a revit safetensors file describes (compact -> ReViT, folded -> VisionTransformer).

    With `model` given, load the tensors into it instead (a preset of your choice); either way a
    file whose shapes do not fit fails with the list of keys.
    """
    tensors, metadata = read_safetensors(path)
    if model is None:
        kind = metadata.get("format")
        if kind not in ("revit.folded", "revit.compact"):
            raise ValueError(f"{path} is not a revit safetensors export (format={kind!r}); "
                             "for a timm-layout file use load_timm_state_dict(model, tensors)")
        try:
            fields = json.loads(metadata["config"])
            if isinstance(fields, dict) and too_deep(fields):
                raise ValueError(too_deep(fields))
            import_moe_if_named(config=fields)  # a comparison mechanism's config needs lib.moe
            config = revit.ViTConfig(**fields)
        except (KeyError, TypeError, ValueError, RecursionError) as e:  # no config, not JSON, fields revit.py lacks
            raise ValueError(f"{path}: its config metadata does not build a model of this revit.py "
                             f"({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None
        with torch.device("meta"):  # shapes first, without memory: a config that says 10**6 experts allocates nothing
            report = shape_report(revit.build_model(config), tensors)
        if report:
            raise ValueError(f"{path} does not fit its own config: {report}")
        model = revit.build_model(config)
    problem = weights_problem(tensors)
    if problem:
        raise ValueError(f"checkpoint {path}: {problem}")
    return load_weights(model, tensors, str(path)).eval()


# --- timm's VisionTransformer layout ---

TIMM_WIDTHS = {192: ("tiny", 12, 3), 384: ("small", 12, 6), 768: ("base", 12, 12), 1024: ("large", 24, 16)}


def timm_model_args(config: revit.ViTConfig) -> tuple[str, dict]:
    """(timm model name, create_model kwargs) that build a model our timm export loads into strictly.

    No LayerScale -> vit_{size}_patch16_224 (class-token position row); LayerScale (DeiT III) ->
    deit3_{size}_patch16_224 (no_embed_class=True, init_values set). The kwargs list only what
    differs from that name's defaults (224², patch 16, 3 channels, 1000 classes, MLP ratio 4).
    """
    layer_scale = config.layer_scale_init is not None
    size, depth, heads = TIMM_WIDTHS.get(config.dim, ("small", 12, 6))
    if layer_scale and size == "tiny":
        size, depth, heads = "small", 12, 6  # timm has no deit3_tiny
    name = f"{'deit3' if layer_scale else 'vit'}_{size}_patch16_224"
    dims = {"tiny": 192, "small": 384, "base": 768, "large": 1024}
    mlp_ratio = config.ffn_dim / config.dim
    if int(config.dim * mlp_ratio) != config.ffn_dim:  # timm builds the hidden width as int(dim * mlp_ratio)
        raise ValueError(f"ffn_dim={config.ffn_dim} is not int(dim * mlp_ratio) for any float ratio timm can take")
    wanted = dict(img_size=config.image_size, patch_size=config.patch_size, in_chans=config.in_channels,
                  num_classes=config.num_classes, embed_dim=config.dim, depth=config.depth,
                  num_heads=config.heads, mlp_ratio=mlp_ratio)
    defaults = dict(img_size=224, patch_size=16, in_chans=3, num_classes=1000, embed_dim=dims[size],
                    depth=depth, num_heads=heads, mlp_ratio=4.0)
    return name, {k: v for k, v in wanted.items() if v != defaults[k]}


def to_timm_state_dict(vit: revit.VisionTransformer) -> dict:
    """State dict of a plain ViT (e.g. revit.fold's output) in timm's VisionTransformer layout."""
    if not (isinstance(vit, revit.VisionTransformer) and vit.config.arch == "vit"):
        raise ValueError("to_timm_state_dict expects a plain ViT; fold a reViT / Raptor first (revit.fold)")
    state = {k: v.detach().cpu().clone().contiguous() for k, v in vit.state_dict().items()}
    if vit.config.layer_scale_init is None:
        # timm's vit_* add positions after prepending the class token: a zero row leaves it unchanged
        state["pos_embed"] = torch.cat([torch.zeros_like(state["pos_embed"][:, :1]), state["pos_embed"]], dim=1)
    return state


def load_timm_state_dict(model: revit.VisionTransformer, state_dict: dict) -> revit.VisionTransformer:
    """Load a timm ViT / DeiT III state dict into a plain ViT of revit.py (e.g. create_model("vit-s")).

    Both differences between the layouts are exact rewrites, so outputs equal timm's:
    - a class-token position row (timm's vit_*) is a constant added to the class token: folded into cls_token;
    - LayerScale: a model with it takes gamma = 1 for weights without it; a model without it folds
      the gammas into attn.proj and mlp.fc2 (gamma * (W x + b) = (gamma W) x + gamma b).
    """
    if not (isinstance(model, revit.VisionTransformer) and model.config.arch == "vit"):
        raise ValueError("load_timm_state_dict loads into a plain ViT (arch 'vit', e.g. create_model('vit-s'))")
    for wrapper in ("model", "state_dict"):  # DeiT / timm training checkpoints wrap the weights
        if wrapper in state_dict and isinstance(state_dict[wrapper], dict):
            state_dict = state_dict[wrapper]
    state = dict(state_dict)
    c = model.config
    pos = state.get("pos_embed")
    if pos is not None and "cls_token" in state and pos.ndim == 3 and pos.shape[1] == c.num_patches + 1:
        state["cls_token"] = state["cls_token"] + pos[:, :1]
        state["pos_embed"] = pos[:, 1:]
    for i in range(len(model.blocks)):
        for gamma_name, layer in ((f"blocks.{i}.ls1.gamma", f"blocks.{i}.attn.proj"),
                                  (f"blocks.{i}.ls2.gamma", f"blocks.{i}.mlp.fc2")):
            if c.layer_scale_init is not None and gamma_name not in state and f"{layer}.weight" in state:
                state[gamma_name] = torch.ones(c.dim, dtype=state[f"{layer}.weight"].dtype)
            elif c.layer_scale_init is None and gamma_name in state and f"{layer}.weight" in state:
                gamma = state.pop(gamma_name)
                state[f"{layer}.weight"] = gamma[:, None] * state[f"{layer}.weight"]
                state[f"{layer}.bias"] = gamma * state[f"{layer}.bias"]
    return load_weights(model, state, "timm state dict")


def save_timm(vit: revit.VisionTransformer, path) -> dict:
    name, kwargs = timm_model_args(vit.config)
    state = to_timm_state_dict(vit)
    if str(path).endswith(".safetensors"):
        save_file(state, str(path), metadata={"format": "timm", "timm_model": name, "timm_kwargs": json.dumps(kwargs)})
    else:
        torch.save(state, path)
    return {"timm_model": name, "timm_kwargs": kwargs}


# --- ONNX ---


def require_onnx() -> None:
    """Checked before anything is written: torch's own error comes after tracing and is less clear."""
    try:
        import onnx  # noqa: F401 -- torch.onnx.export writes the graph through it
    except ImportError:
        raise ValueError("--format onnx needs the onnx package: pip install -r requirements-extra.txt") from None


@torch.no_grad()
def export_onnx(vit: revit.VisionTransformer, path, opset: int = 18) -> float | None:
    """Write the folded graph; returns the max |onnxruntime - PyTorch| difference, None without onnxruntime."""
    require_onnx()
    vit = vit.float().cpu().eval()
    with warnings.catch_warnings():
        # the traced shape checks in ViTBase.embed become constants: the image size is fixed anyway
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        # dynamo=False: the TorchScript exporter needs no onnxscript, and a folded ViT is a static graph
        torch.onnx.export(vit, (example_images(vit.config, batch=2),), str(path), dynamo=False,
                          input_names=["images"], output_names=["logits"], opset_version=opset,
                          dynamic_axes={"images": {0: "batch"}, "logits": {0: "batch"}})
    try:
        import onnxruntime
    except ImportError:
        return None
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    images = example_images(vit.config, batch=3, seed=1)  # not the traced batch size: the axis is dynamic
    got = torch.from_numpy(session.run(["logits"], {"images": images.numpy()})[0])
    return check_close(vit(images), got, f"ONNX graph {path} (onnxruntime) vs PyTorch")


# --- command line ---


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a train.py checkpoint, or a compact / folded .safetensors written by export.py")
    p.add_argument("--depth", type=int, default=None,
                   help="L to fold at (>= 2); default: the model's reference depth. Ignored by --format compact")
    p.add_argument("--format", required=True, choices=FORMATS,
                   help="safetensors: folded ViT; onnx: folded graph; timm: folded ViT in timm's layout; "
                        "compact: the dynamic model (experts + router), depth chosen later")
    p.add_argument("--out", required=True, help="output file (parent folders are created)")
    p.add_argument("--opset", type=int, default=None, help="ONNX opset version (--format onnx; 14..20) [default: 18]")
    return p


def check_args(args: argparse.Namespace) -> None:
    """The flags that need no file: a ValueError naming the flag and what is allowed. Optional packages
    are looked for only after every argument and the source checked out (export)."""
    if args.opset is not None and args.format != "onnx":
        raise ValueError(f"--opset applies to --format onnx only; got --format {args.format} --opset {args.opset}")
    check_numbers(vars(args), PROG, depth=closed(2, MAX_DEPTH))  # s_t = t/(L-1) needs two steps
    args.opset = 18 if args.opset is None else args.opset
    if Path(args.out).is_dir():
        raise ValueError(f"--out {args.out} is a folder; give the file to write, e.g. {Path(args.out) / 'model'}")
    if Path(args.checkpoint).exists() and Path(args.out).resolve() == Path(args.checkpoint).resolve():
        raise ValueError(f"--out {args.out} is the checkpoint being exported; give another file")
    problem = output_problem(args.out, "file")  # also a run's files, its lock and any saved model
    if problem:
        raise ValueError(f"--out {args.out} {problem}")


def write_atomically(out: Path, write):
    """write(temporary path), then rename it to `out`: an interrupted export never leaves a torn file.
    The temporary name keeps the suffix, which save_timm reads. Returns what `write` returns."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.tmp{os.getpid()}{out.suffix}")
    try:
        result = write(tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return result


def export(args: argparse.Namespace) -> dict:
    """Read and check everything first (the source, its weights, the fold at --depth), then write --out."""
    model = load_source(args.checkpoint)
    out = Path(args.out)
    summary = {"format": args.format, "out": str(out), "source_arch": model.config.arch}
    if args.format == "compact":
        write_atomically(out, lambda path: save_safetensors(model, path, "compact"))
        return dict(summary, depth=None)
    vit = plain_vit(model, args.depth)
    summary["depth"] = depth = vit.config.depth
    summary["fold_max_abs_diff"] = check_fold(model, vit, depth) if vit is not model else 0.0
    if args.format == "safetensors":
        write_atomically(out, lambda path: save_safetensors(vit, path, "folded", source_config=asdict(model.config)))
    elif args.format == "timm":
        summary.update(write_atomically(out, lambda path: save_timm(vit, path)))
        kwargs = "".join(f", {k}={v!r}" for k, v in summary["timm_kwargs"].items())
        read = "safetensors.torch.load_file" if out.suffix == ".safetensors" else "torch.load"
        print(f"load in timm: model = timm.create_model({summary['timm_model']!r}{kwargs}); "
              f"model.load_state_dict({read}({str(out)!r}), strict=True)", file=sys.stderr)
    else:
        require_onnx()  # after every argument and the source: a bad input is reported as such without onnx
        summary["onnx_max_abs_diff"] = write_atomically(out, lambda path: export_onnx(vit, path, args.opset))
        if summary["onnx_max_abs_diff"] is None:
            print("onnxruntime is not installed: the ONNX graph was written but not checked "
                  "(pip install -r requirements-extra.txt)", file=sys.stderr)
    return summary


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        summary = export(args)
    except (ValueError, VerificationError) as e:
        fail(str(e), PROG)
    print(json.dumps(summary))  # last stdout line: one JSON document
    return summary


if __name__ == "__main__":
    run_main(main, "an export is written whole or not at all")
