"""train.py's --resume and --eval-only: the saved config under the flags given now, the loop state checked
against the rebuilt run, then loaded. A failure is one line naming the flag, before the run folder is touched.
"""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import torch

from lib import tasks
from lib.build import build
from lib.boundary import fail, or_fail, wrong_type
from lib.checkpoint import (MODEL_KEYS, RESUME_KEYS, count, diverged, fit_problem, load_checkpoint,
                            set_rng_state)
from lib.cli import non_finite_place, pick_device, say


# The model and the data order of a run: a resumed run must keep them.
FIXED_ON_RESUME = ("arch", "patch_size", "depth", "num_experts", "drop_path", "depth_drop", "model_args",
                   "dataset", "data", "tokenizer", "train_subset", "batch_size", "seed", "probe",
                   "probe_pool", "backbone", "teacher")


def resume_config(explicit: dict, config_class, resolve_config) -> tuple[dict, object]:
    """The checkpoint and its run's TrainConfig (`config_class`) under the flags given now (more --epochs)."""
    path = explicit["resume"]
    flags = {**explicit, "out_dir": explicit.get("out_dir") or str(Path(path).parent)}  # the folder may move
    return saved_run(path, "--resume", RESUME_KEYS, flags, config_class, resolve_config,
                     needed=("data", "teacher"), unkept={"stop_at_step", "overwrite", "eval_only"},
                     fixed=FIXED_ON_RESUME)


def saved_config(ckpt: dict, path, flag: str, config_class) -> dict:
    """A checkpoint's train_config, each known value of its flag's type; an older bf16 as its --precision."""
    saved = ckpt["train_config"]
    if "bf16" in saved and "precision" not in saved:
        saved = {**saved, "precision": {True: "auto", False: "fp32"}.get(saved["bf16"], saved["bf16"])}
    problem = wrong_type(saved, config_class)
    if problem:
        fail(f"{flag} {path}: its train_config has {problem}")
    return saved


def saved_run(path, flag: str, keys, flags: dict, config_class, resolve_config, needed, unkept, fixed=()):
    """-> (checkpoint, resolve_config of its saved values (but `unkept`) under the flags given now, which
    may not change the `fixed`). Where the saved values alone are refused, the line names the checkpoint,
    not a flag the user never typed."""
    ckpt = or_fail(load_checkpoint, path, flag, keys)
    saved, source = saved_config(ckpt, path, flag, config_class), f"{flag} {path}"
    changed = [name for name in fixed if name in flags and flags[name] != saved.get(name)]
    if changed:
        fail(f"--{changed[0].replace('_', '-')} cannot change on --resume (the checkpoint has "
             f"{saved.get(changed[0])!r}); start a new run instead")
    known = {f.name for f in fields(config_class)} - unkept
    saved = command_line_only(saved, flags, source, needed)
    merged = {**{k: v for k, v in saved.items() if k in known}, **flags}
    try:
        return ckpt, resolve_config(merged, announce=False, typed=flags)
    except SystemExit:
        saved = {name: value for name, value in merged.items() if name not in flags}
        try:
            resolve_config(saved, announce=False, typed=())
        except SystemExit as refused:
            reason = str(refused.code).partition(": error: ")[2]
            fail(f"{source}: its saved train_config is refused: {reason}")
        raise


EVAL_ONLY_FLAGS = {"eval_only", "eval_depths", "test_subset", "eval_batch_size", "eval_iters", "data",
                   "data_dir", "download", "teacher", "device", "progress"}


def evaluation_setup(path, flags: dict, flag: str, config_class, resolve_config):
    """A checkpoint rebuilt with its test data -> (cfg, model, task); `flags` change how, never the model."""
    extra = sorted(set(flags) - EVAL_ONLY_FLAGS)
    if extra:
        allowed = ", ".join("--" + f.replace("_", "-") for f in sorted(EVAL_ONLY_FLAGS))
        fail(f"{flag} evaluates a checkpoint as trained; it takes only {allowed}; "
             f"got --{extra[0].replace('_', '-')}")
    ckpt, cfg = saved_run(path, flag, MODEL_KEYS + ("train_config",), flags, config_class, resolve_config,
                          needed=("data", "teacher"), unkept={"out_dir", "resume"})
    device = or_fail(pick_device, cfg.device)
    model, task, *_ = build(cfg, 0, 1, device, ckpt)
    trained = model.head if cfg.probe else model
    problem = fit_problem(trained.state_dict(), ckpt["model"], ckpt["arch"])
    if not problem:
        trained.load_state_dict(ckpt["model"])
        problem = None if cfg.probe else diverged(model.to(device).eval())  # as every reader (load_model)
    if problem:
        fail(f"{flag} {path}: {problem}")
    return cfg, model.to(device).eval(), task


