"""Planted bugs, one at a time: every equation, loss, prior, schedule and update rule of both papers
(reViT, arXiv 2610.12448; AlterNet, arXiv 2611.08741) has a mutant here, and the test suite must
catch each of them. Run by hand, not in CI (it takes a while; run subsets with -k):

    OMP_NUM_THREADS=1 python tests/mutants.py                  # every mutant
    OMP_NUM_THREADS=1 python tests/mutants.py -k alternet -k lora   # names containing either word
    python tests/mutants.py --check                            # only: does every snippet still match?
    python tests/mutants.py --list

Each mutant is (name, file, [(original snippet, replacement), ...], tests). The repository is copied
once into a temporary folder (the working tree is never touched); for each mutant its file is edited
there, the tests that should catch it run (`pytest -x`), and the file is restored. A mutant is
"caught" when those tests fail, "SURVIVED" when they pass. Those of its tests in README's fast command
(`python -m pytest -q`) run first, those in the deep one (`-m deep`) only if they pass: each line says
which command caught the bug. Before the mutants, the same tests run on the unmodified copy: a
selection that fails without a bug proves nothing ("BASELINE FAILS").

When code is refactored a snippet may stop matching: the mutant is then reported as "STALE" with the
snippet that no longer occurs exactly once, and tests/test_mutants.py (in CI) fails until the entry
is updated to the new code. Snippets are short and distinctive on purpose.
Exit status: 0 if every mutant was caught, 1 otherwise.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EQ = "tests/test_equations.py::"


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    edits: tuple  # ((original, replacement), ...): every original must occur exactly once in `file`
    tests: tuple  # pytest node ids (a bare test name means one of tests/test_equations.py)


def mutant(name, file, original, replacement, *tests, more=()):
    return Mutant(name, file, ((original, replacement), *more), tuple(t if "/" in t else EQ + t for t in tests))


# Test selections of tests/test_equations.py, by what they check.
GATES = ("test_gate_matrix_is_eq1_psi_with_silu_temperature_and_prior",
         "test_router_output_is_softmax_of_z_over_tau_not_z")
FORWARD = ("test_forward_is_eq3_with_the_eq2_merge_of_each_step",)
AUX = ("test_aux_losses_are_eqs_6_8_9_by_value",
       "test_aux_loss_weights_default_to_table_6_and_cosines_are_not_trivial")
ELASTIC = ("test_elastic_depth_renumbers_the_retained_steps_per_image",)
DISTILL = "test_distillation_is_eq5_the_mse_of_the_final_post_norm_tokens"
FOLD = ("test_fold_is_the_reference_forward_as_a_plain_vit", "test_fold_with_given_gates_merges_those_gates")
LORA = ("test_layerwise_lora_runs_adapter_t_at_step_t_and_folds_to_it",
        "test_layerwise_lora_gradient_reaches_each_adapter_as_the_reference_does")
CONTENT = ("test_content_merges_gate_each_image_on_its_own_state",)
ROUTED = ("test_token_dispatch_mechanisms_are_their_papers_routing",)
ALTER_FORWARD = ("test_alternet_forward_is_eqs_1_to_5_per_sequence",)
ALTER_LOSS = ("test_alternet_training_loss_is_eqs_6_to_10_by_value_and_gradient",)
ALTER_TERMS = ("test_each_alternet_loss_term_has_its_own_gradient",)

R, A, T, M = "revit.py", "alternet.py", "train.py", "lib/moe.py"
AT = "tests/test_alternet.py::"

MUTANTS = [
    # --- reViT, Eq. 1: the depth router psi, tau, the depth grid, the prior (App. A.1) ---
    mutant("psi SiLU -> ReLU", R, "hidden = F.silu(F.linear(s.float()", "hidden = F.relu(F.linear(s.float()", *GATES),
    mutant("psi SiLU -> tanh", R, "hidden = F.silu(F.linear(s.float()", "hidden = torch.tanh(F.linear(s.float()",
           *GATES),
    mutant("tau ignored by the gates", R, "torch.softmax(self.gate_logits(coords) / self.temperature, dim=-1)",
           "torch.softmax(self.gate_logits(coords), dim=-1)", *GATES),
    mutant("tau multiplies", R, "torch.softmax(self.gate_logits(coords) / self.temperature, dim=-1)",
           "torch.softmax(self.gate_logits(coords) * self.temperature, dim=-1)", *GATES),
    mutant("depth grid t / L", R, "dtype=torch.float32) / (depth - 1)", "dtype=torch.float32) / depth", *GATES),
    mutant("depth prior dropped", R, "return z + depth_prior(s, self.num_experts, self.router_prior) if",
           "return z if", *GATES),
    mutant("depth prior sign", R, "return -beta * (s.float() - centres)",
           "return beta * (s.float() - centres)", *GATES),
    mutant("depth prior centres", R, "centres = torch.linspace(0.0, 1.0, num_experts",
           "centres = torch.linspace(0.0, 2.0, num_experts", *GATES),
    mutant("psi output layer not zero-initialised", R, "nn.init.zeros_(self.router[2].weight)", "pass",
           "tests/test_revit.py::test_zero_initialised_router_gives_uniform_gates"),
    # --- Eqs. 2-3: the merge, the FFN, the recurrent step, the stem and head ---
    mutant("merge uses uniform gates", R, "(gates.to(dtype) @ p.to(dtype).flatten(1))",
           "(torch.full_like(gates.to(dtype), 1.0 / gates.shape[1]) @ p.to(dtype).flatten(1))", *FORWARD),
    mutant("FFN GELU -> ReLU", R, "F.linear(F.gelu(F.linear(u, w1, b1)), w2, b2)",
           "F.linear(F.relu(F.linear(u, w1, b1)), w2, b2)", *FORWARD),
    mutant("attention heads split wrongly", R, '"b t (three h c) -> three b h t c"',
           '"b t (three c h) -> three b h t c"', *FORWARD),
    mutant("block: attention residual dropped", R, "x = x + self.drop_path(self.ls1(self.attn(self.norm1(x))))",
           "x = self.drop_path(self.ls1(self.attn(self.norm1(x))))", *FORWARD),
    mutant("block: FFN on the wrong norm", R, "ffn(self.norm2(x))", "ffn(self.norm1(x))", *FORWARD),
    mutant("class token gets no final norm", R, "logits = self.head(tokens[:, 0])", "logits = self.head(x[:, 0])",
           *FORWARD),
    mutant("no position embedding", R, "x = x + self.pos_embed  # DeiT III", "x = x + 0 * self.pos_embed  # DeiT III",
           *FORWARD),
    mutant("tau ignored by the step's FFN", R, "g = torch.softmax(z / self.temperature, dim=-1)",
           "g = torch.softmax(z, dim=-1)", "test_training_forward_without_cache_is_the_same_equations"),
    mutant("cached merge uses step 0", R, "[MergedFFN(*(w[t] for w in merged)) for t in range(depth)]",
           "[MergedFFN(*(w[0] for w in merged)) for t in range(depth)]", *FORWARD),
    mutant("merge cache kept across a mode switch", R, "self.merged_ffns = None  # a mode switch", "pass  #",
           "tests/test_revit.py::test_cache_follows_optimizer_steps_of_a_train_eval_loop"),
    mutant("merge cache ignores temperature and prior edits", R,
           "key = (depth, device, ffn.temperature, ffn.router_prior,", "key = (depth, device,",
           "tests/test_revit.py::test_cache_follows_temperature_and_prior_edits"),
    mutant("merge cache recast at every call", R,
           "merged = [w.to(ffn.fc1_weight.dtype) for w in merged]", "merged = list(merged)",
           "tests/test_device.py::test_a_cached_call_casts_no_more_than_deit_iii"),
    mutant("bf16 merge through fp32 bank copies", R, "merged = self.merge(g, self.fc1_weight.dtype)",
           "merged = self.merge(g)",
           "tests/test_device.py::test_a_bf16_dynamic_forward_holds_one_bf16_merged_ffn_beyond_the_cached_forward"),
    # --- App. A.2: Eqs. 6, 8, 9 and their weights (Table 6) ---
    mutant("Eq. 6 entropy of softmax(z), not z / tau", R, "g = torch.softmax(z / temperature, dim=-1)",
           "g = torch.softmax(z, dim=-1)", *AUX),
    mutant("Eq. 6 without / log E", R, "return 1.0 - entropy / math.log(z.shape[-1]), ", "return 1.0 - entropy, ",
           *AUX),
    mutant("Eq. 8 |lse| instead of lse^2", R, "torch.logsumexp(z, dim=-1).pow(2)",
           "torch.logsumexp(z, dim=-1).abs()", *AUX),
    mutant("Eqs. 6, 8 on step 0's gates only", R, "z = self.gate_logits(depth_grid(depth, self.fc1_weight.device))",
           "z = self.gate_logits(depth_grid(depth, self.fc1_weight.device)[:1].expand(depth))", *AUX),
    mutant("Eq. 9 |cos| instead of cos^2", R, "return cos[i, j].pow(2).mean()", "return cos[i, j].abs().mean()", *AUX),
    mutant("Eq. 9 with the diagonal", R, "triu_indices(self.num_experts, self.num_experts, offset=1",
           "triu_indices(self.num_experts, self.num_experts, offset=0", *AUX),
    mutant("Eq. 9 weight x10", R, '"diversity": self.lambda_div * self.diversity()',
           '"diversity": 10 * self.lambda_div * self.diversity()', *AUX),
    mutant("Eq. 6 weighted by lambda_z", R, '"balance": self.lambda_bal * balance.sum() / depth',
           '"balance": self.lambda_z * balance.sum() / depth', *AUX),
    mutant("Eq. 8 summed, not averaged", R, '"z_loss": self.lambda_z * z_loss.sum() / depth',
           '"z_loss": self.lambda_z * z_loss.sum()', *AUX),
    mutant("lambda_bal default 1e-3", R, "balance_weight: float = 1e-2  # λ_bal",
           "balance_weight: float = 1e-3  #",
           "test_aux_loss_weights_default_to_table_6_and_cosines_are_not_trivial"),
    mutant("lambda_div default 1e-2", R, "diversity_weight: float = 1e-3", "diversity_weight: float = 1e-2",
           "test_aux_loss_weights_default_to_table_6_and_cosines_are_not_trivial"),
    mutant("aux losses get no gradient to psi", R, "z = self.router(s)  ", "z = self.router(s).detach()  ",
           "test_aux_losses_backpropagate_to_psi_and_the_bank_as_the_formulas_do"),
    # --- §3.2: elastic depth ---
    mutant("elastic: coordinates not renumbered", R, "rank.clamp_min(0).float() / (retained - 1).clamp_min(1).float()",
           "rank.clamp_min(0).float() / (keep.shape[1] - 1)", *ELASTIC),
    mutant("elastic: grid coordinates", R, "coords = elastic_plan(keep)",
           "coords = elastic_plan(torch.ones_like(keep))",
           *ELASTIC),
    mutant("elastic: a dropped step still runs", R, "rows = keep[:, t].nonzero().squeeze(1)",
           "rows = keep[:, t].new_ones(keep.shape[0]).nonzero().squeeze(1)", *ELASTIC),
    # --- §3.1: fold ---
    mutant("fold: gate row 0 for every block", R, "self.merge(g.unsqueeze(0))", "self.merge(gates[:1])", *FOLD),
    mutant("fold: gates of the trained depth", R, "steps = (model.block.unrolled_states(depth, gates)",
           'steps = (model.block.unrolled_states(depth, model.gate_matrix()[:depth] if gates is None and '
           'isinstance(model.block.mlp, MergedExpertFFN) else gates)', *FOLD),
    mutant("fold: the plain ViT left on the CPU", R,
           "VisionTransformer(config).to(device=model.cls_token.device, dtype=model.cls_token.dtype)",
           "VisionTransformer(config)", "tests/test_train.py::test_fold_and_its_check_with_the_model_on_a_device"),
    # --- Table 1's baselines: Raptor's schedule, DeiT III's LayerScale ---
    mutant("Raptor thresholds", R, "known = {2: [7], 3: [7, 10], 4: [4, 7, 10]}",
           "known = {2: [6], 3: [6, 9], 4: [3, 6, 9]}", "test_raptor_runs_its_blocks_on_raptors_segments"),
    mutant("Raptor thresholds not scaled with L", R, "scaled = [round(th * depth / 12)",
           "scaled = [round(th * depth // 12)",
           "test_raptor_runs_its_blocks_on_raptors_segments"),
    mutant("DeiT III LayerScale 1e-5", R, "DEIT3 = dict(layer_scale_init=1e-4)", "DEIT3 = dict(layer_scale_init=1e-5)",
           "tests/test_revit.py::test_deit3_numerics",
           "tests/test_revit.py::test_raptor_presets_keep_layer_scale_like_deit3"),
    # --- App. B: content merges (SMEAR, Lory, the feature-only control of Fig. 2) ---
    mutant("content merge: image 0's gates for all", M, "merged = self.merge(torch.softmax(z, dim=-1))",
           "merged = self.merge(torch.softmax(z, dim=-1)[:1].expand_as(z))", *CONTENT),
    mutant("SMEAR pools the class token", M, "return self.merged_forward(u, u.mean(1))",
           "return self.merged_forward(u, u[:, 0])", *CONTENT),
    mutant("Lory routes on the current step", M,
           "source = torch.where(self.seen[rows].unsqueeze(1), self.previous[rows], pooled)", "source = pooled",
           *CONTENT),
    mutant("feature-only normaliser", M, "self.pool(balance_sum=balance.sum(), z_sum=z_loss.sum(), rows=z.shape[0])",
           "self.pool(balance_sum=balance.sum(), z_sum=z_loss.sum(), rows=1)",
           "test_feature_only_control_carries_eqs_6_8_9_over_every_gate_of_every_step"),
    mutant("feature-only tau 2", M, "balance, z_loss = gate_penalties(z, 1.0)",
           "balance, z_loss = gate_penalties(z, 2.0)",
           "test_feature_only_control_carries_eqs_6_8_9_over_every_gate_of_every_step"),
    # --- App. B: token dispatch (DeepSeek-V3, Qwen3, MoEUT) ---
    mutant("DeepSeek-V3 bias in the gate value", M, "gates = scores.gather(1, expert_index)",
           "gates = (scores + self.expert_bias.float()).gather(1, expert_index)", *ROUTED),
    mutant("DeepSeek-V3 no renormalisation", M, "return expert_index, gates / gates.sum(-1, keepdim=True)",
           "return expert_index, gates", *ROUTED),
    mutant("DeepSeek-V3 no shared expert", M, "return y if self.shared is None else y + self.shared.mixture(x)",
           "return y", *ROUTED),
    mutant("DeepSeek-V3 bias update sign", M, "torch.sign(load.mean() - load)", "torch.sign(load - load.mean())",
           "test_remoe_controller_and_deepseek_bias_follow_their_update_rules"),
    mutant("DeepSeek-V3 bias not zero-mean", M, "self.expert_bias -= self.expert_bias.mean()", "pass",
           "test_remoe_controller_and_deepseek_bias_follow_their_update_rules"),
    mutant("Qwen3 no renormalisation", M, "return expert_index, top / top.sum(-1, keepdim=True)",
           "return expert_index, top", *ROUTED),
    mutant("Qwen3 balance without E", M, "self.balance_weight * self.num_experts * (f * P).sum()",
           "self.balance_weight * (f * P).sum()", "test_qwen3_global_batch_balance_loss_pools_every_step"),
    mutant("Qwen3 f over tokens, not choices", M, "f = counts / tokens ", "f = counts / tokens / self.top_k ",
           "test_qwen3_global_batch_balance_loss_pools_every_step"),
    mutant("MoEUT renormalised", M, "return expert_index, scores",
           "return expert_index, scores / scores.sum(-1, keepdim=True)",
           *ROUTED),
    mutant("MoEUT balance sign", M, '{"balance": self.balance_weight * neg_entropy}',
           '{"balance": -self.balance_weight * neg_entropy}',
           "test_moeut_balance_is_minus_the_entropy_of_the_mean_selection"),
    # --- App. B: output mixtures (ReMoE, Soft-MoE) ---
    mutant("ReMoE softplus gates", M, "gates = F.relu(logits)", "gates = F.softplus(logits)", *ROUTED),
    mutant("ReMoE L1 over n, not n^2", M, '(stats["tokens"] ** 2 * k)', '(stats["tokens"] * k)',
           "test_remoe_l1_penalty_is_load_balanced_over_all_steps"),
    mutant("ReMoE controller reversed", M, "(sparsity < self.target_sparsity) - (sparsity > self.target_sparsity)",
           "(sparsity > self.target_sparsity) - (sparsity < self.target_sparsity)",
           "test_remoe_controller_and_deepseek_bias_follow_their_update_rules"),
    mutant("Soft-MoE dispatch over slots", M, "return torch.softmax(logits, dim=1), torch.softmax(logits, dim=2)",
           "return torch.softmax(logits, dim=2), torch.softmax(logits, dim=2)", "test_soft_moe_slots"),
    mutant("Soft-MoE tokens not l2-normalised", M, "logits = F.normalize(u.float(), dim=-1) @ slots",
           "logits = u.float() @ slots", "test_soft_moe_slots"),
    # --- App. B.1: layer-wise LoRA ---
    mutant("LoRA update uses adapter 0", M, 'getattr(self, f"{name}_down")[t]), getattr(self, f"{name}_up")[t])',
           'getattr(self, f"{name}_down")[0]), getattr(self, f"{name}_up")[0])', *LORA),
    mutant("LoRA fold uses adapter 0", M,
           'getattr(self, f"{name}_up")[t].float() @ getattr(self, f"{name}_down")[t].float()',
           'getattr(self, f"{name}_up")[0].float() @ getattr(self, f"{name}_down")[0].float()', *LORA),
    mutant("LoRA adapter 0 in update and fold", M,
           'getattr(self, f"{name}_down")[t]), getattr(self, f"{name}_up")[t])',
           'getattr(self, f"{name}_down")[0]), getattr(self, f"{name}_up")[0])', *LORA,
           more=[('getattr(self, f"{name}_up")[t].float() @ getattr(self, f"{name}_down")[t].float()',
                  'getattr(self, f"{name}_up")[0].float() @ getattr(self, f"{name}_down")[0].float()')]),
    mutant("LoRA B_t gets no gradient", M, 'getattr(self, f"{name}_up")[t])',
           'getattr(self, f"{name}_up")[t].detach())',
           *LORA[1:]),
    mutant("LoRA proj update on the block input", M, 'return self.proj(h) + lora.update("proj", step, h)',
           'return self.proj(h) + lora.update("proj", step, x)', *LORA),
    mutant("LoRA B_t random at init", M, 'nn.Parameter(torch.zeros(depth, fan_out, rank))',
           'nn.Parameter(torch.randn(depth, fan_out, rank))',
           "tests/test_moe.py::test_lora_starts_as_the_tied_block_and_runs_only_its_depth"),

    # --- AlterNet, Eqs. 1-3: depth encoding, router, gated residual step ---
    mutant("alternet: t = d / D", A, "t = iteration / (max_depth - 1) if max_depth > 1",
           "t = iteration / max_depth if max_depth > 1",
           *ALTER_FORWARD),
    mutant("alternet: sin/cos order", A, "torch.stack([angles.sin(), angles.cos()])",
           "torch.stack([angles.cos(), angles.sin()])",
           "test_depth_encoding_is_vaswanis_sinusoid_of_t_and_of_one_minus_t", *ALTER_FORWARD),
    mutant("alternet: encoding frequencies", A, "torch.arange(0, dim, 2, dtype=torch.float32) / dim)",
           "torch.arange(0, dim, 2, dtype=torch.float32) / (2 * dim))",
           "test_depth_encoding_is_vaswanis_sinusoid_of_t_and_of_one_minus_t", *ALTER_FORWARD),
    mutant("alternet: budget signal e_t, not e_(1-t)", A, "encodings.append(depth_encoding(1 - t, dim))",
           "encodings.append(depth_encoding(t, dim))", *ALTER_FORWARD),
    mutant("alternet: router on the final position", A,
           "h = at_last(x, last)  # (n, H)",
           "h = x[:, -1]  # (n, H)", *ALTER_FORWARD),
    mutant("alternet: no logit clamp", A, "logits.clamp(-clamp, clamp)", "logits",
           "test_router_logits_are_clamped_before_top_k_and_the_gates"),
    mutant("alternet: Eq. 2 softmax over all experts", A, "log_gates = top_logits.log_softmax(-1)",
           "log_gates = router_logits.log_softmax(-1).gather(1, expert_indices)", *ALTER_FORWARD),
    mutant("alternet: Eq. 3 not residual", A, "x_next = x + update", "x_next = update", *ALTER_FORWARD),
    mutant("alternet: expert drops its attention update", A,
           "return attn_update + self.ffn(self.norm2(x + attn_update))",
           "return self.ffn(self.norm2(x + attn_update))", *ALTER_FORWARD),
    mutant("alternet: attention not causal", A, "is_causal=True)", "is_causal=False)", *ALTER_FORWARD),
    mutant("alternet: no position embedding", A, "x = self.tok_emb(tokens) + self.pos_emb(",
           "x = self.tok_emb(tokens) + 0 * self.pos_emb(",
           *ALTER_FORWARD),
    # --- AlterNet, Eqs. 4-5: halting ---
    mutant("alternet: Eq. 4 ignores the gates", A,
           "log_halt = torch.logsumexp(log_gates + F.logsigmoid(halt_logits), dim=-1)",
           "log_halt = torch.logsumexp(F.logsigmoid(halt_logits), dim=-1) - math.log(halt_logits.shape[-1])",
           *ALTER_FORWARD),
    mutant("alternet: halt head on the last position", A,
           "lhat = halt_logit(expert.halt_head, at_last(y, take(last, rows)))",
           "lhat = halt_logit(expert.halt_head, y[:, -1])", *ALTER_FORWARD),
    mutant("alternet: Eq. 5 last iteration not forced", A,
           "log_halt = log_halt.masked_fill(before, -math.inf).masked_fill(last, 0.0)",
           "log_halt = log_halt.masked_fill(before, -math.inf)", *ALTER_FORWARD),
    mutant("alternet: Eq. 5 unhalted includes d", A,
           "torch.cat([torch.zeros_like(log_continue[:, :1]), log_continue[:, :-1]], dim=1).cumsum(1)",
           "log_continue.cumsum(1)", *ALTER_FORWARD),
    mutant("alternet: threshold on lambda_d, not the cumulative mass", A,
           "return 1 - (log_unhalted + log_continue).exp() >= halt_threshold",
           "return log_halt.exp() >= halt_threshold",
           "test_halt_threshold_stops_when_the_cumulative_halting_probability_passes_it"),
    mutant("alternet: threshold on p_d, not the cumulative mass", A,
           "return 1 - (log_unhalted + log_continue).exp() >= halt_threshold",
           "return (log_unhalted + log_halt).exp() >= halt_threshold",
           "test_halt_threshold_stops_when_the_cumulative_halting_probability_passes_it",
           AT + "test_threshold_and_cap_stop_where_they_should"),
    mutant("alternet: threshold on the mass halted before this iteration", A,
           "return 1 - (log_unhalted + log_continue).exp() >= halt_threshold",
           "return 1 - log_unhalted.exp() >= halt_threshold",
           "test_halt_threshold_stops_when_the_cumulative_halting_probability_passes_it",
           AT + "test_threshold_and_cap_stop_where_they_should"),
    mutant("alternet: global halt head on the last position", A,
           "halt_logit(self.halt_head, at_last(x_next, last))",
           "halt_logit(self.halt_head, x_next[:, -1])", *ALTER_LOSS),
    mutant("alternet: Model I gets a KL term", A, "if cfg.halting:  # Model I: p is one-hot at D",
           "if True:  # Model I: p is one-hot at D", *ALTER_LOSS),
    # --- AlterNet, Eqs. 6-10: the losses ---
    mutant("alternet: Eq. 7 p detached", A, "task_loss = (p * step_ce.T).sum() / has_target.sum()",
           "task_loss = (p.detach() * step_ce.T).sum() / has_target.sum()", *ALTER_LOSS),
    mutant("alternet: Eq. 7 scores iteration d on x_d", A, "task_loss = (p * step_ce.T).sum() / has_target.sum()",
           "task_loss = (p[:, 1:] * step_ce.T[:, :-1]).sum() / has_target.sum()", *ALTER_LOSS),
    mutant("alternet: Gaussian prior mean D/2 + 1", A, "mean, std = max_depth / 2, max_depth / 4",
           "mean, std = max_depth / 2 + 1, max_depth / 4", *ALTER_LOSS),
    mutant("alternet: Gaussian prior std D/2", A, "mean, std = max_depth / 2, max_depth / 4",
           "mean, std = max_depth / 2, max_depth / 2", *ALTER_LOSS),
    mutant("alternet: geometric prior ratio p", A, "log_q = (iterations - 1) * math.log1p(-geometric_p)",
           "log_q = (iterations - 1) * math.log(geometric_p)", *ALTER_LOSS),
    mutant("alternet: prior not normalised", A, "return log_q.log_softmax(0)", "return log_q", *ALTER_LOSS),
    mutant("alternet: prior normalised by softmax, then log", A, "return log_q.log_softmax(0)",
           "return log_q.softmax(0).log()",
           "tests/test_alternet.py::test_kl_and_loss_are_finite_at_an_extrapolated_cap"),
    mutant("alternet: KL(q || p)", A, "safe_log_p.exp() * (safe_log_p - log_q)", "log_q.exp() * (log_q - safe_log_p)",
           *ALTER_LOSS),
    mutant("alternet: load balance without E", A, "return num_experts * (fraction * mean_probability).sum()",
           "return (fraction * mean_probability).sum()", *ALTER_LOSS),
    mutant("alternet: load balance with sigmoid P", A, "mean_probability = pooled_mean(router_logits.softmax(-1), ran)",
           "mean_probability = pooled_mean(router_logits.sigmoid(), ran)", *ALTER_LOSS),
    mutant("alternet: z-loss not squared", A, 'torch.logsumexp(flat["raw_router_logits"], dim=-1).pow(2)',
           'torch.logsumexp(flat["raw_router_logits"], dim=-1).abs()', *ALTER_LOSS),
    mutant("alternet: z-loss on the clamped logits", A, 'torch.logsumexp(flat["raw_router_logits"]',
           'torch.logsumexp(flat["router_logits"]', "tests/test_alternet.py::test_z_loss_reads_the_logits_before_the_clamp"),
    mutant("alternet: L_PN counts rows without a target", A, "task_loss = (p * step_ce.T).sum() / has_target.sum().clamp(min=1)",
           "task_loss = (p * step_ce.T).sum() / scored.shape[0]",
           "tests/test_alternet.py::test_a_row_without_scored_targets_neither_counts_nor_trains"),
    mutant("alternet: L_RIR trains rows without a target", A, "counted = has_target.expand_as(p) if ran is None else ran & has_target",
           "counted = torch.ones_like(p, dtype=torch.bool) if ran is None else ran",
           "tests/test_alternet.py::test_a_row_without_scored_targets_neither_counts_nor_trains"),
    mutant("alternet: balance weighted by a_z", A, "balance=cfg.balance_weight * load_balance_loss(",
           "balance=cfg.z_loss_weight * load_balance_loss(", *ALTER_LOSS),
    mutant("alternet: Eq. 10 slope 5", A, "torch.sigmoid(50 * ((ce[:, :-1] - ce[:, 1:]).clamp(min=0) - 0.005))",
           "torch.sigmoid(5 * ((ce[:, :-1] - ce[:, 1:]).clamp(min=0) - 0.005))", *ALTER_LOSS),
    mutant("alternet: Eq. 10 improvement reversed", A, "torch.sigmoid(50 * ((ce[:, :-1] - ce[:, 1:])",
           "torch.sigmoid(50 * ((ce[:, 1:] - ce[:, :-1])", *ALTER_LOSS),
    mutant("alternet: Eq. 9 target w, not 1 - w", A, "target = 1 - improvement",
           "target = improvement", *ALTER_LOSS),
    mutant("alternet: L_RIR reaches the experts (either halt head)", A, "for v in (h, h.detach()))",
           "for v in (h, h))", *ALTER_TERMS),
    mutant("alternet: L_RIR reaches the router", A,
           "rir = halting_log_probabilities(log_gates.detach(), halt_logits[1])",
           "rir = halting_log_probabilities(log_gates, halt_logits[1])", *ALTER_TERMS),
    # --- AlterNet, §4: the curriculum and the a_KL ramp ---
    mutant("alternet: curriculum one iteration short", A, "num_iterations) - 1 if self.training else 0",
           "num_iterations) - 2 if self.training else 0",
           "test_curriculum_forces_the_last_iteration_and_the_kl_ramp_starts_at_its_end"),
    mutant("alternet: inference halts before the minimum depth", A,
           "if iteration < first_halt or (halt_threshold is None and not sample_halting):",
           "if halt_threshold is None and not sample_halting:",
           "tests/test_alternet.py::test_minimum_depth_release_abrupt_or_gradual"),
    # --- AlterNet under torch.compile: the static dispatch and the masked inference loop ---
    mutant("alternet: dispatch gates every expert 1", A, "take((gates * chosen).sum(-1), rows)",
           "take(chosen.float().sum(-1), rows)", *ALTER_FORWARD),
    mutant("alternet: compiled inference keeps running halted rows", A,
           "return torch.where(running.view(-1, *[1] * (full.dim() - 1)), part, full)", "return part",
           "tests/test_alternet.py::test_a_compiled_generate_step_halts_as_eager"),
    mutant("alternet: a_KL ramp from step 0", A, "max(0.0, since_release / ramp)",
           "max(0.0, step / ramp)",
           "test_curriculum_forces_the_last_iteration_and_the_kl_ramp_starts_at_its_end"),
    mutant("alternet: halt bias init -1", A, "halt_bias_init: float = -3.0", "halt_bias_init: float = -1.0",
           "tests/test_alternet.py"),

    # --- train.py: the schedule, weight decay (DeiT III recipe, Table 6) ---
    mutant("train: warmup from 0", T, 'return sched["warmup_lr"] + (peak - sched["warmup_lr"]) * step / warmup',
           "return peak * step / warmup", "tests/test_train.py::test_warmup_cosine_schedule"),
    mutant("train: quarter cosine", T, "(1 + math.cos(math.pi * progress))", "(1 + math.cos(math.pi * progress / 2))",
           "tests/test_train.py::test_warmup_cosine_schedule"),
    mutant("train: linear decay, not cosine", T,
           'sched["min_lr"] + 0.5 * (peak - sched["min_lr"]) * (1 + math.cos(math.pi * progress))',
           'sched["min_lr"] + (peak - sched["min_lr"]) * (1 - progress)',
           "tests/test_train.py::test_the_schedule_tells_cosine_from_linear_decay_and_warmup_from_its_off_by_ones"),
    mutant("train: warmup ramp a step late", T, "* step / warmup", "* (step + 1) / (warmup + 1)",
           "tests/test_train.py::test_the_schedule_tells_cosine_from_linear_decay_and_warmup_from_its_off_by_ones"),
    mutant("train: cosine to 0, floored at min_lr", T,
           'return sched["min_lr"] + 0.5 * (peak - sched["min_lr"]) * (1 + math.cos(math.pi * progress))',
           'return max(sched["min_lr"], 0.5 * peak * (1 + math.cos(math.pi * progress)))',
           "tests/test_train.py::test_the_schedule_tells_cosine_from_linear_decay_and_warmup_from_its_off_by_ones"),
    mutant("train: evaluation averages the batches' means", "lib/tasks.py",
           "sums[key] = sums.get(key, 0) + value", "sums[key] = sums.get(key, 0) + value / len(labels)",
           "tests/test_train.py::test_the_evaluation_averages_over_images_not_over_batches",
           more=(("count += len(labels)", "count += 1"),)),
    mutant("language: bpb divides by tokens per byte", "lib/language.py",
           '"bpb": loss * self.tokens_per_byte / math.log(2)', '"bpb": loss / self.tokens_per_byte / math.log(2)',
           "tests/test_train.py::test_bits_per_byte_are_nats_per_token_times_tokens_per_byte_over_ln_2",
           more=(("causal_bpb=loss * self.tokens_per_byte / math.log(2)",
                  "causal_bpb=loss / self.tokens_per_byte / math.log(2)"),)),
    mutant("language: bpb in nats", "lib/language.py", '"bpb": loss * self.tokens_per_byte / math.log(2)',
           '"bpb": loss * self.tokens_per_byte',
           "tests/test_train.py::test_bits_per_byte_are_nats_per_token_times_tokens_per_byte_over_ln_2"),
    mutant("train: micro-batch losses not divided by --grad-accum", T, "(loss / cfg.grad_accum).backward()",
           "loss.backward()",
           "tests/test_train.py::test_gradient_accumulation_takes_the_step_and_logs_the_loss_of_the_whole_batch"),
    mutant("train: the logged loss summed over micro-batches", T, "loss_sum += loss.detach() / cfg.grad_accum",
           "loss_sum += loss.detach()",
           "tests/test_train.py::test_gradient_accumulation_takes_the_step_and_logs_the_loss_of_the_whole_batch"),
    mutant("train: square-root lr scaling", T, "peak = cfg.lr * cfg.batch_size / cfg.lr_batch if",
           "peak = cfg.lr * math.sqrt(cfg.batch_size / cfg.lr_batch) if",
           "tests/test_train.py::test_the_schedule_scales_the_peak_linearly_with_the_batch_and_counts_warmup_in_steps"),
    mutant("train: warmup epochs truncated to steps", T, "round(cfg.warmup_epochs * steps_per_epoch)",
           "int(cfg.warmup_epochs * steps_per_epoch)",
           "tests/test_train.py::test_the_schedule_scales_the_peak_linearly_with_the_batch_and_counts_warmup_in_steps"),
    mutant("train: resume keeps the file's optimizer settings and fused AdamW", "lib/resume.py", "        group.update(own)\n",
           "        pass\n", "tests/test_train.py::test_resume_applies_this_device_s_fused_choice",
           "tests/test_hostile.py::test_a_resume_takes_the_optimizer_settings_from_its_config_not_the_file"),
    mutant("train: 1-D weights decayed", "lib/build.py", "decays = p.ndim >= 2 and", "decays = p.ndim >= 1 and",
           "tests/test_train.py::test_weight_decay_groups"),
    mutant("train: biases decayed", "lib/build.py", 'and not name.endswith("bias") and', "and",
           "tests/test_train.py::test_no_bias_is_decayed_for_any_preset"),
    mutant("train: psi's output layer decayed", R, '"cls_token", "block.mlp.router.2.weight"}', '"cls_token"}',
           "tests/test_train.py::test_weight_decay_groups"),
    mutant("train: DeiT III BCE on soft targets", T, "targets.gt(0.0).to(logits.dtype)",
           "targets.to(logits.dtype)",
           "test_deit3_bce_binarises_the_mixed_targets_and_ce_takes_them_soft"),
    mutant("train: gradient clipping ignored", T, "cfg.grad_clip or math.inf)", "math.inf)",
           "tests/test_train.py::test_gradient_clipping_scales_the_whole_gradient_to_its_max_norm"),
    mutant("train: psi's group at the base lr", T, 'group["lr"] = lr * group["lr_scale"] if "lr_scale" in group else lr',
           'group["lr"] = lr', "tests/test_planted.py::test_router_lr_scale_trains_psi_at_m_times_the_lr"),
    mutant("train: psi split off at m = 1", "lib/build.py", "if router_lr_scale != 1 else set()", "",
           "tests/test_planted.py::test_router_lr_scale_puts_psi_alone_in_a_third_group"),
    mutant("train: psi's group decayed", "lib/build.py", '{"params": psi, "weight_decay": 0.0,', '{"params": psi, "weight_decay": weight_decay,',
           "tests/test_planted.py::test_router_lr_scale_puts_psi_alone_in_a_third_group"),
    mutant("train: no gate spread in the log", T, '"eval": run.metrics, **gates}', '"eval": run.metrics}',
           "tests/test_planted.py::test_a_planted_run_logs_the_gate_spread_at_every_evaluation"),
    # --- the planted-depth task (ours): the target is LN(f_L(... f_1(x))) of each patch token ---
    mutant("planted: the class token scored", "lib/planted.py", 'F.mse_loss(out["tokens"][:, 1:].float()',
           'F.mse_loss(out["tokens"][:, :-1].float()',
           "tests/test_planted.py::test_planted_loss_is_the_mse_against_the_slow_composition"),
    mutant("planted: the maps in reverse order", "lib/planted.py", "zip(self.w1.to(x.device), self.w2.to(x.device))",
           "zip(self.w1.flip(0).to(x.device), self.w2.flip(0).to(x.device))",
           "tests/test_planted.py::test_planted_loss_is_the_mse_against_the_slow_composition"),
    mutant("planted: patches read column-major", "lib/planted.py", "-> b (gy gx) (c py px)", "-> b (gx gy) (c py px)",
           "tests/test_planted.py::test_patch_tokens_read_each_patch_channel_row_column"),
    mutant("planted: no final layer norm", "lib/planted.py", "        return F.layer_norm(x, x.shape[-1:])\n",
           "        return x\n", "tests/test_planted.py::test_planted_loss_is_the_mse_against_the_slow_composition"),
    mutant("planted: one map at every depth", "lib/planted.py",
           "self.w2 = torch.randn(depth, dim, hidden, generator=g)",
           "self.w2 = torch.randn(1, dim, hidden, generator=g).expand(depth, -1, -1)",
           "tests/test_planted.py::test_the_maps_are_fixed_by_their_seed_and_differ_by_depth",
           more=(("self.w1 = torch.randn(depth, hidden, dim, generator=g)",
                  "self.w1 = torch.randn(1, hidden, dim, generator=g).expand(depth, -1, -1)"),)),
    mutant("tables: the planted task's untied ViT not set against E = 1", "lib/tables.py",
           'versus = tied and r is not tied and (r["num_experts"] or not acc)',
           'versus = tied and r is not tied and r["num_experts"]',
           "tests/test_planted.py::test_the_planted_grid_sets_the_untied_vit_against_the_tied_block_too"),
    # --- the guards against hostile input: boundaries on their edge, rules on inputs where twins differ ---
    mutant("loader: storage bound non-strict", "lib/checkpoint.py",
           "if repeats or have < max(t.numel(), extent) * t.element_size():",
           "if repeats or have <= max(t.numel(), extent) * t.element_size():",
           "tests/test_hostile.py::test_a_snapshot_continues_in_a_new_folder"),
    mutant("loader: stride 0 allowed", "lib/checkpoint.py", "repeats = any(s <= 0 for", "repeats = any(s < 0 for",
           "tests/test_hostile.py::test_edited_checkpoints_are_refused_before_anything_is_written"),
    mutant("loader: complex NaN passes", "lib/checkpoint.py",
           "bad = (value.is_floating_point() or value.is_complex()) and", "bad = value.is_floating_point() and",
           "tests/test_hostile.py::test_every_float_and_complex_dtype_is_under_the_finiteness_rule"),
    mutant("loader: a float weight takes only its own dtype", "lib/checkpoint.py",
           "return given.is_floating_point if expected.is_floating_point else given == expected",
           "return given == expected",
           "tests/test_hostile.py::test_a_float_weight_takes_every_float_dtype_and_nothing_else"),
    mutant("loader: a float weight takes ints and bools", "lib/checkpoint.py",
           "return given.is_floating_point if expected.is_floating_point else given == expected",
           "return not given.is_complex if expected.is_floating_point else given == expected",
           "tests/test_hostile.py::test_a_float_weight_takes_every_float_dtype_and_nothing_else"),
    mutant("boundary: ranges open at the top", "lib/boundary.py", "return (lambda v: low <= v <= high),",
           "return (lambda v: low <= v < high),",
           "tests/test_hostile.py::test_a_number_on_its_bound_is_taken_and_one_past_it_refused"),
    mutant("boundary: (0, high] ranges open", "lib/boundary.py", "return (lambda v: low < v <= high),",
           "return (lambda v: low < v < high),",
           "tests/test_hostile.py::test_a_number_on_its_bound_is_taken_and_one_past_it_refused"),
    mutant("boundary: --seed bound one too high", "lib/boundary.py", '"seed": closed(0, 2 ** 32 - 1)',
           '"seed": closed(0, 2 ** 32)',
           "tests/test_hostile.py::test_depth_bounds_take_their_edges"),
    mutant("boundary: --eval-depths bound strict", "lib/boundary.py", "and minimum <= int(d) <= MAX_DEPTH",
           "and minimum <= int(d) < MAX_DEPTH", "tests/test_hostile.py::test_depth_bounds_take_their_edges"),
    mutant("boundary: depth minimum strict", "lib/boundary.py", "and minimum <= int(d) <= MAX_DEPTH",
           "and minimum < int(d) <= MAX_DEPTH", "tests/test_hostile.py::test_depth_bounds_take_their_edges"),
    mutant("cli: a saved depth bound strict", "lib/boundary.py", "and config[name] > MAX_DEPTH:",
           "and config[name] >= MAX_DEPTH:", "tests/test_hostile.py::test_depth_bounds_take_their_edges"),
    mutant("boundary: a run's files overwritten", "lib/boundary.py",
           "if path.exists() and path.name in RUN_FILES:", "if False:", "tests/test_hostile.py::test_no_tool_overwrites_a_run"),
    mutant("resume: missing state refused at step 0", "lib/resume.py", "if refused and step > 0:",
           "if refused and step >= 0:",
           "tests/test_hostile.py::test_a_checkpoint_at_step_0_resumes_without_optimizer_state"),
    mutant("resume: half the optimizer state accepted", "lib/resume.py", "if refused and step > 0:",
           "if False:", "tests/test_hostile.py::test_edited_checkpoints_are_refused_before_anything_is_written"),
    mutant("data: a downloaded archive extracted in place", "lib/data.py", "tar.extractall(staging, ",
           "tar.extractall(target, ", "tests/test_data.py::test_a_cut_archive_leaves_no_data_that_looks_whole"),
    mutant("data: CIFAR labels unchecked", "lib/data.py", "type(y) is int and 0 <= y < classes", "True",
           "tests/test_data.py::test_cifar_archives_with_wrong_contents"),
    mutant("language: gpt2 tokenizer online without --download", "lib/language.py",
           '([] if allowed else ["getaddrinfo", "socket.connect"])', "[]",
           "tests/test_data.py::test_the_gpt2_tokenizer_reaches_the_network_only_with_download"),
    mutant("cli: Ctrl-C as a traceback", "lib/cli.py", "    except KeyboardInterrupt:\n        raise SystemExit(f\"{script_name()}: stopped",
           "    except ZeroDivisionError:\n        raise SystemExit(f\"{script_name()}: stopped",
           "tests/test_hostile.py::test_ctrl_c_ends_every_command_in_one_line"),
    mutant("train: a NaN evaluation logged", T, "place = non_finite_place(results)", "place = None",
           "tests/test_faults.py::test_a_non_finite_evaluation_stops_the_run_and_is_never_written"),
    mutant("checkpoint: the log cut in place", "lib/checkpoint.py", 'atomic_write_text(self.metrics, "".join(',
           'self.metrics.write_text("".join(',
           "tests/test_faults.py::test_a_kill_while_resume_cuts_the_log_leaves_the_log_whole"),
    mutant("checkpoint: fcntl imported where Windows has none", "lib/checkpoint.py",
           "try:  # the run folder's lock: flock on Unix, msvcrt.locking on Windows\n    import fcntl\nexcept ImportError:\n"
           "    fcntl = None", "import fcntl",
           "tests/test_faults.py::test_every_entry_point_helps_without_fcntl_or_fork"),
    mutant("checkpoint: the run folder's lock not taken", "lib/checkpoint.py",
           "fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)", "pass",
           "tests/test_faults.py::test_two_processes_cannot_share_a_folder"),
    mutant("checkpoint: non-finite weights saved", "lib/checkpoint.py",
           "        if bad:\n            return (f\"weights became non-finite", "        if False:\n            return (f\"",
           "tests/test_faults.py::test_non_finite_weights_are_never_saved"),
    mutant("memory: the planned micro-steps not kept", "lib/memory.py", "        cfg.grad_accum = accum\n",
           "        pass\n", "tests/test_memory.py::test_train_raises_grad_accum_to_fit_the_device"),
    mutant("bench: a language preset takes an image recipe", "bench.py",
           'if language and args.recipe not in (None, "text"):', "if False:",
           "tests/test_bench.py::test_hostile_inputs_are_one_line_errors_before_any_work"),
    mutant("bench: --seq-len taken by a vision preset", "bench.py",
           "if not language and args.seq_len is not None:", "if False:",
           "tests/test_bench.py::test_hostile_inputs_are_one_line_errors_before_any_work"),
    mutant("bench: --rows split inside a listed name", "bench.py", 'if rows and f"{rows[-1]}, {name}" in known:',
           "if False:", "tests/test_bench.py::test_every_listed_row_can_be_chosen_by_its_name"),
    mutant("bench: a mistyped flag matched against bench.py's own", "bench.py",
           "parser.commands[args.command].error(", "parser.error(",
           "tests/test_bench.py::test_a_mistyped_flag_gets_the_closest_flag_of_its_subcommand"),
    mutant("bench: memory's estimate without its recipe", "bench.py", 'print(f"{args.arch}, recipe {recipe}: ',
           'print(f"{args.arch}: ', "tests/test_memory.py::test_bench_memory_reports_every_part_and_the_fit"),
    mutant("probes: a NaN metric written", "tools/probes.py", "    if place:  # as a non-finite loss stops",
           "    if False:  # as a non-finite loss stops",
           "tests/test_probes.py::test_a_metric_that_is_not_a_number_stops_the_probe_and_is_never_written"),
    mutant("sweep: seeds at different depths averaged", "tools/sweep.py",
           'if any(seen != depths[0] for seen in depths):',
           'if False:', "tests/test_sweep.py::test_a_cell_whose_seeds_were_evaluated_at_different_depths_is_refused"),
    mutant("sweep: population std over seeds", "tools/sweep.py", '"std": statistics.stdev(values) if',
           '"std": statistics.pstdev(values) if',
           "tests/test_sweep.py::test_shards_split_the_runs_and_the_last_pass_builds_the_table"),
    mutant("sweep: --seeds unbounded", "lib/boundary.py", '"seeds": closed(1, 100),',
           '"seeds": closed(1, 10 ** 9),', "tests/test_sweep.py::test_bad_flags_are_one_line_errors_before_any_work"),
    mutant("boundary: an unwritable parent folder passes", "lib/boundary.py",
           "not path.exists() and not os.access(parent, os.W_OK | os.X_OK)", "False", "tests/test_bench.py::test_a_read_only_working_folder_is_one_line_before_anything_runs"),
    mutant("resume: any parameter may lack state", "lib/resume.py",
           "if not (ROUTED_EXPERT.search(name) or", "if False and (ROUTED_EXPERT.search(name) or",
           "tests/test_hostile.py::test_only_a_routed_expert_may_resume_without_optimizer_state"),
    mutant("resume: a distilled student's head must have state", "lib/resume.py",
           "or distilled and HEAD.search(name))]", "or False)]",
           "tests/test_hostile.py::test_a_distilled_student_killed_mid_run_resumes"),
    # --- boundaries: each rule's comparison, swapped for its strict or non-strict twin ---
    mutant("boundary: Raptor's segment end", R, "return [sum(step > end for end in ends)",
           "return [sum(step >= end for end in ends)", "tests/test_revit.py::test_raptor_segments_match_the_reference_implementation"),
    mutant("boundary: AlterNet's depth index at D = 1", A, "if max_depth > 1 else 0.0", "if max_depth >= 1 else 0.0",
           AT + "test_z_loss_reads_the_logits_before_the_clamp"),
    mutant("boundary: the curriculum's first halt", A, "before = d < first_halt", "before = d <= first_halt",
           *ALTER_LOSS, AT + "test_curriculum_forces_full_depth_then_releases"),
    mutant("boundary: lambda masked before the minimum depth (loss)", A, "if iteration >= first_halt:  # before the minimum depth",
           "if iteration > first_halt:  # before the minimum depth",
           "test_halt_threshold_stops_when_the_cumulative_halting_probability_passes_it",
           AT + "test_threshold_and_cap_stop_where_they_should"),
    mutant("boundary: the minimum depth's release step", A, "if 0 <= since_release < cfg.min_depth_release_steps:",
           "if 0 <= since_release <= cfg.min_depth_release_steps:", AT + "test_minimum_depth_release_abrupt_or_gradual"),
    mutant("boundary: the abrupt release at step 0", A, "else float(since_release >= 0)", "else float(since_release > 0)",
           AT + "test_kl_ramp_starts_when_the_curriculum_ends"),
    mutant("boundary: no halt before the minimum depth (inference)", A, "if iteration < first_halt or (halt_threshold",
           "if iteration <= first_halt or (halt_threshold", AT + "test_threshold_and_cap_stop_where_they_should",
           "test_halt_threshold_stops_when_the_cumulative_halting_probability_passes_it"),
    mutant("boundary: the halt threshold reached", A, "(log_unhalted + log_continue).exp() >= halt_threshold",
           "(log_unhalted + log_continue).exp() > halt_threshold",
           AT + "test_a_threshold_the_halted_mass_lands_on_exactly_stops_there",
           "test_halt_threshold_stops_when_the_cumulative_halting_probability_passes_it"),
    mutant("boundary: top-k sampling keeps the k-th logit", A, "logits.masked_fill(logits < kth", "logits.masked_fill(logits <= kth",
           AT + "test_sampling_draws_from_the_top_k_softmax_at_the_temperature"),
    mutant("sampling: logits times the temperature", A, "logits = logits / temperature", "logits = logits * temperature",
           AT + "test_sampling_draws_from_the_top_k_softmax_at_the_temperature"),
    mutant("boundary: a window of seq_len tokens", A, "and 1 <= T <= c.seq_len,", "and 1 <= T < c.seq_len,",
           AT + "test_bad_inputs_raise_value_error", AT + "test_generate_uses_halting_and_crops_context"),
    mutant("boundary: halt threshold 1", A, "(0 < halt_threshold <= 1 and not", "(0 < halt_threshold < 1 and not",
           AT + "test_a_threshold_the_halted_mass_lands_on_exactly_stops_there"),
    mutant("boundary: the last token id", A, "((tokens >= 0) & (tokens < V))", "((tokens >= 0) & (tokens <= V))",
           AT + "test_token_ids_are_checked_against_the_vocabulary"),
    mutant("boundary: 2-D weights decay", "lib/build.py", "decays = p.ndim >= 2 and", "decays = p.ndim > 2 and",
           "tests/test_train.py::test_weight_decay_groups", "tests/test_train.py::test_no_bias_is_decayed_for_any_preset"),
    mutant("boundary: stop at the given step", T, "run.step >= cfg.stop_at_step", "run.step > cfg.stop_at_step",
           "tests/test_train.py::test_resume_matches_uninterrupted_run"),
    mutant("boundary: AlterNet's lr at width 256", T, "if width <= 256 else (3e-4", "if width < 256 else (3e-4",
           "tests/test_train.py::test_the_automatic_lr_at_the_widths_that_decide_it"),
    mutant("boundary: Table 6's lr at width 768", T, "if width >= 768 else", "if width > 768 else",
           "tests/test_train.py::test_the_automatic_lr_at_the_widths_that_decide_it"),
    mutant("boundary: ReMoE's sparsity controller at the target", M, "(sparsity < self.target_sparsity) - (",
           "(sparsity <= self.target_sparsity) - (", "tests/test_moe.py::test_remoe_controller_multiplies_or_divides_lambda_by_1_2",
           "test_remoe_controller_and_deepseek_bias_follow_their_update_rules"),
    mutant("boundary: App. B's balance weight at U = 1", M, "1e-3 if budget > 1 else 0.0", "1e-3 if budget >= 1 else 0.0",
           "tests/test_moe.py::test_preset_names_and_table_encoding"),
    mutant("boundary: a probe's backbone file replaced unnoticed", "lib/tasks.py",
           'saved = ckpt["model_config"].get("backbone_sha256") if ckpt else None', "saved = None",
           "tests/test_train.py::test_linear_probe_trains_only_the_head"),
    mutant("boundary: a reViT runs 2 steps or more", "lib/tasks.py", 'if config.arch != "vit" and d < 2:',
           'if config.arch != "vit" and d <= 2:', "tests/test_train.py::test_eval_only_matches_the_training_evaluation_and_leaves_the_file"),
    mutant("boundary: gate spread from E = 2", "lib/tasks.py", "config.num_experts < 2:", "config.num_experts <= 2:",
           "tests/test_planted.py::test_a_planted_run_logs_the_gate_spread_at_every_evaluation"),
    mutant("boundary: 4 patches a side", "lib/tasks.py", "images.image_size // patch < 4", "images.image_size // patch <= 4",
           "tests/test_train.py::test_a_preset_patch_is_kept_down_to_four_patches_a_side"),
    mutant("boundary: halting needs 2 iterations", A, "if log_halt.shape[1] < 2:", "if log_halt.shape[1] <= 2:",
           AT + "test_relative_improvement_loss_trains_the_second_halt_head_at_two_iterations"),
    # --- DeiT III's mixup / cutmix (timm's batch mode), on inputs where each wrong variant differs ---
    mutant("mix: targets weighted by 1 - lam", "lib/data.py", "return x, lam * targets + (1 - lam) * targets.flip(0)",
           "return x, (1 - lam) * targets + lam * targets.flip(0)", "tests/test_data.py::test_mixup_and_cutmix_weigh_each_target_by_what_its_image_holds"),
    mutant("cutmix: the sampled lam, not the clipped box's", "lib/data.py",
           "lam = 1 - (y1 - y0) * (x1 - x0) / (h * w)  # the area actually pasted", "pass", "tests/test_data.py::test_mixup_and_cutmix_weigh_each_target_by_what_its_image_holds"),
    mutant("mixup: the partner is the next image", "lib/data.py", "x = lam * x + (1 - lam) * x.flip(0)",
           "x = lam * x + (1 - lam) * x.roll(1, 0)", "tests/test_data.py::test_mixup_and_cutmix_weigh_each_target_by_what_its_image_holds"),
    mutant("label smoothing over K - 1 classes", "lib/data.py", "self.label_smoothing / self.num_classes",
           "self.label_smoothing / (self.num_classes - 1)", "tests/test_data.py::test_mixup_and_cutmix_weigh_each_target_by_what_its_image_holds"),
    # --- DeiT III's stochastic depth ---
    mutant("drop path without the 1 / (1 - p) rescale", R, "return x * keep / (1.0 - self.drop_prob)", "return x * keep", "tests/test_revit.py::test_drop_path_drops_whole_samples_and_rescales_the_kept_ones"),
    mutant("drop path keeps with probability p", R, ".bernoulli_(1.0 - self.drop_prob)", ".bernoulli_(self.drop_prob)", "tests/test_revit.py::test_drop_path_drops_whole_samples_and_rescales_the_kept_ones"),
    mutant("drop path per element", R, "keep = x.new_empty(x.shape[0], *([1] * (x.ndim - 1)))",
           "keep = x.new_empty(x.shape)", "tests/test_revit.py::test_drop_path_drops_whole_samples_and_rescales_the_kept_ones"),
    mutant("drop path in eval", R, "if self.drop_prob == 0.0 or not self.training:", "if self.drop_prob == 0.0:", "tests/test_revit.py::test_drop_path_drops_whole_samples_and_rescales_the_kept_ones"),
    mutant("sample: a checkpoint's tokenizer loaded online", "lib/language.py",
           "with no_network(allowed=download):", "with no_network(allowed=True):",
           "tests/test_sample.py::test_a_checkpoint_naming_gpt2_cannot_make_tiktoken_fetch"),
    # --- Eq. 5: distillation ---
    mutant("distillation against the pre-norm tokens", "lib/tasks.py", 'task = F.mse_loss(out["tokens"].float()',
           'task = F.mse_loss(out["states"][-1].float()', DISTILL),
    mutant("distillation summed over the tokens", "lib/tasks.py", "task = F.mse_loss(out[\"tokens\"].float(), target.float())",
           'task = F.mse_loss(out["tokens"].float(), target.float(), reduction="sum") / len(target)', DISTILL),
    mutant("distillation score averaged over the batch too", "lib/tasks.py", "reduction=\"sum\") / tokens[0].numel()",
           'reduction="sum") / tokens.numel()', DISTILL),
    # --- adversary round: lock files, linked outputs, finite weights that overflow, data sizes ---
    mutant("cli: the files of an output folder unchecked", "lib/boundary.py",
           "    for name in names:\n        problem = output_problem(", "    for name in ():\n        problem = output_problem(",
           "tests/test_hostile.py::test_no_tool_overwrites_a_run"),
    mutant("boundary: a file the project did not write overwritten", "lib/boundary.py",
           "if path.is_file() and not is_own_output(path):", "if False:",
           "tests/test_cli.py::test_an_output_replaces_only_an_earlier_output_of_the_project",
           "tests/test_hostile.py::test_no_tool_overwrites_a_run"),
    mutant("boundary: a checkpoint's packed weights taken for an export", "lib/boundary.py",
           '"timm", "revit.probe_heads")', '"timm", "revit.probe_heads", "revit.checkpoint")',
           "tests/test_cli.py::test_an_output_replaces_only_an_earlier_output_of_the_project"),
    mutant("boundary: a probe's own heads file refused on a re-run", "lib/boundary.py", '"timm", "revit.probe_heads")',
           '"timm")', "tests/test_probes.py::test_cli_writes_results_and_rejects_bad_input"),
    mutant("resume: an rng state that cannot be restored as a traceback", "lib/resume.py",
           "    except (KeyError, RuntimeError, ValueError, TypeError, OverflowError) as e:\n        fail(f\"--resume",
           "    except ZeroDivisionError as e:\n        fail(f\"--resume",
           "tests/test_hostile.py::test_edited_checkpoints_are_refused_before_anything_is_written"),
    mutant("values: finite weights with NaN outputs read", "lib/checkpoint.py", "if torch.isfinite(out).all():\n        return None",
           "if True:\n        return None", "tests/test_hostile.py::test_non_finite_weights_are_refused_by_every_reader",
           "tests/test_sample.py::test_a_diverged_model_is_one_line_whichever_check_finds_it"),
    mutant("alternet: NaN logits sampled", "alternet.py", "    if not torch.isfinite(logits).all():\n        raise ValueError(",
           "    if False:\n        raise ValueError(",
           "tests/test_sample.py::test_a_diverged_model_is_one_line_whichever_check_finds_it"),
    mutant("sample: a sampler's ValueError as a traceback", "sample.py", "        except ValueError as e:  # logits that overflow",
           "        except ZeroDivisionError as e:  # logits that overflow",
           "tests/test_sample.py::test_a_diverged_model_is_one_line_whichever_check_finds_it"),
    mutant("language: the sample's tokenizer built again at every evaluation", "lib/language.py",
           "        text = self.decode(ids[0, prompt.shape[1]:].tolist())",
           "        text = text_codec(self.cfg.tokenizer)[1](ids[0, prompt.shape[1]:].tolist())",
           "tests/test_data.py::test_an_evaluations_sample_is_decoded_by_the_tokenizer_the_run_built"),
    mutant("language: a diverged sample as a traceback", "lib/language.py",
           "                except ValueError as e:  # a diverged model", "                except ZeroDivisionError as e:  # a diverged model",
           "tests/test_sample.py::test_a_diverged_model_is_one_line_whichever_check_finds_it"),
    mutant("depths: a NaN row scored", "tools/depths.py", "    place = non_finite_place(row)\n    if place:",
           "    place = non_finite_place(row)\n    if False:",
           "tests/test_depths.py::test_a_depth_whose_evaluation_is_not_finite_is_refused_before_anything_is_written"),
    mutant("depths: a distilled checkpoint scored as a classifier", "tools/depths.py",
           '.get("train_config") or {}).get("teacher"):', '.get("train_config") or {}).get("no such key"):',
           "tests/test_depths.py::test_depths_bad_arguments_are_one_line_errors"),
    mutant("depths: Pareto front ignores a lower-is-better metric", "tools/depths.py",
           '    sign = 1 if higher_is_better else -1\n    for r in rows:', "    sign = 1\n    for r in rows:",
           "tests/test_depths.py::test_pareto_rows_of_a_lower_is_better_metric_with_ties"),
    mutant("depths: Pareto dominance needs better in both", "tools/depths.py",
           "(sign * o[quality] > sign * r[quality] or o[cost] < r[cost])",
           "(sign * o[quality] > sign * r[quality] and o[cost] < r[cost])",
           "tests/test_depths.py::test_pareto_rows_of_a_lower_is_better_metric_with_ties",
           "tests/test_depths.py::test_pareto_rows_dominate_the_rest"),
    mutant("depths: a planted checkpoint scored by accuracy", "tools/depths.py",
           '"planted" if (ckpt.get("train_config") or {}).get("dataset") == "planted" else "vision")', '"vision")',
           "tests/test_depths.py::test_depths_of_a_planted_checkpoint_is_its_test_mse_by_depth"),
    mutant("depths: planted MSE read as higher is better", "tools/depths.py",
           '"planted": Headline("depth", "mse", 0.005, False,', '"planted": Headline("depth", "mse", 0.005, True,',
           "tests/test_depths.py::test_a_lower_is_better_headline_says_which_way_the_metric_moved"),
    mutant("depths: a lower-is-better change named the wrong way", "tools/depths.py",
           '" (worse)" if change > 0 else " (better)"', '" (better)" if change > 0 else " (worse)"',
           "tests/test_depths.py::test_a_lower_is_better_headline_says_which_way_the_metric_moved"),
    mutant("depths: --depths ignored by AlterNet", "tools/depths.py", "cap_list(args.depths, model)",
           "cap_list([], model)", "tests/test_depths.py::test_depths_alternet_caps_and_thresholds"),
    mutant("depths: an AlterNet cap above D run", "tools/depths.py", "    if max(given, default=d) > d:",
           "    if False:", "tests/test_depths.py::test_depths_alternet_caps_and_thresholds"),
    mutant("depths: depth 1 of a vision model run", "tools/depths.py", '"--depths", 2 if vision else 1,',
           '"--depths", 1,', "tests/test_depths.py::test_depths_bad_arguments_are_one_line_errors"),
    mutant("depths: --batch of an AlterNet checkpoint ignored", "tools/depths.py",
           "if args.batch and not vision:", "if False:",
           "tests/test_depths.py::test_depths_alternet_caps_and_thresholds"),
    mutant("depths: --thresholds of a vision checkpoint ignored", "tools/depths.py",
           '    if args.thresholds and not getattr(model.config, "halting", False):', "    if False:",
           "tests/test_depths.py::test_depths_bad_arguments_are_one_line_errors"),
    mutant("depths: every call in one rotation (the reference after the batch-n call)", "tools/depths.py",
           "pair = {compared: fns[compared], **(", "pair = {**fns, **(",
           "tests/test_depths.py::test_each_row_is_timed_in_rounds_of_its_own_with_the_reference_each_first_in_turn"),
    mutant("depths: the reference row timed against a second call of itself", "tools/depths.py",
           '        if row["reference"]:\n            fns["deployed", 1] = reference',
           '        if False:\n            fns["deployed", 1] = reference',
           "tests/test_depths.py::test_depths_rows_equal_the_training_evaluation"),
    mutant("depths: an untied ViT's headline looks for a smaller depth", "tools/depths.py",
           'kind = family != "language" and single_depth(model.config)', "kind = False",
           "tests/test_depths.py::test_depths_of_a_vit_checkpoint_is_its_single_row"),
    mutant("depths: the plot's y axis named for another family", "tools/depths.py", "ax.set_ylabel(headline.label)",
           'ax.set_ylabel(HEADLINE["vision"].label)',
           "tests/test_depths.py::test_the_plot_names_the_metric_as_the_table_does"),
    mutant("depths: AlterNet's headline names a cap without its halting threshold", "tools/depths.py",
           'if "halt_threshold" in row else ""', 'if False else ""',
           "tests/test_depths.py::test_an_alternet_headline_names_the_halting_threshold_of_each_setting_it_compares"),
    mutant("analyze: CKA of uncentred features", "tools/analyze.py",
           "xs = xs.double() - xs.double().mean(1, keepdim=True)", "xs = xs.double()",
           "tests/test_analyze.py::test_cka_is_the_centred_biased_hsic_not_an_uncentred_or_unbiased_variant",
           more=(("ys = ys.double() - ys.double().mean(1, keepdim=True)", "ys = ys.double()"),)),
    mutant("analyze: effective rank of singular values, not their squares", "tools/analyze.py",
           "svdvals(matrix.double()).square()", "svdvals(matrix.double())",
           "tests/test_analyze.py::test_effective_rank_weights_squared_singular_values"),
    mutant("analyze: Spearman as Pearson", "tools/analyze.py", "ra, rb = average_ranks(a), average_ranks(b)",
           "ra, rb = a.double(), b.double()", "tests/test_analyze.py::test_spearman"),
    mutant("analyze: Spearman's ties not averaged", "tools/analyze.py", "ranks[tied] = ranks[tied].mean()",
           "pass", "tests/test_analyze.py::test_spearman"),
    mutant("analyze: --gradient-batches 8 by default under a smaller --num-images", "tools/analyze.py",
           "args.gradient_batches = min(8, n)", "args.gradient_batches = 8",
           "tests/test_analyze.py::test_gradient_batches_default_to_8_or_to_a_smaller_num_images"),
    mutant("analyze: an undefined number printed as nan in a table", "tools/analyze.py",
           "    if math.isnan(value):\n", "    if False:\n",
           "tests/test_analyze.py::test_undefined_numbers_print_as_n_a_where_analysis_json_holds_null"),
    mutant("analyze: an earlier run's outputs left beside this run's", "tools/analyze.py",
           "        (out / stale).unlink(missing_ok=True)", "        pass",
           "tests/test_analyze.py::test_command_end_to_end"),
    mutant("analyze: --data of a data set that does not read it ignored", "tools/analyze.py",
           'if args.data and dataset != "imagenet":', "if False:",
           "tests/test_analyze.py::test_bad_input_gives_one_line_and_writes_nothing"),
    mutant("probes: mIoU as the IoU of all classes pooled", "tools/probes.py",
           "(intersection[present] / union[present]).mean()",
           "(intersection[present].sum() / union[present].sum())",
           "tests/test_probes.py::test_dense_metrics_count_every_pixel_once"),
    mutant("probes: mIoU counts an absent class as 0", "tools/probes.py", "    present = union > 0\n",
           "    present = union >= 0\n    union = union.clamp_min(1)\n",
           "tests/test_probes.py::test_dense_metrics_count_every_pixel_once"),
    mutant("probes: delta < 1.25 one-sided", "tools/probes.py",
           "ratio = torch.maximum(clamped / target, target / clamped)",
           "ratio = torch.maximum(clamped / target, clamped / target)",
           "tests/test_probes.py::test_dense_metrics_count_every_pixel_once"),
    mutant("probes: --probe mean not pointed to train.py's --probe-pool", "tools/probes.py",
           '            "mean": " (mean pooling', '            "Mean": " (mean pooling',
           "tests/test_probes.py::test_bad_input_gives_one_line_and_writes_nothing"),
    mutant("resume: a refused saved value named as a flag", "lib/resume.py",
           'fail(f"{source}: its saved train_config is refused: {reason}")', "raise", "tests/test_hostile.py::test_edited_checkpoints_are_refused_before_anything_is_written"),
    mutant("resume: a flag given now cannot replace a refused saved value", "lib/resume.py",
           "saved = {name: value for name, value in merged.items() if name not in flags}", "saved = merged",
           "tests/test_hostile.py::test_a_flag_given_now_is_named_as_the_flag_and_may_replace_a_refused_saved_value"),
    mutant("data: a missing data set's hint names --download to a command without it", "lib/data.py",
           "or let train.py --download fetch it,", "or rerun with --download,",
           "tests/test_data.py::test_missing_data_explains_how_to_get_it"),
    mutant("data: an empty IDX file to torch", "lib/data.py", "not 0 < math.prod(dims) ==", "not math.prod(dims) ==",
           "tests/test_data.py::test_bad_idx_files_are_one_line"),
    mutant("data: a file of any size read", "lib/data.py", "if len(raw) <= MAX_FILE_BYTES:", "if True:",
           "tests/test_data.py::test_a_data_file_larger_than_the_bound_is_refused"),
    mutant("data: an image folder's subset ignored", "lib/data.py", 'split == "train", workers, n)',
           'split == "train", workers)', "tests/test_data.py::test_load_images_gives_each_folder_split_its_subset",
           "tests/test_data.py::test_an_image_folder_subset_spreads_over_its_classes"),
    mutant("data: a folder subset of the first files (one class)", "lib/data.py",
           "return [files[i * len(files) // n] for i in range(n)]", "return [files[i] for i in range(n)]",
           "tests/test_data.py::test_a_folder_subset_is_evenly_spaced_over_the_class_sorted_files"),
    mutant("data: an unreadable image read by a worker is its traceback", "lib/data.py",
           'fail(f"--data {str(e)', 'raise  # (f"--data {str(e)',
           "tests/test_data.py::test_an_unreadable_image_read_by_a_worker_ends_in_one_line_naming_it",
           "tests/test_data.py::test_an_unreadable_image_in_an_image_folder_stops_training_in_one_line"),
    mutant("plot: a number beyond float32's range plotted", "tools/plot.py",
           "if abs(step) > FLOAT32_MAX or abs(value) > FLOAT32_MAX:", "if False:",
           "tests/test_plot.py::test_plot_refuses_a_number_beyond_float32_in_one_line"),
    mutant("export: a safetensors source with NaN outputs exported", "tools/export.py",
           "problem = weights_problem(tensors) or diverged(model.eval())", "problem = weights_problem(tensors)",
           "tests/test_export.py::test_bad_input_gives_one_line_naming_it_and_writes_nothing"),
    mutant("resume: an extended schedule changes silently", "lib/resume.py", "if saved[key] != sched[key]:",
           "if False:", "tests/test_train.py::test_extending_a_run_says_how_its_schedule_changes"),
    mutant("resume: a complete run evaluated again", "lib/resume.py", 'if step == sched["total_steps"]:',
           'if step > sched["total_steps"]:',
           "tests/test_train.py::test_a_complete_run_resumed_with_nothing_new_says_so_and_trains_nothing"),
    mutant("train: no loss line without a bar", "train.py", "screen = cfg.progress and sys.stdout.isatty()",
           "screen = cfg.progress",
           "tests/test_train.py::test_piped_output_shows_the_loss_on_lines_of_their_own"),
    mutant("fp16: an overflowed step stops the run", T, "and math.isfinite(norm_value) or overflow):",
           "and math.isfinite(norm_value)):", "tests/test_train.py::test_fp16_on_the_cpu_skips_an_overflow_and_resumes_its_scaler_bit_exactly"),
    mutant("fp16: the scaler's state not saved", T, '"scaler": run.scaler.state_dict(), ', "", "tests/test_train.py::test_fp16_on_the_cpu_skips_an_overflow_and_resumes_its_scaler_bit_exactly"),
    mutant("fp16: the scaler's state not restored", "lib/resume.py", 'run.scaler.load_state_dict(ckpt["scaler"])',
           "pass", "tests/test_train.py::test_fp16_on_the_cpu_skips_an_overflow_and_resumes_its_scaler_bit_exactly"),
    mutant("fp16: a loss scale of 0 resumed", "lib/checkpoint.py", 'and v["scale"] > 0,', "and True,",
           "tests/test_hostile.py::test_edited_checkpoints_are_refused_before_anything_is_written"),
    mutant("sample: the text generated before Ctrl-C lost", "sample.py", "        return ids, used, True",
           "        return prompt, [], True", "tests/test_sample.py::test_ctrl_c_prints_the_sample_so_far"),
    mutant("sample: --top-k above the vocabulary named top_k", "sample.py", "args.top_k > model.config.vocab_size:",
           "False:", "tests/test_sample.py::test_hostile_inputs_get_one_line"),
    mutant("boundary: --top-k may be the whole vocabulary", "sample.py", "args.top_k > model.config.vocab_size:",
           "args.top_k >= model.config.vocab_size:",
           "tests/test_sample.py::test_top_k_may_name_the_whole_vocabulary"),
    mutant("boundary: a student's teacher file replaced unnoticed", "lib/tasks.py",
           'saved = ckpt.get("teacher_sha256") if ckpt else None', "saved = None",
           "tests/test_train.py::test_distillation_loss_decreases"),
    mutant("train: a student's teacher hash not saved", T, '"teacher_sha256": getattr(run.task, "teacher_sha256", None),',
           "", "tests/test_train.py::test_distillation_loss_decreases"),
    mutant("checkpoint: --overwrite deletes the old run before the new one saves", "lib/checkpoint.py",
           "                    path.replace(old)", "                    path.unlink()",
           "tests/test_faults.py::test_overwrite_replaces_a_run_only_once_the_new_one_has_saved"),
    mutant("checkpoint: a stopped --overwrite leaves the old run aside", "lib/checkpoint.py",
           "            self.settle()\n            self.lock.close()", "            self.lock.close()",
           "tests/test_faults.py::test_overwrite_replaces_a_run_only_once_the_new_one_has_saved"),
    mutant("checkpoint: a killed --overwrite's old run not put back", "lib/checkpoint.py",
           "        self.settle()  # what a killed run set aside", "        # what a killed run set aside",
           "tests/test_faults.py::test_overwrite_replaces_a_run_only_once_the_new_one_has_saved"),
    mutant("checkpoint: the old run kept past the first checkpoint", "lib/checkpoint.py",
           "        self.settle()  # the run set aside is replaced now", "",
           "tests/test_faults.py::test_overwrite_replaces_a_run_only_once_the_new_one_has_saved"),
    mutant("export: --depth dropped from a compact export", "tools/export.py",
           '(args.format == "compact" and args.depth is not None,', "(False,",
           "tests/test_export.py::test_bad_input_gives_one_line_naming_it_and_writes_nothing"),
    mutant("export: an --out named for another format written", "tools/export.py",
           '(out.suffix in (".onnx", ".safetensors") and out.suffix != expected,', "(False,",
           "tests/test_export.py::test_an_export_is_read_by_its_content_and_named_for_its_format"),
    mutant("checkpoint: a renamed safetensors file read by its name", "lib/boundary.py",
           'return f.read(9)[8:] == b"{"', "return False",
           "tests/test_export.py::test_an_export_is_read_by_its_content_and_named_for_its_format",
           "tests/test_cli.py::test_an_output_replaces_only_an_earlier_output_of_the_project"),
    mutant("weights: a compact or folded export refused as a checkpoint", "lib/weights.py",
           "if kind not in (WEIGHTS_FORMAT, *EXPORT_FORMATS):", "if kind != WEIGHTS_FORMAT:",
           "tests/test_export.py::test_an_export_of_a_checkpoint_is_a_checkpoint_for_every_command"),
    mutant("export: a compact export names no checkpoint", "tools/export.py",
           'save_safetensors(model, path, "compact", **carried)', 'save_safetensors(model, path, "compact")',
           "tests/test_export.py::test_an_export_of_a_checkpoint_is_a_checkpoint_for_every_command"),
    mutant("checkpoint: a text file's byte code given as the reason", "lib/checkpoint.py",
           ' or isinstance(error, KeyError):', ':',
           "tests/test_export.py::test_bad_input_gives_one_line_naming_it_and_writes_nothing"),
    mutant("checkpoint: a file that is no checkpoint not told what is expected", "lib/checkpoint.py",
           'f"{unreadable(e)}; expected a ckpt.pt written', 'f"{unreadable(e)}; written',
           "tests/test_export.py::test_bad_input_gives_one_line_naming_it_and_writes_nothing"),
    mutant("checkpoint: --resume of a weights file not told to take its ckpt.pt", "lib/checkpoint.py",
           'if packed and "optimizer" in keys else "")', 'if False else "")',
           "tests/test_export.py::test_an_export_of_a_checkpoint_is_a_checkpoint_for_every_command"),
    mutant("moe: python -m lib.moe lists every size's mechanisms", M, 'if n.startswith("revit-s-") and',
           'if n.startswith("revit-") and',
           "tests/test_moe.py::test_python_m_lib_moe_lists_each_mechanism_at_one_size_by_default"),
    mutant("plot: accuracy drawn as a fraction", "tools/plot.py", '"val_acc": ("val acc (%)", 100)',
           '"val_acc": ("val acc (%)", 1)',
           "tests/test_plot.py::test_plot_draws_accuracy_in_percent_beside_a_language_runs_bits_per_byte"),
    mutant("plot: a language run's bits/byte dropped beside a vision run", "tools/plot.py",
           "for key in PANELS if any(key in c for c in runs.values())]", "for key in PANELS if any(key in c "
           "for c in runs.values())][:1]",
           "tests/test_plot.py::test_plot_draws_accuracy_in_percent_beside_a_language_runs_bits_per_byte"),
    mutant("plot: a file that is no log said to lack a loss line", "tools/plot.py", "    if not logged:",
           "    if False:", "tests/test_plot.py::test_plot_says_a_file_that_is_no_log_is_not_a_run"),
    mutant("plot: a missing run's path named twice", "tools/plot.py", 'fail(f"RUN {path}: {problem}", PROG)',
           'fail(f"RUN {run}: {path} {problem}", PROG)', "tests/test_plot.py::test_plot_names_a_missing_run_once"),
    mutant("boundary: a model flag the model never reads echoed and dropped", "lib/boundary.py",
           "        if model not in readers:", "        if False:",
           "tests/test_hostile.py::test_a_model_flag_the_model_never_reads_is_refused",
           "tests/test_train.py::test_alternet_reads_num_experts_and_depth_as_its_model_args_would"),
    mutant("boundary: a saved config's unread fields at the preset's values refused", "lib/boundary.py",
           "if value != preset[name]]", "]",
           "tests/test_hostile.py::test_model_args_a_model_never_reads_pass_where_they_are_the_presets"),
    mutant("boundary: AlterNet's --num-experts / --depth dropped", "lib/boundary.py",
           "overrides[name], set_by[name] = getattr(cfg, flag),", "_, set_by[name] = getattr(cfg, flag),",
           "tests/test_train.py::test_alternet_reads_num_experts_and_depth_as_its_model_args_would"),
    # --- a new user's run (session 16): flags of the other family, typos, depths, subsets ---
    mutant("boundary: a training flag of the other family echoed and dropped", "lib/boundary.py",
           '"eval_depths", *IMAGE_ONLY, *TEXT_ONLY)', '"eval_depths")',
           "tests/test_cli.py::test_a_training_flag_the_other_family_never_reads_is_refused"),
    mutant("boundary: a text file given to an image model blamed on Pillow", "lib/boundary.py",
           "(vision and cfg.data and os.path.isfile(cfg.data),", "(False,",
           "tests/test_cli.py::test_a_text_file_given_to_an_image_model_names_the_language_arch"),
    mutant("cli: a mistyped flag under the whole usage", "lib/cli.py",
           'self.exit(2, f"{self.prog}: error: {message}{hint}\\n")', "super().error(message + hint)",
           "tests/test_cli.py::test_a_mistyped_flag_is_one_line_with_the_closest_flag"),
    mutant("cli: a mistyped flag without the closest one", "lib/cli.py",
           'did you mean {close[0]}?" if close else ""', 'did you mean {close[0]}?" if False else ""',
           "tests/test_cli.py::test_a_mistyped_flag_is_one_line_with_the_closest_flag"),
    mutant("boundary: reViT's --depth 1 passes to the model", "lib/boundary.py",
           '{"depth": REVIT_DEPTH} if model == "revit" else {}', '{"depth": REVIT_DEPTH} if False else {}',
           "tests/test_cli.py::test_depth_is_refused_as_the_chosen_arch_allows"),
    mutant("boundary: a depth named twice in --eval-depths dropped", "lib/boundary.py",
           "if len(set(depths)) < len(depths)", "if False",
           "tests/test_cli.py::test_a_depth_named_twice_in_eval_depths_is_refused"),
    mutant("tasks: a subset past the data set's size taken silently", "lib/tasks.py",
           "        if asked > n:", "        if False:",
           "tests/test_cli.py::test_a_subset_larger_than_the_data_set_says_it_takes_all"),
    mutant("train: --help's data sets without planted", T, "' | '.join(IMAGE_DATASETS + TEXT_DATASETS)} (",
           "' | '.join(IMAGE_DATASETS[:4] + TEXT_DATASETS)} (",
           "tests/test_cli.py::test_help_lists_every_data_set_train_py_takes"),
    mutant("train: --no-progress echoed as --progress", T, "(--{'no-' if value is False else ''}{name", "(--{name",
           "tests/test_cli.py::test_an_override_line_names_the_flag_as_typed"),
    mutant("language: a missing tokenizer blamed on --dataset", "lib/language.py",
           "        codec = text_codec(cfg.tokenizer, cfg.download)\n", "        codec = None\n",
           "tests/test_train.py::test_a_missing_tokenizer_names_the_arch_that_trains_with_it",
           more=[("            codec, cfg.dataset", "            text_codec(cfg.tokenizer, cfg.download), cfg.dataset")]),
    mutant("tasks: a language model taken as --teacher", "lib/checkpoint.py",
           'if vision and module.__name__ == "alternet"', 'if False',
           "tests/test_hostile.py::test_a_language_model_given_as_teacher_is_named_as_such"),
    # --- session 17: saved configs judged by today's range rules only; run folders; text subsets ---
    mutant("boundary: a saved flag the family never reads refused", "lib/boundary.py",
           "if name in typed and getattr(cfg, name)", "if getattr(cfg, name)",
           "tests/test_faults.py::test_a_saved_flag_the_family_never_reads_is_not_refused_but_its_range_is"),
    mutant("checkpoint: a run folder given for its ckpt.pt not pointed to it", "lib/checkpoint.py",
           'if problem and (Path(path) / "ckpt.pt").is_file():', "if False:",
           "tests/test_faults.py::test_resume_of_a_run_folder_names_its_checkpoint"),
    mutant("train: --recipe imagenet without --data trains Fashion-MNIST", T,
           'images = "imagenet" if data else recipe_data or "fashion-mnist"', 'images = "imagenet" if data else "fashion-mnist"',
           "tests/test_train.py::test_cli_errors"),
    mutant("resume: --eval-only of a distilled run scored without its teacher", "lib/resume.py",
           'needed=("data", "teacher"), unkept={"out_dir", "resume"})', 'needed=("data",), unkept={"out_dir", "resume"})',
           "tests/test_train.py::test_distillation_loss_decreases"),
    mutant("train: a resumed run does not say where it continues", T,
           "f\"{f', resumed at step {run.step}' if resume_ckpt else ''} | \"", "\" | \"",
           "tests/test_train.py::test_resume_matches_uninterrupted_run"),
    mutant("hubconf: a helper listed as a torch.hub entry point", "hubconf.py", "import safetensors\n",
           "import safetensors\nfrom safetensors import safe_open\n",
           "tests/test_weights.py::test_torch_hub_lists_only_the_two_models"),
    mutant("train: --test-subset of a text run dropped", T, 'if explicit.get("test_subset") and cfg.dataset in',
           'if False and cfg.dataset in', "tests/test_faults.py::test_test_subset_of_a_language_run_is_refused"),
]


def occurrences(m: Mutant, root: Path = ROOT) -> list:
    """(snippet, count) for every edit of m whose original does not occur exactly once in its file."""
    path = root / m.file
    text = path.read_text() if path.exists() else ""
    return [(original, text.count(original)) for original, _ in m.edits if text.count(original) != 1]


def apply(m: Mutant, root: Path) -> str:
    """Plant m in the copy at root; returns the file's original text."""
    path = root / m.file
    original_text = text = path.read_text()
    for original, replacement in m.edits:
        text = text.replace(original, replacement)
    assert text != original_text, m.name
    path.write_text(text)
    return original_text


