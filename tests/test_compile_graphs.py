"""A compiled reViT forward is ONE graph, in training and at inference, under every torch this project
supports (README: torch 2.11 or newer).

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
