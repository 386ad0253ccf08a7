"""The actor's vLLM clients follow the run's ``inference.vllm.partial_rollouts``: the
learner's publishes pause the servers the actors sample from, so an actor must continue
(or restart) what a pause aborts, as the learner's own client would."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from tests.faults.helpers import config

from ludic.pipeline import actor


@pytest.mark.parametrize("mode", ["continue", "restart", "off"])
def test_the_actors_clients_take_the_runs_partial_rollouts(
    tmp_path: Path, monkeypatch, mode: str
) -> None:
    run_config = config(
        tmp_path, "inference.backend=vllm", f"inference.vllm.partial_rollouts={mode}"
    )
    monkeypatch.setattr(actor, "_load_tokenizer", lambda config, run: "tokenizer")
    learner = {"inference_urls": ["http://127.0.0.1:9", "http://127.0.0.1:10"]}
    with contextlib.ExitStack() as stack:
        client, tokenizer, _ = actor._inference(run_config, None, learner, None, stack)
        servers = [s.client for s in client.servers]
        assert [c.partial_rollouts for c in servers] == [mode, mode]
        assert tokenizer == "tokenizer"
