"""Issue 9, part 3 ("No orphans, no hangs"): a busy weight-sync group port took 148 s to
fail. Now the trainer's side checks the port before it hosts the rendezvous (and before it
asks the server to join), and fails within a second, naming the port."""

from __future__ import annotations

import socket
import time

import pytest

from ludic.distributed.weight_transfer import GroupPortBusyError, init_process_group


@pytest.fixture
def busy_port():
    """A port held by a real listening socket for the test's duration."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


def test_group_on_a_busy_port_fails_within_seconds_naming_the_port(busy_port):
    started = time.monotonic()
    with pytest.raises(GroupPortBusyError, match=rf"group port {busy_port} on 127\.0\.0\.1"):
        init_process_group(
            master_addr="127.0.0.1", master_port=busy_port, rank=0, world_size=2, timeout_s=120
        )
    assert time.monotonic() - started < 3


def test_client_weight_sync_on_a_busy_port_fails_before_contacting_the_server(busy_port):
    """The server URL is dead on purpose: the port check comes before any HTTP call, so
    the error names the port rather than an unreachable server."""
    pytest.importorskip("httpx")
    from ludic.distributed.weight_transfer.groups import free_port
    from ludic.inference.vllm.client import VLLMChatClient

    client = VLLMChatClient(port=free_port(), timeout_s=120, max_retries=0)
    started = time.monotonic()
    try:
        with pytest.raises(GroupPortBusyError, match=f"port {busy_port}"):
            client.init_weight_sync(backend="gloo", master_port=busy_port)
    finally:
        client.close()
    assert time.monotonic() - started < 3
