"""export.py: folded / compact safetensors, ONNX, timm layout both ways, shape errors, the CLI.

Checkpoints are written here in train.py's format and read back through export.py, which
uses checkpoint.load_model. The timm checks never import timm: the
expected layout is written out from its description, and a small reference forward pass
implements timm's VisionTransformer numerics on a timm-layout state dict.
"""
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save, save_file

import alternet
from tools import export
import revit
from helpers import randomise
from lib.checkpoint import RESUME_KEYS, load_checkpoint, load_model
from lib.weights import save_weights

ROOT = Path(__file__).resolve().parent.parent
ONE_LINE_ERROR = re.compile(r"^(\S+\.py|python -m [\w.]+): error: [^\n]+$")  # `prog: error: message`, nothing more

TINY = dict(image_size=8, patch_size=4, in_channels=1, num_classes=5, dim=16, heads=2, ffn_dim=32, depth=4)


def tiny(name="revit-mini", **overrides):
    return randomise(revit.create_model(name, **{**TINY, **overrides})).eval()


def images(config, batch=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, config.in_channels, config.image_size, config.image_size, generator=g)


def write_checkpoint(path, model, arch="revit-mini"):
    """A checkpoint with the keys train.py writes (a plain dict of tensors and values)."""
    torch.save({"model": dict(model.state_dict()), "arch": arch, "model_config": asdict(model.config),
                "train_config": {}, "optimizer": {}, "scheduler": {}, "step": 0, "rng": {}, "metrics": {}}, path)
    return path


@pytest.fixture
def checkpoint(tmp_path):
    model = tiny()
    return model, write_checkpoint(tmp_path / "revit.pt", model)


def run(argv, capsys=None):
    summary = export.main([str(a) for a in argv])
    if capsys is not None:
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary  # last line: one JSON document
    return summary


# --- the timm layout, written out from its description (not from export.py) ---


def timm_layout(c, depth, layer_scale):
    d, f, n = c.dim, c.ffn_dim, c.num_patches
    shapes = {"cls_token": (1, 1, d), "pos_embed": (1, n if layer_scale else 1 + n, d),
              "patch_embed.proj.weight": (d, c.in_channels, c.patch_size, c.patch_size),
              "patch_embed.proj.bias": (d,)}
    for i in range(depth):
        b = f"blocks.{i}."
        shapes.update({b + "norm1.weight": (d,), b + "norm1.bias": (d,),
                       b + "attn.qkv.weight": (3 * d, d), b + "attn.qkv.bias": (3 * d,),
                       b + "attn.proj.weight": (d, d), b + "attn.proj.bias": (d,),
                       b + "norm2.weight": (d,), b + "norm2.bias": (d,),
                       b + "mlp.fc1.weight": (f, d), b + "mlp.fc1.bias": (f,),
                       b + "mlp.fc2.weight": (d, f), b + "mlp.fc2.bias": (d,)})
        if layer_scale:
            shapes.update({b + "ls1.gamma": (d,), b + "ls2.gamma": (d,)})
    shapes.update({"norm.weight": (d,), "norm.bias": (d,), "head.weight": (c.num_classes, d),
                   "head.bias": (c.num_classes,)})
    return shapes


