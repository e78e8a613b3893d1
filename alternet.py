"""
AlterNet: a looped mixture of single-block experts with learned halting.

Kastius, "AlterNet: Adaptive-Depth Mixture-of-Experts with Learned Halting for
Elastic Inference" (arXiv 2611.08741), §3 and Appendices A-C. Equation numbers in
the comments are those of SPEC.md Part 2 (which restates the paper's).

How it differs from a GPT:
- Positions are injected once (token + learned position embedding); there is no
  stack of layers but a loop of up to D iterations over a bank of E experts, each
  expert ONE pre-norm transformer block (causal attention, then an FFN).
- Routing is per sequence, not per token: a linear router reads the hidden state of
  the last valid token plus sinusoidal encodings of the depth coordinate t = d/(D-1)
  and of the remaining budget 1-t. The encodings go to the router only, never into
  the residual stream. Top-k experts, softmax renormalised over the selected ones.
- Each iteration is a gated residual step x <- x + sum_j g_j y_j, with y_j the
  residual update of expert j (block(x) - x).
- Every expert has a halt head; their gated mix gives the probability of halting at
  this step, and PonderNet turns these into a distribution p over depths. A shared
  final LayerNorm + LM head (tied to the token embedding) decodes every iteration,
  and the loss is the p-weighted sum of the per-step cross-entropies plus KL(p||prior),
  Switch load balance, router z-loss and a relative-improvement loss for the halt
  heads.
- At inference a sequence stops when its cumulative halting probability passes a
  threshold (or by sampling); the iteration count may also be capped below D without
  retraining. `halting=False` is the paper's fixed-depth baseline "Model I".

A property of the design worth knowing: the router (and the halt heads) read the LAST
valid token, so in training the expert choice for a whole sequence is made with every
token in view. Attention is causal, but the logits at position i < T-1 depend on later
tokens through that choice (a few bits per step per sequence). Generation is exact
(it predicts from the last token); `lengths` moves the routing position.

Defaults where the paper is ambiguous (each reachable or documented at its code):
- y_j is the block's residual update, so Eq. 3 is a gated residual step.
- The curriculum ("forced to full depth") puts all halting mass on step D-1 in training;
  see AlterNet.curriculum_active. The a_KL ramp starts at step 0.
- Load balance and z-loss pool every (sequence, step) routing decision, so experts may
  specialise by depth; f_i counts top-k selections (sums to k). z-loss uses the clamped
  logits the router acts on.
- The "global" halt-head ablation is one head reading the new state x_{d+1} at the last
  valid token (PonderNet-style), instead of one head per expert.
- L_RIR uses the raw lambda_d of the halt heads (also at d = D-1, where p forces 1).

File layout: depth encoding -> halting / loss functions -> attention, FFN, expert ->
config -> model -> presets -> create_model. Generation is a method of the model.
"""

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

# --- depth encoding (paper §3, Eq. 1) -------------------------------------------


def depth_coordinate(step, max_depth):
    """t = d / (D - 1) (Eq. 1). D = 1 has a single step; we give it t = 0."""
    return step / (max_depth - 1) if max_depth > 1 else 0.0


def depth_encoding(t, dim):
    """Vaswani sinusoidal encoding of a scalar position t: (dim,), interleaved sin/cos.

    Parameter-free, so it is defined for t outside [0, 1] too (depths beyond the
    training D, and a negative budget 1 - t there).
    """
    freqs = torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # (dim/2,)
    angles = t * freqs
    return rearrange(torch.stack([angles.sin(), angles.cos()]), "two f -> (f two)")  # (dim,)


# --- halting and the losses (Eq. 4-10) --------------------------------------------


def halting_probability(gates, halt_logits):
    """Eq. 4: lambda = sum_j g_j sigmoid(lhat_j) over the selected experts.

    gates, halt_logits: (..., k) -> (...,). The gates sum to 1, so lambda is in (0, 1).
    """
    return (gates * halt_logits.sigmoid()).sum(-1)


