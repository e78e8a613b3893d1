"""reViT: one recurrent ViT block whose FFN is a depth-programmed merge of an expert bank.

Paper: "One Block, Multiple Depths: Recurrent Vision Transformers with Depth-Programmed Experts"
(reViT, arXiv 2610.12448): §3.1 (router and merge, Eqs. 1-3), §3.2 (elastic depth), App. A.1-A.2
(initialisation, auxiliary losses Eqs. 6, 8, 9), Table 1 (sizes and baselines).

How reViT differs from a standard pre-norm ViT (DeiT III):
- one block (attention + both LayerNorms) is applied L times; there are no per-layer weights;
- the FFN of step t is a weight-space merge of E expert FFNs, with gates from a tiny router ψ that
  sees only the normalised depth s_t = t / (L - 1) (Eqs. 1-2): the same for every image and token,
  and only one dense FFN runs per step whatever E is;
- the depth L is chosen per call: the router is evaluated on a new grid (§3.2);
- training can drop whole steps per image and renumber the rest (elastic depth, §3.2);
- for a fixed L the L merged FFNs can be cached, or folded into a plain ViT (`fold`);
- three auxiliary losses keep the gates balanced and the experts distinct (Eqs. 6, 8, 9);
- no LayerScale in the recurrent block (Eq. 3); the DeiT III and Raptor baselines keep it.

Reading order, to `fold`: `Attention`, `Mlp` -> `Block` (Eq. 3; the FFN interface) -> `ViTBase` ->
`MergedExpertFFN` (`ffn_at`: Eqs. 1-2 in one look; App. A.2's losses) -> `ReViT` (`forward`: Eq. 3 with
FFN_t; `elastic_steps`, §3.2) -> `fold`. Then the merge cache, fp32 regions, Table 1's baselines, the config.
"""

from __future__ import annotations

import difflib
import math
import sys
from contextlib import nullcontext
from dataclasses import dataclass, fields, replace
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

# --- building blocks (DeiT III numerics: LayerNorm eps 1e-6, qkv bias, trunc-normal 0.02: `init_linear`) ---

