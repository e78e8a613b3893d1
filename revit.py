"""reViT: one recurrent ViT block whose FFN is a depth-programmed merge of an expert bank.

Paper: "One Block, Multiple Depths: Recurrent Vision Transformers with Depth-Programmed Experts"
(reViT, arXiv 2610.12448): §3.1 (router and merge, Eqs. 1-3), §3.2 (elastic depth), App. A.1-A.2
(initialisation, auxiliary losses Eqs. 6, 8, 9), Table 1 (sizes); §4.3 and App. B (the comparisons).

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

Reading order. Part I, top to bottom, is all of reViT: the building blocks (`Attention`, `FFN`,
`Mlp`) -> the ViT block (`Block`, Eq. 3) -> the depth router ψ and the merge (`DepthRouter`,
`MergedExpertFFN`, Eqs. 1-2) with the auxiliary losses (`gate_penalties`, `merge_regularisers`) ->
`ViTConfig` and its input checks -> `ReViT` (`run_steps`; `run_elastic_steps`, §3.2) -> `fold` ->
Table 1's baselines (`VisionTransformer`, `Raptor`) -> `PRESETS` and `create_model`. The merge cache
(`CachedMergedExpertFFN`) is an inference optimisation a first reading may skip. Part II holds the
paper's comparison mechanisms (§4.3, App. B): each an `FFN` (or, for layer-wise LoRA, a `Block`) that
Part II registers in `SHARED_BLOCKS`, so Part I refers to none of them.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, fields, replace
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from torch.optim.optimizer import register_optimizer_step_post_hook

# ================================ Part I — reViT ================================

# --- building blocks (DeiT III numerics: LayerNorm eps 1e-6, qkv bias, trunc-normal 0.02) ---

def init_linear(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)

def full_precision(device: torch.device):
    """A region with autocast off: router and merge math stay fp32 (App. A.5: "generic FP32 reductions")."""
    return torch.autocast(device.type, enabled=False) if torch.amp.is_autocast_available(device.type) else nullcontext()

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

class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma

class DropPath(nn.Module):
    """Stochastic depth *inside* a block: drops a residual branch per sample (DeiT III's recipe).

    Not elastic depth: reViT's `depth_drop` removes whole recurrent steps and renumbers the rest."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = x.new_empty(x.shape[0], *([1] * (x.ndim - 1))).bernoulli_(1.0 - self.p)
        return x * keep / (1.0 - self.p)

def apply_ffn(u, fc1_weight, fc1_bias, fc2_weight, fc2_bias):
    """FFN(u) = W2 GELU(W1 u + b1) + b2 with given weights, cast to u's dtype at use."""
    w1, b1, w2, b2 = (w.to(u.dtype) for w in (fc1_weight, fc1_bias, fc2_weight, fc2_bias))
    return F.linear(F.gelu(F.linear(u, w1, b1)), w2, b2)

class Step(NamedTuple):
    """Where one application of reViT's shared block runs: what an FFN with `needs_step` is given.

      t       int          the step index in 0..L-1
      coords  (b,)         each image's normalised depth coordinate s (Eq. 1; renumbered under §3.2)
      rows    (b,) | None  which images of the batch run this step, under elastic depth; None: the
                           whole batch, every image at the grid coordinate s_t = t / (L - 1)
    """
    t: int
    coords: torch.Tensor
    rows: torch.Tensor | None = None

class FFN(nn.Module):
    """What the FFN of a block implements (a plain Mlp, reViT's merge, and every Part II mechanism).

    forward(u) -> tokens of u's shape, u (b, T, d) the LayerNorm'd tokens of the images that run this
    step; an FFN whose weights depend on where it runs sets `needs_step` and gets forward(u, step), step
    a `Step`. begin_forward(depth, batch) runs once before step 0 (per-forward state: a merge cache,
    pooled router statistics), aux_losses(depth) once after the last step (weighted auxiliary losses).
    """

    needs_step = False

    def begin_forward(self, depth: int, batch: int) -> None:
        pass

    def aux_losses(self, depth: int) -> dict:
        return {}

class Mlp(FFN):
    """The dense FFN of a ViT block: fc2(GELU(fc1(u)))."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(u)))

    def dense_states(self, depth: int, gates: torch.Tensor | None = None) -> list[dict]:
        """The Mlp weights of each of `depth` steps (fold): its own at every step."""
        return [self.state_dict()] * depth

# --- the plain ViT block (Eq. 3) ---

class Block(nn.Module):
    """Pre-norm transformer block (Eq. 3): H = X + MHSA(LN(X)); X' = H + FFN(LN(H)).

    Optional LayerScale (DeiT III) and per-sample drop-path on both branches. The FFN is any
    `FFN`, so the same block serves ViT, Raptor and reViT.
    """

    def __init__(self, dim: int, heads: int, mlp: FFN, layer_scale_init: float | None = None,
                 drop_path: float = 0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.ls1 = LayerScale(dim, layer_scale_init) if layer_scale_init is not None else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = mlp
        self.ls2 = LayerScale(dim, layer_scale_init) if layer_scale_init is not None else nn.Identity()
        self.drop_path = DropPath(drop_path)

    def forward(self, x: torch.Tensor, step: Step | None = None) -> torch.Tensor:
        """step: where this application runs (reViT); only an FFN with `needs_step` reads it."""
        x = x + self.drop_path(self.ls1(self.attn(self.norm1(x))))
        u = self.norm2(x)
        return x + self.drop_path(self.ls2(self.mlp(u, step) if self.mlp.needs_step else self.mlp(u)))

    def begin_forward(self, depth: int, batch: int) -> None:
        self.mlp.begin_forward(depth, batch)

    def unrolled_states(self, depth: int, gates: torch.Tensor | None = None) -> list[dict]:
        """State dicts of `depth` plain Blocks (dense Mlp): block t computes what this shared block
        computes at step t (fold); gates: an [L, E] matrix replacing a merged FFN's own gates."""
        shared = {k: v for k, v in self.state_dict().items() if not k.startswith("mlp.")}
        return [{**shared, **{f"mlp.{k}": v for k, v in ffn.items()}} for ffn in self.mlp.dense_states(depth, gates)]

# --- the depth router ψ and the weight-space merge (§3.1, Eqs. 1-2); aux losses (App. A.2) ---

def depth_grid(depth: int, device=None) -> torch.Tensor:
    """Eq. 1: s_t = t / (L - 1), t = 0..L-1. Same formula as the renumbered elastic coordinates."""
    return torch.arange(depth, device=device, dtype=torch.float32) / (depth - 1)

class ExpertBank(nn.Module):
    """E expert FFNs stored as stacked tensors, theta_e = (W1_e, b1_e, W2_e, b2_e) (§3.1).

    Each expert is initialised like a ViT FFN, independently (App. A.1). Names of the per-expert
    biases end in "bias", so the optimizer never decays them, like every other bias.
    """

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

    def merge(self, gates: torch.Tensor) -> tuple:
        """Eq. 2 for n gate vectors at once: (n, E) -> four stacks of merged tensors (n, ...).

        Always fp32, whatever the bank's dtype or autocast; callers cast at use (apply_ffn)."""
        n = gates.shape[0]
        with full_precision(gates.device):
            return tuple((gates.float() @ p.float().flatten(1)).view(n, *p.shape[1:]) for p in self.bank())

    def diversity(self) -> torch.Tensor:
        """Eq. 9: mean over pairs e < e' of cos^2(vec(theta_e), vec(theta_e')). Pair-mean is our default."""
        theta = F.normalize(torch.cat([p.flatten(1) for p in self.bank()], dim=1).float(), dim=1)  # (E, P)
        cos = theta @ theta.T
        i, j = torch.triu_indices(self.num_experts, self.num_experts, offset=1, device=cos.device)
        return cos[i, j].pow(2).mean()

def gate_penalties(z: torch.Tensor, temperature: float) -> tuple:
    """Sums over the rows of z (n, E) of 1 - H(g)/log E (Eq. 6) and logsumexp(z)^2 (Eq. 8)."""
    z = z.float()
    g = torch.softmax(z / temperature, dim=-1)
    entropy = -(g * torch.log(g.clamp_min(1e-12))).sum(-1)
    return (1.0 - entropy / math.log(z.shape[-1])).sum(), torch.logsumexp(z, dim=-1).pow(2).sum()

def merge_regularisers(bank: ExpertBank, balance_sum, z_sum, rows, weights: tuple) -> dict:
    """Eqs. 6 and 8 as means over `rows` gate vectors (from their sums), and Eq. 9 on the bank."""
    balance_weight, z_weight, diversity_weight = weights
    return {"balance": balance_weight * balance_sum / rows,                     # Eq. 6
            "z_loss": z_weight * z_sum / rows,                                  # Eq. 8
            "diversity": diversity_weight * bank.diversity()}                   # Eq. 9

class DepthRouter(nn.Sequential):
    """psi of Eq. 1: Linear(1, 16) -> SiLU -> Linear(16, E) on the depth coordinate, always in fp32."""

    def __init__(self, hidden: int, num_experts: int):
        super().__init__(nn.Linear(1, hidden), nn.SiLU(), nn.Linear(hidden, num_experts))

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        """(n, 1) coordinates -> (n, E) logits."""
        first, last = self[0], self[2]
        with full_precision(s.device):
            hidden = F.silu(F.linear(s.float(), first.weight.float(), first.bias.float()))  # (n, 16)
            return F.linear(hidden, last.weight.float(), last.bias.float())


def unstack_one(stacks: tuple) -> tuple:
    """(1, ...) stacks -> their only entries. squeeze, not [0]: its backward is a view, where indexing's
    would allocate and copy each merged weight's gradient again at every step."""
    return tuple(w.squeeze(0) for w in stacks)

class MergedExpertFFN(ExpertBank, FFN):
    """reViT's FFN (§3.1): E expert FFNs merged in weight space by a depth router.

    Eq. 1: z_t = psi(s_t), g_t = softmax(z_t / tau), psi = Linear(1,16) -> SiLU -> Linear(16,E).
    Eq. 2: W1_t = sum_e g_te W1_e (same for b1, W2, b2); FFN_t(u) = W2_t GELU(W1_t u + b1_t) + b2_t.
    Gates and merges are computed in fp32 under any autocast or parameter dtype. Each step merges its
    own FFN, so only one merged FFN is alive at a time (the bank stays the only large weight).
    """

    needs_step = True

    def __init__(self, dim: int, hidden: int, num_experts: int, router_hidden: int = 16,
                 router_temperature: float = 1.0, aux_weights: tuple = (1e-2, 1e-3, 1e-3),
                 router_prior: float = 0.0):
        super().__init__(dim, hidden, num_experts)
        self.temperature, self.aux_weights = router_temperature, aux_weights
        self.router_prior = router_prior
        self.router = DepthRouter(router_hidden, num_experts)

    def reset_router(self) -> None:
        """App. A.1: the output layer is zero-initialised, so all experts start with equal weight.
        The paper does not say how the hidden layer starts; ours is the model-wide trunc-normal(0.02)
        with zero bias, which makes psi nearly linear in s at the start (our choice)."""
        self.router.apply(init_linear)
        nn.init.zeros_(self.router[2].weight)
        nn.init.zeros_(self.router[2].bias)

    def gate_logits(self, coords: torch.Tensor) -> torch.Tensor:
        """(n,) coordinates -> (n, E) fp32 logits z = psi(s) + depth_prior(s)."""
        s = coords.float().unsqueeze(-1)                                          # (n, 1)
        z = self.router(s)                                                        # (n, E)
        return z + self.depth_prior(s) if self.router_prior else z

    def depth_prior(self, s: torch.Tensor) -> torch.Tensor:
        """(n, 1) -> (n, E): -beta (s - c_e)^2, c_e = e / (E - 1), beta = router_prior (not in the paper;
        0 by default). A fixed term that starts expert e dominant near s = c_e: a symmetry-breaking start."""
        centres = torch.linspace(0.0, 1.0, self.num_experts, device=s.device)       # (E,)
        return -self.router_prior * (s.float() - centres).pow(2)

    def gates(self, coords: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.gate_logits(coords) / self.temperature, dim=-1)

    def step_weights(self, step: Step) -> tuple:
        """The merged FFN of grid step t (every image at s_t): Eq. 2 on one gate vector."""
        return unstack_one(self.merge(self.gates(step.coords[:1])))

    def forward(self, u: torch.Tensor, step: Step) -> torch.Tensor:
        if step.rows is None:  # every image at grid step t: one merged FFN for the whole batch
            return apply_ffn(u, *self.step_weights(step))
        # Elastic depth: images at this step may sit at different coordinates. Group them by
        # coordinate and run one merged FFN per group, never one weight copy per image.
        values, group = torch.unique(step.coords, return_inverse=True)
        merged = self.merge(self.gates(values))                                   # (groups, ...)
        if len(values) == 1:
            return apply_ffn(u, *unstack_one(merged))
        order = torch.argsort(group)
        chunks = u[order].split(torch.bincount(group, minlength=len(values)).tolist())
        y = torch.cat([apply_ffn(chunk, *(w[i] for w in merged)) for i, chunk in enumerate(chunks)])
        return y[torch.argsort(order)]  # back to the batch order

    def aux_losses(self, depth: int) -> dict:
        """Eqs. 6, 8, 9 on the gates of this forward's grid."""
        z = self.gate_logits(depth_grid(depth, self.fc1_weight.device))  # (L, E)
        return merge_regularisers(self, *gate_penalties(z, self.temperature), z.shape[0], self.aux_weights)

    def dense_states(self, depth: int, gates: torch.Tensor | None = None) -> list[dict]:
        """The Mlp weights of each of `depth` steps, from the router's gates or the given [L, E] (fold)."""
        device = self.fc1_weight.device
        gates = self.gates(depth_grid(depth, device)) if gates is None else gates.to(device)  # (L, E)
        names = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
        return [dict(zip(names, (w[0] for w in self.merge(g.unsqueeze(0))))) for g in gates]

# --- an optimisation a first reading may skip: the merge cache for inference ---

# Optimizer steps taken in this process, counted by a hook on every torch.optim optimizer: fused
# AdamW (torch._fused_adamw_) updates parameters in place without bumping their version counters.
OPTIMIZER_STEPS = [0]

def count_optimizer_step(optimizer, args, kwargs) -> None:
    OPTIMIZER_STEPS[0] += 1

register_optimizer_step_post_hook(count_optimizer_step)

class CachedMergedExpertFFN(MergedExpertFFN):
    """MergedExpertFFN plus a cache (ViTConfig.merge_cache, on by default): inference without gradients
    at depth L merges all L FFNs at once and reuses them until the weights change; the outputs are those
    of MergedExpertFFN up to float rounding. Training and any call with gradients never use it.

    Detected: optimizer steps (fused ones too), load_state_dict, in-place ops on the parameters (also
    under torch.no_grad), moving or casting the module, edits of `temperature` or `router_prior`, and any
    train()/eval() call. Not detected: in-place writes through `p.data` (they bypass the version counter)
    outside an optimizer step — call `clear_cache()` (or model.eval()) after such edits.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._cache_key, self._cache = None, None
        self._merged_steps = None  # this forward's cached (L, ...) stacks, set by begin_forward

    def begin_forward(self, depth: int, batch: int) -> None:
        cacheable = not self.training and not torch.is_grad_enabled()
        self._merged_steps = self.cached_merge(depth) if cacheable else None

    def step_weights(self, step: Step) -> tuple:
        if self._merged_steps is not None:
            return tuple(w[step.t] for w in self._merged_steps)
        return super().step_weights(step)

    def weights_version(self) -> tuple:
        # In-place updates bump a tensor's version counter; moving or casting changes data_ptr / dtype.
        # Fused optimizers write without a version bump: every optimizer step counts as an edit.
        return (OPTIMIZER_STEPS[0], self.temperature, self.router_prior,
                *((p._version, p.data_ptr(), p.dtype) for p in self.parameters()))

    @torch.compiler.disable  # a Python-side lookup: kept out of compiled graphs (no guards, no recompiles)
    def cached_merge(self, depth: int) -> tuple:
        key = (depth, self.fc1_weight.device, self.weights_version())
        if self._cache_key != key:
            self.clear_cache()  # free the old cache before building the new one
            self._cache = self.merge(self.gates(depth_grid(depth, self.fc1_weight.device)))  # fp32 (L, ...)
            self._cache_key = key
        return self._cache

    def clear_cache(self) -> None:
        self._cache_key, self._cache, self._merged_steps = None, None, None

    def train(self, mode: bool = True):
        self.clear_cache()  # a mode switch is where hand-written weight edits usually end
        return super().train(mode)

# --- config and its input checks, and the stem and head that every model shares ---

@dataclass
class ViTConfig:
    """Every model's settings, flat: create_model's overrides, train.py's --model-args and saved configs
    all use these names. Part I's fields first; the last group is read only by Part II's mechanisms."""
    arch: str = "revit"           # "vit" (untied, DeiT III) | "raptor" (k blocks) | "revit"
    image_size: int = 224
    patch_size: int = 16
    in_channels: int = 3
    num_classes: int = 1000       # 0: no head (features only)
    dim: int = 384                # d
    heads: int = 6
    ffn_dim: int = 1536           # d_ff
    depth: int = 12               # L: blocks of a ViT, recurrent steps of Raptor / reViT (trained depth)
    layer_scale_init: float | None = None  # LayerScale init (DeiT III, Raptor presets: 1e-4); None: none (Eq. 3)
    drop_path: float = 0.0        # stochastic depth inside each block: drops residual branches per sample
    raptor_blocks: int = 4        # k distinct blocks of Raptor
    num_experts: int = 4          # E of reViT; E = 1 is the plain tied (ALBERT-style) block
    router_hidden: int = 16       # width of psi (Eq. 1, App. A.1)
    router_temperature: float = 1.0  # tau (App. A.1 fixes 1)
    router_prior: float = 0.0     # beta of a fixed depth prior on the gate logits; 0 = the paper's router
    depth_drop: float = 0.0       # elastic depth (§3.2): per-image drop rate of whole recurrent steps, training only
    balance_weight: float = 1e-2  # lambda_bal (Table 6); Qwen3 / MoEUT use it for their own balance loss
    z_loss_weight: float = 1e-3   # lambda_z
    diversity_weight: float = 1e-3  # lambda_div
    merge_cache: bool = True      # reuse merged FFNs across inference calls at the same depth (CachedMergedExpertFFN)
    expert_ffn_fraction: float = 1.0  # hidden width of each expert / ffn_dim (the paper's ehr / 4)
    ffn: str = "merge"            # the shared block's FFN: "merge" (reViT's); Part II registers the others
    # Part II's settings: read only by the comparison mechanisms Part II registers (App. B, Table 8)
    top_k: int = 1                # K experts per token (deepseek, qwen3, moeut)
    shared_experts: int = 0       # DeepSeek-V3's always-active experts
    slots_per_expert: int = 0     # Soft-MoE; 0: round(num_patches / 4) (49 for S/16, 64 for B/14)
    bias_update_rate: float = 1e-3  # DeepSeek-V3's aux-loss-free balancing step
    remoe_target_sparsity: float = 0.75  # ReMoE: 1 - K/E
    lora_rank: int = 64           # layer-wise LoRA rank r (Table 10: 64 for S/16)

    def __post_init__(self):
        check_config(self)  # types and ranges of every field (below)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def expert_ffn_dim(self) -> int:
        return round(self.expert_ffn_fraction * self.ffn_dim)

    @property
    def depth_programmed(self) -> bool:
        """The FFN of step t depends on the depth only, so the model folds (a gate matrix: ffn='merge')."""
        return SHARED_BLOCKS[self.ffn].depth_programmed

# Bad input gets one ValueError naming the field and what it allows (the CLIs print it as one line).
TYPE_RULES = {"int": "an integer", "float": "a finite number", "bool": "True or False", "str": "a string"}
CONFIG_CHECKS: list[Callable[[ViTConfig], None]] = []  # range checks of Part II's fields, which Part II adds
# Sizes a user would not reach by intent (our choice, far above the paper's ViT-L): a typo or an edited
# checkpoint config is refused before anything is allocated.
MAX_DEPTH = 256
SIZE_LIMITS = dict(image_size=2 ** 14, patch_size=2 ** 10, in_channels=2 ** 10, dim=2 ** 15, heads=2 ** 10,
                   ffn_dim=2 ** 17, router_hidden=2 ** 12, num_experts=2 ** 10)

def type_ok(value, kind: str) -> bool:
    if kind.endswith(" | None"):
        return value is None or type_ok(value, kind[:-7])
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, {"bool": bool, "str": str}[kind])

def need(config: ViTConfig, ok: bool, name: str, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={getattr(config, name)!r} is not allowed: {name} must be {allowed}")

def check_config(c: ViTConfig) -> None:
    """Every field: its type (integers reject floats, strings and bools; floats reject NaN and inf), then its range."""
    for f in fields(c):
        if not type_ok(getattr(c, f.name), f.type):
            allowed = TYPE_RULES[f.type.replace(" | None", "")] + (" or None" if "None" in f.type else "")
            need(c, False, f.name, allowed)
    check_core_fields(c)
    for check in CONFIG_CHECKS:
        check(c)

def check_core_fields(c: ViTConfig) -> None:
    need(c, c.arch in MODELS, "arch", f"one of {tuple(MODELS)}")
    for name, limit in SIZE_LIMITS.items():
        need(c, 1 <= getattr(c, name) <= limit, name, f"an integer in 1..{limit}")
    need(c, c.image_size % c.patch_size == 0, "image_size", f"a multiple of patch_size={c.patch_size}")
    need(c, c.dim % c.heads == 0, "dim", f"a multiple of heads={c.heads}")
    need(c, 0 <= c.num_classes <= 2 ** 20, "num_classes", "in 0..2**20")
    revit_note = " for reViT (s_t = t/(L-1) needs two steps)" if c.arch == "revit" else ""
    need(c, (2 if c.arch == "revit" else 1) <= c.depth <= MAX_DEPTH, "depth",
         f"in {2 if c.arch == 'revit' else 1}..{MAX_DEPTH}{revit_note}")
    need(c, c.arch != "raptor" or 1 <= c.raptor_blocks <= c.depth, "raptor_blocks",
         f"between 1 and depth={c.depth}")
    need(c, c.layer_scale_init is None or c.layer_scale_init > 0, "layer_scale_init", "> 0 or None")
    need(c, 0.0 <= c.depth_drop < 1.0, "depth_drop", "in [0, 1)")
    need(c, 0.0 <= c.drop_path < 1.0, "drop_path", "in [0, 1)")
    need(c, c.router_temperature > 0, "router_temperature", "> 0")
    for name in ("router_prior", "balance_weight", "z_loss_weight", "diversity_weight"):
        need(c, getattr(c, name) >= 0, name, ">= 0")
    need(c, c.expert_ffn_fraction > 0 and round(c.expert_ffn_fraction * c.ffn_dim) >= 1,
         "expert_ffn_fraction", f"> 0 with at least one hidden unit (ffn_dim={c.ffn_dim})")
    need(c, c.ffn in SHARED_BLOCKS, "ffn", f"one of {tuple(SHARED_BLOCKS)}")
    need(c, c.ffn == "merge" or c.arch == "revit", "ffn", "'merge' unless arch='revit' (the mechanisms "
         "replace the FFN of reViT's shared block)")

def check_depth_value(depth) -> int:
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 2:
        raise ValueError(f"depth must be an integer >= 2; got {depth!r}")
    return depth

def check_images(images: torch.Tensor, c: ViTConfig) -> None:
    """(B, C, H, W) of the configured shape and a floating dtype (integer pixels are refused, not guessed at)."""
    if images.ndim != 4 or images.shape[1] != c.in_channels:
        raise ValueError(f"images must have shape (B, {c.in_channels}, {c.image_size}, {c.image_size}); "
                         f"got {tuple(images.shape)} (in_channels={c.in_channels})")
    if images.shape[-2:] != (c.image_size, c.image_size):
        raise ValueError(f"images must be {c.image_size}x{c.image_size} (image_size={c.image_size}); "
                         f"got {images.shape[-2]}x{images.shape[-1]}")
    if not images.is_floating_point():
        raise ValueError(f"images must be a floating-point tensor, normalised as in training; got {images.dtype} "
                         "(convert uint8 pixels with images.float() / 255 and normalise)")

def check_preset(name: str, overrides: dict) -> None:
    """create_model's arguments: a preset name and fields of ViTConfig."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset name={name!r}; choose one of: {', '.join(sorted(PRESETS))}")
    allowed = {f.name for f in fields(ViTConfig)}
    unknown = sorted(set(overrides) - allowed)
    if unknown:
        raise ValueError(f"unknown config field(s) {unknown}; allowed fields: {', '.join(sorted(allowed))}")

def check_model_class(model: nn.Module, c: ViTConfig) -> None:
    """A config builds the class its arch names: a Raptor config never becomes a 12-block ViT."""
    if model.arch != c.arch:
        raise ValueError(f"arch={c.arch!r} builds revit.{MODELS[c.arch].__name__}, not {type(model).__name__}; "
                         "build models with revit.MODELS[config.arch](config)")

def check_foldable(model: nn.Module, depth: int | None, gates: torch.Tensor | None) -> None:
    """fold's arguments: a depth-programmed reViT or a Raptor; gates [L, E] for reViT's merge with E >= 2."""
    if not isinstance(model, (ReViT, Raptor)):
        raise ValueError("fold(model) expects a reViT or Raptor model; a plain ViT is already folded")
    if not model.config.depth_programmed:
        foldable = tuple(name for name, entry in SHARED_BLOCKS.items() if entry.depth_programmed)
        raise ValueError(f"fold: ffn={model.config.ffn!r} is input-dependent (its routing depends on the tokens), "
                         f"so it has no fixed per-depth weights to fold; only ffn in {foldable} (reViT's merge: "
                         "any E) fold into a plain ViT")
    if gates is not None:
        if not isinstance(model, ReViT) or not isinstance(model.block.mlp, MergedExpertFFN):
            raise ValueError("fold: gates= applies to a reViT with num_experts >= 2 only")
        if gates.ndim != 2 or gates.shape[1] != model.config.num_experts:
            raise ValueError(f"fold: gates must have shape [depth, E={model.config.num_experts}]; got {tuple(gates.shape)}")
        if depth is not None and depth != gates.shape[0]:
            raise ValueError(f"fold: depth={depth!r} disagrees with gates of shape {list(gates.shape)}; "
                             "pass gates with one row per step of that depth, or leave depth out")

class ViTBase(nn.Module):
    """Patch embedding, class token, positions, final norm and head: common to every model here."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        check_model_class(self, config)
        c = self.config = config
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
        """Names excluded from weight decay beyond biases and 1-D parameters (norms, gammas)."""
        return {"pos_embed", "cls_token"}

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) floating images -> (B, 1+N, d) tokens. Floating images of another dtype
        (float64, or fp32 into a bf16 model) are cast to the model's dtype; integer images are refused."""
        check_images(images, self.config)
        images = images.to(self.patch_embed.proj.weight.dtype)
        x = rearrange(self.patch_embed.proj(images), "b d gh gw -> b (gh gw) d")  # (B, N, d)
        x = x + self.pos_embed  # DeiT III: positions go on the patch tokens, not the class token
        return torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)  # (B, 1+N, d)

    def check_depth(self, depth: int | None) -> int:
        """The depth to run: the trained depth by default, else an integer >= 2 (check_depth_value)."""
        return self.config.depth if depth is None else check_depth_value(depth)

    def finish(self, x, states, aux, return_states, extra=None):
        tokens = self.norm(x)
        logits = self.head(tokens[:, 0])
        if not return_states:
            return logits
        out = {"logits": logits, "pre_logits": tokens[:, 0], "tokens": tokens,
               "states": states, "aux_losses": aux}
        out.update(extra or {})
        return out

