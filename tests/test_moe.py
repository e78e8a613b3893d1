"""The paper's FFN mechanisms under single-block recurrence (§4.3, App. B, Tables 8 and 10, Fig. 2).

Every mechanism is checked against a slow reference written from its routing rule (a Python loop
over images, steps and tokens), on tiny widths; storage (Table 8) and the nominal budget U are
checked on the real S/B presets built on the meta device.
"""
import dataclasses
import inspect
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch.utils.flop_counter import FlopCounterMode

import revit
import train
from lib import moe
from helpers import randomise, images

FAST = settings(max_examples=6, deadline=None)
TINY = dict(image_size=8, patch_size=4, in_channels=1, num_classes=5, dim=16, heads=2, ffn_dim=24, depth=4)
# one preset per mechanism and budget shape worth testing: U = 1 and a higher U with K > 1 / shared experts
MECHANISMS = ["revit-mini-lory", "revit-mini-smear", "revit-mini-feature", "revit-mini-deepseek-u1",
              "revit-mini-deepseek-u2", "revit-mini-qwen3-u1", "revit-mini-qwen3-u1.5", "revit-mini-moeut-u1",
              "revit-mini-moeut-u1.5", "revit-mini-remoe-u1", "revit-mini-remoe-u2", "revit-mini-softmoe-u1",
              "revit-mini-softmoe-u2"]


def tiny(name, **overrides):
    return moe.create_model(name, **{**TINY, **overrides})




# --- slow references: one image, one step, one token at a time, each mechanism's rule written out ---

def expert(bank, e, x):
    return F.gelu(x @ bank.fc1_weight[e].T + bank.fc1_bias[e]) @ bank.fc2_weight[e].T + bank.fc2_bias[e]


def merged_ffn(ffn, gates, u):
    W1, b1, W2, b2 = (sum(gates[e] * p[e] for e in range(ffn.num_experts)) for p in ffn.bank())
    return F.gelu(u @ W1.T + b1) @ W2.T + b2


def reference_token(ffn, kind, x):
    """One token x (d,) through a token-routed or output-mixture FFN."""
    logits = ffn.router.weight @ x
    if kind == "remoe":
        gates = torch.relu(logits)
        return sum(gates[e] * expert(ffn, e, x) for e in range(ffn.num_experts))
    if kind == "deepseek":
        scores = torch.sigmoid(logits)
        chosen = sorted(range(ffn.num_experts), key=lambda e: -(scores[e] + ffn.expert_bias[e]).item())[:ffn.top_k]
        gates = {e: scores[e] / sum(scores[c] for c in chosen) for e in chosen}
        shared = sum(expert(ffn.shared, s, x) for s in range(ffn.shared.num_experts)) if ffn.shared else 0
        return sum(gates[e] * expert(ffn, e, x) for e in chosen) + shared
    if kind == "qwen3":
        probs = torch.softmax(logits, 0)
        chosen = sorted(range(ffn.num_experts), key=lambda e: -probs[e].item())[:ffn.top_k]
        return sum(probs[e] / sum(probs[c] for c in chosen) * expert(ffn, e, x) for e in chosen)
    if kind == "moeut":
        scores = torch.sigmoid(logits)
        chosen = sorted(range(ffn.num_experts), key=lambda e: -scores[e].item())[:ffn.top_k]
        return sum(scores[e] * expert(ffn, e, x) for e in chosen)
    raise AssertionError(kind)


