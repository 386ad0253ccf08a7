"""OpenEnv environments: ``ludic train`` with docs/envs/openenv.md's config (the
environment of OpenEnv's own classes, served by ludic on loopback); the same environment
served by a separate process and reached by ``base_url`` with a typed client; invalid
actions, a raising environment and a dead server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("openenv.core", reason="OpenEnv is not installed")

from tests.envs.pages import write_page_files  # noqa: E402
from tests.http_helpers import wait_healthy  # noqa: E402
from tests.tiny_run import TINY_RUN  # noqa: E402

from ludic import jobs  # noqa: E402
from ludic.distributed.weight_transfer.groups import free_port  # noqa: E402
from ludic.envs.openenv_env import OpenEnvEnv  # noqa: E402
from ludic.run.loading import load_config, validate_config  # noqa: E402
from ludic.run.preflight import check_config  # noqa: E402

# A typed client for the page's environment, and an app module for a separate server.
CLIENT = """
from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server import State

from guess import GuessAction, GuessObservation


class GuessClient(EnvClient[GuessAction, GuessObservation, State]):
    def _step_payload(self, action):
        return action.model_dump(exclude={"metadata"})

    def _parse_result(self, payload):
        observation = GuessObservation(**payload["observation"], done=payload["done"])
        return StepResult(observation=observation, reward=payload.get("reward"), done=payload["done"])

    def _parse_state(self, payload):
        return State(**payload)
"""
APP = """
from openenv.core.env_server import create_fastapi_app

from guess import GuessAction, GuessNumber, GuessObservation


class Exploding(GuessNumber):
    def step(self, action, timeout_s=None, **kwargs):
        if action.guess == 7:
            raise ValueError("the simulator crashed")
        if action.guess == 8:  # the environment's own bug: a validation error inside step
            return GuessObservation(feedback=None)
        return super().step(action, timeout_s=timeout_s, **kwargs)


app = create_fastapi_app(Exploding, GuessAction, GuessObservation, max_concurrent_envs=8)
"""


def test_the_openenv_page_trains(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = write_page_files("openenv.md", tmp_path)
    run_dir = jobs.train(load_config(config, [f"output_dir={tmp_path}", *TINY_RUN]))
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8  # 2 steps x 2 prompts x 2 samples
    for rollout in samples:
        env_steps = [s for s in rollout["steps"] if s["kind"] == "env"]
        assert env_steps[0]["prev_obs"] == "Guess a digit."
        # the tiny model's text is no digit: the server refuses it, the episode goes on
        assert all(s["info"].get("invalid_action") for s in env_steps)
        assert env_steps[-1]["next_obs"].startswith("Invalid action: guess: Input should be")
        assert rollout["truncated"] and rollout["total_reward"] == 0.0


def test_a_separate_server_a_typed_client_and_failures(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    write_page_files("openenv.md", tmp_path)
    (tmp_path / "guess_client.py").write_text(CLIENT)
    (tmp_path / "guess_app.py").write_text(APP)
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "guess_app:app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, server)
        # the two-line config of a running server builds (docs/envs/index.md)
        two_lines = {"env": {"kind": "openenv", "kwargs": {"base_url": url}}}
        check_config(validate_config({**two_lines, "warm_start": {"steps": 0}}))
        env = OpenEnvEnv(base_url=url, client="guess_client.py:GuessClient")
        assert env.action_field == "guess"  # from the server's /schema
        obs, _ = env.reset(seed=3)["agent_0"]
        assert obs == "Guess a digit."
        wrong = env.step({"agent_0": "seven"})["agent_0"]  # refused by the typed client
        assert wrong.info["invalid_action"] and not wrong.terminated and wrong.reward == 0.0
        target = __import__("random").Random(3).randint(0, 9)
        guess = 0 if target != 0 else 1
        hint = env.step({"agent_0": str(guess)})["agent_0"]
        assert hint.obs == ("higher" if guess < target else "lower") and hint.reward == 0.0
        hit = env.step({"agent_0": str(target)})["agent_0"]
        assert hit.obs == "correct" and hit.reward == 1.0 and hit.terminated
        env.close()
        # the same seed is the same episode, in a new session
        again = OpenEnvEnv(base_url=url, observation_template="[{feedback}]")
        again.reset(seed=3)
        assert again.step({"agent_0": str(target)})["agent_0"].obs == "[correct]"
        again.close()
        # text the schema's type refuses is an invalid action, checked before sending
        generic = OpenEnvEnv(base_url=url)
        generic.reset(seed=3)
        refused = generic.step({"agent_0": "seven"})["agent_0"]
        assert refused.obs == "Invalid action: guess must be an integer"
        # an environment that raises fails the episode, loudly, even with a validation error
        with pytest.raises(RuntimeError, match=f"OpenEnv step on {url}: .*the simulator crashed"):
            generic.step({"agent_0": "7"})
        with pytest.raises(RuntimeError, match="VALIDATION_ERROR.*set env.kwargs.action"):
            generic.step({"agent_0": "8"})
        generic.close()
        # a server that stops answering is an error after message_timeout_s, not a hang
        hung = OpenEnvEnv(base_url=url, action_field="guess", message_timeout_s=2)
        hung.reset(seed=1)
        server.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=f"OpenEnv step on {url}: TimeoutError"):
            hung.step({"agent_0": "1"})
        assert time.monotonic() - started < 10
        server.send_signal(signal.SIGCONT)
        # a dead server: the session's next call fails at once
        dead = OpenEnvEnv(base_url=url, action_field="guess")
        dead.reset(seed=1)
        server.kill()
        server.wait()
        with pytest.raises(RuntimeError, match=f"OpenEnv step on {url}: ConnectionClosed"):
            dead.step({"agent_0": "1"})
    finally:
        server.kill()
        server.wait()
    with pytest.raises(ValueError, match="base_url .* or environment"):
        OpenEnvEnv()
    with pytest.raises(ValueError, match="needs action and observation"):
        OpenEnvEnv(environment="guess.py:GuessNumber")
