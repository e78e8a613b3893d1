"""Devices and dtypes: bf16 weights, bf16 autocast, torch.compile, and the equivalences a GPU must keep.

A GPU run uses bf16 (`torch.autocast("cuda", dtype=torch.bfloat16)`, or bf16 weights for the latency rows
of the paper's Table 7) and `torch.compile`; the same code paths run here on the CPU with tiny models, so
the first GPU user is not their first test. In order:

- bf16 weights: reViT's merges (Eq. 2) and its merge cache in the dtype they are used in;
- bf16 autocast: close to fp32, with the gates, merges and router logits kept in fp32;
- torch.compile: values equal to eager, and the graphs counted (a graph break is a return to Python on a
  GPU, and the frames resumed after it can recompile at every call);
- TestOnDevice: what `python bench.py check` runs on the device it checks, one row per test.
"""
import dataclasses
import logging

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
from torch.utils._python_dispatch import TorchDispatchMode

import alternet
import revit
from helpers import images, randomise
from lib import memory, moe

CPU = torch.device("cpu")
TINY = dict(image_size=8, patch_size=4, in_channels=3, num_classes=5, dim=16, heads=2, ffn_dim=24, depth=4)
KEEP = torch.tensor([[True, False, True, True], [False, True, True, False], [True] * 4])  # elastic depth


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