def reference_soft_moe(ffn, u):
    """u (T, d): loop over slots, then over tokens."""
    phi = ffn.scale * F.normalize(ffn.slot_embed, dim=0)
    logits = F.normalize(u, dim=-1) @ phi  # (T, S)
    slots_out = []
    for s in range(logits.shape[1]):
        dispatch = torch.softmax(logits[:, s], 0)
        slots_out.append(expert(ffn, s // ffn.slots_per_expert, sum(dispatch[t] * u[t] for t in range(len(u)))))
    return torch.stack([sum(c * o for c, o in zip(torch.softmax(logits[t], 0), slots_out)) for t in range(len(u))])


def reference_ffn(ffn, kind, u, previous):
    """u (T, d) of one image at one step; previous: that image's pooled FFN input at its last step."""
    if kind in ("smear", "feature", "lory"):
        pooled = u.mean(0)
        source = previous if kind == "lory" and previous is not None else pooled
        if kind != "lory":
            source = F.layer_norm(source, source.shape, ffn.router_norm.weight, ffn.router_norm.bias, 1e-6)
        gates = torch.softmax(ffn.router.weight @ source + ffn.router.bias, 0)
        return merged_ffn(ffn, gates, u), pooled
    if kind == "softmoe":
        return reference_soft_moe(ffn, u), None
    return torch.stack([reference_token(ffn, kind, x) for x in u]), None


def reference_forward(model, x, keep):
    block, ffn, kind = model.block, model.block.mlp, model.config.ffn
    outs = []
    for b in range(x.shape[0]):
        h, previous = model.embed(x[b:b + 1]), None
        for t in range(keep.shape[1]):
            if not keep[b, t]:
                continue  # a dropped step is the identity; Lory's memory skips it too
            h = h + block.attn(block.norm1(h))
            y, previous = reference_ffn(ffn, kind, block.norm2(h)[0], previous)
            h = h + y
        outs.append(model.head(model.norm(h)[:, 0]))
    return torch.cat(outs)


@pytest.mark.parametrize("name", MECHANISMS)
def test_forward_matches_slow_reference_with_and_without_elastic_depth(name):
    model = randomise(tiny(name, depth=3), 1).train()
    if model.config.ffn == "deepseek":
        model.block.mlp.expert_bias.copy_(torch.randn(model.config.num_experts))  # selection must use it
    x = images(3, model, 1)
    full = torch.ones(3, 3, dtype=torch.bool)
    keep = torch.tensor([[True, False, True], [False] * 3, [False, True, True]])
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference_forward(model, x, full), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(model(x, keep=keep), reference_forward(model, x, keep), rtol=1e-4, atol=1e-4)


@FAST
@given(tokens=st.integers(1, 40), experts=st.integers(1, 7), k=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_grouped_dispatch_equals_a_loop_over_tokens(tokens, experts, k, seed):
    g = torch.Generator().manual_seed(seed)
    bank = randomise(moe.ExpertPool(8, 5, experts), seed)
    x = torch.randn(tokens, 8, generator=g)
    k = min(k, experts)
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])  # some experts empty
    weights = torch.rand(tokens, k, generator=g)
    expected = torch.stack([sum(weights[i, j] * expert(bank, index[i, j], x[i]) for j in range(k))
                            for i in range(tokens)])
    torch.testing.assert_close(bank.dispatch(x, index, weights), expected, rtol=1e-5, atol=1e-5)


# --- training: gradients, aux losses, elastic depth ---

@pytest.mark.parametrize("name", MECHANISMS + ["revit-mini-lora", "revit-mini-e1", "revit-mini"])
def test_every_parameter_gets_a_gradient(name):
    model = randomise(tiny(name, depth_drop=0.3), 2).train()
    out = model(images(6, model), return_states=True)
    assert torch.isfinite(out["logits"]).all() and out["logits"].shape == (6, 5)
    (out["logits"].pow(2).mean() + sum(out["aux_losses"].values())).backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []
    # DeepSeek-V3's balancing bias and ReMoE's lambda are buffers: updated outside the gradient
    assert not any("expert_bias" in n or "l1_weight" in n for n, _ in model.named_parameters())
    train.after_optimizer_step(model)  # what the training loop calls after each step


@pytest.mark.parametrize("name,losses", [
    ("revit-mini-lory", set()), ("revit-mini-smear", set()), ("revit-mini-feature", {"balance", "z_loss", "diversity"}),
    ("revit-mini-deepseek-u2", set()), ("revit-mini-qwen3-u1", set()), ("revit-mini-qwen3-u2", {"balance"}),
    ("revit-mini-moeut-u2", {"balance"}), ("revit-mini-remoe-u2", {"l1"}), ("revit-mini-softmoe-u2", set()),
    ("revit-mini-lora", set()),
])
def test_aux_losses_are_the_mechanisms_own(name, losses):
    model = tiny(name)
    assert set(model(images(2, model), return_states=True)["aux_losses"]) == losses


def test_balance_losses_pool_all_steps():
    """Qwen3's global-batch loss and MoEUT's entropy use statistics summed over every step of a forward."""
    g = torch.Generator().manual_seed(3)
    steps = [torch.randn(2, 5, 16, generator=g) for _ in range(3)]
    x = torch.cat([s.reshape(-1, 16) for s in steps])
    for name in ("revit-mini-qwen3-u2", "revit-mini-moeut-u2"):
        ffn = randomise(tiny(name), 3).block.mlp
        ffn.begin_forward(3, 2)
        for u in steps:
            ffn(u)
        logits = x @ ffn.router.weight.T
        probs = torch.softmax(logits, -1)
        if name.startswith("revit-mini-qwen3"):
            counts = torch.zeros(ffn.num_experts).index_add_(0, probs.topk(ffn.top_k).indices.flatten(),
                                                             torch.ones(len(x) * ffn.top_k))
            expected = 1e-3 * ffn.num_experts * (counts / len(x) * probs.mean(0)).sum()
        else:
            p = probs.mean(0)
            expected = 1e-2 * (p * p.log()).sum()
        assert ffn.aux_losses(3)["balance"].item() == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.parametrize("name", ["revit-mini", "revit-mini-feature", "revit-mini-lory", "revit-mini-qwen3-u1",
                                  "revit-mini-deepseek-u1", "revit-mini-moeut-u1", "revit-mini-remoe-u1",
                                  "revit-mini-softmoe-u1"])
def test_elastic_depth_training(name):
    model = randomise(tiny(name, depth=6, depth_drop=0.3, balance_weight=1e-3), 4).train()
    out = model(images(8, model), return_states=True)
    states = out["states"]
    assert any((states[t + 1] == states[t]).all(-1).all(-1).any() for t in range(6))  # some image skipped a step
    (out["logits"].pow(2).mean() + sum(out["aux_losses"].values())).backward()
    model.eval()
    with torch.no_grad():
        for depth in (2, 5, 9):  # content-routed models run at any depth too
            assert torch.isfinite(model(images(2, model), depth=depth)).all()


# --- routing invariants ---

def router_input(ffn, seed=5):
    return torch.randn(40, ffn.dim, generator=torch.Generator().manual_seed(seed))


def test_deepseek_bias_selects_but_never_weights():
    ffn = randomise(tiny("revit-mini-deepseek-u2"), 5).block.mlp
    logits = router_input(ffn) @ ffn.router.weight.T
    index, gates = ffn.route(logits)
    assert index.shape == (40, 6) and all(len(set(row.tolist())) == 6 for row in index)
    torch.testing.assert_close(gates.sum(-1), torch.ones(40))
    ffn.expert_bias.copy_(torch.tensor([10.0] + [0.0] * 15))  # expert 0 always selected ...
    biased_index, biased_gates = ffn.route(logits)
    assert (biased_index == 0).any(-1).all()
    scores = torch.sigmoid(logits).gather(1, biased_index)
    torch.testing.assert_close(biased_gates, scores / scores.sum(-1, keepdim=True))  # ... gate from the raw score


def test_qwen3_and_moeut_gates():
    qwen = randomise(tiny("revit-mini-qwen3-u1.5"), 6).block.mlp
    logits = router_input(qwen) @ qwen.router.weight.T
    index, gates = qwen.route(logits)
    torch.testing.assert_close(index, torch.softmax(logits, -1).topk(6).indices)
    torch.testing.assert_close(gates.sum(-1), torch.ones(40))  # renormalised over the top K
    moeut = randomise(tiny("revit-mini-moeut-u1.5"), 6).block.mlp
    logits = router_input(moeut) @ moeut.router.weight.T
    index, weights = moeut.route(logits)
    torch.testing.assert_close(weights, torch.sigmoid(logits).gather(1, index))  # raw sigmoid, not renormalised
    assert not torch.allclose(weights.sum(-1), torch.ones(40))


def test_remoe_gates_are_sparse_relu_and_l1_matches_formula():
    ffn = randomise(tiny("revit-mini-remoe-u2"), 7).block.mlp
    u = router_input(ffn).view(4, 10, -1)
    ffn.begin_forward(1, 4)
    ffn(u)
    gates = torch.relu(u.reshape(40, -1) @ ffn.router.weight.T)
    assert (gates == 0).any() and (gates > 0).any()
    k = 8 * 0.25
    expected = 1e-8 * 8 / (40 ** 2 * k) * (gates.sum(0) * (gates > 0).sum(0)).sum()
    assert ffn.aux_losses(1)["l1"].item() == pytest.approx(expected.item(), rel=1e-5)


def test_soft_moe_dispatch_and_combine_are_normalised():
    ffn = randomise(tiny("revit-mini-softmoe-u2"), 8).block.mlp
    dispatch, combine = ffn.routing_weights(router_input(ffn).view(2, 20, -1))
    assert dispatch.shape == combine.shape == (2, 20, 8 * ffn.slots_per_expert)
    torch.testing.assert_close(dispatch.sum(1), torch.ones(2, 8))       # over tokens, per slot
    torch.testing.assert_close(combine.sum(2), torch.ones(2, 20))       # over slots, per token


def test_content_merge_gates_differ_per_image_and_lory_routes_on_the_previous_step():
    model = randomise(tiny("revit-mini-lory"), 9).eval()
    ffn = model.block.mlp
    u0, u1 = torch.randn(2, 2, 5, 16, generator=torch.Generator().manual_seed(9))
    ffn.begin_forward(3, 2)
    first = ffn.router_input(u0, None)
    torch.testing.assert_close(first, u0.mean(1))                       # step 0 routes on itself
    torch.testing.assert_close(ffn.router_input(u1, None), u0.mean(1))  # step 1 routes on step 0
    rows = torch.tensor([1])                                            # only image 1 runs the next step
    torch.testing.assert_close(ffn.router_input(u0[:1], rows), u1.mean(1)[1:])


# --- non-gradient updates after the optimizer step ---

def test_deepseek_bias_update_direction_and_zero_mean():
    model = randomise(tiny("revit-mini-deepseek-u1.5"), 10).train()
    ffn = model.block.mlp
    model.eval()
    model(images(4, model))
    assert ffn._load is None  # eval forwards do not move the balancer
    model.train()
    model(images(16, model))
    load = ffn._load.clone()
    assert load.sum() == 16 * 5 * 4 * 2  # images x tokens x steps x K
    before = ffn.expert_bias.clone()
    model.block.mlp.after_optimizer_step()
    step = 1e-3 * torch.sign(load.mean() - load)
    torch.testing.assert_close(ffn.expert_bias - before, step - step.mean())
    assert abs(ffn.expert_bias.sum().item()) < 1e-6
    over, under = load > load.mean(), load < load.mean()
    assert over.any() and under.any() and ffn.expert_bias[over].max() < ffn.expert_bias[under].min()
    assert ffn._load is None


def test_remoe_controller_multiplies_or_divides_lambda_by_1_2():
    ffn = tiny("revit-mini-remoe-u1").block.mlp.train()
    u = torch.ones(2, 5, 16)
    with torch.no_grad():
        ffn.router.weight.fill_(1.0)                   # every gate positive: sparsity 0 < 0.75
    ffn(u)
    assert ffn.sparsity() == 0.0
    ffn.after_optimizer_step()
    assert ffn.l1_weight.item() == pytest.approx(1e-8 * 1.2, rel=1e-6)
    with torch.no_grad():
        ffn.router.weight.fill_(-1.0)                  # every gate zero: sparsity 1 >= 0.75
    ffn(u)
    ffn.after_optimizer_step()
    ffn(u)
    ffn.after_optimizer_step()
    assert ffn.l1_weight.item() == pytest.approx(1e-8 / 1.2, rel=1e-6)
    assert ffn.l1_weight.dtype == torch.float32
    with torch.no_grad():
        ffn.router.weight[0].fill_(1.0)                # one of the 4 gates open: sparsity 0.75, the target
    ffn(u)
    assert ffn.sparsity() == 0.75
    ffn.after_optimizer_step()
    assert ffn.l1_weight.item() == pytest.approx(1e-8 / 1.2, rel=1e-6)  # alpha^sign(0) = 1: kept


# --- layer-wise LoRA and fold ---

@FAST
@given(seed=st.integers(0, 2**16))
def test_lora_fold_equals_dynamic(seed):
    model = randomise(tiny("revit-mini-lora", lora_rank=3), seed).eval()
    vit = revit.fold(model)
    assert isinstance(vit, revit.VisionTransformer) and not any("lora" in n for n, _ in vit.named_parameters())
    x = images(2, model, seed)
    with torch.no_grad():
        torch.testing.assert_close(vit(x), model(x), rtol=1e-4, atol=1e-4)
        model.block.lora.qkv_up.zero_()  # the update reaches the output through every target
        assert not torch.allclose(model(x), vit(x))


def test_lora_starts_as_the_tied_block_and_runs_only_its_depth():
    lora = tiny("revit-mini-lora", lora_rank=3)
    plain = tiny("revit-mini-e1")
    plain.load_state_dict({k: v for k, v in lora.state_dict().items() if not k.startswith("block.lora.")})
    x = images(2, lora)
    with torch.no_grad():
        torch.testing.assert_close(lora(x), plain(x))  # B_t = 0 at init
    with pytest.raises(ValueError, match="one adapter per trained step"):
        lora(x, depth=6)


def test_lora_has_no_gate_matrix_but_folds():
    """Layer-wise LoRA has no expert bank: no gates to report (neither gate_matrix nor return_states)."""
    model = randomise(tiny("revit-mini-lora", lora_rank=3), 4).eval()
    with pytest.raises(ValueError, match="no depth-only gate matrix"):
        model.gate_matrix()
    x = images(2, model)
    with torch.no_grad():
        out = model(x, return_states=True)
        assert "gates" not in out
        torch.testing.assert_close(revit.fold(model)(x), out["logits"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["revit-mini-smear", "revit-mini-qwen3", "revit-mini-softmoe", "revit-mini-feature"])
def test_input_dependent_mechanisms_refuse_to_fold(name):
    model = tiny(name)
    with pytest.raises(ValueError, match="input-dependent"):
        revit.fold(model)
    with pytest.raises(ValueError, match="no depth-only gate matrix"):
        model.gate_matrix()
    assert "gates" not in model(images(1, model), return_states=True)


def test_lora_parameter_counts_match_table_10():
    with torch.device("meta"):
        model = moe.create_model("revit-s-lora")
    adapters = sum(p.numel() for p in model.block.lora.parameters())
    assert adapters == 16 * 12 * 64 * 384                                # 16 L r d = 4.72M
    assert round((model.num_params() - adapters) / 1e6, 2) == 2.53      # the shared model
    # 7.2498M: the paper's 7.3 is 2.53 + 4.72 = 7.25 rounded up; the exact count rounds to 7.2
    assert round(model.num_params() / 1e6, 2) == 7.25


# --- Table 8 storage and the nominal budget U (App. B), on the real presets ---

TABLE_8 = {  # mechanism -> {U: (S, B) stored expert-FFN parameters in millions}
    "merge": {1: (4.7, 18.9)}, "lory": {1: (4.7, 18.9)}, "smear": {1: (4.7, 18.9)},
    "deepseek": {1: (3.0, 11.8), 1.5: (5.3, 21.3), 2: (5.3, 21.3), 4: (10.6, 42.5)},
    "qwen3": {1: (4.7, 18.9), 1.5: (14.2, 56.7), 2: (18.9, 75.6), 4: (37.8, 151.2)},
    "moeut": {1: (4.7, 18.9), 1.5: (7.1, 28.3), 2: (9.5, 37.8), 4: (9.5, 37.8)},
    "remoe": {1: (1.2, 4.7), 1.5: (1.8, 7.1), 2: (2.4, 9.4), 4: (4.7, 18.9)},
    "softmoe": {1: (4.7, 18.9), 1.5: (7.1, 28.3), 2: (9.5, 37.8), 4: (18.9, 75.6)},
}
CELLS = [(mechanism, budget, size, millions[i]) for mechanism, row in TABLE_8.items()
         for budget, millions in row.items() for i, size in enumerate(("s", "b"))]


def preset(mechanism, budget, size):
    return f"revit-{size}" if mechanism == "merge" else f"revit-{size}-{mechanism}-u{budget:g}"


@pytest.mark.parametrize("mechanism,budget,size,millions", CELLS)
def test_stored_expert_parameters_and_measured_budget_match_the_paper(mechanism, budget, size, millions):
    for name in {preset(mechanism, budget, size), preset(mechanism, budget, "b14" if size == "b" else size)}:
        with torch.device("meta"):
            model = moe.create_model(name)
        assert round(moe.expert_ffn_params(model) / 1e6, 1) == millions  # Table 8
        measured = moe.ffn_budget(model)
        if mechanism == "softmoe":  # S = U * N slots shared by N + 1 tokens (the class token)
            n = model.config.num_patches
            assert model.block.mlp.num_experts * model.block.mlp.slots_per_expert == budget * n
            measured *= (n + 1) / n
        assert measured == pytest.approx(budget, rel=1e-9)


@pytest.mark.parametrize("name", MECHANISMS + ["revit-mini", "revit-mini-e1"])
def test_flop_count_is_what_the_module_runs(name):
    """active_flops_per_token (experts + routing) equals the matmul FLOPs torch counts for one image."""
    model = randomise(tiny(name), 11)
    ffn, tokens, depth = model.block.mlp, 1 + model.config.num_patches, model.config.depth
    u = torch.randn(1, tokens, model.config.dim)
    with FlopCounterMode(display=False) as counter:
        if isinstance(model, moe.ComparisonReViT):  # what MechanismBlock gives a mechanism at each step
            ffn.begin_forward(depth, 1)
            for t in range(depth):
                step = moe.Step(t)
                ffn(u, step) if ffn.needs_step else ffn(u)
        else:  # reViT's own FFN: FFN_t, merged at each step (the model is in training mode: no cache)
            for t in range(depth):
                ffn.ffn_at(revit.depth_grid(depth)[t:t + 1])(u)
    flops = moe.active_flops_per_token(ffn, tokens)
    assert counter.get_total_flops() == pytest.approx(depth * tokens * (flops["experts"] + flops["routing"]))


# --- presets and config ---

def test_preset_names_and_table_encoding():
    for name in ("revit-s-qwen3-u2", "revit-mini-deepseek-u1", "revit-s-lora", "revit-s-feature",
                 "revit-b14-softmoe-u4", "revit-b-moeut-u1.5", "revit-mini32-remoe-u4", "revit-s-smear"):
        assert name in moe.PRESETS
    p = moe.PRESETS["revit-s-deepseek-u4"]
    assert (p["num_experts"], p["top_k"], p["shared_experts"], p["expert_ffn_fraction"]) == (32, 12, 4, 0.25)
    assert moe.PRESETS["revit-s-qwen3-u1"]["balance_weight"] == 0.0
    assert moe.PRESETS["revit-s-qwen3-u4"]["balance_weight"] == 1e-3
    assert moe.PRESETS["revit-s-lora"]["lora_rank"] == 64
    with torch.device("meta"):
        assert moe.create_model("revit-s-softmoe").block.mlp.slots_per_expert == 49
        assert moe.create_model("revit-b14-softmoe").block.mlp.slots_per_expert == 64


@pytest.mark.parametrize("overrides,match", [
    (dict(ffn="switch"), "ffn='switch' is not allowed.*one of"), (dict(ffn="qwen3", top_k=5), "top_k"),
    (dict(ffn=3), "ffn must be a string"),
    (dict(ffn="qwen3", shared_experts=1), "shared_experts"), (dict(arch="vit", ffn="smear"), "ffn"),
    (dict(expert_ffn_fraction=0.0), "expert_ffn_fraction"), (dict(lora_rank=0), "lora_rank"),
    (dict(ffn="remoe", num_experts=4, top_k=10 ** 6), "top_k must be between 1 and num_experts=4"),
])
def test_bad_mechanism_config_names_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny("revit-mini", **overrides)


def test_budgets_are_consistent_across_sizes():
    """ehr is encoded relative to ffn_dim, so the mini presets keep the paper's U for token dispatch."""
    for mechanism in ("deepseek", "qwen3", "moeut", "remoe"):
        for budget in moe.MOE_TABLE[mechanism]:
            model = moe.create_model(f"revit-mini-{mechanism}-u{budget:g}")
            assert moe.ffn_budget(model) == pytest.approx(budget)
    softmoe = moe.create_model("revit-mini-softmoe")  # U*N slots serve N patches + the class token
    n = softmoe.config.num_patches
    assert math.isclose(moe.ffn_budget(softmoe), n / (n + 1))


# --- how the mechanisms plug into reViT ---

def test_only_ffns_that_need_the_step_receive_it():
    def subclasses(cls):
        return {cls} | {s for sub in cls.__subclasses__() for s in subclasses(sub)}
    # LoRAMlp is never called by MechanismBlock.forward: LoRABlock calls it with step t's adapters itself
    for ffn in subclasses(moe.FFN) - {moe.FFN, moe.LoRAMlp}:
        wanted = ["self", "u", "step"] if ffn.needs_step else ["self", "u"]
        assert list(inspect.signature(ffn.forward).parameters)[:len(wanted)] == wanted, ffn.__name__
        assert len(inspect.signature(ffn.forward).parameters) == len(wanted), ffn.__name__


@pytest.mark.parametrize("name", MECHANISMS + ["revit-mini-lora"])
def test_each_mechanism_is_run_by_its_own_revit_and_the_plain_one_refuses_it(name):
    model = tiny(name, **({"lora_rank": 2} if "lora" in name else {}))
    assert type(model) is moe.ComparisonReViT and isinstance(model, revit.ReViT)
    with pytest.raises(ValueError, match="arch='revit' builds lib.moe.ComparisonReViT, not ReViT"):
        revit.ReViT(model.config)
    assert type(revit.build_model(model.config)) is moe.ComparisonReViT


def test_every_bias_like_parameter_of_a_mechanism_is_named_bias():
    for name in MECHANISMS + ["revit-mini-lora"]:
        for pname, p in tiny(name).named_parameters():
            if "bias" in pname:
                assert pname.endswith("bias"), pname


def test_checkpoints_saved_before_the_mechanisms_stood_on_their_own_still_load(tmp_path):
    """tests/main_checkpoints.pt: one tiny model of every kind (ViT, Raptor, reViT E = 4 and 1, LoRA and
    each mechanism), its config, weights and eval logits as the code of commit 4c36352 saved them (the
    weights stored flat to keep the file small). Each loads through the loader and gives the same logits."""
    from lib.checkpoint import load_model
    fixture = torch.load(Path(__file__).parent / "main_checkpoints.pt", weights_only=True)
    images = fixture["outputs"]["images"]
    for name, saved in fixture["checkpoints"].items():
        values = saved["values"].split([math.prod(shape) for shape in saved["shapes"]])
        weights = {k: v.view(shape) for k, v, shape in zip(saved["names"], values, saved["shapes"])}
        path = tmp_path / f"{name}.pt"
        torch.save({"arch": name, "model_config": saved["model_config"], "model": weights}, path)
        model, _ = load_model(path)
        with torch.no_grad():
            torch.testing.assert_close(model(images), fixture["outputs"][name], msg=name)


def test_one_door_builds_every_vision_preset_and_saved_config():
    """moe.create_model builds revit.py's presets as revit.create_model does (class, config, weights); a
    config saved with this file's fields and ffn='merge' (every vision checkpoint saved before lib/moe.py
    had its own config) is checked and builds revit's; `python -m lib.moe NAME` answers in one line."""
    for name in ("vit-mini", "raptor-mini-k2", "revit-mini", "revit-mini-e1"):
        torch.manual_seed(0)
        ours = moe.create_model(name, **TINY)
        torch.manual_seed(0)
        plain = revit.create_model(name, **TINY)
        assert type(ours) is type(plain) and type(ours.config) is revit.ViTConfig and ours.config == plain.config
        assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), plain.state_dict().values()))
    saved = dataclasses.asdict(moe.ViTConfig(**{**revit.PRESETS["revit-mini"], **TINY}))
    assert {"ffn", "top_k", "lora_rank"} <= set(saved) and saved["ffn"] == "merge"
    assert moe.config_of(saved) == revit.ViTConfig(**{**revit.PRESETS["revit-mini"], **TINY})
    with pytest.raises(ValueError, match="top_k=0 is not allowed"):
        moe.config_of({**saved, "top_k": 0})
    done = subprocess.run([sys.executable, "-m", "lib.moe", "revit-mini-smeer"], capture_output=True, text=True,
                          cwd=Path(revit.__file__).parent)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert "did you mean 'revit-mini-smear'" in done.stderr
    helped = subprocess.run([sys.executable, "-m", "lib.moe", "-h"], capture_output=True, text=True,
                            cwd=Path(revit.__file__).parent)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: python -m lib.moe")


def test_python_m_lib_moe_lists_each_mechanism_at_one_size_by_default():
    """With no names, `python -m lib.moe` prints reViT-S and each comparison mechanism at S/16 at every U of
    MOE_TABLE and LoRA (§4.3), with U, each once; not revit.py's presets (`python revit.py` lists those)."""
    done = subprocess.run([sys.executable, "-m", "lib.moe"], capture_output=True, text=True, check=True,
                          cwd=Path(revit.__file__).parent)
    rows = [line.strip("| ").split(" | ") for line in done.stdout.splitlines()[2:]]
    names = [row[0] for row in rows]
    wanted = {f"revit-s-{m}{'' if u == 1 else f'-u{u:g}'}" for m, budgets in moe.MOE_TABLE.items() for u in budgets}
    assert set(names) == {"revit-s", "revit-s-lora", *wanted} and len(names) == len(set(names)), names
    assert all(row[3] for row in rows)  # every one has a U
