"""What does the recurrent block learn? The analyses of reViT (arXiv 2610.12448), §5 and Appendix D.

    python -m tools.analyze runs/revit-mini/ckpt.pt --teacher runs/vit-mini/ckpt.pt --out analysis/

On a seeded subset of the test images: the gate matrix G [L, E] at any depth and its dominant-expert
path (Fig. 3); effective ranks of W1_bank, G, W1_traj = G W1_bank and their depth-centred versions
(Fig. 5); linear CKA of the residual states, self-CKA (Figs. 7-8) and with --teacher cross-CKA and
its alignment with proportional depth (Fig. 9); expert ablations against matched random gate
perturbations, and gate-column permutations, as Delta CKA (Figs. 4, 10), each run as the folded ViT
of its gates (`revit.fold`); and (ours) the task's gradients on the gates, experts and psi. The CKA
parts also take a ViT or Raptor. --out gets analysis.json (every number), gates.csv, self_cka.csv,
cross_cka.csv and, with matplotlib, the figures.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

if not __package__:  # run as a file (python tools/analyze.py): the project's modules are not on the path
    sys.exit("tools/analyze.py: error: run it from the repository root as python -m tools.analyze")

import revit
from lib.checkpoint import load_vision_model
from lib.boundary import MAX_DEPTH, check_numbers, closed, fail, outputs_problem, path_problem
from lib.cli import (ArgumentParser, atomic_write, atomic_write_text, finite_or_null, pick_device, pyplot,
                     run_main)
from lib.data import IMAGE_DATASETS, NORMALISATION, FolderImages, load_images
from tools.plot import save_png

PROG = "python -m tools.analyze"  # how it runs: from the repository root, as a module
OUTPUT_FILES = ("analysis.json", "gates.csv", "self_cka.csv", "cross_cka.csv", "gates.png", "self_cka.png",
                "cross_cka.png")  # all it writes into --out (write_outputs)


# --- measures: effective rank, linear CKA, Spearman rho ---


def effective_rank(matrix: torch.Tensor) -> float:
    """App. D: r_eff = exp(-sum_i p_i log p_i), p_i = sigma_i^2 / sum_j sigma_j^2 (0 for a zero matrix)."""
    energy = torch.linalg.svdvals(matrix.double()).square()
    if energy.sum() == 0:
        return 0.0
    p = energy / energy.sum()
    p = p[p > 0]  # 0 log 0 = 0
    return math.exp(-(p * p.log()).sum().item())


def centre_depth(matrix: torch.Tensor) -> torch.Tensor:
    """App. D: C M with C = I - 11^T / L removes the component shared by all L depths (rows)."""
    return matrix - matrix.mean(0, keepdim=True)


def linear_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """Linear CKA of features x (n, p) and y (n, q) of the same n inputs."""
    return cka_matrix(x[None], y[None])[0, 0].item()


def cka_matrix(xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """Linear CKA of every pair, xs (A, n, p), ys (B, n, q) -> (A, B): ||Yc^T Xc||_F^2 / (||Xc^T Xc||_F
    ||Yc^T Yc||_F), the features centred over the n inputs (Kornblith et al., 2019)."""
    xs = xs.double() - xs.double().mean(1, keepdim=True)
    ys = ys.double() - ys.double().mean(1, keepdim=True)
    x_norm = torch.stack([(x.T @ x).norm() for x in xs])  # (A,)
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


def spearman(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """Spearman's rho: Pearson correlation of the average ranks (None, undefined, when a side is constant)."""
    ra, rb = average_ranks(a), average_ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = (ra.norm() * rb.norm()).item()
    return (ra @ rb).item() / denominator if denominator > 0 else None


# --- the expert bank and the gate program (Figs. 3, 5) ---


def has_gate_program(model) -> bool:
    """A reViT whose FFN is the depth-programmed merge (any E; E = 1 is the tied block, G = ones)."""
    return isinstance(model, revit.ReViT) and getattr(model.config, "ffn", "merge") == "merge"


def is_merged(model) -> bool:
    """A gate program of E >= 2 experts: the ablations, permutations and gradient measures apply."""
    return has_gate_program(model) and isinstance(model.block.mlp, revit.MergedExpertFFN)


def expert_bank(model) -> tuple:
    """reViT's four bank tensors (E, ...); E = 1 (a plain tied Mlp) as a bank of one expert."""
    ffn = model.block.mlp
    if hasattr(ffn, "bank"):
        return ffn.bank()
    return ffn.fc1.weight[None], ffn.fc1.bias[None], ffn.fc2.weight[None], ffn.fc2.bias[None]