PYTEST_ARGS = ("-x", "-q", "-p", "no:cacheprovider", "--no-header")


def without_shrinking() -> None:
    """Hypothesis told not to shrink a failing example: a mutant needs the first failure only
    (shrinking one can take minutes). Loaded before the tests import, so their @settings inherit it."""
    from hypothesis import Phase, settings
    settings.register_profile("mutants", phases=[Phase.explicit, Phase.reuse, Phase.generate])
    settings.load_profile("mutants")


def run_tests(root: Path, tests: tuple, timeout: int) -> tuple:
    """pytest -x on the selection in the copy -> (status, seconds); status is pytest's exit code or 'timeout'.

    On POSIX each run is a fork of this process, which imported torch, pytest and Hypothesis once
    (not the project: the child imports the planted copy), so a run costs no interpreter start."""
    start = time.time()
    if not hasattr(os, "fork"):
        code = "import sys, pytest, mutants; mutants.without_shrinking(); sys.exit(pytest.main(sys.argv[1:]))"
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=str(Path(__file__).parent))
        try:
            status = subprocess.run([sys.executable, "-c", code, *PYTEST_ARGS, *tests], cwd=root, env=env,
                                    capture_output=True, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            status = "timeout"
        return status, time.time() - start
    pid = os.fork()
    if pid == 0:  # the child: its own process group (a timeout kills all of it), quiet, in the copy
        os.setpgrp()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        os.chdir(root)
        sys.path.insert(0, str(root))
        sys.argv = ["pytest"]  # as under pytest: one-line errors name their script, not mutants.py
        import pytest
        without_shrinking()
        os._exit(int(pytest.main([*PYTEST_ARGS, *tests])))
    while time.time() - start < timeout:
        done, wait_status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(wait_status), time.time() - start
        time.sleep(0.2)
    os.killpg(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "timeout", time.time() - start


# README's two commands as selections of a mutant's tests: the fast set first, then the deep one.
COMMANDS = (("fast", ("-m", "not deep")), ("deep", ("-m", "deep")))


def catch(root: Path, tests: tuple, timeout: int) -> tuple:
    """Plant-time verdict -> (verdict, command, seconds): the mutant's tests of the fast command run first;
    only if they pass (or it has none) do its tests of the deep command run."""
    total = 0.0
    for command, selection in COMMANDS:
        status, seconds = run_tests(root, (*selection, *tests), timeout)
        total += seconds
        if status not in (0, 5):  # 5: none of its tests is in this command's set
            verdict = {1: "caught", "timeout": "timeout"}.get(status, f"error (pytest status {status})")
            return verdict, command, total
    return "SURVIVED", "", total


def preload() -> None:
    """What every test run imports anyway (never the project's own modules: those must come from the copy)."""
    sys.dont_write_bytecode = True  # the copy's files change under the same names: no stale .pyc
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import einops  # noqa: F401
    import hypothesis  # noqa: F401
    import numpy  # noqa: F401
    import pytest  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401


def baseline_failures(root: Path, selections: list, timeout: int) -> list:
    """The selections that fail on the unmodified copy: all of them run at once first (one pytest
    start), and one by one only if that fails."""
    union = tuple(dict.fromkeys(node for tests in selections for node in tests))
    if not union or run_tests(root, union, timeout)[0] == 0:
        return []
    return [tests for tests in sorted(set(selections)) if run_tests(root, tests, timeout)[0] != 0]


def copy_repository(dest: Path) -> Path:
    ignore = shutil.ignore_patterns(".git", "__pycache__", ".hypothesis", ".pytest_cache", "results", "runs",
                                    "data", ".venv", "*.pt", "*.safetensors")
    shutil.copytree(ROOT, dest, ignore=ignore)
    return dest


def select(names: list) -> list:
    if not names:
        return MUTANTS
    return [m for m in MUTANTS if any(k.lower() in m.name.lower() for k in names)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Plant one bug at a time and check the tests catch it.")
    parser.add_argument("-k", action="append", default=[], help="run the mutants whose name contains this (repeatable)")
    parser.add_argument("--list", action="store_true", help="print the mutants and their tests, run nothing")
    parser.add_argument("--check", action="store_true", help="only check that every snippet occurs exactly once")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per pytest run (default 900)")
    args = parser.parse_args(argv)
    chosen = select(args.k)
    stale = {m.name: occurrences(m) for m in chosen if occurrences(m)}
    for name, problems in stale.items():
        for snippet, count in problems:
            print(f"STALE     {name}: snippet found {count} times (need exactly 1) in "
                  f"{next(m.file for m in MUTANTS if m.name == name)}: {snippet!r}")
    if args.list:
        for m in chosen:
            print(f"{m.name}  [{m.file}]  ->  {' '.join(m.tests)}")
        return 0
    if args.check:
        print(f"{len(chosen) - len(stale)} of {len(chosen)} mutants match the code")
        return 1 if stale else 0
    results = {}
    with tempfile.TemporaryDirectory(prefix="revit-mutants-") as tmp:
        root = copy_repository(Path(tmp) / "repo")
        preload()
        for tests in baseline_failures(root, [m.tests for m in chosen if m.name not in stale], args.timeout):
            print(f"BASELINE FAILS without any bug: {' '.join(tests)}")
            results.update({m.name: ("baseline fails", "") for m in chosen if m.tests == tests})
        for m in chosen:
            if m.name in stale or m.name in results:
                continue
            original_text = apply(m, root)
            try:
                verdict, command, seconds = catch(root, m.tests, args.timeout)
            finally:
                (root / m.file).write_text(original_text)
            results[m.name] = verdict, command
            print(f"{verdict:<9} {command:<4} {m.name}  ({seconds:.0f} s)", flush=True)
    survived = [n for n, (v, _) in results.items() if v != "caught"]
    by = {command: list(results.values()).count(("caught", command)) for command, _ in COMMANDS}
    print(f"\n{len(results) - len(survived)} of {len(chosen)} mutants caught ({by['fast']} by the fast "
          f"command, {by['deep']} only by the deep one); {len(stale)} stale, {len(survived)} not caught"
          f"{': ' + ', '.join(survived) if survived else ''}")
    return 0 if not stale and not survived else 1


if __name__ == "__main__":
    sys.exit(main())
