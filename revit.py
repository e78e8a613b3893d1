"""reViT: one recurrent ViT block whose FFN is a depth-programmed merge of an expert bank.

Paper: "reViT" (arXiv 2610.12448), §3 and Appendix A; equations restated in SPEC.md Part 1.
Baselines in the same file: the untied ViT of DeiT III and Raptor (k blocks over L steps).

How reViT differs from a standard pre-norm ViT (DeiT III):
- one block (attention + both LayerNorms) is applied L times; there are no per-layer weights;
- the FFN of step t is a weight-space merge of E expert FFNs, with gates from a tiny router
  that sees only the normalised depth s_t = t / (L - 1) (Eq. 1-2), so it is the same for
  every image and every token, and only one dense FFN runs per step whatever E is;
- the depth L is chosen per call: the router is re-sampled on a new grid (§3.2);
- training can drop whole steps per image and renumber the rest (elastic depth, §3.2);
- for a fixed L the L merged FFNs can be cached, or folded into a plain ViT (`fold`);
- three auxiliary losses keep the gates balanced and the experts distinct (Eq. 6, 8, 9);
- no LayerScale in the recurrent block (Eq. 3); DeiT III's untied baseline keeps it.

Read in build order: building blocks -> FFNs behind one interface -> config -> the plain
ViT / Raptor -> reViT -> presets -> fold.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

# --- building blocks (DeiT III numerics: LayerNorm eps 1e-6, qkv bias, trunc-normal 0.02) ---


def init_linear(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = rearrange(self.qkv(x), "b t (three h c) -> three b h t c", three=3, h=self.heads)
        x = F.scaled_dot_product_attention(q, k, v)  # (B, h, T, c), flash/efficient kernels where available
        return self.proj(rearrange(x, "b h t c -> b t (h c)"))


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class DropPath(nn.Module):
    """Stochastic depth on a residual branch (per sample), as DeiT III trains its baseline."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = x.new_empty(x.shape[0], *([1] * (x.ndim - 1))).bernoulli_(1.0 - self.p)
        return x * keep / (1.0 - self.p)


# --- FFNs behind one interface ---
# Every FFN of the shared block takes (u, coords, ctx) and returns tokens of the same shape:
#   u       (b, T, d)  LayerNorm'd tokens of the images that run this step
#   coords  (b,)       each image's normalised depth coordinate s in [0, 1] (None for a plain ViT)
#   ctx     dict       per-forward scratch space: "depth" L, "step" t, "elastic" flag, ...
# prepare(ctx) runs once before the steps and aux_losses(ctx) once after them; this is where a
# mechanism precomputes per-forward state and reports its weighted auxiliary losses.


