"""Real vLLM reward-server tests (CPU is enough). ONE server per test session
(``ludic serve reward``, with an API key) on a tiny one-label Qwen2 sequence classifier
written by ``ludic.models.tiny.save_tiny_reward_model``.

Every test module here starts with ``pytest.importorskip("vllm")``, so the directory is
skipped (with that reason) where vLLM is not installed. Deselect with ``-m "not vllm"``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from tests.vllm_reward.helpers import (
    REWARD_MODEL_DIR,
    ServedRewardModel,
    start_reward_server,
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def served_reward(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("vllm", reason="vLLM is not installed")
    import psutil
    import torch
    from tests.session_servers import take_early
    from tests.vllm.helpers import assert_all_gone
    from transformers import AutoModelForSequenceClassification

    from ludic.models.tiny import build_tiny_tokenizer

    started = time.monotonic()
    server = take_early(request.config, "served_reward")  # started with the policy server
    if server is None:
        server = start_reward_server(tmp_path_factory.mktemp("vllm_reward"), wait=True)
    else:
        server.wait_until_healthy()
    print(f"vLLM reward server up in {time.monotonic() - started:.1f}s ({server.log_path})")
    model_dir = Path(server.log_path).parent / REWARD_MODEL_DIR
    mirror = AutoModelForSequenceClassification.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    try:
        yield ServedRewardModel(server, model_dir, mirror, build_tiny_tokenizer())
    finally:
        pids = [server.pid, *(p.pid for p in psutil.Process(server.pid).children(recursive=True))]
        server.stop()
        assert_all_gone(pids)
