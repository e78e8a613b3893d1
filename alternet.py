"""
AlterNet: a looped mixture of single-block experts with learned halting. Kastius, "AlterNet: Adaptive-Depth
Mixture-of-Experts with Learned Halting for Elastic Inference" (arXiv 2611.08741), §3 and Appendices A-C;
equation numbers are the paper's.

How it differs from a GPT:
- Positions are added once (token + learned position embedding); no stack of layers but a loop of up to D
  iterations over a bank of E experts, each ONE pre-norm transformer block (causal attention, then an FFN).
- Routing is per sequence: a linear router reads the last valid token's state plus sinusoidal encodings of
  the depth t = d/(D-1) and of the remaining budget 1-t (the router's input only, never the residual
  stream); top-k experts, softmax renormalised over the selected ones. Each iteration is a gated residual
  step x <- x + sum_j g_j y_j, y_j the residual update of expert j.
- The experts' halt heads give lambda_d, the probability of halting at iteration d given no halt before;
  PonderNet turns them into a distribution p over depths (in log space: saturated heads keep finite
  gradients). A shared final LayerNorm + LM head decodes every iteration; the loss is the p-weighted sum of
  the iterations' cross-entropies (over chunks of tokens recomputed in backward: never D full-vocabulary
  logit tensors) plus KL(p || prior), Switch load balance, router z-loss and a relative-improvement loss
  for the halt heads.
- At inference a sequence stops once its cumulative halting probability passes a threshold (or by
  sampling); a cap below D needs no retraining. `halting=False` is the paper's fixed-depth "Model I".

Three names, three ideas: `config.halting` is the switch (halt heads or Model I); `log_lambda` holds the
heads' log lambda_d (Eq. 4); `halting_distribution` is PonderNet's p (Eq. 5).

A property of the design worth knowing: the router (and the halt heads) read the LAST valid token, so on a
full window the expert choice for the whole sequence is made with every token in view. Attention is causal,
but the logits at position i < T-1 depend on later tokens through that choice: the gates and halting
probabilities are continuous functions of the last token's state, so the leak is not a few bits but a
real-valued signal at every iteration. The full-window loss is therefore optimistic; `causal_loss` scores
each position as generation does (routing and halting on its own prefix), and training cuts part of each
batch to random lengths (`random_length_fraction`) so the router and halt heads see every position.
Generation is exact.

Where the paper is silent the code says "our choice" and why; docs/choices.md lists them. Layout, in call
order: blocks -> config and its contract -> the model (forward and its loop, schedules, generate) -> the
loss (Eq. 4-10) -> helpers -> causal evaluation -> presets. Tokenizers: lib/language.py; sampling: sample.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from torch.utils.checkpoint import checkpoint

# --- building blocks: depth encoding (Eq. 1), attention, FFN, expert ------------------


def depth_encoding(t: float, dim: int) -> torch.Tensor:
    """Vaswani's sinusoidal encoding of a scalar t: (dim,), interleaved sin/cos; defined for t outside [0, 1]
    too (depths beyond the trained D, and a negative budget 1 - t there). Base 10,000 on t in [0, 1] as
    Vaswani's (our choice): the paper names the encoding, not its scale. Most frequencies barely turn over
    [0, 1]: 4 of 16 dims move by more than 0.05 across alternet-tiny's iterations, 8 of 32 at 50M, 15 of 64
    at 350M."""
    freqs = torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # (dim/2,)
    angles = t * freqs
    return rearrange(torch.stack([angles.sin(), angles.cos()]), "two f -> (f two)")  # (dim,)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, H)
        q, k, v = rearrange(self.qkv(x), "b t (three h d) -> three b h t d", three=3, h=self.heads)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, T, H/heads)
        return self.proj(rearrange(y, "b h t d -> b t (h d)"))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Expert(nn.Module):
    """One pre-norm transformer block that returns its residual update y = block(x) - x, computed directly (no
    subtraction: exact), and the expert's halt head (None with a global head or halting off).
    Pre-norm with a GELU FFN (our choice): the paper says "a transformer block"; GPT-2's layout, stable when
    the same blocks run up to D times. y is the update alone (our choice): the paper leaves open whether
    expert_k(x) includes the block's residual; so Eq. 3 is a gated residual step."""

    def __init__(self, config: AlterNetConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.attn = CausalSelfAttention(config.dim, config.heads)
        self.norm2 = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.ffn = FeedForward(config.dim, config.ffn_dim)
        per_expert = config.halting and config.halt_head == "per_expert"
        self.halt_head = nn.Linear(config.dim, 1) if per_expert else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, H) -> (B, T, H)
        attn_update = self.attn(self.norm1(x))
        return attn_update + self.ffn(self.norm2(x + attn_update))


# --- config (paper Appendix A, Table 2) and its contract --------------------------------


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
    halting: bool = True  # False = fixed-depth baseline "Model I": no halt heads, loss = last-iteration CE
    halt_head: str = "per_expert"  # "per_expert" (Eq. 4) | "global": one head on x_{d+1} (group C)
    halt_bias_init: float = -3.0
    prior: str = "gaussian"  # "gaussian" N(D/2, D/4) over iterations | "geometric" (PonderNet)
    geometric_p: float = 0.12
    # loss weights and schedules (Eq. 6); set_step(step) drives the schedules
    kl_weight: float = 0.1  # a_KL (group D)
    kl_ramp_steps: int = 200  # a_KL rises linearly from 0 over this many steps after the curriculum
    min_depth_warmup: int = 200  # curriculum: all halting mass on iteration D for this many steps
    min_depth_release_steps: int = 0  # 0: release the curriculum at once (paper); N: min depth D -> 1 in N
    balance_weight: float = 1e-2  # a_LB
    z_loss_weight: float = 1e-3  # a_z (group F)
    rir_weight: float = 0.2  # a_RIR
    # §3 routes on "the last valid token" but does not say how often a sequence is shorter than the window:
    # this fraction of each training batch is cut to a uniform random length, so routing and halting learn
    # every position that generation will route on (our choice).
    random_length_fraction: float = 0.5

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # each field's type first: RANGES compares values
            value, kind = getattr(self, f.name), f.type.removesuffix(" | None")
            typed = isinstance(value, TYPES[kind][0]) and isinstance(value, bool) == (kind == "bool")
            ok = typed and (kind != "float" or math.isfinite(value)) or (kind != f.type and value is None)
            refuse([(f.name, ok, TYPES[kind][1] + (" or None" if kind != f.type else ""))], shown=self)
        refuse(((name, test(getattr(self, name), self), allowed.format_map(vars(self)))
                for names, test, allowed in RANGES for name in names.split()), shown=self)


