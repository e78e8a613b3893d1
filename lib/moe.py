"""The paper's comparison mechanisms (reViT, arXiv 2610.12448, §4.3 and App. B; Tables 3, 4, 8, 10; Fig. 2):
each replaces the merged FFN of reViT's shared block, under the same recurrence (`ComparisonReViT`).

revit.py never imports this file. Its `ViTConfig` is revit's plus the mechanisms' fields (`ffn` names the
mechanism), its `PRESETS` are revit's plus revit-{size}-{mechanism}[-u{U}] and revit-{size}-lora, and its
`create_model` builds any of them. Statistics pooled over the steps of one forward live on the FFN (reset
by begin_forward); so do those of a non-gradient update after the optimizer step (DeepSeek-V3's bias,
ReMoE's L1 controller), recorded by training forwards only and summed over ranks.

    python -m lib.moe [names...]   # parameter counts, expert-FFN storage and U of the presets
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist  # global balancing statistics across ranks
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

import revit
from revit import (Attention, Block, ExpertBank, MergedExpertFFN, MergedFFN, Mlp, ReViT, full_precision,
                   gate_penalties)

# --- the interface: what a mechanism's FFN gets from the recurrence ---

class Step(NamedTuple):
    """One application of the shared block: what an FFN with `needs_step` is given (no mechanism reads
    the depth coordinate: content routes them, LoRA's adapter is the step's)."""
    t: int                            # the step index in 0..L-1
    rows: torch.Tensor | None = None  # (b,) the images that run this step (elastic depth); None: all

class FFN(nn.Module):
    """A mechanism's FFN: forward(u), or forward(u, step) if it sets `needs_step`, u (b, T, d) the
    LayerNorm'd tokens of the images that run this step -> u's shape. begin_forward runs before step 0,
    aux_losses(depth) after the last; `pool` sums router statistics over the steps of one forward (one
    shared block: its balance is measured over all of them), and aux_losses takes them."""

    needs_step = False
    router_stats: dict | None = None

    def begin_forward(self, depth: int, batch: int) -> None:
        self.router_stats = {}

    def pool(self, **stats) -> None:
        pooled = self.router_stats = self.router_stats if self.router_stats is not None else {}
        for name, value in stats.items():
            pooled[name] = pooled[name] + value if name in pooled else value

    def take_stats(self) -> dict | None:
        stats, self.router_stats = self.router_stats or None, {}
        return stats

    def aux_losses(self, depth: int) -> dict:
        return {}

    def dense_states(self, depth: int, gates: torch.Tensor | None = None) -> list[dict]:
        raise ValueError(f"fold: {type(self).__name__} is input-dependent (its routing depends on the "
                         "tokens), so it has no fixed per-depth weights to fold; only reViT's merge (any E) "
                         "and layer-wise LoRA fold into a plain ViT")

class MechanismBlock(Block):
    """reViT's shared block (Eq. 3) with a mechanism as its FFN: step t's FFN gets the step if it asks."""

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        return super().forward(x, partial(self.mlp, step=step) if self.mlp.needs_step else self.mlp)

    def begin_forward(self, depth: int, batch: int) -> None:
        self.mlp.begin_forward(depth, batch)

class ComparisonReViT(ReViT):
    """reViT's recurrence (§3.1) and elastic depth (§3.2) with a comparison mechanism in the shared block."""

    def build_block(self, c: ViTConfig) -> Block:
        if c.ffn == "lora":
            return LoRABlock(c)
        return MechanismBlock(c.dim, c.heads, MECHANISM_FFNS[c.ffn](c), c.layer_scale_init, c.drop_path)

    def forward(self, images: torch.Tensor, depth: int | None = None, return_states: bool = False,
                keep: torch.Tensor | None = None):
        depth = self.check_depth(depth)
        # Before any tensor work, as reViT's merge cache: one compiled graph for the whole forward.
        self.block.begin_forward(depth, images.shape[0])
        x = self.embed(images)                                                  # (B, 1+N, d)
        keep = self.elastic_mask(keep, x.shape[0], depth, x.device)
        if keep is None:  # Eq. 3 applied L times
            states = [x]
            for t in range(depth):
                x = self.block(x, Step(t))
                states.append(x)
        else:
            states = self.elastic_steps(x, keep)
        aux = self.block.mlp.aux_losses(depth) if return_states or self.training else {}
        return self.finish(states[-1], states, aux, return_states)

    def elastic_ffn(self, t: int, coords: torch.Tensor, rows: torch.Tensor) -> Step:
        return Step(t, rows)  # reViT's elastic depth (§3.2); MechanismBlock hands it to the FFN

    def gate_matrix(self, depth: int | None = None) -> torch.Tensor:
        self.check_depth(depth)
        raise ValueError(f"ffn={self.config.ffn!r} has no depth-only gate matrix: only reViT's merge "
                         "(ffn='merge') gates its experts by the depth alone")