class Mlp(nn.Module):
    """The dense FFN of a ViT block: fc2(GELU(fc1(u)))."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def prepare(self, ctx: dict) -> None:
        pass

    def forward(self, u: torch.Tensor, coords=None, ctx=None) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(u)))

    def aux_losses(self, ctx: dict) -> dict:
        return {}


def depth_grid(depth: int, device=None) -> torch.Tensor:
    """Eq. 1: s_t = t / (L - 1), t = 0..L-1. Same formula as the renumbered elastic coordinates."""
    return torch.arange(depth, device=device, dtype=torch.float32) / (depth - 1)


def apply_ffn(u, fc1_weight, fc1_bias, fc2_weight, fc2_bias):
    return F.linear(F.gelu(F.linear(u, fc1_weight, fc1_bias)), fc2_weight, fc2_bias)


class MergedExpertFFN(nn.Module):
    """reViT's FFN (paper §3.1): E expert FFNs merged in weight space by a depth router.

    Eq. 1: z_t = psi(s_t), g_t = softmax(z_t / tau), psi = Linear(1,16) -> SiLU -> Linear(16,E).
    Eq. 2: W1_t = sum_e g_te W1_e (same for b1, W2, b2); FFN_t(u) = W2_t GELU(W1_t u + b1_t) + b2_t.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, router_hidden: int = 16,
                 router_temperature: float = 1.0, aux_weights: tuple = (1e-2, 1e-3, 1e-3),
                 merge_cache: bool = True):
        super().__init__()
        self.num_experts, self.temperature = num_experts, router_temperature
        self.balance_weight, self.z_weight, self.diversity_weight = aux_weights
        self.merge_cache = merge_cache
        self.router = nn.Sequential(nn.Linear(1, router_hidden), nn.SiLU(), nn.Linear(router_hidden, num_experts))
        # the expert bank: E complete FFNs, each initialised like a ViT FFN, independently
        self.fc1_weight = nn.Parameter(torch.empty(num_experts, hidden, dim))  # (E, d_ff, d)
        self.fc1_bias = nn.Parameter(torch.zeros(num_experts, hidden))
        self.fc2_weight = nn.Parameter(torch.empty(num_experts, dim, hidden))  # (E, d, d_ff)
        self.fc2_bias = nn.Parameter(torch.zeros(num_experts, dim))
        nn.init.trunc_normal_(self.fc1_weight, std=0.02)
        nn.init.trunc_normal_(self.fc2_weight, std=0.02)
        self._cache_key, self._cache = None, None

    def reset_parameters(self) -> None:
        """Router init after the model-wide Linear init: a zero output layer makes all experts equal."""
        self.router.apply(init_linear)
        nn.init.zeros_(self.router[2].weight)
        nn.init.zeros_(self.router[2].bias)

    def bank(self) -> tuple:
        return self.fc1_weight, self.fc1_bias, self.fc2_weight, self.fc2_bias

    def gate_logits(self, coords: torch.Tensor) -> torch.Tensor:
        """(n,) coordinates -> (n, E) router logits z."""
        return self.router(coords.to(self.router[0].weight.dtype).unsqueeze(-1))

    def gates(self, coords: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.gate_logits(coords).float() / self.temperature, dim=-1)

    def merge(self, gates: torch.Tensor) -> tuple:
        """Eq. 2 for n gate vectors at once: (n, E) -> four stacks of merged tensors (n, ...)."""
        n = gates.shape[0]
        return tuple((gates.to(p.dtype) @ p.flatten(1)).view(n, *p.shape[1:]) for p in self.bank())

    def _version(self) -> tuple:
        # In-place updates (optimizer steps, load_state_dict, .copy_) bump a tensor's version
        # counter; moving the module changes data_ptr. Either invalidates the cache.
        return tuple((p._version, p.data_ptr(), p.dtype) for p in self.parameters())

    def prepare(self, ctx: dict) -> None:
        if ctx["elastic"]:
            return  # images have their own coordinates: merged per coordinate group in forward
        depth = ctx["depth"]
        # Inference without gradients: merge all L FFNs once and reuse them across calls until
        # the weights change. Otherwise merge step by step in forward, so that without a cache
        # only one merged FFN is alive at a time (the bank stays the only large weight).
        cacheable = self.merge_cache and not self.training and not torch.is_grad_enabled()
        if not cacheable:
            ctx["grid_gates"] = self.gates(depth_grid(depth, self.fc1_weight.device))  # (L, E)
            return
        key = (depth, torch.is_autocast_enabled(), self._version())
        if self._cache_key != key:
            self._cache_key, self._cache = None, None  # free the old cache before building the new one
            self._cache = self.merge(self.gates(depth_grid(depth, self.fc1_weight.device)))
            self._cache_key = key
        ctx["merged"] = self._cache

    def forward(self, u: torch.Tensor, coords: torch.Tensor, ctx: dict) -> torch.Tensor:
        t = ctx["step"]
        if "merged" in ctx:  # cached: every image is at grid step t
            return apply_ffn(u, *(w[t] for w in ctx["merged"]))
        if "grid_gates" in ctx:  # every image is at grid step t: merge once for the whole batch
            return apply_ffn(u, *(w[0] for w in self.merge(ctx["grid_gates"][t:t + 1])))
        # Elastic depth: images at this step may sit at different coordinates. Group them by
        # coordinate and run one merged FFN per group, never one weight copy per image.
        values, group = torch.unique(coords, return_inverse=True)
        merged = self.merge(self.gates(values))
        if len(values) == 1:
            return apply_ffn(u, *(w[0] for w in merged))
        order = torch.argsort(group)
        sizes = torch.bincount(group, minlength=len(values)).tolist()
        chunks = u[order].split(sizes)
        y = torch.cat([apply_ffn(chunk, *(w[i] for w in merged)) for i, chunk in enumerate(chunks)])
        return y[torch.argsort(order)]  # back to the batch order

    def aux_losses(self, ctx: dict) -> dict:
        """Eq. 6, 8, 9 on the gates of this forward's grid; all zero-cost to skip for E = 1."""
        if self.num_experts == 1:
            return {}
        z = self.gate_logits(depth_grid(ctx["depth"], self.fc1_weight.device)).float()  # (L, E)
        g = torch.softmax(z / self.temperature, dim=-1)
        entropy = -(g * torch.log(g.clamp_min(1e-12))).sum(-1)
        balance = (1.0 - entropy / math.log(self.num_experts)).mean()          # Eq. 6
        z_loss = torch.logsumexp(z, dim=-1).pow(2).mean()                        # Eq. 8
        return {"balance": self.balance_weight * balance,
                "z_loss": self.z_weight * z_loss,
                "diversity": self.diversity_weight * self.diversity()}

    def diversity(self) -> torch.Tensor:
        """Eq. 9: mean over pairs e < e' of cos^2(vec(theta_e), vec(theta_e')). Pair-mean is our default."""
        theta = torch.cat([p.flatten(1) for p in self.bank()], dim=1).float()  # (E, P)
        theta = F.normalize(theta, dim=1)
        cos = theta @ theta.T
        i, j = torch.triu_indices(self.num_experts, self.num_experts, offset=1, device=cos.device)
        return cos[i, j].pow(2).mean()