class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """(B, T, 3d) fused q, k, v -> (B, T, d) attention output before the projection."""
        q, k, v = rearrange(qkv, "b t (three h c) -> three b h t c", three=3, h=self.heads)
        x = F.scaled_dot_product_attention(q, k, v)  # (B, h, T, c), flash/efficient kernels where available
        return rearrange(x, "b h t c -> b t (h c)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.attend(self.qkv(x)))

class Mlp(nn.Module):
    """The dense FFN of a ViT block, fc2(GELU(fc1(u))); reViT's with E = 1 (ALBERT-style), at every step."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(u)))

    def ffn_at(self, s: torch.Tensor) -> Mlp:  # the same FFN at every coordinate
        return self
    per_image_ffn = ffn_at

    def aux_losses(self, depth: int) -> dict:
        return {}

    def dense_states(self, depth: int, gates: torch.Tensor | None = None) -> list[dict]:
        return [self.state_dict()] * depth  # the weights of each step (fold): its own at every step

class Block(nn.Module):
    """Pre-norm transformer block (Eq. 3), optional LayerScale (DeiT III, the baselines), per-sample drop-path
    on both branches. forward(x, ffn): tokens (b, T, d) -> tokens through `ffn`, default `mlp` (timm's names:
    mlp.fc1.weight). The FFN interface of reViT's block (MergedExpertFFN; E = 1: Mlp): ffn_at(s), FFN_t at a
    coordinate s (1,) (Eqs. 1-2); per_image_ffn(coords), for images at coordinates (b,) (§3.2);
    aux_losses(depth), a dict (App. A.2); dense_states(depth, gates), each step's Mlp weights (fold)."""

    def __init__(self, dim: int, heads: int, mlp: nn.Module, layer_scale_init: float | None = None,
                 drop_path: float = 0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.ls1 = LayerScale(dim, layer_scale_init) if layer_scale_init is not None else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = mlp
        self.ls2 = LayerScale(dim, layer_scale_init) if layer_scale_init is not None else nn.Identity()
        self.drop_prob = drop_path

    def forward(self, x: torch.Tensor, ffn: Callable | None = None) -> torch.Tensor:
        ffn = self.mlp if ffn is None else ffn
        x = x + self.drop_path(self.ls1(self.attn(self.norm1(x))))  # H = X + MHSA(LN(X))
        return x + self.drop_path(self.ls2(ffn(self.norm2(x))))     # X' = H + FFN(LN(H))

    def drop_path(self, x: torch.Tensor) -> torch.Tensor:
        """DeiT III's stochastic depth, per sample; not elastic depth (depth_drop: whole steps, §3.2)."""
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = x.new_empty(x.shape[0], *([1] * (x.ndim - 1))).bernoulli_(1.0 - self.drop_prob)
        return x * keep / (1.0 - self.drop_prob)

    def unrolled_states(self, depth: int, gates: torch.Tensor | None = None) -> list[dict]:
        """State dicts of `depth` plain Blocks, block t computing this block's step t (fold); gates [L, E]."""
        shared = {k: v for k, v in self.state_dict().items() if not k.startswith("mlp.")}
        return [{**shared, **{f"mlp.{k}": v for k, v in ffn.items()}}
                for ffn in self.mlp.dense_states(depth, gates)]

class ViTBase(nn.Module):
    """Patch embedding, class token, positions, final norm and head: common to every model here."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        c = self.config = config
        if self.arch != c.arch or not isinstance(self, c.model_class):  # no Raptor config as a 12-block ViT
            raise ValueError(f"arch={c.arch!r} builds {c.model_class.__module__}.{c.model_class.__name__}, "
                             f"not {type(self).__name__}; build models with revit.build_model(config)")
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(c.in_channels, c.dim, c.patch_size, stride=c.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, c.num_patches, c.dim))  # patch tokens only
        self.norm = nn.LayerNorm(c.dim, eps=1e-6)
        self.head = nn.Linear(c.dim, c.num_classes) if c.num_classes else nn.Identity()

    def init_weights(self) -> None:
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        self.apply(init_linear)

    def no_weight_decay(self) -> set:
        """Names excluded from weight decay beyond biases and 1-D parameters (norms, gammas). reViT's psi
        output layer starts at zero and sets the depth program: decay would pull the gates to uniform."""
        return {"pos_embed", "cls_token", "block.mlp.router.2.weight"}

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) floating images (cast to the model's dtype) -> (B, 1+N, d) tokens. Integer pixels are
        refused, not guessed (uint8 images need .float() / 255 and the normalisation)."""
        c = self.config
        if images.shape[1:] != (c.in_channels, c.image_size, c.image_size) or not images.is_floating_point():
            raise ValueError(f"images must be a floating-point tensor normalised as in training, of shape "
                             f"(B, in_channels={c.in_channels}, image_size={c.image_size}, {c.image_size}); "
                             f"got {images.dtype} {tuple(images.shape)}")
        images = images.to(self.patch_embed.proj.weight.dtype)
        x = rearrange(self.patch_embed.proj(images), "b d gh gw -> b (gh gw) d")  # (B, N, d)
        x = x + self.pos_embed  # DeiT III's layout: no position on the class token (our choice)
        return torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)  # (B, 1+N, d)

    def check_depth(self, depth: int | None) -> int:  # the depth to run: the trained one by default
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 2):
            raise ValueError(f"depth must be an integer >= 2; got {depth!r}")
        return self.config.depth if depth is None else depth

    def finish(self, x, states, aux, return_states, extra=None):
        """The head on x (B, 1+N, d): logits (B, classes), or with return_states logits, pre_logits (B, d),
        tokens (after the final norm), states (the L + 1 residual states), aux_losses and `extra` (gates)."""
        tokens = self.norm(x)
        logits = self.head(tokens[:, 0])
        if not return_states:
            return logits
        return {"logits": logits, "pre_logits": tokens[:, 0], "tokens": tokens, "states": states,
                "aux_losses": aux, **(extra or {})}

# --- the depth router ψ and the weight-space merge (§3.1, Eqs. 1-2); aux losses (App. A.2) ---

def depth_grid(depth: int, device=None) -> torch.Tensor:
    """Eq. 1: s_t = t / (L - 1), t = 0..L-1. Same formula as the renumbered elastic coordinates."""
    return torch.arange(depth, device=device, dtype=torch.float32) / (depth - 1)