# --- shared pieces of the mechanisms ---

def router_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Router math in fp32 (as Switch, Qwen3 and DeepSeek-V3 do), whatever the autocast dtype."""
    with full_precision(x.device):
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float())

def ffn_flops(dim: int, hidden: int) -> int:
    return 4 * dim * hidden  # one FFN on one token: two d x h matmuls, 2 FLOPs per multiply-add

def params_per_expert(bank: ExpertBank) -> int:
    return 2 * bank.dim * bank.hidden + bank.hidden + bank.dim  # P(d, r) = 2 r d^2 + (r + 1) d (App. B)

def apply_ffn_batched(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias):
    """n FFNs on n row sets at once: x (n, m, d), weights stacked (n, ...) -> (n, m, d)."""
    w1, b1, w2, b2 = (w.to(x.dtype) for w in (fc1_weight, fc1_bias, fc2_weight, fc2_bias))
    h = F.gelu(torch.baddbmm(b1.unsqueeze(1), x, w1.transpose(1, 2)))  # (n, m, h)
    return torch.baddbmm(b2.unsqueeze(1), h, w2.transpose(1, 2))       # (n, m, d)

def summed_over_ranks(stats: torch.Tensor) -> torch.Tensor:  # in place, under torch.distributed
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(stats)
    return stats

class ExpertPool(ExpertBank):
    """An expert bank that runs its experts on activations (rather than merging weights)."""

    def mixture(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """Every expert on every token, outputs summed with weights (n, E) (None: all weights 1)."""
        y = apply_ffn_batched(x.expand(self.num_experts, *x.shape), *self.bank())  # (E, n, d)
        if weights is None:
            return y.sum(0)
        return (y * weights.T.unsqueeze(-1).to(y.dtype)).sum(0)  # (n, d)

    def dispatch(self, x: torch.Tensor, expert_index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Token i runs experts expert_index[i] (n, K), outputs summed with weights (n, K). The n K (token,
        expert) pairs are sorted by expert (stably: the sums keep one order), each expert runs once on its
        chunk (never a loop over tokens), and the results are added into their tokens with index_add."""
        n, k = expert_index.shape
        flat = expert_index.flatten()                                   # (n K,)
        order = torch.argsort(flat, stable=True)
        token = order // k                                              # token of each sorted pair
        chunks = x[token].split(torch.bincount(flat, minlength=self.num_experts).tolist())
        y = torch.cat([MergedFFN(*(p[e] for p in self.bank()))(chunk) for e, chunk in enumerate(chunks)])
        y = y * weights.flatten()[order].unsqueeze(1).to(y.dtype)       # (n K, d)
        return y.new_zeros(n, x.shape[1]).index_add_(0, token, y)

# --- weight merge with content gates: SMEAR, Lory, the feature-only control of Fig. 2 ---

class SmearFFN(ExpertBank, FFN):
    """SMEAR (Muqeeth et al., 2024; r-three/smear): Eq. 2's merge with per-image gates from the content,
    g = softmax(W_r LN(pool) + b_r) (b, E), pool the mean of this step's FFN input over the tokens (the
    reference's routing: plain softmax, no temperature, merged per example, no auxiliary losses, App. B).
    One merged FFN per image (batched matmuls); under elastic depth an image's gate comes from its own
    state. Lory and the feature-only control change the router input and the losses."""

    normalise_router_input = True

    def __init__(self, c: ViTConfig):
        super().__init__(c.dim, c.expert_ffn_dim, c.num_experts)
        self.router_norm = nn.LayerNorm(c.dim, eps=1e-6) if self.normalise_router_input else nn.Identity()
        self.router = nn.Linear(c.dim, c.num_experts)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.merged_forward(u, u.mean(1))  # routed on the pooled current state (b, d)

    def merged_forward(self, u: torch.Tensor, router_input: torch.Tensor) -> torch.Tensor:
        """u (b, T, d) through the FFN merged with the gates of router_input (b, d)."""
        z = router_logits(self.router_norm(router_input), self.router.weight, self.router.bias)  # (b, E)
        self.record_gates(z)
        merged = self.merge(torch.softmax(z, dim=-1))   # one merged FFN per image: (b, ...) stacks
        return apply_ffn_batched(u, *merged)            # (b, T, d)

    def record_gates(self, z: torch.Tensor) -> None:
        pass

    def active_flops_per_token(self, num_tokens: int) -> dict:
        routing = 2 * self.dim * self.num_experts + 2 * self.num_experts * params_per_expert(self)
        return {"experts": ffn_flops(self.dim, self.hidden), "routing": routing / num_tokens}

