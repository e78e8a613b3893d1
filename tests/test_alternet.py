"""Tests for alternet.py: the vectorised model against slow Python-loop references.

Tiny widths throughout so the whole file runs in well under a minute on 2 CPU cores.
"""
import dataclasses
import math
import re

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import alternet

SMALL = dict(vocab_size=50, seq_len=16, dim=32, heads=2, ffn_dim=64, num_experts=4, top_k=2, max_depth=4, depth_dim=8)


def small_model(seed=0, **overrides):
    torch.manual_seed(seed)
    return alternet.create_model("alternet-tiny", **{**SMALL, **overrides})


def spread_halting(model, seed=1, halting=True, router_scale=20.0):
    """Larger random router (state columns) and halt heads, so that sequences take different
    experts and halt at different steps (at init all of them look alike)."""
    g = torch.Generator().manual_seed(seed)
    heads = [e.halt_head for e in model.experts if e.halt_head is not None] + [model.halt_head]
    with torch.no_grad():
        H = model.config.dim
        model.router.weight[:, :H] = torch.randn(model.router.weight[:, :H].shape, generator=g) * router_scale
        for head in filter(None, heads if halting else []):
            head.weight.copy_(torch.randn(head.weight.shape, generator=g) * 100)
            head.bias.zero_()
    return model


def tokens_for(model, B=3, T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (B, T), generator=g)


# --- slow references ------------------------------------------------------------


def depth_prior(num_steps, max_depth, kind="gaussian", geometric_p=0.12):
    """The prior q itself (the model keeps log q): (num_steps,), far-tail entries may round to 0."""
    return alternet.log_depth_prior(num_steps, max_depth, kind, geometric_p).exp()


def loop_halting_distribution(lambdas):
    """Eq. 4-5 with Python loops: lambdas (B, D) nested lists."""
    out = []
    for row in lambdas:
        p, unhalted = [], 1.0
        for d, lam in enumerate(row):
            lam = 1.0 if d == len(row) - 1 else lam
            p.append(unhalted * lam)
            unhalted *= 1 - lam
        out.append(p)
    return out


def loop_depth_encoding(t, dim):
    enc = []
    for i in range(dim // 2):
        freq = 10000 ** (-2 * i / dim)
        enc += [math.sin(t * freq), math.cos(t * freq)]
    return torch.tensor(enc)


def loop_expert_update(expert, x):
    """One pre-norm block with attention written out; returns block(x) - x. x: (T, H)."""
    T, H = x.shape
    heads = expert.attn.heads
    hd = H // heads
    q, k, v = expert.attn.qkv(expert.norm1(x)).split(H, dim=-1)
    attn_out = torch.zeros(T, H)
    for h in range(heads):
        sl = slice(h * hd, (h + 1) * hd)
        for i in range(T):
            scores = torch.stack([q[i, sl] @ k[j, sl] / math.sqrt(hd) for j in range(i + 1)])  # causal: j <= i
            weights = scores.softmax(0)
            attn_out[i, sl] = sum(weights[j] * v[j, sl] for j in range(i + 1))
    h_state = x + expert.attn.proj(attn_out)
    out = h_state + expert.ffn.fc2(F.gelu(expert.ffn.fc1(expert.norm2(h_state))))
    return out - x


@torch.no_grad()
def reference_forward(model, tokens, lengths=None, max_depth=None):
    """Per sequence, per step, per selected expert; no batching, no grouping."""
    cfg = model.config
    steps = max_depth or cfg.max_depth
    B, T = tokens.shape
    result = dict(step_logits=[], router_logits=[], lambdas=[], states=[])
    for b in range(B):
        last = (lengths[b].item() if lengths is not None else T) - 1
        x = model.tok_emb.weight[tokens[b]] + model.pos_emb.weight[:T]
        seq = dict(step_logits=[], router_logits=[], lambdas=[], states=[x])
        for d in range(steps):
            t = d / (cfg.max_depth - 1) if cfg.max_depth > 1 else 0.0
            enc = [loop_depth_encoding(t, cfg.depth_dim)]
            if cfg.budget_signal:
                enc.append(loop_depth_encoding(1 - t, cfg.depth_dim))
            logits = model.router.weight @ torch.cat([x[last], *enc])
            if cfg.logit_clamp is not None:
                logits = logits.clamp(-cfg.logit_clamp, cfg.logit_clamp)
            chosen = sorted(range(cfg.num_experts), key=lambda e: -logits[e].item())[: cfg.top_k]
            norm = sum(math.exp(logits[e].item()) for e in chosen)
            update, lam = torch.zeros_like(x), 0.0
            for e in chosen:
                gate = math.exp(logits[e].item()) / norm
                y = loop_expert_update(model.experts[e], x)
                update = update + gate * y
                if cfg.halting and cfg.halt_head == "per_expert":
                    lam += gate * torch.sigmoid(model.experts[e].halt_head(y[last])).item()
            x = x + update
            if cfg.halting and cfg.halt_head == "global":
                lam = torch.sigmoid(model.halt_head(x[last])).item()
            seq["states"].append(x)
            seq["step_logits"].append(model.norm(x) @ model.tok_emb.weight.T)
            seq["router_logits"].append(logits)
            seq["lambdas"].append(lam)
        for key in result:
            result[key].append(seq[key])
    result["p"] = torch.tensor(loop_halting_distribution(result["lambdas"]))
    return result


# --- halting distribution, prior, KL ------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 3), D=st.integers(1, 9), k=st.integers(1, 3), scale=st.floats(0.1, 20.0),
       seed=st.integers(0, 10_000))
def test_halting_distribution_matches_loop_and_sums_to_one(B, D, k, scale, seed):
    g = torch.Generator().manual_seed(seed)
    log_gates = torch.randn(B, D, k, generator=g, dtype=torch.float64).log_softmax(-1)
    halt_logits = torch.randn(B, D, k, generator=g, dtype=torch.float64) * scale
    log_halt, log_continue = alternet.halting_log_probabilities(log_gates, halt_logits)  # (B, D) each
    loop_lambdas = [[sum(math.exp(log_gates[b, d, j].item()) / (1 + math.exp(-halt_logits[b, d, j].item()))
                         for j in range(k)) for d in range(D)] for b in range(B)]
    loop_lambdas = torch.tensor(loop_lambdas, dtype=torch.float64)
    torch.testing.assert_close(log_halt.exp(), loop_lambdas)
    torch.testing.assert_close(log_continue.exp(), 1 - loop_lambdas)
    p = alternet.halting_log_distribution(log_halt, log_continue).exp()
    assert p.shape == (B, D)
    assert (p >= 0).all()
    torch.testing.assert_close(p.sum(1), torch.ones(B, dtype=torch.float64))
    loop_p = torch.tensor(loop_halting_distribution(loop_lambdas.tolist()), dtype=torch.float64)
    torch.testing.assert_close(p, loop_p)


@pytest.mark.parametrize("D", [1, 2, 5, 8, 12, 24])
def test_depth_priors_are_normalised_over_the_iterations(D):
    q = depth_prior(D, D, "gaussian")
    assert q.shape == (D,) and (q > 0).all()
    torch.testing.assert_close(q.sum(), torch.tensor(1.0))
    density = torch.tensor([math.exp(-0.5 * ((n - D / 2) / (D / 4)) ** 2) for n in range(1, D + 1)])
    torch.testing.assert_close(q, density / density.sum())
    geo = depth_prior(D, D, "geometric", geometric_p=0.12)
    torch.testing.assert_close(geo.sum(), torch.tensor(1.0))
    torch.testing.assert_close(geo[1:] / geo[:-1], torch.full((D - 1,), 0.88))
    capped = depth_prior(3, D, "gaussian") if D >= 3 else None  # inference cap: truncate, renormalise
    if capped is not None:
        torch.testing.assert_close(capped, q[:3] / q[:3].sum())


def test_gaussian_prior_mean_is_half_the_iterations():
    """Paper §4: converging to the prior "saves ≈ 50% of iterations" -> mean D/2 iterations
    (up to the truncation to 1..D); Table 2's mu = 6 at D = 12."""
    for D, expected in [(12, 6.1134), (6, 3.1141), (24, 12.1134)]:
        q = depth_prior(D, D, "gaussian").double()
        iterations = torch.arange(1, D + 1, dtype=torch.float64)
        mean = (q * iterations).sum().item()
        assert abs(mean - expected) < 1e-3 and abs(mean / D - 0.5) < 0.02


@settings(max_examples=30, deadline=None)
@given(D=st.integers(1, 10), B=st.integers(1, 3), seed=st.integers(0, 10_000),
       kind=st.sampled_from(["gaussian", "geometric"]))
def test_kl_is_zero_at_the_prior_and_positive_elsewhere(D, B, seed, kind):
    q = depth_prior(D, D, kind).double()
    assert alternet.kl_divergence(q.log().expand(B, D), q.log()).abs() < 1e-12
    g = torch.Generator().manual_seed(seed)
    p = (torch.randn(B, D, generator=g, dtype=torch.float64) * 2).softmax(-1)
    loop = sum(sum(p[b, d] * math.log(p[b, d] / q[d]) for d in range(D)) for b in range(B)) / B
    kl = alternet.kl_divergence(p.log(), q.log())
    torch.testing.assert_close(kl, torch.as_tensor(loop, dtype=torch.float64))
    if D > 1 and (p - q).abs().max() > 1e-6:
        assert kl > 0
    one_hot = torch.zeros(1, D, dtype=torch.float64)
    one_hot[0, -1] = 1  # zeros in p contribute 0 log 0 = 0
    torch.testing.assert_close(alternet.kl_divergence(one_hot.log(), q.log()), -q[-1].log())