# --- bf16 weights: one bf16 matmul accumulating in fp32, never an fp32 copy of the bank ---------------------
# With bf16 weights the dynamic form merges E experts of P parameters at every step. Copying the bank to fp32
# first would hold E x P fp32 values per step (S/16: 12 such copies alive in inductor's plan, ~130 MB against
# DeiT III's ~10 MB), so the memory column would show reViT above DeiT III for our bookkeeping, not for the
# method. The merge cache holds the merged FFNs in the dtype they are used in: an fp32 cache cast back to bf16
# at every step would charge reViT 4 casts per step (48 per S/16 forward). The merge itself stays fp32 (Eq. 2,
# App. A.5): it is rounded once, when cached.
WIDE = dict(dim=64, heads=2, ffn_dim=256, depth=4, num_experts=4)  # the bank dominates the activations
CASTS = (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype)


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
    Inference mode, as bench.py's latency rows run. Measured with lib/memory.py's probe."""
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

    class Record(TorchDispatchMode):
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


# --- bf16 autocast ------------------------------------------------------------------------------------------
# Intended dtypes: psi's gates and every Eq. 2 merge are fp32 (cast to the activation dtype at use); other
# routers' logits are fp32; the logits a model returns are bf16 (autocast's output dtype for the head's
# Linear); the residual stream stays fp32.
# every family: the baselines, reViT in its modes, one mechanism of each MoE family, LoRA
FAMILIES = {
    "vit": ("vit-mini", {}), "raptor": ("raptor-mini-k2", {}), "revit-fixed": ("revit-mini", {}),
    "revit-elastic": ("revit-mini", {}), "revit-cached": ("revit-mini", {}),
    "revit-folded": ("revit-mini", {}), "weight-merge (SMEAR)": ("revit-mini-smear", {}),
    "token-dispatch (Qwen3)": ("revit-mini-qwen3-u1.5", {}),
    "output-mixture (Soft-MoE)": ("revit-mini-softmoe-u2", {}),
    "lora": ("revit-mini-lora", dict(lora_rank=3)),
}


def build(family: str, seed: int = 0) -> torch.nn.Module:
    """A tiny model with its default init, plus non-zero routers and LoRA updates (zero at init)."""
    name, overrides = FAMILIES[family]
    torch.manual_seed(seed)
    model = moe.create_model(name, **{**TINY, **overrides})
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "router" in pname or pname.endswith("_up"):
                p.normal_(0.0, 0.5)
    if family == "revit-folded":
        model = revit.fold(model)
    return model.eval() if family == "revit-cached" else model.train()


def run(model, family, x):
    if family == "revit-elastic":
        return model(x, keep=KEEP, return_states=True)
    return model(x, return_states=True)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_autocast_forward_backward_close_to_fp32(family):
    model = build(family)
    x = images(3, model)
    grad_context = torch.no_grad() if family == "revit-cached" else torch.enable_grad()
    with grad_context:
        reference = run(model, family, x)["logits"]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = run(model, family, x)
            loss = out["logits"].float().pow(2).mean() + sum(out["aux_losses"].values())
        after = run(model, family, x)["logits"]
    assert out["logits"].dtype == torch.bfloat16 and out["states"][-1].dtype == torch.float32
    assert relative_error(out["logits"], reference) < 0.05
    torch.testing.assert_close(after, reference, rtol=0, atol=0)  # an fp32 call after autocast is unaffected
    if family != "revit-cached":
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        assert [n for n, g in grads.items() if g is None] == []
        assert all(torch.isfinite(g).all() for g in grads.values())


def test_gates_merges_and_router_logits_stay_fp32_under_autocast():
    model = build("revit-fixed")
    ffn = model.block.mlp
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gates = model.gate_matrix()
        merged = ffn.merge(gates)
        out = model.eval()(images(2, model), return_states=True)
        with torch.no_grad():
            model(images(2, model))  # fills the merge cache under autocast
        routed = moe.router_logits(torch.randn(5, 16), torch.randn(4, 16))
    assert gates.dtype == out["gates"].dtype == routed.dtype == torch.float32
    assert all(w.dtype == torch.float32 for w in merged)
    assert all(w.dtype == torch.float32 for f in model.merged_ffns[1] for w in f)
    torch.testing.assert_close(gates, model.gate_matrix(), rtol=0, atol=0)
    fold = revit.fold(model)
    torch.testing.assert_close(fold.blocks[1].mlp.fc2.weight, merged[2][1], rtol=1e-6, atol=1e-7)


# --- torch.compile ------------------------------------------------------------------------------------------
# Values against eager run with backend="aot_eager": Dynamo's graph capture, guards, graph breaks, recompiles
# and AOTAutograd's joint forward/backward graph, without inductor's C++ code generation (over a minute for
# the tiniest model on a CPU). Graphs are counted with the "eager" backend (capture only). Under torch 2.11
# one untraceable call in the router's fp32 region (torch.amp.is_autocast_available) broke a revit-mini
# training forward into 26 graphs while torch 2.13 traced it: a test comparing only outputs passed under
# both. What depth does to the graphs: the L steps are unrolled, so each new depth compiles new graphs and a
# repeated depth reuses them; past torch._dynamo.config.recompile_limit distinct depths Dynamo runs the
# forward eagerly. The elastic step loop is never compiled: it runs eagerly inside a compiled model.


@pytest.fixture
def fresh_dynamo(monkeypatch):
    # pytest's log capture would record Dynamo's structured trace (DEBUG) and slow compiles several-fold
    monkeypatch.setattr(logging.getLogger("torch.__trace"), "disabled", True)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def train_step(model, x, labels, lr=0.1):
    """One SGD step; returns the loss and the updated parameters."""
    out = model(x, return_states=True)
    loss = torch.nn.functional.cross_entropy(out["logits"], labels) + sum(out["aux_losses"].values())
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
            p.grad = None
    return loss.detach()


def compiled(model):
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    return torch.compile(model, backend=counter), counter


def count_graphs(model, call) -> tuple[int, int]:
    """(graphs built by the first compiled call, graphs built by a second identical call)."""
    counter = torch._dynamo.testing.CompileCounter()  # the eager backend, counting the graphs it is given
    compiled = torch.compile(model, backend=counter)
    call(compiled)
    first = counter.frame_count
    call(compiled)
    return first, counter.frame_count - first


def revit_mini(train: bool, **overrides):
    torch.manual_seed(0)
    return randomise(revit.create_model("revit-mini", **overrides)).train(train)


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_training_step_matches_eager_and_does_not_recompile():
    eager, twin = build("revit-fixed", 1), build("revit-fixed", 1)
    model, counter = compiled(twin)
    x, labels = images(4, eager, 1), torch.tensor([0, 1, 2, 3])
    for _ in range(3):  # three steps: the weights change, the graph does not
        torch.testing.assert_close(train_step(model, x, labels), train_step(eager, x, labels),
                                   rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(eager.named_parameters(), twin.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
    assert counter.frame_count == 1  # one graph for the whole forward: no graph break, no recompile


@pytest.mark.usefixtures("fresh_dynamo")
def test_explain_finds_no_graph_break_in_a_forward_with_gradients():
    """torch._dynamo.explain names the break, where a count only shows that one happened."""
    model = revit_mini(train=True)
    explained = torch._dynamo.explain(model)(images(2, model), return_states=True)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons[:3]


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("merge_cache", [False, True], ids=["dynamic", "cached"])
def test_an_inference_forward_is_one_graph(merge_cache):
    """Without gradients (the latency rows): the dynamic merge in the graph, or the cached merged FFNs as
    the graph's inputs (the cache's lookup is kept out of the graph and precedes it)."""
    model = revit_mini(train=False, merge_cache=merge_cache)
    x = images(2, model)
    with torch.no_grad():
        assert count_graphs(model, lambda m: m(x)) == (1, 0)


@pytest.mark.usefixtures("fresh_dynamo")
def test_each_new_depth_compiles_one_graph_of_the_whole_forward_and_repeated_depths_reuse_it():
    """The L steps are unrolled: a new depth compiles a new graph, a depth seen before reuses it. At
    inference the merge cache's lookup (never compiled) runs before that graph, so the graph holds the
    whole forward, patch embedding to head, with the cached merged FFNs as its inputs."""
    graphs = []

    def backend(gm, example_inputs):
        targets = [node.target for node in gm.graph.nodes if node.op == "call_function"]
        if targets:  # a change of depth may also compile an empty graph for the lookup's frame
            graphs.append(targets)
        return gm.forward

    eager = revit.create_model("revit-mini", **{**TINY, "depth": 3}).eval()
    model = torch.compile(eager, backend=backend)
    x = images(2, model)
    with torch.no_grad():
        for depth in (3, 4):
            torch.testing.assert_close(model(x, depth=depth), eager(x, depth=depth))
        assert len(graphs) == 2 and eager.merged_ffns[0][0] == 4
        assert all(torch.conv2d in g and torch._C._nn.linear in g for g in graphs)  # embedding and head
        for depth in (3, 4, 3):
            torch.testing.assert_close(model(x, depth=depth), eager(x, depth=depth))
    assert len(graphs) == 2


@pytest.mark.usefixtures("fresh_dynamo")
def test_elastic_training_runs_its_steps_eagerly_under_compile_and_matches_eager():
    """Elastic depth picks row sets and coordinate groups from data (nonzero, unique, split sizes),
    which would break the graph at every step and recompile as the batch composition changes; its
    step loop is therefore excluded from compilation (the stem, head and losses compile)."""
    eager, twin = build("revit-fixed", 2), build("revit-fixed", 2)
    model, counter = compiled(twin)
    x, labels = images(3, eager, 2), torch.tensor([0, 1, 2])

    def step(m, keep):
        out = m(x, keep=keep, return_states=True)
        loss = torch.nn.functional.cross_entropy(out["logits"], labels) + sum(out["aux_losses"].values())
        loss.backward()
        return loss.detach()

    torch.testing.assert_close(step(model, KEEP), step(eager, KEEP), rtol=1e-5, atol=1e-6)
    for p, q in zip(eager.parameters(), twin.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6)
    frames = counter.frame_count
    step(model, KEEP.roll(1, 0))  # another mask, same shapes: nothing new to compile
    assert counter.frame_count == frames


# AlterNet (arXiv 2611.08741): a few graphs, not one per expert per iteration. Eagerly each expert runs on the
# sequences routed to it (`nonzero`: a data-dependent shape) and the inference loop drops halted sequences;
# compiled, both are static (every row, masked) and the token-id checks run outside the graph. Before, a
# compiled alternet-tiny training forward (E = 2, D = 4) was 21 graphs.
ALTER_SIZES = dict(vocab_size=50, seq_len=16, dim=32, heads=2, ffn_dim=64, depth_dim=8)
A_FEW = 2  # graphs of one call: the model's, and one more where a torch version splits at the value check


def alternet_model(train: bool, **overrides):
    torch.manual_seed(0)
    return alternet.create_model("alternet-tiny", **{**ALTER_SIZES, **overrides}).train(train)


def alternet_batch(model):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (3, 12), generator=g)
    return tokens, torch.roll(tokens, -1, 1), torch.tensor([12, 5, 1])


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("experts, depth", [(2, 3), (3, 5)])
def test_an_alternet_training_forward_is_a_few_graphs(experts, depth):
    """The same count whatever E and D (top_k = 2: E = 2 routes densely, E = 3 sparsely), and no new graph
    on the second step."""
    model = alternet_model(True, num_experts=experts, max_depth=depth)
    tokens, targets, lengths = alternet_batch(model)
    step = lambda m: m(tokens, targets=targets, lengths=lengths)["loss"].backward()  # noqa: E731
    first, again = count_graphs(model, step)
    assert first <= A_FEW and again == 0
    if experts == 2:  # explain names the breaks (it traces once more)
        explained = torch._dynamo.explain(model)(tokens, targets=targets, lengths=lengths)
        assert explained.graph_break_count <= A_FEW - 1, explained.break_reasons[:3]


@pytest.mark.usefixtures("fresh_dynamo")
def test_an_alternet_generate_step_is_a_few_graphs():
    """generate's forward: a halting threshold and the last token only, without gradients."""
    model = alternet_model(False, num_experts=3, max_depth=4)
    tokens, _, _ = alternet_batch(model)
    with torch.no_grad():
        first, again = count_graphs(model, lambda m: m(tokens, halt_threshold=0.5, last_token_only=True))
        explained = torch._dynamo.explain(model)(tokens, halt_threshold=0.5, last_token_only=True)
    assert first <= A_FEW and again == 0
    assert explained.graph_break_count <= A_FEW - 1, explained.break_reasons[:3]


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_compiled_alternet_still_checks_its_token_ids():
    """The value checks, kept out of the graph, still run before it."""
    compiled = torch.compile(alternet_model(True, num_experts=2, top_k=1, max_depth=2), backend="eager")
    tokens, targets, _ = alternet_batch(compiled)
    compiled(tokens, targets=targets)
    with pytest.raises(ValueError, match="tokens: token ids must be in 0..49"):
        compiled(tokens.masked_fill(tokens == tokens[0, 0], 50), targets=targets)
    with pytest.raises(ValueError, match="lengths must be"):
        compiled(tokens, targets=targets, lengths=torch.tensor([0, 3, 4]))


