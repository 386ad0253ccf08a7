"""The whole loop on a real tiny transformers model: env -> agent -> protocol -> engine ->
credit -> SAW items -> trainer -> published weights -> inference backend."""

from __future__ import annotations

import asyncio

import pytest
import torch

from ludic.agents import Agent
from ludic.context import FullDialog
from ludic.distributed import ClientPolicyPublisher
from ludic.envs import ArithmeticQAEnv, DatasetQAEnv
from ludic.inference import (
    HFChatTemplate,
    InferenceSpec,
    SamplingSpec,
    ScriptedChatClient,
    TransformersChatClient,
)
from ludic.interaction import SingleAgentProtocol
from ludic.models.tiny import build_tiny_causal_lm
from ludic.parsers import ParseResult
from ludic.training import (
    EnvSpec,
    GRPORequestStrategy,
    OfflineBatchSource,
    ProtocolSpec,
    RolloutBatchSource,
    RolloutEngine,
    RolloutRequest,
    Trainer,
    TrainerConfig,
    make_gmpo,
    make_grpo,
    make_gspo,
    make_sft,
    write_rollouts_jsonl,
)

SAMPLES = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (5, 5)]]


def ascii_fraction(prediction: str, target: str) -> float:
    """A dense toy reward a random model already varies on: share of ASCII characters."""
    return sum(c.isascii() for c in prediction) / max(len(prediction), 1)


def identity_parser(text: str) -> ParseResult:
    return ParseResult(action=text)


def _grpo_trainer(tokenizer, algorithm, group_size: int = 4, temperature: float = 1.0):
    policy = build_tiny_causal_lm(tokenizer, seed=0)
    serving = build_tiny_causal_lm(tokenizer, seed=0)  # the inference side's own copy
    client = TransformersChatClient(serving, tokenizer)
    template = HFChatTemplate(tokenizer)

    def single_agent_protocol() -> SingleAgentProtocol:
        agent = Agent(
            client=client, context=FullDialog(), parser=identity_parser, chat_template=template
        )
        return SingleAgentProtocol(agent)

    engine = RolloutEngine(
        {"qa": lambda: DatasetQAEnv(SAMPLES, verifier=ascii_fraction)},
        {"single": single_agent_protocol},
    )
    inference = InferenceSpec(SamplingSpec(temperature=temperature, max_tokens=6, seed=0))

    def requests() -> list[RolloutRequest]:
        return [
            RolloutRequest(EnvSpec("qa"), ProtocolSpec("single"), env_seed=s, inference=inference)
            for s in range(2)
        ]

    source = RolloutBatchSource(
        engine,
        requests,
        algorithm.credit_assigner,
        request_strategy=GRPORequestStrategy(group_size=group_size),
    )
    trainer = Trainer(
        policy,
        algorithm,
        source,
        TrainerConfig(lr=1e-2, publish_every=1, pad_token_id=tokenizer.pad_token_id),
        publisher=ClientPolicyPublisher(client),
    )
    return trainer, policy, serving, client


@pytest.mark.parametrize("make", [make_grpo, make_gspo, make_gmpo], ids=["grpo", "gspo", "gmpo"])
def test_a_group_step_on_a_toy_env_changes_weights_and_syncs_the_server(tiny_tokenizer, make):
    trainer, policy, serving, client = _grpo_trainer(tiny_tokenizer, make(group_size=4))
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}

    metrics = asyncio.run(trainer.train_step())

    assert any(not torch.equal(before[n], p) for n, p in policy.named_parameters())
    # Published as version 1, and the serving copy now holds exactly the trained weights.
    assert client.policy_version == 1 and metrics["policy_version"] == 1
    for (name, p), (_, s) in zip(policy.named_parameters(), serving.named_parameters()):
        assert torch.equal(p, s), name
    # 2 prompts x 4 samples, one turn each.
    assert metrics["num_items"] == 8


@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_backend_tokens_make_the_first_step_exactly_on_policy(tiny_tokenizer, temperature):
    """Token-in, token-out: the trainer rescoring the backend's own tokens reproduces the
    behaviour logprobs, so the PPO ratio is 1 and nothing is clipped; at temperature 1.3
    both sides take the policy softmax(logits / 1.3)."""
    trainer, *_ = _grpo_trainer(tiny_tokenizer, make_grpo(group_size=4), temperature=temperature)
    metrics = asyncio.run(trainer.train_step())
    assert metrics["loss/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["loss/approx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["loss/clip_frac"] == 0.0


def test_second_step_rolls_out_with_the_published_policy_and_times_its_stages(tiny_tokenizer):
    trainer, _, _, _ = _grpo_trainer(tiny_tokenizer, make_grpo(group_size=4))
    history = asyncio.run(trainer.train(2))
    rollouts = trainer.batch_source.last_rollouts
    versions = {s.trace.policy_version for r in rollouts for s in r.agent_steps}
    assert versions == {1}
    # Where step 2's time went (ludic.timing): every stage that ran has its seconds, and
    # the stages of the wait fit in it (they run one after the other here but for the env
    # and parser calls, which run on the event loop between sampling calls).
    last = history[-1]
    for stage in ("template", "sample", "env", "parser", "credit", "logging"):
        assert last[f"time/stage/{stage}_s"] > 0, stage
    inside = sum(last[f"time/stage/{s}_s"] for s in ("template", "sample", "env", "parser"))
    assert inside < last["time/wait_s"]


def test_sft_on_offline_demonstrations_lowers_the_loss(tiny_tokenizer, tmp_path):
    """Scripted 'expert' answers arithmetic correctly; SFT on its rollouts learns them."""
    env_kwargs = {"num_problems": 8, "max_digits": 1, "operators": ("+",)}
    answers = {}
    for seed in range(8):
        env = ArithmeticQAEnv(**env_kwargs)
        obs, info = env.reset(seed)["agent_0"]
        a, b = obs.rstrip("=").split("+")
        answers[obs] = str(int(a) + int(b))

    def expert(request, prompt_text: str) -> str:
        question = next(q for q in answers if q in prompt_text)
        return answers[question]

    template = HFChatTemplate(tiny_tokenizer)
    client = ScriptedChatClient(tiny_tokenizer, expert)

    def protocol() -> SingleAgentProtocol:
        agent = Agent(
            client=client, context=FullDialog(), parser=identity_parser, chat_template=template
        )
        return SingleAgentProtocol(agent)

    engine = RolloutEngine({"arith": lambda: ArithmeticQAEnv(**env_kwargs)}, {"single": protocol})
    requests = [
        RolloutRequest(EnvSpec("arith"), ProtocolSpec("single"), env_seed=s) for s in range(8)
    ]
    rollouts = asyncio.run(engine.generate_rollouts(requests))
    assert all(r.total_reward == 1.0 for r in rollouts)  # the expert is right
    path = write_rollouts_jsonl(rollouts, tmp_path / "demos.jsonl")

    algorithm = make_sft()
    source = OfflineBatchSource(path, credit_assigner=algorithm.credit_assigner, batch_size=8)
    model = build_tiny_causal_lm(tiny_tokenizer, seed=0)
    trainer = Trainer(model, algorithm, source, TrainerConfig(lr=3e-3))
    losses = [m["loss"] for m in trainer.train_sync(30)]
    assert losses[-1] < 0.5 * losses[0]