def gate_program(model, depth: int) -> dict:
    """G [L, E], its dominant-expert path (Fig. 3) and where in depth each expert is used; with a fixed
    depth prior (ViTConfig.router_prior > 0, ours) also the prior's gates alone (psi = 0) and how far the
    learned router psi moved them, i.e. how much of the program was learned."""
    gates = model.gate_matrix(depth).detach().cpu().double()  # (L, E); float64 on the CPU (MPS has none)
    s = revit.depth_grid(depth).double()  # (L,) Eq. 1
    dominant = gates.argmax(1)
    usage = gates.sum(0)  # (E,)
    program = {"depth": depth, "num_experts": gates.shape[1], "coordinates": s.tolist(),
               "gates": gates.tolist(), "dominant_expert": dominant.tolist(),
               "switches": int((dominant[1:] != dominant[:-1]).sum()),
               "mean_gate": (usage / depth).tolist(),
               # gate-weighted mean coordinate of each expert: early (0) .. late (1) in the schedule
               "centroid_coordinate": ((gates * s[:, None]).sum(0) / usage.clamp_min(1e-12)).tolist()}
    ffn = model.block.mlp
    if getattr(ffn, "router_prior", 0):
        logits = revit.depth_prior(s[:, None].float(), ffn.num_experts, ffn.router_prior)
        prior = torch.softmax(logits / ffn.temperature, dim=-1).double()
        program.update(router_prior=ffn.router_prior, prior_gates=prior.tolist(),
                       prior_dominant_expert=prior.argmax(1).tolist(),
                       learned_shift=float((gates - prior).abs().max()))
    return program


def effective_ranks(model, gates: torch.Tensor) -> dict:
    """Fig. 5 / App. D: r_eff of W1_bank [E, P] (P = d_ff d), G [L, E], W1_traj = G W1_bank [L, P],
    and of the depth-centred G_c = C G and W1_traj,c = C W1_traj (rank <= E - 1: rows of G sum to 1)."""
    w1_bank = expert_bank(model)[0].detach().cpu().double().flatten(1)  # (E, d_ff * d)
    gates = gates.double()
    w1_traj = gates @ w1_bank  # (L, P): row t is vec(merged W1 of step t)
    return {"W1_bank": effective_rank(w1_bank), "G": effective_rank(gates),
            "W1_traj": effective_rank(w1_traj), "G_centred": effective_rank(centre_depth(gates)),
            "W1_traj_centred": effective_rank(centre_depth(w1_traj)), "num_experts": gates.shape[1]}


# --- modified gate programs: ablation, permutation, matched random perturbation (Figs. 4, 10) ---


@torch.no_grad()
def load_merged_ffns(vit: revit.VisionTransformer, merged: tuple) -> None:
    """Block t of a plain ViT gets merged FFN t; `merged` is MergedExpertFFN.merge's four stacks (L, ...)."""
    for block, weights in zip(vit.blocks, zip(*merged)):
        mlp = block.mlp
        for param, value in zip((mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias), weights):
            param.copy_(value)


def ablate_experts(gates: torch.Tensor, experts) -> torch.Tensor:
    """Zero the gate columns of `experts` at every depth and renormalise each row to sum to 1."""
    kept = gates.clone()
    kept[:, list(experts)] = 0
    return kept / kept.sum(1, keepdim=True)


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
    """K = Theta Theta^T [E, E], Theta [E, P_all] = each expert's bank tensors, flattened. The merge is
    linear (Eq. 2): the merged weights of all L steps move by ||dG Theta||_F = sqrt(tr(dG K dG^T))."""
    theta = torch.cat([p.detach().cpu().double().flatten(1) for p in expert_bank(model)], dim=1)
    return theta @ theta.T


def merged_displacement(delta_gates: torch.Tensor, gram: torch.Tensor) -> float:
    """Frobenius displacement of the merged FFN weights (W1, b1, W2, b2 of all L steps) for a gate change."""
    delta_gates = delta_gates.double()
    return ((delta_gates @ gram) * delta_gates).sum().clamp_min(0).sqrt().item()


def matched_perturbation(gates: torch.Tensor, gram: torch.Tensor, target: float, generator: torch.Generator,
                         tries: int = 8) -> torch.Tensor | None:
    """A random gate matrix whose merged FFN weights are `target` (Frobenius) away from those of `gates`,
    None if no draw reaches it. Ambiguity: the paper does not say how its random perturbations are drawn.
    Ours: Gaussian noise on the log-gates, G' = softmax(log G + a N), the scale a found by bisection, so
    that G' is a gate matrix (rows on the simplex) like an ablation."""
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


# --- features: the residual stream of out["states"] ---