def evaluate_only(flags: dict, config_class, resolve_config, evaluate) -> dict:
    """--eval-only: `evaluate` at its --eval-depths, printed, never a non-finite metric; nothing written."""
    path = flags["eval_only"]
    cfg, model, task = evaluation_setup(path, flags, "--eval-only", config_class, resolve_config)
    results = evaluate(model, task, tasks.eval_depths(cfg, model))
    place = non_finite_place(results)
    if place:
        fail(f"--eval-only {path}: its evaluation gave a non-finite {place.removeprefix('None.')} "
             f"(finite but diverged weights)")
    summary, line = tasks.summarise(cfg, model, results)
    say(f"{path}: {line}")
    return {"arch": cfg.arch, **summary}


# What a checkpoint never decides: the files a run reads, whether it downloads, the teacher it loads
# (hub:NAME runs a repository's code). --eval-only, --resume and the tools take these from the command
# line only; a saved value that differs is shown in an `override:` line.
COMMAND_LINE_ONLY = {"data": "", "data_dir": "", "download": False, "teacher": ""}


def command_line_only(saved: dict, explicit: dict, flag: str, needed: tuple) -> dict:
    """The saved config with COMMAND_LINE_ONLY's values from the command line; those `needed`: given again."""
    taken = dict(saved)
    for name, default in COMMAND_LINE_ONLY.items():
        was, given = saved.get(name, default), explicit.get(name, default)
        option = "--" + name.replace("_", "-")
        if was != given and was and name in needed and name not in explicit:
            fail(f"{flag}: the run used {option} {was}; give {option} again (a checkpoint never names the "
                 f"files read or the teacher loaded: they come from the command line)")
        if was != given:
            say(f"override: {name}={given!r} (the checkpoint's {was!r} is not used: files, downloads and "
                f"teachers come from the command line)")
        taken[name] = given
    return taken


# The schedule's numbers a resumed run may change, and the flags that change them.
SCHEDULE_FLAGS = {"total_steps": "--max-steps / --epochs", "warmup_steps": "--warmup-steps / --warmup-epochs",
                  "peak_lr": "--lr / --lr-batch", "min_lr": "--min-lr", "warmup_lr": "--warmup-lr"}


def continue_schedule(path: str, ckpt: dict, sched: dict, lr_at) -> None:
    """An `override:` line per number of the saved schedule that the flags given now change, with what it
    alone does to the lr (train.lr_at); a run at its last step is complete: it exits 0 without training."""
    step, saved = ckpt["step"], ckpt.get("scheduler")
    if isinstance(saved, dict) and all(isinstance(saved.get(k), (int, float)) for k in SCHEDULE_FLAGS):
        for key, flags in SCHEDULE_FLAGS.items():
            if saved[key] != sched[key]:
                alone = {**saved, key: sched[key]}
                before, after = lr_at(step, saved["peak_lr"], saved), lr_at(step, alone["peak_lr"], alone)
                say(f"override: {key}={sched[key]:g} (the checkpoint's: {saved[key]:g}; {flags}): the lr at "
                    f"step {step} goes from {before:.3g} to {after:.3g}"
                    + (f", and the run continues to step {sched[key]}" if key == "total_steps" else ""))
    if step == sched["total_steps"]:
        say(f"--resume {path}: the run is complete (step {step} of {step}); nothing to train. Extend it "
            f"with a larger --max-steps or --epochs, or evaluate it with --eval-only {path}")
        raise SystemExit(0)


ADAM_STATE = {"step", "exp_avg", "exp_avg_sq"}  # what AdamW keeps per parameter (+ max_exp_avg_sq: amsgrad)


# Parameters that no step may reach, so without AdamW state (made at a first gradient), by name: a routed
# expert no sequence of any batch picked yet (AlterNet's experts.N.*), and a distilled student's class head
# (Eq. 5 reads the final tokens, not the head)
ROUTED_EXPERT, HEAD = re.compile(r"(^|\.)experts\.\d+\."), re.compile(r"(^|\.)head\.")


