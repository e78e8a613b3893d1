"""Every equation of both papers against an independent float64 reference written from the paper.

reViT (arXiv 2610.12448): ψ and the gates (Eq. 1), the weight-space merge (Eq. 2), the recurrent
step (Eq. 3), the auxiliary losses (App. A.2, Eqs. 6, 8, 9) by value, elastic depth's renumbered
coordinates (§3.2), fold (§3.1), Raptor's schedule and every comparison mechanism of §4.3 / App. B
with its auxiliary losses and its update after the optimizer step. AlterNet (arXiv 2611.08741):
the depth encoding (Eq. 1), the router (Eq. 2), the gated step (Eq. 3), halting (Eqs. 4-5), the
losses (Eqs. 6-10) by value and by gradient, the curriculum and the a_KL ramp (§4).

The references read only a model's state dict and its config's public fields, and compare with the
model's public outputs (logits, return_states, gate_matrix, fold, aux_losses, loss, gradients). They
never call the code under test: a bug planted in the model (tests/mutants.py) makes them fail.
Weights are random and large enough that gates differ across depth and across images, tau != 1,
the experts' cosines are not in {0, 1} and LoRA's B_t != 0: a test must not pass by symmetry.
"""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import alternet
import revit
from lib import moe  # builds every preset, the comparison mechanisms' too (§4.3, App. B)

F64 = torch.float64
FAST = settings(max_examples=8, deadline=None, derandomize=True)


def close(actual, expected, rtol=1e-4, atol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual).double(), torch.as_tensor(expected).double(),
                               rtol=rtol, atol=atol)