@torch.no_grad()
def residual_features(model, images: torch.Tensor, depth: int | None = None,
                      batch_size: int = 256) -> torch.Tensor:
    """Mean-pooled patch tokens of the L+1 residual states (after the embedding and after every step,
    before the final LayerNorm; class token removed): (L+1, n, d) float32 on the CPU."""
    device = next(model.parameters()).device
    chunks = []
    for x in images.split(batch_size):
        states = model(x.to(device), depth=depth, return_states=True)["states"]  # L+1 x (b, 1+N, d)
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
            "interior_mad": deviation[1:-1].mean().item() if student_steps > 1 else math.nan,
            "weighted_mean_depth": mean.tolist(), "weighted_std_depth": std.tolist()}


def intervention_analysis(model, gates, images, reference, num_random, num_permutations, seed,
                          batch_size) -> dict:
    """Figs. 4 and 10: Delta CKA = CKA(modified) - CKA(intact) to the reference features, for each expert
    ablation (with matched random perturbations) and each gate-column permutation."""
    vit = revit.fold(model, gates=gates)  # folded once; each gate matrix then loads its merged FFNs
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device  # the gate matrices are built on the CPU, the bank lives here

    def cka_to_reference(modified_gates):
        load_merged_ffns(vit, model.block.mlp.merge(modified_gates.to(device)))
        return linear_cka(residual_features(vit, images, batch_size=batch_size)[-1], reference)

    intact = cka_to_reference(gates)
    gram = bank_gram(model)
    merged_norm = merged_displacement(gates, gram)  # ||G Theta||_F: the size of the merged weights themselves
    ablations = []
    for expert in range(gates.shape[1]):
        ablated = ablate_experts(gates, [expert])
        displacement = merged_displacement(ablated - gates, gram)
        perturbed = (matched_perturbation(gates, gram, displacement, generator) for _ in range(num_random))
        random_deltas = [cka_to_reference(p) - intact for p in perturbed if p is not None]
        randoms = torch.tensor(random_deltas, dtype=torch.float64)  # the mean of none is nan
        delta = cka_to_reference(ablated) - intact
        ablations.append({
            "expert": expert, "delta_cka": delta, "displacement": displacement,
            "relative_displacement": displacement / merged_norm if merged_norm else math.nan,
            "random_delta_cka": random_deltas, "random_mean": randoms.mean().item(),
            "random_std": randoms.std().item() if len(randoms) > 1 else math.nan,
            # share of matched random perturbations that hurt more than this ablation
            "fraction_random_worse": (randoms < delta).double().mean().item()})
    # expert e receives gate column p[e]: the bank stays, the assignment changes
    permutations = [{"permutation": list(p), "delta_cka": cka_to_reference(gates[:, list(p)]) - intact}
                    for p in gate_permutations(gates.shape[1], num_permutations, generator)]
    deltas = torch.tensor([p["delta_cka"] for p in permutations], dtype=torch.float64)
    return {"intact_cka": intact, "num_images": len(images), "ablations": ablations,
            "permutations": permutations, "permutation_summary": {
                "count": len(permutations), "mean_delta_cka": deltas.mean().item(),
                "max_delta_cka": deltas.max().item() if len(deltas) else math.nan,
                "num_at_or_above_intact": int((deltas >= 0).sum())}}


# --- why a gate program forms or not: the task's gradients on the gates and on the experts ---


def batch_gradients(model, images: torch.Tensor, labels: torch.Tensor, depth: int) -> tuple:
    """One batch's cross-entropy gradients on the gate logits z [L, E] (psi's output at each step, Eq. 1),
    on the expert bank [E, P] and on psi's parameters [P_psi]; the model's weights are left untouched."""
    ffn = model.block.mlp
    logits = []  # z_t of every step: without a merge cache (gradients on), each step evaluates psi once
    handle = ffn.router.register_forward_hook(lambda module, args, out: logits.append(out))
    try:
        loss = torch.nn.functional.cross_entropy(model(images, depth=depth).float(), labels)
    finally:
        handle.remove()
    assert len(logits) == depth, f"psi ran {len(logits)} times for {depth} steps"  # one z_t per step
    bank, psi = list(ffn.bank()), list(ffn.router.parameters())
    grads = torch.autograd.grad(loss, logits + bank + psi)
    z = torch.cat(grads[:depth])                                                   # (L, E)
    bank_grad = torch.cat([g.flatten(1) for g in grads[depth:depth + len(bank)]], dim=1)  # (E, P)
    return z, bank_grad, torch.cat([g.flatten() for g in grads[depth + len(bank):]])


