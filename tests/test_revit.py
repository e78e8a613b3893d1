"""reViT core: gates, merge, fold, cache, elastic depth, baselines, aux losses, errors.

Each behaviour is checked against a slow, obviously-correct reference (loops over images,
steps and experts) or a direct formula, over random shapes with Hypothesis.
"""
import ast
import inspect
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import revit
from helpers import randomise, images

FAST = settings(max_examples=12, deadline=None)


def tiny(name="revit-mini", **overrides):
    cfg = dict(image_size=8, patch_size=4, in_channels=1, num_classes=5, dim=16, heads=2, ffn_dim=24, depth=4)
    cfg.update(overrides)
    return revit.create_model(name, **cfg)




# --- reference implementation: one image at a time, one step at a time, experts summed by hand ---

def reference_forward(model, x, keep):
    """keep (B, L) bool. Slow path: Python loop over images and steps, Eq. 1-3 written out."""
    ffn, block = model.block.mlp, model.block
    outs = []
    for b in range(x.shape[0]):
        h = model.embed(x[b:b + 1])
        kept = [t for t in range(keep.shape[1]) if keep[b, t]]
        for k, _ in enumerate(kept):
            s = 0.0 if len(kept) == 1 else k / (len(kept) - 1)
            z = ffn.router(torch.tensor([[s]]))[0]
            g = torch.softmax(z / ffn.temperature, -1)
            W1 = sum(g[e] * ffn.fc1_weight[e] for e in range(ffn.num_experts))
            b1 = sum(g[e] * ffn.fc1_bias[e] for e in range(ffn.num_experts))
            W2 = sum(g[e] * ffn.fc2_weight[e] for e in range(ffn.num_experts))
            b2 = sum(g[e] * ffn.fc2_bias[e] for e in range(ffn.num_experts))
            h = h + block.attn(block.norm1(h))
            h = h + F.gelu(block.norm2(h) @ W1.T + b1) @ W2.T + b2
        outs.append(model.head(model.norm(h)[:, 0]))
    return torch.cat(outs)


# --- gates (Eq. 1) ---

@FAST
@given(depth=st.integers(2, 40), experts=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_gates_are_a_distribution(depth, experts, seed):
    model = randomise(tiny(num_experts=experts), seed)
    G = model.gate_matrix(depth)
    assert G.shape == (depth, experts)
    assert (G >= 0).all()
    torch.testing.assert_close(G.sum(1), torch.ones(depth))


@FAST
@given(depth=st.integers(2, 40), experts=st.integers(2, 9))
def test_zero_initialised_router_gives_uniform_gates(depth, experts):
    model = tiny(num_experts=experts)
    torch.testing.assert_close(model.gate_matrix(depth), torch.full((depth, experts), 1.0 / experts))


def test_gate_depends_on_normalised_depth_only():
    model = randomise(tiny(num_experts=4), 1)
    G12, G23 = model.gate_matrix(12), model.gate_matrix(23)
    torch.testing.assert_close(G12[0], G23[0])    # s = 0
    torch.testing.assert_close(G12[-1], G23[-1])  # s = 1
    assert not torch.allclose(G12[0], G12[-1])


# --- the dynamic model equals the slow reference, and folds into a plain ViT ---

@FAST
@given(depth=st.integers(2, 12), experts=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_forward_matches_reference(depth, experts, seed):
    model = randomise(tiny(num_experts=experts), seed).eval()
    if experts == 1:
        return  # E = 1 has no router; covered by test_e1_is_a_tied_block
    x = images(3, model, seed)
    with torch.no_grad():
        torch.testing.assert_close(model(x, depth=depth),
                                   reference_forward(model, x, torch.ones(3, depth, dtype=torch.bool)),
                                   rtol=1e-4, atol=1e-4)


@FAST
@given(depth=st.integers(2, 32), experts=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_fold_equals_dynamic(depth, experts, seed):
    model = randomise(tiny(num_experts=experts), seed).eval()
    vit = revit.fold(model, depth)
    assert isinstance(vit, revit.VisionTransformer) and len(vit.blocks) == depth
    assert not any("router" in n or "fc1_weight" in n for n, _ in vit.named_parameters())
    x = images(2, model, seed)
    with torch.no_grad():
        torch.testing.assert_close(vit(x), model(x, depth=depth), rtol=1e-4, atol=1e-5)


def test_fold_raptor_and_errors():
    model = randomise(tiny("raptor-mini", depth=6, raptor_blocks=3), 2).eval()
    x = images(2, model)
    with torch.no_grad():
        torch.testing.assert_close(revit.fold(model, 9)(x), model(x, depth=9))
        vit = randomise(tiny("vit-mini"), 3).eval()
        torch.testing.assert_close(revit.fold(vit)(x), vit(x))  # a plain ViT is already folded: a copy
    with pytest.raises(ValueError, match="depth"):
        revit.fold(tiny(), 1)


# --- merged-weight cache ---

def test_cache_reused_and_equal_to_uncached():
    model = randomise(tiny(num_experts=3), 3).eval()
    uncached = randomise(tiny(num_experts=3, merge_cache=False), 3).eval()
    x = images(4, model)
    with torch.no_grad():
        a = model(x, depth=7)
        cached = model.merged_ffns[1]
        b = model(x, depth=7)
        assert model.merged_ffns[1] is cached  # reused, not recomputed
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a, uncached(x, depth=7))
        model(x, depth=5)
        assert model.merged_ffns[0][0] == 5 and len(model.merged_ffns[1]) == 5


@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "adamw-foreach-off"])
def test_cache_invalidated_by_optimizer_step_and_load(optimizer):
    model = randomise(tiny(num_experts=3), 4)
    x = images(4, model)
    model.eval()
    with torch.no_grad():
        before = model(x)
    opt = {"sgd": lambda p: torch.optim.SGD(p, lr=0.5),
           "adamw": lambda p: torch.optim.AdamW(p, lr=0.05),
           "adamw-foreach-off": lambda p: torch.optim.AdamW(p, lr=0.05, foreach=False)}[optimizer](model.parameters())
    model.train()
    model(x).pow(2).mean().backward()
    opt.step()
    model.eval()
    fresh = randomise(tiny(num_experts=3, merge_cache=False), 0).eval()
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        after = model(x)
        assert not torch.allclose(after, before)
        torch.testing.assert_close(after, fresh(x))
        # load_state_dict writes in place: the cache must follow
        model.load_state_dict(randomise(tiny(num_experts=3), 9).state_dict())
        torch.testing.assert_close(model(x), randomise(tiny(num_experts=3, merge_cache=False), 9).eval()(x))