def reference_kl_float64(log_halt, log_continue, log_q):
    """KL(p || q) with Python floats, from the halt heads' log-probabilities; 0 log 0 = 0."""
    total = 0.0
    for row_halt, row_continue in zip(log_halt.tolist(), log_continue.tolist()):
        log_unhalted = 0.0
        for d, (lh, lc) in enumerate(zip(row_halt, row_continue)):
            log_p = log_unhalted + (0.0 if d == len(row_halt) - 1 else lh)
            if log_p > -math.inf and math.exp(log_p) > 0:
                total += math.exp(log_p) * (log_p - log_q[d].item())
            log_unhalted += lc
    return total / len(log_halt)


@settings(max_examples=40, deadline=None)
@given(D=st.integers(2, 12), B=st.integers(1, 3), k=st.integers(1, 3), bias=st.floats(8.0, 60.0),
       sign=st.sampled_from([1.0, -1.0]), seed=st.integers(0, 10_000))
def test_kl_is_finite_and_exact_with_saturated_halt_heads(D, B, k, bias, sign, seed):
    """Halt logits far past sigmoid's float32 range: lambda rounds to 1 (or to 0) and some p_d
    are exactly 0. The KL and every gradient stay finite, and equal a float64 reference."""
    g = torch.Generator().manual_seed(seed)
    log_gates = torch.randn(B, D, k, generator=g).log_softmax(-1).requires_grad_()
    halt_logits = (sign * bias + torch.randn(B, D, k, generator=g)).requires_grad_()
    log_halt, log_continue = alternet.halting_log_probabilities(log_gates, halt_logits)
    log_p = alternet.halting_log_distribution(log_halt, log_continue)
    log_q = depth_prior(D, D, "gaussian").log()
    kl = alternet.kl_divergence(log_p, log_q)
    task = (log_p.exp() * torch.arange(D, dtype=torch.float32)).sum()  # a p-weighted loss like L_PN
    (kl + task).backward()
    assert torch.isfinite(kl) and torch.isfinite(log_gates.grad).all() and torch.isfinite(halt_logits.grad).all()
    expected = reference_kl_float64(log_halt.double(), log_continue.double(), log_q.double())
    assert abs(kl.item() - expected) <= 1e-4 * max(1.0, abs(expected))


def test_saturated_halt_heads_give_finite_gradients_everywhere():
    """The reported case: halt-head biases at 12, D = 12. Before the log-space KL the loss was
    finite but 31 parameter tensors got NaN gradients (torch.xlogy(p, p) at p = 0)."""
    model = small_model(max_depth=12)
    with torch.no_grad():
        for expert in model.experts:
            expert.halt_head.bias.fill_(12.0)
    tokens = tokens_for(model, B=3, T=10)
    out = model(tokens, targets=torch.roll(tokens, -1, 1))
    assert (out["halting_distribution"] == 0).any(), "the case needs some p_d exactly 0"
    out["loss"].backward()
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    assert bad == []
    p = out["halting_distribution"]
    # the probability-space formula of the old code, for contrast: its gradient is NaN here
    p_leaf = p.detach().requires_grad_()
    torch.xlogy(p_leaf, p_leaf).sum().backward()
    assert torch.isnan(p_leaf.grad).any()


# --- router: gates, z-loss, load balance -------------------------------------------


def test_topk_gates_and_router_losses_equal_direct_formulas():
    model = small_model(num_experts=5, top_k=3)
    with torch.no_grad():
        model.router.weight.mul_(200)  # spread the logits, some past the clamp
    out = model(tokens_for(model, B=4), return_states=True)
    logits, idx, gates = out["router_logits"], out["expert_indices"], out["gates"]  # (D, B, E), (D, B, k)
    assert logits.abs().max() <= 10 + 1e-6 and logits.abs().max() > 9
    cfg = model.config
    raw = torch.stack([torch.stack([model.router.weight @ torch.cat([state[b, -1], *(
        loop_depth_encoding(t, cfg.depth_dim) for t in (d / (cfg.max_depth - 1), 1 - d / (cfg.max_depth - 1)))])
        for b in range(4)]) for d, state in enumerate(out["states"][:-1])])  # (D, B, E) before the clamp
    assert raw.abs().max() > 11
    torch.testing.assert_close(logits, raw.clamp(-10, 10), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gates.sum(-1), torch.ones(gates.shape[:2]))
    D, B, E = logits.shape
    decisions = [(d, b) for d in range(D) for b in range(B)]
    z = 0.0
    counts, probs = [0.0] * E, [0.0] * E
    for d, b in decisions:
        row = logits[d, b].tolist()
        chosen = sorted(range(E), key=lambda e: -row[e])[:3]
        assert set(chosen) == set(idx[d, b].tolist())
        norm = sum(math.exp(row[e]) for e in chosen)
        for j, e in enumerate(idx[d, b].tolist()):
            assert abs(gates[d, b, j].item() - math.exp(row[e]) / norm) < 1e-5
        total = sum(math.exp(v) for v in row)
        z += math.log(sum(math.exp(v) for v in raw[d, b].tolist())) ** 2  # z-loss: before the clamp
        for e in range(E):
            counts[e] += e in chosen
            probs[e] += math.exp(row[e]) / total
    z /= len(decisions)
    lb_counts = E * sum(counts[e] / len(decisions) * probs[e] / len(decisions) for e in range(E))
    assert abs(out["aux_losses"]["z"].item() - cfg.z_loss_weight * z) < 1e-5 * cfg.z_loss_weight * z
    assert abs(out["aux_losses"]["balance"].item() - cfg.balance_weight * lb_counts) < 1e-6


def test_logit_clamp_switch():
    model = small_model(logit_clamp=None)
    with torch.no_grad():
        model.router.weight.mul_(500)
    assert model(tokens_for(model))["router_logits"].abs().max() > 10