def gradient_measures(model, images: torch.Tensor, labels: torch.Tensor, depth: int, batch_size: int) -> dict:
    """Is there a consistent task signal that would make the experts specialise by depth?
    consistency: |mean over batches of the unit gate-logit gradients| (1: every batch agrees; random
    directions give about 1/sqrt(batches)); expert_specific: |g_e - mean_e g_e| / |mean_e g_e| of the bank
    gradient (0: every expert gets the same update); task_vs_aux_on_psi: the task's gradient norm on psi
    over the auxiliary losses' (Eqs. 6, 8)."""
    zs, specific, psi_task = [], [], []
    for x, y in zip(images.split(batch_size), labels.split(batch_size)):
        z, bank_grad, psi_grad = batch_gradients(model, x, y, depth)
        shared = bank_grad.mean(0, keepdim=True).expand_as(bank_grad)
        specific.append(((bank_grad - shared).norm() / shared.norm().clamp_min(1e-30)).item())
        zs.append(z.flatten())
        psi_task.append(psi_grad.norm().item())
    ffn = model.block.mlp
    aux = sum(ffn.aux_losses(depth).values())
    psi_aux = torch.cat([g.flatten() for g in torch.autograd.grad(aux, list(ffn.router.parameters()))])
    zs = torch.stack(zs)                                                           # (batches, L E)
    bank = torch.cat([p.detach().flatten(1) for p in ffn.bank()], 1).float()  # (E, P)
    experts = torch.nn.functional.normalize(bank, dim=1)
    i, j = torch.triu_indices(len(experts), len(experts), offset=1)
    return {"batches": len(zs), "batch_size": batch_size, "gate_gradient_norm": zs.norm(dim=1).mean().item(),
            "consistency": torch.nn.functional.normalize(zs, dim=1).mean(0).norm().item(),
            "noise_floor": 1 / math.sqrt(len(zs)), "expert_specific": sum(specific) / len(specific),
            "expert_cosine": (experts @ experts.T)[i, j].mean().item(),
            "task_vs_aux_on_psi": (sum(psi_task) / len(psi_task)) / psi_aux.norm().clamp_min(1e-30).item()}


def gradient_part(model, images, labels, depth: int, batches: int, seed: int) -> dict:
    """The measures on the trained checkpoint and on a fresh model of the same config (seed `seed`): the
    zero-initialised router's start (App. A.1) against where training ended."""
    batch_size = len(images) // batches
    device = next(model.parameters()).device
    images, labels = images[:batch_size * batches].to(device), labels[:batch_size * batches].to(device)
    torch.manual_seed(seed)
    fresh = revit.build_model(model.config).to(device).eval()
    return {"trained": gradient_measures(model, images, labels, depth, batch_size),
            "init": gradient_measures(fresh, images, labels, depth, batch_size)}


# --- inputs: everything a user passes, read and checked before anything is written ---


@dataclass
class Inputs:
    model: torch.nn.Module      # the checkpoint's model, eval mode, on --device
    arch: str
    depth: int                  # L analysed
    images: torch.Tensor        # (n, C, H, W) normalised test images
    labels: torch.Tensor        # (n,) their classes (for the gradient measures)
    out: Path
    teacher: torch.nn.Module | None  # --teacher, when given
    teacher_arch: str


def check_args(args) -> None:
    """The flags that need no file, each one line naming the flag and what is allowed."""
    n = args.num_images
    if args.intervention_images is None:  # the paper's 256, or all of a smaller subset
        args.intervention_images = min(256, n)
    if args.gradient_batches is None:  # 8, or one image a batch in a smaller subset
        args.gradient_batches = min(8, n)
    subset = (lambda v: 2 <= v <= n, f"<= {n} (--num-images: they are the first N of that subset) and >= 2")
    batches = (lambda v: v == 0 or 2 <= v <= n, f"0 (skip) or between 2 and --num-images ({n})")
    check_numbers(vars(args), PROG, depth=closed(2, MAX_DEPTH),  # s_t = t/(L-1) needs two steps
                  intervention_images=subset, gradient_batches=batches)
    if args.data_dir and (problem := path_problem(args.data_dir, "folder")):
        raise ValueError(f"--data-dir {args.data_dir}: {problem}")