class ExpertBank(nn.Module):
    """E expert FFNs stored as stacked tensors, theta_e = (W1_e, b1_e, W2_e, b2_e) (§3.1), each initialised
    like a ViT FFN (App. A.1). Names of the per-expert biases end in "bias": never weight-decayed."""

    def __init__(self, dim: int, hidden: int, num_experts: int):
        super().__init__()
        self.num_experts, self.dim, self.hidden = num_experts, dim, hidden
        self.fc1_weight = nn.Parameter(torch.empty(num_experts, hidden, dim))  # (E, d_ff, d)
        self.fc1_bias = nn.Parameter(torch.zeros(num_experts, hidden))        # (E, d_ff)
        self.fc2_weight = nn.Parameter(torch.empty(num_experts, dim, hidden))  # (E, d, d_ff)
        self.fc2_bias = nn.Parameter(torch.zeros(num_experts, dim))           # (E, d)
        nn.init.trunc_normal_(self.fc1_weight, std=0.02)
        nn.init.trunc_normal_(self.fc2_weight, std=0.02)

    def bank(self) -> tuple:
        return self.fc1_weight, self.fc1_bias, self.fc2_weight, self.fc2_bias

    def merge(self, gates: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple:
        """Eq. 2 for n gate vectors (n, E) -> four stacks (n, ...) in `dtype` (fp32 by default whatever the
        bank's dtype or autocast; callers cast at use: MergedFFN)."""
        with full_precision(gates.device):
            return tuple((gates.to(dtype) @ p.to(dtype).flatten(1)).unflatten(1, p.shape[1:])  # (n, ...)
                         for p in self.bank())

    def diversity(self) -> torch.Tensor:
        """Eq. 9: mean over pairs e < e' of cos^2(vec(theta_e), vec(theta_e')). Pair-mean is our default."""
        theta = F.normalize(torch.cat([p.flatten(1) for p in self.bank()], dim=1).float(), dim=1)  # (E, P)
        cos = theta @ theta.T
        i, j = torch.triu_indices(self.num_experts, self.num_experts, offset=1, device=cos.device)
        return cos[i, j].pow(2).mean()

def gate_penalties(z: torch.Tensor, temperature: float) -> tuple:
    """Per row of z (n, E): 1 - H(g)/log E with g = softmax(z / tau) (Eq. 6), and logsumexp(z)^2 (Eq. 8)."""
    z = z.float()
    g = torch.softmax(z / temperature, dim=-1)
    entropy = -(g * torch.log(g.clamp_min(1e-12))).sum(-1)
    return 1.0 - entropy / math.log(z.shape[-1]), torch.logsumexp(z, dim=-1).pow(2)

class DepthRouter(nn.Sequential):
    """psi of Eq. 1, (n, 1) coordinates -> (n, E) logits in fp32 whatever the autocast or dtype (App. A.5)."""

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        first, last = self[0], self[2]
        with full_precision(s.device):
            hidden = F.silu(F.linear(s.float(), first.weight.float(), first.bias.float()))  # (n, 16)
            return F.linear(hidden, last.weight.float(), last.bias.float())

class MergedFFN(NamedTuple):
    """FFN_t of Eq. 2: W2 GELU(W1 u + b1) + b2 with merged fp32 weights (d_ff, d), (d_ff,), (d, d_ff), (d,),
    cast to the tokens' dtype at use."""
    fc1_weight: torch.Tensor
    fc1_bias: torch.Tensor
    fc2_weight: torch.Tensor
    fc2_bias: torch.Tensor

    def __call__(self, u: torch.Tensor) -> torch.Tensor:
        w1, b1, w2, b2 = (w.to(u.dtype) for w in self)
        return F.linear(F.gelu(F.linear(u, w1, b1)), w2, b2)

class MergedExpertFFN(ExpertBank):
    """reViT's FFN (§3.1): E expert FFNs merged in weight space by a depth router (`ffn_at`).
    Eq. 1: z_t = psi(s_t), g_t = softmax(z_t / tau), psi = Linear(1,16) -> SiLU -> Linear(16,E).
    Eq. 2: W1_t = sum_e g_te W1_e (same for b1, W2, b2); FFN_t(u) = W2_t GELU(W1_t u + b1_t) + b2_t."""

    def __init__(self, c: ViTConfig):
        super().__init__(c.dim, c.expert_ffn_dim, c.num_experts)
        self.temperature, self.router_prior = c.router_temperature, c.router_prior
        self.lambda_bal, self.lambda_z = c.balance_weight, c.z_loss_weight  # Eqs. 6, 8 (App. A.2, Table 6)
        self.lambda_div = c.diversity_weight                                 # Eq. 9
        self.router = DepthRouter(nn.Linear(1, c.router_hidden), nn.SiLU(),  # psi (Eq. 1): router.0, router.2
                                  nn.Linear(c.router_hidden, c.num_experts))

    def reset_router(self) -> None:
        """App. A.1: the output layer starts at zero, all experts equal. The hidden layer (the paper leaves
        it open): the model-wide trunc-normal(0.02), zero bias; psi starts near-linear in s (our choice)."""
        self.router.apply(init_linear)
        nn.init.zeros_(self.router[2].weight)
        nn.init.zeros_(self.router[2].bias)

    def gate_logits(self, coords: torch.Tensor) -> torch.Tensor:
        """(n,) coordinates -> (n, E) fp32 logits z = psi(s), plus our optional `depth_prior` (below)."""
        s = coords.float().unsqueeze(-1)                                          # (n, 1)
        z = self.router(s)                                                        # (n, E)
        return z + depth_prior(s, self.num_experts, self.router_prior) if self.router_prior else z

    def gates(self, coords: torch.Tensor) -> torch.Tensor:
        """Eq. 1: (n,) coordinates -> (n, E) gates g = softmax(z / tau), in fp32."""
        return torch.softmax(self.gate_logits(coords) / self.temperature, dim=-1)

    def ffn_at(self, s: torch.Tensor) -> MergedFFN:
        """FFN_t at a coordinate s (1,), one alive at a time. Gates in fp32 under any autocast; the sum in the
        bank's dtype (a bf16 bank: one bf16 matmul accumulating in fp32, never copied to fp32: our choice)."""
        z = self.gate_logits(s)                                                   # (1, E) z = psi(s)
        g = torch.softmax(z / self.temperature, dim=-1)                           # (1, E) Eq. 1
        merged = self.merge(g, self.fc1_weight.dtype)                             # (1, ...) Eq. 2
        # squeeze, not [0]: its backward is a view, where indexing's would copy each weight's gradient
        return MergedFFN(*(w.squeeze(0) for w in merged))

    def per_image_ffn(self, coords: torch.Tensor) -> Callable:
        """The FFN of a step whose images sit at coordinates coords (b,) (elastic depth): one merged FFN
        per distinct coordinate, never one weight copy per image."""
        values, group = torch.unique(coords, return_inverse=True)
        if len(values) == 1:
            return self.ffn_at(values)
        merged = self.merge(self.gates(values), self.fc1_weight.dtype)  # (groups, ...)

        def grouped_ffn(u: torch.Tensor) -> torch.Tensor:  # image i runs FFN group[i]: one call per group
            order = torch.argsort(group)
            chunks = u[order].split(torch.bincount(group, minlength=len(values)).tolist())
            y = torch.cat([MergedFFN(*(w[i] for w in merged))(chunk) for i, chunk in enumerate(chunks)])
            return y[torch.argsort(order)]  # back to the batch order
        return grouped_ffn

    def aux_losses(self, depth: int) -> dict:
        """App. A.2 on the gates of the depth's grid: Eqs. 6 and 8 are means over the L steps."""
        z = self.gate_logits(depth_grid(depth, self.fc1_weight.device))  # (L, E)
        balance, z_loss = gate_penalties(z, self.temperature)           # (L,) each
        return {"balance": self.lambda_bal * balance.sum() / depth,     # Eq. 6
                "z_loss": self.lambda_z * z_loss.sum() / depth,         # Eq. 8
                "diversity": self.lambda_div * self.diversity()}        # Eq. 9

    def dense_states(self, depth: int, gates: torch.Tensor | None = None) -> list[dict]:
        """The Mlp weights of each of `depth` steps, from the router's gates or the given [L, E] (fold)."""
        device = self.fc1_weight.device
        gates = self.gates(depth_grid(depth, device)) if gates is None else gates.to(device)  # (L, E)
        names = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
        return [dict(zip(names, (w[0] for w in self.merge(g.unsqueeze(0))))) for g in gates]

# --- reViT: one shared block, depth-programmed merged FFN, elastic depth (§3) ---

def elastic_plan(keep: torch.Tensor) -> torch.Tensor:
    """(B, L) bool mask of retained steps -> (B, L) coordinates (§3.2): image b's n_b retained steps are
    renumbered k = 0..n_b-1 and sit at k / (n_b - 1); n_b = 1 gets s = 0 (our choice). Dropped: unused."""
    rank = keep.long().cumsum(1) - 1                        # (B, L) index among retained steps
    retained = keep.sum(1, keepdim=True)                    # (B, 1) n_b
    return rank.clamp_min(0).float() / (retained - 1).clamp_min(1).float()

class ReViT(ViTBase):
    """One shared block applied L times (§3.1), at any depth L >= 2, elastic in training (§3.2)."""
    arch = "revit"

    def __init__(self, config: ViTConfig):
        super().__init__(config)
        self.block = self.build_block(config)
        self.init_weights()
        if isinstance(self.block.mlp, MergedExpertFFN):
            self.block.mlp.reset_router()
        self.merged_ffns = None  # the merge cache: (key, the L merged FFNs of one depth); see `merge_cache`

    def build_block(self, c: ViTConfig) -> Block:
        """The shared block: Eq. 3 with reViT's merged expert FFN (E = 1: one dense Mlp, the tied block)."""
        ffn = Mlp(c.dim, c.expert_ffn_dim) if c.num_experts == 1 else MergedExpertFFN(c)
        return Block(c.dim, c.heads, ffn, c.layer_scale_init, c.drop_path)

    def forward(self, images: torch.Tensor, depth: int | None = None, return_states: bool = False,
                keep: torch.Tensor | None = None):
        """images (B, C, H, W) -> logits (B, classes), or named outputs with return_states. depth: L steps
        (default: the trained one). keep: (B, L) bool, the steps each image runs (elastic depth, §3.2)."""
        depth = self.check_depth(depth)
        # The merge cache (after fold), looked up before any tensor work: a compiled forward stays one graph.
        inference = self.config.merge_cache and not self.training and not torch.is_grad_enabled()
        cached = merge_cache(self, depth) if inference else None
        x = self.embed(images)                                                  # (B, 1+N, d)
        keep = self.elastic_mask(keep, x.shape[0], depth, x.device)
        if keep is None:  # every image runs every step, at the grid coordinates s_t (Eq. 1)
            grid, states = depth_grid(depth, x.device), [x]
            for t in range(depth):  # Eq. 3 with FFN_t: merged at s_t (Eqs. 1-2), one alive at a time
                x = self.block(x, cached[t] if cached else self.block.mlp.ffn_at(grid[t:t + 1]))
                states.append(x)
        else:
            states = self.elastic_steps(x, keep)
        # Aux losses only where someone reads them: Eq. 9 alone touches the whole bank (E * P). Under
        # elastic depth they stay on the fixed grid s_t: they regularise the router (our choice).
        aux = self.block.mlp.aux_losses(depth) if return_states or self.training else {}
        extra = {"gates": self.gate_matrix(depth)} if return_states else None
        return self.finish(states[-1], states, aux, return_states, extra)

    # Eager in a compiled model (the stem, head and losses compile): each step picks its rows and coordinate
    # groups from data (a GPU syncs with the host per step); fixed shapes would change the merges' sum order.
    @torch.compiler.disable
    def elastic_steps(self, x: torch.Tensor, keep: torch.Tensor) -> list:
        """Elastic depth (§3.2): image b runs only its retained steps, at renumbered coordinates."""
        coords = elastic_plan(keep)                                             # (B, L)
        states = [x]
        for t in range(keep.shape[1]):
            # the images that run step t; a dropped step is the identity, and the kept steps are not
            # rescaled by 1/(1-p) as drop-path's are (our choice)
            rows = keep[:, t].nonzero().squeeze(1)
            if len(rows) == x.shape[0]:
                x = self.block(x, self.elastic_ffn(t, coords[:, t], rows))
            elif len(rows):  # (an image whose mask keeps no step is never run: the head reads LN(embedding))
                x = x.index_copy(0, rows, self.block(x[rows], self.elastic_ffn(t, coords[rows, t], rows)))
            states.append(x)
        return states

    def elastic_ffn(self, t: int, coords: torch.Tensor, rows: torch.Tensor) -> Callable:
        return self.block.mlp.per_image_ffn(coords)  # step t's FFN for the images `rows` at coords (b,)

    def elastic_mask(self, keep, batch: int, depth: int, device) -> torch.Tensor | None:
        """The (B, L) retained-step mask (drawn in training if depth_drop > 0), or None: every step runs."""
        if keep is None and self.training and self.config.depth_drop > 0:
            keep = torch.rand(batch, depth, device=device) >= self.config.depth_drop
        if keep is not None and keep.shape != (batch, depth):
            raise ValueError(f"keep must have shape (batch, depth) {(batch, depth)}; got {tuple(keep.shape)}")
        return None if keep is None or bool(keep.all()) else keep

    def gate_matrix(self, depth: int | None = None) -> torch.Tensor:
        """G [L, E]: the fp32 gates of every step at depth L (rows sum to 1). E = 1 gives ones."""
        depth = self.check_depth(depth)
        if not isinstance(self.block.mlp, MergedExpertFFN):
            return torch.ones(depth, 1)
        return self.block.mlp.gates(depth_grid(depth, self.cls_token.device))

    def train(self, mode: bool = True):
        self.merged_ffns = None  # a mode switch drops the merge cache: where hand-written weight edits end
        return super().train(mode)

# --- fold: a fixed depth becomes a plain ViT (§3.1: "inserted into a conventional fixed-depth graph") ---

@torch.no_grad()
def fold(model: nn.Module, depth: int | None = None, gates: torch.Tensor | None = None) -> VisionTransformer:
    """A plain untied ViT (VisionTransformer, below) of `depth` blocks with `model`'s outputs at that depth,
    on its device and in its dtype: block t is what the source computes at step t. gates: an [L, E] matrix
    in place of the router's (reViT, E >= 2), for the analysis tools' expert ablation and permutation (§5)."""
    c = model.config
    if gates is not None and not (isinstance(model, ReViT) and c.num_experts >= 2 and gates.ndim == 2
                                  and gates.shape[1] == c.num_experts and depth in (None, gates.shape[0])):
        raise ValueError(f"fold: gates must have shape [depth, num_experts] of a reViT with num_experts >= 2;"
                         f" got {list(gates.shape)}, depth={depth!r}, arch={c.arch!r}, E={c.num_experts}")
    depth = model.check_depth(gates.shape[0] if gates is not None else depth)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith(("block.", "blocks."))}
    # reViT unrolls its shared block; Raptor (or a plain ViT) lists the block that serves each step
    steps = (model.block.unrolled_states(depth, gates) if isinstance(model, ReViT)
             else [model.blocks[j].state_dict() for j in model.schedule(depth)])
    state.update({f"blocks.{t}.{k}": v for t, step in enumerate(steps) for k, v in step.items()})
    hidden = state["blocks.0.mlp.fc1.weight"].shape[0]  # the width of the FFN that actually runs
    plain = {f.name: getattr(c, f.name) for f in fields(ViTConfig)}  # a subclass's: dropped
    config = replace(ViTConfig(**plain), arch="vit", depth=depth, depth_drop=0.0, raptor_blocks=1,
                     ffn_dim=hidden, expert_ffn_fraction=1.0)
    vit = VisionTransformer(config).to(device=model.cls_token.device, dtype=model.cls_token.dtype)
    vit.load_state_dict(state)
    return vit.train(model.training)