# --- reViT: one shared block, depth-programmed merged FFN, elastic depth (§3) ---

def elastic_plan(keep: torch.Tensor) -> torch.Tensor:
    """(B, L) bool mask of retained steps -> (B, L) coordinates (§3.2): image b's n_b retained steps are
    renumbered k = 0..n_b-1 and sit at k / (n_b - 1); n_b = 1 gets s = 0 (our choice). Dropped: unused."""
    rank = keep.long().cumsum(1) - 1                        # (B, L) index among retained steps
    retained = keep.sum(1, keepdim=True)                    # (B, 1) n_b
    return rank.clamp_min(0).float() / (retained - 1).clamp_min(1).float()

class SharedBlock(NamedTuple):
    """How reViT's shared block is built for one value of ViTConfig.ffn."""
    build: Callable[[ViTConfig], Block]
    depth_programmed: bool  # the FFN of step t depends on the depth only, so the model folds (§3.1)

def build_merge_block(c: ViTConfig) -> Block:
    """reViT's shared block: the merged expert FFN (E = 1: a dense Mlp, the tied block)."""
    if c.num_experts == 1:
        ffn = Mlp(c.dim, c.expert_ffn_dim)
    else:
        merged = CachedMergedExpertFFN if c.merge_cache else MergedExpertFFN
        ffn = merged(c.dim, c.expert_ffn_dim, c.num_experts, c.router_hidden, c.router_temperature,
                     (c.balance_weight, c.z_loss_weight, c.diversity_weight), c.router_prior)
    return Block(c.dim, c.heads, ffn, c.layer_scale_init, c.drop_path)