def evaluation_images(args, ckpt: dict, image_size: int) -> tuple:
    """A seeded subset of the test split, normalised as in training: (n, C, H, W) float32, its labels, and
    the data set's name (--dataset, else the checkpoint's)."""
    dataset = args.dataset or ckpt.get("train_config", {}).get("dataset") or "fashion-mnist"
    if dataset not in IMAGE_DATASETS:
        raise ValueError(f"--dataset must be one of {', '.join(IMAGE_DATASETS)}; got {dataset!r}"
                         + ("" if args.dataset else f" (checkpoint {args.checkpoint} was trained on it)"))
    if args.data and dataset != "imagenet":
        raise ValueError(f"--data is read by --dataset imagenet only, not {dataset}")
    if dataset == "imagenet":  # the val split only, resized and centre-cropped (as train.py evaluates)
        if not args.data or not (Path(args.data) / "val").is_dir():
            raise ValueError(f"--dataset imagenet needs --data ROOT with val/ (ImageFolder layout); "
                             f"got {args.data!r}")
        test = FolderImages(Path(args.data) / "val", image_size, train=False, workers=4)
    else:  # load_images raises ValueError / FileNotFoundError with a message naming what is missing
        test = load_images(dataset, data_dir=args.data_dir).test
    index = torch.randperm(len(test), generator=torch.Generator().manual_seed(args.seed))[:args.num_images]
    images, labels = next(iter(test.batches([index])))  # uint8 (n, C, H, W), (n,)
    mean, std = (torch.tensor(v).view(1, -1, 1, 1) for v in NORMALISATION[dataset])
    return (images.float() / 255 - mean) / std, labels.long(), dataset


def load_inputs(args) -> Inputs:
    """Every file and flag, checked: a ValueError of one line on the first problem, nothing written."""
    check_args(args)
    out = Path(args.out) if args.out else Path(args.checkpoint).resolve().parent / "analysis"
    problem = outputs_problem("--out", out, OUTPUT_FILES)
    if problem:
        raise ValueError(problem + ("" if args.out else " (the default --out); give --out"))
    device = pick_device(args.device)
    model, ckpt = load_vision_model(args.checkpoint, "checkpoint", device)
    teacher, teacher_ckpt = (None, {}) if not args.teacher else \
        load_vision_model(args.teacher, "--teacher", device)
    images, labels, dataset = evaluation_images(args, ckpt, model.config.image_size)
    shape = (images.shape[1], images.shape[-1])
    for flag, path, m in (("checkpoint", args.checkpoint, model), ("--teacher", args.teacher, teacher)):
        if m is not None and (m.config.in_channels, m.config.image_size) != shape:
            raise ValueError(f"{flag} {path}: expects {m.config.in_channels}x{m.config.image_size}² images; "
                             f"{dataset} has {shape[0]}x{shape[1]}² (choose the data set with --dataset)")
    depth = args.depth or model.config.depth
    try:
        residual_features(model, images[:1], depth)
    except ValueError as e:  # e.g. a plain ViT or layer-wise LoRA runs only at its trained depth
        raise ValueError(f"--depth {depth}: {ckpt['arch']} cannot run at this depth ({e})") from None
    return Inputs(model, ckpt["arch"], depth, images, labels, out, teacher, teacher_ckpt.get("arch", ""))


# --- the analyses: every number of the report (printing and files come after) ---


def analyse(inputs: Inputs, args) -> dict:
    """Every number of the report, in the order of the paper's §5 / App. D."""
    model, depth, images = inputs.model, inputs.depth, inputs.images
    report = {"checkpoint": str(args.checkpoint), "arch": inputs.arch, "depth": depth, "seed": args.seed}
    gates = model.gate_matrix(depth).detach().float().cpu() if has_gate_program(model) else None  # (L, E)
    if gates is not None:  # Figs. 3 and 5
        report.update(gates=gate_program(model, depth), effective_ranks=effective_ranks(model, gates))
    states = residual_features(model, images, depth, args.batch_size)  # (L+1, n, d): Figs. 7-8
    report.update(num_images=len(images), self_cka=cka_matrix(states, states).tolist())
    reference = states[-1]  # the interventions' reference: the teacher's final features, else its own
    if inputs.teacher is not None:  # Fig. 9
        teacher_states = residual_features(inputs.teacher, images, None, args.batch_size)  # (L_T+1, n, d_T)
        cross = cka_matrix(states, teacher_states)
        report.update(teacher={"checkpoint": args.teacher, "arch": inputs.teacher_arch,
                               "depth": inputs.teacher.config.depth},
                      cross_cka=cross.tolist(), depth_alignment=depth_alignment(cross))
        reference = teacher_states[-1]
    if is_merged(model) and not args.no_interventions:
        n = args.intervention_images
        report["interventions"] = intervention_analysis(model, gates, images[:n], reference[:n],
                                                        args.random_perturbations, args.num_permutations,
                                                        args.seed, args.batch_size)
        report["interventions"]["reference"] = "teacher final state" if args.teacher else \
            "intact student final state (no --teacher)"
    if is_merged(model) and args.gradient_batches:
        report["gate_gradients"] = gradient_part(model, images, inputs.labels, depth, args.gradient_batches,
                                                 args.seed)
    return report


# --- output: tables on stdout, JSON / CSV, optional heat maps ---