def timm_forward(state, x, heads, eps=1e-6):
    """timm's VisionTransformer forward (global_pool='token') on a timm-layout state dict."""
    d = state["cls_token"].shape[-1]
    proj = state["patch_embed.proj.weight"]
    x = F.conv2d(x, proj, state["patch_embed.proj.bias"], stride=proj.shape[-1]).flatten(2).transpose(1, 2)
    cls = state["cls_token"].expand(len(x), -1, -1)
    if state["pos_embed"].shape[1] == x.shape[1]:  # no_embed_class=True (DeiT III): add, then prepend
        x = torch.cat([cls, x + state["pos_embed"]], dim=1)
    else:                                           # vit_*: prepend, then add (class token has a row)
        x = torch.cat([cls, x], dim=1) + state["pos_embed"]
    i = 0
    while f"blocks.{i}.norm1.weight" in state:
        def w(name):
            return state[f"blocks.{i}.{name}"]

        def norm(t, name):
            return F.layer_norm(t, (d,), w(name + ".weight"), w(name + ".bias"), eps)

        B, N, _ = x.shape
        qkv = F.linear(norm(x, "norm1"), w("attn.qkv.weight"), w("attn.qkv.bias"))
        q, k, v = qkv.reshape(B, N, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1) * (d // heads) ** -0.5).softmax(dim=-1)
        y = F.linear((attn @ v).transpose(1, 2).reshape(B, N, d), w("attn.proj.weight"), w("attn.proj.bias"))
        x = x + y * state.get(f"blocks.{i}.ls1.gamma", 1.0)
        y = F.linear(F.gelu(F.linear(norm(x, "norm2"), w("mlp.fc1.weight"), w("mlp.fc1.bias"))),
                     w("mlp.fc2.weight"), w("mlp.fc2.bias"))
        x = x + y * state.get(f"blocks.{i}.ls2.gamma", 1.0)
        i += 1
    x = F.layer_norm(x, (d,), state["norm.weight"], state["norm.bias"], eps)
    return F.linear(x[:, 0], state["head.weight"], state["head.bias"])


def shapes_of(state):
    return {k: tuple(v.shape) for k, v in state.items()}


# --- folded safetensors ---


@pytest.mark.parametrize("depth", [2, 3, 7])
def test_folded_safetensors_equals_dynamic_model(checkpoint, tmp_path, depth):
    model, path = checkpoint
    out = tmp_path / "folded.safetensors"
    summary = run([path, "--depth", depth, "--format", "safetensors", "--out", out])
    assert summary["depth"] == depth and summary["fold_max_abs_diff"] < 1e-5
    folded = export.load_safetensors(out)
    assert type(folded) is revit.VisionTransformer and folded.config.depth == depth and len(folded.blocks) == depth
    x = images(model.config)
    with torch.no_grad():
        torch.testing.assert_close(folded(x), model(x, depth=depth), atol=1e-5, rtol=1e-5)


def test_default_depth_is_the_reference_depth(checkpoint, tmp_path):
    model, path = checkpoint
    summary = run([path, "--format", "safetensors", "--out", tmp_path / "f.safetensors"])
    assert summary["depth"] == model.config.depth


def test_safetensors_round_trip_is_bit_identical(tmp_path):
    for model in (revit.fold(tiny(), 5), tiny("vit-mini"), tiny("raptor-mini-k2")):
        path = tmp_path / "m.safetensors"
        export.save_safetensors(model, path, "folded" if model.config.arch == "vit" else "compact")
        loaded = export.load_safetensors(path)
        assert type(loaded) is type(model) and loaded.config == model.config
        original, reloaded = model.state_dict(), loaded.state_dict()
        assert original.keys() == reloaded.keys()
        for k in original:
            assert original[k].dtype == reloaded[k].dtype and torch.equal(original[k], reloaded[k]), k
        with safe_open(str(path), framework="pt") as f:  # plain safetensors: config is JSON metadata
            assert json.loads(f.metadata()["config"]) == asdict(model.config)


def test_compact_round_trip_then_choose_another_depth(checkpoint, tmp_path):
    model, path = checkpoint
    compact = tmp_path / "compact.safetensors"
    assert run([path, "--format", "compact", "--out", compact])["depth"] is None
    dynamic = export.load_safetensors(compact)
    assert type(dynamic) is revit.ReViT and dynamic.config == model.config
    for k, v in model.state_dict().items():
        assert torch.equal(v, dynamic.state_dict()[k]), k
    x = images(model.config)
    with torch.no_grad():
        for depth in (3, 9):
            assert torch.equal(dynamic(x, depth=depth), model(x, depth=depth))
    # the compact file stands in for the checkpoint: fold it later at a depth chosen then
    folded_path = tmp_path / "folded6.safetensors"
    run([compact, "--depth", 6, "--format", "safetensors", "--out", folded_path])
    with torch.no_grad():
        torch.testing.assert_close(export.load_safetensors(folded_path)(x), model(x, depth=6), atol=1e-5, rtol=1e-5)


def test_an_export_of_a_checkpoint_is_a_checkpoint_for_every_command(checkpoint, tmp_path):
    """A compact or folded export carries its checkpoint's arch and train_config: every loader reads it as
    that model (the folded one as a plain ViT of L blocks), never for --resume; as any checkpoint, weights
    that are not finite, a config that does not build or a file that names no checkpoint are refused."""
    model, path = checkpoint
    compact, folded = tmp_path / "c.safetensors", tmp_path / "f.safetensors"
    run([path, "--format", "compact", "--out", compact])
    run([compact, "--depth", 3, "--format", "safetensors", "--out", folded])  # a compact exports on
    dynamic, ckpt = load_model(compact)
    assert ckpt["arch"] == "revit-mini" and ckpt["train_config"] == {} and dynamic.config == model.config
    assert all(torch.equal(dynamic.state_dict()[k], v) for k, v in model.state_dict().items())
    vit, ckpt = load_model(folded)
    assert type(vit) is revit.VisionTransformer and ckpt["arch"] == "revit-mini" and vit.config.depth == 3
    with torch.no_grad():
        torch.testing.assert_close(vit(images(model.config)), model(images(model.config), depth=3))
    with pytest.raises(ValueError, match="missing optimizer, step, rng.; a .safetensors file holds weights only"):
        load_checkpoint(compact, "--resume", RESUME_KEYS)
    tensors, metadata = export.read_safetensors(compact)
    deep = json.dumps({**json.loads(metadata["config"]), "depth": 1000})
    bare = {k: v for k, v in metadata.items() if k != "arch"}  # save_safetensors of a model: no checkpoint
    nan = {**tensors, "block.attn.proj.bias": torch.full_like(tensors["block.attn.proj.bias"], float("nan"))}
    for name, (edited, meta), problem in (
            ("nan", (nan, metadata), "its weights are not finite (block.attn.proj.bias"),
            ("deep", (tensors, {**metadata, "config": deep}), "its model_config has depth=1000; at most 256"),
            ("bare", (tensors, bare), "its metadata needs arch, config, train_config as JSON (tools.export")):
        (tmp_path / name).write_bytes(save(edited, metadata=meta))
        with pytest.raises(ValueError, match=re.escape(f"{tmp_path / name}: {problem}")):
            load_model(tmp_path / name)


def test_an_export_is_read_by_its_content_and_named_for_its_format(checkpoint, tmp_path):
    """A safetensors file under another name (m.compact, a renamed weights file) reads as what it is; an
    --out whose suffix names another format is refused before anything is written."""
    model, path = checkpoint
    export.save_safetensors(model, tmp_path / "m.compact", "compact")
    run([tmp_path / "m.compact", "--depth", 3, "--format", "safetensors", "--out", tmp_path / "f.safetensors"])
    assert export.load_safetensors(tmp_path / "f.safetensors").config.depth == 3
    save_weights(torch.load(path, weights_only=True), tmp_path / "w.bin")  # as weights/ ships, renamed
    assert export.load_source(tmp_path / "w.bin")[0].config == model.config
    for fmt, name in (("onnx", "y.safetensors"), ("compact", "y.onnx"), ("timm", "y.onnx")):
        with pytest.raises(SystemExit, match=re.escape(f"--out {tmp_path / name}: --format {fmt} writes no {name[1:]}")):
            export.main([str(path), "--format", fmt, "--out", str(tmp_path / name)])
        assert not (tmp_path / name).exists()


# --- ONNX ---


def test_onnx_output_equals_pytorch(checkpoint, tmp_path):
    pytest.importorskip("onnx", reason="onnx not installed (pip install -r requirements-extra.txt)")
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime not installed (pip install -r requirements-extra.txt)")
    model, path = checkpoint
    out = tmp_path / "model.onnx"
    summary = run([path, "--depth", 5, "--format", "onnx", "--out", out])
    assert summary["onnx_max_abs_diff"] is not None and summary["onnx_max_abs_diff"] < 1e-4
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    x = images(model.config, batch=4, seed=7)  # a batch size the export never saw
    got = torch.from_numpy(session.run(["logits"], {"images": x.numpy()})[0])
    with torch.no_grad():
        torch.testing.assert_close(got, model(x, depth=5), atol=1e-4, rtol=1e-4)


# --- timm layout ---


def test_timm_layout_is_exact_for_folded_revit(checkpoint, tmp_path):
    model, path = checkpoint
    out = tmp_path / "timm.safetensors"
    summary = run([path, "--depth", 3, "--format", "timm", "--out", out])
    state, metadata = export.read_safetensors(out)
    assert shapes_of(state) == timm_layout(model.config, depth=3, layer_scale=False)
    assert torch.equal(state["pos_embed"][:, 0], torch.zeros_like(state["pos_embed"][:, 0]))  # zero class row
    assert summary["timm_model"] == metadata["timm_model"] == "vit_small_patch16_224"
    x = images(model.config)
    with torch.no_grad():
        torch.testing.assert_close(timm_forward(state, x, model.config.heads), model(x, depth=3), atol=1e-5, rtol=1e-5)


def test_timm_layout_is_exact_for_deit3_baseline(tmp_path):
    model = tiny("vit-mini")  # DeiT III: LayerScale, patch-only positions
    path = write_checkpoint(tmp_path / "vit.pt", model, arch="vit-mini")
    out = tmp_path / "timm.pth"
    summary = run([path, "--format", "timm", "--out", out])
    state = torch.load(out, weights_only=True)
    assert shapes_of(state) == timm_layout(model.config, depth=model.config.depth, layer_scale=True)
    assert summary["timm_model"] == "deit3_small_patch16_224"
    x = images(model.config)
    with torch.no_grad():
        torch.testing.assert_close(timm_forward(state, x, model.config.heads), model(x), atol=1e-5, rtol=1e-5)


def test_timm_model_names_and_arguments():
    def config(name, **overrides):
        return revit.ViTConfig(**{**revit.PRESETS[name], **overrides})

    fold = dict(arch="vit", raptor_blocks=1)
    assert export.timm_model_args(config("revit-s", **fold)) == ("vit_small_patch16_224", {})
    assert export.timm_model_args(config("revit-b", **fold, depth=16)) == ("vit_base_patch16_224", {"depth": 16})
    assert export.timm_model_args(config("revit-l", **fold)) == ("vit_large_patch16_224", {})
    assert export.timm_model_args(config("vit-s")) == ("deit3_small_patch16_224", {})
    assert export.timm_model_args(config("vit-b14")) == ("deit3_base_patch16_224", {"patch_size": 14})
    assert export.timm_model_args(config("revit-mini", **fold)) == (
        "vit_small_patch16_224", dict(img_size=28, patch_size=7, in_chans=1, num_classes=10, embed_dim=96,
                                      depth=6, num_heads=3, mlp_ratio=2.0))


def random_timm_state(config, layer_scale, seed=3):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=g) * 0.3
            for k, shape in timm_layout(config, config.depth, layer_scale).items()}


