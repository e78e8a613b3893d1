"""A stand-in accelerator for CPU tests: finds the missing `.to(device)` that only a GPU run would hit.

Inside `OnFakeDevice()`, a tensor can sit on a fake device: its data stay on the CPU, but it reports
FAKE (torch.device("meta")) as its `.device`, as a tensor on a GPU reports cuda:0. Tensors get there
as on a GPU: `.to(FAKE)` (also `module.to(FAKE)`: its parameters and buffers), a factory given
`device=FAKE`, or any op with an input there. `.cpu()` / `.to("cpu")` bring them back. An op whose
tensor arguments mix the fake device and the CPU raises DeviceMismatch, where CUDA would raise
"Expected all tensors to be on the same device". Allowed, as on CUDA: 0-dim CPU tensors (scalars)
with device tensors, CPU index tensors into a device tensor, copies across devices.

Unlike the meta device, every value is real: code that reads numbers (.item(), .tolist(), data-
dependent shapes) runs to the end, so a whole tool's main path can run on the stand-in.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

FAKE = torch.device("meta")
TAG = "_on_fake_device"
CROSS_DEVICE = {torch.Tensor.copy_, torch.Tensor.__setitem__}  # the value may come from another device
INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_}


class DeviceMismatch(AssertionError):
    pass


def on_fake(t) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, TAG, False)


def tagged(t, on: bool = True):
    if isinstance(t, torch.Tensor):
        setattr(t, TAG, on)
    return t


def is_fake(device) -> bool:
    return device is not None and torch.device(device) == FAKE


class CpuAutocast(torch.autocast):
    """torch.autocast for the fake device: the CPU's (autocast has no meta device)."""

    def __init__(self, device_type, *args, **kwargs):
        super().__init__("cpu" if device_type == FAKE.type else device_type, *args, **kwargs)


def cpu_generator(device="cpu"):
    """torch.Generator for the fake device: a CPU one."""
    return REAL_GENERATOR("cpu" if is_fake(device) else device)


REAL_GENERATOR, REAL_AUTOCAST = torch.Generator, torch.autocast


class OnFakeDevice(TorchFunctionMode):
    """Every tensor op runs on the CPU; the mode keeps track of which tensors a GPU would hold.
    While it is on, torch.autocast and torch.Generator given the fake device make the CPU's."""

    def __enter__(self):
        torch.autocast, torch.Generator = CpuAutocast, cpu_generator
        return super().__enter__()

    def __exit__(self, *exc):
        torch.autocast, torch.Generator = REAL_AUTOCAST, REAL_GENERATOR
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is torch._C.TensorBase.device:  # the getter of tensor.device
            return FAKE if on_fake(args[0]) else func(*args)
        if func in (torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda):
            return move(func, args, kwargs)
        if func is torch._C._nn._parse_to:  # module.to(device=...) reads its arguments: nothing to create
            return func(*args, **kwargs)
        factory = is_fake(kwargs.get("device"))
        if factory:
            kwargs = {**kwargs, "device": "cpu"}
        check_devices(func, args, kwargs)
        result = func(*args, **kwargs)
        if args and result is args[0]:  # in place: the tensor stays where it is
            return result
        if factory or any(on_fake(t) for t in tree_flatten((args, kwargs))[0]):
            tree_map(tagged, result)
        return result


def move(func, args, kwargs):
    """.to / .cpu: a tensor moved to FAKE is a tagged alias (a parameter is tagged in place, so that
    module.to(FAKE) keeps its Parameter objects); moved to the CPU, an untagged alias."""
    tensor = args[0]
    if func is torch.Tensor.cuda:
        raise DeviceMismatch(".cuda() called: the code should use the device it was given")
    if func is torch.Tensor.cpu:
        device, dtype, rest = torch.device("cpu"), None, {}
    else:
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
        rest = {"non_blocking": non_blocking}
    to_fake = is_fake(device) or device is None and on_fake(tensor)
    result = tensor.to(device="cpu", dtype=dtype, **rest) if dtype is not None else tensor
    if result is tensor and isinstance(tensor, nn.Parameter) and to_fake:
        return tagged(tensor)
    if result is tensor and on_fake(tensor) != to_fake:
        result = tensor.view_as(tensor)  # a new tensor object on the other side
    return tagged(result, to_fake)


def check_devices(func, args, kwargs) -> None:
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    if func in INDEXING or func in CROSS_DEVICE:
        tensors = tensors[:1] + [t for t in tensors[1:] if on_fake(t)]  # CPU indices / values are allowed
    fake = [t for t in tensors if on_fake(t)]
    cpu = [t for t in tensors if not on_fake(t) and t.dim() > 0]
    if fake and cpu:
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
        raise DeviceMismatch(f"{name} mixes tensors on the device {[tuple(t.shape) for t in fake]} with CPU "
                             f"tensors {[tuple(t.shape) for t in cpu]}: a .to(device) is missing")