def cell(value: float, spec: str) -> str:
    """A number of a table, or n/a in its column's width where undefined (nan; null in analysis.json)."""
    if math.isnan(value):
        return format("n/a", spec.replace("+", "").split(".")[0])  # the alignment and width of `spec`
    return format(value, spec)


def print_matrix(title: str, matrix, row_name: str, col_name: str, digits: int = 2) -> None:
    width = digits + 4
    print(f"\n{title}  (rows: {row_name}, columns: {col_name})")
    print(" " * 4 + "".join(f"{j:>{width}}" for j in range(len(matrix[0]))))
    for i, row in enumerate(matrix):
        print(f"{i:>4}" + "".join(cell(v, f">{width}.{digits}f") for v in row))


def print_report(report: dict) -> None:
    """The report as tables on stdout (every number is also in analysis.json)."""
    depth = report["depth"]
    if "gates" in report:
        g = report["gates"]
        print_matrix(f"gate matrix G [L={depth}, E={g['num_experts']}]", g["gates"], "step t", "expert e", 3)
        print(f"dominant expert per step: {g['dominant_expert']} ({g['switches']} switches)")
        if "prior_gates" in g:
            print(f"the depth prior alone (beta = {g['router_prior']:g}, psi = 0): dominant expert per step "
                  f"{g['prior_dominant_expert']}; the learned router moves any gate by at most "
                  f"{g['learned_shift']:.3f}")
        ranks = ", ".join(f"{k} {v:.3f}" for k, v in report["effective_ranks"].items() if k != "num_experts")
        print(f"effective ranks: {ranks}  (E = {g['num_experts']})")
    print_matrix(f"self-CKA of the {depth + 1} residual states ({report['num_images']} images)",
                 report["self_cka"], "state", "state")
    if "cross_cka" in report:
        a, t = report["depth_alignment"], report["teacher"]
        print_matrix(f"cross-CKA student x teacher ({t['arch']}, {t['depth']} layers)", report["cross_cka"],
                     "student state", "teacher state")
        print(f"max-CKA teacher state per student state: {a['max_cka_path']}")
        print(f"Spearman rho {rho_text(a)} | MAD from proportional depth {a['mad']:.2f} teacher "
              f"layers (interior {cell(a['interior_mad'], '.2f')})")
    if "interventions" in report:
        print_interventions(report["interventions"], report["gates"])
    if "gate_gradients" in report:
        print_gradients(report["gate_gradients"])


def rho_text(alignment: dict, why: bool = True) -> str:
    """Spearman's rho of the max-CKA path, or n/a (and why, where asked): a constant path has none."""
    rho = alignment["spearman_rho"]
    if rho is not None:
        return f"{rho:.3f}"
    state = alignment["max_cka_path"][0]
    return f"n/a (every student state is closest to teacher state {state})" if why else "n/a"


def print_gradients(result: dict) -> None:
    t, i = result["trained"], result["init"]
    print(f"\ngradients of the task loss ({t['batches']} batches of {t['batch_size']} images)  "
          f"{'init':>8} {'trained':>8}")
    rows = [("gate-logit gradient norm", "gate_gradient_norm", ".2e"),
            (f"its consistency over batches (noise ~{t['noise_floor']:.2f})", "consistency", ".3f"),
            ("expert-specific / shared bank gradient", "expert_specific", ".3f"),
            ("mean pairwise cosine of the experts", "expert_cosine", ".3f"),
            ("task / auxiliary gradient norm on psi", "task_vs_aux_on_psi", ".1f")]
    for label, key, spec in rows:
        print(f"{label:<52} {cell(i[key], '>8' + spec)} {cell(t[key], '>8' + spec)}")


def print_interventions(result: dict, g: dict) -> None:
    print(f"\nexpert ablations ({result['num_images']} images; Delta CKA to the {result['reference']}, "
          f"intact CKA {result['intact_cka']:.4f})")
    print(f"{'expert':>6} {'mean gate':>9} {'centroid s':>10} {'rel. disp.':>10} {'dCKA':>8} "
          f"{'random dCKA (mean ± std)':>26} {'random worse':>12}")
    for row in result["ablations"]:
        e = row["expert"]
        print(f"{e:>6} {g['mean_gate'][e]:>9.3f} {g['centroid_coordinate'][e]:>10.3f} "
              f"{cell(row['relative_displacement'], '>10.3f')} {cell(row['delta_cka'], '>+8.4f')} "
              f"{cell(row['random_mean'], '>+17.4f')} ± {cell(row['random_std'], '<6.4f')} "
              f"{cell(row['fraction_random_worse'], '>12.2f')}")
    ps = result["permutation_summary"]
    print(f"gate-column permutations: {ps['count']} non-identity, mean Delta CKA "
          f"{cell(ps['mean_delta_cka'], '+.4f')}, best {cell(ps['max_delta_cka'], '+.4f')}, "
          f"{ps['num_at_or_above_intact']} at or above the learned assignment")


