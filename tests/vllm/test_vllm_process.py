"""Process helpers and dead / silent servers: the client fails within its timeout (never
hangs), a server killed mid-sync surfaces as an error, and ``stop()`` leaves no orphans."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

import psutil  # noqa: E402
from tests.vllm.helpers import assert_all_gone  # noqa: E402

from ludic.distributed.weight_transfer import ModelWeightExtractor  # noqa: E402
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


def test_server_killed_mid_sync_raises_within_the_timeout_and_leaves_no_orphans(served):
    """A second, separate server: its API process is SIGKILLed after the trainer announced
    a few chunks. The sync raises within the client timeout; stop() reaps the engine and
    worker processes the dead API process left behind."""
    import torch  # noqa: F401 - loaded already by the session fixture

    server = start_vllm_server(served.model_dir, log_path=served.model_dir.parent / "kill.log")
    pids = [server.pid, *(p.pid for p in psutil.Process(server.pid).children(recursive=True))]
    assert len(pids) >= 3  # API server, engine core, worker(s)
    timeout_s = 20.0
    client = VLLMChatClient(server.url, timeout_s=timeout_s, max_retries=2)
    try:
        client.init_weight_sync(master_port=server.group_port)
        publisher = client.publisher
        publisher.extractor = ModelWeightExtractor(chunk_bytes=20_000)
        inner = publisher.control
        announced = threading.Event()

        class KillAfterThirdAnnounce:
            count = 0

            def announce(self, request):
                inner.announce(request)
                self.count += 1
                if self.count == 3:
                    os.kill(server.pid, signal.SIGKILL)  # only the API server process
                    announced.set()

            def wait_until_applied(self, timeout_s):
                inner.wait_until_applied(timeout_s)

        publisher.control = KillAfterThirdAnnounce()
        started = time.monotonic()
        with pytest.raises((ConnectionError, TimeoutError, RuntimeError)):
            client.sync_weights(served.mirror.state_dict(), version=1)
        assert announced.is_set()
        assert time.monotonic() - started < timeout_s + 10
        started = time.monotonic()
        with pytest.raises(ConnectionError):
            asyncio.run(client.complete(CompletionRequest((1, 2, 3))))
        assert time.monotonic() - started < timeout_s
    finally:
        client.close()
        server.stop()
    assert_all_gone(pids)
    assert not server.is_running()