class Block(nn.Module):
    """Pre-norm transformer block (Eq. 3): H = X + MHSA(LN(X)); X' = H + FFN(LN(H)).

    Optional LayerScale (DeiT III) and per-sample drop-path on both branches. The FFN is
    any module with the interface above, so the same block serves ViT, Raptor and reViT.
    """

    def __init__(self, dim: int, heads: int, mlp: nn.Module, layer_scale_init: float | None = None,
                 drop_path: float = 0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.ls1 = LayerScale(dim, layer_scale_init) if layer_scale_init is not None else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = mlp
        self.ls2 = LayerScale(dim, layer_scale_init) if layer_scale_init is not None else nn.Identity()
        self.drop_path = DropPath(drop_path)

    def forward(self, x: torch.Tensor, coords=None, ctx=None) -> torch.Tensor:
        x = x + self.drop_path(self.ls1(self.attn(self.norm1(x))))
        return x + self.drop_path(self.ls2(self.mlp(self.norm2(x), coords, ctx)))


# --- config ---

ARCHS = ("vit", "raptor", "revit")


@dataclass
class ViTConfig:
    arch: str = "revit"           # "vit" (untied, DeiT III) | "raptor" (k blocks) | "revit"
    image_size: int = 224
    patch_size: int = 16
    in_channels: int = 3
    num_classes: int = 1000       # 0: no head (features only)
    dim: int = 384                # d
    heads: int = 6
    ffn_dim: int = 1536           # d_ff
    depth: int = 12               # L: blocks of a ViT, steps of Raptor / reViT (reference depth)
    layer_scale_init: float | None = None  # DeiT III uses 1e-4; reViT's Eq. 3 has none
    drop_path: float = 0.0        # per-sample stochastic depth inside each block (DeiT III recipe)
    raptor_blocks: int = 4        # k distinct blocks of Raptor
    num_experts: int = 4          # E of reViT; E = 1 is the plain tied (ALBERT-style) block
    router_hidden: int = 16       # width of psi (Eq. 1)
    router_temperature: float = 1.0
    depth_drop: float = 0.0       # elastic depth (§3.2): per-image whole-step drop rate, training only
    balance_weight: float = 1e-2  # lambda_bal (Table 6)
    z_loss_weight: float = 1e-3   # lambda_z
    diversity_weight: float = 1e-3  # lambda_div
    merge_cache: bool = True      # reuse merged FFNs across inference calls at the same depth

    def __post_init__(self):
        def need(ok, name, allowed):
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} is not allowed: {name} must be {allowed}")
        need(self.arch in ARCHS, "arch", f"one of {ARCHS}")
        for name in ("image_size", "patch_size", "in_channels", "dim", "heads", "ffn_dim"):
            need(getattr(self, name) >= 1, name, "a positive integer")
        need(self.image_size % self.patch_size == 0, "image_size",
             f"a multiple of patch_size={self.patch_size}")
        need(self.dim % self.heads == 0, "dim", f"a multiple of heads={self.heads}")
        need(self.num_classes >= 0, "num_classes", ">= 0")
        need(self.depth >= (2 if self.arch == "revit" else 1), "depth",
             ">= 2 for reViT (s_t = t/(L-1) needs two steps)" if self.arch == "revit" else ">= 1")
        need(self.num_experts >= 1, "num_experts", ">= 1")
        need(1 <= self.raptor_blocks <= self.depth, "raptor_blocks", f"between 1 and depth={self.depth}")
        need(0.0 <= self.depth_drop < 1.0, "depth_drop", "in [0, 1)")
        need(0.0 <= self.drop_path < 1.0, "drop_path", "in [0, 1)")
        need(self.router_temperature > 0, "router_temperature", "> 0")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