class FeatureOnlyFFN(SmearFFN):
    """The feature-only control of Fig. 2: SMEAR's gate (pooled current state, no depth signal) with all
    else of reViT, the Eqs. 6, 8, 9 regularisers included (over every per-image gate of every step), so
    the comparison isolates the conditioning signal. Its gate is recomputed at every step: it runs under
    per-image depth dropout (App. A.2) and at any inference depth."""

    def __init__(self, c: ViTConfig):
        super().__init__(c)
        self.lambdas = c.balance_weight, c.z_loss_weight, c.diversity_weight  # λ_bal, λ_z, λ_div, as reViT's

    def record_gates(self, z: torch.Tensor) -> None:
        balance, z_loss = gate_penalties(z, 1.0)  # (b,) each: Eqs. 6 and 8 of each image's gate
        self.pool(balance_sum=balance.sum(), z_sum=z_loss.sum(), rows=z.shape[0])

    def aux_losses(self, depth: int) -> dict:
        stats = self.take_stats()
        if self.num_experts == 1 or stats is None:
            return {}
        balance, z_loss, diversity = self.lambdas
        return {"balance": balance * stats["balance_sum"] / stats["rows"],
                "z_loss": z_loss * stats["z_sum"] / stats["rows"], "diversity": diversity * self.diversity()}

