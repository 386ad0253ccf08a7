"""Real vLLM server tests (CPU is enough). ONE server per test session, on a tiny Qwen2
written by ``ludic.models.tiny.save_tiny_model``; it runs with an API key.

Every test module here starts with ``pytest.importorskip("vllm")``, so the directory is
skipped (with that reason) where vLLM is not installed. Deselect with ``-m "not vllm"``.

The session's policy server is the ``served`` fixture of ``tests/conftest.py`` (shared with
the reward-server tests, which run a policy server side by side). ``ServedPolicy`` keeps a transformers copy of the weights the server should hold
(``mirror``): tests that sync update it, and every parity check compares against it.
"""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm: tests against a real vLLM server (CPU is enough)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)