# --- shared stem and head ---


class ViTBase(nn.Module):
    """Patch embedding, class token, positions, final norm and head: common to every model here."""

    def __init__(self, config: ViTConfig):
        super().__init__()
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
        """Names excluded from weight decay beyond the 1-D parameters (norms, biases, gammas)."""
        return {"pos_embed", "cls_token"}

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        c = self.config
        if images.ndim != 4 or images.shape[1] != c.in_channels:
            raise ValueError(f"images must have shape (B, {c.in_channels}, {c.image_size}, {c.image_size}); "
                             f"got {tuple(images.shape)} (in_channels={c.in_channels})")
        if images.shape[-2:] != (c.image_size, c.image_size):
            raise ValueError(f"images must be {c.image_size}x{c.image_size} (image_size={c.image_size}); "
                             f"got {images.shape[-2]}x{images.shape[-1]}")
        x = rearrange(self.patch_embed.proj(images), "b d gh gw -> b (gh gw) d")  # (B, N, d)
        x = x + self.pos_embed  # DeiT III: positions go on the patch tokens, not the class token
        return torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)  # (B, 1+N, d)

    def check_depth(self, depth: int | None) -> int:
        if depth is None:
            return self.config.depth
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 2:
            raise ValueError(f"depth must be an integer >= 2; got {depth!r}")
        return depth

    def finish(self, x, states, aux, return_states, extra=None):
        tokens = self.norm(x)
        logits = self.head(tokens[:, 0])
        if not return_states:
            return logits
        out = {"logits": logits, "pre_logits": tokens[:, 0], "tokens": tokens,
               "states": states, "aux_losses": aux}
        out.update(extra or {})
        return out


# --- the plain ViT (DeiT III) and Raptor ---


