"""Pipeline RL: an actor generates GRPO batches into Redis while a learner trains on them.

    python examples/pipeline_rl.py                       # starts a local redis-server
    python examples/pipeline_rl.py --steps 4 --prompts-per-step 2 --group-size 2   # smoke run
    python examples/pipeline_rl.py --redis-url redis://localhost:6379/0 --prefix run1

Reads top to bottom (one process and two threads, to keep it in one file):
  1. a tiny Qwen2 + byte tokenizer (nothing downloaded); a serving copy of the policy behind
     the in-process transformers backend;
  2. Redis: a local redis-server with an fsync-always AOF (or yours, with --redis-url); a
     RedisBatchQueue per side, sharing one key prefix;
  3. actor thread: RolloutBatchSource (arithmetic env, GRPO groups) -> run_pipeline_actor,
     which claims a batch index, waits until it is at most max_staleness batches ahead of
     the learner, generates, and pushes (blocking while the queue is full);
  4. learner (main thread): PipelineBatchSource -> Trainer (GRPO) -> publish the weights
     to the serving copy -> mark_trained (the acknowledgement that makes the batch count
     as trained; a crash before it puts the batch back in the queue).

In a real deployment actor and learner are separate processes or machines, the serving
copy is a vLLM server and the publisher a broadcast publisher; the Redis part is the same.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import tempfile
import threading
from dataclasses import dataclass

import torch

from ludic.agents import Agent
from ludic.context import FullDialog
from ludic.distributed import ClientPolicyPublisher
from ludic.envs import ArithmeticQAEnv
from ludic.inference import HFChatTemplate, InferenceSpec, SamplingSpec, TransformersChatClient
from ludic.interaction import SingleAgentProtocol
from ludic.models.tiny import build_tiny_causal_lm, build_tiny_tokenizer
from ludic.parsers import ParseResult
from ludic.pipeline import (
    PipelineBatchSource,
    RedisBatchQueue,
    run_pipeline_actor,
    start_redis_server,
)
from ludic.training import (
    DataExhausted,
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


@dataclass
class Args:
    steps: int = 30
    """batches the actor produces (the learner trains on each one that is fresh enough)"""
    lr: float = 5e-4
    prompts_per_step: int = 4
    """distinct problems per batch"""
    group_size: int = 4
    """samples per problem (GRPO group)"""
    max_staleness: int = 1
    """train on no token older than learner version - max_staleness"""
    max_queued: int = 2
    """batches waiting in Redis before the actor blocks"""
    redis_url: str = ""
    """an existing Redis; empty: start a local redis-server in a temporary folder"""
    prefix: str = "pipeline-demo"
    """key prefix: several runs can share one Redis"""
    seed: int = 0


def answer_parser(text: str) -> ParseResult:
    """The whole completion is the answer; an empty one is a format failure."""
    text = text.strip()
    if not text:
        return ParseResult(action=None, reward=-0.1, obs="Answer with a number.")
    return ParseResult(action=text)


def make_actor_source(client, template, args: Args, credit_assigner) -> RolloutBatchSource:
    def protocol() -> SingleAgentProtocol:
        agent = Agent(
            client=client, context=FullDialog(), parser=answer_parser, chat_template=template
        )
        return SingleAgentProtocol(agent)

    env = lambda: ArithmeticQAEnv(num_problems=100, operators=("+",), max_digits=1)  # noqa: E731
    engine = RolloutEngine({"arith": env}, {"single": protocol})
    sampling = InferenceSpec(SamplingSpec(temperature=1.0, max_tokens=4))
    seeds = itertools.count()

    def requests() -> list[RolloutRequest]:
        return [
            RolloutRequest(
                EnvSpec("arith"), ProtocolSpec("single"), env_seed=next(seeds) % 100,
                inference=sampling,
            )
            for _ in range(args.prompts_per_step)
        ]  # fmt: skip

    return RolloutBatchSource(
        engine,
        requests,
        credit_assigner,
        request_strategy=GRPORequestStrategy(group_size=args.group_size),
    )


def run_actor(source: RolloutBatchSource, queue: RedisBatchQueue, client, args: Args) -> None:
    pushed = asyncio.run(
        run_pipeline_actor(
            source,
            queue,
            actor_id="actor-0",
            max_staleness=args.max_staleness,
            num_batches=args.steps,
            policy_version=lambda: client.policy_version,
        )
    )
    queue.close_producing()  # the learner stops once the queue is empty
    print(f"actor: pushed {len(pushed)} batches")


async def learn(trainer: Trainer, source: PipelineBatchSource) -> None:
    while True:
        try:
            metrics = await trainer.train_step()
        except DataExhausted:
            return
        print(
            f"learner step {trainer.step}: reward {metrics['reward/mean']:+.2f}  "
            f"staleness max {metrics['batch/pipeline_staleness_max']:.0f}  "
            f"dropped stale {metrics['batch/pipeline_dropped_stale']:.0f}"
        )


def main(args: Args) -> None:
    torch.manual_seed(args.seed)
    tokenizer = build_tiny_tokenizer()
    template = HFChatTemplate(tokenizer)
    policy = build_tiny_causal_lm(tokenizer, seed=args.seed)
    client = TransformersChatClient(build_tiny_causal_lm(tokenizer, seed=args.seed), tokenizer)
    client.sync_weights(policy.state_dict(), version=0)

    server = None
    if not args.redis_url:
        server = start_redis_server(tempfile.mkdtemp(prefix="ludic-redis-"))
    url = args.redis_url or server.url
    try:
        grpo = make_grpo(group_size=args.group_size)
        learner_queue = RedisBatchQueue(url, prefix=args.prefix, max_queued=args.max_queued)
        learner_queue.purge()  # a new run: forget what an earlier one left under this prefix
        source = PipelineBatchSource(learner_queue, max_staleness=args.max_staleness)
        trainer = Trainer(
            policy,
            grpo,
            source,
            TrainerConfig(lr=args.lr, publish_every=1),
            publisher=ClientPolicyPublisher(client),
        )
        trainer.step = source.version  # the learner starts first: requeue, announce

        actor_queue = RedisBatchQueue(url, prefix=args.prefix, max_queued=args.max_queued)
        actor_source = make_actor_source(client, template, args, grpo.credit_assigner)
        actor = threading.Thread(target=run_actor, args=(actor_source, actor_queue, client, args))
        actor.start()
        asyncio.run(learn(trainer, source))
        actor.join()
        c = learner_queue.counters()
        print(
            f"trained {c['trained_batches']} batches, dropped {c['dropped_batches']} whole "
            f"batches and {c['dropped_items']} stale items; policy version {trainer.step}"
        )
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in vars(Args()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    main(Args(**vars(parser.parse_args())))
