"""reViT's per-call merge (Eq. 2) of a bf16 expert bank: one bf16 matmul accumulating in fp32, never an fp32
copy of the bank.

With bf16 weights (latency on a GPU, the paper's Table 7) the dynamic form merges E experts of P
parameters at every step. Copying the bank to fp32 first would hold E x P fp32 values per step (S/16:
12 such copies alive in inductor's plan, ~130 MB against DeiT III's ~10 MB), so the memory column would
show reViT above DeiT III for our bookkeeping, not for the method. Measured with lib/memory.py's probe.
"""
import pytest
import torch

import revit
from helpers import images, randomise
from lib import memory

CPU = torch.device("cpu")
WIDE = dict(dim=64, heads=2, ffn_dim=256, depth=4, num_experts=4)  # the bank dominates the activations


def bf16_pair():
    """The same bf16 weights with a dynamic merge and with the merge cache."""
    torch.manual_seed(0)
    cached = randomise(revit.create_model("revit-mini", **WIDE)).eval().to(torch.bfloat16)
    dynamic = revit.create_model("revit-mini", **WIDE, merge_cache=False).eval().to(torch.bfloat16)
    dynamic.load_state_dict(cached.state_dict())
    return dynamic, cached


def test_a_bf16_dynamic_forward_holds_one_bf16_merged_ffn_beyond_the_cached_forward():
    """Both forwards compute the same activations; the dynamic one also holds the FFN it merges for the
    step (P bf16 values), and before this change the fp32 copy of a bank tensor (E x d_ff x d x 4 bytes).
    Inference mode, as bench.py's latency rows run."""
    dynamic, cached = bf16_pair()
    x = images(1, dynamic).to(torch.bfloat16)
    with torch.inference_mode():
        cached(x)  # the cache is built before the measurement, as a latency row's warm-up does
        extra = memory.peak_bytes(lambda: dynamic(x), CPU) - memory.peak_bytes(lambda: cached(x), CPU)
    ffn = dynamic.block.mlp
    one_merged_ffn = 2 * sum(p[0].numel() for p in ffn.bank())                    # bf16 bytes
    fp32_bank_tensor = 4 * ffn.fc1_weight.numel()
    assert extra <= one_merged_ffn + 1024 < fp32_bank_tensor, (extra, one_merged_ffn, fp32_bank_tensor)


@torch.no_grad()
def test_no_op_of_a_bf16_dynamic_forward_makes_an_fp32_tensor_of_bank_size():
    dynamic, _ = bf16_pair()
    x = images(2, dynamic).to(torch.bfloat16)
    bank_tensor = dynamic.block.mlp.fc1_weight.numel()
    made = []

    class Record(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.numel() >= bank_tensor:
                made.append(str(func))
            return out

    with Record():
        dynamic(x)
    assert made == []


@torch.no_grad()
@pytest.mark.parametrize("elastic", [False, True])
def test_bf16_merged_ffns_are_eq_2_within_bf16_rounding(elastic):
    """Against Eq. 2 summed in float64 from the same bf16 bank and the fp32 gates: each gate rounded to
    bf16 as the matmul's operand and the sum rounded once (bf16's unit roundoff 2^-8 each), so within
    2^-7 of sum_e |g_e| |theta_e| (the experts' terms cancel in places: a bound relative to the sum would
    not hold)."""
    dynamic, _ = bf16_pair()
    ffn = dynamic.block.mlp
    coords = torch.tensor([0.0, 1 / 3, 0.5, 1.0])
    gates = ffn.gates(coords)                                                     # (4, E)
    assert gates.dtype == torch.float32
    merged = ffn.merge(gates, torch.bfloat16) if elastic else tuple(ffn.ffn_at(coords[1:2]))
    for w, bank in zip(merged, ffn.bank()):
        reference = torch.einsum("ne,e...->n...", gates.double(), bank.double())
        scale = torch.einsum("ne,e...->n...", gates.double().abs(), bank.double().abs())
        reference, scale = (reference, scale) if elastic else (reference[1], scale[1])
        assert w.dtype == torch.bfloat16
        assert ((w.double() - reference).abs() <= 2 ** -7 * scale + 1e-30).all()