# ViTConfig.ffn -> its shared block. Part I registers reViT's own; Part II registers the paper's comparisons.
SHARED_BLOCKS = {"merge": SharedBlock(build_merge_block, depth_programmed=True)}

class ReViT(ViTBase):
    """One shared block applied L times (§3.1), at any depth L >= 2, elastic in training (§3.2)."""
    arch = "revit"

    def __init__(self, config: ViTConfig):
        super().__init__(config)
        self.block = SHARED_BLOCKS[config.ffn].build(config)
        self.init_weights()
        if isinstance(self.block.mlp, MergedExpertFFN):
            self.block.mlp.reset_router()

    def forward(self, images: torch.Tensor, depth: int | None = None, return_states: bool = False,
                keep: torch.Tensor | None = None):
        """images (B, C, H, W) -> logits (B, classes), or named outputs with return_states. depth: L
        steps (default: the trained one). keep: optional (B, L) bool mask of the steps each image runs
        (elastic depth); sampled in training when depth_drop > 0."""
        depth = self.check_depth(depth)
        check_images(images, self.config)
        # Before any tensor work: under torch.compile the merge cache's lookup (never compiled) then
        # precedes one graph for the whole forward, instead of splitting it in two.
        self.block.begin_forward(depth, images.shape[0])
        x = self.embed(images)                                                  # (B, 1+N, d)
        keep = self.elastic_mask(keep, x.shape[0], depth, x.device)
        states = self.run_steps(x, depth) if keep is None else self.run_elastic_steps(x, keep)
        # Aux losses only where someone reads them: Eq. 9 alone touches the whole bank (E * P).
        aux = self.block.mlp.aux_losses(depth) if return_states or self.training else {}
        extra = {"gates": self.gate_matrix(depth)} if return_states and self.config.ffn == "merge" else None
        return self.finish(states[-1], states, aux, return_states, extra)

    def run_steps(self, x: torch.Tensor, depth: int) -> list:
        """Eq. 3 applied L times with the FFN of grid step t; returns the L + 1 states."""
        grid = depth_grid(depth, x.device)                                      # s_t (Eq. 1)
        states = [x]
        for t in range(depth):
            x = self.block(x, Step(t, grid[t].expand(x.shape[0])))
            states.append(x)
        return states

    @torch.compiler.disable  # data-dependent row sets and coordinate groups: runs eagerly under torch.compile
    def run_elastic_steps(self, x: torch.Tensor, keep: torch.Tensor) -> list:
        """Elastic depth (§3.2): image b runs only its retained steps, at renumbered coordinates.

        Eager even in a compiled model (the stem, head and losses still compile): each step picks its
        rows (nonzero) and coordinate groups (unique, bincount) from data, so on a GPU every step syncs
        with the host and runs one small FFN per group. A fixed-shape version would sum the merges in
        another order; this one keeps the numerics of the CPU runs."""
        coords = elastic_plan(keep)                                             # (B, L)
        states = [x]
        for t in range(keep.shape[1]):
            rows = keep[:, t].nonzero().squeeze(1)  # images that run step t; a dropped step is the identity
            if len(rows) == x.shape[0]:
                x = self.block(x, Step(t, coords[:, t], rows))
            elif len(rows):
                x = x.index_copy(0, rows, self.block(x[rows], Step(t, coords[rows, t], rows)))
            states.append(x)
        return states

    def elastic_mask(self, keep, batch: int, depth: int, device) -> torch.Tensor | None:
        """The (B, L) retained-step mask, or None when every image runs every step."""
        if keep is None and self.training and self.config.depth_drop > 0:
            keep = torch.rand(batch, depth, device=device) >= self.config.depth_drop
        if keep is not None and keep.shape != (batch, depth):
            raise ValueError(f"keep must have shape (batch, depth) = {(batch, depth)}; got {tuple(keep.shape)}")
        return None if keep is None or bool(keep.all()) else keep

    def gate_matrix(self, depth: int | None = None) -> torch.Tensor:
        """G [L, E]: the fp32 gates of every step at depth L (rows sum to 1). E = 1 gives ones."""
        depth = self.check_depth(depth)
        ffn = self.block.mlp
        if self.config.ffn != "merge":
            raise ValueError(f"ffn={self.config.ffn!r} has no depth-only gate matrix: only reViT's merge "
                             "(ffn='merge') gates its experts by the depth alone")
        if not isinstance(ffn, MergedExpertFFN):
            return torch.ones(depth, 1)
        return ffn.gates(depth_grid(depth, ffn.fc1_weight.device))

    def no_weight_decay(self) -> set:
        # The router's output layer starts at zero and sets the depth program; decaying it
        # pulls the gates back towards uniform. (Its bias is 1-D and excluded anyway.)
        names = super().no_weight_decay()
        if isinstance(self.block.mlp, MergedExpertFFN):
            names.add("block.mlp.router.2.weight")
        return names

    def clear_cache(self) -> None:
        """Drop cached merged FFNs (needed only after in-place edits through `p.data`)."""
        if isinstance(self.block.mlp, CachedMergedExpertFFN):
            self.block.mlp.clear_cache()

