"""A compiled reViT forward is ONE graph, in training and at inference, under every torch this project
supports (README: torch 2.11 or newer); a compiled AlterNet call is a few (below).

A graph break splits the forward where dynamo (torch.compile's graph capture) meets something it cannot
trace: on a GPU each break is a return to Python, and the frames resumed after a break can recompile at
every call. Under torch 2.11 one untraceable call in the router's fp32 region (torch.amp.
is_autocast_available) broke a revit-mini training forward into 26 graphs, while torch 2.13 traced it: a
test that only compared compiled and eager outputs passed under both. Here the graphs are counted, with
dynamo's "eager" backend (graph capture only, no code generation: a second on the CPU), so a break shows on
any machine.
"""
import logging

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

import alternet
import revit
from helpers import images, randomise


@pytest.fixture(autouse=True)
def fresh_dynamo(monkeypatch):
    monkeypatch.setattr(logging.getLogger("torch.__trace"), "disabled", True)  # pytest would record the trace
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


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


def test_a_training_forward_is_one_graph():
    model = revit_mini(train=True)
    x = images(2, model)
    assert count_graphs(model, lambda m: m(x, return_states=True)) == (1, 0)


@pytest.mark.parametrize("merge_cache", [False, True], ids=["dynamic", "cached"])
def test_an_inference_forward_is_one_graph(merge_cache):
    """Without gradients (the latency rows): the dynamic merge in the graph, or the cached merged FFNs as
    the graph's inputs (the cache's lookup is kept out of the graph and precedes it)."""
    model = revit_mini(train=False, merge_cache=merge_cache)
    x = images(2, model)
    with torch.no_grad():
        assert count_graphs(model, lambda m: m(x)) == (1, 0)


def test_explain_finds_no_graph_break_in_a_forward_with_gradients():
    """torch._dynamo.explain names the break, where the counts above only show that one happened."""
    model = revit_mini(train=True)
    explained = torch._dynamo.explain(model)(images(2, model), return_states=True)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons[:3]


# --- AlterNet (arXiv 2611.08741): a few graphs, not one per expert per iteration ---------------------------
# Eagerly each expert runs on the sequences routed to it (`nonzero`: a data-dependent shape) and the inference
# loop drops halted sequences; compiled, both are static (every row, masked) and the token-id checks run
# outside the graph. Before, a compiled alternet-tiny training forward (E = 2, D = 4) was 21 graphs.
ALTER_SIZES = dict(vocab_size=50, seq_len=16, dim=32, heads=2, ffn_dim=64, depth_dim=8)
A_FEW = 2  # graphs of one call: the model's, and one more where a torch version splits at the value check


def alternet_model(train: bool, **overrides):
    torch.manual_seed(0)
    return alternet.create_model("alternet-tiny", **{**ALTER_SIZES, **overrides}).train(train)


def alternet_batch(model):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (3, 12), generator=g)
    return tokens, torch.roll(tokens, -1, 1), torch.tensor([12, 5, 1])


@pytest.mark.parametrize("experts, depth", [(2, 3), (3, 5)])
def test_an_alternet_training_forward_is_a_few_graphs(experts, depth):
    """The same count whatever E and D, and no new graph on the second step."""
    model = alternet_model(True, num_experts=experts, max_depth=depth)
    tokens, targets, lengths = alternet_batch(model)
    first, again = count_graphs(model, lambda m: m(tokens, targets=targets, lengths=lengths)["loss"].backward())
    assert first <= A_FEW and again == 0
    if experts == 2:  # explain names the breaks (it traces once more)
        explained = torch._dynamo.explain(model)(tokens, targets=targets, lengths=lengths)
        assert explained.graph_break_count <= A_FEW - 1, explained.break_reasons[:3]


def test_an_alternet_generate_step_is_a_few_graphs():
    """generate's forward: a halting threshold and the last token only, without gradients."""
    model = alternet_model(False, num_experts=3, max_depth=4)
    tokens, _, _ = alternet_batch(model)
    with torch.no_grad():
        first, again = count_graphs(model, lambda m: m(tokens, halt_threshold=0.5, last_token_only=True))
        explained = torch._dynamo.explain(model)(tokens, halt_threshold=0.5, last_token_only=True)
    assert first <= A_FEW and again == 0
    assert explained.graph_break_count <= A_FEW - 1, explained.break_reasons[:3]


def test_a_compiled_alternet_still_checks_its_token_ids():
    """The value checks, kept out of the graph, still run before it."""
    compiled = torch.compile(alternet_model(True, num_experts=2, top_k=1, max_depth=2), backend="eager")
    tokens, targets, _ = alternet_batch(compiled)
    compiled(tokens, targets=targets)
    with pytest.raises(ValueError, match="tokens: token ids must be in 0..49"):
        compiled(tokens.masked_fill(tokens == tokens[0, 0], 50), targets=targets)
    with pytest.raises(ValueError, match="lengths must be"):
        compiled(tokens, targets=targets, lengths=torch.tensor([0, 3, 4]))