def halting_distribution(lambdas):
    """Eq. 5, PonderNet: p_d = lambda_d prod_{i<d} (1 - lambda_i).

    lambdas: (B, D) conditional halting probabilities -> p: (B, D). The last step
    takes the remaining mass (lambda_{D-1} := 1), so every row sums to 1.
    """
    lambdas = torch.cat([lambdas[:, :-1], torch.ones_like(lambdas[:, -1:])], dim=1)
    not_halted_before = torch.cumprod(
        torch.cat([torch.ones_like(lambdas[:, :1]), 1 - lambdas[:, :-1]], dim=1), dim=1
    )  # (B, D): P_unhalted,d
    return not_halted_before * lambdas


def depth_prior(num_steps, max_depth, kind="gaussian", geometric_p=0.12):
    """Prior q over steps 0..num_steps-1, truncated and renormalised to sum to 1.

    gaussian: q_d ∝ N(d; D/2, D/4) with D = max_depth (paper §3); geometric: q_d ∝ p (1-p)^d
    (PonderNet). A cap num_steps < D at inference truncates the same prior.
    """
    d = torch.arange(num_steps, dtype=torch.float32)
    if kind == "gaussian":
        mean, std = max_depth / 2, max_depth / 4
        log_q = -0.5 * ((d - mean) / std) ** 2
    elif kind == "geometric":
        log_q = d * math.log1p(-geometric_p)
    else:
        raise ValueError(f"prior must be one of 'gaussian', 'geometric', got {kind!r}")
    return log_q.softmax(0)  # softmax of log-weights = normalisation over 0..num_steps-1


def kl_divergence(p, q):
    """Eq. 8: KL(p || q) = mean_b sum_d p_d log(p_d / q_d); 0 log 0 = 0. p: (B, D), q: (D,).

    The argument order matters: KL(p || prior), not the reversed one several
    PonderNet codes compute by misusing KLDivLoss.
    """
    return (torch.xlogy(p, p) - p * q.log()).sum(-1).mean()


def load_balance_loss(router_logits, expert_indices, num_experts):
    """Switch load balance E * sum_i f_i P_i over routing decisions.

    router_logits: (N, E) (N = every (sequence, step) decision, pooled), expert_indices:
    (N, k). f_i = fraction of decisions routing to i (sums to k, as in HF Mixtral/Qwen;
    the balanced minimum is k), P_i = mean full-softmax probability of i.
    """
    routed = F.one_hot(expert_indices, num_experts).sum(1).float()  # (N, E), 0/1 per expert
    fraction = routed.mean(0)  # (E,)
    mean_probability = router_logits.softmax(-1).mean(0)  # (E,)
    return num_experts * (fraction * mean_probability).sum()


def router_z_loss(router_logits):
    """z-loss (Zoph et al. 2022): mean over decisions of logsumexp(l)^2. router_logits: (N, E)."""
    return torch.logsumexp(router_logits, dim=-1).pow(2).mean()


def improvement_weights(step_ce):
    """Eq. 10: w_d = sigmoid(50 (max(CE_{d-1} - CE_d, 0) - 0.005)) for d = 1..D-1.

    step_ce: (D, B) per-sequence CE -> (D-1, B), detached (it is a target).
    """
    step_ce = step_ce.detach()
    return torch.sigmoid(50 * ((step_ce[:-1] - step_ce[1:]).clamp(min=0) - 0.005))


def relative_improvement_loss(lambdas, step_ce, ran=None):
    """Eq. 9: L_RIR = 1/B sum_b 1/(D-1) sum_{d>=1} BCE(lambda_d, 1 - w_d).

    lambdas: (D, B) halt-head probabilities; step_ce: (D, B); ran: (D, B) bool, which
    steps each sequence ran (inference with early halting; all True in training).
    A sequence averages over the steps d >= 1 it ran.
    """
    if lambdas.shape[0] < 2:
        return lambdas.sum() * 0
    target = 1 - improvement_weights(step_ce)  # (D-1, B): halt when step d did not help
    bce = F.binary_cross_entropy(lambdas[1:], target, reduction="none")  # (D-1, B)
    ran = torch.ones_like(bce, dtype=torch.bool) if ran is None else ran[1:]
    per_sequence = (bce * ran).sum(0) / ran.sum(0).clamp(min=1)  # (B,)
    has_pairs = ran.any(0)
    return (per_sequence * has_pairs).sum() / has_pairs.sum().clamp(min=1)


