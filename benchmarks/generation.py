"""The in-process backend's speed: sampling against ``model.generate``, and a whole GRPO step
against TRL's ``GRPOTrainer`` (when ``trl`` is installed).

    .venv/bin/python benchmarks/generation.py                # ~1 min on 2 cores
    .venv/bin/python benchmarks/generation.py --rounds 5 --steps 8
    pip install trl                                          # for the GRPO step comparison

Same tiny model folder (``save_tiny_model``), same batch: ``--prompts`` prompts x
``--group`` samples, ``--new-tokens`` new tokens, temperature 1, CPU, one thread pool.

1. **generation**: ``TransformersChatClient`` (every request one ``complete`` call,
   gathered into one batch) against ``model.generate(do_sample=True)`` on the same padded
   batch; both produce exactly ``--new-tokens`` tokens per row (EOS off), so the ratio is
   one of tokens/s.
2. **GRPO step**: ludic's ``Trainer`` (``make_grpo``, ``RolloutBatchSource`` over an env
   whose prompts are the same, the in-process backend on a serving copy synced after every
   step) against TRL's ``GRPOTrainer`` (``use_vllm=False``: it generates with the training
   model), both with beta 0, one optimizer step per batch, a constant reward. A step is
   generation + loss + backward + optimizer step (+ ludic's weight sync). The time per step
   is the median of ``--steps`` steps after one warm-up step.

The ways are measured in interleaved rounds (``--rounds``), so a change in machine load
hits all of them alike; each ratio is a median over rounds of the per-round ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ludic.agents import Agent
from ludic.context import FullDialog
from ludic.distributed import ClientPolicyPublisher
from ludic.envs import DatasetQAEnv
from ludic.inference import (
    CompletionRequest,
    HFChatTemplate,
    InferenceSpec,
    SamplingSpec,
    TransformersChatClient,
)
from ludic.interaction import SingleAgentProtocol
from ludic.models.tiny import save_tiny_model
from ludic.parsers import ParseResult
from ludic.training import (
    EnvSpec,
    GRPORequestStrategy,
    ProtocolSpec,
    RolloutBatchSource,
    RolloutEngine,
    RolloutRequest,
    Trainer,
    TrainerConfig,
    make_grpo,
)

QUESTIONS = ["What is 2+3?", "What is 7+1?", "What is 4+4?", "What is 9+0?"]


def load(folder: Path) -> tuple[torch.nn.Module, Any]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(folder)


def chat_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    template = HFChatTemplate(tokenizer)
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]
    return [template.render([{"role": "user", "content": q}]) for q in questions]


# ----------------------------------------------------------------------------- generation
def time_ludic_generation(client: TransformersChatClient, prompts, args) -> float:
    spec = InferenceSpec(SamplingSpec(temperature=1.0, max_tokens=args.new_tokens))

    async def run() -> list[Any]:
        reqs = [CompletionRequest(tuple(p), spec) for p in prompts for _ in range(args.group)]
        return await asyncio.gather(*(client.complete(r) for r in reqs))

    start = time.perf_counter()
    responses = asyncio.run(run())
    elapsed = time.perf_counter() - start
    assert all(len(r.trace.completion_token_ids) == args.new_tokens for r in responses)
    return elapsed


def time_hf_generate(model: torch.nn.Module, tokenizer: Any, prompts, args) -> float:
    rows = [p for p in prompts for _ in range(args.group)]
    width = max(len(p) for p in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(rows):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            pad_token_id=tokenizer.pad_token_id,
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] - width == args.new_tokens
    return elapsed


# ----------------------------------------------------------------------------- GRPO step
def constant_parser(text: str) -> ParseResult:
    return ParseResult(action=text)


def ludic_grpo_trainer(folder: Path, args, clock: StepClock, shared_prefix: bool) -> Trainer:
    policy, tokenizer = load(folder)
    serving, _ = load(folder)
    serving.requires_grad_(False)
    client = TransformersChatClient(serving, tokenizer, max_batch_size=args.prompts * args.group)
    template = HFChatTemplate(tokenizer)
    rows = [{"question": q, "answer": "x"} for q in QUESTIONS]

    def protocol() -> SingleAgentProtocol:
        agent = Agent(
            client=client, context=FullDialog(), parser=constant_parser, chat_template=template
        )
        return SingleAgentProtocol(agent)

    engine = RolloutEngine(
        {"qa": lambda: DatasetQAEnv(rows, verifier=lambda _answer, _target: True)},
        {"single": protocol},
    )
    sampling = InferenceSpec(SamplingSpec(temperature=1.0, max_tokens=args.new_tokens))

    def requests() -> list[RolloutRequest]:
        return [
            RolloutRequest(EnvSpec("qa"), ProtocolSpec("single"), env_seed=i, inference=sampling)
            for i in range(args.prompts)
        ]

    grpo = make_grpo(group_size=args.group)
    source = RolloutBatchSource(
        engine, requests, grpo.credit_assigner, request_strategy=GRPORequestStrategy(args.group)
    )
    config = TrainerConfig(
        lr=1e-6, publish_every=1, pad_token_id=tokenizer.pad_token_id, shared_prefix=shared_prefix
    )
    publisher = ClientPolicyPublisher(client)
    return Trainer(policy, grpo, source, config, publisher=publisher, loggers=[clock])


class StepClock:
    """A ``TrainingLogger`` that notes when each step ends."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def log(self, step: int, metrics: Any) -> None:
        self.ends.append(time.perf_counter())

    def close(self) -> None:
        pass


