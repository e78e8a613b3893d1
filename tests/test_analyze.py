"""analyze.py: CKA, effective rank, gate interventions, and the command end to end.

The measures are checked against their defining properties (Hypothesis over shapes and seeds);
the interventions against the model itself (a folded model with the router's own gates must
reproduce the reViT's residual states).
"""
import json
import math
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

import alternet
from tools import analyze
import revit

ROOT = Path(__file__).resolve().parent.parent
# `prog: error: message`, nothing more
ONE_LINE_ERROR = re.compile(r"^(\S+\.py|python -m [\w.]+): error: [^\n]+$")

FAST = settings(max_examples=15, deadline=None)


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def orthogonal(n, seed):
    q, r = torch.linalg.qr(randn(n, n, seed=seed))
    return q * torch.sign(torch.diagonal(r))  # Haar-distributed


def tiny_revit(seed=0, **overrides):
    cfg = dict(image_size=28, patch_size=7, in_channels=1, num_classes=10, dim=16, heads=2, ffn_dim=24,
               depth=4, num_experts=3)
    model = revit.create_model("revit-mini", **{**cfg, **overrides}).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # random weights everywhere, so the router's gates are far from uniform
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


# --- linear CKA ---

features = st.tuples(st.integers(4, 24), st.integers(1, 12), st.integers(1, 12), st.integers(0, 2**16))


@FAST
@given(features)
def test_cka_of_a_representation_with_itself_is_one(shape):
    n, p, _, seed = shape
    x = randn(n, p, seed=seed)
    assert analyze.linear_cka(x, x) == pytest.approx(1.0, abs=1e-9)


@FAST
@given(features, st.floats(0.01, 100.0))
def test_cka_is_symmetric_and_invariant_to_rotation_and_isotropic_scaling(shape, scale):
    n, p, q, seed = shape
    x, y = randn(n, p, seed=seed), randn(n, q, seed=seed + 1)
    cka = analyze.linear_cka(x, y)
    assert 0.0 <= cka <= 1.0 + 1e-9
    assert analyze.linear_cka(y, x) == pytest.approx(cka, abs=1e-9)
    assert analyze.linear_cka(x @ orthogonal(p, seed + 2), y) == pytest.approx(cka, abs=1e-9)
    assert analyze.linear_cka(x, y @ orthogonal(q, seed + 3)) == pytest.approx(cka, abs=1e-9)
    assert analyze.linear_cka(scale * x, y) == pytest.approx(cka, abs=1e-9)
    assert analyze.linear_cka(x, scale * y) == pytest.approx(cka, abs=1e-9)


def hsic(k, l, unbiased=False):
    """HSIC of two Gram matrices by its definition: tr(K H L H) / (n-1)^2 with the centring matrix H
    (Kornblith et al., 2019, Eq. 3), or Song et al.'s (2012) unbiased estimator."""
    n = len(k)
    if not unbiased:
        h = torch.eye(n, dtype=torch.float64) - 1 / n
        return torch.trace(k @ h @ l @ h) / (n - 1) ** 2
    k, l = k - torch.diag(k.diagonal()), l - torch.diag(l.diagonal())
    return (torch.trace(k @ l) + k.sum() * l.sum() / ((n - 1) * (n - 2))
            - 2 / (n - 2) * (k.sum(0) @ l.sum(0))) / (n * (n - 3))


def test_cka_is_the_centred_biased_hsic_not_an_uncentred_or_unbiased_variant():
    """Features far from zero mean and few inputs: CKA without centring, and CKA of the unbiased HSIC,
    give other numbers here; linear_cka is Kornblith et al.'s (biased HSIC of centred features)."""
    x = randn(8, 5, seed=11) + 3 * randn(1, 5, seed=12)
    y = x[:, :3] @ randn(3, 4, seed=13) + randn(8, 4, seed=14) + 2
    k, l = x @ x.T, y @ y.T

    def cka(unbiased=False):
        return (hsic(k, l, unbiased) / (hsic(k, k, unbiased) * hsic(l, l, unbiased)).sqrt()).item()

    expected = cka()
    assert analyze.linear_cka(x, y) == pytest.approx(expected, rel=1e-12)
    uncentred = ((y.T @ x).square().sum() / ((x.T @ x).norm() * (y.T @ y).norm())).item()
    assert abs(uncentred - expected) > 0.05 and abs(cka(unbiased=True) - expected) > 0.05