TYPES = {"int": (int, "an integer"), "float": ((int, float), "a finite number"),  # a bool is no number
         "bool": (bool, "True or False"), "str": (str, "a string")}
# Sizes far above the paper's V = 50,257 and D <= 12, past what a user reaches by intent (our choice): a
# typo or an edited checkpoint config is refused before anything is allocated or run.
MAX_ITERATIONS = 256  # D, and a call's cap on iterations
SIZES = dict(vocab_size=2 ** 20, seq_len=2 ** 17, dim=2 ** 15, heads=2 ** 10, ffn_dim=2 ** 17,
             num_experts=2 ** 10, max_depth=MAX_ITERATIONS, depth_dim=2 ** 12)
RANGES = [  # (fields, the test of each one's value v on the config c, what it allows; "{name}": c's name)
    *((name, lambda v, c, top=top: 1 <= v <= top, f"an integer in 1..{top}") for name, top in SIZES.items()),
    ("top_k", lambda v, c: 1 <= v <= c.num_experts, "in 1..num_experts={num_experts}"),
    ("dim", lambda v, c: v % c.heads == 0, "divisible by heads={heads}"),
    ("depth_dim", lambda v, c: v % 2 == 0, "even (sin/cos pairs)"),
    ("logit_clamp", lambda v, c: v is None or v > 0, "a positive number or None (off)"),
    ("norm_eps", lambda v, c: v > 0, "a positive number"),
    ("halt_head", lambda v, c: v in ("per_expert", "global"), "one of 'per_expert', 'global'"),
    ("prior", lambda v, c: v in ("gaussian", "geometric"), "one of 'gaussian', 'geometric'"),
    ("geometric_p", lambda v, c: 0 < v < 1, "in (0, 1)"),
    ("kl_weight balance_weight z_loss_weight rir_weight", lambda v, c: v >= 0, "a finite number >= 0"),
    ("kl_ramp_steps min_depth_warmup min_depth_release_steps", lambda v, c: v >= 0, "an integer >= 0"),
    ("random_length_fraction", lambda v, c: 0 <= v <= 1, "in [0, 1]"),
]


# forward's and generate's contract, run before a compiled graph rather than in it: reading the token ids is
# a host sync, and under torch.compile a graph break.
@torch.compiler.disable
def check_call(c: AlterNetConfig, tokens: torch.Tensor, targets: torch.Tensor | None = None, lengths=None,
               max_depth=None, halt_threshold=None, sample_halting=False, last_token_only=False) -> None:
    T, V = tokens.shape[-1] if tokens.dim() else 0, c.vocab_size
    refuse([
        ("tokens", tokens.dim() == 2 and tokens.dtype == torch.long and 1 <= T <= c.seq_len,
         f"a (B, T) long tensor, T in 1..seq_len={c.seq_len}, got {tuple(tokens.shape)} {tokens.dtype}"),
        ("tokens: token ids", ((tokens >= 0) & (tokens < V)).all(), f"in 0..{V - 1} (vocab_size={V})"),
        ("targets", targets is None or (targets.shape == tokens.shape and targets.dtype == torch.long
                                        and not last_token_only and ((targets >= -1) & (targets < V)).all()),
         f"None or a (B, T) long tensor of ids in 0..{V - 1} or -1 (ignore); None if last_token_only"),
        ("lengths", lengths is None or (lengths.dtype == torch.long and lengths.shape == tokens.shape[:1]
                                        and ((lengths >= 1) & (lengths <= T)).all()),
         f"a (B,) long tensor with values in 1..T={T}, or None"),
        ("max_depth", max_depth is None or (type(max_depth) is int and 1 <= max_depth <= MAX_ITERATIONS),
         f"None or an integer in 1..{MAX_ITERATIONS}, got {max_depth!r}"),
        ("halt_threshold", halt_threshold is None or (0 < halt_threshold <= 1 and not sample_halting),
         f"None or in (0, 1], None with sample_halting=True (they are alternatives), got {halt_threshold!r}"),
        ("halt_threshold", c.halting or (halt_threshold is None and not sample_halting),
         "None, as sample_halting False, with halting=False (fixed depth): cap with max_depth")])


def refuse(rules, shown: AlterNetConfig | None = None) -> None:
    """ValueError for the first broken (argument, value allowed?, what it allows); `shown`: the config."""
    for name, ok, allowed in rules:
        if not ok:
            value = "" if shown is None else f"{name}={getattr(shown, name)!r} is not allowed: "
            raise ValueError(f"{value}{name} must be {allowed}")


# --- the model -------------------------------------------------------------------


