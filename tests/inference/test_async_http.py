"""ludic's HTTP plumbing against real local HTTP servers: AsyncHTTP's pools
(``max_connections`` split into small httpx pools, each request through the least busy one,
every connection counted), and what is sent again when a server drops a connection before
answering (reads only)."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import threading
import time
from collections.abc import Iterator

import pytest

from ludic.inference.vllm.http import POOL_SHARD_CONNECTIONS, AsyncHTTP, VLLMControlPlane


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, so connections are pooled
    peers: set[tuple[str, int]] = set()
    in_flight = 0
    most_in_flight = 0
    lock = threading.Lock()

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        cls = type(self)
        with cls.lock:
            cls.peers.add(self.client_address)
            cls.in_flight += 1
            cls.most_in_flight = max(cls.most_in_flight, cls.in_flight)
        self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(0.05)
        body = json.dumps({"ok": True}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        with cls.lock:
            cls.in_flight -= 1

    def log_message(self, *args: object) -> None:
        pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # the listen backlog: every connection at once, even on a busy machine


@pytest.fixture
def server() -> Iterator[str]:
    httpd = _Server(("127.0.0.1", 0), _Handler)
    _Handler.peers, _Handler.in_flight, _Handler.most_in_flight = set(), 0, 0
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_requests_spread_over_small_pools_within_max_connections(server: str) -> None:
    max_connections = 2 * POOL_SHARD_CONNECTIONS + 3  # three pools (12 + 12 + 11 at 16)
    client = AsyncHTTP(server, max_connections=max_connections)

    async def main() -> tuple[list[int], list[int]]:
        responses = await asyncio.gather(*(client.post("/x", {"i": i}) for i in range(100)))
        pools = client._pools()
        assert [p.in_flight for p in pools] == [0] * len(pools)  # nothing leaked
        sizes = [p.client._transport._pool._max_connections for p in pools]  # type: ignore[attr-defined]
        await client.aclose()
        return [r.status_code for r in responses], sizes

    statuses, sizes = asyncio.run(main())
    assert statuses == [200] * 100
    assert len(sizes) == 3 and sum(sizes) == max_connections and max(sizes) - min(sizes) <= 1
    # All pools served (the least busy one is picked), never more sockets than allowed.
    assert _Handler.most_in_flight > sizes[0]
    assert len(_Handler.peers) <= max_connections


def test_a_failed_request_gives_its_pool_slot_back() -> None:
    from ludic.distributed.weight_transfer.groups import free_port

    client = AsyncHTTP(f"http://127.0.0.1:{free_port()}", max_retries=0, timeout_s=2)

    async def main() -> list[int]:
        with pytest.raises(ConnectionError, match="unreachable"):
            await client.post("/x", {})
        counts = [p.in_flight for p in client._pools()]
        await client.aclose()
        return counts

    assert asyncio.run(main()) == [0] * (256 // POOL_SHARD_CONNECTIONS)


class _DroppingServer(http.server.ThreadingHTTPServer):
    """Answers every request with ``{"num_background_tasks": 0, ...}`` except the first
    ``drops``, whose connection it closes after reading the request, without an answer (a
    keep-alive connection closed as a request went out). Counts the requests per path."""

    daemon_threads = True

    def __init__(self, drops: int) -> None:
        self.drops, self.seen = drops, []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                server.seen.append((self.command, self.path))
                if server.drops > 0:
                    server.drops -= 1
                    self.close_connection = True
                    return
                body = b'{"num_background_tasks": 0, "error_count": 0, "status": "ok"}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer  # noqa: N815 (http.server's naming)

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    @contextlib.contextmanager
    def control(self, max_retries: int) -> Iterator[VLLMControlPlane]:
        control = VLLMControlPlane(self.url, timeout_s=5, max_retries=max_retries)
        try:
            yield control
        finally:
            control.close()
            self.shutdown()
            self.server_close()


def test_a_read_is_sent_again_when_the_server_drops_the_connection_before_answering():
    """The status poll and the GET routes change nothing on the server: a connection the
    server closed without an answer (a keep-alive race) costs a resend, not the sync."""
    server = _DroppingServer(drops=2)
    with server.control(max_retries=2) as control:
        control.wait_until_applied(timeout_s=5)
        assert server.seen == [("POST", "/get_num_background_tasks?report=true")] * 3
        server.drops = 2
        assert control.health() == {"num_background_tasks": 0, "error_count": 0, "status": "ok"}
        assert server.seen[3:] == [("GET", "/health")] * 3


def test_a_dropped_read_fails_after_its_retries_and_a_dropped_write_is_never_sent_twice():
    server = _DroppingServer(drops=3)
    with server.control(max_retries=2) as control:
        with pytest.raises(ConnectionError, match=r"during /health: RemoteProtocolError"):
            control.health()
        assert server.seen == [("GET", "/health")] * 3
        server.drops = 1
        with pytest.raises(ConnectionError, match=r"during /pause\?mode=abort"):
            control.pause()  # it may have paused the server: not sent again
        assert server.seen[3:] == [("POST", "/pause?mode=abort")]


def test_the_async_client_sends_a_read_again_but_never_a_post():
    server = _DroppingServer(drops=1)
    client = AsyncHTTP(server.url, max_retries=1, timeout_s=5)

    async def main() -> None:
        assert (await client.get("/runtime_version")).status_code == 200
        server.drops = 1
        with pytest.raises(ConnectionError, match=r"during /v1/completions"):
            await client.post("/v1/completions", {})
        await client.aclose()

    try:
        asyncio.run(main())
    finally:
        server.shutdown()
        server.server_close()
    assert server.seen == [("GET", "/runtime_version")] * 2 + [("POST", "/v1/completions")]