# --- the whole forward against the loop reference -------------------------------------


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(halt_head="global", budget_signal=False, logit_clamp=None),
    dict(num_experts=3, top_k=1, max_depth=3),
    dict(halting=False),
])
def test_forward_matches_loop_reference(overrides):
    model = spread_halting(small_model(**overrides))
    tokens = tokens_for(model, B=3, T=7)
    lengths = torch.tensor([7, 4, 1])
    out = model(tokens, lengths=lengths, return_states=True)
    ref = reference_forward(model, tokens, lengths)
    D = model.config.max_depth
    for b, L in enumerate(lengths.tolist()):
        for d in range(D):
            torch.testing.assert_close(out["states"][d + 1][b, :L], ref["states"][b][d + 1][:L], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(out["step_logits"][d, b, :L], ref["step_logits"][b][d][:L], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(out["router_logits"][d, b], ref["router_logits"][b][d], atol=1e-5, rtol=1e-4)
    if model.config.halting:
        torch.testing.assert_close(out["halting_distribution"], ref["p"].float(), atol=1e-5, rtol=1e-4)
    else:
        assert (out["halting_distribution"][:, -1] == 1).all() and (out["halting_distribution"][:, :-1] == 0).all()
    assert (out["iterations"] == D).all()
    torch.testing.assert_close(out["logits"], out["step_logits"][-1])


def test_depth_encodings_never_enter_the_residual_stream(monkeypatch):
    model = small_model()
    tokens = tokens_for(model)
    out = model(tokens, return_states=True)
    torch.testing.assert_close(out["states"][0], model.tok_emb(tokens) + model.pos_emb.weight[: tokens.shape[1]])
    # with the router blind to the encodings, replacing them by noise changes nothing anywhere
    with torch.no_grad():
        model.router.weight[:, model.config.dim:] = 0
    clean = model(tokens, return_states=True)
    monkeypatch.setattr(alternet, "depth_encoding", lambda t, dim: torch.randn(dim) * 100)
    noisy = model(tokens, return_states=True)
    for a, b in zip(clean["states"], noisy["states"]):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(clean["halting_distribution"], noisy["halting_distribution"])
    # and the encodings do reach the router when it looks at them
    with torch.no_grad():
        model.router.weight[:, model.config.dim:] = 1.0
    assert not torch.allclose(model(tokens)["router_logits"], noisy["router_logits"])


def test_router_reads_the_last_valid_token_with_right_padding():
    model = spread_halting(small_model())
    model.eval()
    lengths = torch.tensor([9, 3, 6])
    tokens = tokens_for(model, B=3, T=9)
    padded = model(tokens, lengths=lengths, halt_threshold=0.5)
    assert padded["iterations"].unique().numel() > 1, "test needs sequences that halt at different depths"
    for b, L in enumerate(lengths.tolist()):
        alone = model(tokens[b : b + 1, :L], halt_threshold=0.5)
        assert padded["iterations"][b] == alone["iterations"][0]
        n = alone["iterations"][0].item()
        torch.testing.assert_close(padded["router_logits"][:n, b], alone["router_logits"][:n, 0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(padded["logits"][b, :L], alone["logits"][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(padded["halting_distribution"][b, :n], alone["halting_distribution"][0, :n])
    # the padding content is irrelevant
    garbage = tokens.clone()
    garbage[1, 3:] = (garbage[1, 3:] + 7) % model.config.vocab_size
    again = model(garbage, lengths=lengths, halt_threshold=0.5)
    torch.testing.assert_close(again["logits"][1, :3], padded["logits"][1, :3])
    # the last-token fast path reads the same position
    fast = model(tokens, lengths=lengths, halt_threshold=0.5, last_token_only=True)
    torch.testing.assert_close(fast["logits"][:, 0], padded["logits"][torch.arange(3), lengths - 1])


def test_padding_is_ignored_by_the_loss():
    model = small_model()
    tokens = tokens_for(model, B=2, T=8)
    lengths = torch.tensor([8, 5])
    targets = torch.roll(tokens, -1, 1)
    a = model(tokens, targets=targets, lengths=lengths)
    masked = targets.clone()
    masked[1, 5:] = -1
    b = model(tokens, targets=masked)  # same positions ignored through -1 instead
    assert torch.isclose(a["step_losses"], model(tokens, targets=masked, lengths=lengths)["step_losses"]).all()
    assert not torch.isclose(a["task_loss"], b["task_loss"])  # b routes on the padding: different model path
    changed = targets.clone()
    changed[1, 5:] = 0
    torch.testing.assert_close(model(tokens, targets=changed, lengths=lengths)["loss"], a["loss"])


# --- losses ----------------------------------------------------------------------------


def test_task_loss_is_p_weighted_step_cross_entropy():
    model = spread_halting(small_model(rir_weight=0.3))
    tokens = tokens_for(model, B=3, T=6)
    targets = torch.roll(tokens, -1, 1)
    targets[0, :4] = -1  # ignored: sequence 0 averages over its 2 valid targets
    out = model(tokens, targets=targets)
    step_logits = model(tokens)["step_logits"]  # same path: targets only add the losses
    p, D = out["halting_distribution"], model.config.max_depth
    ce = torch.stack([torch.stack([F.cross_entropy(step_logits[d, b], targets[b], ignore_index=-1)
                                   for d in range(D)]) for b in range(3)])  # (B, D) per-sequence mean CE
    torch.testing.assert_close(out["task_loss"], (p * ce).sum(1).mean())
    token_mean = [F.cross_entropy(step_logits[d].flatten(0, 1), targets.flatten(), ignore_index=-1)
                  for d in range(D)]
    torch.testing.assert_close(out["step_losses"], torch.stack(token_mean).detach())
    # L_RIR, Eq. 9-10, with loops
    rir = 0.0
    for b in range(3):
        for d in range(1, D):
            w = 1 / (1 + math.exp(-50 * (max(ce[b, d - 1].item() - ce[b, d].item(), 0) - 0.005)))
            lam = out["halt_lambdas"][b, d].item()
            rir -= ((1 - w) * math.log(lam) + w * math.log(1 - lam)) / (D - 1)
    assert abs(out["aux_losses"]["rir"].item() - 0.3 * rir / 3) < 1e-5
    prior = depth_prior(D, D, "gaussian")
    kl = alternet.kl_divergence(p.log(), prior.log())
    torch.testing.assert_close(out["aux_losses"]["kl"], model.config.kl_weight * kl)
    torch.testing.assert_close(out["loss"], out["task_loss"] + sum(out["aux_losses"].values()))


@pytest.mark.parametrize("halt_head", ["per_expert", "global"])
def test_rir_loss_changes_only_halt_head_gradients(halt_head):
    grads = {}
    for weight in (0.0, 5.0):
        model = spread_halting(small_model(halt_head=halt_head, rir_weight=weight))
        tokens = tokens_for(model, B=4, T=8)
        out = model(tokens, targets=torch.roll(tokens, -1, 1))
        assert out["aux_losses"]["rir"].item() > 0 or weight == 0
        model.zero_grad()
        out["loss"].backward()
        grads[weight] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads[0.0].keys() == grads[5.0].keys()
    halt_names = [n for n in grads[0.0] if "halt_head" in n]
    assert halt_names
    for name in grads[0.0]:
        if "halt_head" in name:
            continue
        torch.testing.assert_close(grads[0.0][name], grads[5.0][name], msg=name)
    assert any(not torch.allclose(grads[0.0][n], grads[5.0][n]) for n in halt_names)


@pytest.mark.parametrize("overrides", [dict(), dict(halt_head="global"), dict(halting=False)])
def test_every_parameter_gets_a_gradient(overrides):
    model = spread_halting(small_model(**overrides, num_experts=3), halting=False)
    tokens = tokens_for(model, B=8, T=8)
    out = model(tokens, targets=torch.roll(tokens, -1, 1))
    assert out["expert_indices"].unique().numel() == 3, "every expert should be routed to"
    out["loss"].backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    if not model.config.halting:
        assert not any("halt" in n for n, _ in model.named_parameters())


def test_fixed_depth_model_one():
    model = small_model(halting=False)
    tokens = tokens_for(model)
    targets = torch.roll(tokens, -1, 1)
    out = model(tokens, targets=targets, max_depth=3)
    assert out["aux_losses"].keys() == {"balance", "z"}
    assert (out["iterations"] == 3).all() and out["token_losses"].shape == (3, *tokens.shape)
    last_ce = F.cross_entropy(model(tokens, max_depth=3)["step_logits"][-1].flatten(0, 1), targets.flatten())
    torch.testing.assert_close(out["task_loss"], last_ce)
    model.eval()
    for call in (lambda **kw: model(tokens, **kw), lambda **kw: model.generate(tokens, 0, **kw)):
        for halting in (dict(halt_threshold=0.5), dict(sample_halting=True)):  # forward and generate: one rule
            with pytest.raises(ValueError, match="halting=False"):
                call(**halting)
    assert model.generate(tokens, 2).shape == (3, 14)


# --- curriculum, a_KL ramp ---------------------------------------------------------------


def test_curriculum_forces_full_depth_then_releases():
    model = spread_halting(small_model(min_depth_warmup=10, kl_ramp_steps=100, kl_weight=1.0))
    tokens = tokens_for(model)
    targets = torch.roll(tokens, -1, 1)
    D = model.config.max_depth
    model.train()
    model.set_step(0)
    out = model(tokens, targets=targets, halt_threshold=0.5)  # the curriculum overrides early exit
    assert (out["iterations"] == D).all()
    torch.testing.assert_close(out["halting_distribution"], F.one_hot(torch.full((3,), D - 1), D).float())
    torch.testing.assert_close(out["task_loss"], out["step_losses"][-1])
    assert out["aux_losses"]["kl"] == 0
    assert out["aux_losses"]["rir"] > 0  # the halt heads keep learning
    model.set_step(9)
    assert model(tokens)["halting_distribution"][:, -1].eq(1).all()
    model.set_step(10)  # released at once (the paper's abrupt release)
    released = model(tokens)
    assert (released["halting_distribution"][:, :-1] > 0).all()
    model.eval()
    model.set_step(0)  # no curriculum at evaluation
    assert (model(tokens)["halting_distribution"][:, :-1] > 0).all()


def test_kl_ramp_starts_when_the_curriculum_ends():
    """Table 2 lists "a_KL warmup steps" and "Min-depth warmup" separately: a_KL is 0 through the
    curriculum and at its end, then rises linearly over kl_ramp_steps."""
    model = spread_halting(small_model(min_depth_warmup=10, kl_ramp_steps=100, kl_weight=1.0)).train()
    tokens = tokens_for(model)
    D = model.config.max_depth
    prior = depth_prior(D, D, "gaussian").log()
    for step, scale in [(0, 0.0), (9, 0.0), (10, 0.0), (60, 0.5), (110, 1.0), (500, 1.0)]:
        model.set_step(step)
        assert model.kl_scale == scale
        out = model(tokens)
        expected = scale * alternet.kl_divergence(out["halting_distribution"].log(), prior)
        torch.testing.assert_close(out["aux_losses"]["kl"], expected)
    model.set_step(10)
    assert (model(tokens)["halting_distribution"][:, :-1] > 0).all(), "released, but a_KL still 0"
    no_curriculum = small_model(min_depth_warmup=0, kl_ramp_steps=100)
    no_curriculum.set_step(50)
    assert no_curriculum.kl_scale == 0.5  # without a curriculum the ramp starts at step 0
    abrupt = small_model(min_depth_warmup=10, kl_ramp_steps=0)  # no ramp: a_KL = 1 from the release on
    for step, scale in [(9, 0.0), (10, 1.0), (11, 1.0)]:
        abrupt.set_step(step)
        assert abrupt.kl_scale == scale, step


@pytest.mark.parametrize("release", [0, 8])
def test_minimum_depth_release_abrupt_or_gradual(release):
    model = spread_halting(small_model(max_depth=5, min_depth_warmup=10, min_depth_release_steps=release)).train()
    tokens = tokens_for(model, B=6, T=5)
    schedule = []
    for step in range(0, 22):
        model.set_step(step)
        m = model.first_halt(5) + 1  # iterations before a sequence may halt
        schedule.append(m)
        out = model(tokens, halt_threshold=0.01)  # would stop everyone at once without a minimum
        assert (out["iterations"] == m).all()
        p = out["halting_distribution"]
        assert (p[:, : m - 1] == 0).all() and (p[:, m - 1:] > 0).all()
    assert schedule[:11] == [5] * 10 + ([1] if release == 0 else [5])
    if release:  # linear from D to 1 over the release steps, never increasing
        assert schedule[10:19] == [5, 5, 4, 4, 3, 3, 2, 2, 1] and schedule[-1] == 1
    assert model.first_halt(3) == 0 and model.eval().first_halt(5) == 0


# --- inference: threshold, cap, sampling -----------------------------------------------


@pytest.mark.parametrize("threshold", [0.2, 0.5, 0.9])
def test_threshold_and_cap_stop_where_they_should(threshold):
    model = spread_halting(small_model(max_depth=6)).eval()
    tokens = tokens_for(model, B=6, T=5)
    full = model(tokens)  # every sequence runs D steps
    D = model.config.max_depth
    for cap in (D, 3, 1):
        out = model(tokens, max_depth=cap, halt_threshold=threshold)
        for b in range(6):
            cumulative, expected = 0.0, cap
            for d in range(cap):
                cumulative += full["halting_distribution"][b, d].item()
                if cumulative >= threshold:
                    expected = d + 1
                    break
            assert out["iterations"][b].item() == expected
        assert out["step_logits"].shape[0] == out["iterations"].max()
        capped = model(tokens, max_depth=cap)
        assert (capped["iterations"] == cap).all()
        torch.testing.assert_close(capped["halting_distribution"].sum(1), torch.ones(6))
        torch.testing.assert_close(capped["halting_distribution"][:, :-1], full["halting_distribution"][:, : cap - 1])
    assert model(tokens, halt_threshold=threshold)["iterations"].unique().numel() > 1 or threshold != 0.5


def test_early_halt_equals_a_run_capped_at_that_depth():
    model = spread_halting(small_model(max_depth=6)).eval()
    tokens = tokens_for(model, B=6, T=5)
    targets = torch.roll(tokens, -1, 1)
    out = model(tokens, targets=targets, halt_threshold=0.5)
    logits = model(tokens, halt_threshold=0.5)
    assert out["iterations"].unique().numel() > 1
    capped_rir = []
    for b in range(6):
        n = out["iterations"][b].item()
        capped = model(tokens[b : b + 1], targets=targets[b : b + 1], max_depth=n)
        if n > 1:
            capped_rir.append(capped["aux_losses"]["rir"])
        torch.testing.assert_close(logits["logits"][b], model(tokens[b : b + 1], max_depth=n)["logits"][0],
                                   atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(out["token_losses"][-1, b], capped["token_losses"][-1, 0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(out["halting_distribution"][b, :n], capped["halting_distribution"][0])
        assert (out["halting_distribution"][b, n:] == 0).all()
        # halted outputs are frozen: later rows repeat the halted logits and their losses
        for d in range(n, logits["step_logits"].shape[0]):
            assert torch.equal(logits["step_logits"][d, b], logits["step_logits"][n - 1, b])
            assert torch.equal(out["token_losses"][d, b], out["token_losses"][n - 1, b])
        assert (out["expert_indices"][n:, b] == -1).all()
    # L_RIR of an early-halted batch covers only the steps each sequence ran
    torch.testing.assert_close(out["aux_losses"]["rir"], torch.stack(capped_rir).mean())


def test_sampled_halting_uses_the_conditional_lambda():
    model = small_model(max_depth=4).eval()
    with torch.no_grad():
        for e in model.experts:
            e.halt_head.weight.zero_()
            e.halt_head.bias.zero_()  # lambda_d = 0.5 at every step
    tokens = tokens_for(model, B=600, T=3)
    torch.manual_seed(0)
    it = model(tokens, sample_halting=True)["iterations"]
    freq = [(it == n).float().mean().item() for n in (1, 2, 3, 4)]
    # halting with lambda: 1/2, 1/4, 1/8, 1/8; with p_d it would be 1/2, 1/8, ...
    for f, expected in zip(freq, (0.5, 0.25, 0.125, 0.125)):
        assert abs(f - expected) < 0.06
    with torch.no_grad():
        for e in model.experts:
            e.halt_head.bias.fill_(30.0)
    assert (model(tokens[:5], sample_halting=True)["iterations"] == 1).all()


# --- causality, determinism, generation ---------------------------------------------------


def test_causality():
    model = small_model()
    tokens = tokens_for(model, B=2, T=10)
    i = 4
    changed = tokens.clone()
    changed[:, i + 1:] = (changed[:, i + 1:] + 3) % model.config.vocab_size
    # routing on a valid-length prefix: everything up to i ignores the tokens after it
    lengths = torch.full((2,), i + 1)
    a, b = model(tokens, lengths=lengths), model(changed, lengths=lengths)
    torch.testing.assert_close(a["step_logits"][:, :, : i + 1], b["step_logits"][:, :, : i + 1])
    # routing on the last token is the only path from later tokens: blind it and position i is causal
    assert not torch.allclose(model(tokens)["logits"][:, : i + 1], model(changed)["logits"][:, : i + 1])
    with torch.no_grad():
        model.router.weight[:, : model.config.dim] = 0
        for e in model.experts:
            e.halt_head.weight.zero_()
    blind, blind_changed = model(tokens), model(changed)
    torch.testing.assert_close(blind["step_logits"][:, :, : i + 1], blind_changed["step_logits"][:, :, : i + 1])


def test_determinism():
    a, b = small_model(seed=3), small_model(seed=3)
    tokens = tokens_for(a)
    torch.testing.assert_close(a(tokens, targets=tokens)["loss"], b(tokens, targets=tokens)["loss"])
    a.eval(), b.eval()
    torch.manual_seed(5)
    ga = a.generate(tokens[:, :4], 6, top_k=5)
    torch.manual_seed(5)
    gb = b.generate(tokens[:, :4], 6, top_k=5)
    assert torch.equal(ga, gb)


def test_a_threshold_the_halted_mass_lands_on_exactly_stops_there():
    """§3: a sequence stops once its halted mass sum_{i<=d} p_i *reaches* the threshold. Every lambda 1/2 (halt
    heads zeroed) gives the mass 1/2, 3/4, 7/8: thresholds of exactly 1/2 and 3/4 stop after 1 and 2
    iterations; 1, the largest allowed, runs to the cap (only the last iteration's forced lambda = 1 reaches it)."""
    model = small_model(max_depth=4).eval()
    with torch.no_grad():
        for head in filter(None, [e.halt_head for e in model.experts] + [model.halt_head]):
            head.weight.zero_()
            head.bias.zero_()
    tokens = tokens_for(model, B=3, T=5)
    for threshold, stop in ((0.5, 1), (0.75, 2), (1.0, 4)):
        assert model(tokens, halt_threshold=threshold)["iterations"].tolist() == [stop] * 3, threshold
    with pytest.raises(ValueError, match=r"halt_threshold must be None or in \(0, 1\]"):
        model(tokens, halt_threshold=1.0000001)


def test_relative_improvement_loss_trains_the_second_halt_head_at_two_iterations():
    """Eq. 9 scores the halt decision of every iteration d >= 1 (iteration 0 has no improvement to judge):
    at D = 2 that is iteration 1's head, so the loss is not zero and reaches lambda_1 only."""
    torch.manual_seed(0)
    logits = torch.randn(4, 2, requires_grad=True)
    loss = alternet.relative_improvement_loss(F.logsigmoid(logits), F.logsigmoid(-logits), torch.rand(4, 2) + 1)
    loss.backward()
    assert loss > 0 and (logits.grad[:, 0] == 0).all() and (logits.grad[:, 1] != 0).all()


@pytest.mark.parametrize("temperature, top_k", [(0.5, None), (2.0, 3), (0.7, 1)])
def test_sampling_draws_from_the_top_k_softmax_at_the_temperature(temperature, top_k):
    """Each next token ~ softmax(logits / temperature) over the top_k largest logits (the k-th kept), counted
    over 40,000 draws of one row; temperature 0 is the argmax."""
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 0.5, 1.5, -1.0, 1.0, 0.0]])
    draws = alternet.sample_next_token(logits.expand(40_000, -1), temperature, top_k)[:, 0]
    counts = torch.bincount(draws, minlength=6).float() / 40_000
    kept = torch.full_like(logits[0], float("-inf"))
    order = logits[0].argsort(descending=True)[: top_k or 6]
    kept[order] = logits[0, order] / temperature
    assert (counts[kept == float("-inf")] == 0).all()
    assert torch.allclose(counts, kept.softmax(-1), atol=0.01)  # the standard error is <= 0.0025
    assert torch.equal(alternet.sample_next_token(logits, 0, top_k), torch.tensor([[0]]))


def test_generate_uses_halting_and_crops_context():
    model = spread_halting(small_model(max_depth=6)).eval()
    prompt = tokens_for(model, B=3, T=20)  # longer than seq_len = 16
    ids, iters = model.generate(prompt, 4, temperature=0, halt_threshold=0.5, return_iterations=True)
    assert ids.shape == (3, 24) and torch.equal(ids[:, :20], prompt) and iters.shape == (3, 4)
    context = ids[:, 20 - 16 + 1 : 20 + 1]  # the window that produced the second new token
    ref = model(context, halt_threshold=0.5)
    torch.testing.assert_close(ids[:, 21], ref["logits"][:, -1].argmax(-1))
    torch.testing.assert_close(iters[:, 1], ref["iterations"])
    _, capped = model.generate(prompt, 2, temperature=0, halt_threshold=0.5, max_depth=2, return_iterations=True)
    assert (capped <= 2).all()


# --- presets and configuration ------------------------------------------------------------


@pytest.mark.parametrize("name, target, exact", [
    ("alternet-50m", 50e6, 51_222_536),
    ("alternet-350m", 350e6, 355_884_298),
])
def test_paper_presets_have_the_paper_sizes(name, target, exact):
    with torch.device("meta"):
        model = alternet.create_model(name)
        fixed = alternet.create_model(name + "-fixed")
    n = model.num_params()
    print(f"{name}: {n:,} parameters")
    assert abs(n - target) / target < 0.05  # the paper: "≈50M", "≈350M"
    assert n == exact  # pins the layout; update deliberately
    cfg = model.config
    assert fixed.num_params() == n - cfg.num_experts * (cfg.dim + 1)  # Model I: same network minus halt heads


def test_all_presets_build_and_run():
    for name in alternet.PRESETS:
        if name.startswith("alternet-tiny"):
            model = alternet.create_model(name)
            out = model(torch.randint(0, 256, (1, 8)))
            assert out["logits"].shape == (1, 8, 256)


def test_initialisation():
    model = small_model(halt_bias_init=-3.0)
    assert all(e.halt_head.bias.item() == -3.0 for e in model.experts)
    assert small_model(halt_head="global").halt_head.bias.item() == -3.0
    assert model.lm_head.weight is model.tok_emb.weight  # tied LM head
    assert small_model(tie_embeddings=False).lm_head.weight is not small_model().tok_emb.weight
    lam = model(tokens_for(model))["halt_lambdas"]
    assert (lam - torch.sigmoid(torch.tensor(-3.0))).abs().max() < 0.02  # starts by (almost) never halting


def test_ablation_switches():
    assert small_model(budget_signal=False).router.in_features == 32 + 8
    assert small_model().router.in_features == 32 + 16
    g = small_model(halt_head="global")
    assert g.halt_head is not None and all(e.halt_head is None for e in g.experts)
    assert small_model(num_experts=6, ffn_dim=16).experts[5].ffn.fc1.out_features == 16
    geo = small_model(prior="geometric", geometric_p=0.3)
    out = geo(tokens_for(geo))
    torch.testing.assert_close(out["aux_losses"]["kl"], 0.1 * alternet.kl_divergence(
        out["halting_distribution"].log(), depth_prior(4, 4, "geometric", 0.3).log()))
    assert small_model(z_loss_weight=0.0)(tokens_for(geo))["aux_losses"]["z"] == 0


# Every rule of the config's contract, each type and each row of alternet.RANGES: (one field's value, what
# the refusal says it allows); the sizes' bounds are tried from alternet.SIZES below.
CONFIG_REFUSALS = [
    (dict(dim=32.0), "an integer"), (dict(dim="32"), "an integer"), (dict(max_depth=True), "an integer"),
    (dict(num_experts=2.5), "an integer"), (dict(kl_ramp_steps=10.0), "an integer"),
    (dict(halting=1), "True or False"), (dict(prior=1), "a string"),
    (dict(kl_weight=float("nan")), "a finite number"), (dict(halt_bias_init=math.inf), "a finite number"),
    (dict(logit_clamp="10"), "a finite number or None"),
    (dict(top_k=5), "in 1..num_experts=4"), (dict(top_k=0), "in 1..num_experts=4"),
    (dict(dim=33), "divisible by heads=2"),
    (dict(depth_dim=7), "even (sin/cos pairs)"),
    (dict(logit_clamp=0.0), "a positive number or None (off)"),
    (dict(logit_clamp=-1.0), "a positive number or None (off)"), (dict(norm_eps=0.0), "a positive number"),
    (dict(halt_head="central"), "one of 'per_expert', 'global'"),
    (dict(prior="uniform"), "one of 'gaussian', 'geometric'"),
    (dict(geometric_p=1.0), "in (0, 1)"), (dict(geometric_p=0), "in (0, 1)"),
    *((dict([(name, -0.5)]), "a finite number >= 0")
      for name in ("kl_weight", "balance_weight", "z_loss_weight", "rir_weight")),
    *((dict([(name, -1)]), "an integer >= 0")
      for name in ("kl_ramp_steps", "min_depth_warmup", "min_depth_release_steps")),
    (dict(random_length_fraction=1.5), "in [0, 1]"), (dict(random_length_fraction=-0.1), "in [0, 1]"),
    *((dict([(name, value)]), f"an integer in 1..{top}")
      for name, top in alternet.SIZES.items() for value in (0, top + 1)),
]


@pytest.mark.parametrize("kwargs, allowed", CONFIG_REFUSALS)
def test_bad_config_raises_one_line_naming_the_field_and_what_it_allows(kwargs, allowed):
    (name, value), = kwargs.items()
    line = f"{name}={value!r} is not allowed: {name} must be {allowed}"
    with pytest.raises(ValueError, match=f"^{re.escape(line)}$"):
        small_model(**kwargs)


def test_every_config_rule_is_tried_and_good_values_pass():
    tried = {name for kwargs, _ in CONFIG_REFUSALS for name in kwargs}
    assert {name for names, _, _ in alternet.RANGES for name in names.split()} <= tried
    assert {f.name for f in dataclasses.fields(alternet.AlterNetConfig)} - tried == {
        "budget_signal", "tie_embeddings"}  # bools, as `halting` is tried
    small_model(logit_clamp=None, kl_weight=1, halt_bias_init=-2, geometric_p=0.5, random_length_fraction=1)
    with pytest.raises(ValueError, match="unknown config field"):
        small_model(nonsense=1)


def test_bad_inputs_raise_value_error():
    with pytest.raises(ValueError, match="alternet-50m"):
        alternet.create_model("alternet-5m")
    model = small_model()
    tokens = tokens_for(model)
    cases = [
        (dict(tokens=torch.zeros(1, 17, dtype=torch.long)), "seq_len=16"),
        (dict(tokens=tokens.float()), "long tensor"),
        (dict(max_depth=0), "max_depth"),
        (dict(halt_threshold=1.5), "halt_threshold"),
        (dict(halt_threshold=0.5, sample_halting=True), "alternatives"),
        (dict(lengths=torch.tensor([0, 1, 2])), "lengths"),
        (dict(lengths=torch.tensor([13, 1, 2])), "lengths"),
        (dict(targets=tokens[:, :3]), "targets"),
    ]
    for kwargs, match in cases:
        kwargs = {"tokens": tokens, **kwargs}
        with pytest.raises(ValueError, match=match):
            model(**kwargs)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(tokens, 1, temperature=-1)


def test_token_ids_are_checked_against_the_vocabulary():
    model = small_model()  # vocab_size 50
    tokens = tokens_for(model)
    for bad, match in [(50, r"^tokens: token ids must be in 0\.\.49 \(vocab_size=50\)$"),
                       (-3, "tokens: token ids must be in 0..49")]:
        wrong = tokens.clone()
        wrong[1, 2] = bad
        with pytest.raises(ValueError, match=match):
            model(wrong)
    targets = torch.roll(tokens, -1, 1)
    targets[0, 0] = -1  # the ignore value is allowed
    model(tokens, targets=targets)
    allowed = r"^targets must be None or a \(B, T\) long tensor of ids in 0\.\.49 or -1 \(ignore\)"
    for bad in (50, -2):
        wrong = targets.clone()
        wrong[2, 3] = bad
        with pytest.raises(ValueError, match=allowed):
            model(tokens, targets=wrong)
    with pytest.raises(ValueError, match=allowed):
        model(tokens, targets=targets.float())


# --- causal evaluation and variable-length training -------------------------------------------


@pytest.mark.parametrize("overrides, threshold, cap", [(dict(), 0.5, None), (dict(halting=False), None, 3)])
def test_causal_loss_equals_a_per_position_loop(overrides, threshold, cap):
    model = spread_halting(small_model(max_depth=5, **overrides)).eval()
    tokens = tokens_for(model, B=3, T=9)
    targets = torch.roll(tokens, -1, 1)
    targets[1, 4] = -1
    result = alternet.causal_loss(model, tokens, targets, max_depth=cap, halt_threshold=threshold, rows_per_call=7)
    for b in range(3):
        for i in range(9):  # the slow reference: the prefix alone, as generation sees it
            alone = model(tokens[b : b + 1, : i + 1], max_depth=cap, halt_threshold=threshold)
            ce = 0.0 if targets[b, i] == -1 else F.cross_entropy(alone["logits"][0, -1], targets[b, i]).item()
            assert abs(result["ce"][b, i].item() - ce) < 1e-4
            assert result["iterations"][b, i] == alone["iterations"][0]
    torch.testing.assert_close(result["loss"], result["ce"].sum() / 26)
    if model.config.halting:
        assert result["iterations"].unique().numel() > 1
    # the full window routes position i on the last token, which has seen the later targets
    full = F.cross_entropy(model(tokens, max_depth=cap, halt_threshold=threshold)["logits"].transpose(1, 2),
                           targets, ignore_index=-1, reduction="none")
    assert not torch.allclose(full[:, :-1], result["ce"][:, :-1], atol=1e-3)
    torch.testing.assert_close(full[:, -1], result["ce"][:, -1], atol=1e-4, rtol=1e-4)


def test_training_lengths():
    g = torch.Generator().manual_seed(0)
    assert (alternet.training_lengths(64, 12, 0.0, g) == 12).all()
    cut = alternet.training_lengths(2000, 12, 1.0, g)
    assert cut.min() == 1 and cut.max() == 12 and cut.unique().numel() == 12
    half = alternet.training_lengths(4000, 12, 0.5, g)
    assert abs((half == 12).float().mean().item() - (0.5 + 0.5 / 12)) < 0.03
    again = alternet.training_lengths(50, 12, 0.5, torch.Generator().manual_seed(1))
    assert torch.equal(again, alternet.training_lengths(50, 12, 0.5, torch.Generator().manual_seed(1)))


def test_recipes_are_table_2():
    import train  # the recipes are TrainConfig overrides
    names = {f.name for f in dataclasses.fields(train.TrainConfig)}
    assert set(alternet.RECIPES) == {"alternet-50m", "alternet-50m-fixed", "alternet-350m", "alternet-350m-fixed"}
    for preset, recipe in alternet.RECIPES.items():
        assert set(recipe) <= names, preset
        assert recipe["block_size"] == alternet.PRESETS[preset]["seq_len"] == 512
        assert recipe["tokenizer"] == "gpt2" and recipe["lr"] == 3e-4
    table = {"alternet-50m": (32_768, 1000, 5000), "alternet-350m": (131_072, 2000, 30_000),
             "alternet-350m-fixed": (131_072, 2000, 10_000)}  # tokens per step, LR warmup, steps
    for preset, (tokens, warmup, steps) in table.items():
        r = alternet.RECIPES[preset]
        assert (r["batch_size"] * r["block_size"], r["warmup_steps"], r["max_steps"]) == (tokens, warmup, steps)
    assert alternet.RECIPES["alternet-350m"]["min_lr"] == 1e-4  # Run II: 3 -> 1 x 10^-4


# --- CPU stand-ins for the GPU paths: bf16 autocast, torch.compile -----------------------------


@pytest.mark.parametrize("halting", [True, False])
def test_bf16_autocast_forward_backward_close_to_fp32(halting):
    model = spread_halting(small_model(halting=halting, num_experts=3), halting=False)  # every expert routed
    tokens = tokens_for(model, B=8, T=10)
    targets = torch.roll(tokens, -1, 1)
    reference = model(tokens, targets=targets)
    reference["loss"].backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(tokens, targets=targets)
    out["loss"].backward()
    # dtypes: the router, its gates and the halting distribution in fp32; logits in bf16 (the LM
    # head runs under autocast); the losses in fp32 (CE on logits.float())
    assert out["router_logits"].dtype == out["gates"].dtype == out["halting_distribution"].dtype == torch.float32
    assert out["loss"].dtype == out["token_losses"].dtype == torch.float32
    assert torch.equal(out["expert_indices"], reference["expert_indices"])
    assert abs(out["loss"].item() - reference["loss"].item()) < 0.02 * reference["loss"].item()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens)["logits"]
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), model(tokens)["logits"], atol=0.05, rtol=0.05)
    for name, p in model.named_parameters():
        assert torch.isfinite(p.grad).all(), name
        cosine = F.cosine_similarity(p.grad.flatten(), ref_grads[name].flatten(), dim=0)
        assert cosine > 0.95 or ref_grads[name].abs().max() < 1e-6, name
    torch.testing.assert_close(model(tokens, targets=targets)["loss"], reference["loss"])  # fp32 after bf16


def compiled_and_eager(backend="aot_eager"):
    """Two copies of one model with spread routing and halting, the second compiled."""
    eager = spread_halting(small_model(num_experts=3, rir_weight=0.3), router_scale=10.0)
    copy = spread_halting(small_model(num_experts=3, rir_weight=0.3), router_scale=10.0)
    return eager, copy, torch.compile(copy, backend=backend)


def test_torch_compile_training_step_matches_eager():
    """backend="aot_eager": Dynamo capture and AOTAutograd's joint forward/backward graphs (where
    graph breaks and functionalisation bugs show), without inductor's C++ code generation. Compiled, every
    expert runs every sequence with gate 0 where it was not chosen (static shapes): the same loss, and
    gradients equal up to the order of float32 sums over more rows (the gate-0 ones)."""
    eager, copy, compiled = compiled_and_eager()
    tokens = tokens_for(eager, B=5, T=12)
    targets = torch.roll(tokens, -1, 1)
    targets[0, 2:6] = -1
    lengths = torch.tensor([12, 7, 1, 12, 4])
    outs = []
    for model in (eager, compiled):
        outs.append(model(tokens, targets=targets, lengths=lengths))
        outs[-1]["loss"].backward()
    assert outs[0]["expert_indices"].unique().numel() == 3, "the case needs every expert routed to"
    for key in ("loss", "task_loss", "halting_distribution", "token_losses"):
        torch.testing.assert_close(outs[1][key], outs[0][key], atol=1e-6, rtol=1e-5, msg=key)
    for key, value in outs[0]["aux_losses"].items():
        torch.testing.assert_close(outs[1]["aux_losses"][key], value, atol=1e-6, rtol=1e-5, msg=key)
    for (name, a), b in zip(eager.named_parameters(), copy.parameters()):
        # ~4e-6 of each tensor's largest entry here (the halt heads' weights are x100): float32 sums
        torch.testing.assert_close(b.grad, a.grad, msg=name, atol=3e-5 * a.grad.abs().max().item(), rtol=1e-4)
    torch._dynamo.reset()


def test_a_compiled_generate_step_halts_as_eager():
    """Compiled, the halting loop keeps every row and masks the halted ones (no active set, no early exit):
    the same logits and iterations, its record running to the cap with zeros where nobody ran."""
    eager, _, compiled = compiled_and_eager(backend="eager")
    eager.eval(), compiled.eval()
    tokens, lengths = tokens_for(eager, B=6, T=9), torch.tensor([9, 3, 6, 1, 9, 5])
    with torch.no_grad():
        every = eager(tokens, lengths=lengths, halt_threshold=0.5)["iterations"]
        early = every < eager.config.max_depth  # a batch that halts before the cap: eagerly D' < D
        a, b = (m(tokens[early], lengths=lengths[early], halt_threshold=0.5, last_token_only=True)
                for m in (eager, compiled))
    assert every.unique().numel() > 2 and a["iterations"].unique().numel() > 1
    assert torch.equal(a["iterations"], b["iterations"])
    torch.testing.assert_close(b["logits"], a["logits"], atol=1e-5, rtol=1e-5)
    n = a["halting_distribution"].shape[1]
    assert n < eager.config.max_depth == b["halting_distribution"].shape[1]
    torch.testing.assert_close(b["halting_distribution"][:, :n], a["halting_distribution"], atol=1e-6, rtol=1e-5)
    assert (b["halting_distribution"][:, n:] == 0).all() and (b["expert_indices"][n:] == -1).all()
    torch._dynamo.reset()


# --- the loss as it was first written, as a reference for the memory-bounded one ---------------
# A copy of the original formulation (renamed and self-contained; it reads only the model's
# parameters and submodules): every iteration decodes the full (B, T, V) logits, they are stacked
# into (D', B, T, V), and the cross-entropies are taken from the stack. Simple, and memory-hungry:
# the model now computes the same loss in chunks of tokens (the tests below check it is the same
# loss with the same gradients). Its edges are the original ones too: z-loss on the clamped logits,
# the depth prior normalised in probability space, rows without targets counted in 1/B.


def stacked_depth_encoding(t, dim):
    freqs = torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = t * freqs
    return torch.stack([angles.sin(), angles.cos()], dim=1).flatten()  # interleaved sin/cos


def stacked_halting(log_gates, halt_logits):
    return (torch.logsumexp(log_gates + F.logsigmoid(halt_logits), dim=-1),
            torch.logsumexp(log_gates + F.logsigmoid(-halt_logits), dim=-1))


def stacked_log_p(log_halt, log_continue):
    log_halt = torch.cat([log_halt[:, :-1], torch.zeros_like(log_halt[:, -1:])], dim=1)
    log_unhalted = torch.cat([torch.zeros_like(log_continue[:, :1]), log_continue[:, :-1]], dim=1).cumsum(1)
    return log_halt + log_unhalted


def stacked_prior(num_steps, max_depth, kind, geometric_p):
    iterations = torch.arange(1, num_steps + 1, dtype=torch.float32)
    if kind == "gaussian":
        log_q = -0.5 * ((iterations - max_depth / 2) / (max_depth / 4)) ** 2
    else:
        log_q = (iterations - 1) * math.log1p(-geometric_p)
    return log_q.softmax(0)


def stacked_kl(log_p, log_q):
    reached = log_p > float("-inf")
    safe_log_p = torch.where(reached, log_p, torch.zeros_like(log_p))
    terms = torch.where(reached, safe_log_p.exp() * (safe_log_p - log_q), torch.zeros_like(log_p))
    return terms.sum(-1).mean()


def stacked_rir(log_halt, log_continue, step_ce, ran):
    if log_halt.shape[0] < 2:
        return log_halt.sum() * 0
    step_ce = step_ce.detach()
    target = 1 - torch.sigmoid(50 * ((step_ce[:-1] - step_ce[1:]).clamp(min=0) - 0.005))
    bce = -(target * log_halt[1:] + (1 - target) * log_continue[1:])
    ran = ran[1:]
    per_sequence = (bce * ran).sum(0) / ran.sum(0).clamp(min=1)
    has_pairs = ran.any(0)
    return (per_sequence * has_pairs).sum() / has_pairs.sum().clamp(min=1)


def stacked_schedules(model, num_iterations):
    """(minimum depth, a_KL scale) of the curriculum and the ramp at the model's training step."""
    cfg, step = model.config, model.schedule_step
    if not cfg.halting:
        return num_iterations, 1.0
    if step is None:
        return 1, 1.0
    since = step - cfg.min_depth_warmup
    if not model.training:
        depth = 1
    elif since < 0:
        depth = cfg.max_depth
    elif since < cfg.min_depth_release_steps:
        depth = math.ceil(cfg.max_depth - (cfg.max_depth - 1) * since / cfg.min_depth_release_steps)
    else:
        depth = 1
    scale = float(since >= 0) if cfg.kl_ramp_steps == 0 else min(1.0, max(0.0, since / cfg.kl_ramp_steps))
    return min(depth, num_iterations), scale


def stacked_iteration(model, x, last, iteration):
    """One iteration (Eq. 1-4) for the running sequences: next states and the routing/halting record."""
    cfg = model.config
    n, k = x.shape[0], cfg.top_k
    t = iteration / (cfg.max_depth - 1) if cfg.max_depth > 1 else 0.0
    encodings = [stacked_depth_encoding(t, cfg.depth_dim)]
    if cfg.budget_signal:
        encodings.append(stacked_depth_encoding(1 - t, cfg.depth_dim))
    h = x[torch.arange(n), last]
    router_logits = torch.cat([h.float(), torch.cat(encodings).expand(n, -1)], -1) @ model.router.weight.float().T
    if cfg.logit_clamp is not None:
        router_logits = router_logits.clamp(-cfg.logit_clamp, cfg.logit_clamp)
    top_logits, expert_indices = router_logits.topk(k, dim=-1)
    log_gates = top_logits.log_softmax(-1)
    gates = log_gates.exp()
    update = torch.zeros_like(x)
    halt_logits, rir_halt_logits = x.new_zeros(n, k), x.new_zeros(n, k)
    for e, expert in enumerate(model.experts):
        seq, slot = (expert_indices == e).nonzero(as_tuple=True)
        if seq.numel() == 0:
            continue
        y = expert(x[seq])
        update = update.index_add(0, seq, gates[seq, slot][:, None, None] * y)
        if expert.halt_head is not None:
            y_last = y[torch.arange(seq.numel()), last[seq]]
            halt_logits = halt_logits.index_put((seq, slot), expert.halt_head(y_last).squeeze(-1))
            rir_halt_logits = rir_halt_logits.index_put((seq, slot), expert.halt_head(y_last.detach()).squeeze(-1))
    x_next = x + update
    if model.halt_head is not None:
        h_last = x_next[torch.arange(n), last]
        logit, rir_logit = model.halt_head(h_last).squeeze(-1), model.halt_head(h_last.detach()).squeeze(-1)
        halting = (F.logsigmoid(logit), F.logsigmoid(-logit), F.logsigmoid(rir_logit), F.logsigmoid(-rir_logit))
    elif cfg.halting:
        halting = (*stacked_halting(log_gates, halt_logits), *stacked_halting(log_gates.detach(), rir_halt_logits))
    else:
        zeros = x.new_zeros(n)
        halting = (torch.full_like(zeros, -math.inf), zeros, zeros, zeros)
    record = dict(router_logits=router_logits, expert_indices=expert_indices, gates=gates,
                  **dict(zip(("log_halt", "log_continue", "rir_log_halt", "rir_log_continue"), halting)))
    return x_next, record


def stacked_stop(record, iteration, num_iterations, min_depth, log_unhalted, halt_threshold):
    n = record["log_halt"].shape[0]
    if iteration < min_depth - 1:
        record["log_halt"] = torch.full((n,), float("-inf"))
        record["log_continue"] = torch.zeros(n)
    if iteration == num_iterations - 1:
        halt_now = torch.ones(n, dtype=torch.bool)
    elif iteration < min_depth - 1 or halt_threshold is None:
        halt_now = torch.zeros(n, dtype=torch.bool)
    else:
        halt_now = 1 - (log_unhalted + record["log_continue"].detach()).exp() >= halt_threshold
    record["log_halt"] = torch.where(halt_now, torch.zeros_like(record["log_halt"]), record["log_halt"])
    record["log_continue"] = torch.where(halt_now, torch.full_like(record["log_continue"], float("-inf")),
                                         record["log_continue"])
    return halt_now


def stacked_scatter(record, active, batch_size):
    full = {key: value.new_full((batch_size, *value.shape[1:]), -1 if key == "expert_indices" else 0)
            .index_copy(0, active, value) for key, value in record.items()}
    full["ran"] = torch.zeros(batch_size, dtype=torch.bool).index_fill(0, active, True)
    return full


def stacked_logits_loss(model, tokens, targets, max_depth=None, halt_threshold=None, lengths=None):
    """The original loss: every iteration's (B, T, V) logits kept and stacked, CE taken from the stack."""
    cfg = model.config
    B, T = tokens.shape
    num_iterations = max_depth or cfg.max_depth
    last = torch.full((B,), T - 1) if lengths is None else lengths - 1
    min_depth, kl_scale = stacked_schedules(model, num_iterations)
    x = model.tok_emb(tokens) + model.pos_emb(torch.arange(T))
    active, log_unhalted = torch.arange(B), torch.zeros(B)
    logits, records = None, []
    for iteration in range(num_iterations):
        everyone = active.numel() == B
        x_next, record = stacked_iteration(model, x[active], last[active], iteration)
        step_logits = model.lm_head(model.norm(x_next))
        halt_now = stacked_stop(record, iteration, num_iterations, min_depth, log_unhalted[active], halt_threshold)
        log_unhalted = log_unhalted.index_copy(0, active, log_unhalted[active] + record["log_continue"].detach())
        x = x_next if everyone else x.index_copy(0, active, x_next)
        logits = step_logits if logits is None or everyone else logits.index_copy(0, active, step_logits)
        records.append((logits, stacked_scatter(record, active, B)))
        active = active[~halt_now]
        if active.numel() == 0:
            break
    step_logits = torch.stack([r[0] for r in records])  # (D', B, T, V)
    rec = {key: torch.stack([r[1][key] for r in records]) for key in records[0][1]}
    log_p = stacked_log_p(rec["log_halt"].T, rec["log_continue"].T)
    ran = rec["ran"]
    router_logits, expert_indices = rec["router_logits"][ran], rec["expert_indices"][ran]
    routed = F.one_hot(expert_indices, cfg.num_experts).sum(1).float()
    balance = cfg.num_experts * (routed.mean(0) * router_logits.softmax(-1).mean(0)).sum()
    aux = dict(balance=cfg.balance_weight * balance,
               z=cfg.z_loss_weight * torch.logsumexp(router_logits, dim=-1).pow(2).mean())
    if cfg.halting:
        log_prior = stacked_prior(log_p.shape[1], cfg.max_depth, cfg.prior, cfg.geometric_p).log()
        aux["kl"] = cfg.kl_weight * kl_scale * stacked_kl(log_p, log_prior)
    D = step_logits.shape[0]
    valid = targets != -1
    if lengths is not None:
        valid &= torch.arange(T) < lengths[:, None]
    targets = targets.masked_fill(~valid, -1)
    ce = torch.stack([F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-1,
                                      reduction="none").view(B, T) for logits in step_logits])  # (D, B, T)
    step_ce = ce.sum(-1) / valid.sum(1).clamp(min=1)
    task_loss = (log_p.exp() * step_ce.T).sum(1).mean()
    if cfg.halting:
        aux["rir"] = cfg.rir_weight * stacked_rir(rec["rir_log_halt"], rec["rir_log_continue"], step_ce, ran)
    return dict(loss=task_loss + sum(aux.values()), task_loss=task_loss, aux_losses=aux,
                step_losses=ce.sum((1, 2)) / valid.sum().clamp(min=1), halting_distribution=log_p.exp(),
                iterations=rec["ran"].sum(0), token_losses=ce)


LOSS_CASES = {  # name: (config overrides, training step or None, train mode, forward arguments)
    "curriculum": (dict(min_depth_warmup=3), 1, True, dict()),
    "gradual release, halting": (dict(min_depth_warmup=2, min_depth_release_steps=4), 4, True,
                                 dict(halt_threshold=0.3)),
    "released, halting": (dict(), None, True, dict(halt_threshold=0.5)),
    "evaluation, cap": (dict(max_depth=5), None, False, dict(halt_threshold=0.4, max_depth=3)),
    "global head": (dict(halt_head="global"), None, False, dict(halt_threshold=0.5)),
    "fixed depth": (dict(halting=False), None, True, dict(max_depth=3)),
}


@pytest.mark.parametrize("case", LOSS_CASES)
@pytest.mark.usefixtures("one_thread")  # two summation orders of the same terms: one thread keeps each fixed
def test_chunked_loss_equals_the_stacked_logits_loss(case, monkeypatch):
    """Same loss, same gradients, as every iteration's logits stacked (fp32), with halting, caps, the
    curriculum's release, right-padded lengths and ignored targets; chunks smaller than the batch."""
    overrides, step, train_mode, kwargs = LOSS_CASES[case]
    monkeypatch.setattr(alternet, "LOSS_CHUNK_LOGITS", 7 * 50)  # 7 tokens per chunk at V = 50
    model = spread_halting(small_model(rir_weight=0.3, **overrides), router_scale=10.0).train(train_mode)
    if step is not None:
        model.set_step(step)
    tokens = tokens_for(model, B=5, T=9)
    targets = torch.roll(tokens, -1, 1)
    targets[0, 2:5] = -1
    lengths = torch.tensor([9, 6, 3, 1, 9])
    out = model(tokens, targets=targets, lengths=lengths, **kwargs)
    assert out["router_logits"].abs().max() < model.config.logit_clamp, "the reference clamps the z-loss"
    if "halt_threshold" in kwargs and case != "curriculum":
        assert out["iterations"].unique().numel() > 1, "the case needs sequences that halt at different depths"
    out["loss"].backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    ref = stacked_logits_loss(model, tokens, targets, lengths=lengths, **kwargs)
    ref["loss"].backward()
    close = dict(atol=1e-6, rtol=1e-5)
    for key in ("loss", "task_loss", "step_losses", "token_losses", "halting_distribution", "iterations"):
        torch.testing.assert_close(out[key], ref[key], msg=key, **close)
    assert out["aux_losses"].keys() == ref["aux_losses"].keys()
    for key, value in ref["aux_losses"].items():
        torch.testing.assert_close(out["aux_losses"][key], value, msg=key, **close)
    for name, p in model.named_parameters():
        assert (grads[name] is None) == (p.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, msg=name, **close)


# --- edges: the clamp, extrapolated caps, rows without targets --------------------------------


def test_z_loss_reads_the_logits_before_the_clamp():
    """ST-MoE's order: at logits [12, 12, -12], clamped to [10, 10, -10], the z-loss still pulls the
    router back (on the clamped logits no loss term would move it: gradient exactly 0)."""
    model = small_model(num_experts=3, top_k=2, max_depth=1)
    H = model.config.dim
    with torch.no_grad():
        model.tok_emb.weight.zero_()
        model.tok_emb.weight[:, 0] = 1.0  # every state: 1 in feature 0, 0 elsewhere
        model.pos_emb.weight.zero_()
        model.router.weight.zero_()
        model.router.weight[:, 0] = torch.tensor([12.0, 12.0, -12.0])
    out = model(tokens_for(model, B=2, T=4))
    torch.testing.assert_close(out["router_logits"][0], torch.tensor([[10.0, 10.0, -10.0]] * 2))
    raw_z = torch.logsumexp(torch.tensor([12.0, 12.0, -12.0]), 0) ** 2
    torch.testing.assert_close(out["aux_losses"]["z"], model.config.z_loss_weight * raw_z)
    out["aux_losses"]["z"].backward()
    assert model.router.weight.grad[:, 0].abs().min() > 0
    assert model.router.weight.grad[:, 1:H].abs().max() == 0


@pytest.mark.parametrize("num_steps, max_depth, kind", [(24, 4, "gaussian"), (64, 12, "gaussian"),
                                                        (400, 8, "geometric")])
def test_depth_prior_is_finite_far_beyond_the_trained_depth(num_steps, max_depth, kind):
    """Log-space normalisation: the far tail of the prior does not underflow to log 0 = -inf."""
    log_q = alternet.log_depth_prior(num_steps, max_depth, kind, geometric_p=0.12)
    n = torch.arange(1, num_steps + 1, dtype=torch.float64)
    if kind == "gaussian":
        log_weights = -0.5 * ((n - max_depth / 2) / (max_depth / 4)) ** 2
    else:
        log_weights = (n - 1) * math.log(0.88)
    expected = log_weights - torch.logsumexp(log_weights, 0)
    assert torch.isfinite(log_q).all()
    torch.testing.assert_close(log_q.double(), expected, rtol=1e-5, atol=1e-4)


def test_kl_and_loss_are_finite_at_an_extrapolated_cap():
    """D = 4 run with a cap of 24: the Gaussian prior's tail is ~e^-242, below float32's range."""
    model = spread_halting(small_model(max_depth=4)).eval()
    tokens = tokens_for(model, B=2, T=5)
    out = model(tokens, targets=torch.roll(tokens, -1, 1), max_depth=24)
    assert out["halting_distribution"].shape == (2, 24)
    assert torch.isfinite(out["aux_losses"]["kl"]) and torch.isfinite(out["loss"])


def test_a_row_without_scored_targets_neither_counts_nor_trains():
    """L_PN and L_RIR average over the sequences that have a target; a row of -1 adds nothing to
    them and no gradient to the halt heads (without the fix: 1/B counted it, and L_RIR trained its
    halt heads toward lambda = 1 - sigmoid(-0.25) = 0.56)."""
    model = spread_halting(small_model(rir_weight=0.3, kl_weight=0.0))
    tokens = tokens_for(model, B=4, T=6)
    targets = torch.roll(tokens, -1, 1)
    targets[2] = -1
    kept = [0, 1, 3]
    runs = []
    for rows, row_targets in ((tokens, targets), (tokens[kept], targets[kept])):
        model.zero_grad(set_to_none=True)
        out = model(rows, targets=row_targets)
        (out["task_loss"] + out["aux_losses"]["rir"]).backward()
        grads = {n: p.grad for n, p in model.named_parameters() if "halt_head" in n and p.grad is not None}
        runs.append((out, grads))
    (with_empty, grads), (without, grads_without) = runs
    torch.testing.assert_close(with_empty["task_loss"], without["task_loss"])
    torch.testing.assert_close(with_empty["aux_losses"]["rir"], without["aux_losses"]["rir"])
    assert grads_without
    for name in grads.keys() | grads_without.keys():  # an expert only the empty row took: zero gradient
        zero = torch.zeros_like(grads.get(name, grads_without.get(name)))
        torch.testing.assert_close(grads.get(name, zero), grads_without.get(name, zero), msg=name)


def test_compiled_training_recompiles_only_when_the_curriculum_depth_changes():
    """The schedules reach forward as a depth that changes at most D times and a 0-d tensor (the
    a_KL scale), not as the step counter: dynamo guards on neither the step nor the ramp's value.
    Reading the step in forward recompiled at every step until the recompile limit."""
    # top_k = E: every expert runs every sequence, so no routing-dependent shape recompiles either
    model = small_model(num_experts=2, top_k=2, max_depth=2, min_depth_warmup=3, kl_ramp_steps=10)
    counter = torch._dynamo.testing.CompileCounter()  # dynamo's capture only (backend: the eager graph)
    compiled = torch.compile(model, backend=counter)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    tokens = tokens_for(model, B=4, T=12)
    depths, compiles, kl_scales = [], [], []
    for step in range(20):
        model.set_step(step)
        out = compiled(tokens, targets=torch.roll(tokens, -1, 1))
        out["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
        depths.append(model.first_halt(2) + 1)
        compiles.append(counter.frame_count)
        kl_scales.append(float(model.kl_scale))
    assert depths == [2, 2, 2] + [1] * 17 and len(set(kl_scales)) == 11  # the ramp moved every step
    for step in range(1, 20):
        if depths[step] == depths[step - 1]:
            assert compiles[step] == compiles[step - 1], f"recompiled at step {step}: {compiles}"
    torch._dynamo.reset()


def test_the_model_file_imports_nothing_of_the_project():
    """alternet.py stands alone: torch, einops and the standard library at any level; the tokenizers live in
    lib/language.py, sampling from a checkpoint in sample.py."""
    import ast
    from pathlib import Path
    root = Path(alternet.__file__).parent
    tree = ast.parse((root / "alternet.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert not any(isinstance(node, ast.ImportFrom) and node.level for node in ast.walk(tree))
    assert imported <= {"__future__", "collections", "dataclasses", "math", "torch", "einops"}, imported
    assert not imported & {path.stem for path in root.glob("*.py")}


def test_every_choice_labelled_at_its_code_is_listed_in_docs_choices():
    """One line of docs/choices.md's AlterNet list per "(our choice)" in alternet.py, no more, no fewer."""
    from pathlib import Path
    root = Path(alternet.__file__).parent
    listed = (root / "docs" / "choices.md").read_text().split("\nAlterNet (arXiv 2611.08741)")[1].split("\n\n")[0]
    bullets = [line for line in listed.splitlines() if line.startswith("- ")]
    assert len(bullets) == (root / "alternet.py").read_text().count("(our choice)") > 0
