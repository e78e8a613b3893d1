"""CPU stand-ins for the GPU paths of revit.py: bf16 autocast and torch.compile.

A GPU run uses `torch.autocast("cuda", dtype=torch.bfloat16)` and `torch.compile`; the same code
paths run here on the CPU with tiny models, so the first GPU user is not their first test.

Intended dtypes under bf16 autocast: ψ's gates and every Eq. 2 merge are fp32 (cast to the
activation dtype at use); other routers' logits are fp32; the logits a model returns are bf16
(autocast's output dtype for the head's Linear); the residual stream stays fp32.

torch.compile runs with backend="aot_eager": it exercises what can break on a GPU — Dynamo's graph
capture, guards, graph breaks, recompiles and AOTAutograd's joint forward/backward graph — without
inductor's C++ code generation, which takes over a minute for even the tiniest model on this
machine's CPUs. What depth does to compiled graphs (also stated in the tests below): the L steps are
unrolled, so each new depth compiles new graphs (one in training; two at inference without gradients,
before and after the merge cache's lookup, which is kept out of the graph) and a repeated depth reuses
them; past torch._dynamo.config.recompile_limit distinct depths Dynamo runs the forward eagerly. The
elastic step loop is never compiled: it runs eagerly inside a compiled model.
"""
import logging

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

import revit
from helpers import images
from lib import moe

TINY = dict(image_size=8, patch_size=4, in_channels=1, num_classes=5, dim=16, heads=2, ffn_dim=24, depth=4)
# every family: the baselines, reViT in its modes, one mechanism of each MoE family, LoRA
FAMILIES = {
    "vit": ("vit-mini", {}), "raptor": ("raptor-mini-k2", {}), "revit-fixed": ("revit-mini", {}),
    "revit-elastic": ("revit-mini", {}), "revit-cached": ("revit-mini", {}), "revit-folded": ("revit-mini", {}),
    "weight-merge (SMEAR)": ("revit-mini-smear", {}), "token-dispatch (Qwen3)": ("revit-mini-qwen3-u1.5", {}),
    "output-mixture (Soft-MoE)": ("revit-mini-softmoe-u2", {}), "lora": ("revit-mini-lora", dict(lora_rank=3)),
}
KEEP = torch.tensor([[True, False, True, True], [False, True, True, False], [True] * 4])


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


def relative_error(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


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


# --- torch.compile ---


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


@pytest.fixture(autouse=True)
def fresh_dynamo(monkeypatch):
    # pytest's log capture would record Dynamo's structured trace (DEBUG) and slow compiles several-fold
    monkeypatch.setattr(logging.getLogger("torch.__trace"), "disabled", True)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_training_step_matches_eager_and_does_not_recompile():
    eager, twin = build("revit-fixed", 1), build("revit-fixed", 1)
    model, counter = compiled(twin)
    x, labels = images(4, eager, 1), torch.tensor([0, 1, 2, 3])
    for _ in range(3):  # three steps: the weights change, the graph does not
        torch.testing.assert_close(train_step(model, x, labels), train_step(eager, x, labels), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(eager.named_parameters(), twin.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
    assert counter.frame_count == 1  # one graph for the whole forward: no graph break, no recompile


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