def test_no_cache_when_gradients_are_needed():
    model = randomise(tiny(num_experts=3), 5).eval()
    model(images(2, model)).sum().backward()  # eval mode but grad enabled: the bank must get a gradient
    assert model.block.mlp.fc1_weight.grad is not None and model.block.mlp.fc1_weight.grad.abs().sum() > 0
    assert model.merged_ffns is None


@pytest.mark.parametrize("optimizer", ["adamw-fused", "adamw-foreach"])
def test_cache_follows_optimizer_steps_of_a_train_eval_loop(optimizer):
    """Fused AdamW writes the parameters in place without bumping their version counters: a loop that
    steps in train() and evaluates in eval() (train.py's) drops the cache at each switch."""
    model = randomise(tiny(num_experts=3), 18).eval()
    x = images(4, model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, **{optimizer.split("-")[1]: True})
    with torch.no_grad():
        before = model(x)                            # fills the cache
    model.train()
    model(x).pow(2).mean().backward()
    versions = [p._version for p in model.parameters()]
    opt.step()
    if optimizer == "adamw-fused":  # the case the version counter cannot see
        assert [p._version for p in model.parameters()] == versions
    model.eval()
    fresh = tiny(num_experts=3, merge_cache=False).eval()
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        after = model(x)
        assert not torch.allclose(after, before)
        torch.testing.assert_close(after, fresh(x))


@pytest.mark.parametrize("edit", [dict(temperature=0.25), dict(router_prior=4.0)])
def test_cache_follows_temperature_and_prior_edits(edit):
    model = randomise(tiny(num_experts=3), 19).eval()
    uncached = randomise(tiny(num_experts=3, merge_cache=False), 19).eval()
    x = images(3, model)
    with torch.no_grad():
        before = model(x)                                                   # fills the cache
        torch.testing.assert_close(before, uncached(x))
        for ffn in (model.block.mlp, uncached.block.mlp):
            for name, value in edit.items():
                setattr(ffn, name, value)
        edited = uncached(x)
        assert not torch.allclose(edited, before)
        torch.testing.assert_close(model(x), edited)


# --- elastic depth (§3.2, §3.2) ---

@FAST
@given(batch=st.integers(1, 5), depth=st.integers(2, 9), seed=st.integers(0, 2**16))
def test_elastic_coordinates_are_the_renumbered_grid(batch, depth, seed):
    keep = torch.rand(batch, depth, generator=torch.Generator().manual_seed(seed)) > 0.4
    coords = revit.elastic_plan(keep)
    for b in range(batch):
        kept = keep[b].nonzero().flatten().tolist()
        expected = [0.0] if len(kept) == 1 else [k / (len(kept) - 1) for k in range(len(kept))]
        torch.testing.assert_close(coords[b, kept], torch.tensor(expected[:len(kept)]))


