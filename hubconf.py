"""torch.hub entry points: the trained weights in weights/, to try both models without training.

    import torch
    model = torch.hub.load("path/to/clone", "revit_mini", source="local")    # reViT on Fashion-MNIST
    lm = torch.hub.load("path/to/clone", "alternet_tiny", source="local")   # AlterNet on the built-in corpus

Each returns the model in eval mode, rebuilt from weights/NAME.safetensors (its arch and model config are in
the file's metadata; weights/NAME.json gives the training command, commit, hardware and scores), with the
two model files, torch and safetensors only. The same files are checkpoints for every command.
"""
import json
import pathlib

import safetensors

import alternet
import revit

dependencies = ["torch", "einops", "safetensors"]  # what torch.hub checks before loading this file
WEIGHTS = pathlib.Path(__file__).resolve().parent / "weights"


def _load(name: str, module, pretrained: bool):
    with safetensors.safe_open(str(WEIGHTS / f"{name}.safetensors"), framework="pt") as f:
        metadata = f.metadata()
        config = json.loads(metadata["model_config"])
        if module is revit:  # saved with lib/moe.py's fields too (ffn="merge": reViT's own FFN), unused here
            config = {k: v for k, v in config.items() if k in revit.ViTConfig.__dataclass_fields__}
        model = module.create_model(metadata["arch"], **config)
        if pretrained:
            state = {key: f.get_tensor(key) for key in f.keys()}
            if not all(t.isfinite().all() for t in state.values()):  # as every reader of weights refuses
                raise ValueError(f"{name}.safetensors: its weights are not finite")
            model.load_state_dict(state)
    return model.eval()


def revit_mini(pretrained: bool = True) -> revit.ReViT:
    """reViT `revit-mini` (E = 4 experts, L = 6 steps, d = 96) trained on Fashion-MNIST: input [B, 1, 28, 28]
    in [0, 1], normalised with mean 0.2860 and std 0.3530; output logits over the 10 classes. Any depth
    runs: `model(x, depth=4)`."""
    return _load("revit-mini", revit, pretrained)


def alternet_tiny(pretrained: bool = True) -> alternet.AlterNet:
    """AlterNet `alternet-tiny` (E = 4 expert blocks, top-2, up to 6 iterations, d = 128) trained on the
    repository's built-in corpus, byte tokens (vocabulary 256): `lm.generate(ids, max_new_tokens=100)`."""
    return _load("alternet-tiny", alternet, pretrained)
