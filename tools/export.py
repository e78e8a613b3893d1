"""Ship a trained reViT: fold it at a chosen depth and write it for the tools people already use.

    python -m tools.export CHECKPOINT --depth L --format safetensors|onnx|timm|compact --out PATH

reViT (arXiv 2610.12448) §3.1: the merged FFNs depend only on depth, so at a chosen L the model folds
into a plain ViT of L blocks (`revit.fold`), checked against the dynamic model before it is written.
- safetensors: the folded ViT, its ViTConfig as JSON metadata: `load_safetensors(path)` rebuilds it.
- onnx: the folded graph (dynamic batch axis), checked with onnxruntime when it is installed.
- timm: a state dict in timm's VisionTransformer layout (.safetensors or torch.save by the suffix).
- compact: the dynamic model (experts + router) and its config, to choose L later; `load_safetensors`
  returns a `revit.ReViT`, and the file stands in for its checkpoint in every command but --resume.

timm layout: our names are timm's; only the positions differ. We add positions to the patch tokens only
(DeiT III); timm's `vit_*` keep a class-token row, so a model without LayerScale (a folded reViT) gets a
zero row and loads strictly into `vit_small_patch16_224`; one with LayerScale (the DeiT III baselines)
keeps patch-only positions for `deit3_small_patch16_224`. `timm_model_args` gives the name and keyword
arguments (printed by the export); `load_timm_state_dict` loads either layout into a vit-s/b/l baseline.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save

if not __package__:  # run as a file (python tools/export.py): the project's modules are not on the path
    sys.exit("tools/export.py: error: run it from the repository root as python -m tools.export")

import revit
from lib import moe, weights
from lib.checkpoint import diverged, fit_problem, load_vision_model, weights_problem
from lib.boundary import MAX_DEPTH, check_numbers, closed, fail, is_safetensors, output_problem
from lib.cli import ArgumentParser, atomic_write, run_main

PROG = "python -m tools.export"  # how it runs: from the repository root, as a module


FORMATS = ("safetensors", "onnx", "timm", "compact")
FORMAT_VERSION = "1"


def load_source(path) -> tuple[nn.Module, dict]:
    """export.py's input -> (model in eval mode, its checkpoint's arch and train_config): a checkpoint of
    this project (a ckpt.pt, weights/'s .safetensors, a compact / folded export of one), or an export that
    names no checkpoint ({}). A compact or folded export carries them on: every command reads it then."""
    if is_safetensors(path) and "arch" not in read_safetensors(path)[1]:
        return load_safetensors(path), {}
    model, ckpt = load_vision_model(path, "checkpoint")
    return model, {"arch": ckpt["arch"], "train_config": ckpt.get("train_config", {})}


def plain_vit(model: nn.Module, depth: int | None) -> revit.VisionTransformer:
    """The plain ViT that runs `model` at `depth`: fold a reViT / Raptor; an untied ViT already is one."""
    if model.config.arch == "vit":
        model.schedule(depth or model.config.depth)  # its own depth only: revit's one-line refusal otherwise
        return model.eval()
    return revit.fold(model.eval(), depth).eval()


def example_images(config: revit.ViTConfig, batch: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, config.in_channels, config.image_size, config.image_size, generator=g)


def check_close(expected: torch.Tensor, got: torch.Tensor, what: str) -> float:
    """Max abs difference; fails when it exceeds a float32 tolerance relative to the output scale."""
    diff = (expected.float() - got.float()).abs().max().item()
    tolerance = 1e-4 * max(1.0, expected.abs().max().item())
    if not diff <= tolerance:
        raise ValueError(f"{what}: outputs differ by {diff:.3g} (tolerance {tolerance:.3g})")
    return diff


@torch.no_grad()
def check_fold(model: nn.Module, vit: revit.VisionTransformer, depth: int | None) -> float:
    """Folding changes no number (§3.1): folded and dynamic outputs agree to float tolerance."""
    images = example_images(vit.config, batch=2).to(next(vit.parameters()).device)
    return check_close(model(images, depth=depth), vit(images), f"folded vs dynamic model at depth {depth}")


# --- safetensors: folded ViT or compact dynamic model, config in the metadata ---


def save_safetensors(model: nn.Module, path, kind: str, **extra) -> None:
    """kind "folded" (a plain ViT) or "compact" (any model of revit.py, e.g. the dynamic reViT)."""
    metadata = {"format": f"revit.{kind}", "format_version": FORMAT_VERSION,
                "config": json.dumps(asdict(model.config)), **{k: json.dumps(v) for k, v in extra.items()}}
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    Path(path).write_bytes(save(tensors, metadata=metadata))  # the umask's mode, not save_file's 0600


def read_safetensors(path) -> tuple[dict, dict]:
    """(tensors, metadata) of any safetensors file; a ValueError naming it."""
    try:
        return weights.read_safetensors(path)
    except ValueError as e:
        raise ValueError(f"checkpoint {path}: {e}") from None


def load_safetensors(path, model: nn.Module | None = None) -> nn.Module:
    """The model a revit safetensors file describes (compact -> ReViT, folded -> VisionTransformer), or
    with `model` given, that model (a preset of your choice) with the file's tensors. As every reader, it
    refuses weights that are not plain and finite, and finite weights whose output is not."""
    tensors, metadata = read_safetensors(path)
    if model is None:
        kind = metadata.get("format")
        if kind not in ("revit.folded", "revit.compact"):
            raise ValueError(f"{path} is not a revit safetensors export (format={kind!r}); "
                             "for a timm-layout file use load_timm_state_dict(model, tensors)")
        try:  # revit's config, or lib/moe.py's for a comparison mechanism
            config = moe.config_of(json.loads(metadata["config"]))
        except (KeyError, TypeError, ValueError, RecursionError) as e:  # none, not JSON, unknown fields
            raise ValueError(f"{path}: its config metadata does not build a model of this revit.py "
                             f"({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None
        with torch.device("meta"):  # shapes first: a config of 10**6 experts allocates nothing
            problem = fit_problem(revit.build_model(config).state_dict(), tensors, "its own config")
        model = None if problem else revit.build_model(config)
    else:
        problem = fit_problem(model.state_dict(), tensors, type(model).__name__)
    if not problem:
        model.load_state_dict(tensors)
        problem = weights_problem(tensors) or diverged(model.eval())  # as load_vision_model: plain, finite
    if problem:
        raise ValueError(f"{path}: {problem}")
    return model


# --- timm's VisionTransformer layout ---

TIMM_WIDTHS = {192: ("tiny", 12, 3), 384: ("small", 12, 6), 768: ("base", 12, 12), 1024: ("large", 24, 16)}


def timm_model_args(config: revit.ViTConfig) -> tuple[str, dict]:
    """(timm model name, create_model kwargs) that build a model our timm export loads into strictly:
    vit_{size}_patch16_224 without LayerScale, deit3_{size}_patch16_224 with it; the kwargs list only
    what differs from that name's defaults (224², patch 16, 3 channels, 1000 classes, MLP ratio 4)."""
    layer_scale = config.layer_scale_init is not None
    tiny = layer_scale and config.dim == 192  # timm has no deit3_tiny
    width = config.dim if config.dim in TIMM_WIDTHS and not tiny else 384  # any other: small's name
    size, depth, heads = TIMM_WIDTHS[width]
    name = f"{'deit3' if layer_scale else 'vit'}_{size}_patch16_224"
    mlp_ratio = config.ffn_dim / config.dim
    if int(config.dim * mlp_ratio) != config.ffn_dim:  # timm builds the hidden width as int(dim * mlp_ratio)
        raise ValueError(f"ffn_dim={config.ffn_dim} is not int(dim * mlp_ratio) for any ratio timm can take")
    wanted = dict(img_size=config.image_size, patch_size=config.patch_size, in_chans=config.in_channels,
                  num_classes=config.num_classes, embed_dim=config.dim, depth=config.depth,
                  num_heads=config.heads, mlp_ratio=mlp_ratio)
    defaults = dict(img_size=224, patch_size=16, in_chans=3, num_classes=1000, embed_dim=width,
                    depth=depth, num_heads=heads, mlp_ratio=4.0)
    return name, {k: v for k, v in wanted.items() if v != defaults[k]}


def to_timm_state_dict(vit: revit.VisionTransformer) -> dict:
    """State dict of a plain ViT (e.g. revit.fold's output) in timm's VisionTransformer layout."""
    state = {k: v.detach().cpu().clone().contiguous() for k, v in vit.state_dict().items()}
    if vit.config.layer_scale_init is None:
        # timm's vit_* add positions after prepending the class token: a zero row leaves it unchanged
        pos = state["pos_embed"]
        state["pos_embed"] = torch.cat([torch.zeros_like(pos[:, :1]), pos], dim=1)
    return state


def load_timm_state_dict(model: revit.VisionTransformer, state_dict: dict) -> revit.VisionTransformer:
    """Load a timm ViT / DeiT III state dict into a plain ViT of revit.py (e.g. create_model("vit-s")), by
    exact rewrites: a class-token position row (timm's vit_*) is added to cls_token; LayerScale is gamma = 1
    for weights without it, or folded into attn.proj and mlp.fc2 for a model without it (gamma (W x + b))."""
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
    problem = fit_problem(model.state_dict(), state, type(model).__name__)  # one line naming what differs
    if problem:
        raise ValueError(f"timm state dict: {problem}")
    model.load_state_dict(state)
    return model


def save_timm(vit: revit.VisionTransformer, path) -> dict:
    name, kwargs = timm_model_args(vit.config)
    state = to_timm_state_dict(vit)
    if str(path).endswith(".safetensors"):
        metadata = {"format": "timm", "timm_model": name, "timm_kwargs": json.dumps(kwargs)}
        Path(path).write_bytes(save(state, metadata=metadata))
    else:
        torch.save(state, path)
    return {"timm_model": name, "timm_kwargs": kwargs}


# --- ONNX ---


@torch.no_grad()
def export_onnx(vit: revit.VisionTransformer, path, opset: int = 18) -> float | None:
    """Write the folded graph; -> the max |onnxruntime - PyTorch| difference, None without onnxruntime."""
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
    p = ArgumentParser(prog=PROG, description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint",
                   help="a train.py checkpoint, or a compact / folded .safetensors written by export.py")
    p.add_argument("--depth", type=int,
                   help="L to fold at, >= 2 (default: its reference depth); not with --format compact")
    p.add_argument("--format", required=True, choices=FORMATS, help="what to write (the formats above)")
    p.add_argument("--out", required=True, help="output file (parent folders are created)")
    p.add_argument("--opset", type=int, default=18,
                   help="ONNX opset version (--format onnx; 14..20) [default: 18]")
    return p


def export(args: argparse.Namespace) -> dict:
    """Check the flags, the source and its weights and the fold at --depth first; then write --out."""
    check_numbers(vars(args), PROG, depth=closed(2, MAX_DEPTH))  # s_t = t/(L-1) needs two steps
    out, expected = Path(args.out), ".onnx" if args.format == "onnx" else ".safetensors"
    source = Path(args.checkpoint).exists() and out.resolve() == Path(args.checkpoint).resolve()
    # output_problem: also a run's files, its lock and any saved model
    problem = "is the checkpoint being exported; give another file" if source else output_problem(args.out)
    for broken, message in [
        (args.format == "compact" and args.depth is not None,  # compact: L is chosen when it is folded
         "--depth is not allowed with --format compact, which keeps every depth (give --depth when exporting "
         "the compact file to another format)"),
        (out.suffix in (".onnx", ".safetensors") and out.suffix != expected,  # timm: torch.save's for others
         f"--out {args.out}: --format {args.format} writes no {out.suffix} file; "
         f"give a name ending {expected}"),
        (problem, f"--out {args.out} {problem}")]:
        if broken:
            raise ValueError(message)
    model, carried = load_source(args.checkpoint)
    summary = {"format": args.format, "out": str(out), "source_arch": model.config.arch}
    if args.format == "compact":
        atomic_write(out, lambda path: save_safetensors(model, path, "compact", **carried))
        return dict(summary, depth=None)
    vit = plain_vit(model, args.depth)
    summary["depth"] = depth = vit.config.depth
    summary["fold_max_abs_diff"] = check_fold(model, vit, depth) if vit is not model else 0.0
    if args.format == "safetensors":
        source = asdict(model.config)
        atomic_write(out, lambda path: save_safetensors(vit, path, "folded", source_config=source,
                                                        **carried))
    elif args.format == "timm":
        summary.update(atomic_write(out, lambda path: save_timm(vit, path)))
        kwargs = "".join(f", {k}={v!r}" for k, v in summary["timm_kwargs"].items())
        read = "safetensors.torch.load_file" if out.suffix == ".safetensors" else "torch.load"
        print(f"load in timm: model = timm.create_model({summary['timm_model']!r}{kwargs}); "
              f"model.load_state_dict({read}({str(out)!r}), strict=True)", file=sys.stderr)
    else:  # after every argument and the source, before anything is written (torch's error is less clear)
        if importlib.util.find_spec("onnx") is None:  # torch.onnx.export writes the graph through it
            raise ValueError("--format onnx needs the onnx package: pip install -r requirements-extra.txt")
        summary["onnx_max_abs_diff"] = atomic_write(out, lambda path: export_onnx(vit, path, args.opset))
        if summary["onnx_max_abs_diff"] is None:
            print("onnxruntime is not installed: the ONNX graph was written but not checked "
                  "(pip install -r requirements-extra.txt)", file=sys.stderr)
    return summary


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    try:
        summary = export(args)
    except ValueError as e:
        fail(str(e), PROG)
    print(json.dumps(summary))  # last stdout line: one JSON document
    return summary


if __name__ == "__main__":
    run_main(main, "an export is written whole or not at all")
