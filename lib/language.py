"""The language task: next-token prediction with AlterNet (arXiv 2611.08741) on a text corpus. train.py
builds it for a language preset (`build`); a vision run never imports this file, nor the language model.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

import alternet
from lib import data
from lib.checkpoint import unwrap
from lib.boundary import fail, model_overrides
from lib.cli import device_options, say
from lib.tasks import autocast_of, make


# --- text: tokens of a corpus (lib/data.py reads it), with no network unless --download ---


@contextlib.contextmanager
def no_network(allowed: bool = False):
    """Inside, DNS lookups and connections are refused unless `allowed` (--download): tiktoken fetches its
    encoding files when they are not cached, and a tokenizer named by a checkpoint must not make it fetch."""
    from unittest import mock
    with contextlib.ExitStack() as offline:
        for name in ([] if allowed else ["getaddrinfo", "socket.connect"]):  # no lookup, no connection
            offline.enter_context(mock.patch(f"socket.{name}", side_effect=OSError("no --download")))
        yield


BYTES = (lambda text: list(text.encode("utf-8")), lambda ids: bytes(ids).decode("utf-8", errors="replace"),
         256)  # the byte tokenizer: the UTF-8 bytes


def text_codec(tokenizer: str, download: bool = False) -> tuple[Callable, Callable, int]:
    """(encode: str -> list of ids, decode: list of ids -> str, vocabulary size) of a --tokenizer name; gpt2:
    GPT-2's BPE through tiktoken, which fetches its encoding files once, so only with download."""
    if tokenizer == "byte":
        return BYTES
    if tokenizer != "gpt2":  # train.py's flag is checked on entry (lib/boundary.CHOICES); a checkpoint's here
        raise ValueError(f"tokenizer must be byte or gpt2; got {tokenizer!r}")
    try:
        import tiktoken
        with no_network(allowed=download):
            encoding = tiktoken.get_encoding("gpt2")
    except Exception as e:  # noqa: BLE001 -- not installed, or its files not cached or not fetched
        raise ValueError(f"the gpt2 tokenizer needs tiktoken and its encoding files ({e}): pip install "
                         "tiktoken, and it fetches its files once, with --download (or use byte)") from None
    return encoding.encode_ordinary, encoding.decode, encoding.n_vocab


def tokenize(text: str, codec) -> tuple[torch.Tensor, float, int]:
    """text under a text_codec -> (tokens (N,) int64, tokens per byte, vocabulary size)."""
    raw = text.encode("utf-8")
    if codec is BYTES:  # without a Python list of the bytes
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long(), 1.0, 256
    encode, _, vocab = codec
    tokens = torch.tensor(encode(text), dtype=torch.long)
    return tokens, len(tokens) / len(raw), vocab


def load_text(codec=BYTES, corpus: str = "grammar", path: str = "", data_dir: str = "",
              download: bool = False) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """Train/val token tensors (90/10 split) under a text_codec, tokens per byte, vocabulary size."""
    tokens, tokens_per_byte, vocab = tokenize(data.read_text(corpus, path, data_dir, download), codec)
    split = int(0.9 * len(tokens))
    return tokens[:split], tokens[split:], tokens_per_byte, vocab