@FAST
@given(batch=st.integers(1, 6), depth=st.integers(2, 8), experts=st.integers(2, 4), seed=st.integers(0, 2**16))
def test_elastic_forward_matches_per_image_reference(batch, depth, experts, seed):
    model = randomise(tiny(num_experts=experts), seed).train()
    keep = torch.rand(batch, depth, generator=torch.Generator().manual_seed(seed)) > 0.35
    x = images(batch, model, seed)
    torch.testing.assert_close(model(x, depth=depth, keep=keep), reference_forward(model, x, keep),
                               rtol=1e-4, atol=1e-4)


def test_dropped_step_is_identity_and_all_dropped_image_unchanged():
    model = randomise(tiny(num_experts=3, depth=4), 6).train()
    x = images(3, model)
    keep = torch.tensor([[True, False, True, True], [False] * 4, [True] * 4])
    out = model(x, keep=keep, return_states=True)
    states = out["states"]
    torch.testing.assert_close(states[2][0], states[1][0])      # step 1 dropped for image 0
    for t in range(5):
        torch.testing.assert_close(states[t][1], states[0][1])  # image 1 never changes
    assert not torch.allclose(states[1][2], states[0][2])


def test_elastic_training_samples_masks_and_keeps_gradients():
    model = randomise(tiny(num_experts=3, depth=6, depth_drop=0.3), 7).train()
    out = model(images(16, model), return_states=True)
    loss = out["logits"].pow(2).mean() + sum(out["aux_losses"].values())
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    model.eval()  # depth_drop is a training-only behaviour
    with torch.no_grad():
        torch.testing.assert_close(model(images(2, model)), model(images(2, model)))


# --- baselines ---

def test_e1_is_a_tied_block():
    model = randomise(tiny(num_experts=1, depth=5), 8).eval()
    assert not hasattr(model.block.mlp, "router")
    vit = revit.create_model("vit-mini", **{k: v for k, v in vars(model.config).items() if k not in ("arch", "layer_scale_init")},
                             layer_scale_init=None)
    state = {k: v for k, v in vit.state_dict().items() if not k.startswith("blocks.")}
    state.update({k: v for k, v in model.state_dict().items() if not k.startswith("block.")})
    for t in range(5):
        state.update({f"blocks.{t}.{k}": v for k, v in model.block.state_dict().items()})
    vit.load_state_dict(state)
    x = images(2, model)
    with torch.no_grad():
        torch.testing.assert_close(vit.eval()(x), model(x))


@FAST
@given(depth=st.integers(1, 16), k=st.integers(1, 6))
def test_raptor_schedule_is_contiguous_and_covers_all_blocks(depth, k):
    if k > depth:
        return
    schedule = revit.raptor_schedule(k, depth)
    assert len(schedule) == depth and schedule[0] == 0 and schedule[-1] == k - 1
    assert all(b - a in (0, 1) for a, b in zip(schedule, schedule[1:]))


def test_raptor_segments_match_the_reference_implementation():
    # Raptor's thresholds at L=12 (1-based steps t <= threshold): k=4 -> [4, 7, 10]
    assert revit.raptor_schedule(4, 12) == [0] * 4 + [1] * 3 + [2] * 3 + [3] * 2
    assert revit.raptor_schedule(3, 12) == [0] * 7 + [1] * 3 + [2] * 2
    assert revit.raptor_schedule(2, 12) == [0] * 7 + [1] * 5


def test_raptor_with_k_equal_l_is_an_untied_vit():
    raptor = randomise(tiny("raptor-mini", depth=5, raptor_blocks=5), 9).eval()
    vit = tiny("vit-mini", depth=5).eval()  # both keep DeiT III's LayerScale
    assert {k: v.shape for k, v in raptor.state_dict().items()} == {k: v.shape for k, v in vit.state_dict().items()}
    vit.load_state_dict(raptor.state_dict())
    x = images(2, raptor)
    with torch.no_grad():
        torch.testing.assert_close(vit(x), raptor(x))