# --- behind the story: the merge cache (§3.1), fp32 regions (App. A.5), the depth prior, DeiT III's init ---

@torch.compiler.disable  # a Python-side lookup, kept out of compiled graphs (no guards, no recompiles)
def merge_cache(model: ReViT, depth: int) -> list[MergedFFN] | None:
    """The L merged FFNs of depth L, "computed once and reused" (§3.1; None for E = 1): merged at once in
    fp32, cast once (equal to the per-step merge up to float rounding). Not detected: writes that bypass the
    version counters (`p.data`, a fused optimizer step) with no train()/eval() after them."""
    ffn = model.block.mlp
    if not isinstance(ffn, MergedExpertFFN):
        return None
    device = ffn.fc1_weight.device
    key = (depth, device, ffn.temperature, ffn.router_prior,
           *((p._version, p.data_ptr(), p.dtype) for p in ffn.parameters()))
    if model.merged_ffns is None or model.merged_ffns[0] != key:
        model.merged_ffns = None  # free the old cache before building the new one
        merged = ffn.merge(ffn.gates(depth_grid(depth, device)))                 # fp32 (L, ...)
        merged = [w.to(ffn.fc1_weight.dtype) for w in merged]                    # cast once, not per call
        model.merged_ffns = key, [MergedFFN(*(w[t] for w in merged)) for t in range(depth)]
    return model.merged_ffns[1]