def test_cka_matrix_matches_pairwise_cka():
    xs, ys = randn(3, 20, 5, seed=1), randn(2, 20, 7, seed=2)
    expected = torch.tensor([[analyze.linear_cka(x, y) for y in ys] for x in xs], dtype=torch.float64)
    torch.testing.assert_close(analyze.cka_matrix(xs, ys), expected)


# --- effective rank ---


@FAST
@given(st.integers(1, 10), st.integers(1, 10), st.integers(0, 2**16), st.floats(0.1, 10.0))
def test_effective_rank_of_k_equal_singular_values_is_k(m, n, seed, value):
    k = 1 + seed % min(m, n)
    u, v = orthogonal(m, seed)[:, :k], orthogonal(n, seed + 1)[:, :k]
    assert analyze.effective_rank(u @ (value * v.T)) == pytest.approx(k, rel=1e-9)


@FAST
@given(st.integers(1, 10), st.integers(1, 10), st.integers(0, 2**16))
def test_effective_rank_of_a_rank_one_matrix_is_one(m, n, seed):
    rank_one = torch.outer(randn(m, seed=seed), randn(n, seed=seed + 1))
    assert analyze.effective_rank(rank_one) == pytest.approx(1.0)


def test_effective_rank_weights_squared_singular_values():
    """App. D: the entropy of sigma_i^2 / sum sigma_j^2. Equal singular values cannot tell it from the
    entropy of sigma_i / sum sigma_j (Roy and Vetterli's own normalisation); 3, 1, 0.5 can."""
    spectrum = torch.tensor([3.0, 1.0, 0.5], dtype=torch.float64)
    matrix = orthogonal(5, 1)[:, :3] @ torch.diag(spectrum) @ orthogonal(4, 2)[:, :3].T

    def entropy_rank(p):
        return math.exp(-sum(pi * math.log(pi) for pi in (p / p.sum()).tolist()))

    assert analyze.effective_rank(matrix) == pytest.approx(entropy_rank(spectrum ** 2), rel=1e-9)
    assert abs(entropy_rank(spectrum) - entropy_rank(spectrum ** 2)) > 0.3


def test_effective_rank_of_zero_matrix_is_zero():
    assert analyze.effective_rank(torch.zeros(3, 4)) == 0.0


def gates_and_bank(depth, experts, bank_rank, seed):
    gates = torch.softmax(3 * randn(depth, experts, seed=seed), -1)  # rows on the simplex, like G
    bank = randn(experts, bank_rank, seed=seed + 1) @ randn(bank_rank, 40, seed=seed + 2)  # (E, P), rank <= r
    return gates, bank


@FAST
@given(st.integers(2, 12), st.integers(1, 8), st.integers(1, 8), st.integers(0, 2**16))
def test_merged_trajectory_rank_is_bounded_by_gates_and_bank(depth, experts, bank_rank, seed):
    gates, bank = gates_and_bank(depth, experts, bank_rank, seed)
    traj = gates @ bank  # W1_traj = G W1_bank
    rank = torch.linalg.matrix_rank
    bound = min(rank(gates), rank(bank))
    assert rank(traj) <= bound
    assert analyze.effective_rank(traj) <= bound + 1e-6  # exp(entropy) never exceeds the rank


@FAST
@given(st.integers(2, 12), st.integers(1, 8), st.integers(0, 2**16))
def test_depth_centred_gates_have_rank_at_most_e_minus_one(depth, experts, seed):
    gates, bank = gates_and_bank(depth, experts, experts, seed)
    centred = analyze.centre_depth(gates)
    assert torch.linalg.matrix_rank(centred, atol=1e-9) <= experts - 1
    assert analyze.effective_rank(centred) <= max(experts - 1, 0) + 1e-6
    torch.testing.assert_close(analyze.centre_depth(gates @ bank), centred @ bank)  # C (G W) = (C G) W


def test_effective_ranks_of_a_model():
    model = tiny_revit(num_experts=3, depth=6)
    ranks = analyze.effective_ranks(model, model.gate_matrix(6).detach())
    assert all(0 < ranks[k] <= 3 + 1e-9 for k in ("W1_bank", "G", "W1_traj"))
    assert ranks["G_centred"] <= 2 + 1e-9 and ranks["W1_traj_centred"] <= 2 + 1e-9