def test_drop_path_drops_whole_samples_and_rescales_the_kept_ones():
    """DeiT III's stochastic depth (timm's DropPath): in training each sample's residual branch is kept with
    probability 1 - p and scaled by 1 / (1 - p), so its expectation is unchanged; in eval, the identity."""
    torch.manual_seed(0)
    p, n = 0.25, 4000
    block = revit.Block(6, 1, revit.Mlp(6, 8), drop_path=p).train()
    x = torch.rand(n, 5, 6) + 1
    ratio = (block.drop_path(x) / x).flatten(1)
    assert torch.allclose(ratio, ratio[:, :1].expand_as(ratio))  # a whole sample, never single elements
    kept = ratio[:, 0] > 0
    assert torch.allclose(ratio[kept], torch.full_like(ratio[kept], 1 / (1 - p)))
    assert abs(kept.float().mean().item() - (1 - p)) < 0.03  # 4,000 samples: the standard error is 0.007
    assert torch.equal(block.eval().drop_path(x), x)


def test_deit3_numerics():
    vit = tiny("vit-mini")
    assert vit.blocks[0].ls1.gamma.eq(1e-4).all() and vit.norm.eps == 1e-6
    assert vit.blocks[0].attn.qkv.bias is not None and vit.pos_embed.shape[1] == vit.config.num_patches
    x = images(2, vit)
    with torch.no_grad():  # the class token carries no position embedding
        out = vit(x, return_states=True)
        torch.testing.assert_close(out["states"][0][:, 0], vit.cls_token[:, 0].expand(2, -1))


@pytest.mark.parametrize("name", ["vit-mini", "raptor-mini", "revit-mini", "revit-mini-e1"])
def test_every_parameter_gets_a_gradient_and_outputs_are_named(name):
    model = randomise(tiny(name), 10).train()
    out = model(images(3, model), return_states=True)
    assert out["logits"].shape == (3, 5) and out["tokens"].shape == (3, 5, 16)
    assert out["pre_logits"].shape == (3, 16) and len(out["states"]) == model.config.depth + 1
    assert torch.isfinite(out["logits"]).all()
    (out["logits"].pow(2).mean() + sum(out["aux_losses"].values())).backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []


# --- auxiliary losses (Eq. 6, 8, 9) against direct formulas ---

def set_router_output(model, bias):
    ffn = model.block.mlp
    with torch.no_grad():
        ffn.router[2].weight.zero_()
        ffn.router[2].bias.copy_(torch.tensor(bias))


def test_aux_losses_match_direct_formulas():
    model = tiny(num_experts=4)
    out = model(images(2, model), return_states=True)
    assert out["aux_losses"]["balance"].item() == pytest.approx(0.0, abs=1e-7)  # uniform gates
    assert out["aux_losses"]["z_loss"].item() == pytest.approx(1e-3 * math.log(4) ** 2, rel=1e-5)

    bias = [2.0, -1.0, 0.5, 0.0]
    set_router_output(model, bias)
    g = torch.softmax(torch.tensor(bias), 0)
    entropy = -(g * g.log()).sum()
    out = model(images(2, model), return_states=True)
    assert out["aux_losses"]["balance"].item() == pytest.approx(1e-2 * (1 - entropy / math.log(4)).item(), rel=1e-5)
    assert out["aux_losses"]["z_loss"].item() == pytest.approx(1e-3 * torch.logsumexp(torch.tensor(bias), 0).item() ** 2, rel=1e-5)


def test_diversity_loss_on_hand_built_experts():
    model = tiny(num_experts=3)
    ffn = model.block.mlp
    with torch.no_grad():
        for p in ffn.bank():
            p.copy_(p[0:1].expand_as(p))
            p.add_(0.0)
    assert ffn.diversity().item() == pytest.approx(1.0, rel=1e-5)  # identical experts
    with torch.no_grad():  # disjoint supports: orthogonal parameter vectors
        for p in ffn.bank():
            p.zero_()
        ffn.fc1_weight[0, 0, 0] = 1.0
        ffn.fc1_weight[1, 0, 1] = 2.0
        ffn.fc2_bias[2, 3] = -1.0
    assert ffn.diversity().item() == pytest.approx(0.0, abs=1e-7)


def test_no_aux_losses_for_one_expert_or_plain_vit():
    for name in ("revit-mini-e1", "vit-mini", "raptor-mini"):
        model = tiny(name)
        assert model(images(1, model), return_states=True)["aux_losses"] == {}


# --- presets and parameter counts (Table 1, ImageNet 224², 1000 classes) ---

