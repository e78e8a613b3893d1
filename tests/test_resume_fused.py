"""A resumed run steps with the optimizer implementation of the device it runs on, whatever device saved
the checkpoint: torch's Optimizer.load_state_dict restores each saved group's `fused` flag with its
hyperparameters, so a CPU checkpoint (fused=None) resumed on a GPU silently dropped fused AdamW, and a GPU
checkpoint resumed on a CPU took CPU fused AdamW instead of the CPU runs' default (other numerics).
Reproduced on the CPU: the GPU's choice is CPU fused AdamW (torch has one), through device_options."""
import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import train
from test_train import run

REAL_OPTIONS = train.device_options


@pytest.fixture
def fused_seen():
    """The `fused` flag of every optimizer step taken while the test runs."""
    seen = []
    handle = register_optimizer_step_pre_hook(
        lambda optimizer, args, kwargs: seen.append(optimizer.param_groups[0]["fused"]))
    yield seen
    handle.remove()


def fused_device(monkeypatch):
    """This CPU as a device whose choice is fused AdamW (CUDA's, in device_options)."""
    monkeypatch.setattr(train, "device_options", lambda kind, precision="auto": {
        **REAL_OPTIONS(kind, precision), "fused_adamw": True})


@pytest.mark.parametrize("saved_on_fused_device", [False, True])
def test_resume_applies_this_device_s_fused_choice(tmp_path, fashion_mnist_dir, monkeypatch, fused_seen,
                                                   saved_on_fused_device):
    with monkeypatch.context() as saving:
        if saved_on_fused_device:
            fused_device(saving)
        _, out = run(tmp_path, fashion_mnist_dir, "--max-steps", "4", "--stop-at-step", "2")
    saved = torch.load(out / "ckpt.pt", weights_only=False)["optimizer"]["param_groups"]
    assert {g["fused"] for g in saved} == ({True} if saved_on_fused_device else {None})
    if not saved_on_fused_device:
        fused_device(monkeypatch)  # resumed where fused AdamW is the choice
    summary = train.main(["--resume", str(out / "ckpt.pt"), "--no-progress"])
    assert summary["step"] == 4
    resumed = fused_seen[2:]
    assert len(resumed) == 2 and set(resumed) == ({None} if saved_on_fused_device else {True}), fused_seen