# --- fold: a fixed depth becomes a plain ViT (§3.1: "inserted into a conventional fixed-depth graph") ---

@torch.no_grad()
def fold(model: nn.Module, depth: int | None = None, gates: torch.Tensor | None = None) -> VisionTransformer:
    """Return a plain untied ViT (VisionTransformer, below) of `depth` blocks with the same outputs
    as `model` at that depth, on the model's device and in its dtype.

    gates: optional [L, E] matrix that replaces the router's gates (reViT with E >= 2 only; depth, if
    given too, must be L) — the analysis tools use it for expert ablation and permutation (§5). Block t
    of the result is what the source computes at step t (Block.unrolled_states): for reViT, the shared
    attention and merged FFN t; for Raptor (below), the block that serves step t.
    """
    check_foldable(model, depth, gates)
    depth = model.check_depth(gates.shape[0] if gates is not None else depth)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith(("block.", "blocks."))}
    if isinstance(model, ReViT):
        steps = model.block.unrolled_states(depth, gates)
    else:  # Raptor: the block that serves step t
        steps = [model.blocks[j].state_dict() for j in model.schedule(depth)]
    for t, step_state in enumerate(steps):
        state.update({f"blocks.{t}.{k}": v for k, v in step_state.items()})
    hidden = state["blocks.0.mlp.fc1.weight"].shape[0]  # the width of the FFN that actually runs
    config = replace(model.config, arch="vit", ffn="merge", depth=depth, depth_drop=0.0, raptor_blocks=1,
                     ffn_dim=hidden, expert_ffn_fraction=1.0)
    reference = next(model.parameters())
    vit = VisionTransformer(config).to(device=reference.device, dtype=reference.dtype)
    vit.load_state_dict(state)
    return vit.train(model.training)