@pytest.mark.parametrize("file_has_layer_scale", [False, True])
@pytest.mark.parametrize("model_has_layer_scale", [False, True])
def test_load_timm_state_dict_matches_timm_numerics(file_has_layer_scale, model_has_layer_scale):
    model = revit.create_model("vit-mini", **TINY, layer_scale_init=1e-4 if model_has_layer_scale else None).eval()
    state = random_timm_state(model.config, file_has_layer_scale)  # vit_* files: non-zero class-token row
    export.load_timm_state_dict(model, {"model": state})  # wrapped like a DeiT training checkpoint
    x = images(model.config)
    with torch.no_grad():
        torch.testing.assert_close(model(x), timm_forward(state, x, model.config.heads), atol=1e-5, rtol=1e-5)


def test_timm_export_loads_back_into_a_baseline(checkpoint):
    model, _ = checkpoint
    state = export.to_timm_state_dict(revit.fold(model, model.config.depth))
    baseline = revit.create_model("vit-mini", **TINY).eval()  # has LayerScale: takes gamma = 1
    export.load_timm_state_dict(baseline, state)
    x = images(model.config)
    with torch.no_grad():
        torch.testing.assert_close(baseline(x), model(x), atol=1e-5, rtol=1e-5)


# --- errors ---


def test_mismatched_shapes_name_the_keys(tmp_path):
    model = revit.create_model("vit-mini", **TINY)
    state = random_timm_state(revit.ViTConfig(**{**asdict(model.config), "num_classes": 7, "ffn_dim": 48}), False)
    with pytest.raises(ValueError) as info:
        export.load_timm_state_dict(model, state)
    message = str(info.value)
    assert "\n" not in message and "14 differently shaped tensors (head.weight [7, 16] vs [5, 16]" in message

    path = tmp_path / "folded.safetensors"
    export.save_safetensors(revit.fold(tiny(), 3), path, "folded")
    shallower = revit.create_model("vit-mini", **{**TINY, "depth": 2, "raptor_blocks": 1})  # with LayerScale
    with pytest.raises(ValueError) as info:
        export.load_safetensors(path, model=shallower)
    message = str(info.value)
    assert str(path) in message and "4 missing tensors (blocks.0.ls1.gamma, blocks.0.ls2.gamma" in message