def full_precision(device: torch.device):
    """A region with autocast off: router and merge math stay fp32 (App. A.5: "generic FP32 reductions")."""
    return torch.autocast(device.type, enabled=False) if autocast_available(device.type) else nullcontext()

@torch.compiler.assume_constant_result  # a fact of the device type; dynamo (torch 2.11) cannot trace it
def autocast_available(device_type: str) -> bool:
    return torch.amp.is_autocast_available(device_type)

def depth_prior(s: torch.Tensor, num_experts: int, beta: float) -> torch.Tensor:
    """Not in the paper: (n, 1) -> (n, E) -beta (s - c_e)^2, c_e = e / (E - 1), a fixed term on the logits
    that starts expert e dominant near s = c_e, a symmetry-breaking start (ours; beta = router_prior)."""
    centres = torch.linspace(0.0, 1.0, num_experts, device=s.device)       # (E,)
    return -beta * (s.float() - centres).pow(2)

def init_linear(module: nn.Module) -> None:  # LayerNorms keep their (1, 0) start
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)

# --- Table 1's baselines: DeiT III's LayerScale, the plain ViT (also what `fold` returns) and Raptor ---

class LayerScale(nn.Module):
    """DeiT III's per-channel scale of a residual branch (the baselines; reViT's block has none, Eq. 3)."""

    def __init__(self, dim: int, init: float):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma

class VisionTransformer(ViTBase):
    """Untied ViT: block t serves step t. `fold` returns this class, so a folded reViT runs through
    plain ViT code; Raptor (next) shares k blocks over the steps by overriding `schedule`."""
    arch = "vit"  # the ViTConfig.arch this class builds

    def __init__(self, c: ViTConfig, num_blocks: int | None = None):
        super().__init__(c)
        self.blocks = nn.ModuleList(
            Block(c.dim, c.heads, Mlp(c.dim, c.ffn_dim), c.layer_scale_init, c.drop_path)
            for _ in range(num_blocks or c.depth))
        self.init_weights()

    def schedule(self, depth: int) -> list[int]:  # which block serves each step
        if depth != self.config.depth:
            raise ValueError(f"depth={depth}: an untied ViT runs only its own depth ({self.config.depth}); "
                             "use a Raptor or reViT model for other depths")
        return list(range(depth))

    def forward(self, images: torch.Tensor, depth: int | None = None, return_states: bool = False):
        schedule = self.schedule(self.check_depth(depth))
        x = self.embed(images)
        states = [x]
        for block_index in schedule:
            x = self.blocks[block_index](x)
            states.append(x)
        return self.finish(x, states, {}, return_states)

def raptor_schedule(num_blocks: int, depth: int) -> list[int]:
    """Which block serves each step: contiguous segments. Raptor (L=12) lets block i serve 1-based steps
    t <= thresholds[i] (`known`); at another depth they scale with L; other k split evenly."""
    known = {2: [7], 3: [7, 10], 4: [4, 7, 10]}
    ends = [round((i + 1) * depth / num_blocks) for i in range(num_blocks)]
    if num_blocks in known and depth >= num_blocks:
        scaled = [round(th * depth / 12) for th in known[num_blocks]] + [depth]
        if all(a < b for a, b in zip([0] + scaled, scaled)):  # too shallow to scale: even split
            ends = scaled
    return [sum(step > end for end in ends) for step in range(1, depth + 1)]  # segments ended before step

class Raptor(VisionTransformer):
    """k = raptor_blocks blocks, each serving a contiguous segment of the steps, at any depth."""
    arch = "raptor"

    def __init__(self, config: ViTConfig):
        super().__init__(config, config.raptor_blocks)

    def schedule(self, depth: int) -> list[int]:
        return raptor_schedule(len(self.blocks), depth)

