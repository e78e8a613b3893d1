"""The merge cache holds the merged FFNs in the dtype they are used in, so a cached call casts nothing.

Latency with bf16 weights (bench.py latency on CUDA, the paper's Table 7) compares reViT's cached form
with DeiT III, whose weights were cast to bf16 once. An fp32 cache cast back to bf16 at every step would
charge reViT 4 casts per step (48 per S/16 forward) for our bookkeeping, not for the method, and hold
twice the cache's memory. The merge itself stays fp32 (Eq. 2, App. A.5): it is rounded once, when cached.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import revit
from helpers import images, randomise

CASTS = (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype)


class CountCasts(TorchDispatchMode):
    """The dtype casts an op sequence makes (a cast to the same dtype is no op and not counted)."""

    def __init__(self):
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in CASTS and out.dtype != args[0].dtype:
            self.casts += 1
        return out


def casts_of_a_cached_call(model, x) -> int:
    with torch.no_grad():
        model(x)  # builds the cache
        with CountCasts() as counter:
            model(x)
    return counter.casts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cached_call_casts_no_more_than_deit_iii(dtype):
    torch.manual_seed(0)
    revit_model = randomise(revit.create_model("revit-mini")).eval().to(dtype)
    deit = randomise(revit.create_model("vit-mini")).eval().to(dtype)
    x = images(2, revit_model).to(dtype)
    assert casts_of_a_cached_call(revit_model, x) == casts_of_a_cached_call(deit, x) == 0
    assert all(w.dtype == dtype for ffn in revit_model.merged_ffns[1] for w in ffn)


@torch.no_grad()
def test_the_bf16_cache_is_the_fp32_merge_rounded_once():
    """Against Eq. 2 summed by hand in float64 from the same (bf16) bank and the router's gates."""
    torch.manual_seed(0)
    model = randomise(revit.create_model("revit-mini")).eval().to(torch.bfloat16)
    x = images(2, model).to(torch.bfloat16)
    model(x)
    ffn = model.block.mlp
    gates = model.gate_matrix().double()                                         # (L, E), fp32 router
    for cached, bank in zip(map(torch.stack, zip(*model.merged_ffns[1])), ffn.bank()):
        reference = torch.einsum("le,e...->l...", gates, bank.double())          # (L, ...)
        assert cached.dtype == torch.bfloat16
        # one rounding to bf16 (relative 2^-8) of the exact sum: within one bf16 ulp
        torch.testing.assert_close(cached.double(), reference, rtol=2 ** -8, atol=1e-30)