def time_ludic_steps(folder: Path, args, n: int, shared_prefix: bool = True) -> list[float]:
    """Step times of one ``train_sync(n)`` call (one event loop, as in a real run)."""
    clock = StepClock()
    trainer = ludic_grpo_trainer(folder, args, clock, shared_prefix)
    start = time.perf_counter()
    trainer.train_sync(n)
    ends = [start, *clock.ends]
    return [b - a for a, b in zip(ends, ends[1:])]


def time_trl_steps(folder: Path, args, n: int, workdir: Path) -> list[float]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    policy, tokenizer = load(folder)
    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS[: args.prompts]]
    data = Dataset.from_dict({"prompt": prompts * (n + 1) * 2})
    ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_begin(self, *_a: Any, **_k: Any) -> None:
            if not ends:
                ends.append(time.perf_counter())

        def on_step_end(self, *_a: Any, **_k: Any) -> None:
            ends.append(time.perf_counter())

    config = GRPOConfig(
        output_dir=str(workdir / "trl"),
        per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group,
        max_completion_length=args.new_tokens,
        temperature=1.0,
        learning_rate=1e-6,
        beta=0.0,
        bf16=False,  # float32 without activation checkpointing, as ludic's step runs
        gradient_checkpointing=False,
        max_steps=n,
        use_cpu=True,
        report_to="none",
        logging_steps=10**6,
        save_strategy="no",
        shuffle_dataset=False,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=lambda completions, **_: [1.0] * len(completions),
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[StepClock()],
    )
    trainer.train()
    return [b - a for a, b in zip(ends, ends[1:])]


# ----------------------------------------------------------------------------- main
WAYS = ("gen-ludic", "gen-generate", "step-ludic", "step-ludic-plain", "step-trl")


def measure(way: str, folder: Path, args) -> float:
    """One way's median time (s), in this process (a fresh one per way and round)."""
    if way.startswith("gen-"):
        model, tokenizer = load(folder)
        model.eval()
        prompts = chat_prompts(tokenizer, args.prompts)
        if way == "gen-ludic":
            client = TransformersChatClient(
                model, tokenizer, eos_token_ids=[-1], max_batch_size=10**6
            )
            run = lambda: time_ludic_generation(client, prompts, args)  # noqa: E731
        else:
            run = lambda: time_hf_generate(model, tokenizer, prompts, args)  # noqa: E731
        run()  # warm-up
        return statistics.median(run() for _ in range(args.repeats))
    if way == "step-trl":
        times = time_trl_steps(folder, args, args.steps + 1, folder.parent)
    else:
        times = time_ludic_steps(folder, args, args.steps + 1, way == "step-ludic")
    return statistics.median(times[1:])  # the first step warms up


def run_way(way: str, folder: Path, args) -> float:
    """``measure`` in a fresh interpreter: torch's thread pools and caches start cold for
    every way alike, and no way inherits another's threads."""
    cmd = [sys.executable, __file__, "--worker", way, "--folder", str(folder)]
    for name in ("steps", "prompts", "group", "new_tokens", "repeats"):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{way} failed:\n{out.stderr[-3000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def summary_line(name: str, ours: list[float], theirs: list[float], note: str = "") -> str:
    ratios = [a / b for a, b in zip(ours, theirs)]
    med = statistics.median
    return (
        f"{name:34}{med(ours) * 1e3:>8.1f}ms{med(theirs) * 1e3:>9.1f}ms"
        f"{med(ratios):>8.2f}{min(ratios):>7.2f}-{max(ratios):.2f}{note}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed GRPO steps per round")
    parser.add_argument("--repeats", type=int, default=7, help="timed generations per round")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--worker", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        torch.manual_seed(0)
        print(measure(args.worker, args.folder, args))
        return

    folder = save_tiny_model(Path(tempfile.mkdtemp(prefix="ludic-bench-gen-")) / "model")
    ways = list(WAYS)
    if importlib.util.find_spec("trl") is None:
        ways.remove("step-trl")
        print("trl is not installed: the GRPO step comparison is skipped (pip install trl)")
    times: dict[str, list[float]] = {way: [] for way in ways}
    for rnd in range(args.rounds):
        for way in ways:
            times[way].append(run_way(way, folder, args))
        print(f"round {rnd}: " + ", ".join(f"{w} {times[w][-1] * 1e3:.1f} ms" for w in ways))

    rows = args.prompts * args.group
    print(f"\nbatch: {args.prompts} prompts x {args.group} samples, {args.new_tokens} new tokens")
    print(f"{'ludic / baseline':34}{'ludic':>10}{'baseline':>11}{'ratio':>8}{'range':>11}")
    tokens_per_s = rows * args.new_tokens / statistics.median(times["gen-ludic"])
    print(
        summary_line(
            "generation / model.generate",
            times["gen-ludic"],
            times["gen-generate"],
            f"   ({tokens_per_s:.0f} tokens/s)",
        )
    )
    if "step-trl" in times:
        print(summary_line("GRPO step / TRL GRPOTrainer", times["step-ludic"], times["step-trl"]))
        print(summary_line("  plain forward / TRL", times["step-ludic-plain"], times["step-trl"]))
    print(
        summary_line(
            "shared prefix / plain forward", times["step-ludic"], times["step-ludic-plain"]
        )
    )


if __name__ == "__main__":
    main()
