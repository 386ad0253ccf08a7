"""Issue 9, part 2: ``ludic train`` started its vLLM server with no key and had no config
field for one, and a key in the environment (``LUDIC_API_KEY``) broke the run with HTTP
401 after 31 s. Now a server ludic starts gets ``inference.vllm.api_key``, else the
environment's key, else a fresh random one; the clients send it; it is never written to
the run directory, the server log or the server's command line. On real servers (no
start-up of their own): a run with the key in the environment is
``tests/vllm/test_vllm_train.py``'s first; a server started with no key, and the random
one it gets, ``tests/vllm/test_vllm_lora.py``'s."""

from __future__ import annotations

from pathlib import Path

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