def matrix_rows(name: str, matrix) -> list:
    """A CKA matrix as CSV rows: a header, then one row per state."""
    return [[name, *range(len(matrix[0]))], *([i, *row] for i, row in enumerate(matrix))]


def write_csv(path, rows) -> None:
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)


def write_outputs(report: dict, out: Path) -> None:
    """--out's tables, figures and analysis.json (nothing non-finite), each written whole or not at all."""
    tables = {"self_cka.csv": matrix_rows("state", report["self_cka"])}
    if "gates" in report:
        g = report["gates"]
        steps = zip(g["coordinates"], g["gates"], g["dominant_expert"])
        tables["gates.csv"] = [["step", "s", *(f"expert_{e}" for e in range(g["num_experts"])), "dominant"],
                               *([t, s, *row, d] for t, (s, row, d) in enumerate(steps))]
    if "cross_cka" in report:
        tables["cross_cka.csv"] = matrix_rows("student_state", report["cross_cka"])
    for name, rows in tables.items():
        atomic_write(out / name, lambda tmp: write_csv(tmp, rows))
    report["plots"] = save_plots(report, out)
    atomic_write_text(out / "analysis.json", json.dumps(finite_or_null(report, "", []), indent=1))
    for stale in set(OUTPUT_FILES) - {"analysis.json", *tables, *report["plots"]}:
        (out / stale).unlink(missing_ok=True)  # an earlier run's, which would read as this one's
    print(f"\nwrote {out / 'analysis.json'}, " + ", ".join([*sorted(tables), *report["plots"]]))


# --- figures (matplotlib is an optional extra) ---


def import_pyplot():
    """pyplot (cli.pyplot), or None and a note saying where the numbers are instead."""
    plt = pyplot()
    if plt is None:
        print("note: matplotlib is not installed, so no PNG figures (pip install -r requirements-extra.txt); "
              "the numbers are in analysis.json and the CSV files")
    return plt


