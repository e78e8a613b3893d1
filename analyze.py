"""What does the recurrent block learn? The analyses of the reViT paper's §5 and Appendix D (SPEC §1.10).

    python analyze.py runs/revit-mini/ckpt.pt --teacher runs/vit-mini/ckpt.pt --out analysis/

For a checkpoint of this project (the CKA parts also work for a ViT or Raptor checkpoint):
- the gate matrix G [L, E] at any depth and its dominant-expert path (Fig. 3);
- effective ranks of W1_bank [E, P], G, W1_traj = G W1_bank and their depth-centred versions (Fig. 5);
- linear CKA (Kornblith et al., 2019) of mean-pooled patch-token residual states, after the embedding
  and after every step: self-CKA [L+1, L+1] (Figs. 7-8) and, with --teacher, cross-CKA against the
  teacher's states with the max-CKA path, its Spearman rho and its mean absolute deviation (MAD)
  from proportional depth (Fig. 9);
- expert ablations (one gate column zeroed at every depth, rows renormalised) against random gate
  perturbations of the same Frobenius displacement of the merged FFN weights (Figs. 4, 10a), and
  gate-column permutations (Fig. 10b), each as Delta CKA to the teacher's final features.

Images are a seeded subset of the test split (Fashion-MNIST by default, or the checkpoint's data set).
A model under modified gates is the folded ViT (`revit.fold`) with the merged FFNs of those gates
(`MergedExpertFFN.merge`), so no forward pass is copied here. Outputs in --out: analysis.json (every
number), gates.csv, self_cka.csv, cross_cka.csv, and PNG heat maps when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
from pathlib import Path

import torch

import revit
import train
from data import BUILTIN, NORMALISATION, FolderImages, load_images


def fail(message: str):
    """A user error: one clear line on stderr, non-zero exit."""
    raise SystemExit(f"analyze.py: error: {message}")


# --- measures: effective rank, linear CKA, Spearman rho ---


def effective_rank(matrix: torch.Tensor) -> float:
    """SPEC §1.10: r_eff = exp(-sum_i p_i log p_i), p_i = sigma_i^2 / sum_j sigma_j^2 (0 for a zero matrix)."""
    energy = torch.linalg.svdvals(matrix.double()).square()
    if energy.sum() == 0:
        return 0.0
    p = energy / energy.sum()
    p = p[p > 0]  # 0 log 0 = 0
    return math.exp(-(p * p.log()).sum().item())


def centre_depth(matrix: torch.Tensor) -> torch.Tensor:
    """C M with C = I - 11^T / L: remove the component shared by all L depths (rows)."""
    return matrix - matrix.mean(0, keepdim=True)


def linear_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """Linear CKA of features x (n, p) and y (n, q) of the same n inputs:
    ||Yc^T Xc||_F^2 / (||Xc^T Xc||_F ||Yc^T Yc||_F), columns centred (Kornblith et al., 2019)."""
    return cka_matrix(x[None], y[None])[0, 0].item()


def cka_matrix(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """Linear CKA of every pair: xs (A, n, p), ys (B, n, q) -> (A, B)."""
    xs = xs.double() - xs.double().mean(1, keepdim=True)  # centre each feature over the n inputs
    ys = ys.double() - ys.double().mean(1, keepdim=True)
    x_norm = torch.stack([(x.T @ x).norm() for x in xs])  # (A,) ||Xc^T Xc||_F
    y_norm = torch.stack([(y.T @ y).norm() for y in ys])  # (B,)
    hsic = torch.stack([torch.stack([(y.T @ x).square().sum() for y in ys]) for x in xs])  # (A, B)
    return hsic / (x_norm[:, None] * y_norm[None, :])


def average_ranks(values: torch.Tensor) -> torch.Tensor:
    """Ranks 0..n-1 of values, ties sharing their mean rank (as Spearman's rho needs)."""
    values = values.double()
    ranks = torch.empty_like(values)
    ranks[values.argsort()] = torch.arange(len(values), dtype=torch.float64)
    for v in values.unique():
        tied = values == v
        ranks[tied] = ranks[tied].mean()
    return ranks


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rho: Pearson correlation of the average ranks (nan when either side is constant)."""
    ra, rb = average_ranks(a), average_ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = (ra.norm() * rb.norm()).item()
    return (ra @ rb).item() / denominator if denominator > 0 else float("nan")


# --- the expert bank and the gate program (Figs. 3, 5) ---


def has_gate_program(model) -> bool:
    """A reViT whose FFN is the depth-programmed merge (any E; E = 1 is the tied block, G = ones).
    Content-routed FFNs have no depth-only gates, and layer-wise LoRA has no expert bank."""
    return isinstance(model, revit.ReViT) and getattr(model.config, "ffn", "merge") == "merge"


def is_merged(model) -> bool:
    """A gate program with E >= 2 experts: the ablations and permutations apply."""
    return has_gate_program(model) and isinstance(model.block.mlp, revit.MergedExpertFFN)


def expert_bank(model) -> tuple:
    """reViT's four bank tensors (E, ...); E = 1 (a plain tied Mlp) as a bank of one expert."""
    ffn = model.block.mlp
    if hasattr(ffn, "bank"):
        return ffn.bank()
    return ffn.fc1.weight[None], ffn.fc1.bias[None], ffn.fc2.weight[None], ffn.fc2.bias[None]


def gate_program(model, depth: int) -> dict:
    """G [L, E], its dominant-expert path (Fig. 3), and where in depth each expert is used."""
    gates = model.gate_matrix(depth).detach().double().cpu()  # (L, E)
    s = revit.depth_grid(depth).double()  # (L,) Eq. 1
    dominant = gates.argmax(1)
    usage = gates.sum(0)  # (E,)
    return {"depth": depth, "num_experts": gates.shape[1], "coordinates": s.tolist(), "gates": gates.tolist(),
            "dominant_expert": dominant.tolist(),
            "switches": int((dominant[1:] != dominant[:-1]).sum()),
            "mean_gate": (usage / depth).tolist(),
            # gate-weighted mean coordinate of each expert: early (0) .. late (1) in the schedule
            "centroid_coordinate": ((gates * s[:, None]).sum(0) / usage.clamp_min(1e-12)).tolist()}


def effective_ranks(model, gates: torch.Tensor) -> dict:
    """Fig. 5 / App. D: r_eff of W1_bank [E, P] (P = d_ff d), G [L, E], W1_traj = G W1_bank [L, P],
    and of the depth-centred G_c = C G and W1_traj,c = C W1_traj (rank <= E - 1: rows of G sum to 1)."""
    w1_bank = expert_bank(model)[0].detach().double().cpu().flatten(1)  # (E, d_ff * d)
    gates = gates.double()
    w1_traj = gates @ w1_bank  # (L, P): row t is vec(merged W1 of step t)
    return {"W1_bank": effective_rank(w1_bank), "G": effective_rank(gates), "W1_traj": effective_rank(w1_traj),
            "G_centred": effective_rank(centre_depth(gates)),
            "W1_traj_centred": effective_rank(centre_depth(w1_traj)), "num_experts": gates.shape[1]}


# --- modified gate programs: ablation, permutation, matched random perturbation (Figs. 4, 10) ---


def ablate_experts(gates: torch.Tensor, experts) -> torch.Tensor:
    """Zero the gate columns of `experts` at every depth and renormalise each row to sum to 1."""
    kept = gates.clone()
    kept[:, list(experts)] = 0
    return kept / kept.sum(1, keepdim=True)


def permute_gates(gates: torch.Tensor, permutation) -> torch.Tensor:
    """Expert e receives the gate column permutation[e]: the bank stays, the assignment changes."""
    return gates[:, list(permutation)]


def gate_permutations(num_experts: int, limit: int, generator: torch.Generator) -> list[tuple]:
    """Every non-identity permutation for E <= 4; otherwise `limit` distinct ones drawn with `generator`."""
    identity = tuple(range(num_experts))
    if num_experts <= 4:
        return [p for p in itertools.permutations(identity) if p != identity]
    limit = min(limit, math.factorial(num_experts) - 1)
    chosen = []
    while len(chosen) < limit:
        p = tuple(torch.randperm(num_experts, generator=generator).tolist())
        if p != identity and p not in chosen:
            chosen.append(p)
    return chosen


def bank_gram(model) -> torch.Tensor:
    """K = Theta Theta^T [E, E], Theta [E, P_all] = every bank tensor of each expert, flattened.
    The merge is linear (Eq. 2), so the merged weights of all L steps move by ||dG Theta||_F = sqrt(tr(dG K dG^T))."""
    theta = torch.cat([p.detach().double().cpu().flatten(1) for p in expert_bank(model)], dim=1)
    return theta @ theta.T


def merged_displacement(delta_gates: torch.Tensor, gram: torch.Tensor) -> float:
    """Frobenius displacement of the merged FFN weights (W1, b1, W2, b2 of all L steps) for a gate change."""
    delta_gates = delta_gates.double()
    return ((delta_gates @ gram) * delta_gates).sum().clamp_min(0).sqrt().item()


def matched_perturbation(gates: torch.Tensor, gram: torch.Tensor, target: float, generator: torch.Generator,
                         tries: int = 8) -> torch.Tensor | None:
    """A random gate matrix whose merged FFN weights are `target` (Frobenius) away from those of `gates`.

    Ambiguity: the paper does not say how its random perturbations are drawn. Default: Gaussian noise
    on the log-gates, G' = softmax(log G + a N), with the scale a found by bisection, so that G' is a
    gate matrix (rows on the simplex) like an ablation. None if no draw reaches the target.
    """
    log_gates = gates.double().log()
    for _ in range(tries):
        noise = torch.randn(gates.shape, generator=generator, dtype=torch.float64)

        def displacement(scale):
            return merged_displacement(torch.softmax(log_gates + scale * noise, -1) - gates.double(), gram)

        low, high = 0.0, 1.0
        while displacement(high) < target and high < 1e4:
            low, high = high, 2 * high
        if displacement(high) < target:
            continue  # this noise saturates below the target: draw again
        for _ in range(60):
            middle = (low + high) / 2
            low, high = (middle, high) if displacement(middle) < target else (low, middle)
        return torch.softmax(log_gates + high * noise, -1).to(gates.dtype)
    return None


@torch.no_grad()
# --- features: the residual stream of out["states"] ---


@torch.no_grad()
def residual_features(model, images: torch.Tensor, depth: int | None = None, batch_size: int = 256) -> torch.Tensor:
    """Mean-pooled patch tokens of the L+1 residual states (after the embedding and after every step,
    before the final LayerNorm; class token removed): (L+1, n, d) float32 on the CPU."""
    device = next(model.parameters()).device
    kwargs = {} if depth is None else {"depth": depth}
    chunks = []
    for x in images.split(batch_size):
        states = model(x.to(device), return_states=True, **kwargs)["states"]  # L+1 x (b, 1+N, d)
        chunks.append(torch.stack([s[:, 1:].mean(1) for s in states]).float().cpu())  # (L+1, b, d)
    return torch.cat(chunks, dim=1)


def depth_alignment(cross: torch.Tensor) -> dict:
    """Fig. 9: for each student state i (0..L) the teacher state of maximal CKA, against proportional
    depth i L_T / L in teacher-layer units; plus the max(CKA, 0)^4-weighted mean teacher depth and std."""
    student_steps, teacher_steps = cross.shape[0] - 1, cross.shape[1] - 1
    path = cross.argmax(1).double()  # (L+1,)
    steps = torch.arange(student_steps + 1, dtype=torch.float64)
    proportional = steps * teacher_steps / student_steps
    deviation = (path - proportional).abs()
    weights = cross.double().clamp_min(0) ** 4
    weights = weights / weights.sum(1, keepdim=True).clamp_min(1e-300)
    layers = torch.arange(teacher_steps + 1, dtype=torch.float64)
    mean = weights @ layers
    std = (weights @ layers.square() - mean.square()).clamp_min(0).sqrt()
    return {"max_cka_path": path.long().tolist(), "proportional_depth": proportional.tolist(),
            "spearman_rho": spearman(steps, path), "mad": deviation.mean().item(),
            "interior_mad": deviation[1:-1].mean().item() if student_steps > 1 else float("nan"),
            "weighted_mean_depth": mean.tolist(), "weighted_std_depth": std.tolist()}


def intervention_analysis(model, gates, images, reference, num_random, num_permutations, seed, batch_size) -> dict:
    """Figs. 4 and 10: Delta CKA to the reference features for each expert ablation (with matched random
    perturbations) and each gate-column permutation. Delta = CKA(modified) - CKA(intact)."""
    vit = revit.fold(model, gates=gates)
    generator = torch.Generator().manual_seed(seed)

    def cka_to_reference(modified_gates):
        revit.load_merged_ffns(vit, model.block.mlp.merge(modified_gates))
        return linear_cka(residual_features(vit, images, batch_size=batch_size)[-1], reference)

    intact = cka_to_reference(gates)
    gram = bank_gram(model)
    merged_norm = merged_displacement(gates, gram)  # ||G Theta||_F: the size of the merged weights themselves
    ablations = []
    for expert in range(gates.shape[1]):
        ablated = ablate_experts(gates, [expert])
        displacement = merged_displacement(ablated - gates, gram)
        random_deltas = []
        for _ in range(num_random):
            perturbed = matched_perturbation(gates, gram, displacement, generator)
            if perturbed is not None:
                random_deltas.append(cka_to_reference(perturbed) - intact)
        delta = cka_to_reference(ablated) - intact
        randoms = torch.tensor(random_deltas, dtype=torch.float64)
        ablations.append({
            "expert": expert, "delta_cka": delta, "displacement": displacement,
            "relative_displacement": displacement / merged_norm if merged_norm else float("nan"),
            "random_delta_cka": random_deltas,
            "random_mean": randoms.mean().item() if len(randoms) else float("nan"),
            "random_std": randoms.std().item() if len(randoms) > 1 else float("nan"),
            # share of matched random perturbations that hurt more than this ablation
            "fraction_random_worse": (randoms < delta).double().mean().item() if len(randoms) else float("nan")})
    permutations = [{"permutation": list(p), "delta_cka": cka_to_reference(permute_gates(gates, p)) - intact}
                    for p in gate_permutations(gates.shape[1], num_permutations, generator)]
    deltas = torch.tensor([p["delta_cka"] for p in permutations], dtype=torch.float64)
    return {"intact_cka": intact, "num_images": len(images), "ablations": ablations, "permutations": permutations,
            "permutation_summary": {
                "count": len(permutations),
                "mean_delta_cka": deltas.mean().item() if len(deltas) else float("nan"),
                "max_delta_cka": deltas.max().item() if len(deltas) else float("nan"),
                "num_at_or_above_intact": int((deltas >= 0).sum())}}


# --- checkpoints and data (train.py's loaders) ---


def load_checkpoint(path: str, device) -> tuple:
    if not Path(path).is_file():
        fail(f"{path}: no such checkpoint file")
    try:
        model, ckpt = train.load_model(path, device)
    except Exception as e:  # noqa: BLE001 -- any unreadable file is a user error here
        fail(f"{path} is not a usable checkpoint of this project: {e}")
    if not isinstance(model, (revit.ReViT, revit.VisionTransformer)):
        fail(f"{path} holds a {ckpt['arch']} model; analyze.py reads vision checkpoints (reViT, ViT, Raptor)")
    return model, ckpt


def evaluation_images(args, ckpt: dict, config) -> torch.Tensor:
    """A seeded subset of the test split, normalised as in training: (n, C, H, W) float32."""
    dataset = args.dataset or ckpt.get("train_config", {}).get("dataset") or "fashion-mnist"
    if dataset == "imagenet":  # only the val split: resize the short side, centre crop (as train.py evaluates)
        root = Path(args.data or ckpt.get("train_config", {}).get("data", ""))
        if not (root / "val").is_dir():
            fail(f"--dataset imagenet needs --data ROOT with val/ (ImageFolder layout); got {str(root)!r}")
        test = FolderImages(root / "val", config.image_size, train=False, workers=4)
    elif dataset in BUILTIN and dataset != "tinyshakespeare":
        try:
            test = load_images(dataset, data_dir=args.data_dir).test
        except (ValueError, FileNotFoundError) as e:
            fail(str(e))
    else:
        fail(f"--dataset must be one of fashion-mnist, cifar10, cifar100, imagenet; got {dataset!r}")
    mean, std = NORMALISATION[dataset]
    generator = torch.Generator().manual_seed(args.seed)
    index = torch.randperm(len(test), generator=generator)[:args.num_images]
    images, _ = next(iter(test.batches([index])))  # uint8 (n, C, H, W)
    if (images.shape[1], images.shape[-1]) != (config.in_channels, config.image_size):
        fail(f"the model expects {config.in_channels}x{config.image_size}² images; {dataset} has "
             f"{images.shape[1]}x{images.shape[-1]}² (choose the data set it was trained on with --dataset)")
    return (images.float() / 255 - torch.tensor(mean).view(1, -1, 1, 1)) / torch.tensor(std).view(1, -1, 1, 1)


# --- output: tables on stdout, JSON / CSV, optional heat maps ---


def print_matrix(title: str, matrix, row_name: str, col_name: str, digits: int = 2) -> None:
    matrix = torch.as_tensor(matrix)
    width = digits + 4
    print(f"\n{title}  (rows: {row_name}, columns: {col_name})")
    print(" " * 4 + "".join(f"{j:>{width}}" for j in range(matrix.shape[1])))
    for i, row in enumerate(matrix.tolist()):
        print(f"{i:>4}" + "".join(f"{v:>{width}.{digits}f}" for v in row))


def write_csv(path: Path, header: list, rows: list) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


def json_ready(value):
    """nan / inf -> null, so analysis.json is strict JSON."""
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def save_plots(report: dict, out: Path) -> list[str]:
    """Heat maps of G with the dominant-expert path (Fig. 3), self-CKA (Figs. 7-8) and cross-CKA with the
    max-CKA path and proportional depth (Fig. 9). matplotlib is optional: without it, a note and no PNG."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        print("note: matplotlib is not installed, so no PNG heat maps (pip install matplotlib); "
              "the numbers are in analysis.json and the CSV files")
        return []
    saved = []

    def heat_map(name, matrix, xlabel, ylabel, title, lines=()):
        fig, ax = plt.subplots(figsize=(5, 4))
        # gates and CKA both lie in [0, 1]: one fixed colour scale, comparable across models
        image = ax.imshow(matrix, origin="lower", aspect="auto", cmap="magma_r", interpolation="nearest",
                          vmin=0, vmax=1)
        fig.colorbar(image, ax=ax)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        for xs, ys, style, label in lines:
            ax.plot(xs, ys, style, label=label)
        if lines:
            ax.legend(loc="upper left", fontsize=7)
        ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        saved.append(name)

    if "gates" in report:
        g = report["gates"]
        steps = list(range(g["depth"]))
        heat_map("gates.png", torch.tensor(g["gates"]).T, "depth step t", "expert e",
                 f"gates g[t, e], L={g['depth']}, E={g['num_experts']}",
                 [(steps, g["dominant_expert"], "-o", "dominant expert")])
    heat_map("self_cka.png", report["self_cka"], "state", "state", "self-CKA (mean-pooled patch tokens)")
    if "cross_cka" in report:
        a = report["depth_alignment"]
        steps = list(range(len(a["max_cka_path"])))
        heat_map("cross_cka.png", report["cross_cka"], "teacher state", "student state",
                 f"cross-CKA, rho={a['spearman_rho']:.3f}, MAD={a['mad']:.2f}",
                 [(a["max_cka_path"], steps, "o:", "max-CKA teacher depth"),
                  (a["proportional_depth"], steps, "--", "proportional depth")])
    return saved


# --- the command ---


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="checkpoint of this project (train.py's ckpt.pt): reViT, ViT or Raptor")
    parser.add_argument("--teacher", default="", help="checkpoint whose residual states and final features the "
                        "student is compared with (cross-CKA, Delta CKA); without it, interventions are "
                        "measured against the intact student's own final features")
    parser.add_argument("--depth", type=int, default=None, help="depth L to analyse (reViT/Raptor; "
                        "default: the checkpoint's reference depth)")
    parser.add_argument("--out", default="", help="output folder (default: analysis/ next to the checkpoint)")
    parser.add_argument("--dataset", default="", help="fashion-mnist | cifar10 | cifar100 | imagenet "
                        "(default: the data set the checkpoint was trained on)")
    parser.add_argument("--data-dir", default="", help="where the built-in data sets live (default: ./data, "
                        "then $REVIT_DATA_DIR, then /usr/share/datasets); never downloads")
    parser.add_argument("--data", default="", help="imagenet only: ImageFolder root holding val/")
    parser.add_argument("--num-images", type=int, default=1000, help="seeded test subset for CKA (paper: 1000)")
    parser.add_argument("--intervention-images", type=int, default=256,
                        help="first N of that subset for ablations and permutations (paper: 256)")
    parser.add_argument("--random-perturbations", type=int, default=64,
                        help="matched random gate perturbations per expert ablation (paper: 64)")
    parser.add_argument("--num-permutations", type=int, default=64,
                        help="gate-column permutations sampled when E > 4 (all 23 non-identity ones for E = 4)")
    parser.add_argument("--no-interventions", action="store_true", help="skip ablations and permutations")
    parser.add_argument("--seed", type=int, default=0, help="seed of the image subset, permutations and perturbations")
    parser.add_argument("--batch-size", type=int, default=256, help="images per forward pass")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    return parser


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    for name in ("num_images", "intervention_images", "batch_size"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if args.num_images < 2:
        fail("--num-images must be >= 2 (CKA centres over the images)")
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    model, ckpt = load_checkpoint(args.checkpoint, device)
    config = model.config
    if config.arch == "vit" and args.depth not in (None, config.depth):
        fail(f"--depth {args.depth}: a plain ViT runs only its own depth ({config.depth})")
    depth = config.depth if args.depth is None else args.depth
    if depth < 2:
        fail(f"--depth must be >= 2; got {depth}")
    out = Path(args.out) if args.out else Path(args.checkpoint).resolve().parent / "analysis"
    out.mkdir(parents=True, exist_ok=True)
    report = {"checkpoint": str(args.checkpoint), "arch": ckpt["arch"], "depth": depth, "seed": args.seed}
    print(f"{args.checkpoint}: {ckpt['arch']} ({config.arch}), {model.num_params() / 1e6:.3f}M params, "
          f"analysed at depth L={depth}")

    if has_gate_program(model):
        gates = model.gate_matrix(depth).detach().float().cpu()  # (L, E)
        report["gates"] = gate_program(model, depth)
        report["effective_ranks"] = effective_ranks(model, gates)
        g = report["gates"]
        print_matrix(f"gate matrix G [L={depth}, E={g['num_experts']}]", gates, "step t", "expert e", 3)
        print(f"dominant expert per step: {g['dominant_expert']} ({g['switches']} switches)")
        print("effective ranks: " + ", ".join(f"{k} {v:.3f}" for k, v in report["effective_ranks"].items()
                                              if k != "num_experts") + f"  (E = {g['num_experts']})")
        write_csv(out / "gates.csv", ["step", "s"] + [f"expert_{e}" for e in range(g["num_experts"])] + ["dominant"],
                  [[t, s, *row, d] for t, (s, row, d) in
                   enumerate(zip(g["coordinates"], g["gates"], g["dominant_expert"]))])

    elif isinstance(model, revit.ReViT):
        print(f"note: ffn={config.ffn!r} has no depth-only gate program over an expert bank: "
              "gates, effective ranks, ablations and permutations are skipped")

    images = evaluation_images(args, ckpt, config)
    recurrent = config.arch != "vit"
    try:
        states = residual_features(model, images, depth if recurrent else None, args.batch_size)  # (L+1, n, d)
    except ValueError as e:  # e.g. layer-wise LoRA runs only at its trained depth
        fail(f"cannot run {ckpt['arch']} at depth {depth}: {e}")
    report["num_images"] = len(images)
    report["self_cka"] = cka_matrix(states, states).tolist()
    print_matrix(f"self-CKA of the {depth + 1} residual states ({len(images)} images)", report["self_cka"],
                 "state", "state")
    write_csv(out / "self_cka.csv", ["state"] + list(range(depth + 1)),
              [[i, *row] for i, row in enumerate(report["self_cka"])])

    reference = states[-1]  # without a teacher: the intact student's own final features
    if args.teacher:
        teacher, teacher_ckpt = load_checkpoint(args.teacher, device)
        tc = teacher.config
        if (tc.in_channels, tc.image_size) != (config.in_channels, config.image_size):
            fail(f"the teacher expects {tc.in_channels}x{tc.image_size}² images, the student "
                 f"{config.in_channels}x{config.image_size}²")
        teacher_states = residual_features(teacher, images, None, args.batch_size)  # (L_T+1, n, d_T)
        cross = cka_matrix(states, teacher_states)
        report["teacher"] = {"checkpoint": str(args.teacher), "arch": teacher_ckpt["arch"], "depth": tc.depth}
        report["cross_cka"] = cross.tolist()
        report["depth_alignment"] = depth_alignment(cross)
        reference = teacher_states[-1]
        a = report["depth_alignment"]
        print_matrix(f"cross-CKA student x teacher ({teacher_ckpt['arch']}, {tc.depth} layers)", cross,
                     "student state", "teacher state")
        print(f"max-CKA teacher state per student state: {a['max_cka_path']}")
        print(f"Spearman rho {a['spearman_rho']:.3f} | MAD from proportional depth {a['mad']:.2f} teacher layers "
              f"(interior {a['interior_mad']:.2f})")
        write_csv(out / "cross_cka.csv", ["student_state"] + list(range(tc.depth + 1)),
                  [[i, *row] for i, row in enumerate(report["cross_cka"])])

    if is_merged(model) and not args.no_interventions:
        n = min(args.intervention_images, len(images))
        if n < 2:
            fail("--intervention-images must be >= 2")
        result = intervention_analysis(model, gates, images[:n], reference[:n], args.random_perturbations,
                                       args.num_permutations, args.seed, args.batch_size)
        result["reference"] = "teacher final state" if args.teacher else "intact student final state (no --teacher)"
        report["interventions"] = result
        print(f"\nexpert ablations ({n} images; Delta CKA to the {result['reference']}, intact CKA "
              f"{result['intact_cka']:.4f})")
        print(f"{'expert':>6} {'mean gate':>9} {'centroid s':>10} {'rel. disp.':>10} {'dCKA':>8} "
              f"{'random dCKA (mean ± std)':>26} {'random worse':>12}")
        for row in result["ablations"]:
            e = row["expert"]
            print(f"{e:>6} {g['mean_gate'][e]:>9.3f} {g['centroid_coordinate'][e]:>10.3f} "
                  f"{row['relative_displacement']:>10.3f} {row['delta_cka']:>+8.4f} "
                  f"{row['random_mean']:>+17.4f} ± {row['random_std']:<6.4f} {row['fraction_random_worse']:>12.2f}")
        ps = result["permutation_summary"]
        print(f"gate-column permutations: {ps['count']} non-identity, mean Delta CKA {ps['mean_delta_cka']:+.4f}, "
              f"best {ps['max_delta_cka']:+.4f}, {ps['num_at_or_above_intact']} at or above the learned assignment")

    report["plots"] = save_plots(report, out)
    with open(out / "analysis.json", "w") as f:
        json.dump(json_ready(report), f, indent=1)
    print(f"\nwrote {out / 'analysis.json'}, " + ", ".join(p.name for p in sorted(out.glob("*.csv")))
          + "".join(f", {p}" for p in report["plots"]))
    return report


if __name__ == "__main__":
    main()