class AlterNet(nn.Module):
    """The looped expert bank. forward returns a dict; every call has halting_distribution (B, D'): p of
    Eq. 5 (a sequence halted early at h has lambda_h := 1, like a cap at h + 1); iterations (B,) long;
    aux_losses {balance, z[, kl, rir]}, weighted; router_logits (D', B, E); expert_indices (D', B, k)
    (-1 after halting); gates (D', B, k); halt_lambdas (B, D'): the heads' lambda_d before Eq. 5's masks
    (0 after halting); states (D'+1 of (B, T, H)) with return_states. Without targets the logits: logits
    (B, T, V) of the iteration each sequence stopped at ((B, 1, V) with last_token_only); step_logits
    (D', B, T, V), a halted row repeating its output. With targets the losses, no logits (D' x B x T x V
    floats): loss (Eq. 6), task_loss (L_PN, Eq. 7) and the per-iteration CE, iteration first:
    token_losses (D', B, T), 0 where ignored; step_ce (D', B), per sequence; step_losses (D',), token mean.
    D' = iterations run: the cap, or fewer once every sequence has halted (compiled: the cap)."""

    def __init__(self, config: AlterNetConfig) -> None:
        super().__init__()
        self.config = config
        H, E = config.dim, config.num_experts
        self.tok_emb = nn.Embedding(config.vocab_size, H)
        self.pos_emb = nn.Embedding(config.seq_len, H)
        encodings = 2 if config.budget_signal else 1  # e_t, e_{1-t}
        self.router = nn.Linear(H + encodings * config.depth_dim, E, bias=False)  # W_r: E x (H + 2m)
        self.experts = nn.ModuleList(Expert(config) for _ in range(E))
        self.halt_head = nn.Linear(H, 1) if config.halting and config.halt_head == "global" else None
        self.norm = nn.LayerNorm(H, eps=config.norm_eps)
        self.lm_head = nn.Linear(H, config.vocab_size, bias=False)
        if config.tie_embeddings:  # tied (our choice): the paper is silent; GPT-2's tying, V x H fewer
            self.lm_head.weight = self.tok_emb.weight
        for module in self.modules():  # N(0, 0.02) weights, zero biases
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for name, p in self.named_parameters():
            # std 0.02 / sqrt(2D) on the projections into the residual stream (our choice): the paper gives no
            # init; GPT-2's 0.02 / sqrt(2 layers), the D iterations as layers, as up to D updates are summed
            if name.endswith(("attn.proj.weight", "ffn.fc2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.max_depth))
            if name.endswith("halt_head.bias"):
                nn.init.constant_(p, config.halt_bias_init)  # sigmoid(-3) ~ 0.05: start by not halting
        # the schedules at the optimizer step of set_step(); without a trainer they are finished
        self.schedule_step = None
        self.curriculum_depth = 1  # minimum iterations in training (curriculum, paper §4)
        self.register_buffer("kl_scale", torch.ones(()), persistent=False)  # a_KL ramp; not in the state dict

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, max_depth: int | None = None,
                halt_threshold: float | None = None, lengths: torch.Tensor | None = None, *,
                sample_halting: bool = False, return_states: bool = False,
                last_token_only: bool = False) -> dict:
        """tokens: (B, T) long, right-padded when `lengths` (B,) is given -> the dict above. max_depth: this
        call's cap D' (default the trained D; more extrapolates). halt_threshold: stop a sequence once its
        cumulative halting probability reaches it; sample_halting: stop with probability lambda_d (the
        conditional, not p_d); neither stops before the curriculum's minimum depth. targets: (B, T) long,
        -1 = ignore (as are positions >= lengths): the outputs are the losses."""
        check_call(self.config, tokens, targets, lengths, max_depth, halt_threshold, sample_halting,
                   last_token_only)
        B, T = tokens.shape
        num_iterations = self.config.max_depth if max_depth is None else max_depth
        last = torch.full((B,), T - 1, device=tokens.device) if lengths is None else lengths - 1  # (B,)
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(T, device=tokens.device))  # (B, T, H), once
        first_halt = self.first_halt(num_iterations)
        if targets is not None and lengths is not None:  # the padding, positions >= lengths, is ignored (-1)
            targets = targets.masked_fill(torch.arange(T, device=tokens.device) >= lengths[:, None], -1)
        out = self.loop(x, last, targets, num_iterations, first_halt, (halt_threshold, sample_halting),
                        last_token_only)
        states = out.pop("states")
        return dict(out, states=states) if return_states else out

    # -- the loop (Eq. 1-4 per iteration), then p (Eq. 5) and the losses (Eq. 6-10) --

    def loop(self, x: torch.Tensor, last: torch.Tensor, targets: torch.Tensor | None, num_iterations: int,
             first_halt: int, rule: tuple, last_token_only: bool) -> dict:
        """Training (targets, no halting rule; also evaluation at a fixed depth) runs every iteration on the
        whole batch and scores each x_{d+1}. Otherwise after each iteration the rule (halt_threshold,
        sample_halting) decides who stops; a stopped sequence keeps its state and output and, eagerly, runs
        no more (the active set). Without targets the logits (at the last valid token with last_token_only:
        generate); with them the losses, each sequence scored where it stopped (evaluation's halted loss)."""
        everyone = targets is not None and rule == (None, False)  # training: no active set, no masks
        running = None if everyone else torch.ones(len(x), dtype=torch.bool, device=x.device)  # (B,) running
        log_unhalted = torch.zeros(len(x), device=x.device)  # log prod_{i<d} (1 - lambda_i): the threshold's
        states, routing, log_lambda, ran, outputs = [x], [], [], [], []
        for iteration in range(num_iterations):
            rows = None if everyone else active_rows(running)  # (n,) indices, or None: the whole batch
            if rows is not None and rows.numel() == 0:
                break
            x_next, step_routing, step_log_lambda = self.iterate(take(x, rows), take(last, rows), iteration)
            # iteration d scored on its output x_{d+1}, never the embedding x_0 (our choice)
            output = self.decode(x_next, take(last, rows) if last_token_only else None) if targets is None \
                else self.token_losses(x_next, take(targets, rows))
            if not everyone:
                unhalted = take(log_unhalted, rows)
                stop = halt_now(step_log_lambda, iteration, num_iterations, first_halt, unhalted, *rule)
                if iteration >= first_halt:  # before the minimum depth lambda := 0, so log(1 - lambda) = 0
                    unhalted = unhalted + step_log_lambda["continue"].detach()
                    log_unhalted = write_back(log_unhalted, unhalted, rows, running)
                ran.append(running)
            x = write_back(x, x_next, rows, running)  # halted sequences keep their state and output
            outputs.append(write_back(outputs[-1], output, rows, running) if outputs else output)
            states.append(x)
            routing.append(fill_back(step_routing, rows, running))
            log_lambda.append(fill_back(step_log_lambda, rows, running))
            if not everyone:
                running = running & ~write_back(torch.zeros_like(running), stop, rows, running)
        routing, log_lambda = stack_steps(routing, dim=0), stack_steps(log_lambda, dim=1)  # (D', B), (B, D')
        ran = None if everyone else torch.stack(ran, 1)  # (B, D'): the iterations each sequence ran
        iterations = torch.full_like(last, num_iterations) if everyone else ran.sum(1)  # (B,)
        # Eq. 5, two masks on the heads' lambda: := 0 before the minimum depth, 1 where each sequence stopped
        log_p = halting_log_distribution(log_lambda["halt"], log_lambda["continue"], first_halt,
                                         stop=iterations - 1)
        out = dict(halting_distribution=log_p.exp(), iterations=iterations, states=states,
                   halt_lambdas=log_lambda["halt"].exp(),
                   **{key: routing[key] for key in ("router_logits", "expert_indices", "gates")})
        if targets is not None:  # Eq. 6-10
            return dict(out, **training_losses(self.config, routing, log_lambda, log_p, torch.stack(outputs),
                                               targets, self.kl_scale, ran))
        aux = aux_losses(self.config, routing, log_p, self.kl_scale, ran)
        return dict(out, aux_losses=aux, logits=outputs[-1],
                    **({} if last_token_only else dict(step_logits=torch.stack(outputs))))

    def iterate(self, x: torch.Tensor, last: torch.Tensor, iteration: int) -> tuple[torch.Tensor, dict, dict]:
        """One iteration (Eq. 1-4) of the sequences x: (n, T, H), last: (n,) their last valid index.
        -> x_{d+1}, its routing record (each (n, ...)) and the heads' log lambda_d record (each (n,))."""
        h = at_last(x, last)  # (n, H): the last valid token's state
        # Eq. 1: the router reads h, e_t with t = d / (D - 1) on the trained D (D = 1: t = 0), and e_{1-t}
        max_depth, dim = self.config.max_depth, self.config.depth_dim
        t = iteration / (max_depth - 1) if max_depth > 1 else 0.0
        encodings = [depth_encoding(t, dim)]  # e_t
        if self.config.budget_signal:
            encodings.append(depth_encoding(1 - t, dim))  # e_{1-t}: remaining budget
        encodings = torch.cat(encodings).to(h.device).expand(len(h), -1)  # (n, m or 2m)
        with torch.autocast(h.device.type, enabled=False):  # router math in fp32 (Switch)
            raw_logits = F.linear(torch.cat([h.float(), encodings], dim=-1), self.router.weight.float())
        clamp = self.config.logit_clamp  # the router acts on the clamped logits: (n, E) fp32
        router_logits = raw_logits if clamp is None else raw_logits.clamp(-clamp, clamp)
        top_logits, expert_indices = router_logits.topk(self.config.top_k, dim=-1)  # (n, k)
        log_gates = top_logits.log_softmax(-1)  # Eq. 2: renormalised over the selected experts only
        gates = log_gates.exp()
        update, halt_logits = self.mix_experts(x, last, expert_indices, gates)
        x_next = x + update  # Eq. 3: gated residual step
        routing = dict(router_logits=router_logits, raw_router_logits=raw_logits,
                       expert_indices=expert_indices, gates=gates)
        return x_next, routing, self.log_lambda(x_next, last, log_gates, halt_logits)

    def mix_experts(self, x: torch.Tensor, last: torch.Tensor, expert_indices: torch.Tensor,
                    gates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. 3's sum_j g_j y_j: (n, T, H), and each selected expert's halt logit lhat_j: (live, for L_RIR),
        each (n, k). A loop over experts, never over sequences; active_rows picks each expert's rows."""
        n, k = expert_indices.shape
        update = torch.zeros_like(x)
        halt_logits = [x.new_zeros(n, k, dtype=torch.float32) for _ in range(2)]
        for e, expert in enumerate(self.experts):
            chosen = expert_indices == e  # (n, k): a sequence takes an expert in at most one slot
            rows = active_rows(chosen.any(-1), none_when_all=False)  # (n_e,), None when compiled
            if rows is not None and rows.numel() == 0:
                continue
            y = expert(take(x, rows))  # (n_e, T, H)
            weighted = (take((gates * chosen).sum(-1), rows)[:, None, None] * y).to(update.dtype)  # g_j y_j
            update = update + weighted if rows is None else update.index_add(0, rows, weighted)
            if expert.halt_head is not None:
                # the head reads the expert's update y_j at the last valid token (our choice): Eq. 4 writes
                # lhat_j = head_j(expert_j(x)), and our expert returns its update (Expert)
                lhat = halt_logit(expert.halt_head, at_last(y, take(last, rows)))  # (n_e,) each
                if rows is not None:  # back to all n rows
                    lhat = [new.new_zeros(n).index_copy(0, rows, new) for new in lhat]
                halt_logits = [torch.where(chosen, new[:, None], old) for new, old in zip(lhat, halt_logits)]
        return update, halt_logits

    def log_lambda(self, x_next: torch.Tensor, last: torch.Tensor, log_gates: torch.Tensor,
                    halt_logits: list[torch.Tensor]) -> dict:
        """log lambda_d and log(1 - lambda_d) of this iteration (Eq. 4), each (n,) fp32, and the L_RIR
        copies (gradient to the halt heads only). Model I (halting off): lambda = 0."""
        if self.halt_head is not None:  # the global head reads x_{d+1}'s last valid token (our choice)
            logits = halt_logit(self.halt_head, at_last(x_next, last))
            live, rir = ((F.logsigmoid(logit), F.logsigmoid(-logit)) for logit in logits)
        elif self.config.halting:
            live = halting_log_probabilities(log_gates, halt_logits[0])
            rir = halting_log_probabilities(log_gates.detach(), halt_logits[1])
        else:  # lambda = 0: log lambda = -inf, log(1 - lambda) = 0
            zeros = x_next.new_zeros(len(x_next), dtype=torch.float32)
            live, rir = (torch.full_like(zeros, -math.inf), zeros), (zeros, zeros)
        return {"halt": live[0], "continue": live[1], "rir_halt": rir[0], "rir_continue": rir[1]}

    def token_losses(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy of decode(x): x (n, T, H), targets (n, T) -> (n, T) fp32, 0 where -1. Never
        holds the (n, T, V) logits: chunks of LOSS_CHUNK_LOGITS // V tokens, each recomputed in backward
        (activation checkpointing), so the loss's extra memory is one chunk's logits whatever D and T are."""
        def decoded_cross_entropy(xs: torch.Tensor, ts: torch.Tensor) -> torch.Tensor:  # fp32, also autocast
            return F.cross_entropy(self.decode(xs).float(), ts, ignore_index=-1, reduction="none")

        chunk = loss_chunk_tokens(self.config.vocab_size)
        flat_x, flat_targets = rearrange(x, "n t h -> (n t) h"), targets.flatten()
        losses = [checkpoint(decoded_cross_entropy, xs, ts, use_reentrant=False, preserve_rng_state=False)
                  if torch.is_grad_enabled() else decoded_cross_entropy(xs, ts)
                  for xs, ts in zip(flat_x.split(chunk), flat_targets.split(chunk))]
        return torch.cat(losses).view(targets.shape)  # (n, T)

    # -- the training schedules (paper §4, Table 2): set by the trainer, read by forward --

    def set_step(self, step: int) -> None:
        """Called by the training loop before the forward of optimizer step `step`. Evaluated here, not in
        forward: forward reads a depth that changes at most D times and the a_KL scale as a 0-d tensor, so
        torch.compile has no per-step value to guard on (a step counter read in forward recompiles)."""
        cfg, self.schedule_step = self.config, int(step)
        since_release = self.schedule_step - cfg.min_depth_warmup
        # The curriculum's minimum depth in iterations, 1-based (§4): for the first min_depth_warmup steps the
        # model is "forced to stick to its maximum number of iterations" (lambda_d := 0 before D, so L_PN is
        # the CE at D; L_RIR still trains the halt heads); then 1 at once, or D -> 1 linearly over
        # min_depth_release_steps (our choice), off by default.
        self.curriculum_depth = cfg.max_depth if since_release < 0 else 1
        if 0 <= since_release < cfg.min_depth_release_steps:
            self.curriculum_depth = math.ceil(cfg.max_depth - (cfg.max_depth - 1) * since_release
                                              / cfg.min_depth_release_steps)
        # a_KL ramp (Table 2, "a_KL warmup steps"): 0 until the curriculum ends, then linear to 1 over
        # kl_ramp_steps. Its start (our choice): in the curriculum the KL has no gradient, so a ramp from
        # step 0 would jump to its full value at the release.
        ramp = cfg.kl_ramp_steps
        self.kl_scale.fill_(min(1.0, max(0.0, since_release / ramp)) if ramp else float(since_release >= 0))

    def first_halt(self, num_iterations: int) -> int:
        """The 0-based index of the first iteration that may halt: the one conversion from the curriculum's
        1-based minimum depth m (capped at num_iterations), m - 1; 0 at evaluation and inference."""
        return min(self.curriculum_depth, num_iterations) - 1 if self.training else 0

    def decode(self, x: torch.Tensor, last: torch.Tensor | None = None) -> torch.Tensor:
        """Shared final norm + LM head: (n, T, H) -> (n, T, V), or (n, 1, V) at `last` only."""
        return self.lm_head(self.norm(x if last is None else at_last(x, last)[:, None]))

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, max_new_tokens: int, halt_threshold: float | None = None,
                 max_depth: int | None = None, temperature: float = 1.0, top_k: int | None = None,
                 sample_halting: bool = False, return_iterations: bool = False) -> torch.Tensor | tuple:
        """Autoregressive sampling with forward's halting and cap (call .eval() first): tokens (B, T) long ->
        (B, T + max_new_tokens), the context cropped to seq_len; temperature 0 = greedy. return_iterations:
        also the iterations used per new token, (B, max_new_tokens)."""
        V = self.config.vocab_size
        check_call(self.config, tokens[..., -self.config.seq_len:], max_depth=max_depth,
                   halt_threshold=halt_threshold, sample_halting=sample_halting)
        refuse([("temperature", temperature >= 0, f">= 0 (0: greedy), got {temperature}"),
                ("top_k", top_k is None or 1 <= top_k <= V, f"None or in 1..vocab_size={V}, got {top_k}")])
        used = []
        for _ in range(max_new_tokens):
            out = self(tokens[:, -self.config.seq_len:], max_depth=max_depth, halt_threshold=halt_threshold,
                       sample_halting=sample_halting, last_token_only=True)
            next_token = sample_next_token(out["logits"][:, -1, :].float(), temperature, top_k)  # (B, 1)
            tokens = torch.cat([tokens, next_token], dim=1)
            used.append(out["iterations"])
        if return_iterations:
            return tokens, torch.stack(used, dim=1) if used else tokens.new_zeros(tokens.shape[0], 0)
        return tokens

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count (the tied LM head counted once); non_embedding drops the position table."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.pos_emb.weight.numel() if non_embedding else n


# --- the training loss (Eq. 4-10), in the order loop calls it, in log space ----------------
# A confident halt head saturates: lambda rounds to 1 or prod(1 - lambda) underflows, so some p_d are
# exactly 0. p log p then has a 0/0 gradient; log p computed from logsigmoid stays finite, and the KL
# treats p_d = 0 exactly (its term and gradient are 0). Axes: lambda and p are (B, D), a sequence per row
# as p is written; what the loop appends is iteration-major: the routing record (D, B, ...) and the
# per-iteration losses token_losses (D, B, T), step_ce (D, B) and step_losses (D,) (.T where they meet p).


def halting_log_probabilities(log_gates: torch.Tensor, halt_logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Eq. 4 in log space: lambda = sum_j g_j sigmoid(lhat_j) over the selected experts. log_gates,
    halt_logits: (..., k) -> (log lambda, log(1 - lambda)), each (...,); as the gates sum to 1,
    1 - lambda = sum_j g_j sigmoid(-lhat_j)."""
    log_halt = torch.logsumexp(log_gates + F.logsigmoid(halt_logits), dim=-1)
    log_continue = torch.logsumexp(log_gates + F.logsigmoid(-halt_logits), dim=-1)
    return log_halt, log_continue


def halting_log_distribution(log_halt: torch.Tensor, log_continue: torch.Tensor, first_halt: int = 0,
                             stop: torch.Tensor | None = None) -> torch.Tensor:
    """Eq. 5, PonderNet, in log space: log p_d = log lambda_d + sum_{i<d} log(1 - lambda_i). log_halt,
    log_continue: (B, D) -> log p (B, D), -inf where p_d = 0. Two masks on the heads' lambda, nothing else:
    lambda_d := 0 for d < first_halt (the curriculum, §4), and lambda := 1 at each sequence's last iteration
    stop (B,) (default D-1), so every row of p sums to 1 (halted early at h is as a cap at h + 1)."""
    d = torch.arange(log_halt.shape[1], device=log_halt.device)
    last = d == (log_halt.shape[1] - 1 if stop is None else stop[:, None])
    before = d < first_halt
    log_halt = log_halt.masked_fill(before, -math.inf).masked_fill(last, 0.0)
    log_continue = log_continue.masked_fill(before, 0.0).masked_fill(last, -math.inf)
    log_unhalted = torch.cat([torch.zeros_like(log_continue[:, :1]), log_continue[:, :-1]], dim=1).cumsum(1)
    return log_halt + log_unhalted  # log P_unhalted,d + log lambda_d


def training_losses(cfg: AlterNetConfig, routing: dict, log_lambda: dict, log_p: torch.Tensor,
                    token_losses: torch.Tensor, targets: torch.Tensor, kl_scale: torch.Tensor,
                    ran: torch.Tensor | None = None) -> dict:
    """Eq. 6, assembled here and only here: L = L_PN + a_KL KL + a_LB LB + a_z z + a_RIR L_RIR.
    token_losses: (D', B, T), the per-token CE of every iteration; log_lambda: the heads' (B, D') record;
    log_p: (B, D'); ran: (B, D'), the iterations each sequence ran (None = all). A sequence without a
    scored target counts in neither L_PN's nor L_RIR's 1/B (our choice) and trains no halt head."""
    scored = targets != -1  # (B, T)
    step_ce = token_losses.sum(-1) / scored.sum(1).clamp(min=1)  # (D', B): each sequence's mean CE
    has_target = scored.any(1, keepdim=True)  # (B, 1)
    p = log_p.exp()
    task_loss = (p * step_ce.T).sum() / has_target.sum().clamp(min=1)  # L_PN, Eq. 7
    aux = aux_losses(cfg, routing, log_p, kl_scale, ran)
    if cfg.halting:
        counted = has_target.expand_as(p) if ran is None else ran & has_target  # (B, D')
        aux["rir"] = cfg.rir_weight * relative_improvement_loss(
            log_lambda["rir_halt"], log_lambda["rir_continue"], step_ce.T, counted)
    step_losses = (token_losses.sum((1, 2)) / scored.sum().clamp(min=1)).detach()  # (D',) token mean
    return dict(loss=task_loss + sum(aux.values()), task_loss=task_loss, aux_losses=aux, step_ce=step_ce,
                step_losses=step_losses, token_losses=token_losses)


def aux_losses(cfg: AlterNetConfig, routing: dict, log_p: torch.Tensor, kl_scale: torch.Tensor,
               ran: torch.Tensor | None = None) -> dict:
    """Eq. 6's terms that read no targets, weighted: load balance and z-loss pooled over every (iteration,
    sequence) decision made (routing: (D', B, ...) records; ran: (B, D') bool, None = all), and the KL of
    Eq. 8 on log p (B, D') against the prior truncated to its D' iterations."""
    flat = {key: value.flatten(0, 1) for key, value in routing.items()}  # (D' B, ...): the decisions
    made = None if ran is None else ran.T.flatten()
    # Pooled over every (sequence, iteration) decision, so experts may specialise by depth (our choice).
    # z-loss (Zoph et al. 2022): the mean of logsumexp(l)^2. ST-MoE's order (our choice): on the logits
    # before the clamp (it keeps pulling a logit past +-c back), the gates and balance on the clamped ones
    z_loss = pooled_mean(torch.logsumexp(flat["raw_router_logits"], dim=-1).pow(2), made)
    aux = dict(balance=cfg.balance_weight * load_balance_loss(flat["router_logits"], flat["expert_indices"],
                                                              cfg.num_experts, made),
               z=cfg.z_loss_weight * z_loss)
    if cfg.halting:  # Model I: p is one-hot at D by construction, nothing to regularise
        log_prior = log_depth_prior(log_p.shape[1], cfg.max_depth, cfg.prior, cfg.geometric_p)
        aux["kl"] = cfg.kl_weight * kl_scale * kl_divergence(log_p, log_prior.to(log_p.device))
    return aux


def load_balance_loss(router_logits: torch.Tensor, expert_indices: torch.Tensor, num_experts: int,
                      ran: torch.Tensor | None = None) -> torch.Tensor:
    """Switch load balance E * sum_i f_i P_i (paper §3, Fedus et al. 2022) over N decisions: router_logits
    (N, E), expert_indices (N, k), ran (N,) bool: the decisions made (not a halted sequence's, indices -1).
    f_i = fraction of decisions routing to i; it sums to k (our choice), as in HF Mixtral, so the balanced
    minimum is k and a_LB acts as k x Switch's weight. P_i = mean softmax probability of i."""
    routed = F.one_hot(expert_indices.clamp(min=0), num_experts).sum(1).float()  # (N, E), 0/1 per expert
    fraction = pooled_mean(routed, ran)  # (E,)
    mean_probability = pooled_mean(router_logits.softmax(-1), ran)  # (E,)
    return num_experts * (fraction * mean_probability).sum()


def pooled_mean(values: torch.Tensor, ran: torch.Tensor | None) -> torch.Tensor:
    """Mean over the routing decisions (dim 0) that were made: ran (N,) bool, None = all of them."""
    if ran is None:
        return values.mean(0)
    weights = ran.to(values.dtype).view(-1, *[1] * (values.dim() - 1))
    return (values * weights).sum(0) / ran.sum()


def kl_divergence(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Eq. 8: KL(p || q) = mean_b sum_d p_d (log p_d - log q_d); log_p (B, D), log_q (D,). Exact at p_d = 0
    (log p_d = -inf): its term and gradient are 0, both branches of the `where` finite (no 0 * inf in
    backward). KL(p || prior), not the reverse that several PonderNet codes get from KLDivLoss."""
    reached = log_p > float("-inf")
    safe_log_p = torch.where(reached, log_p, torch.zeros_like(log_p))
    terms = torch.where(reached, safe_log_p.exp() * (safe_log_p - log_q), torch.zeros_like(log_p))
    return terms.sum(-1).mean()


def log_depth_prior(num_steps: int, max_depth: int, kind: str = "gaussian",
                    geometric_p: float = 0.12) -> torch.Tensor:
    """log q over iterations 1..num_steps, normalised in log space, every entry finite: (num_steps,).
    gaussian: q_n ∝ N(n; D/2, D/4), D = max_depth (§3; Table 2: mu = 6, sigma = 3 at D = 12); geometric:
    q_n ∝ p (1-p)^(n-1) (PonderNet). A cap num_steps < D truncates the same prior."""
    iterations = torch.arange(1, num_steps + 1, dtype=torch.float32)
    if kind == "gaussian":
        # Centred on D/2 *iterations*, not 0-based index D/2 (mean D/2 + 1) (our choice): the paper's
        # "converging to the prior saves ≈ 50% of iterations" (§4, Fig. 3) fits a mean of D/2.
        mean, std = max_depth / 2, max_depth / 4
        log_q = -0.5 * ((iterations - mean) / std) ** 2
    else:  # "geometric" (the config refuses any other)
        log_q = (iterations - 1) * math.log1p(-geometric_p)
    # log_softmax, never softmax(...).log(): far beyond D (a cap of 24 at D = 4, or past ~49 for the
    # 350M prior) q_n underflows to 0 in float32 and its log, the KL and the loss would be inf
    return log_q.log_softmax(0)


def relative_improvement_loss(log_halt: torch.Tensor, log_continue: torch.Tensor, ce: torch.Tensor,
                              ran: torch.Tensor | None = None) -> torch.Tensor:
    """Eq. 9: L_RIR = 1/B sum_b 1/(D-1) sum_{d>=1} BCE(lambda_d, 1 - w_d), BCE from log lambda. log_halt,
    log_continue: (B, D), the heads' raw lambda_d before Eq. 5's masks, also at d = D-1 where p forces 1
    (our choice); ce: (B, D) each sequence's CE (step_ce.T); ran: (B, D) bool, the iterations each sequence
    ran (all in training): a sequence averages over the iterations d >= 1 it ran."""
    if log_halt.shape[1] < 2:
        return log_halt.sum() * 0
    ce = ce.detach()  # a target; Eq. 10: w_d = sigmoid(50 (max(CE_{d-1} - CE_d, 0) - 0.005)), d = 1..D-1
    improvement = torch.sigmoid(50 * ((ce[:, :-1] - ce[:, 1:]).clamp(min=0) - 0.005))  # (B, D-1)
    target = 1 - improvement  # halt when iteration d did not help
    bce = -(target * log_halt[:, 1:] + (1 - target) * log_continue[:, 1:])  # (B, D-1)
    ran = torch.ones_like(bce, dtype=torch.bool) if ran is None else ran[:, 1:]
    per_sequence = (bce * ran).sum(1) / ran.sum(1).clamp(min=1)  # (B,)
    has_pairs = ran.any(1)
    return (per_sequence * has_pairs).sum() / has_pairs.sum().clamp(min=1)


# --- the model's helpers: the loss's chunks, the active rows, halting, sampling ---------------------

# The loss decodes this many logits at a time (our choice): 2^25, 128 MiB in fp32, ~670 tokens at
# GPT-2's V = 50,257, so its memory grows with neither the iterations D nor the tokens B x T.
LOSS_CHUNK_LOGITS = 2 ** 25


def loss_chunk_tokens(vocab_size: int) -> int:
    return max(1, LOSS_CHUNK_LOGITS // vocab_size)


def active_rows(mask: torch.Tensor, none_when_all: bool = True) -> torch.Tensor | None:
    """The one switch between the eager (sparse) and compiled (static-shape) paths: the indices of the True
    rows of mask (n,), an expert's sequences or the running ones, or None for every row. None under
    torch.compile (our choice): static shapes, no host sync, one graph; rows not chosen run with gate 0
    (adding 0 * y is exact), halted rows are masked by write_back. Eagerly None also when every row is True,
    unless none_when_all=False (an expert's rows, always indexed: one backward graph whatever the routing)."""
    if torch.compiler.is_compiling():
        return None
    rows = mask.nonzero().squeeze(1)
    return None if none_when_all and rows.numel() == mask.numel() else rows


def at_last(x: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Each sequence's state at its last valid token: x (n, T, H), last (n,) -> (n, H)."""
    return x[torch.arange(len(x), device=x.device), last]


def take(values: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return values if rows is None else values[rows]


def halt_logit(head: nn.Linear, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A halt head on h: (n, H) -> its logits (n,) fp32, live and on detached h: L_RIR trains only the halt
    heads (Eq. 9), so its copy reaches nothing before them."""
    return tuple(head(v).squeeze(-1).float() for v in (h, h.detach()))


def stack_steps(steps: list[dict], dim: int) -> dict:
    """Per-iteration records -> one dict of tensors, iterations along `dim`."""
    return {key: torch.stack([step[key] for step in steps], dim=dim) for key in steps[0]}


def write_back(full: torch.Tensor, part: torch.Tensor, rows: torch.Tensor | None,
               running: torch.Tensor | None) -> torch.Tensor:
    """full (B, ...) with the sequences that ran this iteration (running: (B,) bool) taking their new values:
    part holds those rows (indices `rows`), or, rows None, the whole batch. The others keep theirs. running
    None: every sequence runs (training), part is the whole batch."""
    if running is None:
        return part
    if rows is not None:
        part = full.index_copy(0, rows, part)
    return torch.where(running.view(-1, *[1] * (full.dim() - 1)), part, full)


# After a sequence halts its record reads: no expert (-1); lambda 0 (log -inf), as it does not run; the
# other log entries 0, harmless after Eq. 5's lambda := 1 and finite in L_RIR's masked sum.
FILLS = {"expert_indices": -1, "halt": -math.inf}


def fill_back(step: dict, rows: torch.Tensor | None, running: torch.Tensor | None) -> dict:
    """A step's record of the running sequences -> the whole batch's, FILLS (else 0) for halted ones."""
    if running is None:
        return step
    return {key: write_back(value.new_full((len(running), *value.shape[1:]), FILLS.get(key, 0)), value, rows,
                            running) for key, value in step.items()}


def halt_now(log_lambda: dict, iteration: int, num_iterations: int, first_halt: int,
             log_unhalted: torch.Tensor, halt_threshold: float | None, sample_halting: bool) -> torch.Tensor:
    """Which of the running sequences stop after this iteration: (n,) bool. All of them at the cap; none
    before first_halt or without a rule; with probability lambda_d (sampled); or once the cumulative halted
    mass sum_{i<=d} p_i = 1 - prod_{i<=d} (1 - lambda_i) reaches the threshold."""
    log_halt, log_continue = log_lambda["halt"].detach(), log_lambda["continue"].detach()
    if iteration == num_iterations - 1:
        return torch.ones_like(log_halt, dtype=torch.bool)
    if iteration < first_halt or (halt_threshold is None and not sample_halting):
        return torch.zeros_like(log_halt, dtype=torch.bool)
    if sample_halting:
        return torch.bernoulli(log_halt.exp()).bool()
    return 1 - (log_unhalted + log_continue).exp() >= halt_threshold


def sample_next_token(logits: torch.Tensor, temperature: float, top_k: int | None) -> torch.Tensor:
    """(B, V) logits -> (B, 1) ids: greedy at temperature 0, else sampled from softmax(logits / temperature),
    among the top_k most likely if set. Non-finite logits (diverged weights) have no answer: ValueError."""
    if not torch.isfinite(logits).all():
        raise ValueError("the model's next-token logits are not finite (NaN or inf): diverged weights")
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, top_k).values[:, [-1]]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(-1), num_samples=1)


# --- causal evaluation: every position routed and halted on its own prefix ------------


def training_lengths(batch_size: int, seq_len: int, fraction: float,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """Valid lengths (batch_size,): a random `fraction` of the rows cut to a uniform length in 1..seq_len."""
    cut = torch.rand(batch_size, generator=generator) < fraction
    random_lengths = torch.randint(1, seq_len + 1, (batch_size,), generator=generator)
    return torch.where(cut, random_lengths, torch.full_like(random_lengths, seq_len))


@torch.no_grad()
def causal_loss(model: AlterNet, tokens: torch.Tensor, targets: torch.Tensor, max_depth: int | None = None,
                halt_threshold: float | None = None, rows_per_call: int = 512) -> dict:
    """Score each position as generation sees it (call model.eval() first): position i by the model run on
    tokens[:, :i+1] alone, routing and halting on token i (§3's "last valid token"), where the full-window
    forward routes every position on the window's last token. Exact and batched: position i is a row
    tokens[b, :end] with lengths = i + 1, only i decoded; rows_per_call bounds memory. targets -1 = ignore
    -> dict(ce (B, T) fp32, 0 where ignored; iterations (B, T); loss: mean CE)."""
    B, T = tokens.shape
    ce = torch.zeros(B, T, device=tokens.device)
    iterations = torch.zeros(B, T, dtype=torch.long, device=tokens.device)
    per_call = max(1, rows_per_call // B)  # positions per forward
    for first in range(0, T, per_call):
        end = min(T, first + per_call)
        positions = torch.arange(first, end, device=tokens.device)  # (P,)
        rows = tokens[:, :end].repeat(len(positions), 1)  # (P * B, end): row p * B + b
        out = model(rows, max_depth=max_depth, halt_threshold=halt_threshold,
                    lengths=(positions + 1).repeat_interleave(B), last_token_only=True)
        logits = rearrange(out["logits"][:, 0].float(), "(p b) v -> b p v", b=B)  # (B, P, V)
        ce[:, first:end] = F.cross_entropy(logits.transpose(1, 2), targets[:, first:end],
                                           ignore_index=-1, reduction="none")
        iterations[:, first:end] = rearrange(out["iterations"], "(p b) -> b p", b=B)
    scored = targets != -1
    return dict(ce=ce, iterations=iterations, loss=ce.sum() / scored.sum().clamp(min=1))


# --- presets (paper Appendix A, Tables 1-2) ------------------------------------------

PRESETS = {
    # Byte-level CPU model, AlterNetConfig's defaults: Run II recipe (Gaussian prior, curriculum, a_RIR 0.2)
    # with schedules shortened to a few-thousand-step run and a_KL 0.1 (group D).
    "alternet-tiny": {},
    # 50M ablation model, as in Table 2: geometric prior p=0.12, no curriculum, a_RIR 0; a_KL 0.1, Table 2's
    # (our choice): Table 6's ablation default is 0.01.
    "alternet-50m": dict(vocab_size=50257, seq_len=512, dim=512, heads=8, ffn_dim=2048, num_experts=8,
                         top_k=2, max_depth=8, depth_dim=32, prior="geometric", geometric_p=0.12,
                         kl_weight=0.1, kl_ramp_steps=1000, min_depth_warmup=0, rir_weight=0.0),
    # 350M Run II: Gaussian prior (mu=6, sigma=3 = D/2, D/4), a_KL 1.0 ramped, 1000-step curriculum, a_RIR 0.2
    "alternet-350m": dict(vocab_size=50257, seq_len=512, dim=2048, heads=16, ffn_dim=2048, num_experts=10,
                          top_k=2, max_depth=12, depth_dim=64, prior="gaussian", kl_weight=1.0,
                          kl_ramp_steps=1000, min_depth_warmup=1000, rir_weight=0.2),
}
# Fixed-depth twins: the paper's "Model I" (halting off, always D iterations).
PRESETS.update({f"{name}-fixed": dict(overrides, halting=False) for name, overrides in list(PRESETS.items())})

# Training recipes of Table 2, as train.py TrainConfig fields (global batch x context = tokens per
# step: 64 x 512 = 32,768 and 256 x 512 = 131,072; GPT-2 BPE through tiktoken). Table 2 gives one
# lr for the 50M ablations and Run I and "3 -> 1 x 10^-4" for Run II; a single value reads as constant
# after warm-up (our choice), min_lr = lr, and Run II's as a cosine decay to 1e-4. C4 (en): pass --data.
_RECIPE_50M = dict(batch_size=64, block_size=512, warmup_steps=1000, max_steps=5000, lr=3e-4, min_lr=3e-4,
                   lr_batch=0, tokenizer="gpt2")
_RUN_II = dict(_RECIPE_50M, batch_size=256, warmup_steps=2000, max_steps=30000, min_lr=1e-4)
RECIPES = {"alternet-50m": _RECIPE_50M, "alternet-50m-fixed": _RECIPE_50M, "alternet-350m": _RUN_II,
           "alternet-350m-fixed": dict(_RUN_II, max_steps=10000, min_lr=3e-4)}  # Run I


def create_model(name: str, **overrides) -> AlterNet:
    """Build a preset, e.g. create_model("alternet-tiny", max_depth=8). Unknown names -> ValueError."""
    fields = [f.name for f in dataclasses.fields(AlterNetConfig)]
    unknown = sorted(set(overrides) - set(fields))
    refuse([("name", name in PRESETS, f"one of {sorted(PRESETS)}, got {name!r}"),
            ("overrides", not unknown, f"AlterNetConfig fields {fields}; unknown config field(s) {unknown}")])
    return AlterNet(AlterNetConfig(**{**PRESETS[name], **overrides}))