# --- Table 1's baselines: the plain ViT (DeiT III; also what `fold` returns) ---

class VisionTransformer(ViTBase):
    """Untied ViT: block t serves step t. `fold` returns this class, so a folded reViT runs through
    plain ViT code; Raptor (next) shares k blocks over the steps by overriding `schedule`."""
    arch = "vit"  # the ViTConfig.arch this class builds

    def __init__(self, config: ViTConfig, num_blocks: int | None = None):
        super().__init__(config)
        c = config
        self.blocks = nn.ModuleList(
            Block(c.dim, c.heads, Mlp(c.dim, c.ffn_dim), c.layer_scale_init, c.drop_path)
            for _ in range(num_blocks or c.depth))
        self.init_weights()

    def schedule(self, depth: int) -> list[int]:
        """Which block serves each step."""
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

# --- ... and Raptor: k distinct blocks shared over the L steps ---

def raptor_schedule(num_blocks: int, depth: int) -> list[int]:
    """Which block serves each step: contiguous segments, Raptor's own split where it has one.

    Raptor (L=12) lets block i serve 1-based steps t <= thresholds[i]: k=2 -> [7], k=3 -> [7, 10],
    k=4 -> [4, 7, 10]. At another depth the thresholds scale with L; other k split evenly.
    """
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

# --- presets (Table 1; ImageNet 224²) and small CPU presets of our own ---

WIDTHS = {  # d, heads, d_ff, L (Table 1: S, B, L)
    "s": dict(dim=384, heads=6, ffn_dim=1536, depth=12),
    "b": dict(dim=768, heads=12, ffn_dim=3072, depth=12),
    "l": dict(dim=1024, heads=16, ffn_dim=4096, depth=24),
}
# Small presets for CPU runs: 28x28x1 (Fashion-MNIST, "-mini") and 32x32x3 (CIFAR, "-mini32").
MINI = dict(image_size=28, patch_size=7, in_channels=1, num_classes=10, dim=96, heads=3, ffn_dim=192, depth=6)
MINI32 = dict(MINI, image_size=32, patch_size=4, in_channels=3)
# LayerScale: DeiT III's 1e-4 for the untied ViT. Raptor's official block has LayerScale too
# (KempnerInstitute/raptor, Block(init_values=1e-5)); the paper trains Raptor with DeiT III's recipe, so
# our Raptor presets use DeiT III's 1e-4 (our choice). reViT's block has none (Eq. 3).
DEIT3_LAYER_SCALE = 1e-4

def _build_presets() -> dict:
    presets = {}
    for size, width in [*WIDTHS.items(), ("mini", MINI), ("mini32", MINI32)]:
        patch14 = [] if size.startswith("mini") else [(f"{size}14", dict(width, patch_size=14))]
        for name, base in [(size, width), *patch14]:
            presets[f"vit-{name}"] = dict(base, arch="vit", layer_scale_init=DEIT3_LAYER_SCALE)
            for k in (2, 3, 4):
                presets[f"raptor-{name}-k{k}"] = dict(base, arch="raptor", raptor_blocks=k,
                                                      layer_scale_init=DEIT3_LAYER_SCALE)
            presets[f"raptor-{name}"] = presets[f"raptor-{name}-k4"]  # Table 1's Raptor: k = 4
            for e in (1, 2, 3, 4, 8):
                presets[f"revit-{name}-e{e}"] = dict(base, arch="revit", num_experts=e)
            presets[f"revit-{name}"] = presets[f"revit-{name}-e4"]    # Table 1's reViT: E = 4
    return presets

PRESETS = _build_presets()  # Part II adds the comparison presets
MODELS = {cls.arch: cls for cls in (VisionTransformer, Raptor, ReViT)}  # the class each ViTConfig.arch builds

def create_model(name: str, **overrides) -> nn.Module:
    """Build a preset by name, e.g. create_model("revit-s", depth_drop=0.3)."""
    check_preset(name, overrides)
    config = ViTConfig(**{**PRESETS[name], **overrides})
    return MODELS[config.arch](config)

# ====================== Part II — the paper's comparisons (§4.3, App. B) ======================
# Every mechanism below is an `FFN` (Part I) of reViT's shared block, or (layer-wise LoRA) a Block
# variant; Part II registers each in Part I's SHARED_BLOCKS under its ViTConfig.ffn name, and its
# settings' checks in CONFIG_CHECKS. Each also reports its cost, active_flops_per_token(T) ->
# {"experts", "routing"} (the measures section). Statistics pooled over the steps of one forward live
# on the module (reset by begin_forward); statistics for a non-gradient update after the optimizer
# step (DeepSeek-V3's bias, ReMoE's L1 controller) live on the module too, recorded by training
# forwards only, and are summed over ranks under torch.distributed.

import torch.distributed as dist  # Part II only: global balancing statistics across ranks

def router_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Router math in fp32 (as Switch, Qwen3 and DeepSeek-V3 do), whatever the autocast dtype."""
    with full_precision(x.device):
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float())

def ffn_flops(dim: int, hidden: int) -> int:
    """FLOPs of one FFN on one token: two matmuls d x h, 2 FLOPs per multiply-add."""
    return 4 * dim * hidden

def params_per_expert(bank: ExpertBank) -> int:
    """P(d, r) = 2 r d^2 + (r + 1) d for hidden width r d (App. B)."""
    return 2 * bank.dim * bank.hidden + bank.hidden + bank.dim

def apply_ffn_batched(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias):
    """n FFNs on n row sets at once: x (n, m, d), weights stacked (n, ...) -> (n, m, d)."""
    w1, b1, w2, b2 = (w.to(x.dtype) for w in (fc1_weight, fc1_bias, fc2_weight, fc2_bias))
    h = F.gelu(torch.baddbmm(b1.unsqueeze(1), x, w1.transpose(1, 2)))  # (n, m, h)
    return torch.baddbmm(b2.unsqueeze(1), h, w2.transpose(1, 2))       # (n, m, d)

class PooledRouterStats:
    """Mixin: router statistics summed over every recurrent step of one forward. The experts are the
    same at every step (one shared block), so balance is measured over all of them."""

    router_stats: dict | None = None

    def begin_forward(self, depth: int, batch: int) -> None:
        self.router_stats = {}

    def pool(self, **stats) -> None:
        pooled = self.router_stats = self.router_stats if self.router_stats is not None else {}
        for name, value in stats.items():
            pooled[name] = pooled[name] + value if name in pooled else value

    def take_stats(self) -> dict | None:
        """This forward's pooled statistics (None if nothing was routed), consumed."""
        stats, self.router_stats = self.router_stats or None, {}
        return stats