class LoryFFN(SmearFFN):
    """Lory (Zhong et al., 2024; no public code): a linear softmax router on the pooled representation
    of the previous segment picks the merged FFN of the next one (causal routing). App. B reads segments
    as recurrent steps: the pooled FFN input of an image's previous retained step routes step t; at its
    first step it routes on its own (our choice). No LayerNorm on the router input (the pooled tokens are
    already LayerNorm'd), no auxiliary loss; similarity-based batching has no image analogue."""

    normalise_router_input = False
    needs_step = True  # step.rows: which images' memories this step reads and writes
    previous = seen = batch = None  # this forward's memory: pooled inputs (B, d), whether set (B,)

    def begin_forward(self, depth: int, batch: int) -> None:
        self.previous, self.seen, self.batch = None, None, batch

    def forward(self, u: torch.Tensor, step: Step) -> torch.Tensor:
        return self.merged_forward(u, self.router_input(u, step.rows))

    def router_input(self, u: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """The pooled FFN input of each image's previous retained step (its own at its first): (b, d)."""
        pooled = u.mean(1)  # (b, d)
        rows = torch.arange(u.shape[0], device=u.device) if rows is None else rows
        if self.previous is None:  # first step of this forward
            self.previous = pooled.new_zeros(self.batch or u.shape[0], u.shape[-1])
            self.seen = torch.zeros(len(self.previous), dtype=torch.bool, device=u.device)
        source = torch.where(self.seen[rows].unsqueeze(1), self.previous[rows], pooled)
        self.previous = self.previous.index_copy(0, rows, pooled)
        self.seen = self.seen.index_fill(0, rows, True)
        return source

# --- routing per token: DeepSeek-V3, Qwen3, MoEUT (top-K dispatch), ReMoE (every expert, ReLU gates) ---

class RoutedFFN(ExpertPool, FFN):
    """A linear router without bias scores E experts per token; `combine` runs them: the top-K experts of
    `route` by grouped dispatch, route(logits (n, E) fp32) -> expert_index (n, K), weights (n, K), plus
    the always-active shared experts (DeepSeek-V3's). Qwen3's and MoEUT's losses weigh balance_weight."""

    def __init__(self, c: ViTConfig):
        super().__init__(c.dim, c.expert_ffn_dim, c.num_experts)
        self.top_k, self.balance_weight = c.top_k, c.balance_weight
        self.router = nn.Linear(c.dim, c.num_experts, bias=False)
        self.shared = ExpertPool(c.dim, c.expert_ffn_dim, c.shared_experts) if c.shared_experts else None

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        x = rearrange(u, "b t d -> (b t) d")
        y = self.combine(x, router_logits(x, self.router.weight))
        return rearrange(y, "(b t) d -> b t d", b=u.shape[0])

    def combine(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        y = self.dispatch(x, *self.route(logits))
        return y if self.shared is None else y + self.shared.mixture(x)

    def active_flops_per_token(self, num_tokens: int) -> dict:
        active = self.top_k + (self.shared.num_experts if self.shared is not None else 0)
        return {"experts": active * ffn_flops(self.dim, self.hidden),
                "routing": 2 * self.dim * self.num_experts}

class DeepSeekV3FFN(RoutedFFN):
    """DeepSeek-V3 (Liu et al., 2024; deepseek-ai/DeepSeek-V3 inference/model.py), App. B adaptation.

    Sigmoid affinities s = sigmoid(x W_r); top-K selection on s + b with a per-expert bias b that is
    never added to the gate value; gates = s of the selected experts renormalised over them; plus
    `shared` always-active experts. b is the auxiliary-loss-free balancer: a buffer updated after each
    optimizer step by b += rate * sign(mean(load) - load_e), re-centred to zero mean, from the token
    loads of the training forwards since the last update. The sequence-wise balance loss, node-limited
    routing and the 671B model's route scale 2.5 are omitted (K = 1: see MOE_TABLE).
    """

    def __init__(self, c: ViTConfig):
        super().__init__(c)
        self.bias_update_rate = c.bias_update_rate
        self.register_buffer("expert_bias", torch.zeros(c.num_experts))
        self._load = None  # (E,) tokens routed to each expert since the last optimizer step

    def route(self, logits: torch.Tensor) -> tuple:
        scores = torch.sigmoid(logits)                                                     # (n, E)
        # the bias steers the selection only, never the gate value
        expert_index = torch.topk(scores + self.expert_bias.float(), self.top_k, dim=-1).indices
        gates = scores.gather(1, expert_index)
        if self.training:
            load = torch.bincount(expert_index.flatten(), minlength=self.num_experts).float()
            self._load = load if self._load is None else self._load + load
        return expert_index, gates / gates.sum(-1, keepdim=True)

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        if self._load is None:
            return
        load, self._load = summed_over_ranks(self._load), None  # every rank: the same update
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)
        self.expert_bias -= self.expert_bias.mean()

class Qwen3FFN(RoutedFFN):
    """Qwen3 (Yang et al., 2025; HF transformers qwen3_moe), App. B adaptation.

    Softmax over all experts in fp32, top-K, renormalised by the top-K sum; no shared expert.
    Global-batch load balancing (Qiu et al., 2025): L = w * E * sum_e f_e P_e, P_e the mean router
    probability of this forward, f_e the fraction of (token, slot) selections of expert e over the global
    batch: every recurrent step of the forward and, in training, every rank (no gradient). With gradient
    accumulation each micro-batch uses the counts of its own forward: a loss that waited for later
    micro-batches could not be backpropagated per micro-batch. App. B's w: see MOE_TABLE.
    """

    def route(self, logits: torch.Tensor) -> tuple:
        probs = torch.softmax(logits, dim=-1)                                   # (n, E) fp32
        top, expert_index = torch.topk(probs, self.top_k, dim=-1)
        counts = torch.bincount(expert_index.flatten(), minlength=self.num_experts).float()
        self.pool(prob_sum=probs.sum(0), counts=counts, tokens=probs.shape[0])
        return expert_index, top / top.sum(-1, keepdim=True)

    def aux_losses(self, depth: int) -> dict:
        stats = self.take_stats()
        if not self.balance_weight or stats is None:
            return {}
        counts = stats["counts"].detach().clone()
        tokens = torch.tensor(float(stats["tokens"]), device=counts.device)
        if self.training:  # evaluation may run on one rank
            counts, tokens = summed_over_ranks(counts), summed_over_ranks(tokens)
        f = counts / tokens                                  # global: sums to K
        P = stats["prob_sum"] / stats["tokens"]              # local, differentiable
        return {"balance": self.balance_weight * self.num_experts * (f * P).sum()}

class MoEUTFFN(RoutedFFN):
    """MoEUT (Csordás et al., 2024; RobertCsordas/moeut), App. B adaptation: sigma-MoE routing (sigmoid
    scores, top-K, outputs summed with the scores, not renormalised). Balance: minus the entropy of the
    mean softmax selection, pooled over tokens and every recurrent step, weight 0.01. SwitchHead,
    peri-LayerNorm and expert dropout are omitted (dense attention is kept)."""

    def route(self, logits: torch.Tensor) -> tuple:
        self.pool(prob_sum=torch.softmax(logits, dim=-1).sum(0), tokens=logits.shape[0])
        scores, expert_index = torch.topk(torch.sigmoid(logits), self.top_k, dim=-1)
        return expert_index, scores

    def aux_losses(self, depth: int) -> dict:
        stats = self.take_stats()
        if not self.balance_weight or stats is None:
            return {}
        mean_selection = stats["prob_sum"] / stats["tokens"]  # (E,)
        neg_entropy = (mean_selection * torch.log(mean_selection.clamp_min(1e-12))).sum()
        return {"balance": self.balance_weight * neg_entropy}

class ReMoEFFN(RoutedFFN):
    """ReMoE (Wang et al., 2025; thu-ml/ReMoE), App. B adaptation: a dense output mixture.

    Gates g = relu(x W_r) (no softmax, no top-K): every expert runs on every token, outputs summed with
    g, so a token whose gates are all zero keeps only its residual. Sparsity comes from the load-balanced
    L1 penalty lambda * E / (n^2 K) * sum_e (sum_tokens g_e) * count_e (count_e: tokens with g_e > 0;
    K = E (1 - target)), lambda set after each optimizer step: * 1.2 while the measured sparsity is below
    the target 0.75, / 1.2 while above, kept on it; it starts at 1e-8 (an fp32 buffer). Our choice for
    the recurrence: the n tokens are pooled over all L steps into one normalisation, 1/L of the sum of
    per-step (per-layer) penalties.
    """

    def __init__(self, c: ViTConfig):
        super().__init__(c)
        self.top_k = c.num_experts  # every expert runs (the budget U counts them all)
        self.target_sparsity, self.l1_step = c.remoe_target_sparsity, 1.2
        self.register_buffer("l1_weight", torch.tensor(1e-8, dtype=torch.float32))
        self._active, self._total = None, 0  # nonzero gates and gates seen since the last update

    def combine(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        gates = F.relu(logits)                                                   # (n, E) fp32
        active = (gates > 0).float()
        self.pool(gate_sum=gates.sum(0), counts=active.sum(0), tokens=gates.shape[0])
        if self.training:
            nonzero = active.sum().detach()
            self._active = nonzero if self._active is None else self._active + nonzero
            self._total += active.numel()
        return self.mixture(x, gates)

    def aux_losses(self, depth: int) -> dict:
        stats = self.take_stats()
        if stats is None:
            return {}
        k = self.num_experts * (1.0 - self.target_sparsity)
        scale = self.l1_weight.float() * self.num_experts / (stats["tokens"] ** 2 * k)
        return {"l1": scale * (stats["gate_sum"] * stats["counts"].detach()).sum()}

    def sparsity(self) -> float:
        return 1.0 - float(self._active) / self._total

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        if self._active is None:
            return
        total = torch.tensor(float(self._total), device=self._active.device)
        active = summed_over_ranks(torch.stack([self._active.float(), total]))
        self._active, self._total = None, 0
        sparsity = 1.0 - (active[0] / active[1]).item()
        # lambda <- lambda * alpha^sign(target - sparsity): up while too dense, down while too sparse, kept on
        # the target (which a few experts reach exactly: one of E = 4 gates open is sparsity 0.75)
        direction = (sparsity < self.target_sparsity) - (sparsity > self.target_sparsity)
        self.l1_weight.mul_(self.l1_step ** direction)

# --- Soft-MoE: experts on slots, each a softmax mixture of an image's tokens ---

class SoftMoEFFN(ExpertPool, FFN):
    """Soft-MoE (Puigcerver et al., 2024; google-research/vmoe), App. B adaptation.

    S = E * p slots with parameters Phi (d, S). Logits = l2norm(x) . (scale * l2norm(Phi)) over d (the
    experts see the un-normalised tokens), scale a learnable scalar (init 1). Dispatch: softmax over an
    image's tokens, per slot; combine: softmax over the slots, per token. Expert e runs on its p slots;
    no aux loss. Per token the experts cost S / T dense FFNs: U = S / T (p: by default N / 4 patches).
    """

    def __init__(self, c: ViTConfig):
        super().__init__(c.dim, c.expert_ffn_dim, c.num_experts)
        self.slots_per_expert = p = c.slots_per_expert or max(1, round(c.num_patches / 4))
        self.slot_embed = nn.Parameter(torch.empty(c.dim, c.num_experts * p))  # Phi (d, S)
        self.scale = nn.Parameter(torch.ones(()))
        nn.init.trunc_normal_(self.slot_embed, std=0.02)

    def routing_weights(self, u: torch.Tensor) -> tuple:
        """(b, T, d) -> dispatch (b, T, S), normalised over T; combine (b, T, S), normalised over S."""
        with full_precision(u.device):
            slots = self.scale.float() * F.normalize(self.slot_embed.float(), dim=0)
            logits = F.normalize(u.float(), dim=-1) @ slots          # (b, T, S)
        return torch.softmax(logits, dim=1), torch.softmax(logits, dim=2)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        dispatch, combine = self.routing_weights(u)
        slots = dispatch.transpose(1, 2).to(u.dtype) @ u                                       # (b, S, d)
        slots = rearrange(slots, "b (e p) d -> e (b p) d", e=self.num_experts)
        out = apply_ffn_batched(slots, *self.bank())                     # expert e on its own slots
        out = rearrange(out, "e (b p) d -> b (e p) d", b=u.shape[0])                            # (b, S, d)
        return combine.to(out.dtype) @ out                                                      # (b, T, d)

    def active_flops_per_token(self, num_tokens: int) -> dict:
        slots = self.num_experts * self.slots_per_expert
        # logits, dispatch and combine: three (T x d x S) products per image
        return {"experts": slots * ffn_flops(self.dim, self.hidden) / num_tokens,
                "routing": 6 * self.dim * slots}

MECHANISM_FFNS = {"lory": LoryFFN, "smear": SmearFFN, "feature": FeatureOnlyFFN, "deepseek": DeepSeekV3FFN,
                  "qwen3": Qwen3FFN, "moeut": MoEUTFFN, "remoe": ReMoEFFN, "softmoe": SoftMoEFFN}

# --- layer-wise LoRA (Relaxed Recursive Transformers): a Block variant with per-step updates ---

LORA_LAYERS = {"qkv": "attn.qkv", "proj": "attn.proj", "fc1": "mlp.fc1", "fc2": "mlp.fc2"}

class LayerwiseLoRA(nn.Module):
    """The factors of layer-wise LoRA (Bae et al., 2025a; no public code), App. B.1 / Table 10.

    An independent rank-r update W_t = W + B_t A_t per step t on the fused qkv, the attention output,
    fc1 and fc2; biases and norms stay shared. A_t starts random (PEFT's uniform(+-1/sqrt(fan_in))),
    B_t at zero, so training starts from the tied block; no alpha/r scaling (the paper writes
    W + B_t A_t). Parameters: 16 L r d for d_ff = 4d (4.72M for S/16, r = 64).
    """

    def __init__(self, dim: int, ffn_dim: int, depth: int, rank: int):
        super().__init__()
        shapes = {"qkv": (dim, 3 * dim), "proj": (dim, dim), "fc1": (dim, ffn_dim), "fc2": (ffn_dim, dim)}
        for name, (fan_in, fan_out) in shapes.items():
            down = nn.Parameter(torch.empty(depth, rank, fan_in))   # A_t (L, r, in)
            nn.init.uniform_(down, -1.0 / math.sqrt(fan_in), 1.0 / math.sqrt(fan_in))
            setattr(self, f"{name}_down", down)
            setattr(self, f"{name}_up", nn.Parameter(torch.zeros(depth, fan_out, rank)))  # B_t (L, out, r)

    def update(self, name: str, t: int, x: torch.Tensor) -> torch.Tensor:
        """B_t A_t x for layer `name` at step t."""
        return F.linear(F.linear(x, getattr(self, f"{name}_down")[t]), getattr(self, f"{name}_up")[t])

    def delta(self, t: int, name: str) -> torch.Tensor:
        """B_t A_t (out, in) in fp32: what fold adds to the shared weight."""
        return getattr(self, f"{name}_up")[t].float() @ getattr(self, f"{name}_down")[t].float()

class LoRAAttention(Attention):
    """The shared attention with step t's low-rank updates on qkv and proj."""

    def forward(self, x: torch.Tensor, step: int, lora: LayerwiseLoRA) -> torch.Tensor:
        h = self.attend(self.qkv(x) + lora.update("qkv", step, x))                        # (B, T, d)
        return self.proj(h) + lora.update("proj", step, h)

class LoRAMlp(Mlp, FFN):
    """The shared dense FFN with step t's low-rank updates on fc1 and fc2."""

    def forward(self, u: torch.Tensor, step: int, lora: LayerwiseLoRA) -> torch.Tensor:
        h = F.gelu(self.fc1(u) + lora.update("fc1", step, u))                              # (B, T, d_ff)
        return self.fc2(h) + lora.update("fc2", step, h)

class LoRABlock(MechanismBlock):
    """The tied block plus layer-wise LoRA: step t runs W + B_t A_t on qkv, proj, fc1 and fc2.
    One adapter per trained step, so the model runs only at its own depth."""

    def __init__(self, c: ViTConfig):
        super().__init__(c.dim, c.heads, LoRAMlp(c.dim, c.ffn_dim), c.layer_scale_init, c.drop_path)
        self.attn = LoRAAttention(c.dim, c.heads)  # same parameter names as the plain block's
        self.lora = LayerwiseLoRA(c.dim, c.ffn_dim, c.depth, c.lora_rank)
        self.trained_depth = c.depth

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        x = x + self.drop_path(self.ls1(self.attn(self.norm1(x), step.t, self.lora)))
        return x + self.drop_path(self.ls2(self.mlp(self.norm2(x), step.t, self.lora)))

    def check_depth(self, depth: int, batch: int = 0) -> None:
        if depth != self.trained_depth:
            raise ValueError(f"depth={depth}: layer-wise LoRA has one adapter per trained step, so it runs "
                             f"only at its own depth ({self.trained_depth})")

    begin_forward = check_depth  # the adapters keep no state between the steps of a forward

    def unrolled_states(self, depth: int, gates: torch.Tensor | None = None) -> list[dict]:
        """Step t: the shared weights plus B_t A_t on qkv, proj, fc1 and fc2 (fp32 sums, cast on loading)."""
        self.check_depth(depth)
        states = [{k: v for k, v in state.items() if not k.startswith("lora.")}
                  for state in super().unrolled_states(depth)]
        for t, state in enumerate(states):
            for name, layer in LORA_LAYERS.items():
                state[f"{layer}.weight"] = state[f"{layer}.weight"].float() + self.lora.delta(t, name)
        return states

# --- the comparisons' config: revit.py's fields plus the mechanism and its settings ---

FFNS = ("merge", "lora", *MECHANISM_FFNS)

@dataclass
class ViTConfig(revit.ViTConfig):
    """revit.ViTConfig plus `ffn` and the settings the mechanisms read (§4.3, App. B, Table 8; Qwen3's and
    MoEUT's balance losses take revit's balance_weight). revit's name, so that a caller uses either
    module's create_model / ViTConfig / PRESETS alike."""
    ffn: str = "merge"            # the shared block's FFN: reViT's "merge" or a mechanism (FFNS)
    top_k: int = 1                # K experts per token (deepseek, qwen3, moeut)
    shared_experts: int = 0       # DeepSeek-V3's always-active experts
    slots_per_expert: int = 0     # Soft-MoE; 0: round(num_patches / 4) (49 for S/16, 64 for B/14)
    bias_update_rate: float = 1e-3  # DeepSeek-V3's aux-loss-free balancing step
    remoe_target_sparsity: float = 0.75  # ReMoE: 1 - K/E
    lora_rank: int = 64           # layer-wise LoRA rank r (Table 10: 64 for S/16)

    def __post_init__(self):
        revit.check_fields(self, revit.FIELD_RULES + FIELD_RULES)

    @property
    def model_class(self) -> type:
        return super().model_class if self.ffn == "merge" else ComparisonReViT

    @property
    def depth_programmed(self) -> bool:
        """The FFN of step t depends on the depth only, so the model folds (reViT's merge: any E; LoRA)."""
        return self.ffn in ("merge", "lora")

FIELD_RULES = [  # revit.FIELD_RULES' form, for this config's own fields
    ("ffn", lambda c: c.ffn in FFNS, f"one of {FFNS}"),
    ("ffn", lambda c: c.ffn == "merge" or c.arch == "revit",
     "'merge' unless arch='revit' (the mechanisms replace the FFN of reViT's shared block)"),
    ("top_k", lambda c: 1 <= c.top_k <= c.num_experts, "between 1 and num_experts={num_experts}"),
    ("shared_experts", lambda c: 0 <= c.shared_experts <= 2 ** 10, "in 0..1024"),
    ("shared_experts", lambda c: c.shared_experts == 0 or c.ffn == "deepseek", "0 unless ffn='deepseek'"),
    ("slots_per_expert", lambda c: 0 <= c.slots_per_expert <= 2 ** 12, "in 0..4096 (0: num_patches / 4)"),
    ("bias_update_rate", lambda c: c.bias_update_rate >= 0, ">= 0"),
    ("remoe_target_sparsity", lambda c: 0.0 < c.remoe_target_sparsity < 1.0, "in (0, 1)"),
    ("lora_rank", lambda c: 1 <= c.lora_rank <= 2 ** 12, "in 1..4096"),
]

# --- the paper's measures of a mechanism: stored expert parameters (Table 8) and budget U (§4.3) ---

def expert_ffn_params(model: nn.Module) -> int:
    """Table 8's count: parameters of every stored expert FFN, routed and shared, P(d, r) each (App. B);
    routers, Soft-MoE's slots, LoRA factors and the backbone are not counted. A dense FFN (the tied
    block, a ViT's blocks) counts as one expert."""
    banks = [m.bank() if isinstance(m, ExpertBank) else m.parameters()
             for m in model.modules() if isinstance(m, (ExpertBank, Mlp))]
    return sum(p.numel() for bank in banks for p in bank)

def active_flops_per_token(ffn: FFN, num_tokens: int) -> dict:
    """{"experts", "routing"}: FLOPs per token and step for an image of num_tokens tokens; "experts" is
    what the budget U counts (§4.3). reViT's own two FFNs are measured here (revit.py has no accounting)."""
    if isinstance(ffn, Mlp):
        return {"experts": ffn_flops(ffn.fc1.in_features, ffn.fc1.out_features), "routing": 0}
    if isinstance(ffn, MergedExpertFFN):
        # routing, for one image: psi on s_t (1 -> 16 -> E) and the Eq. 2 merge (E * P multiply-adds)
        router = 2 * (ffn.router[0].out_features + ffn.router[2].in_features * ffn.num_experts)
        merge = 2 * ffn.num_experts * params_per_expert(ffn)
        return {"experts": ffn_flops(ffn.dim, ffn.hidden), "routing": (router + merge) / num_tokens}
    return ffn.active_flops_per_token(num_tokens)

def ffn_budget(model: nn.Module, num_tokens: int | None = None) -> float:
    """Nominal FFN budget U (§4.3): active expert-FFN FLOPs per token and step / one dense FFN's, at
    num_tokens = 1 + num_patches (routers, merges, Soft-MoE's dispatch/combine: not in U). Soft-MoE's S
    slots cost S / T FFNs per token: with the class token, the paper's slots / patches times N / (N + 1)."""
    c = model.config
    ffn = model.block.mlp if isinstance(model, ReViT) else model.blocks[0].mlp
    flops = active_flops_per_token(ffn, num_tokens or 1 + c.num_patches)
    return flops["experts"] / ffn_flops(c.dim, c.ffn_dim)

# --- presets of the comparison (App. B, Tables 8 and 10) ---

# mechanism -> {U: (E routed experts, K active per token (0: not a top-K router), shared experts, ehr)},
# ehr = expert hidden width / d. A ViT FFN has ehr 4, so the experts get expert_ffn_fraction = ehr / 4
# of the preset's ffn_dim at every size. At U = 1, DeepSeek-V3 and Qwen3 route K = 1 expert and
# renormalise its gate to 1, so their routers get no gradient (true to the rules; DeepSeek-V3 still
# balances through its bias). Qwen3's balance loss: w = 1e-3 at U > 1, none at U = 1 (App. B).
MOE_TABLE = {
    "lory": {1: (4, 0, 0, 4)},
    "smear": {1: (4, 0, 0, 4)},
    "feature": {1: (4, 0, 0, 4)},  # Fig. 2's feature-only control (SMEAR-style gate, reViT's aux losses)
    "deepseek": {1: (4, 1, 1, 2), 1.5: (8, 2, 1, 2), 2: (16, 6, 2, 1), 4: (32, 12, 4, 1)},
    "qwen3": {1: (4, 1, 0, 4), 1.5: (48, 6, 0, 1), 2: (64, 8, 0, 1), 4: (128, 16, 0, 1)},
    "moeut": {1: (4, 1, 0, 4), 1.5: (8, 2, 0, 3), 2: (16, 4, 0, 2), 4: (32, 16, 0, 1)},
    "remoe": {1: (4, 0, 0, 1), 1.5: (6, 0, 0, 1), 2: (8, 0, 0, 1), 4: (16, 0, 0, 1)},   # all experts run
    "softmoe": {1: (4, 0, 0, 4), 1.5: (6, 0, 0, 4), 2: (8, 0, 0, 4), 4: (16, 0, 0, 4)},  # N/4 slots each
}
MOE_SIZES = {size: revit.SIZES[size] for size in ("s", "b", "b14", "mini", "mini32")}  # S/16, B/16, B/14; CPU

def _moe_presets() -> dict:
    """revit-{size}-{mechanism}-u{U} for every cell of MOE_TABLE, revit-{size}-{mechanism} for U = 1,
    and revit-{size}-lora (Table 10: r = 64 at S/16, i.e. r = d / 6)."""
    presets = {}
    for size, width in MOE_SIZES.items():
        for mechanism, budgets in MOE_TABLE.items():
            for budget, (experts, top_k, shared, ehr) in budgets.items():
                preset = dict(width, arch="revit", ffn=mechanism, num_experts=experts, shared_experts=shared,
                              expert_ffn_fraction=ehr / 4, **({"top_k": top_k} if top_k else {}))
                if mechanism == "qwen3":  # App. B: global-batch balance loss 1e-3 at higher U only
                    preset["balance_weight"] = 1e-3 if budget > 1 else 0.0
                presets[f"revit-{size}-{mechanism}-u{budget:g}"] = preset
                if budget == 1:
                    presets[f"revit-{size}-{mechanism}"] = preset
        presets[f"revit-{size}-lora"] = dict(width, arch="revit", ffn="lora", num_experts=1,
                                             lora_rank=width["dim"] // 6)
    return presets

PRESETS = {**revit.PRESETS, **_moe_presets()}  # every vision preset

def create_model(name: str, **overrides) -> nn.Module:
    """Build any vision preset by name, revit.py's or a mechanism's: create_model("revit-s-smear")."""
    return revit.build_model(config_of({**revit.preset(name, PRESETS), **overrides}))

def config_of(values: dict) -> revit.ViTConfig:
    """The config of a vision model: this file's for a mechanism, else revit's. Checkpoints saved before
    this file had its own config hold its fields with ffn="merge": checked, then dropped."""
    config = revit.make_config(ViTConfig, values)
    if config.ffn != "merge":
        return config
    return revit.ViTConfig(**{f.name: getattr(config, f.name) for f in fields(revit.ViTConfig)})

if __name__ == "__main__":  # python -m lib.moe [names...]: parameter counts of the presets (meta device)
    import sys

    if {"-h", "--help"} & set(sys.argv):
        print("usage: python -m lib.moe [PRESET ...]: parameter counts of the mechanisms' presets "
              "(default: revit-s and its mechanisms)")
        sys.exit()
    # reViT-S/16 and each mechanism at every U of MOE_TABLE (§4.3), each once: -u1 is the bare name
    shown = [n for n in PRESETS if n.startswith("revit-s-") and n not in revit.PRESETS and n[-3:] != "-u1"]
    rows = []
    for name in sys.argv[1:] or ["revit-s", *shown]:
        try:
            with torch.device("meta"):
                model = create_model(name)
        except ValueError as e:  # every name is checked before the table starts: one line, no header
            sys.exit(f"lib.moe: {e}")
        budget = f"{ffn_budget(model):.3g}" if model.config.arch == "revit" else ""
        counts = f"{model.num_params() / 1e6:.2f} | {expert_ffn_params(model) / 1e6:.2f}"
        rows.append(f"| {name} | {counts} | {budget} |")
    # one write: `| head` closing the pipe early ends the command quietly
    print("| preset | params (M) | expert FFN (M) | U |", "|---|---:|---:|---:|", *rows, sep="\n")
