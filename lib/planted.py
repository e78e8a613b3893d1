"""The planted-depth task (ours): a task that needs a different function at each depth, by construction.
Each 4x4x3 patch token of an input (lib/data.planted_images) is to be mapped to LN(f_L(... f_1(x))).

    python train.py --dataset planted --arch revit-mini --depth 4 --patch-size 4 \
        --model-args dim=48,heads=3,ffn_dim=96
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange

from lib import data, tasks
from lib.boundary import fail


class PlantedMaps:
    """f_1 ... f_L: distinct random residual MLPs f_t(x) = x + W2_t gelu(W1_t LN(x)) on token vectors, from
    a fixed seed (one task for every run seed). The form of a pre-norm FFN block, so an untied stack can fit
    it exactly, a block tied over depth only by an average, and reViT only if ψ gives each step its own
    merge (the motivation of reViT's §1 and §3.1: tying removes depth-specific transformations)."""

    def __init__(self, dim: int, depth: int, hidden: int, gain: float, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.w1 = torch.randn(depth, hidden, dim, generator=g) / math.sqrt(dim)
        self.w2 = torch.randn(depth, dim, hidden, generator=g) * (gain / math.sqrt(hidden))

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """(..., dim) -> LN(f_L(... f_1(tokens))), each token on its own (LN without affine weights)."""
        x = tokens.float()
        for w1, w2 in zip(self.w1.to(x.device), self.w2.to(x.device)):
            x = x + F.gelu(F.layer_norm(x, x.shape[-1:]) @ w1.T) @ w2.T
        return F.layer_norm(x, x.shape[-1:])


# The task's depth L, the maps' hidden width and gain, their seed: fixed, so every run sees one task.
PLANTED_MAPS = dict(depth=4, hidden=8, gain=3.0, seed=2035)


def patch_tokens(x: torch.Tensor, patch: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, patches, C * patch²) in row-major patch order: the input tokens of the task."""
    return rearrange(x, "b c (gy py) (gx px) -> b (gy gx) (c py px)", py=patch, px=patch)


class PlantedTask(tasks.ClassificationTask):
    """Regress the planted composition of each patch token: MSE between the model's final post-norm patch
    tokens (B, patches, d) and LN(f_L ∘ ... ∘ f_1(patch)); the class token is not scored. Needs d equal to
    the patch vector's length (3 * 4² = 48). No augmentation: the input is the target's argument."""

    def __init__(self, cfg, images, device, augment, autocast, model):
        super().__init__(cfg, images, device, augment, autocast)
        self.patch = data.PLANTED["patch_size"]
        width, config = images.channels * self.patch ** 2, model.config
        if (config.patch_size, config.dim) != (self.patch, width):
            fail(f"--dataset planted regresses {images.channels}x{self.patch}² patch vectors: it needs "
                 f"--patch-size {self.patch} and dim={width} (--model-args); got patch {config.patch_size}, "
                 f"dim {config.dim}")
        self.maps = PlantedMaps(width, **PLANTED_MAPS)

    def target(self, x: torch.Tensor) -> torch.Tensor:
        return self.maps(patch_tokens(x, self.patch))

    def loss(self, model, images, labels):
        x = self.augment.normalise(images.to(self.device, non_blocking=True).float() / 255)
        with self.autocast():
            out = model(x, return_states=True)
        task = F.mse_loss(out["tokens"][:, 1:].float(), self.target(x))
        aux = out.get("aux_losses", {})
        return task + sum(aux.values()), {"planted": task, **aux}

    def score(self, model, x, labels, depth):
        with self.autocast():
            tokens = model(x, depth=depth, return_states=True)["tokens"]
        error = F.mse_loss(tokens[:, 1:].float(), self.target(x), reduction="sum")
        return {"mse": error / tokens[0, 1:].numel()}  # summed per-image MSE: evaluate divides by images


def build(cfg, rank: int, world: int, device, ckpt: dict | None):
    """lib/tasks.build's data and model, with the planted task in place of classification."""
    if cfg.probe or cfg.teacher:
        fail(f"--dataset planted is a regression task of its own; it takes no "
             f"--{'probe' if cfg.probe else 'teacher'}")
    model, task, batches, augment, steps_per_epoch = tasks.build(cfg, rank, world, device, ckpt)
    task = PlantedTask(cfg, task.data, task.device, task.augment, task.autocast, model)
    return model, task, batches, augment, steps_per_epoch