def test_prior_share_measures_what_the_router_learned_on_top_of_the_depth_prior():
    model = revit.create_model("revit-mini", dim=16, heads=2, ffn_dim=24, depth=6, router_prior=8.0).eval()
    untrained = analyze.gate_program(model, 6)  # psi's output layer starts at zero: the gates are the prior's
    assert untrained["learned_shift"] < 1e-6
    assert untrained["prior_dominant_expert"] == untrained["dominant_expert"]
    assert untrained["prior_dominant_expert"][0] == 0 and untrained["prior_dominant_expert"][-1] == 3
    with torch.no_grad():  # a router that learned something: the shift is the largest change of any gate
        model.block.mlp.router[2].bias.copy_(torch.tensor([0.0, 0.0, 0.0, 3.0]))
    trained = analyze.gate_program(model, 6)
    gates, prior = torch.tensor(trained["gates"]), torch.tensor(trained["prior_gates"])
    assert trained["learned_shift"] == pytest.approx(float((gates - prior).abs().max()))
    assert trained["learned_shift"] > 0.1
    assert "prior_gates" not in analyze.gate_program(tiny_revit(), 4)  # the paper's router has no prior


def test_effective_ranks_of_the_tied_block():
    model = tiny_revit(num_experts=1)  # E = 1: a plain Mlp, G = ones
    ranks = analyze.effective_ranks(model, model.gate_matrix(4))
    assert ranks["W1_bank"] == ranks["G"] == pytest.approx(1.0) and ranks["W1_traj"] == pytest.approx(1.0)
    assert ranks["G_centred"] == ranks["W1_traj_centred"] == 0.0
    assert not analyze.is_merged(model)


# --- Spearman rho and the max-CKA path ---


def test_spearman():
    a = torch.arange(6.0)
    assert analyze.spearman(a, a ** 3) == pytest.approx(1.0)
    assert analyze.spearman(a, -a) == pytest.approx(-1.0)
    # ranks 0.5, 0.5, 2.5, 2.5
    ties = analyze.spearman(torch.tensor([1.0, 2, 3, 4]), torch.tensor([1.0, 1, 2, 2]))
    assert ties == pytest.approx(2 / math.sqrt(5))
    assert analyze.spearman(a, torch.ones(6)) is None  # undefined: one side is constant


def test_a_constant_max_cka_path_has_no_spearman_rho_and_says_why(capsys):
    """Every student state closest to one teacher state: rho is undefined, printed as n/a with the reason
    and written to analysis.json as null, never as nan."""
    cross = torch.tensor([[1.0, 0.5, 0.2]] * 3)
    alignment = analyze.depth_alignment(cross)
    assert alignment["max_cka_path"] == [0, 0, 0] and alignment["spearman_rho"] is None
    assert json.loads(json.dumps(alignment, allow_nan=False))["spearman_rho"] is None
    analyze.print_report({"depth": 2, "self_cka": cross[:, :1].tolist(), "num_images": 4,
                          "cross_cka": cross.tolist(), "depth_alignment": alignment,
                          "teacher": {"arch": "vit", "depth": 2}})
    printed = capsys.readouterr().out
    assert "Spearman rho n/a (every student state is closest to teacher state 0) | MAD" in printed


def test_depth_alignment_of_a_proportional_trajectory():
    # student L = 3 against teacher L_T = 6: CKA peaks at teacher state 2 i
    cross = torch.tensor([[1.0 - 0.1 * abs(j - 2 * i) for j in range(7)] for i in range(4)])
    result = analyze.depth_alignment(cross)
    assert result["max_cka_path"] == [0, 2, 4, 6]
    assert result["spearman_rho"] == pytest.approx(1.0)
    assert result["mad"] == pytest.approx(0.0) and result["interior_mad"] == pytest.approx(0.0)
    symmetric = analyze.depth_alignment(cross[:3, :5])  # L = 2, L_T = 4: the middle row is symmetric about 2
    assert symmetric["weighted_mean_depth"][1] == pytest.approx(2.0)
    assert 0 < symmetric["weighted_std_depth"][1] < 2


# --- gate interventions ---


def test_ablation_keeps_rows_on_the_simplex():
    gates = torch.softmax(randn(5, 4, seed=3), -1)
    ablated = analyze.ablate_experts(gates, [1])
    assert (ablated[:, 1] == 0).all()
    torch.testing.assert_close(ablated.sum(1), torch.ones(5, dtype=torch.float64))
    torch.testing.assert_close(analyze.ablate_experts(gates, []), gates)


