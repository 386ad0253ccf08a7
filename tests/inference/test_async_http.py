"""AsyncHTTP's pools against a real local HTTP server: ``max_connections`` split into small
httpx pools, each request through the least busy one, every connection counted."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time
from collections.abc import Iterator

import pytest

from ludic.inference.vllm.http import POOL_SHARD_CONNECTIONS, AsyncHTTP


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