@pytest.mark.parametrize("name,millions", [
    ("vit-s", 22.1), ("vit-b", 86.6), ("vit-l", 304.4),
    ("raptor-s", 7.9), ("raptor-b", 29.9), ("raptor-l", 52.4),
    ("revit-s", 6.1), ("revit-b", 22.8), ("revit-l", 39.8),  # paper: 23.6 / 40.9 (RESULTS.md explains)
])
def test_parameter_counts_match_the_paper(name, millions):
    with torch.device("meta"):
        model = revit.create_model(name)
    assert round(model.num_params() / 1e6, 1) == millions


def test_preset_names():
    for name in ("vit-s", "vit-b14", "raptor-s-k2", "raptor-l-k3", "revit-s-e8", "revit-b14", "revit-mini", "vit-mini32"):
        assert name in revit.PRESETS
    assert revit.PRESETS["revit-s-e8"]["num_experts"] == 8


@pytest.mark.parametrize("arch", ["vit", "raptor", "revit"])
def test_each_arch_builds_its_own_class_and_no_other(arch):
    config = revit.ViTConfig(**revit.PRESETS[f"{arch}-mini"])
    assert type(revit.create_model(f"{arch}-mini")) is revit.MODELS[arch]
    for cls in {revit.VisionTransformer, revit.Raptor, revit.ReViT} - {revit.MODELS[arch]}:
        with pytest.raises(ValueError, match=f"arch='{arch}' builds revit.{revit.MODELS[arch].__name__}"):
            cls(config)


# --- bad input ---

