"""to_openai_params: InferenceSpec -> OpenAI/vLLM completion request parameters."""

from __future__ import annotations

import pytest

from ludic.inference.request import InferenceSpec, ReturnSpec, SamplingSpec
from ludic.inference.sampling import to_openai_params


def test_rl_spec_asks_for_token_ids_and_chosen_token_logprobs() -> None:
    params = to_openai_params(InferenceSpec(sampling=SamplingSpec(temperature=0.7, top_p=0.9)))
    assert params == {
        "temperature": 0.7,
        "top_p": 0.9,
        "max_tokens": 256,
        "logprobs": 0,
        "return_token_ids": True,
    }


def test_eval_spec_omits_logprobs_and_token_ids() -> None:
    params = to_openai_params(InferenceSpec(returns=ReturnSpec.for_eval()))
    assert "logprobs" not in params and "return_token_ids" not in params


def test_token_ids_without_logprobs() -> None:
    spec = InferenceSpec(returns=ReturnSpec(return_token_ids=True, return_logprobs=False))
    params = to_openai_params(spec)
    assert params["return_token_ids"] is True and "logprobs" not in params


def test_optional_sampling_fields_appear_only_when_set() -> None:
    spec = InferenceSpec(sampling=SamplingSpec(top_k=20, max_tokens=64, stop=("\n\n",), seed=3))
    params = to_openai_params(spec)
    assert params["top_k"] == 20
    assert params["max_tokens"] == 64
    assert params["stop"] == ["\n\n"]
    assert params["seed"] == 3
    default = to_openai_params(InferenceSpec())
    assert not {"top_k", "stop", "seed"} & set(default)


def test_max_think_goes_to_vllm_xargs() -> None:
    assert to_openai_params(InferenceSpec(max_think=128))["vllm_xargs"] == {"max_think": 128}


def test_extra_is_merged_and_vllm_xargs_dicts_combine() -> None:
    spec = InferenceSpec(max_think=8, extra={"min_tokens": 2, "vllm_xargs": {"other": 1}})
    params = to_openai_params(spec)
    assert params["min_tokens"] == 2
    assert params["vllm_xargs"] == {"max_think": 8, "other": 1}


def test_extra_colliding_with_a_spec_field_raises() -> None:
    with pytest.raises(ValueError, match=r"extra\['temperature'\]"):
        to_openai_params(InferenceSpec(extra={"temperature": 0.0}))


def test_extra_vllm_xargs_colliding_with_max_think_raises() -> None:
    with pytest.raises(ValueError, match="max_think"):
        to_openai_params(InferenceSpec(max_think=4, extra={"vllm_xargs": {"max_think": 9}}))