class ExpertPool(ExpertBank):
    """An expert bank that also runs its experts on activations (rather than merging weights):
    on their own rows, as a weighted mixture over all experts, or by token dispatch."""

    def run_all(self, x: torch.Tensor) -> torch.Tensor:
        """Expert e on its own rows: x (E, m, d) -> (E, m, d)."""
        return apply_ffn_batched(x, *self.bank())

    def mixture(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """Every expert on every token, outputs summed with weights (n, E) (None: all weights 1)."""
        y = self.run_all(x.expand(self.num_experts, *x.shape))  # (E, n, d)
        if weights is None:
            return y.sum(0)
        return (y * weights.T.unsqueeze(-1).to(y.dtype)).sum(0)  # (n, d)

    def dispatch(self, x: torch.Tensor, expert_index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Token dispatch: token i runs experts expert_index[i] (n, K), outputs summed with weights (n, K).

        The n*K (token, expert) pairs are sorted by expert, each expert runs once on its contiguous
        chunk (a loop over experts, never over tokens), and results are scattered back with index_add.
        """
        n, k = expert_index.shape
        flat = expert_index.flatten()                                   # (n K,)
        order = torch.argsort(flat, stable=True)
        token = order // k                                              # token of each sorted pair
        sizes = torch.bincount(flat, minlength=self.num_experts).tolist()
        chunks = x[token].split(sizes)
        y = torch.cat([apply_ffn(chunk, *(p[e] for p in self.bank())) for e, chunk in enumerate(chunks)])
        y = y * weights.flatten()[order].unsqueeze(1).to(y.dtype)       # (n K, d)
        return y.new_zeros(n, x.shape[1]).index_add_(0, token, y)

# --- weight merge with content gates: SMEAR, Lory, the feature-only control of Fig. 2 ---

class ContentMergedFFN(ExpertBank, FFN):
    """Eq. 2 merge with per-image gates from a pooled token state instead of the depth coordinate.

    Shared by SMEAR, Lory and the feature-only control: gates g = softmax(W_r pool + b_r) (b, E),
    one merged FFN per image (b weight copies, run with batched matmuls). The router input is what
    the subclasses change. Elastic depth needs nothing extra: an image's gate comes from its own state.
    """

    normalise_router_input = True

    def __init__(self, dim: int, hidden: int, num_experts: int):
        super().__init__(dim, hidden, num_experts)
        self.router_norm = nn.LayerNorm(dim, eps=1e-6) if self.normalise_router_input else nn.Identity()
        self.router = nn.Linear(dim, num_experts)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.merged_forward(u, u.mean(1))  # routed on the pooled current state (b, d)

    def merged_forward(self, u: torch.Tensor, router_input: torch.Tensor) -> torch.Tensor:
        """u (b, T, d) through the FFN merged with the gates of router_input (b, d)."""
        z = router_logits(self.router_norm(router_input), self.router.weight, self.router.bias)  # (b, E)
        self.record_gates(z)
        merged = self.merge(torch.softmax(z, dim=-1))   # per image: (b, d_ff, d), (b, d_ff), (b, d, d_ff), (b, d)
        return apply_ffn_batched(u, *merged)            # (b, T, d)

    def record_gates(self, z: torch.Tensor) -> None:
        pass

    def active_flops_per_token(self, num_tokens: int) -> dict:
        routing = 2 * self.dim * self.num_experts + 2 * self.num_experts * params_per_expert(self)
        return {"experts": ffn_flops(self.dim, self.hidden), "routing": routing / num_tokens}

class SmearFFN(ContentMergedFFN):
    """SMEAR (Muqeeth et al., 2024; r-three/smear): soft merging of experts with a content router.

    The reference routes on the mean over tokens, LayerNorm'd, with a plain softmax (no temperature),
    merges per example and uses no balance loss (App. B: "no auxiliary losses"). Here the experts are
    full FFNs of the shared block and the pooled state is this step's FFN input.
    """

class FeatureOnlyFFN(PooledRouterStats, ContentMergedFFN):
    """The feature-only control of Fig. 2: SMEAR's gate (pooled current state, no depth signal).

    It replaces reViT's depth coordinate by content and keeps everything else of reViT, including
    the Eqs. 6, 8, 9 regularisers (balance and z-loss over every per-image gate of every step), so
    the comparison isolates the conditioning signal. The gate is recomputed at every step, which is
    what lets it run under per-image depth dropout (App. A.2) and at any inference depth.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, aux_weights: tuple = (1e-2, 1e-3, 1e-3)):
        super().__init__(dim, hidden, num_experts)
        self.aux_weights = aux_weights

    def record_gates(self, z: torch.Tensor) -> None:
        balance_sum, z_sum = gate_penalties(z, 1.0)
        self.pool(balance_sum=balance_sum, z_sum=z_sum, rows=z.shape[0])

    def aux_losses(self, depth: int) -> dict:
        stats = self.take_stats()
        if self.num_experts == 1 or stats is None:
            return {}
        return merge_regularisers(self, stats["balance_sum"], stats["z_sum"], stats["rows"], self.aux_weights)

class LoryFFN(ContentMergedFFN):
    """Lory (Zhong et al., 2024; no public code): a linear softmax router on the pooled representation
    of the previous segment picks the merged FFN of the next one (causal routing).

    App. B reinterprets segments as recurrent steps: the pooled FFN input of an image's previous
    (retained) step routes step t. At an image's first step there is no previous one; it routes on
    its own pooled input (our choice). No LayerNorm on the router input (the pooled tokens are
    already LayerNorm'd) and no auxiliary loss; similarity-based batching has no image analogue.
    Per-image memory of one forward: `previous` (B, d) pooled inputs, `seen` (B,) whether set.
    """

    normalise_router_input = False
    needs_step = True  # step.rows: which images' memories this step reads and writes

    def begin_forward(self, depth: int, batch: int) -> None:
        self.previous, self.seen = None, None
        self.batch = batch

    def forward(self, u: torch.Tensor, step: Step) -> torch.Tensor:
        return self.merged_forward(u, self.router_input(u, step.rows))

    def router_input(self, u: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """The pooled FFN input of each image's previous retained step (its own at its first): (b, d)."""
        pooled = u.mean(1)  # (b, d)
        rows = torch.arange(u.shape[0], device=u.device) if rows is None else rows
        if getattr(self, "previous", None) is None:  # first step of this forward
            batch = getattr(self, "batch", u.shape[0])
            self.previous = pooled.new_zeros(batch, u.shape[-1])
            self.seen = torch.zeros(batch, dtype=torch.bool, device=u.device)
        source = torch.where(self.seen[rows].unsqueeze(1), self.previous[rows], pooled)
        self.previous = self.previous.index_copy(0, rows, pooled)
        self.seen = self.seen.index_fill(0, rows, True)
        return source

# --- token dispatch: DeepSeek-V3, Qwen3, MoEUT (each token runs its top-K experts) ---

class TokenRoutedFFN(ExpertPool, FFN):
    """Common part of the token-dispatch FFNs: a linear router (no bias) over E experts, top-K per
    token, grouped dispatch; subclasses choose scores, selection and gate values (`route`)."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int):
        super().__init__(dim, hidden, num_experts)
        self.top_k = top_k
        self.router = nn.Linear(dim, num_experts, bias=False)

    def route(self, logits: torch.Tensor) -> tuple:
        """(n, E) fp32 router logits -> expert_index (n, K), gate weights (n, K)."""
        raise NotImplementedError

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        x = rearrange(u, "b t d -> (b t) d")
        expert_index, weights = self.route(router_logits(x, self.router.weight))
        y = self.dispatch(x, expert_index, weights) + self.shared_output(x)
        return rearrange(y, "(b t) d -> b t d", b=u.shape[0])

    def shared_output(self, x: torch.Tensor):
        return 0.0

    def active_experts(self) -> int:
        return self.top_k

    def active_flops_per_token(self, num_tokens: int) -> dict:
        return {"experts": self.active_experts() * ffn_flops(self.dim, self.hidden),
                "routing": 2 * self.dim * self.num_experts}

class DeepSeekV3FFN(TokenRoutedFFN):
    """DeepSeek-V3 (Liu et al., 2024; deepseek-ai/DeepSeek-V3 inference/model.py), App. B adaptation.

    Sigmoid affinities s = sigmoid(x W_r); top-K selection on s + b with a per-expert bias b that is
    never added to the gate value; gates = s of the selected experts renormalised over them; plus
    `shared` always-active experts whose outputs are added. b is the auxiliary-loss-free balancer:
    a buffer (no gradient, not trained) updated after each optimizer step by
    b += rate * sign(mean(load) - load_e), re-centred to zero mean, from the token loads of the
    training forwards since the last update. The sequence-wise balance loss, node-limited group
    routing and the 2.5 route scale of the 671B model are omitted. With K = 1 the renormalised gate
    is always 1, so the router gets no gradient and learns only through the bias (the original rule).
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, shared_experts: int,
                 bias_update_rate: float = 1e-3):
        super().__init__(dim, hidden, num_experts, top_k)
        self.shared = ExpertPool(dim, hidden, shared_experts) if shared_experts else None
        self.bias_update_rate = bias_update_rate
        self.register_buffer("expert_bias", torch.zeros(num_experts))
        self._load = None  # (E,) tokens routed to each expert since the last optimizer step

    def route(self, logits: torch.Tensor) -> tuple:
        scores = torch.sigmoid(logits)                                                     # (n, E)
        expert_index = torch.topk(scores + self.expert_bias.float(), self.top_k, dim=-1).indices  # selection only
        gates = scores.gather(1, expert_index)
        if self.training:
            load = torch.bincount(expert_index.flatten(), minlength=self.num_experts).float()
            self._load = load if self._load is None else self._load + load
        return expert_index, gates / gates.sum(-1, keepdim=True)

    def shared_output(self, x: torch.Tensor):
        return 0.0 if self.shared is None else self.shared.mixture(x)

    def active_experts(self) -> int:
        return self.top_k + (self.shared.num_experts if self.shared is not None else 0)

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        if self._load is None:
            return
        load, self._load = self._load, None
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(load)  # every rank applies the same update from the global load
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)
        self.expert_bias -= self.expert_bias.mean()

