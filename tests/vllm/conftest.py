"""Real vLLM server tests (CPU is enough). ONE server per test session, on a tiny Qwen2
written by ``ludic.models.tiny.save_tiny_model``; it runs with an API key.

Every test module here starts with ``pytest.importorskip("vllm")``, so the directory is
skipped (with that reason) where vLLM is not installed. Deselect with ``-m "not vllm"``.

``ServedPolicy`` keeps a transformers copy of the weights the server should hold
(``mirror``): tests that sync update it, and every parity check compares against it.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from tests.vllm.helpers import API_KEY, ServedPolicy, assert_all_gone


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm: tests against a real vLLM server (CPU is enough)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("vllm", reason="vLLM is not installed")
    import psutil
    import torch
    from transformers import AutoModelForCausalLM

    from ludic.inference.vllm_client import VLLMChatClient
    from ludic.inference.vllm_utils import start_vllm_server
    from ludic.models.tiny import build_tiny_tokenizer, save_tiny_model

    root = tmp_path_factory.mktemp("vllm")
    model_dir = save_tiny_model(root / "model")
    started = time.monotonic()
    server = start_vllm_server(model_dir, api_key=API_KEY, log_path=root / "server.log")
    print(f"vLLM server up in {time.monotonic() - started:.1f}s ({server.log_path})")
    client = VLLMChatClient(server.url, api_key=API_KEY, timeout_s=60.0)
    mirror = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    try:
        client.init_weight_sync(master_port=server.group_port)
        yield ServedPolicy(server, client, mirror, build_tiny_tokenizer(), model_dir)
    finally:
        client.close()
        pids = [server.pid, *(p.pid for p in psutil.Process(server.pid).children(recursive=True))]
        server.stop()
        assert_all_gone(pids)