# --- the config: every model's settings; presets: Table 1's models and small CPU sizes of our own ---

@dataclass
class ViTConfig:
    """Every model's settings, flat: the names of create_model's overrides, --model-args and checkpoints."""
    arch: str = "revit"           # "vit" (untied, DeiT III) | "raptor" (k blocks) | "revit"
    image_size: int = 224
    patch_size: int = 16
    in_channels: int = 3
    num_classes: int = 1000       # 0: no head (features only)
    dim: int = 384                # d
    heads: int = 6
    ffn_dim: int = 1536           # d_ff
    depth: int = 12               # L: blocks of a ViT, recurrent steps of Raptor / reViT (trained depth)
    layer_scale_init: float | None = None  # LayerScale init (DeiT III, Raptor: 1e-4); None: none (Eq. 3)
    drop_path: float = 0.0        # stochastic depth inside each block: drops residual branches per sample
    raptor_blocks: int = 4        # k distinct blocks of Raptor
    num_experts: int = 4          # E of reViT; E = 1 is the plain tied (ALBERT-style) block
    router_hidden: int = 16       # width of psi (Eq. 1, App. A.1)
    router_temperature: float = 1.0  # tau (App. A.1 fixes 1)
    router_prior: float = 0.0     # beta of a fixed depth prior on the gate logits; 0 = the paper's router
    depth_drop: float = 0.0       # elastic depth (§3.2): per-image drop rate of whole steps, training only
    balance_weight: float = 1e-2  # λ_bal of Eq. 6 (App. A.2, Table 6)
    z_loss_weight: float = 1e-3   # λ_z of Eq. 8 (App. A.2, Table 6)
    diversity_weight: float = 1e-3  # λ_div of Eq. 9 (App. A.2, Table 6)
    merge_cache: bool = True      # inference without gradients reuses the merged FFNs of a depth
    expert_ffn_fraction: float = 1.0  # hidden width of each expert / ffn_dim (the paper's ehr / 4)

    def __post_init__(self):
        check_fields(self, FIELD_RULES)  # each field's type, then its range (at the end of the file)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def expert_ffn_dim(self) -> int:
        return round(self.expert_ffn_fraction * self.ffn_dim)

    @property
    def model_class(self) -> type:  # the class this config builds
        return MODELS[self.arch]

MINI = dict(num_classes=10, dim=96, heads=3, ffn_dim=192, depth=6)  # our CPU width
SIZES = {  # Table 1's (ImageNet 224², patch 16; "s14" etc.: patch 14, e.g. DINOv2 distillation's B/14)
    "s": dict(dim=384, heads=6, ffn_dim=1536, depth=12),
    "b": dict(dim=768, heads=12, ffn_dim=3072, depth=12),
    "l": dict(dim=1024, heads=16, ffn_dim=4096, depth=24),
    "mini": dict(image_size=28, patch_size=7, in_channels=1, **MINI),  # Fashion-MNIST (the quick start)
    "mini32": dict(image_size=32, patch_size=4, in_channels=3, **MINI),  # CIFAR-10
}
SIZES.update({f"{size}14": dict(SIZES[size], patch_size=14) for size in ("s", "b", "l")})
# Table 1: DeiT III (untied), Raptor (k = 4 blocks), reViT (one block, E = 4); at every size also Raptor with
# k = 2, 3, 4 ("-k2") and reViT with E = 1, 2, 3, 4, 8 ("-e8", Table 5). LayerScale 1e-4 (DeiT III). Raptor's
# official block (KempnerInstitute/raptor) has 1e-5; ours 1e-4, as the paper trains it with DeiT III's recipe.
DEIT3 = dict(layer_scale_init=1e-4)
ARCHS = {"vit": DEIT3, "raptor": dict(raptor_blocks=4, **DEIT3), "revit": dict(num_experts=4)}
VARIANTS = {"vit": [], "raptor": [(f"-k{k}", dict(raptor_blocks=k)) for k in (2, 3, 4)],
            "revit": [(f"-e{e}", dict(num_experts=e)) for e in (1, 2, 3, 4, 8)]}
PRESETS = {f"{arch}-{size}{suffix}": {"arch": arch, **width, **extra, **variant}
           for size, width in SIZES.items() for arch, extra in ARCHS.items()
           for suffix, variant in [("", {}), *VARIANTS[arch]]}
MODELS = {cls.arch: cls for cls in (VisionTransformer, Raptor, ReViT)}  # the class each ViTConfig.arch builds

def create_model(name: str, **overrides) -> nn.Module:
    """Build a preset by name, e.g. create_model("revit-s", depth_drop=0.3)."""
    values = {**preset(name, PRESETS, " (the comparison mechanisms': lib.moe.create_model)"), **overrides}
    return build_model(make_config(ViTConfig, values))

def build_model(config: ViTConfig) -> nn.Module:
    return config.model_class(config)