class OsSystem:
    """A pickled call of os.system: a safe load must refuse it, and say so."""
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def edit_safetensors_config(path, **fields):
    tensors, metadata = export.read_safetensors(path)
    metadata["config"] = json.dumps({**json.loads(metadata["config"]), **fields})
    save_file(tensors, str(path), metadata=metadata)


def bad_inputs(tmp_path, checkpoint):
    """Files a user might pass by mistake, each next to the checkpoint fixture."""
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "hello.txt").write_text("hello\n")  # torch.load: KeyError naming a byte
    (tmp_path / "card.json").write_text(json.dumps({"name": "revit-mini"}))  # a safe load refuses it
    (tmp_path / "garbage.safetensors").write_bytes(b"not a checkpoint")
    export.save_timm(revit.fold(checkpoint[0], 2), tmp_path / "timm.safetensors")
    write_checkpoint(tmp_path / "vit.pt", tiny("vit-mini"), arch="vit-mini")
    torch.save([1, 2, 3], tmp_path / "list.pt")
    torch.save({"model": {}, "note": Path("notes.txt")}, tmp_path / "pickled.pt")  # a pickled Python object
    ckpt = torch.load(checkpoint[1], weights_only=True)
    ckpt["model_config"]["ffn_dim"] = 48
    torch.save(ckpt, tmp_path / "misfit.pt")
    del ckpt["arch"]
    torch.save(ckpt, tmp_path / "no_arch.pt")
    diverged = tiny()
    with torch.no_grad():
        diverged.block.attn.qkv.weight[0, 0] = float("nan")
    write_checkpoint(tmp_path / "diverged.pt", diverged)
    (tmp_path / "afile").write_text("a file where a folder is expected")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "ckpt.pt").write_bytes(b"another run's checkpoint")
    (tmp_path / "loop.pt").symlink_to(tmp_path / "loop.pt")
    (tmp_path / "loop.safetensors").symlink_to(tmp_path / "loop.safetensors")
    torch.save({"model": OsSystem()}, tmp_path / "os_system.pt")
    folded = revit.fold(checkpoint[0], 2)
    export.save_safetensors(folded, tmp_path / "deep.safetensors", "folded")
    edit_safetensors_config(tmp_path / "deep.safetensors", depth=10 ** 9)
    export.save_safetensors(folded, tmp_path / "wide.safetensors", "folded")
    edit_safetensors_config(tmp_path / "wide.safetensors", dim=2 ** 15, heads=1, ffn_dim=2 ** 17)
    with torch.no_grad():
        folded.head.bias[0] = float("inf")
    export.save_safetensors(folded, tmp_path / "nan.safetensors", "folded")
    with torch.no_grad():
        folded.head.bias[0] = 0.0
        folded.cls_token.fill_(3e38)  # finite, but its LayerNorm overflows
    export.save_safetensors(folded, tmp_path / "huge.safetensors", "folded")
    deep = torch.load(checkpoint[1], weights_only=True)
    deep["model_config"]["depth"] = 10 ** 9
    torch.save(deep, tmp_path / "deep.pt")
    lm = alternet.create_model("alternet-tiny", dim=16, heads=2, ffn_dim=16, num_experts=2, seq_len=8)
    torch.save({"model": lm.state_dict(), "arch": "alternet-tiny", "model_config": asdict(lm.config)},
               tmp_path / "language.pt")