def raptor_schedule(num_blocks: int, depth: int) -> list[int]:
    """Which block serves each step: contiguous segments, Raptor's own split where it has one.

    Raptor (L=12) lets block i serve 1-based steps t <= thresholds[i]: k=2 -> [7], k=3 -> [7, 10],
    k=4 -> [4, 7, 10]. At another depth the thresholds scale with L; other k split evenly.
    """
    known = {2: [7], 3: [7, 10], 4: [4, 7, 10]}
    if num_blocks in known and depth >= num_blocks:
        ends = [round(th * depth / 12) for th in known[num_blocks]] + [depth]
    else:
        ends = [round((i + 1) * depth / num_blocks) for i in range(num_blocks)]
    schedule, block = [], 0
    for step in range(1, depth + 1):
        while step > ends[block]:
            block += 1
        schedule.append(block)
    return schedule


class VisionTransformer(ViTBase):
    """Untied ViT (arch "vit": L blocks) or Raptor (arch "raptor": k blocks over L steps).

    This class is also what `fold` returns, so a folded reViT runs through plain ViT code.
    """

    def __init__(self, config: ViTConfig):
        super().__init__(config)
        c = config
        num_blocks = c.depth if c.arch == "vit" else c.raptor_blocks
        self.blocks = nn.ModuleList(
            Block(c.dim, c.heads, Mlp(c.dim, c.ffn_dim), c.layer_scale_init, c.drop_path)
            for _ in range(num_blocks))
        self.init_weights()

    def forward(self, images: torch.Tensor, depth: int | None = None, return_states: bool = False):
        c = self.config
        depth = self.check_depth(depth)
        if c.arch == "vit" and depth != c.depth:
            raise ValueError(f"depth={depth}: an untied ViT runs only its own depth ({c.depth}); "
                             "use a Raptor or reViT model for other depths")
        schedule = range(depth) if c.arch == "vit" else raptor_schedule(len(self.blocks), depth)
        x = self.embed(images)
        states = [x]
        for block_index in schedule:
            x = self.blocks[block_index](x)
            states.append(x)
        return self.finish(x, states, {}, return_states)


# --- reViT: one shared block, depth-programmed merged FFN, elastic depth (§3) ---


def elastic_plan(keep: torch.Tensor) -> torch.Tensor:
    """Per-image coordinates of the retained steps (§3.2, SPEC §1.6).

    keep: (B, L) bool, True where the step runs for that image. The n_b retained steps are
    renumbered 0..n_b-1 in execution order and sit at k / (n_b - 1); n_b = 1 gets s = 0.
    Returns (B, L) float coordinates (values at dropped steps are unused).
    """
    rank = keep.long().cumsum(1) - 1                        # (B, L) index among retained steps
    retained = keep.sum(1, keepdim=True)                    # (B, 1) n_b
    return rank.clamp_min(0).float() / (retained - 1).clamp_min(1).float()


