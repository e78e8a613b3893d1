"""The tables of a quality sweep (tools/sweep.py's rows: each cell over its seeds), one function per kind
of grid: what `python -m tools.sweep` prints and results/render.py writes into RESULTS.md. Standard
library only (results/render.py runs without torch).
"""

from __future__ import annotations

import functools
import math


def markdown_table(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def pm(stats: dict, scale: float = 100, places: int = 2, seed_places: int = 1) -> str:
    """'88.12 ± 0.20 [88.0 88.3 88.1]': mean ± std over seeds, then the per-seed values, in % (scale 100)."""
    seeds = " ".join(f"{scale * v:.{seed_places}f}" for v in stats["values"])
    return f"{scale * stats['mean']:.{places}f} ± {scale * stats['std']:.{places}f} [{seeds}]"


def mse(stats: dict) -> str:
    """'0.1234 ± 0.0012 [0.1230 0.1220 0.1250]': an MSE over seeds, then the per-seed values."""
    return pm(stats, 1, 4, 4)


def gap(a: dict, b: dict, scale: float = 100, places: int = 2) -> str:
    """Difference of two cells' means ± its standard error (independent seeds): in points, or (scale 1,
    4 places) of an MSE."""
    se = scale * math.sqrt(sum(s["std"] ** 2 / len(s["values"]) for s in (a, b)))
    return f"{scale * (a['mean'] - b['mean']):+.{places}f} ± {se:.{places}f}"


def programs(row: dict, seeds: int | None = None) -> str:
    """The first `seeds` (default: every) seed's dominant expert per step ('0123 / 3321 / 0000'), or '–'."""
    found = row.get("dominant_expert")
    return " / ".join("".join(map(str, p)) for p in found[:seeds]) if found else "–"


def growth(row: dict) -> str:
    """The gate spread at the first evaluation -> at the end, each seed ('0.06→0.42 / ...'), or '–'."""
    traces = row.get("gate_traces")
    return " / ".join(f"{t[0][1]:.2f}→{t[-1][1]:.2f}" for t in traces) if traces else "–"


def experts_grid(rows: list[dict], metric: str = "acc", each_seed: bool = False):
    """Table 5 / Table 1 shape: the score per cell over seeds (top-1 %, or the planted task's test MSE,
    lower is better), the gap to the tied block (E = 1; the planted task compares the untied ViT too), the
    gate spread and the router's program: seed 0's, or every seed's with the spread's growth (each_seed)."""
    acc, tied = metric == "acc", next((r for r in rows if r.get("num_experts") == 1), None)
    score, scale = (pm, (100, 2)) if acc else (mse, (1, 4))
    seeds = len(rows[0][metric]["values"])
    columns = ["model", "params", f"{'top-1 %' if acc else 'test MSE'} mean ± std [{seeds} seeds]",
               f"vs E = 1 ({'points ' if acc else ''}± s.e.)", "gate spread"]
    columns += ["spread, epoch 1 → end (each seed)", "dominant expert per step (each seed)"] if each_seed \
        else ["dominant expert per step (seed 0)"]
    cells = []
    for r in rows:
        versus = tied and r is not tied and (r["num_experts"] or not acc)
        spread = r.get("gate_spread")
        cells.append([r["cell"], f"{r['params']:,}", score(r[metric]),
                      gap(r[metric], tied[metric], *scale) if versus else "–",
                      f"{spread['mean']:.2f} ± {spread['std']:.2f}" if spread else "–",
                      *([growth(r), programs(r)] if each_seed else [programs(r, 1)])])
    return columns, cells


def distill_grid(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Teachers (supervised top-1), students (Eq. 5 MSE to their teacher's tokens), then the linear probe of
    every frozen model against the teacher's own probe (none yet while a sweep still runs)."""
    teacher_probe = next((r for r in rows if r["cell"] == "probe: teacher"), None)
    columns = ["model", "params (trained)", "measure", "mean ± std [per seed]",
               "vs the teacher's probe (points ± s.e.)"]
    cells = []
    for r in rows:
        metric = r.get("metric", "acc")
        measure = "distillation MSE (Eq. 5)" if metric != "acc" else \
            "linear probe top-1 %" if r["cell"].startswith("probe") else "top-1 %"
        student_probe = teacher_probe and r["cell"].startswith("probe: student")
        score = pm(r[metric]) if metric == "acc" else mse(r[metric])
        cells.append([r["cell"], f"{r['params']:,}", measure, score,
                      gap(r["acc"], teacher_probe["acc"]) if student_probe else "–"])
    return columns, cells


def depth_grid(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Fig. 2 shape: the score (top-1 %, or the planted task's MSE) of each elastic checkpoint at every
    inference depth."""
    depths = sorted({d for r in rows for d in r["depths"]}, key=int)
    trained = str(rows[0]["reference_depth"])
    shown = pm if rows[0].get("metric", "acc") == "acc" else mse
    columns = ["model"] + [f"depth {d}" + (" (trained)" if d == trained else "") for d in depths]
    return columns, [[r["cell"]] + [shown(r["depths"][d]).split(" [")[0] for d in depths] for r in rows]


def tying_grid(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The rows come in pairs 'SETTING: ViT' / 'SETTING: E=1'; the gap is the cost of tying."""
    by_cell = {r["cell"]: r for r in rows}
    settings = [s for s in dict.fromkeys(r["cell"].split(":")[0] for r in rows)  # both rows finished
                if f"{s}: ViT" in by_cell and f"{s}: E=1" in by_cell]
    columns = ["setting", "ViT, untied", "reViT E = 1 (tied block)", "gap (points ± s.e.)"]
    return columns, [[s, pm(by_cell[f"{s}: ViT"]["acc"]), pm(by_cell[f"{s}: E=1"]["acc"]),
                      gap(by_cell[f"{s}: ViT"]["acc"], by_cell[f"{s}: E=1"]["acc"])] for s in settings]


planted_grid = functools.partial(experts_grid, metric="mse", each_seed=True)
router_grid = functools.partial(experts_grid, each_seed=True)
GRIDS = {"experts": experts_grid, "quickstart": experts_grid, "elastic": depth_grid, "tying": tying_grid,
         "planted": planted_grid, "planted-lr": planted_grid, "planted-table3": planted_grid,
         "planted-elastic": depth_grid, "router-lr": router_grid, "long": router_grid,
         "distill": distill_grid}
