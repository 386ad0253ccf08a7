"""The reward server's pure pieces, without a server: ``/score`` body validation, the
runner and model checks, and the start helpers' argument checks."""

from __future__ import annotations

import subprocess
import sys
from argparse import Namespace
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

from ludic.inference.vllm.process import start_vllm_server  # noqa: E402
from ludic.inference.vllm.reward_server import (  # noqa: E402
    ScoreBody,
    ScoreBodyError,
    check_reward_model,
    force_pooling_runner,
    parse_score_body,
)
from ludic.inference.vllm.server import ControlState, make_control_router  # noqa: E402


def _parse(body: dict) -> ScoreBody:
    return parse_score_body(
        body, served_models=["rm", "rm-alias"], pooling_type="last", vocab_size=10
    )


def test_a_minimal_body_gets_the_first_served_model_and_normalize_true():
    assert _parse({"input": ["a", [1, 9]]}) == ScoreBody(("a", (1, 9)), "rm", True)


def test_every_optional_field_is_accepted_when_it_fits_the_server():
    body = {
        "input": ["a"],
        "model": "rm-alias",
        "normalize": False,
        "pooling_type": "last",
        "return_hidden_states": False,
    }
    assert _parse(body) == ScoreBody(("a",), "rm-alias", False)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({}, "input is missing"),
        ({"input": None}, "input is missing"),
        ({"input": "a"}, "got one string"),
        ({"input": []}, "input must be a non-empty list"),
        ({"input": ("a",)}, "input must be a non-empty list"),
        ({"input": ["a", 1]}, "input[1] must be a string or a non-empty list"),
        ({"input": ["a", ""]}, "input[1] is an empty string"),
        ({"input": [[1], []]}, "input[1] must be a string or a non-empty list"),
        ({"input": [[1, 2.0]]}, "input[0][1] must be a token id"),
        ({"input": [[False]]}, "input[0][0] must be a token id"),
        ({"input": [[10]]}, "input[0][0]=10 is not a token id of this model (vocabulary size 10)"),
        ({"input": ["a"], "model": "other"}, "model='other' is not served here"),
        ({"input": ["a"], "normalize": 1}, "normalize must be true or false"),
        ({"input": ["a"], "pooling_type": "LAST"}, "pooling_type='LAST', but this server pools"),
        ({"input": ["a"], "pooling_type": "mean"}, "pooling_type='mean'"),
        ({"input": ["a"], "return_hidden_states": True}, "return_hidden_states=True"),
        ({"input": ["a"], "return_hidden_states": None}, "return_hidden_states=None"),
        ({"input": ["a"], "inputs": ["b"]}, "unknown field(s) ['inputs']"),
    ],
)
def test_bad_bodies_raise_naming_the_field(body, message):
    with pytest.raises(ScoreBodyError) as info:
        _parse(body)
    assert message in str(info.value)


def test_the_pooling_runner_is_forced_and_a_contradicting_one_refused():
    assert force_pooling_runner(Namespace(runner="auto")).runner == "pooling"
    assert force_pooling_runner(Namespace(runner="pooling")).runner == "pooling"
    for runner in ("generate", "draft"):
        with pytest.raises(SystemExit, match=f"--runner {runner} was given"):
            force_pooling_runner(Namespace(runner=runner))


def test_only_one_label_classifiers_are_served():
    config = SimpleNamespace(model="m", hf_config=SimpleNamespace(num_labels=1))
    check_reward_model(config, ("classify", "token_classify"))
    with pytest.raises(RuntimeError, match="not 'classify'"):
        check_reward_model(config, ("embed",))
    config.hf_config.num_labels = 2
    with pytest.raises(RuntimeError, match="num_labels=2"):
        check_reward_model(config, ("classify",))


def test_unknown_server_kinds_and_types_are_refused():
    with pytest.raises(ValueError, match="kind='critic'"):
        start_vllm_server("no-model", kind="critic")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="server_type='critic'"):
        make_control_router(None, ControlState(), server_type="critic")


def test_ludic_serve_reward_refuses_the_generate_runner(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # passes the model-folder check; never loaded
    result = subprocess.run(
        [sys.executable, "-m", "ludic", "serve", "reward", "--model", str(tmp_path)]
        + ["--runner", "generate"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "--runner pooling, but --runner generate was given" in result.stderr