class Qwen3FFN(PooledRouterStats, TokenRoutedFFN):
    """Qwen3 (Yang et al., 2025; HF transformers qwen3_moe), App. B adaptation.

    Softmax over all experts in fp32, top-K, renormalised by the top-K sum; no shared expert.
    Global-batch load balancing (Qiu et al., 2025): L = w * E * sum_e f_e P_e, P_e the mean router
    probability of this forward, f_e the fraction of (token, slot) selections of expert e counted over
    the global batch: all recurrent steps of the forward (the block is shared) and, under
    torch.distributed, all ranks (all_reduce of the counts, no gradient). With gradient accumulation
    each micro-batch's loss uses the counts of its own forward (over all ranks), not of the whole
    accumulated batch: a loss that waited for later micro-batches could not be backpropagated per
    micro-batch. App. B uses w = 1e-3 at U > 1 and no balance loss at U = 1 (the presets do), where
    K = 1 renormalises every gate to 1: the router then gets no gradient at all (true to the rules).
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, balance_weight: float = 1e-3):
        super().__init__(dim, hidden, num_experts, top_k)
        self.balance_weight = balance_weight

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
        if self.training and dist.is_available() and dist.is_initialized():  # (evaluation may run on one rank)
            dist.all_reduce(counts)
            dist.all_reduce(tokens)
        f = counts / tokens                                  # global: sums to K
        P = stats["prob_sum"] / stats["tokens"]              # local, differentiable
        return {"balance": self.balance_weight * self.num_experts * (f * P).sum()}

class MoEUTFFN(PooledRouterStats, TokenRoutedFFN):
    """MoEUT (Csordás et al., 2024; RobertCsordas/moeut), App. B adaptation.

    sigma-MoE routing: sigmoid scores, top-K, expert outputs summed with the sigmoid scores (no
    renormalisation). Balance regulariser: minus the entropy of the mean softmax selection
    distribution, pooled over tokens and all recurrent applications, weight 0.01. SwitchHead,
    peri-LayerNorm and expert dropout are omitted (dense attention is kept).
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, balance_weight: float = 1e-2):
        super().__init__(dim, hidden, num_experts, top_k)
        self.balance_weight = balance_weight

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

# --- output mixtures: ReMoE (every expert, ReLU gates), Soft-MoE (slots) ---

class ReMoEFFN(PooledRouterStats, ExpertPool, FFN):
    """ReMoE (Wang et al., 2025; thu-ml/ReMoE), App. B adaptation: a dense output mixture.

    Gates g = relu(x W_r) (no softmax, no top-K); every expert runs on every token and the outputs
    are summed with g, so a token whose gates are all zero keeps only its residual. Sparsity comes
    from the load-balanced L1 penalty lambda * E / (n^2 K) * sum_e (sum_tokens g_e) * count_e
    (count_e: tokens with g_e > 0; K = E (1 - target)), with lambda set by the controller after each
    optimizer step: lambda *= 1.2 while the measured sparsity is below the target 0.75, else
    lambda /= 1.2; lambda starts at 1e-8 and is an fp32 buffer. Our choice for the recurrence: the
    n tokens are pooled over all L steps into one normalisation, which is 1/L of the sum of per-step
    (per-layer) penalties.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, target_sparsity: float = 0.75,
                 l1_init: float = 1e-8, l1_step: float = 1.2):
        super().__init__(dim, hidden, num_experts)
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.target_sparsity, self.l1_step = target_sparsity, l1_step
        self.register_buffer("l1_weight", torch.tensor(l1_init, dtype=torch.float32))
        self._active, self._total = None, 0  # nonzero gates and gates seen since the last update

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        x = rearrange(u, "b t d -> (b t) d")
        gates = F.relu(router_logits(x, self.router.weight))                     # (n, E) fp32
        active = (gates > 0).float()
        self.pool(gate_sum=gates.sum(0), counts=active.sum(0), tokens=gates.shape[0])
        if self.training:
            nonzero = active.sum().detach()
            self._active = nonzero if self._active is None else self._active + nonzero
            self._total += active.numel()
        return rearrange(self.mixture(x, gates), "(b t) d -> b t d", b=u.shape[0])

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
        active = torch.stack([self._active.float(), torch.tensor(float(self._total), device=self._active.device)])
        self._active, self._total = None, 0
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(active)
        sparsity = 1.0 - (active[0] / active[1]).item()
        self.l1_weight.mul_(self.l1_step if sparsity < self.target_sparsity else 1.0 / self.l1_step)

    def active_flops_per_token(self, num_tokens: int) -> dict:
        return {"experts": self.num_experts * ffn_flops(self.dim, self.hidden),
                "routing": 2 * self.dim * self.num_experts}

class SoftMoEFFN(ExpertPool, FFN):
    """Soft-MoE (Puigcerver et al., 2024; google-research/vmoe), App. B adaptation.

    S = E * p slots with parameters Phi (d, S). Logits = l2norm(x) . (scale * l2norm(Phi)) over d
    (the normalisation is for the logits only; experts see the un-normalised tokens), with a
    learnable scalar scale (init 1). Dispatch weights: softmax over the tokens of an image, per slot;
    combine weights: softmax over all slots, per token. Expert e runs on its p slots. No aux loss.
    Per token the experts cost S / T dense FFNs, so U = S / T (the paper sizes S from the patch count).
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, slots_per_expert: int):
        super().__init__(dim, hidden, num_experts)
        self.slots_per_expert = slots_per_expert
        self.slot_embed = nn.Parameter(torch.empty(dim, num_experts * slots_per_expert))  # Phi (d, S)
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
        out = rearrange(self.run_all(slots), "e (b p) d -> b (e p) d", b=u.shape[0])          # (b, S, d)
        return combine.to(out.dtype) @ out                                                      # (b, T, d)

    def active_flops_per_token(self, num_tokens: int) -> dict:
        slots = self.num_experts * self.slots_per_expert
        # logits, dispatch and combine: three (T x d x S) products per image
        return {"experts": slots * ffn_flops(self.dim, self.hidden) / num_tokens, "routing": 6 * self.dim * slots}

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

    def flops_per_token(self) -> int:
        return sum(2 * getattr(self, f"{n}_down").shape[1] * (getattr(self, f"{n}_down").shape[2]
                                                               + getattr(self, f"{n}_up").shape[1])
                   for n in LORA_LAYERS)


class LoRAAttention(Attention):
    """The shared attention with step t's low-rank updates on qkv and proj."""

    def forward(self, x: torch.Tensor, step: int, lora: LayerwiseLoRA) -> torch.Tensor:
        h = self.attend(self.qkv(x) + lora.update("qkv", step, x))                        # (B, T, d)
        return self.proj(h) + lora.update("proj", step, h)


class LoRAMlp(Mlp):
    """The shared dense FFN with step t's low-rank updates on fc1 and fc2."""

    def forward(self, u: torch.Tensor, step: int, lora: LayerwiseLoRA) -> torch.Tensor:
        h = F.gelu(self.fc1(u) + lora.update("fc1", step, u))                              # (B, T, d_ff)
        return self.fc2(h) + lora.update("fc2", step, h)


class LoRABlock(Block):
    """The tied block plus layer-wise LoRA: step t runs W + B_t A_t on qkv, proj, fc1 and fc2.
    One adapter per trained step, so the model runs only at its own depth."""

    def __init__(self, dim: int, heads: int, ffn_dim: int, depth: int, rank: int,
                 layer_scale_init: float | None = None, drop_path: float = 0.0):
        super().__init__(dim, heads, LoRAMlp(dim, ffn_dim), layer_scale_init, drop_path)
        self.attn = LoRAAttention(dim, heads)  # same parameter names as the plain block's
        self.lora = LayerwiseLoRA(dim, ffn_dim, depth, rank)
        self.trained_depth = depth

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        x = x + self.drop_path(self.ls1(self.attn(self.norm1(x), step.t, self.lora)))
        return x + self.drop_path(self.ls2(self.mlp(self.norm2(x), step.t, self.lora)))

    def check_depth(self, depth: int) -> None:
        if depth != self.trained_depth:
            raise ValueError(f"depth={depth}: layer-wise LoRA has one adapter per trained step, so it runs only "
                             f"at its own depth ({self.trained_depth})")

    def begin_forward(self, depth: int, batch: int) -> None:
        self.check_depth(depth)
        super().begin_forward(depth, batch)

    def unrolled_states(self, depth: int, gates: torch.Tensor | None = None) -> list[dict]:
        """Step t: the shared weights plus B_t A_t on qkv, proj, fc1 and fc2 (fp32 sums, cast on loading)."""
        self.check_depth(depth)
        states = [{k: v for k, v in state.items() if not k.startswith("lora.")}
                  for state in super().unrolled_states(depth)]
        for t, state in enumerate(states):
            for name, layer in LORA_LAYERS.items():
                state[f"{layer}.weight"] = state[f"{layer}.weight"].float() + self.lora.delta(t, name)
        return states


