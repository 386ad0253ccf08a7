"""One training step with a real-size vocabulary: chunked logprobs vs the naive full-vocab
computation (peak memory, time), and packed vs padded micro-batches (tokens/s).

    .venv/bin/python benchmarks/train_step.py                       # ~6 min on 2 cores
    .venv/bin/python benchmarks/train_step.py --only memory --seq-len 512
    .venv/bin/python benchmarks/train_step.py --only packing --rounds 5

The model is built locally: a Qwen2 causal LM with Qwen2.5's vocabulary size
(V = 151,936, tied embeddings) and a tiny decoder (``--hidden`` 64, ``--layers`` 2), in
float32, so the output head dominates as it does in a 0.5B model's memory.

1. **Memory.** One step on ``--batch`` x ``--seq-len`` tokens (a ``--prompt-len`` prompt,
   the rest action tokens), REINFORCE token-mean, AdamW. Each variant runs in its own
   process (so one's freed memory cannot hide another's peak): a warm-up step, then
   ``--steps`` timed ones. Peak memory is the process's peak RSS (``ru_maxrss``) less its
   RSS once the model, optimizer state and batch exist.

   | | logprobs |
   |---|---|
   | naive (baseline) | what the Trainer did before: ``model(...).logits`` [B, T, V], ``log_softmax(logits.float())`` over all of it, gather; the entropy metric a few rows at a time without gradient |
   | full | ``TrainerConfig(logprobs="full")``: whole logits from the model, log-softmax of the action positions only |
   | chunked | ``TrainerConfig(logprobs="chunked")`` (the default): decoder hidden states, output head on the action tokens a chunk at a time (``ludic.training.logprobs``), entropy included |

   Goal (issue 13): chunked/naive peak memory <= 0.25, time <= 1.1.

2. **Packing.** ``--items`` sequences, lengths drawn uniformly from ``--min-len`` to
   ``--max-len`` (seeded), the last quarter of each the completion, trained by the real
   ``Trainer`` (chunked logprobs, no shared prefix: every prompt differs) with
   ``max_tokens_per_microbatch`` = ``--budget``: padded (``packing=False``: length-sorted
   micro-batches of ``B * T_max`` <= budget) vs packed (``packing=True``: rows of the
   longest sequence, ``R * L`` <= budget). Same items, the two in turn for ``--rounds``
   rounds after a warm-up; tokens/s = real tokens / step time. Goal: packed/padded >= 1.5.
   ``--with-full`` adds padded micro-batches with whole logits (``logprobs="full"``: the
   model's ``[B, T, V]`` logits, padding included), close to the forward before issue 13.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 151_936


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 32),
        num_key_value_heads=max(1, args.hidden // 32),
        max_position_embeddings=max(4096, args.seq_len, args.max_len),
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


# ---------------------------------------------------------------- 1. memory (one process each)
def memory_variant(args: argparse.Namespace, variant: str) -> dict[str, float]:
    from ludic.training.collate import collate
    from ludic.training.logprobs import token_logprobs
    from ludic.training.losses import LossInputs, ReinforceLoss
    from ludic.training.losses.base import masked_token_entropy
    from ludic.training.token_scores import ScoringOptions, score_tokens, split_causal_lm
    from ludic.training.types import SAWItem

    torch.set_num_threads(args.threads)
    model = build_model(args).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(1)
    items = [
        SAWItem(
            torch.randint(0, VOCAB, (args.seq_len,), generator=g).tolist(),
            [0] * args.prompt_len + [1] * (args.seq_len - args.prompt_len),
            weight=(-1.0) ** k,
        )
        for k in range(args.batch)
    ]
    mb = collate(items, pad_token_id=0)
    loss_fn = ReinforceLoss()
    parts = split_causal_lm(model)
    options = ScoringOptions(logprobs=variant, packing=False, shared_prefix=False)  # type: ignore[arg-type]
    # AdamW state exists before the baseline RSS is read: one step of zeros
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    def step() -> None:
        if variant == "naive":
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
            logprobs = token_logprobs(logits, mb.input_ids)
            with torch.no_grad():  # the entropy metric, as the Trainer logged it: 64 MiB rows
                rows = max(1, (1 << 24) // (logits.shape[1] * logits.shape[2]))
                for r in range(0, logits.shape[0], rows):
                    masked_token_entropy(logits[r : r + rows].detach())
        else:
            logprobs = score_tokens(model, mb, options, with_entropy=True, parts=parts).logprobs
        inputs = LossInputs(
            logprobs=logprobs,
            action_mask=mb.action_mask,
            weights=mb.weights,
            num_sequences=mb.num_sequences,
            num_action_tokens=mb.num_action_tokens,
        )
        loss_fn(inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    base = rss_bytes()
    times = []
    for k in range(args.steps + 1):
        started = time.perf_counter()
        step()
        if k:  # the first is the warm-up
            times.append(time.perf_counter() - started)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_bytes": peak - base, "step_s": statistics.median(times)}


def run_memory(args: argparse.Namespace) -> None:
    tokens = args.batch * args.seq_len
    print(
        f"[1] memory: one step on {args.batch} x {args.seq_len} tokens "
        f"({args.seq_len - args.prompt_len} action tokens each), V = {VOCAB}, hidden "
        f"{args.hidden} x {args.layers} layers, float32, AdamW, {args.threads} threads; "
        f"float32 logits of the batch: {tokens * VOCAB * 4 / 2**30:.2f} GiB"
    )
    results = {}
    for variant in ("naive", "full", "chunked"):
        cmd = [sys.executable, __file__, "--_variant", variant, *sys.argv[1:]]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if out.returncode != 0:
            print(f"  {variant:8s} failed (exit {out.returncode}): {out.stderr.strip()[-400:]}")
            continue
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
        r = results[variant]
        print(
            f"  {variant:8s} peak +{r['peak_bytes'] / 2**30:6.2f} GiB   step "
            f"{r['step_s']:6.2f} s (median of {args.steps})"
        )
    if "naive" in results and "chunked" in results:
        n, c = results["naive"], results["chunked"]
        print(
            f"  chunked/naive: peak memory {c['peak_bytes'] / n['peak_bytes']:.3f} "
            f"(goal <= 0.25), time {c['step_s'] / n['step_s']:.2f} (goal <= 1.1)"
        )
    if "full" in results and "naive" in results:
        f, n = results["full"], results["naive"]
        print(
            f"  full/naive:    peak memory {f['peak_bytes'] / n['peak_bytes']:.3f}, "
            f"time {f['step_s'] / n['step_s']:.2f}"
        )


# ---------------------------------------------------------------- 2. packing
def run_packing(args: argparse.Namespace) -> None:
    import copy

    from ludic.training.algorithm import make_reinforce
    from ludic.training.config import TrainerConfig
    from ludic.training.trainer import Trainer
    from ludic.training.types import SAWBatch, SAWItem

    torch.set_num_threads(args.threads)

    class Fixed:
        def __init__(self, batch: SAWBatch) -> None:
            self.batch = batch

        async def next_batch(self) -> SAWBatch:
            return self.batch

    g = torch.Generator().manual_seed(2)
    items = []
    for k in range(args.items):
        n = int(torch.randint(args.min_len, args.max_len + 1, (1,), generator=g))
        completion = max(1, n // 4)
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        items.append(SAWItem(ids, [0] * (n - completion) + [1] * completion, (-1.0) ** k))
    tokens = sum(i.num_tokens for i in items)
    model = build_model(args)
    trainers = {}
    variants = {"padded": (False, "chunked"), "packed": (True, "chunked")}
    if args.with_full:
        variants["padded_full"] = (False, "full")
    for name, (packing, logprobs) in variants.items():
        config = TrainerConfig(
            lr=1e-6,
            max_tokens_per_microbatch=args.budget,
            packing=packing,
            logprobs=logprobs,  # type: ignore[arg-type]
            shared_prefix=False,
            pad_token_id=0,
            publish_every=0,
        )
        trainers[name] = Trainer(
            copy.deepcopy(model), make_reinforce(), Fixed(SAWBatch(items)), config
        )
    print(
        f"[2] packing: {args.items} sequences of {args.min_len}-{args.max_len} tokens "
        f"({tokens} in all, a quarter of each the completion), budget {args.budget} tokens "
        f"per micro-batch, V = {VOCAB}, hidden {args.hidden} x {args.layers} layers"
    )
    times: dict[str, list[float]] = {name: [] for name in variants}
    run: dict[str, float] = {}
    for r in range(args.rounds + 1):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            started = time.perf_counter()
            (metrics,) = trainers[name].train_sync(1)
            elapsed = time.perf_counter() - started
            run[name] = metrics["num_tokens_run"]
            if r:
                times[name].append(elapsed)
        if r:
            print(
                f"  round {r}: padded {times['padded'][-1]:.2f} s, packed "
                f"{times['packed'][-1]:.2f} s; packed/padded tokens/s "
                f"{times['padded'][-1] / times['packed'][-1]:.2f}"
            )
    ratios = [a / b for a, b in zip(times["padded"], times["packed"])]
    for name in variants:
        t = statistics.median(times[name])
        print(
            f"  {name}: {tokens / t:8.0f} tokens/s (median {t:.2f} s/step), positions run "
            f"{run[name]:.0f} ({run[name] / tokens:.2f}x the real tokens)"
        )
    print(
        f"  packed/padded tokens/s: {statistics.median(ratios):.2f} (range "
        f"{min(ratios):.2f}-{max(ratios):.2f}; goal >= 1.5)"
    )
    if "padded_full" in times:
        before = [a / b for a, b in zip(times["padded_full"], times["packed"])]
        print(
            f"  packed/padded_full tokens/s: {statistics.median(before):.2f} (range "
            f"{min(before):.2f}-{max(before):.2f}): the new forward against the padded "
            "whole-logits one"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=["memory", "packing"])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--items", type=int, default=16)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--with-full",
        action="store_true",
        help="also time padded micro-batches with whole logits (logprobs=full)",
    )
    parser.add_argument("--_variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._variant:
        print(json.dumps(memory_variant(args, args._variant)))
        return
    if args.only in (None, "memory"):
        run_memory(args)
    if args.only in (None, "packing"):
        run_packing(args)


if __name__ == "__main__":
    main()