def heat_map(plt, matrix, cmap: str, label: str, **figure) -> tuple:
    """A figure of `matrix` on one fixed colour scale [0, 1] for every model (flat gates look flat)."""
    from matplotlib.ticker import MaxNLocator
    fig, ax = plt.subplots(**figure)
    image = ax.imshow(torch.as_tensor(matrix).numpy(), origin="lower", aspect="auto", cmap=cmap,
                      interpolation="nearest", vmin=0, vmax=1)
    fig.colorbar(image, ax=ax, label=label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    return fig, ax


def gate_figure(plt, g: dict):
    """Fig. 3: the gate weights g[t, e] over recurrent step t (bottom axis) and normalised depth
    s_t = t / (L-1) (top axis) for each expert e, the dominant expert of each step marked and connected:
    the depth program, if one formed."""
    gates = torch.tensor(g["gates"])  # (L, E)
    steps, experts = gates.shape
    size = (max(5.0, 0.55 * steps + 2.5), max(3.2, 0.5 * experts + 2.2))
    fig, ax = heat_map(plt, gates.T, "YlOrBr", "gate weight $g_{t,e}$", figsize=size, layout="constrained")
    ax.plot(range(steps), g["dominant_expert"], "-o", color="teal", linewidth=2, markersize=15,
            markerfacecolor="none", markeredgewidth=2,
            label="dominant expert of each step, $\\arg\\max_e\\, g_{t,e}$")
    if "prior_dominant_expert" in g:  # what the fixed depth prior alone would pick: how much was learned
        ax.plot(range(steps), g["prior_dominant_expert"], "--", color="gray", linewidth=1.5,
                label=f"the fixed depth prior alone ($\\beta$ = {g['router_prior']:g}; learned shift "
                      f"$\\leq$ {g['learned_shift']:.2f})")
    if steps * experts <= 160:  # small enough to print each weight in its cell
        for t, e in itertools.product(range(steps), range(experts)):
            ax.text(t, e, f"{gates[t, e]:.2f}", ha="center", va="center", fontsize=6,
                    color="white" if gates[t, e] > 0.6 else "black")
    ax.set(xlabel="recurrent step $t$", ylabel="expert $e$")
    last = max(steps - 1, 1)
    top = ax.secondary_xaxis("top", functions=(lambda t: t / last, lambda s: s * last))
    top.set_xlabel("normalised depth $s_t = t/(L-1)$")
    ax.set_title(f"gate program at L={steps}, E={experts}: {g['switches']} switches of the dominant expert",
                 fontsize=9)
    fig.legend(loc="outside lower center", fontsize=8, frameon=False, ncols=1)
    return fig


def cka_figure(plt, matrix, xlabel: str, ylabel: str, title: str, lines=()):
    """Figs. 7-9: a CKA heat map; `lines` are (xs, ys, style, label) overlays."""
    fig, ax = heat_map(plt, matrix, "magma_r", "linear CKA", figsize=(5, 4))
    for xs, ys, style, label in lines:
        ax.plot(xs, ys, style, label=label)
    if lines:
        ax.legend(loc="upper left", fontsize=7)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    fig.tight_layout()
    return fig


def save_plots(report: dict, out: Path) -> list[str]:
    """gates.png (Fig. 3), self_cka.png (Figs. 7-8) and cross_cka.png with the max-CKA path and
    proportional depth (Fig. 9); the names written (none without matplotlib)."""
    plt = import_pyplot()
    if plt is None:
        return []
    figures = {}
    if "gates" in report:
        figures["gates.png"] = gate_figure(plt, report["gates"])
    figures["self_cka.png"] = cka_figure(plt, report["self_cka"], "state", "state",
                                         "self-CKA (mean-pooled patch tokens)")
    if "cross_cka" in report:
        a = report["depth_alignment"]
        steps = list(range(len(a["max_cka_path"])))
        figures["cross_cka.png"] = cka_figure(
            plt, report["cross_cka"], "teacher state", "student state",
            f"cross-CKA, rho={rho_text(a, why=False)}, MAD={a['mad']:.2f}",
            [(a["max_cka_path"], steps, "o:", "max-CKA teacher depth"),
             (a["proportional_depth"], steps, "--", "proportional depth")])
    for name, fig in figures.items():
        save_png(fig, out / name)
        plt.close(fig)
    return list(figures)


# --- the command ---


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="reViT, ViT or Raptor: a ckpt.pt written by train.py, or a "
                        ".safetensors from weights/ or tools.export")
    parser.add_argument("--teacher", default="", help="checkpoint whose residual states and final features "
                        "the student is compared with (cross-CKA, Delta CKA); without it, interventions are "
                        "measured against the intact student's own final features")
    parser.add_argument("--depth", type=int, default=None, help="depth L to analyse (reViT/Raptor; "
                        "default: the checkpoint's reference depth)")
    parser.add_argument("--out", default="", help="output folder (default: analysis/ next to the checkpoint)")
    parser.add_argument("--dataset", default="", help="fashion-mnist | cifar10 | cifar100 | imagenet "
                        "(default: the data set the checkpoint was trained on)")
    parser.add_argument("--data-dir", default="", help="where the built-in data sets live (default: ./data, "
                        "then $REVIT_DATA_DIR, then /usr/share/datasets); never downloads")
    parser.add_argument("--data", default="", help="imagenet only: ImageFolder root holding val/")
    parser.add_argument("--num-images", type=int, default=1000, help="seeded test subset (paper: 1000)")
    parser.add_argument("--intervention-images", type=int, default=None,
                        help="first N of that subset for ablations and permutations (paper: 256; "
                             "default: 256, or --num-images when fewer)")
    parser.add_argument("--random-perturbations", type=int, default=64,
                        help="matched random gate perturbations per expert ablation (paper: 64)")
    parser.add_argument("--num-permutations", type=int, default=64,
                        help="gate-column permutations sampled when E > 4 (at E = 4: all 23)")
    parser.add_argument("--no-interventions", action="store_true", help="skip ablations and permutations")
    parser.add_argument("--gradient-batches", type=int, default=None, help="split the subset into N batches "
                        "for the gradient measures on the gates and experts, trained and at init (0: skip; "
                        "default: 8, or --num-images when fewer)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the subset, permutations, perturbations")
    parser.add_argument("--batch-size", type=int, default=256, help="images per forward pass")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N | mps")
    return parser


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    try:
        inputs = load_inputs(args)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e), PROG)
    model = inputs.model
    print(f"{args.checkpoint}: {inputs.arch} ({model.config.arch}), {model.num_params() / 1e6:.3f}M "
          f"params, analysed at depth L={inputs.depth}")
    if isinstance(model, revit.ReViT) and not has_gate_program(model):
        print(f"note: ffn={model.config.ffn!r} has no depth-only gate program over an expert bank: "
              "gates, effective ranks, ablations and permutations are skipped")
    report = analyse(inputs, args)
    print_report(report)
    write_outputs(report, inputs.out)
    return report


if __name__ == "__main__":
    run_main(main, "every file it writes is written whole or not at all")