@pytest.mark.parametrize("argv, needle", [
    (["{ckpt}", "--depth", "1", "--format", "onnx", "--out", "{tmp}/x"], "--depth must be in 2..256; got 1"),
    (["{ckpt}", "--depth", "1000000000", "--format", "safetensors", "--out", "{tmp}/x"],
     "--depth must be in 2..256"),
    (["{ckpt}", "--format", "compact", "--out", "{tmp}/afile/x"], "afile is a file, not a folder"),
    (["{ckpt}", "--format", "compact", "--out", "{ckpt}"], "is the checkpoint being exported"),
    (["{ckpt}", "--format", "compact", "--out", "{tmp}/run/ckpt.pt"], "is a file of a training run"),
    (["{tmp}/loop.pt", "--format", "onnx", "--out", "{tmp}/x"], "loop.pt: cannot be read (Too many levels"),
    (["{tmp}/loop.safetensors", "--format", "onnx", "--out", "{tmp}/x"], "loop.safetensors: not a readable "
                                                                         "safetensors file"),
    (["{tmp}/os_system.pt", "--format", "onnx", "--out", "{tmp}/x"], "it stores the Python object posix.system"),
    (["{tmp}/deep.safetensors", "--format", "onnx", "--out", "{tmp}/x"], "depth must be in 1..256"),
    (["{tmp}/wide.safetensors", "--format", "onnx", "--out", "{tmp}/x"], "do not fit its own config"),
    (["{tmp}/nan.safetensors", "--format", "onnx", "--out", "{tmp}/x"], "nan.safetensors: its weights are not "
                                                                        "finite (head.bias"),
    (["{tmp}/deep.pt", "--format", "onnx", "--out", "{tmp}/x"], "model_config has depth=1000000000; at most 256"),
    (["{tmp}/huge.safetensors", "--format", "compact", "--out", "{tmp}/x"], "huge.safetensors: its weights are "
                                                                           "finite but its output is not"),
    (["{ckpt}", "--format", "onnx", "--opset", "9", "--out", "{tmp}/x"], "--opset must be in 14..20; got 9"),
    (["{ckpt}", "--depth", "8", "--format", "compact", "--out", "{tmp}/x"],
     "--depth is not allowed with --format compact, which keeps every depth"),
    (["{ckpt}", "--format", "safetensors", "--out", "{tmp}"], "is a folder"),
    (["{tmp}/missing.pt", "--depth", "4", "--format", "onnx", "--out", "{tmp}/x"], "missing.pt: no such file"),
    (["{tmp}", "--format", "onnx", "--out", "{tmp}/x"], "a folder, not a file"),
    (["{tmp}/garbage.pt", "--format", "onnx", "--out", "{tmp}/x"], "garbage.pt: not a PyTorch file"),
    (["{tmp}/empty.pt", "--format", "onnx", "--out", "{tmp}/x"], "empty.pt: not a PyTorch file"),
    *((["{tmp}/" + name, "--format", "onnx", "--out", "{tmp}/x"], f"{name}: not a PyTorch file; expected a "
       "ckpt.pt written by train.py or a .safetensors from weights/ or tools.export") for name in
      ("hello.txt", "card.json")),
    (["{tmp}/list.pt", "--format", "onnx", "--out", "{tmp}/x"], "list.pt: not a checkpoint of this project"),
    (["{tmp}/no_arch.pt", "--format", "onnx", "--out", "{tmp}/x"], "no_arch.pt: not a checkpoint of this "
                                                                   "project (missing arch)"),
    (["{tmp}/pickled.pt", "--format", "onnx", "--out", "{tmp}/x"], "it stores the Python object pathlib"),
    (["{tmp}/misfit.pt", "--format", "onnx", "--out", "{tmp}/x"], "its weights do not fit revit-mini"),
    (["{tmp}/language.pt", "--format", "onnx", "--out", "{tmp}/x"], "holds the language model alternet-tiny"),
    (["{tmp}/diverged.pt", "--format", "compact", "--out", "{tmp}/x"], "weights are not finite (block.attn.qkv"),
    (["{tmp}/garbage.safetensors", "--format", "onnx", "--out", "{tmp}/x"], "not a readable safetensors file"),
    (["{tmp}/timm.safetensors", "--format", "onnx", "--out", "{tmp}/x"], "not a revit safetensors export"),
    (["{tmp}/vit.pt", "--depth", "3", "--format", "safetensors", "--out", "{tmp}/x"], "untied ViT runs only its own depth (4)"),
])
def test_bad_input_gives_one_line_naming_it_and_writes_nothing(checkpoint, tmp_path, argv, needle):
    bad_inputs(tmp_path, checkpoint)
    argv = [a.format(ckpt=checkpoint[1], tmp=tmp_path) for a in argv]
    with pytest.raises(SystemExit) as info:
        export.main(argv)
    message = str(info.value)
    assert ONE_LINE_ERROR.match(message) and needle in message, message
    assert "weights_only" not in message
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.tmp*"))
    assert not (tmp_path / "pwned").exists() and not Path("pwned").exists()
    assert torch.load(checkpoint[1], weights_only=True)["arch"] == "revit-mini"  # the input is never overwritten