def test_gate_permutations():
    g = torch.Generator().manual_seed(0)
    four = analyze.gate_permutations(4, 64, g)
    assert len(four) == len(set(four)) == 23 and (0, 1, 2, 3) not in four
    six = analyze.gate_permutations(6, 10, torch.Generator().manual_seed(1))
    assert len(set(six)) == 10 and (0, 1, 2, 3, 4, 5) not in six
    assert six == analyze.gate_permutations(6, 10, torch.Generator().manual_seed(1))  # seeded
    assert analyze.gate_permutations(1, 64, g) == []


def test_displacement_is_the_frobenius_distance_of_the_merged_weights():
    model = tiny_revit()
    ffn = model.block.mlp
    gates = model.gate_matrix(4).detach()
    ablated = analyze.ablate_experts(gates, [0])
    with torch.no_grad():
        direct = torch.cat([(a - b).flatten() for a, b in zip(ffn.merge(ablated), ffn.merge(gates))]).norm()
    gram = analyze.bank_gram(model)
    assert analyze.merged_displacement(ablated - gates, gram) == pytest.approx(direct.item(), rel=1e-4)
    perturbed = analyze.matched_perturbation(gates, gram, direct.item(), torch.Generator().manual_seed(0))
    torch.testing.assert_close(perturbed.sum(1), torch.ones(4))
    assert (perturbed >= 0).all()
    assert analyze.merged_displacement(perturbed - gates, gram) == pytest.approx(direct.item(), rel=1e-5)


def test_folding_with_the_routers_gates_reproduces_the_model():
    model = tiny_revit()
    x = randn(5, 1, 28, 28, seed=4).float()
    states = analyze.residual_features(model, x, depth=5)
    folded = revit.fold(model, gates=model.gate_matrix(5).detach())
    torch.testing.assert_close(analyze.residual_features(folded, x), states, atol=1e-5, rtol=1e-4)
    assert states.shape == (6, 5, 16)


def test_identity_permutation_and_empty_ablation_leave_cka_unchanged():
    model = tiny_revit()
    x = randn(12, 1, 28, 28, seed=5).float()
    gates = model.gate_matrix(4).detach()
    vit = revit.fold(model, gates=gates)
    reference = randn(12, 8, seed=6).float()

    def cka(g):
        analyze.load_merged_ffns(vit, model.block.mlp.merge(g))
        return analyze.linear_cka(analyze.residual_features(vit, x)[-1], reference)

    intact = cka(gates)
    assert cka(gates[:, [0, 1, 2]]) == intact
    assert cka(analyze.ablate_experts(gates, [])) == pytest.approx(intact, abs=1e-6)
    assert cka(gates[:, [1, 2, 0]]) != pytest.approx(intact, abs=1e-6)


# --- gradients on the gates and the experts ---


