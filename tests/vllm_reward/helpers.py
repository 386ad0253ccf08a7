"""Shared helpers of the reward-server tests (see ``conftest.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.vllm.helpers import API_KEY  # one key for the session's servers

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_ABS_SCORE_DIFF = 1e-4


@dataclass
class ServedRewardModel:
    """The session's reward server and a transformers copy of the weights it serves.

    ``mirror`` is an ``AutoModelForSequenceClassification`` (one label); tests that sync
    weights update it, and every parity check compares against it.
    """

    server: Any  # VLLMServerProcess (kind="reward")
    model_dir: Path
    mirror: Any
    tokenizer: Any

    @property
    def url(self) -> str:
        return self.server.url

    def post_score(self, body: Any, *, headers: dict[str, str] | None = None) -> Any:
        """``POST /score`` with the API key; returns the ``httpx.Response``."""
        import httpx

        return httpx.post(f"{self.url}/score", json=body, headers=headers or AUTH, timeout=60)

    def scores(self, inputs: list[Any], **fields: Any) -> list[float]:
        """``/score`` of ``inputs`` (raises on a non-200 answer)."""
        response = self.post_score({"input": inputs, **fields})
        assert response.status_code == 200, response.text
        data = response.json()["data"]
        assert [d["index"] for d in data] == list(range(len(inputs)))
        return [d["score"] for d in data]

    def reference(self, inputs: list[Any]) -> list[float]:
        """Raw scores (``logits[:, 0]``) of ``mirror``, one sequence at a time."""
        import torch

        out = []
        for x in inputs:
            ids = self.tokenizer(x)["input_ids"] if isinstance(x, str) else list(x)
            with torch.no_grad():
                out.append(float(self.mirror(torch.tensor([ids])).logits[0, 0]))
        return out


def max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


REWARD_MODEL_DIR = "model"
"""The reward model's folder under the server's root (its log: ``root / "server.log"``)."""


def start_reward_server(root: Path, *, wait: bool):
    """The session's reward server (``ludic serve reward`` with the key) on a tiny reward
    model written to ``root / "model"``; ``wait=False`` returns while it starts."""
    from ludic.inference.vllm.process import start_vllm_server
    from ludic.models.tiny import save_tiny_reward_model

    model_dir = save_tiny_reward_model(root / REWARD_MODEL_DIR)
    return start_vllm_server(
        model_dir, kind="reward", api_key=API_KEY, log_path=root / "server.log", wait=wait
    )