@pytest.mark.parametrize("overrides,match", [
    (dict(depth=1), "depth"), (dict(num_experts=0), "num_experts"), (dict(image_size=10), "image_size"),
    (dict(arch="cnn"), "arch"), (dict(depth_drop=1.0), "depth_drop"), (dict(heads=5), "dim"),
    (dict(colour=1), "unknown config field"),
])
def test_bad_config_names_the_argument(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny(**overrides)


def test_bad_input_names_the_argument():
    model = tiny()
    with pytest.raises(ValueError, match="unknown preset name='revit-xl'.*revit-s"):
        revit.create_model("revit-xl")
    with pytest.raises(ValueError, match="unknown preset name='revit-mni'; did you mean 'revit-mini'"):
        revit.create_model("revit-mni")
    done = subprocess.run([sys.executable, "revit.py", "revit-mni"], cwd=Path(revit.__file__).parent,
                          capture_output=True, text=True)  # the command line: one line, no traceback
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "did you mean 'revit-mini'" in done.stderr
    assert done.stdout == ""  # no table header before the refusal
    helped = subprocess.run([sys.executable, "revit.py", "--help"], cwd=Path(revit.__file__).parent,
                            capture_output=True, text=True)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: python revit.py") and not helped.stderr
    with pytest.raises(ValueError, match="did you mean 'revit-mini'"):  # the case of a name is forgiven
        revit.create_model("REVIT-MINI")
    with pytest.raises(ValueError, match="depth must be an integer >= 2"):
        model(images(1, model), depth=1)
    with pytest.raises(ValueError, match="in_channels=1"):
        model(torch.randn(1, 3, 8, 8))
    with pytest.raises(ValueError, match="image_size=8"):
        model(torch.randn(1, 1, 12, 12))
    expected = rf"keep must have shape \(batch, depth\) \(1, {model.config.depth}\)"
    for shape in [(2, model.config.depth), (1, model.config.depth + 1)]:  # an image or a step too many
        with pytest.raises(ValueError, match=expected):
            model(images(1, model), keep=torch.ones(shape, dtype=torch.bool))
    with pytest.raises(ValueError, match="untied ViT runs only its own depth"):
        tiny("vit-mini")(images(1, model), depth=6)


def test_state_dict_loads_with_weights_only(tmp_path):
    model = randomise(tiny(num_experts=3), 11)
    torch.save(model.state_dict(), tmp_path / "m.pt")
    state = torch.load(tmp_path / "m.pt", weights_only=True)
    fresh = tiny(num_experts=3)
    fresh.load_state_dict(state)
    x = images(2, model)
    with torch.no_grad():
        torch.testing.assert_close(fresh.eval()(x), model.eval()(x))


def test_fold_with_given_gates_runs_the_chosen_experts():
    model = randomise(tiny(num_experts=3, depth=4), 12).eval()
    gates = torch.eye(3)[[0, 2, 1, 2]]  # one-hot: step t runs expert k_t alone
    vit = revit.fold(model, gates=gates)
    ffn = model.block.mlp
    for t, k in enumerate([0, 2, 1, 2]):
        torch.testing.assert_close(vit.blocks[t].mlp.fc1.weight, ffn.fc1_weight[k])
        torch.testing.assert_close(vit.blocks[t].mlp.fc2.bias, ffn.fc2_bias[k])
    torch.testing.assert_close(revit.fold(model, gates=model.gate_matrix(6))(images(2, model)),
                               model(images(2, model), depth=6))
    with pytest.raises(ValueError, match="gates must have shape"):
        revit.fold(model, gates=torch.ones(4, 2) / 2)


def test_fold_refuses_a_depth_that_disagrees_with_its_gates():
    model = randomise(tiny(num_experts=3, depth=4), 12).eval()
    gates = model.gate_matrix(6)
    with pytest.raises(ValueError, match=r"fold: gates must have shape .* got \[6, 3\], depth=5"):
        revit.fold(model, 5, gates=gates)
    x = images(2, model)
    with torch.no_grad():  # a depth that agrees is honoured
        torch.testing.assert_close(revit.fold(model, 6, gates=gates)(x), model(x, depth=6))


# --- merge cache against autocast and hand-written weight edits ---

def autocast_bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("order", [("bf16", "fp32"), ("fp32", "bf16"), ("bf16", "bf16"), ("fp32", "fp32"),
                                   ("fp16", "bf16", "fp32")])
def test_cache_is_fp32_whatever_the_autocast_of_the_first_call(order):
    """Merged weights are built in fp32 and cast at use, so one cache serves every autocast state."""
    model = randomise(tiny(num_experts=3), 13).eval()
    uncached = randomise(tiny(num_experts=3, merge_cache=False), 13).eval()
    x = images(3, model)
    with torch.no_grad():
        for mode in order:
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[mode]
            with torch.autocast("cpu", dtype=dtype, enabled=mode != "fp32"):
                out, expected = model(x), uncached(x)
            assert all(w.dtype == torch.float32 for ffn in model.merged_ffns[1] for w in ffn)
            assert out.dtype == dtype  # logits: autocast's dtype
            torch.testing.assert_close(out, expected)  # cached (L merges at once) vs per-step merges
        torch.testing.assert_close(model(x), uncached(x))  # a plain fp32 call at the end


def test_data_edits_need_a_mode_switch_and_other_edits_do_not():
    model = randomise(tiny(num_experts=3), 14).eval()
    x = images(2, model)
    ffn = model.block.mlp
    with torch.no_grad():
        before = model(x)
        ffn.fc1_weight.mul_(0.5)                    # in-place under no_grad: detected
        halved = model(x)
        assert not torch.allclose(halved, before)
        ffn.fc2_weight.data.mul_(0.5)               # through .data: not detected (documented) ...
        torch.testing.assert_close(model(x), halved)
        model.train().eval()                        # ... until a mode switch
        edited = model(x)
        assert not torch.allclose(edited, halved)
        ffn.fc2_bias.data.add_(1.0)
        model.eval()                                 # a mode switch clears the cache too
        fresh = randomise(tiny(num_experts=3, merge_cache=False), 0).eval()
        fresh.load_state_dict(model.state_dict())
        torch.testing.assert_close(model(x), fresh(x))


# --- fold keeps the model's dtype and device, for every config create_model accepts ---

@pytest.mark.parametrize("overrides", [dict(num_experts=3), dict(num_experts=3, expert_ffn_fraction=0.5),
                                       dict(num_experts=1, expert_ffn_fraction=0.5), dict(router_prior=2.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fold_keeps_dtype_and_handles_every_merge_config(overrides, dtype):
    model = randomise(tiny(**overrides), 15).eval().to(dtype)
    vit = revit.fold(model, 5)
    assert {p.dtype for p in vit.parameters()} == {dtype} and next(vit.parameters()).device == torch.device("cpu")
    x = images(2, model).to(dtype)
    with torch.no_grad():
        tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.05, atol=0.05)
        torch.testing.assert_close(vit(x), model(x, depth=5), **tol)
        assert vit(x).dtype == dtype


def test_gates_and_merges_are_fp32_under_autocast_and_in_bf16_models():
    model = randomise(tiny(num_experts=4), 16).eval()
    reference = model.gate_matrix(7)
    with autocast_bf16():
        gates = model.gate_matrix(7)
        merged = model.block.mlp.merge(gates)
    assert gates.dtype == torch.float32 and all(w.dtype == torch.float32 for w in merged)
    torch.testing.assert_close(gates, reference, rtol=0, atol=0)
    folded = revit.fold(model, 7)
    torch.testing.assert_close(folded.blocks[3].mlp.fc1.weight, merged[0][3], rtol=1e-6, atol=1e-7)
    bf16 = randomise(tiny(num_experts=4), 16).to(torch.bfloat16)
    assert bf16.gate_matrix(7).dtype == torch.float32
    assert bf16.block.mlp.merge(bf16.gate_matrix(7))[0].dtype == torch.float32


# --- the optional depth prior on the gate logits (beta = router_prior) ---

@FAST
@given(experts=st.integers(2, 6), seed=st.integers(0, 2**16))
def test_router_prior_zero_is_exactly_the_papers_router(experts, seed):
    model = randomise(tiny(num_experts=experts), seed)
    ffn = model.block.mlp
    s = revit.depth_grid(9)
    torch.testing.assert_close(ffn.gate_logits(s), ffn.router(s.unsqueeze(-1)), rtol=0, atol=1e-6)
    beta = 3.0
    prior = randomise(tiny(num_experts=experts, router_prior=beta), seed).block.mlp
    centres = torch.arange(experts) / (experts - 1)
    torch.testing.assert_close(prior.gate_logits(s), ffn.router(s.unsqueeze(-1)) - beta * (s[:, None] - centres) ** 2,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("experts", [2, 4, 8])
def test_router_prior_makes_expert_e_dominant_near_its_centre_at_init(experts):
    model = tiny(num_experts=experts, router_prior=50.0)
    centres = torch.arange(experts) / (experts - 1)
    gates = model.block.mlp.gates(centres)               # (E, E): row e at s = c_e
    assert (gates.argmax(1) == torch.arange(experts)).all()
    assert torch.allclose(tiny(num_experts=experts).gate_matrix(5), torch.full((5, experts), 1 / experts))


# --- weight decay: every bias, whatever its shape, is named as one ---

def test_every_bias_like_parameter_is_named_bias():
    for name in revit.PRESETS:
        if not name.startswith(("vit-mini", "raptor-mini", "revit-mini")) or "mini32" in name:
            continue
        model = tiny(name)
        for pname, p in model.named_parameters():
            if "bias" in pname:
                assert pname.endswith("bias"), pname
        bank_biases = [n for n, _ in model.named_parameters() if n.endswith(("fc1_bias", "fc2_bias"))]
        assert all(model.get_parameter(n).ndim == 2 for n in bank_biases)  # (E, d_ff), (E, d): 2-D but biases


def test_raptor_presets_keep_layer_scale_like_deit3():
    assert revit.PRESETS["raptor-s"]["layer_scale_init"] == revit.PRESETS["vit-s"]["layer_scale_init"] == 1e-4
    assert "layer_scale_init" not in revit.PRESETS["revit-s"]
    assert tiny("raptor-mini").blocks[0].ls1.gamma.eq(1e-4).all()


# --- config and input validation ---

@pytest.mark.parametrize("overrides,match", [
    (dict(depth=6.5), "depth=6.5 is not allowed: depth must be an integer"),
    (dict(num_experts=2.0), "num_experts=2.0 is not allowed: num_experts must be an integer"),
    (dict(dim="96"), "dim='96' is not allowed: dim must be an integer"),
    (dict(depth=True), "depth=True is not allowed: depth must be an integer"),
    (dict(depth_drop=float("nan")), "depth_drop=nan is not allowed: depth_drop must be a finite number"),
    (dict(router_temperature="1"), "router_temperature must be a finite number"),
    (dict(merge_cache="yes"), "merge_cache must be True or False"),
    (dict(arch=3), "arch must be a string"),
    (dict(layer_scale_init=float("inf")), "layer_scale_init must be a finite number or None"),
    (dict(layer_scale_init=0.0), "layer_scale_init must be > 0 or None"),
    (dict(router_prior=-1.0), r"router_prior must be in \[0, 1000\]"),
    (dict(router_prior=1e308), r"router_prior must be in \[0, 1000\]"),  # a NaN loss at step 0, not a hint
    (dict(router_temperature=1e-320), r"router_temperature must be in \[0.001, 1000\]"),
    (dict(router_hidden=0), r"router_hidden must be an integer in 1\.\.4096"),
    (dict(num_experts=10 ** 8), r"num_experts must be an integer in 1\.\.1024"),
    (dict(dim=10 ** 9, heads=1), r"dim must be an integer in 1\.\.32768"),
    (dict(depth=10 ** 9), r"depth must be in 1\.\.256 \(reViT: 2\.\.256"),
    (dict(depth=1), r"depth=1 is not allowed: depth must be in 1\.\.256 \(reViT: 2\.\.256"),
    (dict(arch="vit", depth=0), r"depth=0 is not allowed: depth must be in 1\.\.256"),
    (dict(balance_weight=-1e-3), r"balance_weight must be in \[0, 1000\]"),
])
def test_config_types_and_ranges_are_checked_up_front(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny(**overrides)


def test_image_dtypes():
    model = randomise(tiny(), 17).eval()
    x = images(2, model)
    with pytest.raises(ValueError, match="images must be a floating-point tensor.*torch.uint8"):
        model((x * 50).clamp(0, 255).to(torch.uint8))
    with pytest.raises(ValueError, match="floating-point.*torch.int64"):
        model(x.long())
    with torch.no_grad():  # other floating dtypes are cast to the model's
        torch.testing.assert_close(model(x.double()), model(x))
        assert model.to(torch.bfloat16)(x).dtype == torch.bfloat16


# --- the file's structure: reViT's story reads to `fold` alone; checks, the cache and hooks come after ---

def top_level(source: str) -> list:
    return ast.parse(source).body


def test_the_story_reads_to_fold_and_nothing_runs_behind_the_call_site():
    """From the top of revit.py to `fold` a reader meets reViT and the blocks it is built from (the input
    checks and the merge cache's body come after it); nowhere does revit.py swap a module's class, hook
    a forward or every optimizer of the process."""
    source = Path(revit.__file__).read_text()
    fold_line = next(n.lineno for n in top_level(source) if getattr(n, "name", None) == "fold")
    assert fold_line <= STORY_LINES, f"fold starts at line {fold_line}: the story grew past {STORY_LINES} lines"
    story = [n for n in top_level(source) if n.lineno < fold_line]
    names = module_level_names(story)
    assert not {n for n in names if n.startswith("check_") or "cache" in n.lower() or "hook" in n.lower()}
    for hidden in ("__class__ =", "register_optimizer_step_post_hook", "register_forward_pre_hook", "CONFIG_CHECKS",
                   "MECHANISMS"):
        assert hidden not in source, hidden


STORY_LINES = 420  # revit.py's top to `fold` (its reading order is in the opening docstring)


def module_level_names(statements) -> set:
    names = set()
    for node in statements:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for target in targets for t in ast.walk(target) if isinstance(t, ast.Name))
    return names


def test_the_fixed_depth_forward_is_the_reference_loop():
    """ReViT.forward runs Eq. 3 with FFN_t (Block(x, ffn_t)), FFN_t built one call away by ffn_at from the
    coordinate s_t: psi, the softmax of Eq. 1, the gate-weighted sum of Eq. 2, in one look."""
    forward = inspect.getsource(revit.ReViT.forward)
    assert "x = self.block(x, cached[t] if cached else self.block.mlp.ffn_at(grid[t:t + 1]))" in forward
    ffn_at = inspect.getsource(revit.MergedExpertFFN.ffn_at)
    assert all(step in ffn_at for step in ("self.gate_logits(s)", "torch.softmax(z / self.temperature",
                                           "self.merge(g, "))
    assert "self.mlp(u, step)" not in inspect.getsource(revit.Block.forward)  # one FFN interface


def test_importing_revit_installs_no_hook_and_imports_no_comparison():
    """No hook, with or without the merge cache; the comparison mechanisms (lib/moe.py) are not revit.py's:
    their names and fields are refused by it in one line, and importing lib.moe changes nothing of it."""
    script = (
        "import sys, dataclasses, torch, torch.optim.optimizer as o, revit\n"
        "assert not o._global_optimizer_post_hooks and 'lib.moe' not in sys.modules\n"
        "model = revit.create_model('revit-mini').eval()\n"
        "with torch.no_grad():\n"
        "    model(torch.randn(1, 1, 28, 28))\n"
        "assert not o._global_optimizer_post_hooks and not model._forward_pre_hooks\n"
        "assert type(model.block.mlp) is revit.MergedExpertFFN and model.merged_ffns is not None\n"
        "for name, kw, says in (('revit-s-smear', {}, 'lib.moe.create_model'), ('revit-mini', {'ffn': 'smear'},\n"
        "                       \"unknown config field(s) ['ffn']\")):\n"
        "    try:\n"
        "        revit.create_model(name, **kw)\n"
        "    except ValueError as e:\n"
        "        assert says in str(e) and '\\n' not in str(e), e\n"
        "    else:\n"
        "        raise AssertionError(name)\n"
        "presets, fields = dict(revit.PRESETS), dataclasses.fields(revit.ViTConfig)\n"
        "import lib.moe\n"
        "assert revit.PRESETS == presets and dataclasses.fields(revit.ViTConfig) == fields\n"
        "assert type(lib.moe.create_model('revit-mini-smear')).__name__ == 'ComparisonReViT'\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=Path(revit.__file__).parent, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