def test_gate_logit_gradients_account_for_every_step():
    """z_t = W h_t + b at each step, so the loss's gradient on psi's output bias is the sum over steps of
    the per-step gate-logit gradients, and on its weight the sum of their outer products with h_t."""
    model = tiny_revit(depth=5)
    x, y = randn(6, 1, 28, 28, seed=1).float(), torch.arange(6) % 10
    z, bank_grad, psi_grad = analyze.batch_gradients(model, x, y, 5)
    router = model.block.mlp.router
    loss = torch.nn.functional.cross_entropy(model(x, depth=5), y)
    weight, bias = torch.autograd.grad(loss, [router[2].weight, router[2].bias])
    hidden = torch.nn.functional.silu(router[0](revit.depth_grid(5)[:, None]))  # (L, 16)
    assert z.shape == (5, 3) and bank_grad.shape[0] == 3
    torch.testing.assert_close(z.sum(0), bias, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(z.T @ hidden, weight, rtol=1e-4, atol=1e-8)
    assert psi_grad.numel() == sum(p.numel() for p in router.parameters())
    assert all(p.grad is None for p in model.parameters())  # the model's .grad fields are left alone


def test_gradient_measures_at_init_and_on_repeated_batches():
    model = revit.create_model("revit-mini", dim=16, heads=2, ffn_dim=24, depth=4, num_experts=3).eval()
    x, y = randn(8, 1, 28, 28, seed=2).float(), torch.arange(8) % 10
    twice = analyze.gradient_measures(model, torch.cat([x, x]), torch.cat([y, y]), 4, batch_size=8)
    assert twice["consistency"] == pytest.approx(1.0)  # two identical batches point the same way
    assert twice["noise_floor"] == pytest.approx(1 / math.sqrt(2))
    # the zero-initialised router gives uniform gates, so every expert receives exactly the same update
    assert twice["expert_specific"] == pytest.approx(0.0, abs=1e-6)
    part = analyze.gradient_part(tiny_revit(), x, y, 4, batches=2, seed=0)
    assert part["init"]["expert_specific"] == pytest.approx(0.0, abs=1e-6)
    assert part["trained"]["expert_specific"] > 0.01  # random (non-uniform) gates: the updates differ
    assert -1 <= part["trained"]["expert_cosine"] <= 1 and part["trained"]["batches"] == 2


# --- the command, end to end ---


def save_checkpoint(model, arch, path):
    """The keys train.py writes, minus the optimizer and loop state."""
    torch.save({"model": model.state_dict(), "arch": arch, "model_config": asdict(model.config),
                "train_config": {"dataset": "fashion-mnist"}, "step": 0}, path)


def test_command_end_to_end(tmp_path, fashion_mnist_dir, capsys):
    save_checkpoint(tiny_revit(), "revit-mini", tmp_path / "student.pt")
    teacher = revit.create_model("vit-mini", patch_size=7, dim=16, heads=2, ffn_dim=24, depth=4)
    save_checkpoint(teacher, "vit-mini", tmp_path / "teacher.pt")
    out = tmp_path / "analysis"
    analyze.main([str(tmp_path / "student.pt"), "--teacher", str(tmp_path / "teacher.pt"), "--depth", "5",
                  "--out", str(out), "--data-dir", str(fashion_mnist_dir), "--num-images", "48",
                  "--intervention-images", "32", "--random-perturbations", "3", "--device", "cpu"])
    report = json.loads((out / "analysis.json").read_text())
    assert len(report["gates"]["gates"]) == 5 and len(report["gates"]["gates"][0]) == 3
    assert set(report["effective_ranks"]) >= {"W1_bank", "G", "W1_traj", "G_centred", "W1_traj_centred"}
    assert len(report["self_cka"]) == 6 and report["self_cka"][2][2] == pytest.approx(1.0)
    assert len(report["cross_cka"]) == 6 and len(report["cross_cka"][0]) == 5  # student 5+1 x teacher 4+1
    assert len(report["depth_alignment"]["max_cka_path"]) == 6
    interventions = report["interventions"]
    assert [a["expert"] for a in interventions["ablations"]] == [0, 1, 2]
    assert all(len(a["random_delta_cka"]) == 3 for a in interventions["ablations"])
    assert interventions["permutation_summary"]["count"] == 5
    assert (out / "gates.csv").read_text().count("\n") == 6  # header + L rows
    assert report["gate_gradients"]["init"]["batches"] == 8 == report["gate_gradients"]["trained"]["batches"]
    assert (out / "cross_cka.csv").exists() and (out / "self_cka.csv").exists()
    if analyze.import_pyplot() is not None:
        assert report["plots"] == ["gates.png", "self_cka.png", "cross_cka.png"]
        assert all((out / name).read_bytes()[:4] == b"\x89PNG" for name in report["plots"])
    # the same seed gives the same numbers; a rerun rewrites its own files whole and names only those, and
    # leaves none of the first run's that it did not rewrite (no cross-CKA without --teacher)
    capsys.readouterr()
    again = analyze.main([str(tmp_path / "student.pt"), "--depth", "5", "--out", str(out),
                          "--data-dir", str(fashion_mnist_dir), "--num-images", "48", "--no-interventions",
                          "--gradient-batches", "0"])
    assert again["self_cka"] == report["self_cka"]
    assert "gate_gradients" not in again and "interventions" not in again
    wrote = capsys.readouterr().out.splitlines()[-1]
    assert wrote.startswith(f"wrote {out / 'analysis.json'}, gates.csv, self_cka.csv")
    assert "cross" not in wrote and not [p.name for p in out.iterdir() if p.name.startswith("cross")]
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temporary file is left


def test_a_planted_run_is_analysed_on_its_own_inputs(tmp_path):
    """A checkpoint trained with --dataset planted reads the planted task's test inputs (lib/data.py's
    planted_images): 16x16x3, 4x4 patches; its gate program at another depth than it was trained at."""
    model = tiny_revit(image_size=16, patch_size=4, in_channels=3)
    torch.save({"model": model.state_dict(), "arch": "revit-mini", "model_config": asdict(model.config),
                "train_config": {"dataset": "planted"}, "step": 0}, tmp_path / "planted.pt")
    report = analyze.main([str(tmp_path / "planted.pt"), "--depth", "6", "--out", str(tmp_path / "out"),
                           "--num-images", "32", "--no-interventions", "--gradient-batches", "0",
                           "--device", "cpu"])
    assert len(report["gates"]["gates"]) == 6 and len(report["self_cka"]) == 7


def test_full_analysis_with_the_model_on_a_device(tmp_path, fashion_mnist_dir, monkeypatch):
    """Every part (gates, ranks, CKA with a teacher, ablations with matched perturbations, permutations,
    gradients) with the models on an accelerator, here the CPU stand-in of device_check: a tensor the code
    builds on the CPU and mixes with the model's raises there, as on a GPU. Same numbers as on the CPU."""
    from device_check import FAKE, OnFakeDevice
    save_checkpoint(tiny_revit(), "revit-mini", tmp_path / "student.pt")
    teacher = revit.create_model("vit-mini", patch_size=7, dim=16, heads=2, ffn_dim=24, depth=4)
    save_checkpoint(teacher, "vit-mini", tmp_path / "teacher.pt")
    args = [str(tmp_path / "student.pt"), "--teacher", str(tmp_path / "teacher.pt"), "--data-dir",
            str(fashion_mnist_dir), "--num-images", "24", "--intervention-images", "16",
            "--random-perturbations", "2", "--gradient-batches", "2"]
    on_cpu = analyze.main([*args, "--out", str(tmp_path / "cpu"), "--device", "cpu"])
    monkeypatch.setattr(analyze, "pick_device", lambda name: FAKE)
    with OnFakeDevice():
        on_device = analyze.main([*args, "--out", str(tmp_path / "device")])
    assert on_device["interventions"]["permutation_summary"]["count"] == 5
    for part in ("gates", "effective_ranks", "self_cka", "cross_cka", "interventions", "gate_gradients"):
        assert json.dumps(on_device[part]) == json.dumps(on_cpu[part]), part


@pytest.mark.gpu
def test_full_analysis_on_the_gpu(tmp_path, fashion_mnist_dir):
    """The same analysis on a CUDA GPU (REVIT_GPU_TESTS=1): the numbers of the CPU run, to float tolerance."""
    save_checkpoint(tiny_revit(), "revit-mini", tmp_path / "student.pt")
    args = [str(tmp_path / "student.pt"), "--data-dir", str(fashion_mnist_dir), "--num-images", "24",
            "--intervention-images", "16", "--random-perturbations", "2", "--gradient-batches", "2"]
    on_cpu = analyze.main([*args, "--out", str(tmp_path / "cpu"), "--device", "cpu"])
    on_gpu = analyze.main([*args, "--out", str(tmp_path / "gpu"), "--device", "cuda"])
    assert on_gpu["interventions"]["permutation_summary"]["count"] == 5
    torch.testing.assert_close(torch.tensor(on_gpu["self_cka"]), torch.tensor(on_cpu["self_cka"]),
                               rtol=0, atol=1e-2)  # TF32 matmuls, if an earlier test turned them on


def analysis_args(tmp_path, fashion_mnist_dir, *extra):
    return [str(tmp_path / "student.pt"), "--out", str(tmp_path / "analysis"), "--data-dir",
            str(fashion_mnist_dir), "--num-images", "16", "--device", "cpu", *extra]


def bad_files(tmp_path):
    """A student that is fine, and teachers a user might pass by mistake."""
    save_checkpoint(tiny_revit(), "revit-mini", tmp_path / "student.pt")
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    torch.save({"model": {}, "note": Path("notes.txt")}, tmp_path / "pickled.pt")  # a pickled Python object
    cifar_teacher = revit.create_model("vit-mini", image_size=32, in_channels=3, patch_size=8, dim=16,
                                       heads=2, ffn_dim=24, depth=2)
    save_checkpoint(cifar_teacher, "vit-mini", tmp_path / "cifar_teacher.pt")
    lm = alternet.create_model("alternet-tiny", dim=16, heads=2, ffn_dim=16, num_experts=2, seq_len=8)
    torch.save({"model": lm.state_dict(), "arch": "alternet-tiny", "model_config": asdict(lm.config)},
               tmp_path / "language.pt")


@pytest.mark.parametrize("extra, needle", [
    (["--teacher", "{tmp}/missing.pt"], "--teacher {tmp}/missing.pt: no such file"),
    (["--teacher", "{tmp}/garbage.pt"], "--teacher {tmp}/garbage.pt: not a PyTorch file"),
    (["--teacher", "{tmp}/pickled.pt"], "--teacher {tmp}/pickled.pt: it stores the Python object pathlib"),
    (["--teacher", "{tmp}/language.pt"],
     "--teacher {tmp}/language.pt: holds the language model alternet-tiny"),
    (["--teacher", "{tmp}/cifar_teacher.pt"], "--teacher {tmp}/cifar_teacher.pt: expects 3x32² images; "
     "fashion-mnist has 1x28²"),
    (["--num-images", "1"], "--num-images must be in 2..1,048,576; got 1"),
    (["--intervention-images", "0"],
     "--intervention-images must be <= 16 (--num-images: they are the first N of that subset) and >= 2; "
     "got 0"),
    (["--random-perturbations", "-1"], "--random-perturbations must be in 0..10,000; got -1"),
    (["--batch-size", "0"], "--batch-size must be in 1..1,048,576; got 0"),
    (["--gradient-batches", "1"],
     "--gradient-batches must be 0 (skip) or between 2 and --num-images (16); got 1"),
    (["--depth", "1"], "--depth must be in 2..256; got 1"),
    (["--dataset", "mnist"],
     "--dataset must be one of fashion-mnist, cifar10, cifar100, imagenet, planted; got 'mnist'"),
    (["--data-dir", "{tmp}/nowhere"], "--data-dir {tmp}/nowhere: no such folder"),
    (["--data", "{tmp}"], "--data is read by --dataset imagenet only, not fashion-mnist"),
    (["--device", "tpu:7"], "--device 'tpu:7': not a device"),
])
def test_bad_input_gives_one_line_and_writes_nothing(tmp_path, fashion_mnist_dir, extra, needle):
    bad_files(tmp_path)
    argv = analysis_args(tmp_path, fashion_mnist_dir, *[a.format(tmp=tmp_path) for a in extra])
    with pytest.raises(SystemExit) as info:
        analyze.main(argv)
    message = str(info.value)
    assert ONE_LINE_ERROR.match(message) and needle.format(tmp=tmp_path) in message, message
    assert not (tmp_path / "analysis").exists()  # all inputs are checked before any output is written


def test_gradient_batches_default_to_8_or_to_a_smaller_num_images():
    """A user who gives only --num-images 5 never reads of an 8 they did not give; one who gives 8 does."""
    parse = analyze.build_parser().parse_args
    for given, batches in ((["--num-images", "5"], 5), ([], 8)):
        args = parse(["ckpt.pt", *given])
        analyze.check_args(args)
        assert args.gradient_batches == batches
    refused = r"--gradient-batches must be 0 \(skip\) or between 2 and --num-images \(5\); got 8"
    with pytest.raises(SystemExit, match=refused):
        analyze.check_args(parse(["ckpt.pt", "--num-images", "5", "--gradient-batches", "8"]))


def test_undefined_numbers_print_as_n_a_where_analysis_json_holds_null(tmp_path, fashion_mnist_dir, capsys):
    """No matched random perturbation (their mean, std and share are undefined) and a zero expert bank
    (the displacement relative to the merged weights' norm of 0 is undefined): n/a in the table, null in
    the file; so is the interior MAD of a one-step student (no interior state)."""
    model = tiny_revit()
    with torch.no_grad():
        for p in model.block.mlp.bank():
            p.zero_()
    save_checkpoint(model, "revit-mini", tmp_path / "student.pt")
    analyze.main(analysis_args(tmp_path, fashion_mnist_dir, "--random-perturbations", "0",
                               "--gradient-batches", "0"))
    printed = capsys.readouterr().out
    rows = printed.split("random worse\n")[1].splitlines()[:3]
    assert [row.split()[3:] for row in rows] == [["n/a", "+0.0000", "n/a", "±", "n/a", "n/a"]] * 3, rows
    report = json.loads((tmp_path / "analysis" / "analysis.json").read_text())
    undefined = ("relative_displacement", "random_mean", "random_std", "fraction_random_worse")
    assert all(row[key] is None for row in report["interventions"]["ablations"] for key in undefined)
    cross = torch.tensor([[1.0, 0.5, 0.2], [0.2, 0.5, 1.0]])  # L = 1 against L_T = 2
    analyze.print_report({"depth": 1, "self_cka": cross[:, :2].tolist(), "num_images": 4,
                          "cross_cka": cross.tolist(), "depth_alignment": analyze.depth_alignment(cross),
                          "teacher": {"arch": "vit", "depth": 2}})
    assert "teacher layers (interior n/a)" in capsys.readouterr().out


def test_bad_checkpoint_and_depth(tmp_path):
    with pytest.raises(SystemExit, match=r"checkpoint \S*missing.pt: no such file"):
        analyze.main([str(tmp_path / "missing.pt")])
    vit = revit.create_model("vit-mini", patch_size=7, dim=16, heads=2, ffn_dim=24, depth=4)
    save_checkpoint(vit, "vit-mini", tmp_path / "vit.pt")
    with pytest.raises(SystemExit, match="--depth 6: vit-mini cannot run at this depth "
                                         ".depth=6: an untied ViT runs only its own depth"):
        analyze.main([str(tmp_path / "vit.pt"), "--depth", "6"])
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match="--out .*file is a file"):
        analyze.main([str(tmp_path / "vit.pt"), "--out", str(tmp_path / "file")])


