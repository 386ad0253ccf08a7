"""Issue 9, part 2: ``ludic train`` started its vLLM server with no key and had no config
field for one, and a key in the environment (``LUDIC_API_KEY``) broke the run with HTTP
401 after 31 s. Now a server ludic starts gets ``inference.vllm.api_key``, else the
environment's key, else a fresh random one; the clients send it; it is never written to
the run directory, the server log or the server's command line. A run with the key in
the environment is ``tests/vllm/test_vllm_train.py``'s first (one vLLM start-up less)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ludic.run.config import VLLMConfig
from ludic.run.loading import load_config
from ludic.run.servers import server_api_key

DEMO = Path(__file__).parents[2] / "src" / "ludic" / "configs" / "arithmetic_demo.yaml"


def test_the_key_comes_from_the_field_then_the_environment_then_chance(monkeypatch):
    monkeypatch.delenv("LUDIC_API_KEY", raising=False)
    first, second = server_api_key(VLLMConfig()), server_api_key(VLLMConfig())
    assert first and second and first != second and len(first) >= 32
    assert server_api_key(VLLMConfig(start_server=False, port=8000)) is None
    monkeypatch.setenv("LUDIC_API_KEY", "from-env")
    assert server_api_key(VLLMConfig()) == "from-env"
    assert server_api_key(VLLMConfig(api_key="from-field")) == "from-field"


def test_the_key_field_is_neither_saved_nor_shown():
    config = load_config(DEMO, ["inference.vllm.api_key=s3cret-field"])
    assert config.inference.vllm.api_key == "s3cret-field"
    assert "s3cret-field" not in repr(config)
    assert "s3cret-field" not in str(config.model_dump(mode="json"))


@pytest.mark.vllm
def test_a_started_server_gets_a_random_key_that_only_the_client_knows(tmp_path, monkeypatch):
    pytest.importorskip("vllm", reason="vLLM is not installed")
    import httpx
    import psutil

    from ludic.inference.vllm.client import VLLMChatClient
    from ludic.models.tiny import save_tiny_model
    from ludic.run.servers import vllm_server_client

    monkeypatch.delenv("LUDIC_API_KEY", raising=False)
    model_dir = save_tiny_model(tmp_path / "model")
    seen: dict[str, str | None] = {}

    def connect(url: str, timeout_s: float, key: str | None) -> VLLMChatClient:
        seen["url"], seen["key"] = url, key
        return VLLMChatClient(url, timeout_s=timeout_s, api_key=key)

    with vllm_server_client(
        VLLMConfig(),
        kind="policy",
        field="inference.vllm",
        model=model_dir,
        cuda=False,
        log_dir=tmp_path,
        connect=connect,
    ) as client:
        key, url = seen["key"], seen["url"]
        assert key
        assert client.get_policy_version() == 0  # the weight-sync group formed with it
        assert httpx.get(f"{url}/get_world_size").status_code == 401
        assert httpx.get(f"{url}/health").status_code == 200
        server = next(p for p in psutil.Process().children() if "serve" in " ".join(p.cmdline()))
        assert key not in " ".join(server.cmdline())
    assert key not in (tmp_path / "vllm_server.log").read_text(errors="replace")