# --- on the device: what `python bench.py check` runs -------------------------------------------------------


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    device = torch.device(request.param)
    if device.type != "cuda":
        yield device
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield device
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def device_model(arch: str, device: torch.device) -> torch.nn.Module:
    """A ViT or reViT of the device's size, weights nudged off their initial symmetries (zero router output
    layer, equal experts) so that every equivalence has something to compare."""
    torch.manual_seed(0)
    on_gpu = device.type == "cuda"
    model = revit.create_model(f"{arch}-s") if on_gpu else revit.create_model(f"{arch}-mini", **TINY)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    return model.to(device)


def forward_backward(model, images, bf16: bool = False):
    """Logits and the flat gradient of a scalar of them, with or without bf16 autocast."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(images.device.type, dtype=torch.bfloat16, enabled=bf16):
        out = model(images, return_states=True)
        loss = out["logits"].float().logsumexp(-1).mean() + sum(out["aux_losses"].values())
    loss.backward()
    grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
    return out["logits"].detach(), torch.cat(grads)


def copy_of(model, **changes):
    """The same weights in a second module (config changes that keep the parameters)."""
    copy = type(model)(dataclasses.replace(model.config, **changes)).to(next(model.parameters()).device)
    copy.load_state_dict(model.state_dict())
    return copy


class TestOnDevice:
    """The equivalences a device must keep, once per device: "cpu" always; "cuda" (marked gpu) only with
    REVIT_GPU_TESTS=1 on a machine with a GPU. `python bench.py check` runs this class in its own process
    on the device it checks and puts one row per test in its report, so the first minutes on a GPU say
    whether bf16 autocast, torch.compile (inductor), fused AdamW, the fold (reViT §3.1), the merge cache
    and elastic depth (§3.2) compute what the CPU computes.

    Sizes: on the CPU a tiny reViT (seconds); on a GPU the S/16 models at 224², as the paper's Table 7, so
    the kernels are the ones a real run uses (flash attention at head dim 64, bf16 tensor cores). TF32 is
    off for the float32 equivalences: it is an approximation by design."""

    @pytest.mark.parametrize("arch", ["vit", "revit"])
    def test_bf16_autocast_is_close_to_fp32_and_leaves_a_later_fp32_call_unchanged(self, arch, device):
        """The merge cache keys on the autocast state: an fp32 call after a bf16 one must not reuse bf16
        weights."""
        model = device_model(arch, device).train()
        x = images(4, model, 1).to(device)
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

    @pytest.mark.usefixtures("fresh_dynamo")
    def test_compiled_forward_and_backward_equal_eager_without_recompiling(self, device):
        """inductor on a GPU (what train.py --compile runs); on the CPU aot_eager (graph capture, guards and
        the joint graph without inductor's C++ build, which takes minutes here)."""
        model = device_model("revit", device).train()
        x = images(4, model, 1).to(device)
        ref_logits, ref_grads = forward_backward(model, x)
        counter = torch._dynamo.testing.CompileCounterWithBackend(
            "inductor" if device.type == "cuda" else "aot_eager")
        compiled = torch.compile(model, backend=counter)
        logits, grads = forward_backward(compiled, x)
        frames = counter.frame_count
        forward_backward(compiled, x)
        assert relative_error(logits, ref_logits) <= 1e-4 and relative_error(grads, ref_grads) <= 1e-4
        assert counter.frame_count == frames  # a repeated call builds nothing new

    def test_fused_adamw_step_equals_the_foreach_step(self, device):
        model = device_model("revit", device).train()
        x = images(4, model, 1).to(device)
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
    def test_fold_equals_the_revit_at_its_depth_and_at_another(self, device):
        """§3.1: revit.fold's plain ViT computes what the reViT computes at that depth."""
        model = device_model("revit", device).eval()
        x = images(4, model, 1).to(device)
        for depth in (model.config.depth, max(2, model.config.depth // 2)):
            assert relative_error(revit.fold(model, depth)(x), model(x, depth=depth)) <= 1e-4, depth

    @torch.no_grad()
    def test_merge_cache_equals_merging_on_every_call_also_after_a_weight_change(self, device):
        model = device_model("revit", device).eval()
        dynamic = copy_of(model, merge_cache=False).eval()
        x = images(4, model, 1).to(device)
        assert relative_error(model(x), dynamic(x)) <= 1e-5
        for m in (model, dynamic):
            m.block.mlp.fc1_weight.mul_(1.01)  # the cache must notice
        assert relative_error(model(x), dynamic(x)) <= 1e-5

    @torch.no_grad()
    def test_an_elastic_keep_mask_equals_the_smaller_depth(self, device):
        """§3.2: an image that keeps n of the L steps (renumbered to k / (n - 1)) equals the model run at
        depth n."""
        model = device_model("revit", device).eval()
        x = images(4, model, 1).to(device)
        keep = torch.ones(len(x), model.config.depth, dtype=torch.bool, device=device)
        keep[1:, 1::2] = False  # every other step dropped for all but the first image
        out = model(x, keep=keep)
        for i in range(len(x)):
            assert relative_error(out[i], model(x[i:i + 1], depth=int(keep[i].sum()))[0]) <= 1e-4, i