def test_argument_errors_come_before_the_onnx_package_is_looked_for(checkpoint, tmp_path, monkeypatch):
    """Without onnx installed, a bad input is still reported as what it is."""
    monkeypatch.setitem(sys.modules, "onnx", None)
    bad_inputs(tmp_path, checkpoint)
    for argv, needle in [([checkpoint[1], "--depth", "1"], "--depth must be in 2..256; got 1"),
                         ([checkpoint[1], "--opset", "9"], "--opset must be in 14..20"),
                         ([tmp_path / "missing.pt"], "no such file"),
                         ([tmp_path / "diverged.pt"], "weights are not finite")]:
        with pytest.raises(SystemExit) as info:
            export.main([str(a) for a in argv] + ["--format", "onnx", "--out", str(tmp_path / "x")])
        assert needle in str(info.value) and "onnx package" not in str(info.value)
    with pytest.raises(SystemExit, match="needs the onnx package"):  # a good input: then the package is asked for
        export.main([str(checkpoint[1]), "--format", "onnx", "--out", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("argv, needle", [
    (["{ckpt}", "--depth", "two", "--format", "onnx", "--out", "{tmp}/x"], "invalid int value: 'two'"),
    (["{ckpt}", "--depth", "4", "--format", "tflite", "--out", "{tmp}/x"], "invalid choice: 'tflite'"),
    (["{ckpt}", "--depth", "4", "--format", "onnx"], "--out"),
])
def test_malformed_flags_are_argparse_errors(checkpoint, tmp_path, capsys, argv, needle):
    with pytest.raises(SystemExit) as info:
        export.main([a.format(ckpt=checkpoint[1], tmp=tmp_path) for a in argv])
    assert info.value.code == 2 and needle in capsys.readouterr().err.splitlines()[-1]


def test_command_line_prints_no_traceback(checkpoint, tmp_path):
    bad_inputs(tmp_path, checkpoint)  # torch's own text for this file is many lines and advises weights_only=False
    result = subprocess.run([sys.executable, "-m", "tools.export", str(tmp_path / "pickled.pt"), "--format", "timm",
                             "--out", str(tmp_path / "x")], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 1 and result.stdout == ""
    assert ONE_LINE_ERROR.match(result.stderr.strip()) and "Traceback" not in result.stderr, result.stderr
    assert "weights_only" not in result.stderr and not (tmp_path / "x").exists()


def test_onnx_without_optional_packages(checkpoint, tmp_path, capsys, monkeypatch):
    pytest.importorskip("onnx", reason="onnx not installed (pip install -r requirements-extra.txt)")
    argv = [checkpoint[1], "--depth", 3, "--format", "onnx", "--out", tmp_path / "m.onnx"]
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # written, not checked, and the user is told
    assert run(argv)["onnx_max_abs_diff"] is None and (tmp_path / "m.onnx").is_file()
    assert "onnxruntime is not installed" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "onnx", None)
    argv[-1] = tmp_path / "new" / "m.onnx"
    with pytest.raises(SystemExit, match="needs the onnx package"):
        run(argv)
    assert not (tmp_path / "new").exists()  # checked before anything is written


def test_cli_end_to_end(checkpoint, tmp_path, capsys):
    model, path = checkpoint
    formats = [("safetensors", "m.safetensors"), ("timm", "t.safetensors"), ("compact", "c.safetensors")]
    if importlib.util.find_spec("onnx") is not None:
        formats.append(("onnx", "m.onnx"))
    for fmt, name in formats:
        out = tmp_path / "exports" / name
        depth = [] if fmt == "compact" else ["--depth", 4]  # a compact file keeps every depth
        summary = run([path, *depth, "--format", fmt, "--out", out], capsys)
        assert out.is_file() and summary["format"] == fmt and summary["source_arch"] == "revit"
        umask = os.umask(0)
        os.umask(umask)
        assert out.stat().st_mode & 0o777 == 0o666 & ~umask, fmt  # as every output (safetensors' own: 0600)


def test_an_interrupted_export_leaves_no_file(checkpoint, tmp_path, monkeypatch):
    def write_half_then_stop(model, path, kind, **extra):
        Path(path).write_bytes(b"half a file")
        raise KeyboardInterrupt  # Ctrl-C (or a full disk) in the middle of the write
    monkeypatch.setattr(export, "save_safetensors", write_half_then_stop)
    with pytest.raises(KeyboardInterrupt):
        export.main([str(checkpoint[1]), "--format", "compact", "--out", str(tmp_path / "m.safetensors")])
    assert [p.name for p in tmp_path.iterdir()] == ["revit.pt"]  # neither the file nor a temporary one
