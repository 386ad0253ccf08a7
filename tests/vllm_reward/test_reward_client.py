"""``VLLMRewardClient`` against the session's real reward server: scoring parity, the model
version, and for every training mode a train -> publish -> score cycle in which the
server's scores equal the trained model's.

Each test leaves the server serving ``served_reward.mirror``'s weights (the other modules
compare against it)."""

from __future__ import annotations

import asyncio
import copy

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

import torch  # noqa: E402
from tests.vllm_reward.helpers import API_KEY, MAX_ABS_SCORE_DIFF, max_abs_diff  # noqa: E402

from ludic.distributed.reward_publisher import create_reward_publisher  # noqa: E402
from ludic.inference.reward_client import ScoringRequest, format_reward_input  # noqa: E402
from ludic.inference.vllm.http import VLLMServerError  # noqa: E402
from ludic.inference.vllm.reward_client import VLLMRewardClient  # noqa: E402
from ludic.run.demos import synthetic_arithmetic_preferences  # noqa: E402
from ludic.training.reward_model.config import PreferenceTrainerConfig
from ludic.training.reward_model.trainer import (
    LoraSettings,
    PreferenceTrainer,
    prepare_reward_model,
    reward_scores,
)

TEXTS = ["1+1=\n2", "3+4=\n9", "A longer text about rewards. " * 5, "x"]


@pytest.fixture
def client(served_reward):
    client = VLLMRewardClient(served_reward.url, api_key=API_KEY, timeout_s=60.0)
    yield client
    client.close()


def test_scores_equal_the_model_raw_and_normalized(client, served_reward) -> None:
    reference = served_reward.reference(TEXTS)
    raw = asyncio.run(client.score_batch(TEXTS, normalize=False))
    assert max_abs_diff(raw, reference) <= MAX_ABS_SCORE_DIFF
    normalized = asyncio.run(client.score_batch(TEXTS))  # normalize=True by default (spec)
    sigmoid = torch.sigmoid(torch.tensor(reference)).tolist()
    assert max_abs_diff(normalized, sigmoid) <= MAX_ABS_SCORE_DIFF


def test_token_ids_score_like_their_text(client, served_reward) -> None:
    ids = served_reward.tokenizer(TEXTS[1])["input_ids"]
    by_ids, by_text = asyncio.run(client.score_batch([ids, TEXTS[1]], normalize=False))
    assert abs(by_ids - by_text) <= MAX_ABS_SCORE_DIFF


def test_response_carries_the_model_version(client) -> None:
    response, info = asyncio.run(client.score(ScoringRequest(inputs=TEXTS[:2])))
    version = asyncio.run(client.get_model_version())
    assert response.model_version == version
    assert response.metadata["usage"]["prompt_tokens"] > 0
    assert info["status_code"] == 200


def test_bad_requests_fail_clearly(client) -> None:
    with pytest.raises(ValueError, match="expected a list of texts, got one string"):
        ScoringRequest(inputs="one text")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pooling_type='median'; expected one of"):
        ScoringRequest(inputs=["a"], pooling_type="median")  # not a pooling type at all
    with pytest.raises(VLLMServerError, match="pooling_type"):
        asyncio.run(client.score(ScoringRequest(inputs=["a"], pooling_type="mean")))
    with pytest.raises(VLLMServerError, match="model"):
        asyncio.run(client.score(ScoringRequest(inputs=["a"], model="not-served")))


def test_a_wrong_key_is_refused(served_reward) -> None:
    wrong = VLLMRewardClient(served_reward.url, api_key="wrong", timeout_s=10.0)
    try:
        with pytest.raises(VLLMServerError, match="401"):
            asyncio.run(wrong.score_batch(["a"]))
    finally:
        wrong.close()


# ------------------------------------------------------------------------------ train -> sync
def _pairs():
    return synthetic_arithmetic_preferences(64, seed=3)


def _texts(pairs) -> list[str]:
    return [format_reward_input(p.prompt, r) for p in pairs[:6] for r in (p.chosen, p.rejected)]


@pytest.mark.parametrize("mode", ["head_only", "lora", "full"])
def test_train_publish_and_the_server_scores_the_trained_model(client, served_reward, mode) -> None:
    mirror = served_reward.mirror
    start = copy.deepcopy(mirror)
    lora = LoraSettings(r=4, alpha=8) if mode == "lora" else None
    model = prepare_reward_model(copy.deepcopy(mirror), mode, lora=lora)

    client.init_weight_sync()
    publisher = create_reward_publisher(client, training_mode=mode)
    announced: list[list[str]] = []
    control = publisher.inner.control
    publisher.inner.control = _Recording(control, announced)
    config = PreferenceTrainerConfig(lr=5e-3, batch_size=16, publish_every=3)
    trainer = PreferenceTrainer(
        model, served_reward.tokenizer, _pairs(), config, training_mode=mode, publisher=publisher
    )
    trainer.train(3)  # publishes after step 3 as version 3

    texts = _texts(_pairs())
    with torch.no_grad():
        trained = reward_scores(model.eval(), served_reward.tokenizer, texts).tolist()
        untrained = reward_scores(start.eval(), served_reward.tokenizer, texts).tolist()
    served = asyncio.run(client.score_batch(texts, normalize=False))
    assert max_abs_diff(trained, untrained) > 1e-3  # training moved the scores
    assert max_abs_diff(served, trained) <= MAX_ABS_SCORE_DIFF
    assert asyncio.run(client.get_model_version()) == 3  # version = the trainer's step

    names = [name for chunk in announced for name in chunk]
    if mode == "head_only":
        assert names == ["score.weight"]  # the sync carries the head only
    else:
        assert sorted(names) == sorted(mirror.state_dict())
    # Serve the starting weights again (other modules compare against the mirror).
    client.sync_weights(start.state_dict(), training_mode="full")
    served = asyncio.run(client.score_batch(texts, normalize=False))
    assert max_abs_diff(served, untrained) <= MAX_ABS_SCORE_DIFF


def test_a_sync_that_does_not_fit_its_mode_sends_nothing(client, served_reward) -> None:
    client.init_weight_sync()
    version = asyncio.run(client.get_model_version())
    with pytest.raises(ValueError, match="HEAD_ONLY carries only head weights"):
        client.sync_weights(served_reward.mirror.state_dict(), training_mode="head_only")
    with pytest.raises(ValueError, match="carries the backbone too"):
        client.sync_weights({"score.weight": served_reward.mirror.score.weight}, version=99)
    assert asyncio.run(client.get_model_version()) == version
    # The group is still usable.
    client.sync_weights(
        {"score.weight": served_reward.mirror.score.weight},
        version=version + 1,
        training_mode="head_only",
    )
    assert asyncio.run(client.get_model_version()) == version + 1
    served = asyncio.run(client.score_batch(TEXTS, normalize=False))
    assert max_abs_diff(served, served_reward.reference(TEXTS)) <= MAX_ABS_SCORE_DIFF


class _Recording:
    """The client's control plane, recording the names of every announced chunk."""

    def __init__(self, inner, announced: list[list[str]]) -> None:
        self.inner, self.announced = inner, announced

    def announce(self, request) -> None:
        self.announced.append(list(request.names))
        self.inner.announce(request)

    def wait_until_applied(self, timeout_s: float) -> None:
        self.inner.wait_until_applied(timeout_s)