# --- registering the comparisons with Part I: ViTConfig.ffn -> the shared block, and their settings' checks ---

def build_lora_block(c: ViTConfig) -> Block:
    return LoRABlock(c.dim, c.heads, c.ffn_dim, c.depth, c.lora_rank, c.layer_scale_init, c.drop_path)

def build_comparison_block(c: ViTConfig) -> Block:
    """The shared block for an input-dependent mechanism (hidden width of each expert: expert_ffn_dim)."""
    hidden, aux = c.expert_ffn_dim, (c.balance_weight, c.z_loss_weight, c.diversity_weight)
    slots = c.slots_per_expert or max(1, round(c.num_patches / 4))
    ffn = {
        "smear": lambda: SmearFFN(c.dim, hidden, c.num_experts),
        "lory": lambda: LoryFFN(c.dim, hidden, c.num_experts),
        "feature": lambda: FeatureOnlyFFN(c.dim, hidden, c.num_experts, aux),
        "deepseek": lambda: DeepSeekV3FFN(c.dim, hidden, c.num_experts, c.top_k, c.shared_experts,
                                          c.bias_update_rate),
        "qwen3": lambda: Qwen3FFN(c.dim, hidden, c.num_experts, c.top_k, c.balance_weight),
        "moeut": lambda: MoEUTFFN(c.dim, hidden, c.num_experts, c.top_k, c.balance_weight),
        "remoe": lambda: ReMoEFFN(c.dim, hidden, c.num_experts, c.remoe_target_sparsity),
        "softmoe": lambda: SoftMoEFFN(c.dim, hidden, c.num_experts, slots),
    }[c.ffn]()
    return Block(c.dim, c.heads, ffn, c.layer_scale_init, c.drop_path)

SHARED_BLOCKS["lora"] = SharedBlock(build_lora_block, depth_programmed=True)
SHARED_BLOCKS.update({name: SharedBlock(build_comparison_block, depth_programmed=False)
                      for name in ("lory", "smear", "feature", "deepseek", "qwen3", "moeut", "remoe", "softmoe")})
FFNS = tuple(SHARED_BLOCKS)  # every value ViTConfig.ffn may take

def check_mechanism_fields(c: ViTConfig) -> None:
    """The ranges of Part II's settings (ViTConfig's last group)."""
    need(c, 1 <= c.top_k <= c.num_experts, "top_k", f"between 1 and num_experts={c.num_experts}")
    need(c, c.shared_experts >= 0, "shared_experts", ">= 0")
    need(c, c.shared_experts == 0 or c.ffn == "deepseek", "shared_experts", "0 unless ffn='deepseek'")
    need(c, c.slots_per_expert >= 0, "slots_per_expert", ">= 0 (0: round(num_patches / 4))")
    need(c, c.bias_update_rate >= 0, "bias_update_rate", ">= 0")
    need(c, 0.0 < c.remoe_target_sparsity < 1.0, "remoe_target_sparsity", "in (0, 1)")
    need(c, 1 <= c.lora_rank <= 2 ** 12, "lora_rank", "in 1..4096")
    need(c, c.shared_experts <= 2 ** 10, "shared_experts", "at most 1024")
    need(c, c.slots_per_expert <= 2 ** 12, "slots_per_expert", "at most 4096")

CONFIG_CHECKS.append(check_mechanism_fields)

# --- the paper's measures of a mechanism: stored expert parameters (Table 8) and budget U (§4.3) ---

def expert_ffn_params(model: nn.Module) -> int:
    """Table 8's count: parameters of every stored expert FFN, routed and shared, P(d, r) each
    (App. B); routers, Soft-MoE slot parameters, LoRA factors and the backbone are not counted.
    A dense FFN (the tied block, a ViT's blocks) counts as one expert."""
    total = 0
    for module in model.modules():
        if isinstance(module, ExpertBank):
            total += sum(p.numel() for p in module.bank())
        elif isinstance(module, Mlp):
            total += sum(p.numel() for p in module.parameters())
    return total

def active_flops_per_token(ffn: FFN, num_tokens: int) -> dict:
    """{"experts", "routing"}: FLOPs per token and step for an image of num_tokens tokens (2 per
    multiply-add of the matmuls); "experts" is what the budget U counts (§4.3). Part I's two FFNs are
    measured here, so that Part I carries no accounting; every Part II mechanism measures itself."""
    if isinstance(ffn, Mlp):
        return {"experts": ffn_flops(ffn.fc1.in_features, ffn.fc1.out_features), "routing": 0}
    if isinstance(ffn, MergedExpertFFN):
        # routing, for one image: psi on s_t (1 -> 16 -> E) and the Eq. 2 merge (E * P multiply-adds)
        router = 2 * (ffn.router[0].out_features + ffn.router[2].in_features * ffn.num_experts)
        merge = 2 * ffn.num_experts * params_per_expert(ffn)
        return {"experts": ffn_flops(ffn.dim, ffn.hidden), "routing": (router + merge) / num_tokens}
    return ffn.active_flops_per_token(num_tokens)

def ffn_budget(model: nn.Module, num_tokens: int | None = None) -> float:
    """Nominal FFN budget U (§4.3): active expert-FFN FLOPs per token and step / one dense FFN's.

    Measured from the FFN's own FLOP count (`active_flops_per_token`) for images of
    num_tokens = 1 + num_patches tokens. Router matmuls, merges and Soft-MoE's dispatch/combine
    are not in U (see "routing"). Soft-MoE's S slots cost S / T FFNs per token, so with the class
    token its U is the paper's (slots / patches) times N / (N + 1).
    """
    c = model.config
    ffn = model.block.mlp if isinstance(model, ReViT) else model.blocks[0].mlp
    flops = active_flops_per_token(ffn, num_tokens or 1 + c.num_patches)
    return flops["experts"] / ffn_flops(c.dim, c.ffn_dim)

# --- for the analysis tools: expert ablation and permutation on a folded model (§5) ---

@torch.no_grad()
def load_merged_ffns(vit: VisionTransformer, merged: tuple) -> None:
    """Block t of a plain ViT gets merged FFN t; `merged` is MergedExpertFFN.merge's four stacks (L, ...)."""
    for block, (fc1_weight, fc1_bias, fc2_weight, fc2_bias) in zip(vit.blocks, zip(*merged)):
        block.mlp.fc1.weight.copy_(fc1_weight)
        block.mlp.fc1.bias.copy_(fc1_bias)
        block.mlp.fc2.weight.copy_(fc2_weight)
        block.mlp.fc2.bias.copy_(fc2_bias)

# --- presets of the comparison (App. B, Tables 8 and 10) ---

# mechanism -> {U: (E routed experts, K active per token (0: not a top-K router), shared experts, ehr)},
# ehr = expert hidden width / d. A ViT FFN has ehr 4, so the experts get expert_ffn_fraction = ehr / 4
# of the preset's ffn_dim at every size. At U = 1, DeepSeek-V3 and Qwen3 route K = 1 expert and
# renormalise its gate to 1, so their routers get no gradient (true to the rules; DeepSeek-V3 still
# balances through its bias, Qwen3 then has no balance loss either).
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
MOE_SIZES = {"s": WIDTHS["s"], "b": WIDTHS["b"], "b14": dict(WIDTHS["b"], patch_size=14),
             "mini": MINI, "mini32": MINI32}

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

PRESETS.update(_moe_presets())


if __name__ == "__main__":  # python revit.py [names...]: parameter counts of the presets (built on the meta device)
    import sys

    names = sys.argv[1:] or [n for n in PRESETS if n.count("-") == 1 or n.endswith(("-e1", "-e8"))]
    print(f"| {'preset':<22} | {'params (M)':>10} | {'expert FFN (M)':>14} | {'U':>5} | {'L':>3} "
          f"| {'d':>5} | {'E / k':>5} |")
    print(f"|{'-' * 24}|{'-' * 12}|{'-' * 16}|{'-' * 7}|{'-' * 5}|{'-' * 7}|{'-' * 7}|")
    for name in names:
        with torch.device("meta"):
            model = create_model(name)
        c = model.config
        ek = {"revit": c.num_experts, "raptor": c.raptor_blocks}.get(c.arch, "")
        budget = f"{ffn_budget(model):.3g}" if c.arch == "revit" else ""
        print(f"| {name:<22} | {model.num_params() / 1e6:>10.2f} | {expert_ffn_params(model) / 1e6:>14.2f} "
              f"| {budget:>5} | {c.depth:>3} | {c.dim:>5} | {ek!s:>5} |")
