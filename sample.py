"""Sample text from a trained AlterNet checkpoint (nanoGPT's sample.py convention).

    python sample.py out/alternet-tiny-<time>/ckpt.pt --prompt "ROMEO:" --max-new-tokens 200 --show-iterations

Prints each sample; with --show-iterations, under it one mark per generated token for the iterations
that token used (AlterNet, arXiv 2611.08741, halts per token: 1-9, then a = 10, b = 11, ...) and
their mean. Every bad argument or unusable checkpoint is one line `sample.py: error: ...`.
"""

from __future__ import annotations

import argparse

import torch

import alternet
from lib.checkpoint import load_model
from lib.boundary import check_numbers, fail
from lib.cli import DEVICES, ArgumentParser, pick_device, run_main
from lib.language import text_codec

DEFAULT_HALT_THRESHOLD = 0.5  # for a model with halting (train.py's evaluation uses the same)


def iteration_marks(iterations: list[int]) -> str:
    """One character per generated token: 1-9, then a, b, ... for 10, 11, ... iterations."""
    return "".join("0123456789abcdefghijklmnopqrstuvwxyz"[min(n, 35)] for n in iterations)


def sample_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="sample.py", description="Sample text from an AlterNet checkpoint.")
    p.add_argument("checkpoint", metavar="CKPT",
                   help="an alternet-* model: a ckpt.pt written by train.py or a .safetensors from weights/")
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    p.add_argument("--max-new-tokens", type=int, default=200,
                   help="tokens to generate per sample, 0..100,000 [default: %(default)s]")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="softmax temperature; 0 = greedy [default: %(default)s]")
    p.add_argument("--top-k", type=int, default=None,
                   help="sample only from the k most likely tokens [default: all]")
    p.add_argument("--halt-threshold", type=float, default=None,
                   help="stop iterating once the cumulative halting probability reaches this, in (0, 1] "
                        f"(default {DEFAULT_HALT_THRESHOLD}; a fixed-depth model takes none: it runs every "
                        "iteration)")
    p.add_argument("--max-depth", type=int, default=None,
                   help=f"cap on iterations per token, 1..{alternet.MAX_ITERATIONS} (default: trained D)")
    p.add_argument("--seed", type=int, default=1337, help="random seed [default: %(default)s]")
    p.add_argument("--num-samples", type=int, default=1,
                   help="number of samples, 1..1,000 [default: %(default)s]")
    p.add_argument("--show-iterations", action="store_true",
                   help="under each sample, one mark per generated token: the iterations it used "
                        "(1-9, a=10, ...)")
    p.add_argument("--device", default="auto",
                   help=f"{DEVICES} [default: auto: CUDA when available, else CPU]")
    return p


def encode_prompt(prompt: str, encode, model: alternet.AlterNet, device: torch.device) -> torch.Tensor:
    """--prompt as token ids (1, P) in the model's vocabulary; ValueError naming --prompt otherwise."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:  # bytes the shell passed that are not UTF-8 (kept as surrogates by Python)
        raise ValueError(f"--prompt {prompt!r} is not UTF-8 text (give the prompt as UTF-8)") from None
    ids = torch.tensor([encode(prompt)], dtype=torch.long, device=device)  # (1, P)
    if ids.numel() == 0:
        raise ValueError(f"--prompt {prompt!r} encodes to no tokens")
    vocab = model.config.vocab_size
    if ids.max() >= vocab:
        raise ValueError(f"--prompt {prompt!r} has tokens outside this model's vocabulary "
                         f"(ids 0..{vocab - 1}; the prompt has {ids.max().item()})")
    return ids


def prepare(args: argparse.Namespace):
    """Everything the sampling needs, checked before any work: (model, prompt ids, decode)."""
    check_numbers(vars(args), "sample.py")  # every number flag in its range (lib/boundary.RANGES)
    device = pick_device(args.device)
    model, ckpt = load_model(args.checkpoint, device=device, flag="CKPT")  # in eval mode
    if not isinstance(model, alternet.AlterNet):
        raise ValueError(f"CKPT {args.checkpoint} is a checkpoint of {ckpt.get('arch')!r}, not of an "
                         f"AlterNet language model (one of {', '.join(sorted(alternet.PRESETS))})")
    encode, decode, _ = text_codec(ckpt.get("train_config", {}).get("tokenizer", "byte"))  # offline
    prompt = encode_prompt(args.prompt, encode, model, device)
    if args.top_k is not None and args.top_k > model.config.vocab_size:  # RANGES checked its static part
        raise ValueError(f"--top-k must be in 1..{model.config.vocab_size:,} (this model's vocabulary); "
                         f"got {args.top_k}")
    if args.halt_threshold is None and model.config.halting:
        args.halt_threshold = DEFAULT_HALT_THRESHOLD
    return model, prompt, decode


def generate(model: alternet.AlterNet, prompt: torch.Tensor, args) -> tuple[torch.Tensor, list[int], bool]:
    """model.generate one token a call (the same draws as all at once), so that Ctrl-C keeps the tokens so
    far -> (ids (1, P + n), the iterations of each new token, whether Ctrl-C stopped it)."""
    ids, used = prompt, []
    try:
        while len(used) < args.max_new_tokens:
            ids, iterations = model.generate(ids, 1, halt_threshold=args.halt_threshold,
                                             max_depth=args.max_depth, temperature=args.temperature,
                                             top_k=args.top_k, return_iterations=True)
            used.append(iterations.item())
    except KeyboardInterrupt:
        return ids, used, True
    return ids, used, False


def main(argv: list[str] | None = None) -> list[tuple[str, list[int]]]:
    """Print each sample (with --show-iterations, its iteration marks); -> [(text, iterations)]."""
    args = sample_parser().parse_args(argv)
    try:
        model, prompt, decode = prepare(args)
    except ValueError as e:
        fail(str(e), "sample.py")
    torch.manual_seed(args.seed)
    samples = []
    for i in range(args.num_samples):
        try:
            ids, used, stopped = generate(model, prompt, args)
        except ValueError as e:  # logits that overflow on this prompt (load_model tried one input only), or
            # a flag this model cannot take: --halt-threshold without halting
            fail(f"CKPT {args.checkpoint}: {e}", "sample.py")
        samples.append((decode(ids[0].tolist()), used))
        print(samples[-1][0])
        if args.show_iterations:
            mean = sum(used) / max(len(used), 1)
            print(f"{iteration_marks(used)}\nmean iterations per generated token: {mean:.2f}")
        if stopped:
            raise SystemExit(f"sample.py: stopped by Ctrl-C after {len(used)} of {args.max_new_tokens} new "
                             "tokens (printed above); nothing is written")
        if i < args.num_samples - 1:
            print("---------------")
    return samples


if __name__ == "__main__":
    run_main(main, "nothing is written")