class ReViT(ViTBase):
    def __init__(self, config: ViTConfig):
        super().__init__(config)
        c = config
        if c.num_experts == 1:
            ffn = Mlp(c.dim, c.ffn_dim)  # E = 1: the plain tied block, no router
        else:
            ffn = MergedExpertFFN(c.dim, c.ffn_dim, c.num_experts, c.router_hidden, c.router_temperature,
                                  (c.balance_weight, c.z_loss_weight, c.diversity_weight), c.merge_cache)
        self.block = Block(c.dim, c.heads, ffn, c.layer_scale_init, c.drop_path)
        self.init_weights()
        if isinstance(ffn, MergedExpertFFN):
            ffn.reset_parameters()

    def no_weight_decay(self) -> set:
        # The router's output layer starts at zero and sets the depth program; decaying it
        # pulls the gates back towards uniform. (Its bias is 1-D and excluded anyway.)
        names = super().no_weight_decay()
        if isinstance(self.block.mlp, MergedExpertFFN):
            names.add("block.mlp.router.2.weight")
        return names

    def gate_matrix(self, depth: int | None = None) -> torch.Tensor:
        """G [L, E]: the gates of every step at depth L (rows sum to 1). E = 1 gives ones."""
        depth = self.check_depth(depth)
        ffn = self.block.mlp
        if not isinstance(ffn, MergedExpertFFN):
            return torch.ones(depth, 1)
        return ffn.gates(depth_grid(depth, ffn.fc1_weight.device))

    def sample_keep_mask(self, batch: int, depth: int, device) -> torch.Tensor:
        """Elastic depth: drop each whole step of each image independently with rate depth_drop."""
        return torch.rand(batch, depth, device=device) >= self.config.depth_drop

    def forward(self, images: torch.Tensor, depth: int | None = None, return_states: bool = False,
                keep: torch.Tensor | None = None):
        """keep: optional (B, L) bool mask of retained steps; sampled in training when depth_drop > 0."""
        depth = self.check_depth(depth)
        x = self.embed(images)
        if keep is None and self.training and self.config.depth_drop > 0:
            keep = self.sample_keep_mask(x.shape[0], depth, x.device)
        if keep is not None and keep.shape != (x.shape[0], depth):
            raise ValueError(f"keep must have shape (batch, depth) = {(x.shape[0], depth)}; got {tuple(keep.shape)}")
        elastic = keep is not None and not bool(keep.all())
        ctx = {"depth": depth, "elastic": elastic}
        self.block.mlp.prepare(ctx)
        grid = depth_grid(depth, x.device)
        coords = elastic_plan(keep) if elastic else None
        states = [x]
        for t in range(depth):
            ctx["step"] = t
            if not elastic:
                x = self.block(x, grid[t].expand(x.shape[0]), ctx)
            else:
                # run only the images that keep step t: a dropped step costs nothing (identity)
                idx = keep[:, t].nonzero().squeeze(1)
                if len(idx) == x.shape[0]:
                    x = self.block(x, coords[:, t], ctx)
                elif len(idx):
                    x = x.index_copy(0, idx, self.block(x[idx], coords[idx, t], ctx))
            states.append(x)
        aux = self.block.mlp.aux_losses(ctx)
        extra = {"gates": self.gate_matrix(depth)} if return_states else None
        return self.finish(x, states, aux, return_states, extra)


# --- presets (paper Table 1; ImageNet 224²) and small CPU presets of our own ---

WIDTHS = {  # d, heads, d_ff, L (SPEC §1.1)
    "s": dict(dim=384, heads=6, ffn_dim=1536, depth=12),
    "b": dict(dim=768, heads=12, ffn_dim=3072, depth=12),
    "l": dict(dim=1024, heads=16, ffn_dim=4096, depth=24),
}
# Small presets for CPU runs: 28x28x1 (Fashion-MNIST, "-mini") and 32x32x3 (CIFAR, "-mini32").
MINI = dict(image_size=28, patch_size=4, in_channels=1, num_classes=10, dim=96, heads=3, ffn_dim=192, depth=6)
MINI32 = dict(MINI, image_size=32, in_channels=3)


def _build_presets() -> dict:
    presets = {}
    for size, width in [*WIDTHS.items(), ("mini", MINI), ("mini32", MINI32)]:
        patch_sizes = {"": {}} if size.startswith("mini") else {"": {}, "14": {"patch_size": 14}}
        for suffix, patch in patch_sizes.items():
            base = {**width, **patch}
            name = f"{size}{suffix}"
            presets[f"vit-{name}"] = dict(base, arch="vit", layer_scale_init=1e-4)  # DeiT III
            for k in (2, 3, 4):
                raptor = dict(base, arch="raptor", raptor_blocks=k)
                presets[f"raptor-{name}-k{k}"] = raptor
                if k == 4:
                    presets[f"raptor-{name}"] = raptor
            for e in (1, 2, 3, 4, 8):
                revit = dict(base, arch="revit", num_experts=e)
                presets[f"revit-{name}-e{e}"] = revit
                if e == 4:
                    presets[f"revit-{name}"] = revit
    return presets