# --- input checks: bad input gets one ValueError naming the field and what it allows ---

TYPES = {  # a field's annotation -> (the types it accepts, what it allows)
    "int": (int, "an integer"), "float": ((int, float), "a finite number"), "bool": (bool, "True or False"),
    "str": (str, "a string"), "float | None": ((int, float, type(None)), "a finite number or None")}
# Sizes nobody reaches by intent (our choice, far above ViT-L): a typo or an edited config is refused early.
MAX_DEPTH = 256
SIZE_LIMITS = dict(image_size=2 ** 14, patch_size=2 ** 10, in_channels=2 ** 10, dim=2 ** 15, heads=2 ** 10,
                   ffn_dim=2 ** 17, router_hidden=2 ** 12, num_experts=2 ** 10)
FIELD_RULES = [  # (field, test on the config c, what the field allows; "{name}" shows c's value of name)
    ("arch", lambda c: c.arch in MODELS, f"one of {tuple(MODELS)}"),
    *((name, lambda c, name=name, limit=limit: 1 <= getattr(c, name) <= limit, f"an integer in 1..{limit}")
      for name, limit in SIZE_LIMITS.items()),
    ("image_size", lambda c: c.image_size % c.patch_size == 0, "a multiple of patch_size={patch_size}"),
    ("dim", lambda c: c.dim % c.heads == 0, "a multiple of heads={heads}"),
    ("num_classes", lambda c: 0 <= c.num_classes <= 2 ** 20, "in 0..2**20"),
    ("depth", lambda c: (2 if c.arch == "revit" else 1) <= c.depth <= MAX_DEPTH,
     f"in 1..{MAX_DEPTH} (reViT: 2..{MAX_DEPTH}, as s_t = t/(L-1) needs two steps)"),
    ("raptor_blocks", lambda c: c.arch != "raptor" or 1 <= c.raptor_blocks <= c.depth,
     "between 1 and depth={depth}"),
    ("layer_scale_init", lambda c: c.layer_scale_init is None or c.layer_scale_init > 0, "> 0 or None"),
    ("depth_drop", lambda c: 0.0 <= c.depth_drop < 1.0, "in [0, 1)"),
    ("drop_path", lambda c: 0.0 <= c.drop_path < 1.0, "in [0, 1)"),
    ("router_temperature", lambda c: 1e-3 <= c.router_temperature <= 1e3, "in [0.001, 1000]"),
    *((name, lambda c, name=name: 0 <= getattr(c, name) <= 1e3, "in [0, 1000]")
      for name in ("router_prior", "balance_weight", "z_loss_weight", "diversity_weight")),
    ("expert_ffn_fraction", lambda c: c.expert_ffn_fraction > 0 and c.expert_ffn_dim >= 1,
     "> 0 with at least one hidden unit (ffn_dim={ffn_dim})"),
]

def preset(name: str, presets: dict, more: str = "") -> dict:
    if name not in presets:
        close = " or ".join(map(repr, difflib.get_close_matches(name.lower(), presets, n=3)))
        hint = f"did you mean {close}?" if close else "`python revit.py` lists the presets"
        raise ValueError(f"unknown preset name={name!r}; {hint}{more}")
    return presets[name]

def make_config(cls: type, values: dict) -> ViTConfig:
    allowed = [f.name for f in fields(cls)]
    if unknown := sorted(set(values) - set(allowed)):
        raise ValueError(f"unknown config field(s) {unknown}; allowed fields: {', '.join(allowed)}")
    return cls(**values)

def check_fields(c: ViTConfig, rules: list) -> None:
    """Each field's type (ints refuse floats, strings, bools; floats NaN and inf), then the rules in order."""
    for f in fields(c):
        value, (types, allowed) = getattr(c, f.name), TYPES[f.type]
        finite = not isinstance(value, float) or math.isfinite(value)
        if not (isinstance(value, types) and isinstance(value, bool) == (f.type == "bool") and finite):
            raise refusal(c, f.name, allowed)
    for name, test, allowed in rules:
        if not test(c):
            raise refusal(c, name, allowed.format_map(vars(c)))

def refusal(c: ViTConfig, name: str, allowed: str) -> ValueError:
    return ValueError(f"{name}={getattr(c, name)!r} is not allowed: {name} must be {allowed}")

if __name__ == "__main__":  # python revit.py [names...]: parameter counts (on the meta device)
    if {"-h", "--help"} & set(sys.argv):
        print("usage: python revit.py [PRESET ...]: parameter counts of the presets (default: the main ones)")
        sys.exit()
    names = sys.argv[1:] or [n for n in PRESETS if n.count("-") == 1 or n.endswith(("-e1", "-e8"))]
    try:
        with torch.device("meta"):
            rows = [f"| {name} | {create_model(name).num_params() / 1e6:.2f} |" for name in names]
    except ValueError as e:  # every name is checked before the table starts: one line, no header
        sys.exit(f"revit.py: {e}")
    print("| preset | params (M) |", "|---|---:|", *rows, sep="\n")
