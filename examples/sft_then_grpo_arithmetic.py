"""SFT warm start, then GRPO, on single-digit addition with a tiny model built locally.

    python examples/sft_then_grpo_arithmetic.py            # about a minute on 2 CPU cores
    python examples/sft_then_grpo_arithmetic.py --grpo-steps 5 --sft-steps 5   # smoke run

Reads top to bottom:
  1. build a tiny Qwen2 + byte tokenizer (nothing downloaded);
  2. an "expert" (a scripted client that knows the answers) plays the arithmetic env;
     its rollouts are written to JSONL;
  3. SFT on those demonstrations (OfflineBatchSource + make_sft);
  4. GRPO on the same env, sampling from the in-process transformers backend, which the
     trainer re-syncs after every step (RolloutBatchSource + make_grpo);
  5. greedy evaluation before and after GRPO.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ludic.agents import Agent
from ludic.context import FullDialog
from ludic.distributed import ClientPolicyPublisher
from ludic.envs import ArithmeticQAEnv
from ludic.eval import default_reducers, run_eval
from ludic.inference import (
    HFChatTemplate,
    InferenceSpec,
    ReturnSpec,
    SamplingSpec,
    ScriptedChatClient,
    TransformersChatClient,
)
from ludic.interaction import SingleAgentProtocol
from ludic.models.tiny import build_tiny_causal_lm, build_tiny_tokenizer
from ludic.parsers import ParseResult
from ludic.training import (
    EnvSpec,
    GRPORequestStrategy,
    OfflineBatchSource,
    ProtocolSpec,
    RichConsoleLogger,
    RolloutBatchSource,
    RolloutEngine,
    RolloutRequest,
    Trainer,
    TrainerConfig,
    make_grpo,
    make_sft,
    write_rollouts_jsonl,
)


@dataclass
class Args:
    sft_steps: int = 300
    """optimizer steps of supervised warm start"""
    sft_lr: float = 3e-3
    grpo_steps: int = 100
    """optimizer steps of GRPO"""
    grpo_lr: float = 5e-4
    prompts_per_step: int = 8
    """distinct problems per GRPO step"""
    group_size: int = 8
    """samples per problem (GRPO group)"""
    num_problems: int = 100
    """size of the problem set (seeds 0..num_problems-1)"""
    seed: int = 0


ENV_KWARGS = {"operators": ("+",), "min_digits": 1, "max_digits": 1}


def answer_parser(text: str) -> ParseResult:
    """The whole completion is the answer; an empty one is a format failure."""
    text = text.strip()
    if not text:
        return ParseResult(action=None, reward=-0.1, obs="Answer with a number.")
    return ParseResult(action=text)


def make_engine(client, template: HFChatTemplate, num_problems: int) -> RolloutEngine:
    def protocol() -> SingleAgentProtocol:
        agent = Agent(
            client=client, context=FullDialog(), parser=answer_parser, chat_template=template
        )
        return SingleAgentProtocol(agent)

    return RolloutEngine(
        {"arith": lambda: ArithmeticQAEnv(num_problems=num_problems, **ENV_KWARGS)},
        {"single": protocol},
    )


def requests(seeds, inference: InferenceSpec) -> list[RolloutRequest]:
    return [
        RolloutRequest(EnvSpec("arith"), ProtocolSpec("single"), env_seed=s, inference=inference)
        for s in seeds
    ]


def expert_answer(request, prompt_text: str) -> str:
    """Reads 'a+b=' from the rendered prompt and answers correctly."""
    question = prompt_text.rsplit("user\n", 1)[1].split("=", 1)[0]
    a, b = question.split("+")
    return str(int(a) + int(b))


def main(args: Args) -> None:
    torch.manual_seed(args.seed)
    tokenizer = build_tiny_tokenizer()
    template = HFChatTemplate(tokenizer)
    policy = build_tiny_causal_lm(tokenizer, seed=args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="ludic-arith-"))

    # 2. Demonstrations from a scripted expert.
    expert = make_engine(ScriptedChatClient(tokenizer, expert_answer), template, args.num_problems)
    demos = asyncio.run(
        expert.generate_rollouts(requests(range(args.num_problems), InferenceSpec()))
    )
    demo_path = write_rollouts_jsonl(demos, workdir / "demos.jsonl")
    print(f"wrote {len(demos)} expert demonstrations to {demo_path}")

    # 3. SFT warm start.
    sft = make_sft()
    sft_source = OfflineBatchSource(demo_path, credit_assigner=sft.credit_assigner, batch_size=32)
    sft_trainer = Trainer(policy, sft, sft_source, TrainerConfig(lr=args.sft_lr))
    sft_history = sft_trainer.train_sync(args.sft_steps)
    print(f"SFT loss {sft_history[0]['loss']:.3f} -> {sft_history[-1]['loss']:.3f}")

    # 4. GRPO: sample from a separate serving copy that the trainer syncs every step.
    serving = build_tiny_causal_lm(tokenizer, seed=args.seed)
    client = TransformersChatClient(serving, tokenizer)
    client.sync_weights(policy.state_dict(), version=0)
    engine = make_engine(client, template, args.num_problems)

    greedy = InferenceSpec(SamplingSpec(temperature=0.0, max_tokens=4), ReturnSpec.for_eval())
    evaluate = lambda: asyncio.run(  # noqa: E731
        run_eval(engine, requests(range(args.num_problems), greedy), default_reducers())
    )[0]
    print(f"greedy accuracy after SFT: {evaluate()['success_rate']:.2f}")

    grpo = make_grpo(group_size=args.group_size)
    sampling = InferenceSpec(SamplingSpec(temperature=1.0, max_tokens=4))
    step_seeds = iter(range(10**9))

    def next_requests() -> list[RolloutRequest]:
        first = next(step_seeds) * args.prompts_per_step
        seeds = [s % args.num_problems for s in range(first, first + args.prompts_per_step)]
        return requests(seeds, sampling)

    source = RolloutBatchSource(
        engine,
        next_requests,
        grpo.credit_assigner,
        request_strategy=GRPORequestStrategy(group_size=args.group_size),
    )
    trainer = Trainer(
        policy,
        grpo,
        source,
        TrainerConfig(lr=args.grpo_lr, publish_every=1),
        publisher=ClientPolicyPublisher(client),
        loggers=[
            RichConsoleLogger(
                keys=["batch/reward_mean", "loss", "grad_norm", "tokens_per_s"], every=10
            )
        ],
    )
    history = trainer.train_sync(args.grpo_steps)
    k = max(1, len(history) // 10)
    first = sum(m["batch/reward_mean"] for m in history[:k]) / k
    last = sum(m["batch/reward_mean"] for m in history[-k:]) / k
    print(f"GRPO sampled reward: first {k} steps {first:.2f} -> last {k} steps {last:.2f}")
    print(f"greedy accuracy after GRPO: {evaluate()['success_rate']:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in vars(Args()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    main(Args(**vars(parser.parse_args())))