# --- building blocks: attention, FFN, expert ----------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):  # (B, T, H)
        q, k, v = rearrange(self.qkv(x), "b t (three h d) -> three b h t d", three=3, h=self.heads)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, T, H/heads)
        return self.proj(rearrange(y, "b h t d -> b t (h d)"))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Expert(nn.Module):
    """One pre-norm transformer block that returns its residual update y = block(x) - x.

    SPEC §2.1 ambiguity, default: y excludes the block's own residual, so Eq. 3 is a
    gated residual step. Computed directly (no subtraction), so y is exact.
    The per-expert halt head lives here (None with a global head or halting off).
    """

    def __init__(self, config):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.attn = CausalSelfAttention(config.dim, config.heads)
        self.norm2 = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.ffn = FeedForward(config.dim, config.ffn_dim)
        per_expert = config.halting and config.halt_head == "per_expert"
        self.halt_head = nn.Linear(config.dim, 1) if per_expert else None

    def forward(self, x):  # (B, T, H) -> (B, T, H)
        attn_update = self.attn(self.norm1(x))
        return attn_update + self.ffn(self.norm2(x + attn_update))


# --- config --------------------------------------------------------------------


@dataclass
class AlterNetConfig:
    # sizes (defaults = the byte-level CPU preset "alternet-tiny")
    vocab_size: int = 256
    seq_len: int = 128  # block size: learned positions exist for this many tokens
    dim: int = 128  # H
    heads: int = 4
    ffn_dim: int = 512  # expert FFN width (Appendix B group A varies it with num_experts)
    num_experts: int = 4  # E
    top_k: int = 2
    max_depth: int = 6  # D: iterations in training; t = d/(D-1) uses it at inference too
    depth_dim: int = 16  # m: size of each sinusoidal depth encoding
    budget_signal: bool = True  # also feed e_{1-t} to the router (Appendix B group B)
    logit_clamp: float | None = 10.0  # router logits clamped to [-c, c]; None = off (group F)
    tie_embeddings: bool = True  # LM head shares the token embedding
    norm_eps: float = 1e-5
    # halting
    halting: bool = True  # False = fixed-depth baseline "Model I": no halt heads, loss = last-step CE
    halt_head: str = "per_expert"  # "per_expert" (Eq. 4) | "global": one head on x_{d+1} (group C)
    halt_bias_init: float = -3.0
    prior: str = "gaussian"  # "gaussian" N(D/2, D/4) | "geometric" (PonderNet)
    geometric_p: float = 0.12
    # loss weights and schedules (Eq. 6); set_step(step) drives the two schedules
    kl_weight: float = 0.1  # a_KL (group D)
    kl_ramp_steps: int = 200  # a_KL rises linearly from 0 over this many optimizer steps
    min_depth_warmup: int = 200  # curriculum: all halting mass on step D-1 for this many steps
    balance_weight: float = 1e-2  # a_LB
    z_loss_weight: float = 1e-3  # a_z (group F)
    rir_weight: float = 0.2  # a_RIR

    def __post_init__(self):
        positive = ("vocab_size", "seq_len", "dim", "heads", "ffn_dim", "num_experts", "max_depth", "depth_dim")
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.dim % self.heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by heads ({self.heads})")
        if self.depth_dim % 2:
            raise ValueError(f"depth_dim must be even (sin/cos pairs), got {self.depth_dim}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in 1..num_experts={self.num_experts}, got {self.top_k}")
        if self.halt_head not in ("per_expert", "global"):
            raise ValueError(f"halt_head must be one of 'per_expert', 'global', got {self.halt_head!r}")
        if self.prior not in ("gaussian", "geometric"):
            raise ValueError(f"prior must be one of 'gaussian', 'geometric', got {self.prior!r}")
        if not 0 < self.geometric_p < 1:
            raise ValueError(f"geometric_p must be in (0, 1), got {self.geometric_p}")
        if self.logit_clamp is not None and not self.logit_clamp > 0:
            raise ValueError(f"logit_clamp must be a positive float or None (off), got {self.logit_clamp}")
        for name in ("kl_weight", "balance_weight", "z_loss_weight", "rir_weight", "kl_ramp_steps", "min_depth_warmup"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


# --- the model -------------------------------------------------------------------


class AlterNet(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        H, E = config.dim, config.num_experts
        self.tok_emb = nn.Embedding(config.vocab_size, H)
        self.pos_emb = nn.Embedding(config.seq_len, H)
        num_encodings = 2 if config.budget_signal else 1
        self.router = nn.Linear(H + num_encodings * config.depth_dim, E, bias=False)  # W_r: E x (H + 2m)
        self.experts = nn.ModuleList(Expert(config) for _ in range(E))
        use_global = config.halting and config.halt_head == "global"
        self.halt_head = nn.Linear(H, 1) if use_global else None
        self.norm = nn.LayerNorm(H, eps=config.norm_eps)
        self.lm_head = nn.Linear(H, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            # GPT-2: scale the projections into the residual stream; here up to D of them are summed
            if name.endswith(("attn.proj.weight", "ffn.fc2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.max_depth))
            if name.endswith("halt_head.bias"):
                nn.init.constant_(p, config.halt_bias_init)  # sigmoid(-3) ~ 0.05: start by not halting
        self.step = None  # optimizer step from set_step(); None (no trainer) = curriculum over, full a_KL

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self, non_embedding=False):
        """Parameter count (the tied LM head counted once); non_embedding drops the position table."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.pos_emb.weight.numel() if non_embedding else n

    def no_weight_decay(self):
        """Names to exclude from weight decay beyond the p.ndim < 2 rule: none."""
        return set()

    # -- training schedules (paper §4, Appendix A/C) --

    def set_step(self, step):
        """Called by the training loop before the forward of optimizer step `step`."""
        self.step = int(step)

    @property
    def curriculum_active(self):
        """Curriculum release: during the first min_depth_warmup training steps the model
        is "forced to stick to its maximum number of iterations" (paper §4). Training always
        runs D iterations, so we force it in the objective: every lambda_d := 0 for d < D-1,
        p puts all mass on the last step, L_PN is the last step's CE and L_KL is constant.
        The halt heads keep learning from L_RIR meanwhile. Release is abrupt at the step."""
        cfg = self.config
        return cfg.halting and self.training and self.step is not None and self.step < cfg.min_depth_warmup

    @property
    def kl_scale(self):
        """a_KL ramp: linear from 0 to 1 over kl_ramp_steps (from step 0)."""
        ramp = self.config.kl_ramp_steps
        return 1.0 if self.step is None or ramp == 0 else min(1.0, self.step / ramp)

    # -- one iteration of the depth loop (Eq. 1-4) --

    def route(self, h, step):
        """Sequence-level router (Eq. 1-2). h: (n, H) last-valid-token states -> logits (n, E), fp32."""
        cfg = self.config
        t = depth_coordinate(step, cfg.max_depth)
        encodings = [depth_encoding(t, cfg.depth_dim)]  # e_t
        if cfg.budget_signal:
            encodings.append(depth_encoding(1 - t, cfg.depth_dim))  # e_{1-t}: remaining budget
        encodings = torch.cat(encodings).to(h.device).expand(h.shape[0], -1)  # (n, m or 2m)
        with torch.autocast(h.device.type, enabled=False):  # router math in fp32 (Switch)
            logits = F.linear(torch.cat([h.float(), encodings], dim=-1), self.router.weight.float())
        if cfg.logit_clamp is not None:
            logits = logits.clamp(-cfg.logit_clamp, cfg.logit_clamp)
        return logits

    def iterate(self, x, last, step):
        """x: (n, T, H) states of the sequences still running, last: (n,) last valid index.

        Returns the next states and the routing/halting record of this step. Experts run
        on the sequences routed to them (a loop over experts, never over sequences).
        """
        n, k = x.shape[0], self.config.top_k
        seq_index = torch.arange(n, device=x.device)
        router_logits = self.route(x[seq_index, last], step)  # (n, E)
        top_logits, expert_indices = router_logits.topk(k, dim=-1)  # (n, k)
        gates = top_logits.softmax(-1)  # Eq. 2: renormalised over the selected experts only
        update = torch.zeros_like(x)
        halt_logits = x.new_zeros(n, k, dtype=torch.float32)
        rir_halt_logits = x.new_zeros(n, k, dtype=torch.float32)
        for e, expert in enumerate(self.experts):
            seq, slot = (expert_indices == e).nonzero(as_tuple=True)  # sequences routed to e, their slot
            if seq.numel() == 0:
                continue
            y = expert(x[seq])  # (n_e, T, H)
            gate = gates[seq, slot]  # (n_e,)
            update = update.index_add(0, seq, (gate[:, None, None] * y).to(update.dtype))
            if expert.halt_head is not None:
                y_last = y[torch.arange(seq.numel(), device=x.device), last[seq]]  # (n_e, H)
                lhat = expert.halt_head(y_last).squeeze(-1).float()
                halt_logits = halt_logits.index_put((seq, slot), lhat)
                # L_RIR must train only the halt heads: same heads on detached inputs
                rir_lhat = expert.halt_head(y_last.detach()).squeeze(-1).float()
                rir_halt_logits = rir_halt_logits.index_put((seq, slot), rir_lhat)
        x_next = x + update  # Eq. 3: gated residual step
        if self.halt_head is not None:  # global head reads the new state's last valid token
            h_last = x_next[seq_index, last]
            lambdas = self.halt_head(h_last).squeeze(-1).float().sigmoid()
            rir_lambdas = self.halt_head(h_last.detach()).squeeze(-1).float().sigmoid()
        elif self.config.halting:
            lambdas = halting_probability(gates, halt_logits)  # Eq. 4
            rir_lambdas = halting_probability(gates.detach(), rir_halt_logits)
        else:
            lambdas = rir_lambdas = x.new_zeros(n, dtype=torch.float32)
        record = dict(router_logits=router_logits, expert_indices=expert_indices, gates=gates,
                      halt_lambdas=lambdas, rir_lambdas=rir_lambdas)
        return x_next, record

    def decode(self, x, last=None):
        """Shared final norm + LM head: (n, T, H) -> (n, T, V), or (n, 1, V) at `last` only."""
        if last is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last][:, None]
        return self.lm_head(self.norm(x))

    # -- the forward pass --

    def forward(self, tokens, targets=None, max_depth=None, halt_threshold=None, lengths=None, *,
                sample_halting=False, return_states=False, last_token_only=False):
        """tokens: (B, T) long, right-padded when `lengths` (B,) is given.

        max_depth: cap D' on iterations (default D). halt_threshold: stop a sequence once
        its cumulative halting probability reaches it; sample_halting: stop with
        probability lambda_d (the conditional, not p_d). Either one needs halting=True;
        during the curriculum both are ignored (full depth). Without them every
        sequence runs D' steps. targets: (B, T) long, -1 = ignore (as are positions >= lengths).

        Returns a dict (see notes/CONTRACT.md):
          logits (B, T, V)           output of the step each sequence stopped at
          step_logits (D', B, T, V)  per step; after a sequence halts its row repeats its output
          halting_distribution (B, D')  p of Eq. 5; a sequence halted early at step h has
                                     lambda_h := 1 (all remaining mass), like a cap at h + 1
          iterations (B,) long, aux_losses {kl, balance, z[, rir]} already weighted,
          router_logits (D', B, E), expert_indices (D', B, k) (-1 after halting),
          gates (D', B, k), halt_lambdas (B, D') raw lambda_d (before the last-step/curriculum
          overrides), states (list of D'+1 (B, T, H)) when return_states,
          and with targets: task_loss (L_PN), loss, step_losses (D',) token-mean CE per step.
        """
        cfg = self.config
        B, T, num_steps, last = self._check_inputs(tokens, targets, max_depth, halt_threshold, lengths,
                                                   sample_halting, last_token_only)
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(T, device=tokens.device))  # (B, T, H), positions once
        forced_full_depth = not cfg.halting or self.curriculum_active
        early_exit = not forced_full_depth and (halt_threshold is not None or sample_halting)

        active = torch.arange(B, device=tokens.device)  # sequences still iterating
        not_halted = torch.ones(B, device=tokens.device)  # P_unhalted,d (detached, for decisions)
        iterations = torch.zeros(B, dtype=torch.long, device=tokens.device)
        logits, states, records = None, [x], []
        for step in range(num_steps):
            everyone = active.numel() == B
            x_active, last_active = (x, last) if everyone else (x[active], last[active])
            x_next, record = self.iterate(x_active, last_active, step)
            step_logits = self.decode(x_next, last_active if last_token_only else None)

            # lambda used in p: 0 when forced to full depth, 1 at the last step (Eq. 5)
            lambdas = torch.zeros_like(record["halt_lambdas"]) if forced_full_depth else record["halt_lambdas"]
            halt_now = torch.full_like(lambdas, step == num_steps - 1, dtype=torch.bool)
            if early_exit and step < num_steps - 1:
                if sample_halting:
                    halt_now = torch.bernoulli(lambdas.detach()).bool()
                else:
                    halted_mass = 1 - not_halted[active] * (1 - lambdas.detach())  # cumulative sum of p
                    halt_now = halted_mass >= halt_threshold
            lambdas = torch.where(halt_now, torch.ones_like(lambdas), lambdas)
            record["lambdas"] = lambdas
            not_halted = not_halted.index_copy(0, active, not_halted[active] * (1 - lambdas.detach()))
            iterations = iterations.index_add(0, active, torch.ones_like(active))

            # write the running sequences back; halted ones keep their state and output
            x = x_next if everyone else x.index_copy(0, active, x_next)
            logits = step_logits if logits is None or everyone else logits.index_copy(0, active, step_logits)
            records.append((logits, self._scatter_record(record, active, B)))
            states.append(x)
            active = active[~halt_now]
            if active.numel() == 0:
                break

        step_logits = torch.stack([r[0] for r in records])  # (D', B, T, V)
        rec = {key: torch.stack([r[1][key] for r in records]) for key in records[0][1]}  # each (D', B, ...)
        p = halting_distribution(rec["lambdas"].T)  # (B, D')
        out = dict(logits=logits, step_logits=step_logits, halting_distribution=p, iterations=iterations,
                   router_logits=rec["router_logits"], expert_indices=rec["expert_indices"],
                   gates=rec["gates"], halt_lambdas=rec["halt_lambdas"].T)
        if return_states:
            out["states"] = states
        out["aux_losses"] = self._aux_losses(rec, p)
        if targets is not None:
            self._task_losses(out, rec, targets, lengths)
        return out

    def _scatter_record(self, record, active, batch_size):
        """Per-step record of the running sequences -> full batch; halted rows get fills."""
        if active.numel() == batch_size:
            ran = torch.ones(batch_size, dtype=torch.bool, device=active.device)
            return dict(record, ran=ran)
        full = {}
        for key, value in record.items():
            fill = -1 if key == "expert_indices" else 0
            full[key] = value.new_full((batch_size, *value.shape[1:]), fill).index_copy(0, active, value)
        full["ran"] = torch.zeros(batch_size, dtype=torch.bool, device=active.device).index_fill(0, active, True)
        return full

    def _aux_losses(self, rec, p):
        """Router losses pooled over every (step, sequence) decision made; halting KL (Eq. 6, 8)."""
        cfg = self.config
        ran = rec["ran"]  # (D', B)
        router_logits, expert_indices = rec["router_logits"][ran], rec["expert_indices"][ran]  # (N, E), (N, k)
        aux = dict(balance=cfg.balance_weight * load_balance_loss(router_logits, expert_indices, cfg.num_experts),
                   z=cfg.z_loss_weight * router_z_loss(router_logits))
        if cfg.halting:
            prior = depth_prior(p.shape[1], cfg.max_depth, cfg.prior, cfg.geometric_p).to(p.device)
            aux["kl"] = cfg.kl_weight * self.kl_scale * kl_divergence(p, prior)
        return aux

    def _task_losses(self, out, rec, targets, lengths):
        """L_PN (Eq. 7), L_RIR (Eq. 9) and per-step CE for logging."""
        cfg = self.config
        step_logits, p = out["step_logits"], out["halting_distribution"]
        D, B, T, V = step_logits.shape
        valid = targets != -1
        if lengths is not None:
            valid &= torch.arange(T, device=targets.device) < lengths[:, None]
        targets = targets.masked_fill(~valid, -1)
        ce = torch.stack([F.cross_entropy(rearrange(logits.float(), "b t v -> (b t) v"), targets.flatten(),
                                          ignore_index=-1, reduction="none").view(B, T)
                          for logits in step_logits])  # (D, B, T), one step at a time to bound memory
        counts = valid.sum(1).clamp(min=1)  # (B,)
        step_ce = ce.sum(-1) / counts  # (D, B): per-sequence mean CE of each step
        out["task_loss"] = (p * step_ce.T).sum(1).mean()  # Eq. 7
        out["step_losses"] = (ce.sum((1, 2)) / valid.sum().clamp(min=1)).detach()  # (D,)
        if cfg.halting:
            rir = relative_improvement_loss(rec["rir_lambdas"], step_ce, rec["ran"])
            out["aux_losses"]["rir"] = cfg.rir_weight * rir
        out["loss"] = out["task_loss"] + sum(out["aux_losses"].values())

    def _check_inputs(self, tokens, targets, max_depth, halt_threshold, lengths, sample_halting, last_token_only):
        cfg = self.config
        if tokens.dim() != 2 or tokens.dtype != torch.long:
            raise ValueError(f"tokens must be a (B, T) long tensor, got {tuple(tokens.shape)} {tokens.dtype}")
        B, T = tokens.shape
        if not 1 <= T <= cfg.seq_len:
            raise ValueError(f"tokens: sequence length must be in 1..seq_len={cfg.seq_len}, got {T}")
        if targets is not None and targets.shape != tokens.shape:
            raise ValueError(f"targets must have the shape of tokens {tuple(tokens.shape)}, got {tuple(targets.shape)}")
        if targets is not None and last_token_only:
            raise ValueError("targets: not supported with last_token_only=True (the loss needs every position)")
        num_steps = cfg.max_depth if max_depth is None else max_depth
        if not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"max_depth must be None or an integer >= 1, got {max_depth!r}")
        if halt_threshold is not None and not 0 < halt_threshold <= 1:
            raise ValueError(f"halt_threshold must be None or in (0, 1], got {halt_threshold!r}")
        if halt_threshold is not None and sample_halting:
            raise ValueError("halt_threshold and sample_halting=True are alternatives: give one of them")
        if (halt_threshold is not None or sample_halting) and not cfg.halting:
            raise ValueError("halt_threshold/sample_halting: this model has halting=False (fixed depth); use max_depth")
        if lengths is None:
            last = torch.full((B,), T - 1, dtype=torch.long, device=tokens.device)
        else:
            if lengths.shape != (B,) or lengths.dtype != torch.long or lengths.min() < 1 or lengths.max() > T:
                raise ValueError(f"lengths must be a (B,) long tensor with values in 1..T={T}")
            last = lengths - 1
        return B, T, num_steps, last

    # -- generation --

    @torch.no_grad()
    def generate(self, tokens, max_new_tokens, halt_threshold=0.5, max_depth=None, temperature=1.0, top_k=None,
                 sample_halting=False, return_iterations=False):
        """Autoregressive sampling with the same halting as forward (call .eval() first).

        tokens: (B, T) long -> (B, T + max_new_tokens); the context is cropped to seq_len.
        temperature 0 = greedy. Fixed-depth models ignore halt_threshold (they run max_depth).
        return_iterations: also return the iterations used per new token, (B, max_new_tokens).
        """
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k is not None and not 1 <= top_k <= self.config.vocab_size:
            raise ValueError(f"top_k must be None or in 1..vocab_size={self.config.vocab_size}, got {top_k}")
        if not self.config.halting or sample_halting:
            halt_threshold = None
        sample_halting = sample_halting and self.config.halting
        used = []
        for _ in range(max_new_tokens):
            context = tokens[:, -self.config.seq_len:]
            out = self(context, max_depth=max_depth, halt_threshold=halt_threshold,
                       sample_halting=sample_halting, last_token_only=True)
            logits = out["logits"][:, -1, :].float()  # (B, V)
            if temperature == 0:
                next_token = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, top_k).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                next_token = torch.multinomial(logits.softmax(-1), num_samples=1)  # (B, 1)
            tokens = torch.cat([tokens, next_token], dim=1)
            used.append(out["iterations"])
        if return_iterations:
            return tokens, torch.stack(used, dim=1) if used else tokens.new_zeros(tokens.shape[0], 0)
        return tokens

    sample = generate  # the name for it


# --- presets (paper Appendix A, Tables 1-2) ------------------------------------------

PRESETS = {
    # Byte-level CPU model for tinyshakespeare: Run II recipe (Gaussian prior, curriculum,
    # a_RIR 0.2) with schedules shortened to a few-thousand-step run and a_KL 0.1 (group D).
    "alternet-tiny": dict(vocab_size=256, seq_len=128, dim=128, heads=4, ffn_dim=512, num_experts=4, top_k=2,
                          max_depth=6, depth_dim=16, prior="gaussian", kl_weight=0.1, kl_ramp_steps=200,
                          min_depth_warmup=200, rir_weight=0.2),
    # 50M ablation model, trained as in Table 2: geometric prior p=0.12, a_KL 0.1, no curriculum, a_RIR 0.
    "alternet-50m": dict(vocab_size=50257, seq_len=512, dim=512, heads=8, ffn_dim=2048, num_experts=8, top_k=2,
                         max_depth=8, depth_dim=32, prior="geometric", geometric_p=0.12, kl_weight=0.1,
                         kl_ramp_steps=1000, min_depth_warmup=0, rir_weight=0.0),
    # 350M Run II: Gaussian prior (mu=6, sigma=3 = D/2, D/4), a_KL 1.0 ramped, 1000-step curriculum, a_RIR 0.2.
    "alternet-350m": dict(vocab_size=50257, seq_len=512, dim=2048, heads=16, ffn_dim=2048, num_experts=10, top_k=2,
                          max_depth=12, depth_dim=64, prior="gaussian", kl_weight=1.0, kl_ramp_steps=1000,
                          min_depth_warmup=1000, rir_weight=0.2),
}
# Fixed-depth twins: the paper's "Model I" (halting off, always D iterations).
PRESETS.update({f"{name}-fixed": dict(overrides, halting=False) for name, overrides in list(PRESETS.items())})


def create_model(name, **overrides):
    """Build a preset, e.g. create_model("alternet-tiny", max_depth=8). Unknown names -> ValueError."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    fields = [f.name for f in dataclasses.fields(AlterNetConfig)]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ValueError(f"unknown config field(s) {unknown}; AlterNetConfig fields are {fields}")
    return AlterNet(AlterNetConfig(**{**PRESETS[name], **overrides}))