class LanguageTask:
    """Next-token prediction; the model computes its own loss (PonderNet L_PN + aux terms).

    Training cuts the model config's random_length_fraction of each batch to random valid lengths
    (torch's global RNG, saved in checkpoints), so the router and halt heads, which read the last
    valid token, learn every position generation routes on. Evaluation reports the full-window
    numbers (halted, and every fixed depth) and next to them "causal": alternet.causal_loss, each
    position routed and halted on its own prefix as in generation, on the first causal_windows
    validation windows of each rank (T forwards per window, so a subset); then prints a sample, decoded by
    the run's tokenizer (`decode`, built once by `build`).
    """

    causal_windows, sample_tokens = 4, 80

    def __init__(self, cfg, val_tokens, tokens_per_byte, block_size, device, autocast, decode=BYTES[1]):
        self.cfg, self.val, self.tokens_per_byte = cfg, val_tokens, tokens_per_byte
        self.block_size, self.device, self.autocast, self.decode = block_size, device, autocast, decode

    def loss(self, model, tokens, targets):
        tokens, targets = tokens.to(self.device), targets.to(self.device)
        fraction = unwrap(model).config.random_length_fraction
        lengths = None
        if model.training and fraction > 0:
            lengths = alternet.training_lengths(len(tokens), tokens.shape[1], fraction).to(self.device)
        with self.autocast():
            out = model(tokens, targets=targets, lengths=lengths)
        return out["loss"], {"task": out["task_loss"], **out["aux_losses"]}

    def windows(self, rank, world):
        """(x, y) validation batches of this rank: (B, T) each, consecutive non-overlapping windows."""
        n = (len(self.val) - 1) // self.block_size
        starts = torch.arange(n)[rank::world] * self.block_size
        if self.cfg.eval_iters:
            starts = starts[:self.cfg.eval_iters * self.cfg.eval_batch_size]
        for chunk in starts.split(self.cfg.eval_batch_size):
            rows = torch.stack([self.val[s:s + self.block_size + 1] for s in chunk.tolist()])
            yield rows[:, :-1].to(self.device), rows[:, 1:].to(self.device)

    @torch.no_grad()
    def evaluate(self, model, depths, rank, world):
        """Validation loss and bits-per-byte at the halted depth, at every fixed depth 1..D, and causal."""
        was_training = model.training
        model.eval()
        lm = unwrap(model)
        depth, threshold = lm.config.max_depth, 0.5 if lm.config.halting else None
        # sums over this rank's windows: CE at [halted, depth 1..D], iterations, tokens, sequences;
        # then causal CE, causal iterations, causal tokens, full-window CE on the causal windows
        stats = torch.zeros(depth + 8, dtype=torch.float64, device=self.device)
        causal_left = self.causal_windows
        for x, y in self.windows(rank, world):
            with self.autocast():  # a fixed-depth model (halting off) "halts" at its last step
                # with targets the model returns per-token CE (D', B, T), never D' full-vocabulary logits
                halted = lm(x, targets=y, halt_threshold=threshold)
                fixed = lm(x, targets=y, halt_threshold=None)  # all D steps
            halted_losses = halted["token_losses"][-1]  # (B, T): each row at the iteration it stopped at
            for row, token_losses in enumerate([halted_losses, *fixed["token_losses"]]):
                stats[row] += token_losses.sum()
            counted = [halted["iterations"].sum().item(), y.numel(), len(x)]
            stats[depth + 1:depth + 4] += torch.tensor(counted, dtype=torch.float64, device=self.device)
            if causal_left > 0:
                x, y, full = x[:causal_left], y[:causal_left], halted_losses[:causal_left].sum()
                causal_left -= len(x)
                with self.autocast():
                    causal = alternet.causal_loss(lm, x, y, halt_threshold=threshold)
                counted = [causal["ce"].sum().item(), causal["iterations"].sum().item(), y.numel(),
                           full.item()]
                stats[depth + 4:] += torch.tensor(counted, dtype=torch.float64, device=self.device)
        if world > 1:
            dist.all_reduce(stats)
        results = self.results(stats.tolist(), depth)
        if rank == 0 and "causal_loss" in results[None]:
            r = results[None]
            print(f"causal (each position routed on its own prefix, {r['causal_tokens']} tokens): loss "
                  f"{r['causal_loss']:.4f}, {r['causal_bpb']:.4f} bits/byte, {r['causal_iterations']:.2f} "
                  f"iterations | full window, same tokens: loss {r['causal_full_window_loss']:.4f}")
        if rank == 0 and self.sample_tokens:
            self.print_sample(lm, threshold)
        model.train(was_training)  # the loop's model trains on; a tool's stays in eval mode
        return results

    def results(self, stats, depth):
        """{None (halted) | 1..D: {loss, bpb, iterations}} from the summed statistics; None also holds the
        causal metric and the full-window loss on the same tokens."""
        iterations, tokens, sequences, causal_ce, causal_iterations, causal_tokens, full = stats[depth + 1:]
        results = {}
        for row, key in enumerate([None, *range(1, depth + 1)]):
            loss = stats[row] / tokens
            results[key] = {"loss": loss, "bpb": loss * self.tokens_per_byte / math.log(2),
                            "iterations": iterations / sequences if key is None else float(key)}
        if causal_tokens:  # iterations: mean per position (each is one generated token's forward)
            loss = causal_ce / causal_tokens
            results[None].update(causal_loss=loss, causal_bpb=loss * self.tokens_per_byte / math.log(2),
                                 causal_iterations=causal_iterations / causal_tokens,
                                 causal_full_window_loss=full / causal_tokens,
                                 causal_tokens=int(causal_tokens))
        return results

    def print_sample(self, lm, threshold):
        """A short continuation of the first validation tokens (fixed seed; the training RNG is untouched)."""
        prompt = self.val[:min(32, self.block_size)][None].to(self.device)  # (1, P)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(0)
            with self.autocast():
                try:
                    ids, used = lm.generate(prompt, self.sample_tokens, halt_threshold=threshold,
                                            temperature=0.8, top_k=min(40, lm.config.vocab_size),
                                            return_iterations=True)
                except ValueError as e:  # a diverged model: its non-finite loss is what the caller reports
                    print(f"sample: none ({e})")
                    return
        text = self.decode(ids[0, prompt.shape[1]:].tolist())
        print(f"sample: {self.decode(prompt[0].tolist())!r} -> {text!r} "
              f"({used.float().mean().item():.2f} iterations per token)")


