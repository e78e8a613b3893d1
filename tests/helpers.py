"""Small helpers shared by the model tests."""
import torch


def randomise(model, seed=0):
    """Random weights everywhere (zero-initialised routers, LoRA's B, ...) so that checks are not trivial."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def images(batch, model, seed=0):
    """A seeded batch of random images of the model's input shape."""
    c = model.config
    return torch.randn(batch, c.in_channels, c.image_size, c.image_size, generator=torch.Generator().manual_seed(seed))