def test_command_line_prints_no_traceback(tmp_path, fashion_mnist_dir):
    bad_files(tmp_path)  # torch's own text for this file is many lines and advises weights_only=False
    argv = analysis_args(tmp_path, fashion_mnist_dir, "--teacher", str(tmp_path / "pickled.pt"))
    result = subprocess.run([sys.executable, "-m", "tools.analyze", *argv], capture_output=True, text=True,
                            cwd=ROOT)  # as README runs it: from the repository
    assert result.returncode == 1 and "Traceback" not in result.stderr and "weights_only" not in result.stderr
    assert ONE_LINE_ERROR.match(result.stderr.strip()), result.stderr
    assert not (tmp_path / "analysis").exists()


# --- figures ---


def test_gate_figure_shows_the_dominant_expert_path(tmp_path):
    plt = analyze.import_pyplot()
    if plt is None:
        pytest.skip("matplotlib is not installed (an optional extra: pip install -r requirements-extra.txt)")
    import matplotlib.image
    program = analyze.gate_program(tiny_revit(num_experts=3), 7)
    fig = analyze.gate_figure(plt, program)
    ax = fig.axes[0]
    path = [line for line in ax.get_lines() if "dominant" in line.get_label()]
    assert len(path) == 1 and list(path[0].get_ydata()) == program["dominant_expert"]
    assert list(path[0].get_xdata()) == list(range(7))
    assert ax.get_xlabel() == "recurrent step $t$" and ax.get_ylabel() == "expert $e$"
    assert any("g_{t,e}" in other.get_ylabel() for other in fig.axes[1:])  # the colour bar says what it means
    heat = ax.get_images()[0].get_array()
    expected = torch.tensor(program["gates"], dtype=torch.float64)
    assert heat.shape == (3, 7) and torch.allclose(torch.tensor(heat.data).T.double(), expected, atol=1e-6)
    fig.savefig(tmp_path / "gates.png")
    plt.close(fig)
    assert (tmp_path / "gates.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(tmp_path / "gates.png")
    assert pixels.ndim == 3 and pixels.std() > 0.05  # a picture, not a blank canvas


def test_without_matplotlib_everything_else_is_written(tmp_path, fashion_mnist_dir, monkeypatch, capsys):
    save_checkpoint(tiny_revit(), "revit-mini", tmp_path / "student.pt")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    report = analyze.main(analysis_args(tmp_path, fashion_mnist_dir, "--no-interventions"))
    out = tmp_path / "analysis"
    assert report["plots"] == [] and "matplotlib is not installed" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["analysis.json", "gates.csv", "self_cka.csv"]
    assert json.loads((out / "analysis.json").read_text())["gates"]["dominant_expert"] == report["gates"][
        "dominant_expert"]