def optimizer_problem(saved: dict, optimizer, step: int, names: dict, distilled: bool) -> str | None:
    """A saved AdamW state against the run's optimizer: parameter ids in groups as state_dict numbers them,
    per parameter AdamW's state in its shape and a float dtype. After the first step a parameter without
    state (`names`: id -> name) is refused unless no step may reach it."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ids = [g["params"] for g in optimizer.state_dict()["param_groups"]]
    if [g["params"] for g in saved["param_groups"]] != ids:
        return (f"its optimizer state does not fit the model (parameter ids are not 0..{len(params) - 1} in "
                f"{len(optimizer.param_groups)} groups)")
    for index, state in saved["state"].items():
        fits = (isinstance(index, int) and 0 <= index < len(params) and isinstance(state, dict)
                and ADAM_STATE <= set(state) <= ADAM_STATE | {"max_exp_avg_sq"} and step_ok(state["step"])
                and all(torch.is_tensor(v) and v.is_floating_point() and v.shape == params[index].shape
                        for k, v in state.items() if k != "step"))
        if not fits:
            return f"its optimizer state does not fit the model (entry {index!r})"
    stateless = [names.get(id(p), f"parameter {i}") for i, p in enumerate(params) if i not in saved["state"]]
    refused = [name for name in stateless
               if not (ROUTED_EXPERT.search(name) or distilled and HEAD.search(name))]
    if refused and step > 0:
        return (f"its optimizer state covers {len(saved['state'])} of {len(params)} parameters, none for "
                f"{refused[0]} (after a step only a routed expert no sequence picked, or a distilled "
                f"student's class head, has none): an edited or partial file")
    if stateless and step > 0:
        say(f"override: {len(stateless)} of {len(params)} parameters have no optimizer state (a routed "
            f"expert no sequence picked yet, or a distilled student's unused class head); they start fresh")
    return None


def step_ok(step) -> bool:  # AdamW's per-parameter step count
    if torch.is_tensor(step):
        return step.numel() == 1 and not step.is_complex() and bool(step >= 0)
    return count(step)


def continue_run(run, ckpt: dict, fused_adamw: bool) -> None:
    """train.py's Run where the checkpoint left it: its loop state checked against the rebuilt run (the
    optimizer state as the next step would take it), then loaded, all before the run folder is opened. The
    optimizer keeps the run's own settings (lr, betas, decay from its config; this device's fused AdamW):
    load_state_dict would restore the file's, and with them the saving device's implementation."""
    cfg, step, total = run.cfg, ckpt["step"], run.sched["total_steps"]
    names = {id(p): name for name, p in run.trainable.named_parameters()}
    # fp16: the scaler may have skipped every step so far, and AdamW makes its state at the first one taken
    stepped = 0 if ckpt.get("scaler") and not ckpt["optimizer"]["state"] else step
    past = step > total and (f"it is at step {step}, past this run's {total} steps; give a larger "
                             f"--max-steps or --epochs (the checkpoint is left as it is)")
    problem = (past or fit_problem(run.trainable.state_dict(), ckpt["model"], cfg.arch)
               or optimizer_problem(ckpt["optimizer"], run.optimizer, stepped, names, bool(cfg.teacher)))
    if problem:
        fail(f"--resume {cfg.resume}: {problem}")
    settings = [dict(group, fused=fused_adamw or None) for group in run.optimizer.param_groups]
    run.trainable.load_state_dict(ckpt["model"])
    run.optimizer.load_state_dict(ckpt["optimizer"])
    for group, own in zip(run.optimizer.param_groups, settings):
        group.update(own)
    if run.scaler.is_enabled() and ckpt.get("scaler"):  # fp16's loss scale (none from another precision)
        run.scaler.load_state_dict(ckpt["scaler"])
    run.step = run.folder.saved_step = step
    run.metrics = ckpt.get("metrics", {})
    try:
        restore_rng(run, ckpt["rng"])
    except (KeyError, RuntimeError, ValueError, TypeError, OverflowError) as e:
        fail(f"--resume {cfg.resume}: its rng state of rank {run.rank} cannot be restored "
             f"({' '.join(str(e).split())[:120]})")


def restore_rng(run, rngs: list) -> None:
    """Each rank's saved random streams; where they cannot apply (another number of ranks or device type),
    a reseed by (seed, rank, step), said in an `override:` line."""
    rank, world, device = run.rank, run.world, run.device
    seed = run.cfg.seed * 1_000_003 + run.step * world + rank + 1
    reseeded = set_rng_state(rngs[rank] if len(rngs) == world else None, run.augment, device, seed)
    if reseeded:
        saved_on = rngs[rank].get("device_type", "another device") if len(rngs) == world else None
        why = (f"the checkpoint was saved by {len(rngs)} rank(s), this run has {world}" if saved_on is None
               else f"the checkpoint's states were saved on {saved_on}, they do not apply on {device.type}")
        say(f"override: random streams reseeded ({', '.join(reseeded)}; seed {seed}): {why}; the run "
            f"continues deterministically, not bit-for-bit")