PRESETS = _build_presets()


def create_model(name: str, **overrides) -> nn.Module:
    """Build a preset by name, e.g. create_model("revit-s", depth_drop=0.3)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset name={name!r}; choose one of: {', '.join(sorted(PRESETS))}")
    allowed = {f.name for f in fields(ViTConfig)}
    unknown = sorted(set(overrides) - allowed)
    if unknown:
        raise ValueError(f"unknown config field(s) {unknown}; allowed fields: {', '.join(sorted(allowed))}")
    config = ViTConfig(**{**PRESETS[name], **overrides})
    return ReViT(config) if config.arch == "revit" else VisionTransformer(config)


def config_dict(model: nn.Module) -> dict:
    return asdict(model.config)


# --- fold: a fixed depth becomes a plain ViT (§3.1, SPEC §1.7) ---


@torch.no_grad()
def fold(model: nn.Module, depth: int | None = None) -> VisionTransformer:
    """Return a plain untied ViT of `depth` blocks with the same outputs as `model` at that depth.

    Works for reViT (shared attention copied into every block, merged FFN t in block t; the
    router and the bank disappear) and for Raptor (block j copied into each step it serves).
    """
    if not isinstance(model, ReViT) and not (isinstance(model, VisionTransformer) and model.config.arch == "raptor"):
        raise ValueError("fold(model) expects a reViT or Raptor model; a plain ViT is already folded")
    depth = model.check_depth(depth)
    config = replace(model.config, arch="vit", depth=depth, depth_drop=0.0, raptor_blocks=1)
    vit = VisionTransformer(config).to(next(model.parameters()).device)
    for name in ("patch_embed", "norm", "head"):
        getattr(vit, name).load_state_dict(getattr(model, name).state_dict())
    vit.cls_token.copy_(model.cls_token)
    vit.pos_embed.copy_(model.pos_embed)
    if isinstance(model, ReViT):
        sources = [model.block] * depth
    else:
        sources = [model.blocks[j] for j in raptor_schedule(len(model.blocks), depth)]
    ffn = sources[0].mlp
    merged = ffn.merge(ffn.gates(depth_grid(depth, ffn.fc1_weight.device))) if isinstance(ffn, MergedExpertFFN) else None
    for t, (block, source) in enumerate(zip(vit.blocks, sources)):
        for name in ("norm1", "attn", "ls1", "norm2", "ls2"):
            getattr(block, name).load_state_dict(getattr(source, name).state_dict())
        if merged is None:
            block.mlp.load_state_dict(source.mlp.state_dict())
        else:
            fc1_weight, fc1_bias, fc2_weight, fc2_bias = (w[t] for w in merged)
            block.mlp.fc1.weight.copy_(fc1_weight)
            block.mlp.fc1.bias.copy_(fc1_bias)
            block.mlp.fc2.weight.copy_(fc2_weight)
            block.mlp.fc2.bias.copy_(fc2_bias)
    return vit.train(model.training)


if __name__ == "__main__":  # python revit.py [names...]: parameter counts of the presets (built on the meta device)
    import sys

    names = sys.argv[1:] or [n for n in PRESETS if n.count("-") == 1 or n.endswith(("-e1", "-e8"))]
    print(f"| {'preset':<18} | {'params (M)':>10} | {'L':>3} | {'d':>5} | {'E / k':>5} |")
    print(f"|{'-' * 20}|{'-' * 12}|{'-' * 5}|{'-' * 7}|{'-' * 7}|")
    for name in names:
        with torch.device("meta"):
            model = create_model(name)
        c = model.config
        ek = {"revit": c.num_experts, "raptor": c.raptor_blocks}.get(c.arch, "")
        print(f"| {name:<18} | {model.num_params() / 1e6:>10.2f} | {c.depth:>3} | {c.dim:>5} | {ek!s:>5} |")