def float64_state(model):
    return {k: v.detach().double() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------------------
# Float64 building blocks, written out (no torch.nn.functional, no code of the project)
# ---------------------------------------------------------------------------------------------

def layer_norm(x, weight, bias, eps):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def gelu(x):  # the exact GELU (Hendrycks & Gimpel): x Phi(x)
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def silu(x):  # SiLU(x) = x sigmoid(x)
    return x / (1.0 + torch.exp(-x))


def sigmoid(x):
    return 1.0 / (1.0 + torch.exp(-x))


def softmax(z):
    e = torch.exp(z - z.max(-1, keepdim=True).values)
    return e / e.sum(-1, keepdim=True)


def logsumexp(z):
    m = z.max(-1).values
    return m + torch.log(torch.exp(z - m.unsqueeze(-1)).sum(-1))


def linear(x, weight, bias=None):
    y = x @ weight.T
    return y if bias is None else y + bias


def attention(x, w_qkv, b_qkv, w_proj, b_proj, heads, causal=False):
    """Multi-head self-attention of one sequence x (T, d): softmax(q k^T / sqrt(c)) v per head."""
    T, d = x.shape
    c = d // heads
    qkv = linear(x, w_qkv, b_qkv)
    q, k, v = qkv[:, :d], qkv[:, d:2 * d], qkv[:, 2 * d:]
    out = []
    for h in range(heads):
        cols = slice(h * c, (h + 1) * c)
        scores = q[:, cols] @ k[:, cols].T / math.sqrt(c)                 # (T, T)
        if causal:
            scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
        out.append(softmax(scores) @ v[:, cols])
    return linear(torch.cat(out, dim=1), w_proj, b_proj)


def ffn(u, w1, b1, w2, b2):
    return linear(gelu(linear(u, w1, b1)), w2, b2)


def entropy(g):
    return -(g * torch.log(g)).sum(-1)


def cosine(a, b):
    return (a @ b) / (a.norm() * b.norm())


# ---------------------------------------------------------------------------------------------
# reViT (arXiv 2610.12448), one image at a time
# ---------------------------------------------------------------------------------------------

TINY = dict(image_size=8, patch_size=4, in_channels=1, num_classes=3, dim=8, heads=2, ffn_dim=12, depth=4)


def tiny(preset, seed=0, **overrides):
    """A tiny model with random weights everywhere: ψ's first layer large (its output layer starts at zero),
    the experts a shared direction plus their own (cosines strictly between 0 and 1)."""
    torch.manual_seed(seed)
    model = moe.create_model(preset, **{**TINY, **overrides})
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = {"block.mlp.router.0.weight": 2.0, "block.mlp.router.0.bias": 1.0}.get(name, 0.4)
            p.copy_(torch.randn(p.shape, generator=g) * scale)
            if name.endswith(("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")) and p.shape[0] > 1:
                p.copy_(p[:1] + 0.8 * p)  # experts share a component: cos(theta_e, theta_e') in (0, 1)
            if name.endswith("norm.weight") or name.endswith(("norm1.weight", "norm2.weight")):
                p.add_(1.0)
    return model


def images(model, batch, seed=0):
    c = model.config
    return torch.randn(batch, c.in_channels, c.image_size, c.image_size, generator=torch.Generator().manual_seed(seed))


def embed(sd, config, image):
    """§3.1 / ViT: non-overlapping p x p patches, a linear map, positions on the patch tokens, a class
    token in front (DeiT III's layout). image (C, H, W) -> (1 + N, d)."""
    p, (C, H, W) = config.patch_size, image.shape
    patches = image.double().reshape(C, H // p, p, W // p, p).permute(1, 3, 0, 2, 4).reshape((H // p) * (W // p), -1)
    w = sd["patch_embed.proj.weight"].reshape(config.dim, -1)
    tokens = patches @ w.T + sd["patch_embed.proj.bias"] + sd["pos_embed"][0]
    return torch.cat([sd["cls_token"][0], tokens])


def head(sd, x):
    return linear(layer_norm(x, sd["norm.weight"], sd["norm.bias"], 1e-6)[0], sd["head.weight"], sd["head.bias"])


def block_step(sd, prefix, x, heads, mlp, deltas=None):
    """Eq. 3: H = X + MHSA(LN(X)); X' = H + FFN(LN(H)); LayerScale where the block has it;
    deltas: LoRA's B_t A_t added to the four weights."""
    deltas = deltas or {}
    w = {name: sd[f"{prefix}{name}"] + deltas.get(name, 0.0)
         for name in ("attn.qkv.weight", "attn.proj.weight")}
    a = attention(layer_norm(x, sd[f"{prefix}norm1.weight"], sd[f"{prefix}norm1.bias"], 1e-6),
                  w["attn.qkv.weight"], sd[f"{prefix}attn.qkv.bias"],
                  w["attn.proj.weight"], sd[f"{prefix}attn.proj.bias"], heads)
    h = x + a * sd.get(f"{prefix}ls1.gamma", 1.0)
    y = mlp(layer_norm(h, sd[f"{prefix}norm2.weight"], sd[f"{prefix}norm2.bias"], 1e-6))
    return h + y * sd.get(f"{prefix}ls2.gamma", 1.0)


def psi(sd, config, s):
    """Eq. 1: z = psi(s) with psi = Linear(1, 16) -> SiLU -> Linear(16, E), plus the fixed depth prior
    -beta (s - c_e)^2, c_e = e / (E - 1) (beta = router_prior; 0 is the paper's router)."""
    P = "block.mlp.router."
    hidden = silu(sd[P + "0.weight"][:, 0] * s + sd[P + "0.bias"])
    z = sd[P + "2.weight"] @ hidden + sd[P + "2.bias"]
    E = z.shape[0]
    centres = torch.tensor([e / (E - 1) for e in range(E)], dtype=F64)
    return z - config.router_prior * (s - centres) ** 2


def gates_at(sd, config, s):
    """Eq. 1: g = softmax(z / tau)."""
    return softmax(psi(sd, config, s) / config.router_temperature)


def merged_ffn(sd, g, prefix="block.mlp."):
    """Eq. 2: W_t = sum_e g_te W_e for W1, b1, W2, b2; returns the FFN u -> W2 GELU(W1 u + b1) + b2."""
    w1, b1, w2, b2 = (sum(g[e] * sd[prefix + k][e] for e in range(len(g)))
                      for k in ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"))
    return lambda u: ffn(u, w1, b1, w2, b2)


def retained_coordinates(keep_row):
    """§3.2: the n retained steps, renumbered k = 0..n-1 in execution order, sit at k / (n - 1);
    n = 1 sits at s = 0 (our choice). Dropped steps get None."""
    n = int(sum(keep_row))
    coords, k = [], 0
    for kept in keep_row:
        coords.append((k / (n - 1) if n > 1 else 0.0) if kept else None)
        k += bool(kept)
    return coords


def reference_revit(model, x, depth=None, keep=None, mlp_of=None):
    """The recurrent forward, image by image and step by step. mlp_of(sd, b, t, s) returns the FFN that
    image b runs at step t and coordinate s (default: reViT's merged FFN of Eqs. 1-2).
    -> logits (B, classes), states (B, L + 1, T, d)."""
    sd, c = float64_state(model), model.config
    depth = depth or c.depth
    mlp_of = mlp_of or (lambda sd, b, t, s: merged_ffn(sd, gates_at(sd, c, s)))
    logits, states = [], []
    for b in range(x.shape[0]):
        row = [True] * depth if keep is None else keep[b].tolist()
        h = embed(sd, c, x[b])
        trajectory = [h]
        for t, s in enumerate(retained_coordinates(row)):
            if s is not None:  # a dropped step is the identity
                h = block_step(sd, "block.", h, c.heads, mlp_of(sd, b, t, s))
            trajectory.append(h)
        logits.append(head(sd, h))
        states.append(torch.stack(trajectory))
    return torch.stack(logits), torch.stack(states)


def reference_aux_losses(model, depth):
    """App. A.2 on the grid s_t = t / (L - 1): Eq. 6 L_bal = 1/L sum_t [1 - H(g_t) / log E]; Eq. 8
    L_z = 1/L sum_t (logsumexp_e z_te)^2; Eq. 9 L_div = mean over pairs e < e' of
    cos^2(theta_e, theta_e'); each times its weight (lambda_bal, lambda_z, lambda_div)."""
    sd, c = float64_state(model), model.config
    E = c.num_experts
    z = torch.stack([psi(sd, c, t / (depth - 1)) for t in range(depth)])      # (L, E)
    g = softmax(z / c.router_temperature)
    balance = (1 - entropy(g) / math.log(E)).mean()
    z_loss = (logsumexp(z) ** 2).mean()
    return {"balance": c.balance_weight * balance, "z_loss": c.z_loss_weight * z_loss,
            "diversity": c.diversity_weight * diversity(sd)}


def diversity(sd, prefix="block.mlp."):
    """Eq. 9: mean over pairs e < e' of cos^2 of the flattened expert parameter vectors."""
    theta = torch.cat([sd[prefix + k].flatten(1) for k in ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")], 1)
    E = theta.shape[0]
    pairs = [cosine(theta[i], theta[j]) ** 2 for i in range(E) for j in range(i + 1, E)]
    return sum(pairs) / len(pairs)


def forward(model, x, **kwargs):
    with torch.no_grad():
        return model(x, return_states=True, **kwargs)


def assert_states(out, expected_logits, expected_states):
    close(out["logits"], expected_logits)
    close(torch.stack(out["states"], 1), expected_states)


# --- Eq. 1: ψ, tau and the depth prior ---

@FAST
@given(experts=st.integers(2, 6), depth=st.integers(2, 9), temperature=st.sampled_from([0.35, 1.0, 2.5]),
       prior=st.sampled_from([0.0, 3.0]), seed=st.integers(0, 99))
def test_gate_matrix_is_eq1_psi_with_silu_temperature_and_prior(experts, depth, temperature, prior, seed):
    model = tiny("revit-mini", seed, num_experts=experts, router_temperature=temperature, router_prior=prior)
    sd, c = float64_state(model), model.config
    expected = torch.stack([gates_at(sd, c, t / (depth - 1)) for t in range(depth)])
    close(model.gate_matrix(depth), expected, rtol=1e-5, atol=1e-6)
    assert (expected.max(0).values - expected.min(0).values).max() > 0.05  # gates differ across depth


def test_router_output_is_softmax_of_z_over_tau_not_z():
    model = tiny("revit-mini", 3, num_experts=3, router_temperature=0.5)
    sd, c = float64_state(model), model.config
    g = model.gate_matrix(5).double()
    for t in range(5):
        z = psi(sd, c, t / 4)
        close(torch.log(g[t]) - torch.log(g[t]).mean(), (z - z.mean()) / 0.5, rtol=1e-4, atol=1e-4)


# --- Eqs. 2-3: the merge and the recurrent step, at the trained depth and at others ---

@pytest.mark.parametrize("depth", [None, 2, 7])
def test_forward_is_eq3_with_the_eq2_merge_of_each_step(depth):
    model = tiny("revit-mini", 1, num_experts=3, router_temperature=0.7, router_prior=2.0).eval()
    x = images(model, 3, 1)
    out = forward(model, x, depth=depth)
    assert_states(out, *reference_revit(model, x, depth))
    sd, c = float64_state(model), model.config
    L = depth or c.depth
    close(out["gates"], torch.stack([gates_at(sd, c, t / (L - 1)) for t in range(L)]), atol=1e-6)


def test_training_forward_without_cache_is_the_same_equations():
    model = tiny("revit-mini", 2, num_experts=4, router_temperature=1.3).train()
    x = images(model, 2, 2)
    out = model(x, return_states=True)
    assert_states(out, *reference_revit(model, x))


# --- Eqs. 6, 8, 9 by value ---

@FAST
@given(experts=st.integers(2, 5), depth=st.integers(2, 8), temperature=st.sampled_from([0.5, 1.0, 1.7]),
       weights=st.sampled_from([(1e-2, 1e-3, 1e-3), (0.3, 0.05, 0.7), (1.0, 0.0, 2.0)]), seed=st.integers(0, 99))
def test_aux_losses_are_eqs_6_8_9_by_value(experts, depth, temperature, weights, seed):
    balance, z, div = weights
    model = tiny("revit-mini", seed, num_experts=experts, router_temperature=temperature, router_prior=1.5,
                 balance_weight=balance, z_loss_weight=z, diversity_weight=div).eval()
    aux = forward(model, images(model, 1, seed), depth=depth)["aux_losses"]
    expected = reference_aux_losses(model, depth)
    assert set(aux) == set(expected)
    for name in expected:
        close(aux[name], expected[name], rtol=1e-4, atol=1e-7)


def test_aux_loss_weights_default_to_table_6_and_cosines_are_not_trivial():
    model = tiny("revit-mini", 4).eval()
    c = model.config
    assert (c.balance_weight, c.z_loss_weight, c.diversity_weight) == (1e-2, 1e-3, 1e-3)  # Table 6
    assert c.router_temperature == 1.0 and c.router_hidden == 16  # App. A.1
    sd = float64_state(model)
    theta = torch.cat([sd["block.mlp." + k].flatten(1)
                       for k in ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")], 1)
    cos = [cosine(theta[i], theta[j]).item() for i in range(4) for j in range(i + 1, 4)]
    assert all(0.1 < v < 0.9 for v in cos)  # cos^2 != |cos| != cos here
    aux = forward(model, images(model, 1))["aux_losses"]
    for name, value in reference_aux_losses(model, c.depth).items():
        close(aux[name], value, rtol=1e-4, atol=1e-8)


def test_aux_losses_backpropagate_to_psi_and_the_bank_as_the_formulas_do():
    model = tiny("revit-mini", 5, num_experts=3, router_temperature=0.8, balance_weight=0.5,
                 z_loss_weight=0.2, diversity_weight=0.9).train()
    sum(model(images(model, 1), return_states=True)["aux_losses"].values()).backward()
    leaves = {k: v.clone().requires_grad_() for k, v in float64_state(model).items()}
    E, L, c = 3, model.config.depth, model.config
    z = torch.stack([psi(leaves, c, t / (L - 1)) for t in range(L)])
    g = softmax(z / c.router_temperature)
    total = (c.balance_weight * (1 - entropy(g) / math.log(E)).mean() + c.z_loss_weight * (logsumexp(z) ** 2).mean()
             + c.diversity_weight * diversity(leaves))
    total.backward()
    for name, p in model.named_parameters():
        if name.startswith("block.mlp."):
            assert p.grad is not None, name
            close(p.grad, leaves[name].grad, rtol=1e-3, atol=1e-6)


# --- elastic depth (§3.2) ---

def test_elastic_depth_renumbers_the_retained_steps_per_image():
    model = tiny("revit-mini", 6, num_experts=3, router_temperature=0.6, depth=5).eval()
    keep = torch.tensor([[True, False, True, True, False],     # n = 3: s = 0, 1/2, 1
                         [False, True, False, False, True],    # n = 2: s = 0, 1
                         [False, False, True, False, False],   # n = 1: s = 0
                         [False] * 5,                          # n = 0: unchanged
                         [True] * 4 + [False]])                # n = 4: s = 0, 1/3, 2/3, 1
    x = images(model, 5, 6)
    assert_states(forward(model, x, keep=keep), *reference_revit(model, x, keep=keep))


@FAST
@given(seed=st.integers(0, 10**6))
def test_elastic_depth_matches_the_reference_for_random_masks(seed):
    model = tiny("revit-mini", 7, num_experts=2, router_prior=4.0).eval()
    keep = torch.rand(4, 4, generator=torch.Generator().manual_seed(seed)) < 0.6
    x = images(model, 4, seed)
    close(forward(model, x, keep=keep)["logits"], reference_revit(model, x, keep=keep)[0])


# --- fold (§3.1) ---

def reference_vit(model, x, schedule=None, deltas_of=None):
    """A plain ViT / Raptor: step t runs block schedule[t] (with LayerScale where the block has it)."""
    sd, c = float64_state(model), model.config
    schedule = schedule or list(range(c.depth))
    logits = []
    for b in range(x.shape[0]):
        h = embed(sd, c, x[b])
        for j in schedule:
            P = f"blocks.{j}."
            h = block_step(sd, P, h, c.heads, lambda u, P=P: ffn(u, sd[P + "mlp.fc1.weight"], sd[P + "mlp.fc1.bias"],
                                                                  sd[P + "mlp.fc2.weight"], sd[P + "mlp.fc2.bias"]))
        logits.append(head(sd, h))
    return torch.stack(logits)


@pytest.mark.parametrize("depth", [3, 6])
def test_fold_is_the_reference_forward_as_a_plain_vit(depth):
    model = tiny("revit-mini", 8, num_experts=3, router_temperature=0.7, router_prior=2.0).eval()
    x = images(model, 2, 8)
    vit = revit.fold(model, depth)
    with torch.no_grad():
        close(vit(x), reference_revit(model, x, depth)[0])
    close(vit(x), reference_vit(vit, x))


def test_fold_with_given_gates_merges_those_gates():
    model = tiny("revit-mini", 9, num_experts=3).eval()
    gates = torch.tensor([[1.0, 0.0, 0.0], [0.2, 0.5, 0.3], [0.0, 0.0, 1.0]])
    vit = revit.fold(model, gates=gates)
    x = images(model, 2, 9)
    expected, _ = reference_revit(model, x, 3, mlp_of=lambda sd, b, t, s: merged_ffn(sd, gates[t].double()))
    with torch.no_grad():
        close(vit(x), expected)


# --- Table 1's baselines: the untied ViT and Raptor's schedule ---

def reference_raptor_schedule(k, depth):
    """Raptor (KempnerInstitute/raptor): at L = 12 block i serves 1-based steps t <= thresholds[i],
    k=2 -> [7], k=3 -> [7, 10], k=4 -> [4, 7, 10]; at another depth the thresholds scale with L."""
    thresholds = {2: [7], 3: [7, 10], 4: [4, 7, 10]}[k]
    ends = [round(th * depth / 12) for th in thresholds] + [depth]
    return [sum(step > end for end in ends) for step in range(1, depth + 1)]


@pytest.mark.parametrize("k,depth", [(4, 12), (3, 12), (2, 12), (4, 8), (3, 24)])
def test_raptor_runs_its_blocks_on_raptors_segments(k, depth):
    model = tiny(f"raptor-mini-k{k}", 10, depth=depth).eval()
    x = images(model, 1, 10)
    if depth == 12:
        assert reference_raptor_schedule(k, 12) == {4: [0] * 4 + [1] * 3 + [2] * 3 + [3] * 2,
                                                    3: [0] * 7 + [1] * 3 + [2] * 2, 2: [0] * 7 + [1] * 5}[k]
    with torch.no_grad():
        close(model(x), reference_vit(model, x, reference_raptor_schedule(k, depth)))


def test_untied_vit_has_layer_scale_and_its_own_blocks():
    model = tiny("vit-mini", 11).eval()
    assert "blocks.0.ls1.gamma" in model.state_dict()
    x = images(model, 2, 11)
    with torch.no_grad():
        close(model(x), reference_vit(model, x))


def test_deit3_bce_binarises_the_mixed_targets_and_ce_takes_them_soft():
    """DeiT III (Table 6's loss): after mixup/cutmix the targets are binarised (> 0), then per-class
    binary cross-entropy; the cross-entropy alternative takes the soft targets as they are."""
    import train
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 5, generator=g)
    targets = torch.softmax(torch.randn(4, 5, generator=g), -1) * (torch.rand(4, 5, generator=g) > 0.4)
    y, z = (targets > 0).double(), logits.double()
    bce = -(y * torch.log(sigmoid(z)) + (1 - y) * torch.log(1 - sigmoid(z))).mean()
    close(train.classification_loss(logits, targets, "bce"), bce, atol=1e-6)
    ce = -(targets.double() * (z - logsumexp(z).unsqueeze(-1))).sum(-1).mean()
    close(train.classification_loss(logits, targets, "ce"), ce, atol=1e-6)


def test_distillation_is_eq5_the_mse_of_the_final_post_norm_tokens():
    """Eq. 5 (App. A.3): L = 1/(T d) ||LN(X^L) - Y||_F^2 per image, Y a frozen teacher's final post-norm tokens,
    averaged over the batch and added to the student's auxiliary losses; the evaluation's distill_mse sums the
    per-image terms (train.py divides by the number of images)."""
    import contextlib
    from lib import tasks
    student, teacher = tiny("revit-mini", 12).train(), tiny("vit-mini", 13).eval()
    x, labels = images(student, 3, 12), torch.zeros(3, dtype=torch.long)
    task = tasks.DistillTask(None, None, torch.device("cpu"), lambda x, y: (x, y), contextlib.nullcontext,
                             tasks.TeacherTokens(teacher, hub=False))
    loss, parts = task.loss(student, x, labels)
    sd = float64_state(student)
    _, states = reference_revit(student, x)
    with torch.no_grad():
        y = teacher(x, return_states=True)["tokens"].double()
    final = layer_norm(states[:, -1], sd["norm.weight"], sd["norm.bias"], 1e-6)   # LN(X^L): (B, T, d)
    per_image = ((final - y) ** 2).sum((1, 2)) / (final.shape[1] * final.shape[2])
    close(parts["distill"], per_image.mean())
    close(loss, per_image.mean() + sum(reference_aux_losses(student, student.config.depth).values()))
    with torch.no_grad():
        close(task.score(student.eval(), x, labels, None)["distill_mse"], per_image.sum())


# ---------------------------------------------------------------------------------------------
# reViT's comparisons (§4.3, App. B): each mechanism's FFN and its auxiliary losses
# ---------------------------------------------------------------------------------------------

def expert(sd, prefix, e):
    return lambda u: ffn(u, *(sd[prefix + k][e] for k in ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")))


class Recorder:
    """What a reference FFN saw over one forward: router rows (logits or gates), their steps, top-K choices."""

    def __init__(self):
        self.rows, self.steps, self.chosen = [], [], []


def content_merge(kind, recorder):
    """SMEAR / feature-only: g = softmax(W LN(mean_tokens u) + b); Lory: no LayerNorm, routed on the
    pooled FFN input of the image's previous retained step (its own at its first). One merge per image."""
    previous = {}

    def mlp_of(sd, b, t, s):
        def run(u):
            pooled = u.mean(0)
            if kind == "lory":
                source = previous.get(b, pooled)
                previous[b] = pooled
            else:
                source = layer_norm(pooled, sd["block.mlp.router_norm.weight"], sd["block.mlp.router_norm.bias"], 1e-6)
            z = linear(source, sd["block.mlp.router.weight"], sd["block.mlp.router.bias"])
            recorder.rows.append(z)
            recorder.steps.append(t)
            return merged_ffn(sd, softmax(z))(u)
        return run
    return mlp_of


@pytest.mark.parametrize("kind", ["smear", "feature", "lory"])
def test_content_merges_gate_each_image_on_its_own_state(kind):
    model = tiny(f"revit-mini-{kind}", 12, depth=3).eval()
    x = images(model, 3, 12)
    keep = torch.tensor([[True, True, True], [True, False, True], [False, True, True]])
    for k in (None, keep):
        recorder = Recorder()
        expected = reference_revit(model, x, keep=k, mlp_of=content_merge(kind, recorder))
        assert_states(forward(model, x, keep=k), *expected)
    first_step = softmax(torch.stack([z for z, t in zip(recorder.rows, recorder.steps) if t == 0]))
    assert len(first_step) == 2 and (first_step[0] - first_step[1]).abs().max() > 0.05  # differ per image


@pytest.mark.parametrize("weights", [(1e-2, 1e-3, 1e-3), (0.4, 0.07, 0.9)])
def test_feature_only_control_carries_eqs_6_8_9_over_every_gate_of_every_step(weights):
    model = tiny("revit-mini-feature", 13, depth=3, balance_weight=weights[0], z_loss_weight=weights[1],
                 diversity_weight=weights[2]).train()
    x = images(model, 3, 13)
    keep = torch.tensor([[True, True, False], [True, False, True], [False, True, True]])
    recorder = Recorder()
    reference_revit(model, x, keep=keep, mlp_of=content_merge("feature", recorder))
    z = torch.stack(recorder.rows)  # (rows, E): every per-image gate vector of every step
    assert len(z) == int(keep.sum())
    E = model.config.num_experts
    expected = {"balance": weights[0] * (1 - entropy(softmax(z)) / math.log(E)).mean(),
                "z_loss": weights[1] * (logsumexp(z) ** 2).mean(),
                "diversity": weights[2] * diversity(float64_state(model))}
    aux = model(x, keep=keep, return_states=True)["aux_losses"]
    assert set(aux) == set(expected)
    for name in expected:
        close(aux[name], expected[name], rtol=1e-4, atol=1e-8)


def test_smear_and_lory_have_no_auxiliary_losses():
    for kind in ("smear", "lory"):
        model = tiny(f"revit-mini-{kind}", 14).train()
        assert model(images(model, 2), return_states=True)["aux_losses"] == {}


def token_routed(kind, config, recorder):
    """Token dispatch, one token at a time.
    DeepSeek-V3: s = sigmoid(W x), top-K of s + bias (selection only), gates s / sum over the selected,
    plus the always-active shared experts. Qwen3: p = softmax(W x), top-K, renormalised. MoEUT:
    s = sigmoid(W x), top-K, outputs weighted by s (no renormalisation). ReMoE: g = relu(W x), every
    expert, outputs weighted by g."""
    P, K = "block.mlp.", config.top_k

    def mlp_of(sd, b, t, s):
        def token(x):
            logits = sd[P + "router.weight"] @ x
            if kind == "remoe":
                g = logits.clamp(min=0)
                recorder.rows.append(g)
                return sum(g[e] * expert(sd, P, e)(x) for e in range(len(g)))
            recorder.rows.append(logits)
            if kind == "deepseek":
                score = sigmoid(logits)
                chosen = torch.topk(score + sd[P + "expert_bias"], K).indices.tolist()
                weight = {e: score[e] / score[chosen].sum() for e in chosen}
                shared = sum(expert(sd, P + "shared.", j)(x) for j in range(config.shared_experts))
            elif kind == "qwen3":
                prob = softmax(logits)
                chosen = torch.topk(prob, K).indices.tolist()
                weight, shared = {e: prob[e] / prob[chosen].sum() for e in chosen}, 0.0
            else:  # moeut
                score = sigmoid(logits)
                chosen = torch.topk(score, K).indices.tolist()
                weight, shared = {e: score[e] for e in chosen}, 0.0
            recorder.chosen.append(chosen)
            return sum(weight[e] * expert(sd, P, e)(x) for e in chosen) + shared
        return lambda u: torch.stack([token(x) for x in u])
    return mlp_of


ROUTED = {"deepseek": dict(num_experts=4, top_k=2, shared_experts=1), "qwen3": dict(num_experts=4, top_k=2),
          "moeut": dict(num_experts=5, top_k=2), "remoe": dict(num_experts=4)}


@pytest.mark.parametrize("kind", list(ROUTED))
def test_token_dispatch_mechanisms_are_their_papers_routing(kind):
    model = tiny(f"revit-mini-{kind}", 15, depth=3, **ROUTED[kind]).eval()
    if kind == "deepseek":
        with torch.no_grad():  # the balancing bias must change the selection, never the gate value
            model.block.mlp.expert_bias.copy_(torch.tensor([0.6, -0.2, 0.1, -0.5]))
    x = images(model, 2, 15)
    keep = torch.tensor([[True, False, True], [True, True, True]])
    for k in (None, keep):
        expected = reference_revit(model, x, keep=k, mlp_of=token_routed(kind, model.config, Recorder()))
        assert_states(forward(model, x, keep=k), *expected)


def pooled_router_rows(model, x, kind):
    recorder = Recorder()
    reference_revit(model, x, mlp_of=token_routed(kind, model.config, recorder))
    return recorder, torch.stack(recorder.rows)


def test_qwen3_global_batch_balance_loss_pools_every_step():
    """Qwen3 (global-batch balance): w * E * sum_e f_e P_e, f_e the fraction of (token, slot) choices of
    expert e, P_e the mean router probability, both over every token of every recurrent step."""
    model = tiny("revit-mini-qwen3", 16, depth=3, num_experts=4, top_k=2, balance_weight=0.3).train()
    x = images(model, 2, 16)
    recorder, logits = pooled_router_rows(model, x, "qwen3")
    counts = torch.zeros(4, dtype=F64)
    for chosen in recorder.chosen:
        counts[chosen] += 1
    f, P = counts / len(logits), softmax(logits).mean(0)
    close(model(x, return_states=True)["aux_losses"]["balance"], 0.3 * 4 * (f * P).sum(), rtol=1e-4, atol=1e-8)


def test_moeut_balance_is_minus_the_entropy_of_the_mean_selection():
    model = tiny("revit-mini-moeut", 17, depth=3, num_experts=5, top_k=2, balance_weight=0.2).train()
    x = images(model, 2, 17)
    _, logits = pooled_router_rows(model, x, "moeut")
    mean_selection = softmax(logits).mean(0)
    close(model(x, return_states=True)["aux_losses"]["balance"], -0.2 * entropy(mean_selection), rtol=1e-4, atol=1e-8)


def test_remoe_l1_penalty_is_load_balanced_over_all_steps():
    """ReMoE: lambda E / (n^2 K) sum_e (sum over tokens of g_e) count_e, n tokens over all L steps,
    K = E (1 - target sparsity), count_e the tokens with g_e > 0."""
    model = tiny("revit-mini-remoe", 18, depth=3, num_experts=4, remoe_target_sparsity=0.6).train()
    with torch.no_grad():
        model.block.mlp.l1_weight.fill_(0.37)
    x = images(model, 2, 18)
    _, g = pooled_router_rows(model, x, "remoe")
    n, E, K = len(g), 4, 4 * (1 - 0.6)
    counts = (g > 0).double().sum(0)
    assert 0 < counts.sum() < g.numel()
    expected = 0.37 * E / (n ** 2 * K) * (g.sum(0) * counts).sum()
    close(model(x, return_states=True)["aux_losses"]["l1"], expected, rtol=1e-4, atol=1e-8)


def test_remoe_controller_and_deepseek_bias_follow_their_update_rules():
    """ReMoE: lambda *= 1.2 while the sparsity is below its target, else lambda /= 1.2.
    DeepSeek-V3: b_e += rate * sign(mean load - load_e), kept at zero mean, from the tokens' top-K choices."""
    model = tiny("revit-mini-remoe", 19, depth=2, num_experts=4, remoe_target_sparsity=0.6).train()
    x = images(model, 2, 19)
    _, g = pooled_router_rows(model, x, "remoe")
    sparsity = 1 - (g > 0).double().mean().item()
    model(x)
    before = model.block.mlp.l1_weight.item()
    model.block.mlp.after_optimizer_step()
    assert model.block.mlp.l1_weight.item() == pytest.approx(before * (1.2 if sparsity < 0.6 else 1 / 1.2), rel=1e-6)

    model = tiny("revit-mini-deepseek", 20, depth=2, num_experts=4, top_k=2, shared_experts=1,
                 bias_update_rate=0.01).train()
    bias = torch.tensor([0.05, -0.02, 0.03, 0.0])  # not zero-mean: the update re-centres it
    with torch.no_grad():
        model.block.mlp.expert_bias.copy_(bias)
    recorder, _ = pooled_router_rows(model, x, "deepseek")
    load = torch.zeros(4, dtype=F64)
    for chosen in recorder.chosen:
        load[chosen] += 1
    model(x)
    model.block.mlp.after_optimizer_step()
    updated = bias.double() + 0.01 * torch.sign(load.mean() - load)
    close(model.block.mlp.expert_bias, updated - updated.mean(), atol=1e-7)


def test_soft_moe_slots():
    """Soft-MoE: logits = l2norm(x) . (scale l2norm(Phi_s)); dispatch = softmax over tokens per slot,
    combine = softmax over slots per token; expert e runs on its own p slots."""
    model = tiny("revit-mini-softmoe", 21, depth=2, num_experts=3, slots_per_expert=2).eval()
    P = "block.mlp."

    def mlp_of(sd, b, t, s):
        def run(u):
            phi = sd[P + "slot_embed"]
            logits = (u / u.norm(dim=1, keepdim=True)) @ (sd[P + "scale"] * phi / phi.norm(dim=0, keepdim=True))
            dispatch, combine = softmax(logits.T).T, softmax(logits)      # (T, S) each
            slot_inputs = dispatch.T @ u                                  # (S, d)
            outputs = torch.stack([expert(sd, P, i // 2)(slot_inputs[i]) for i in range(6)])
            return combine @ outputs
        return run
    x = images(model, 2, 21)
    assert_states(forward(model, x), *reference_revit(model, x, mlp_of=mlp_of))


# --- layer-wise LoRA (Relaxed Recursive Transformers): W_t = W + B_t A_t at step t ---

LORA = {"qkv": "attn.qkv.weight", "proj": "attn.proj.weight", "fc1": "mlp.fc1.weight", "fc2": "mlp.fc2.weight"}


def reference_lora(sd, config, x):
    """Step t runs the shared block with W + B_t A_t on qkv, proj, fc1 and fc2 (biases and norms shared)."""
    def step(h, t):
        deltas = {w: sd[f"block.lora.{n}_up"][t] @ sd[f"block.lora.{n}_down"][t] for n, w in LORA.items()}
        mlp = lambda u: ffn(u, sd["block.mlp.fc1.weight"] + deltas["mlp.fc1.weight"], sd["block.mlp.fc1.bias"],
                            sd["block.mlp.fc2.weight"] + deltas["mlp.fc2.weight"], sd["block.mlp.fc2.bias"])
        return block_step(sd, "block.", h, config.heads, mlp, deltas)
    logits = []
    for b in range(x.shape[0]):
        h = embed(sd, config, x[b])
        for t in range(config.depth):
            h = step(h, t)
        logits.append(head(sd, h))
    return torch.stack(logits)


def lora_model(seed):
    model = tiny("revit-mini-lora", seed, depth=3, lora_rank=2)
    assert all(model.block.lora.state_dict()[f"{n}_up"].abs().min() > 0 for n in LORA)  # B_t != 0
    return model


def test_layerwise_lora_runs_adapter_t_at_step_t_and_folds_to_it():
    model = lora_model(22).eval()
    x = images(model, 2, 22)
    expected = reference_lora(float64_state(model), model.config, x)
    with torch.no_grad():
        close(model(x), expected)
        vit = revit.fold(model)
        close(vit(x), expected)
    sd, vsd = float64_state(model), float64_state(vit)
    for t in range(3):
        for n, w in LORA.items():
            delta = sd[f"block.lora.{n}_up"][t] @ sd[f"block.lora.{n}_down"][t]  # B_t A_t
            close(vsd[f"blocks.{t}.{w}"], sd[f"block.{w}"] + delta)


def test_layerwise_lora_gradient_reaches_each_adapter_as_the_reference_does():
    model = lora_model(23).train()
    x = images(model, 2, 23)
    weights = torch.randn(2, 3, generator=torch.Generator().manual_seed(23))
    (model(x) * weights).sum().backward()
    leaves = {k: v.clone().requires_grad_() for k, v in float64_state(model).items()}
    (reference_lora(leaves, model.config, x) * weights.double()).sum().backward()
    for name, p in model.named_parameters():
        if name.startswith("block.lora."):
            for t in range(3):
                assert leaves[name].grad[t].abs().max() > 0
                close(p.grad[t], leaves[name].grad[t], rtol=1e-3, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# AlterNet (arXiv 2611.08741), one sequence at a time
# ---------------------------------------------------------------------------------------------

ALTER = dict(vocab_size=13, seq_len=8, dim=8, heads=2, ffn_dim=12, num_experts=3, top_k=2, max_depth=4, depth_dim=4)


def alter_model(seed=0, **overrides):
    """Random weights: a router whose logits spread widely but stay inside the clamp, halt heads whose
    lambdas spread over (0, 1), so that sequences take different experts and halting is not trivial."""
    torch.manual_seed(seed)
    model = alternet.create_model("alternet-tiny", **{**ALTER, **overrides})
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = {"router.weight": 0.7}.get(name, 1.0 if "halt_head" in name else 0.3)
            p.copy_(torch.randn(p.shape, generator=g) * scale)
            if name.endswith(("norm1.weight", "norm2.weight", "norm.weight")):
                p.add_(1.0)
    return model


def sinusoid(t, m):
    """Vaswani et al.'s encoding of a scalar position t: PE_2i = sin(t / 10000^(2i/m)), PE_2i+1 = cos(...)."""
    out = []
    for i in range(m // 2):
        angle = t / 10000 ** (2 * i / m)
        out += [math.sin(angle), math.cos(angle)]
    return torch.tensor(out, dtype=F64)


def alter_expert(sd, c, j, x):
    """Expert j: one pre-norm causal block; y_j is its residual update block(x) - x (Eq. 3's default)."""
    P, eps = f"experts.{j}.", c.norm_eps
    a = attention(layer_norm(x, sd[P + "norm1.weight"], sd[P + "norm1.bias"], eps),
                  sd[P + "attn.qkv.weight"], sd[P + "attn.qkv.bias"],
                  sd[P + "attn.proj.weight"], sd[P + "attn.proj.bias"], c.heads, causal=True)
    f = ffn(layer_norm(x + a, sd[P + "norm2.weight"], sd[P + "norm2.bias"], eps),
            sd[P + "ffn.fc1.weight"], sd[P + "ffn.fc1.bias"], sd[P + "ffn.fc2.weight"], sd[P + "ffn.fc2.bias"])
    return a + f


def alter_sequence(sd, c, tokens, last, num_iterations, detach=lambda v: v.detach()):
    """One sequence through every iteration. Returns per iteration: router logits l (Eqs. 1-2), the chosen
    experts, the new state x_{d+1} (Eq. 3), lambda_d (Eq. 4) and lambda_d for L_RIR (halt heads on
    detached inputs and gates: its gradient reaches the halt heads only)."""
    T = len(tokens)
    x = sd["tok_emb.weight"][tokens] + sd["pos_emb.weight"][:T]           # positions injected once
    D = c.max_depth
    record = []
    for d in range(num_iterations):
        t = d / (D - 1)                                                   # Eq. 1
        features = [x[last], sinusoid(t, c.depth_dim)] + ([sinusoid(1 - t, c.depth_dim)] if c.budget_signal else [])
        logits = sd["router.weight"] @ torch.cat(features)
        if c.logit_clamp is not None:
            logits = logits.clamp(-c.logit_clamp, c.logit_clamp)
        chosen = torch.topk(logits, c.top_k).indices.tolist()
        g = softmax(logits[chosen])                                       # Eq. 2: over the selected only
        ys = [alter_expert(sd, c, j, x) for j in chosen]
        x = x + sum(gj * y for gj, y in zip(g, ys))                       # Eq. 3
        lam, lam_rir = halting_lambda(sd, c, g, chosen, ys, x, last, detach)
        record.append(dict(logits=logits, chosen=chosen, x=x, lam=lam, lam_rir=lam_rir))
    return record


def halting_lambda(sd, c, g, chosen, ys, x_next, last, detach):
    """Eq. 4: lambda = sum_j g_j sigmoid(w_j . y_j[last] + b_j) over the selected experts; the "global"
    ablation: one head on the new state, sigmoid(w . x_{d+1}[last] + b); halting off (Model I): 0.
    Also lambda for L_RIR, from detached inputs and gates."""
    if not c.halting:
        return torch.tensor(0.0, dtype=F64), torch.tensor(0.0, dtype=F64)
    if c.halt_head == "global":
        head = lambda h: sigmoid(sd["halt_head.weight"][0] @ h + sd["halt_head.bias"][0])
        return head(x_next[last]), head(detach(x_next[last]))
    head = lambda j, h: sigmoid(sd[f"experts.{j}.halt_head.weight"][0] @ h + sd[f"experts.{j}.halt_head.bias"][0])
    return (sum(gj * head(j, y[last]) for gj, j, y in zip(g, chosen, ys)),
            sum(detach(gj) * head(j, detach(y[last])) for gj, j, y in zip(g, chosen, ys)))


def halting_p(lams):
    """Eq. 5: p_d = lambda_d prod_{i<d} (1 - lambda_i), with lambda_{D-1} := 1 (p sums to 1)."""
    p, unhalted = [], 1.0
    for d, lam in enumerate(lams):
        lam = 1.0 if d == len(lams) - 1 else lam
        p.append(unhalted * lam)
        unhalted = unhalted * (1 - lam)
    return torch.stack([torch.as_tensor(v, dtype=F64) for v in p])


def prior_q(c, n):
    """Prior over iteration counts 1..n, truncated and renormalised: Gaussian N(D/2, D/4) (§3, Table 2),
    or geometric q_k ∝ p (1 - p)^(k - 1) (PonderNet)."""
    k = torch.arange(1, n + 1, dtype=F64)
    if c.prior == "gaussian":
        w = torch.exp(-0.5 * ((k - c.max_depth / 2) / (c.max_depth / 4)) ** 2)
    else:
        w = c.geometric_p * (1 - c.geometric_p) ** (k - 1)
    return w / w.sum()


def decode_ce(sd, c, x, targets, valid):
    """Mean cross-entropy over the valid positions of the shared final LayerNorm + (tied) LM head."""
    head_weight = sd["tok_emb.weight"] if c.tie_embeddings else sd["lm_head.weight"]
    logits = layer_norm(x, sd["norm.weight"], sd["norm.bias"], c.norm_eps) @ head_weight.T
    ce = logsumexp(logits) - logits[torch.arange(len(targets)), targets.clamp(min=0)]
    return (ce * valid).sum() / valid.sum(), logits


def reference_alternet(sd, c, tokens, targets, lengths=None, kl_scale=1.0):
    """The loss of Eqs. 6-10 with Python loops over sequences and iterations:
    L = L_PN + a_KL L_KL + a_LB L_LB + a_z L_z + a_RIR L_RIR, with
    L_PN = 1/B sum_b sum_d p_d CE_d (CE_d on the output x_{d+1} of iteration d) (Eq. 7),
    L_KL = 1/B sum_b sum_d p_d log(p_d / q_d) (Eq. 8), L_LB = E sum_i f_i P_i and
    L_z = mean (logsumexp l)^2 over every (sequence, iteration) decision,
    w_d = sigmoid(50 (max(CE_{d-1} - CE_d, 0) - 0.005)) and
    L_RIR = 1/B sum_b 1/(D-1) sum_{d>=1} BCE(lambda_d, 1 - w_d) (Eqs. 9-10)."""
    B, T = tokens.shape
    D, E = c.max_depth, c.num_experts
    pn, kl, rir, ps, decisions, counts = 0.0, 0.0, 0.0, [], [], torch.zeros(E, dtype=F64)
    q = prior_q(c, D)
    for b in range(B):
        n = T if lengths is None else int(lengths[b])
        valid = ((targets[b] != -1) & (torch.arange(T) < n)).double()
        record = alter_sequence(sd, c, tokens[b], n - 1, D)
        ce = [decode_ce(sd, c, r["x"], targets[b], valid)[0] for r in record]
        p = halting_p([r["lam"] for r in record])
        ps.append(p)
        pn = pn + sum(p[d] * ce[d] for d in range(D))
        kl = kl + sum(p[d] * torch.log(p[d] / q[d]) for d in range(D) if p[d] > 0)
        terms = [torch.tensor(0.0, dtype=F64)]
        for d in range(1, D if c.halting else 1):
            w = sigmoid(50 * (torch.clamp(ce[d - 1].detach() - ce[d].detach(), min=0) - 0.005))
            target, lam = 1 - w, record[d]["lam_rir"]
            terms.append(-(target * torch.log(lam) + (1 - target) * torch.log(1 - lam)))
        rir = rir + sum(terms) / (D - 1)  # (the halt heads' own lambda, also at d = D - 1)
        for r in record:
            decisions.append(r["logits"])
            counts[r["chosen"]] += 1
    logits = torch.stack(decisions)
    # Strictly inside the clamp (a clamped logit would sit at +-c): the losses then do not depend on
    # whether L_z reads the logits before or after the clamp.
    assert c.logit_clamp is None or logits.abs().max() < c.logit_clamp
    f, P = counts / len(logits), softmax(logits).mean(0)
    aux = {"balance": c.balance_weight * E * (f * P).sum(), "z": c.z_loss_weight * (logsumexp(logits) ** 2).mean()}
    if c.halting:  # Model I (halting off) has p = one-hot on iteration D: no KL, no L_RIR
        aux.update(kl=c.kl_weight * kl_scale * kl / B, rir=c.rir_weight * rir / B)
    task = pn / B
    return dict(task_loss=task, aux_losses=aux, loss=task + sum(aux.values()), halting_distribution=torch.stack(ps))


def alter_batch(model, seed=0, B=3, T=7):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.config.vocab_size, (B, T), generator=g)
    targets = torch.randint(0, model.config.vocab_size, (B, T), generator=g)
    targets[0, 2] = -1
    return tokens, targets


def assert_gradients(model, leaves):
    """Every parameter's gradient equals the reference's; a parameter the reference does not reach
    (an expert no sequence chose, a term's detached inputs) gets none or zero."""
    reached = 0
    for name, p in model.named_parameters():
        ref = leaves[name].grad
        if ref is None or not ref.abs().max() > 0:
            assert p.grad is None or not p.grad.abs().max() > 1e-7, name
            continue
        assert p.grad is not None, name
        close(p.grad, ref, rtol=2e-3, atol=2e-5 * max(1.0, float(ref.abs().max())))
        reached += 1
    assert reached > 0


# --- Eqs. 1-5 at inference ---

def test_depth_encoding_is_vaswanis_sinusoid_of_t_and_of_one_minus_t():
    for t in (0.0, 1 / 3, 1.0, 1.5):
        close(alternet.depth_encoding(t, 6), sinusoid(t, 6), atol=1e-6)


@pytest.mark.parametrize("overrides", [{}, dict(budget_signal=False), dict(num_experts=4, top_k=1)])
def test_alternet_forward_is_eqs_1_to_5_per_sequence(overrides):
    model = alter_model(1, **overrides).eval()
    c, sd = model.config, float64_state(model)
    tokens, _ = alter_batch(model, 1)
    lengths = torch.tensor([7, 4, 1])
    with torch.no_grad():
        out = model(tokens, lengths=lengths)
    chosen_sets, lambdas = set(), []
    for b in range(3):
        record = alter_sequence(sd, c, tokens[b], int(lengths[b]) - 1, c.max_depth)
        p = halting_p([r["lam"] for r in record])
        close(out["halting_distribution"][b], p, rtol=1e-4, atol=1e-6)
        close(out["logits"][b, :int(lengths[b])],
              decode_ce(sd, c, record[-1]["x"], tokens[b], torch.ones(7))[1][:int(lengths[b])], rtol=1e-4, atol=1e-4)
        chosen_sets.update(tuple(sorted(r["chosen"])) for r in record)
        lambdas.extend(float(r["lam"]) for r in record)
    assert len(chosen_sets) > 1  # sequences and iterations take different experts
    assert max(lambdas) - min(lambdas) > 0.3  # halting differs across sequences and iterations


def test_halt_threshold_stops_when_the_cumulative_halting_probability_passes_it():
    """§3 at inference: a sequence stops after the first iteration d with sum_{i<=d} p_i =
    1 - prod_{i<=d} (1 - lambda_i) >= threshold (not lambda_d >= threshold: the test checks both differ)."""
    model = alter_model(4).eval()  # lambdas between 0.1 and 0.5: the two rules differ
    c, sd = model.config, float64_state(model)
    tokens, _ = alter_batch(model, 4, B=6)
    records = [alter_sequence(sd, c, tokens[b], tokens.shape[1] - 1, c.max_depth) for b in range(6)]
    differs = False
    for threshold in (0.25, 0.4, 0.55, 0.7, 0.85):
        with torch.no_grad():
            out = model(tokens, halt_threshold=threshold)
        for b, record in enumerate(records):
            halted, stop = 0.0, c.max_depth
            for d, r in enumerate(record):
                halted = halted + (1 - halted) * r["lam"]
                if halted >= threshold:
                    stop = d + 1
                    break
            assert int(out["iterations"][b]) == stop
            close(out["logits"][b], decode_ce(sd, c, record[stop - 1]["x"], tokens[b], torch.ones(7))[1], atol=1e-4)
            by_lambda = next((d + 1 for d, r in enumerate(record) if r["lam"] >= threshold), c.max_depth)
            differs |= by_lambda != stop
    assert differs


def test_router_logits_are_clamped_before_top_k_and_the_gates():
    model = alter_model(3, logit_clamp=0.5).eval()
    with torch.no_grad():
        model.router.weight.mul_(20)  # logits far beyond the clamp: every gate from clamped logits
    c, sd = model.config, float64_state(model)
    tokens, _ = alter_batch(model, 3)
    with torch.no_grad():
        out = model(tokens)
    for b in range(3):
        record = alter_sequence(sd, c, tokens[b], tokens.shape[1] - 1, c.max_depth)
        close(out["halting_distribution"][b], halting_p([r["lam"] for r in record]), rtol=1e-4, atol=1e-6)


# --- Eqs. 6-10: the training loss by value and by gradient ---

@pytest.mark.parametrize("overrides", [{}, dict(prior="geometric", geometric_p=0.3, kl_weight=0.7),
                                       dict(rir_weight=1.5, balance_weight=0.4, z_loss_weight=0.05),
                                       dict(halt_head="global"), dict(halting=False)])
def test_alternet_training_loss_is_eqs_6_to_10_by_value_and_gradient(overrides):
    model = alter_model(4, **overrides).train()
    c = model.config
    tokens, targets = alter_batch(model, 4)
    lengths = torch.tensor([7, 5, 3])
    out = model(tokens, targets, lengths=lengths)
    leaves = {k: v.clone().requires_grad_() for k, v in float64_state(model).items()}
    expected = reference_alternet(leaves, c, tokens, targets, lengths)
    close(out["loss"], expected["loss"], rtol=1e-4, atol=1e-6)
    close(out["task_loss"], expected["task_loss"], rtol=1e-4, atol=1e-6)
    assert set(out["aux_losses"]) == set(expected["aux_losses"])
    for name, value in expected["aux_losses"].items():
        close(out["aux_losses"][name], value, rtol=1e-4, atol=1e-7)
    close(out["halting_distribution"], expected["halting_distribution"], rtol=1e-4, atol=1e-6)
    out["loss"].backward()
    expected["loss"].backward()
    assert_gradients(model, leaves)


@pytest.mark.parametrize("halt_head", ["per_expert", "global"])
def test_each_alternet_loss_term_has_its_own_gradient(halt_head):
    """Per term, so that a weight or a detach on one term cannot hide behind the others."""
    model = alter_model(5, rir_weight=1.0, balance_weight=0.5, z_loss_weight=0.1, kl_weight=0.8,
                        halt_head=halt_head).train()
    tokens, targets = alter_batch(model, 5)
    for term in ("task_loss", "kl", "balance", "z", "rir"):
        model.zero_grad()
        out = model(tokens, targets)
        (out[term] if term == "task_loss" else out["aux_losses"][term]).backward()
        leaves = {k: v.clone().requires_grad_() for k, v in float64_state(model).items()}
        expected = reference_alternet(leaves, model.config, tokens, targets)
        (expected[term] if term == "task_loss" else expected["aux_losses"][term]).backward()
        assert_gradients(model, leaves)
        if term == "rir":  # the halt heads only (Eq. 9's target and inputs are detached)
            assert all(p.grad is None or not p.grad.abs().max() > 0
                       for name, p in model.named_parameters() if "halt_head" not in name)


def test_curriculum_forces_the_last_iteration_and_the_kl_ramp_starts_at_its_end():
    """§4: for the first min_depth_warmup steps all halting mass sits on iteration D; then a_KL rises
    linearly from 0 to 1 over kl_ramp_steps (Table 2)."""
    model = alter_model(6, min_depth_warmup=10, kl_ramp_steps=20, kl_weight=0.5).train()
    c, sd = model.config, float64_state(model)
    tokens, targets = alter_batch(model, 6)
    model.set_step(3)
    out = model(tokens, targets)
    close(out["halting_distribution"], torch.tensor([[0.0, 0.0, 0.0, 1.0]] * 3))
    close(out["aux_losses"]["kl"], 0.0)
    for step, scale in ((10, 0.0), (15, 0.25), (30, 1.0), (100, 1.0)):
        model.set_step(step)
        out = model(tokens, targets)
        expected = reference_alternet(sd, c, tokens, targets, kl_scale=scale)
        close(out["aux_losses"]["kl"], expected["aux_losses"]["kl"], rtol=1e-4, atol=1e-8)
        close(out["halting_distribution"], expected["halting_distribution"], rtol=1e-4, atol=1e-6)
