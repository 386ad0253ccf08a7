"""Process helpers and dead / silent servers: the client fails within its timeout (never
hangs) and a server that exits is reported with its error line. (A server killed mid-sync:
``test_vllm_verify.py``, which restarts the session server after the kill.)"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")


from ludic.distributed.weight_transfer.groups import free_port
from ludic.inference.request import CompletionRequest  # noqa: E402
from ludic.inference.vllm.client import VLLMChatClient  # noqa: E402
from ludic.inference.vllm.process import (  # noqa: E402
    ServerExitedError,
    log_error_line,
    start_vllm_server,
    wait_for_vllm_health,
)


def test_nothing_listening_raises_connection_error_quickly():
    client = VLLMChatClient(port=free_port(), timeout_s=5, max_retries=2)
    started = time.monotonic()
    with pytest.raises(ConnectionError, match="unreachable"):
        asyncio.run(client.complete(CompletionRequest((1, 2, 3))))
    with pytest.raises(ConnectionError, match="unreachable"):
        client.get_policy_version()
    assert time.monotonic() - started < 5
    client.close()


def test_a_server_that_never_answers_raises_timeout_error_within_timeout():
    with socket.socket() as silent:  # accepts connections (backlog) but never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        client = VLLMChatClient(port=port, model="m", timeout_s=1.0)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="did not answer"):
            asyncio.run(client.complete(CompletionRequest((1, 2, 3))))
        with pytest.raises(TimeoutError):
            client.get_policy_version()
        assert time.monotonic() - started < 5
        client.close()


def test_health_wait_reports_the_servers_error_line_when_it_exits(tmp_path):
    log = tmp_path / "server.log"
    started = time.monotonic()
    with pytest.raises(ServerExitedError) as info:
        start_vllm_server(tmp_path / "no-such-model", log_path=log, health_timeout_s=120)
    message = str(info.value)
    assert info.value.returncode == 2 and "\n" not in message
    assert message.endswith(
        f"exited with code 2 before becoming healthy: error: --model "
        f"{str(tmp_path / 'no-such-model')!r}: no such folder; give a Hugging Face model "
        f"folder (log: {log})"
    )
    assert time.monotonic() - started < 120


def test_the_error_line_is_the_last_error_then_exception_then_any_line(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(
        "INFO starting\nTraceback (most recent call last):\n  File x\n"
        "(EngineCore pid=7) ValueError: head size 16 is not supported\nINFO shutting down\n"
    )
    assert log_error_line(log) == "(EngineCore pid=7) ValueError: head size 16 is not supported"
    log.write_text("usage: x [--a]\n       [--b]\nx: error: unrecognized arguments: --c\n")
    assert log_error_line(log) == "x: error: unrecognized arguments: --c"
    log.write_text("INFO one\n" + "Killed " * 100 + "\n\n")
    assert log_error_line(log, limit=20) == "Killed Killed Kil..."
    assert log_error_line(tmp_path / "missing.log") == ""


def test_health_wait_times_out_with_a_clear_error():
    with pytest.raises(TimeoutError, match="not healthy after"):
        wait_for_vllm_health(f"http://127.0.0.1:{free_port()}", timeout_s=1.0)