def build(cfg, rank: int, world: int, device, ckpt: dict | None):
    """Text, model and task -> (model, task, batches(start_step), None, None): lib/tasks.build's shape for a
    language preset. A resumed or evaluated checkpoint supplies the model config."""
    autocast = autocast_of(device, device_options(device.type, cfg.precision))
    try:  # before the text: a missing tokenizer is the tokenizer's (a recipe's) problem, not the data's
        codec = text_codec(cfg.tokenizer, cfg.download)
    except ValueError as e:
        by = alternet.RECIPES.get(cfg.arch, {}).get("tokenizer") == cfg.tokenizer
        fail(f"--tokenizer {cfg.tokenizer}{f' (--arch {cfg.arch} trains with it)' if by else ''}: {e}")
    try:
        train_tokens, val_tokens, tokens_per_byte, vocab = load_text(
            codec, cfg.dataset if cfg.dataset != "text" else "", cfg.data, cfg.data_dir, cfg.download)
    except (ValueError, FileNotFoundError) as e:
        fail(f"{'--data' if cfg.data else '--dataset ' + cfg.dataset}: {e}")
    overrides = model_overrides(cfg)
    top = max(int(train_tokens.max()), int(val_tokens.max()))
    if overrides.get("vocab_size", vocab) <= top:  # the data's token ids would fail mid-run
        fail(f"--model-args vocab_size={overrides['vocab_size']}: the data's token ids reach {top}")
    if cfg.tokenizer != "byte":
        overrides["vocab_size"] = vocab
    model = make(alternet.create_model, cfg.arch, ckpt["model_config"] if ckpt else overrides)
    if cfg.block_size is None:
        cfg.block_size = model.config.seq_len
        say(f"override: block_size={cfg.block_size} (auto: the model's seq_len)")
    block_size = cfg.block_size
    if block_size > model.config.seq_len:
        fail(f"--block-size {block_size} exceeds the model's seq_len {model.config.seq_len} "
             f"(raise it with --model-args seq_len={block_size})")
    if min(len(train_tokens), len(val_tokens)) <= block_size + 1:
        fail(f"the text has {len(train_tokens) + len(val_tokens)} tokens: too short for --block-size "
             f"{block_size} (90% train / 10% validation, each needs more than {block_size + 1})")
    windows = len(train_tokens) // block_size
    if cfg.batch_size > windows:  # as for images: a batch larger than the data
        fail(f"--batch-size {cfg.batch_size} is larger than the training text ({windows} windows of "
             f"--block-size {block_size})")
    task = LanguageTask(cfg, val_tokens, tokens_per_byte, block_size, device, autocast, codec[1])
    batches = lambda start: data.text_batches(  # noqa: E731
        train_tokens, cfg.batch_size, block_size, cfg.seed, rank, world, start)
    return model, task, batches, None, None
