"""The equivalences a device must keep, on the CPU here and on a GPU under `python bench.py check`.

Each test runs once per device: "cpu" always; "cuda" (marked gpu) only with REVIT_GPU_TESTS=1 on a
machine with a GPU. `python bench.py check` runs this file in its own process on the device it checks
and puts one row per test in its report, so the first minutes on a GPU say whether bf16 autocast,
torch.compile (inductor), fused AdamW, the fold (reViT §3.1), the merge cache and elastic depth
(§3.2) compute what the CPU computes.

Sizes: on the CPU a tiny reViT (seconds); on a GPU the S/16 models at 224², as the paper's Table 7,
so the kernels are the ones a real run uses (flash attention at head dim 64, bf16 tensor cores).
TF32 is off for the float32 equivalences: it is an approximation by design.
"""
import dataclasses
import logging

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

import revit

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
TINY = dict(image_size=8, patch_size=4, in_channels=3, num_classes=5, dim=16, heads=2, ffn_dim=24, depth=4)


@pytest.fixture(params=DEVICES)
def device(request):
    device = torch.device(request.param)
    if device.type != "cuda":
        yield device
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield device
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def build(arch: str, device: torch.device) -> torch.nn.Module:
    """A ViT or reViT of the device's size, weights nudged off their initial symmetries (zero router output
    layer, equal experts) so that every equivalence has something to compare."""
    torch.manual_seed(0)
    model = revit.create_model(f"{arch}-s") if device.type == "cuda" else revit.create_model(f"{arch}-mini", **TINY)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    return model.to(device)


def images_for(model, device, batch: int = 4) -> torch.Tensor:
    c = model.config
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, c.in_channels, c.image_size, c.image_size, generator=g).to(device)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def forward_backward(model, images, bf16: bool = False):
    """Logits and the flat gradient of a scalar of them, with or without bf16 autocast."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(images.device.type, dtype=torch.bfloat16, enabled=bf16):
        out = model(images, return_states=True)
        loss = out["logits"].float().logsumexp(-1).mean() + sum(out["aux_losses"].values())
    loss.backward()
    return out["logits"].detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def copy_of(model, **changes):
    """The same weights in a second module (config changes that keep the parameters)."""
    copy = type(model)(dataclasses.replace(model.config, **changes)).to(next(model.parameters()).device)
    copy.load_state_dict(model.state_dict())
    return copy


@pytest.mark.parametrize("arch", ["vit", "revit"])
def test_bf16_autocast_is_close_to_fp32_and_leaves_a_later_fp32_call_unchanged(arch, device):
    """The merge cache keys on the autocast state: an fp32 call after a bf16 one must not reuse bf16 weights."""
    model = build(arch, device).train()
    x = images_for(model, device)
    ref_logits, ref_grads = forward_backward(model, x)
    logits, grads = forward_backward(model, x, bf16=True)
    assert logits.dtype == torch.bfloat16
    assert relative_error(logits, ref_logits) < 0.05 and relative_error(grads, ref_grads) < 0.05
    model.eval()
    with torch.no_grad():
        before = model(x)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            model(x)
        assert relative_error(model(x), before) <= 1e-6


def test_compiled_forward_and_backward_equal_eager_without_recompiling(device, monkeypatch):
    """inductor on a GPU (what train.py --compile runs); on the CPU aot_eager (graph capture, guards and the
    joint graph without inductor's C++ build, which takes minutes here)."""
    monkeypatch.setattr(logging.getLogger("torch.__trace"), "disabled", True)  # pytest would record dynamo's trace
    torch._dynamo.reset()
    model = build("revit", device).train()
    x = images_for(model, device)
    ref_logits, ref_grads = forward_backward(model, x)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor" if device.type == "cuda" else "aot_eager")
    compiled = torch.compile(model, backend=counter)
    logits, grads = forward_backward(compiled, x)
    frames = counter.frame_count
    forward_backward(compiled, x)
    assert relative_error(logits, ref_logits) <= 1e-4 and relative_error(grads, ref_grads) <= 1e-4
    assert counter.frame_count == frames  # a repeated call builds nothing new
    torch._dynamo.reset()


def test_fused_adamw_step_equals_the_foreach_step(device):
    model = build("revit", device).train()
    x = images_for(model, device)
    before = torch.cat([p.detach().flatten() for p in model.parameters()])
    updates = []
    for fused in (True, False):
        copy = copy_of(model)
        optimizer = torch.optim.AdamW(copy.parameters(), lr=1e-3, weight_decay=0.05, fused=fused,
                                      foreach=None if fused else True)
        forward_backward(copy, x)
        optimizer.step()
        updates.append(torch.cat([p.detach().flatten() for p in copy.parameters()]) - before)
    assert relative_error(updates[0], updates[1]) <= 1e-5


@torch.no_grad()
def test_fold_equals_the_revit_at_its_depth_and_at_another(device):
    """§3.1: revit.fold's plain ViT computes what the reViT computes at that depth."""
    model = build("revit", device).eval()
    x = images_for(model, device)
    for depth in (model.config.depth, max(2, model.config.depth // 2)):
        assert relative_error(revit.fold(model, depth)(x), model(x, depth=depth)) <= 1e-4, depth


@torch.no_grad()
def test_merge_cache_equals_merging_on_every_call_also_after_a_weight_change(device):
    model = build("revit", device).eval()
    dynamic = copy_of(model, merge_cache=False).eval()
    x = images_for(model, device)
    assert relative_error(model(x), dynamic(x)) <= 1e-5
    for m in (model, dynamic):
        m.block.mlp.fc1_weight.mul_(1.01)  # the cache must notice
    assert relative_error(model(x), dynamic(x)) <= 1e-5


@torch.no_grad()
def test_an_elastic_keep_mask_equals_the_smaller_depth(device):
    """§3.2: an image that keeps n of the L steps (renumbered to k / (n - 1)) equals the model run at depth n."""
    model = build("revit", device).eval()
    x = images_for(model, device)
    keep = torch.ones(len(x), model.config.depth, dtype=torch.bool, device=device)
    keep[1:, 1::2] = False  # every other step dropped for all but the first image
    out = model(x, keep=keep)
    for i in range(len(x)):
        assert relative_error(out[i], model(x[i:i + 1], depth=int(keep[i].sum()))[0]) <= 1e-4, i
