"""The router against real HTTP servers (``router_backend.py`` subprocesses) and a real
``ludic serve router`` subprocess: least-in-flight choice, retry on another backend,
a backend killed mid-request, health checks, model routing, keys and hostile requests.
The same router over real vLLM reward servers: ``tests/vllm_reward/test_router_vllm.py``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from tests.http_helpers import wait_healthy

from ludic.distributed.weight_transfer.groups import free_port
from ludic.inference.router import start_router

pytest.importorskip("uvicorn", reason="the router needs uvicorn (extra: router)")

KEY = "router-test-key"
BACKEND_KEY = "backend-test-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
SCRIPT = Path(__file__).with_name("router_backend.py")


class Backend:
    def __init__(self, name: str, model: str = "m") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, str(SCRIPT), str(self.port), name, model],
            start_new_session=True,
        )
        wait_healthy(self.url, self.process, timeout_s=20)

    def set_health(self, ok: bool) -> None:
        httpx.post(f"{self.url}/set_health?ok={int(ok)}", timeout=5)

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(5)


@pytest.fixture(scope="module")
def backends():
    started = {
        name: Backend(name, model) for name, model in [("a", "m"), ("b", "m"), ("c", "judge")]
    }
    yield started
    for backend in started.values():
        if backend.process.poll() is None:
            backend.kill()


def router(urls, **kwargs):
    kwargs.setdefault("health_interval_s", 0.3)
    return start_router(urls, api_key=KEY, backend_api_key=BACKEND_KEY, **kwargs)


def score(url: str, body: dict | None = None, timeout: float = 30.0) -> httpx.Response:
    return httpx.post(f"{url}/score", json=body or {}, headers=HEADERS, timeout=timeout)


def status(url: str) -> dict[str, dict]:
    reply = httpx.get(f"{url}/router/backends", headers=HEADERS, timeout=5).json()
    return {b["url"]: b for b in reply["backends"]}


def test_idle_requests_alternate_between_backends(backends) -> None:
    a, b = backends["a"], backends["b"]
    with router([a.url, b.url]) as r:
        served = Counter(score(r.url).json()["backend"] for _ in range(10))
        assert served == {"a": 5, "b": 5}
        assert {u: s["served"] for u, s in status(r.url).items()} == {a.url: 5, b.url: 5}


def test_the_backend_with_fewer_requests_in_flight_gets_the_next(backends) -> None:
    a, b = backends["a"], backends["b"]
    with router([a.url, b.url]) as r, ThreadPoolExecutor(1) as pool:
        slow = pool.submit(score, r.url, {"sleep": 2.0})
        time.sleep(0.5)  # the slow request is in flight on one backend
        busy = next(u for u, s in status(r.url).items() if s["in_flight"] == 1)
        fast = [score(r.url).headers["x-ludic-backend"] for _ in range(4)]
        assert fast == [u for u in (a.url, b.url) if u != busy] * 4
        assert slow.result().headers["x-ludic-backend"] == busy
        assert all(s["in_flight"] == 0 for s in status(r.url).values())


def test_answers_pass_through_with_the_backend_key_and_headers(backends) -> None:
    with router([backends["a"].url]) as r:
        reply = score(r.url, {"x": [1, 2]})
        assert reply.status_code == 200
        assert reply.json()["echo"] == {"x": [1, 2]}
        assert reply.json()["auth"] == f"Bearer {BACKEND_KEY}"  # never the client's key
        assert reply.headers["x-ludic-policy-version"] == "7"
        assert reply.headers["x-ludic-backend"] == backends["a"].url


def test_every_route_but_health_needs_the_key(backends) -> None:
    with router([backends["a"].url]) as r:
        assert httpx.get(f"{r.url}/health").json()["type"] == "router"
        for method, path in [
            ("POST", "/score"),
            ("GET", "/router/backends"),
            ("GET", "/v1/models"),
        ]:
            assert httpx.request(method, f"{r.url}{path}", json={}).status_code == 401
            wrong = {"Authorization": "Bearer nope"}
            assert (
                httpx.request(method, f"{r.url}{path}", json={}, headers=wrong).status_code == 401
            )


def test_hostile_and_control_requests_are_refused(backends) -> None:
    with router([backends["a"].url]) as r:
        for path in ["/update_param_batch", "/init_communicator", "/pause", "//evil.example/x"]:
            reply = httpx.post(f"{r.url}{path}", json={}, headers=HEADERS)
            assert reply.status_code == 404, path
            assert "does not forward" in reply.json()["error"]
        reply = httpx.post(
            f"{r.url}/v1/chat/completions", json={"stream": True, "messages": []}, headers=HEADERS
        )
        assert reply.status_code == 400 and "stream" in reply.json()["error"]
        garbage = httpx.post(f"{r.url}/score", content=b"\xff\x00not json", headers=HEADERS)
        assert garbage.status_code == 400  # not the router's to judge: the backend answers
        assert status(r.url)[backends["a"].url]["in_flight"] == 0


def test_a_dead_backend_is_skipped_and_its_requests_retried(backends) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with router([dead, backends["a"].url]) as r:
        assert [score(r.url).json()["backend"] for _ in range(6)] == ["a"] * 6
        state = status(r.url)
        assert not state[dead]["healthy"] and "ConnectError" in state[dead]["last_error"]
        assert all(s["in_flight"] == 0 for s in state.values())


def test_a_backend_killed_mid_request_loses_nothing(backends) -> None:
    doomed = Backend("doomed")
    with router([backends["a"].url, doomed.url]) as r, ThreadPoolExecutor(8) as pool:
        started = time.monotonic()
        replies = [pool.submit(score, r.url, {"sleep": 1.0}) for _ in range(8)]
        time.sleep(0.4)
        assert status(r.url)[doomed.url]["in_flight"] >= 3
        doomed.kill()
        answered = [f.result(timeout=15) for f in replies]
        assert all(reply.status_code == 200 for reply in answered)
        assert Counter(reply.json()["backend"] for reply in answered) == {"a": 8}
        assert time.monotonic() - started < 10
        state = status(r.url)
        assert not state[doomed.url]["healthy"] and state[doomed.url]["failures"] >= 3
        assert all(s["in_flight"] == 0 for s in state.values())
        # the next requests go straight to the live backend
        assert {score(r.url).json()["backend"] for _ in range(4)} == {"a"}


def test_unavailable_answers_go_to_another_backend_then_fail_as_502(backends) -> None:
    a, b = backends["a"], backends["b"]
    with router([a.url, b.url]) as r:
        reply = score(r.url, {"status": 503})
        assert reply.status_code == 502
        assert a.url in reply.json()["error"] and b.url in reply.json()["error"]
        assert all(s["failures"] == 1 and s["in_flight"] == 0 for s in status(r.url).values())
        bad = score(r.url, {"status": 400})  # the backend's verdict: not retried
        assert bad.status_code == 400
        assert sum(s["served"] for s in status(r.url).values()) == 1


def test_a_success_whose_body_is_not_a_json_object_is_a_502_not_a_200(backends) -> None:
    a, b = backends["a"], backends["b"]
    with router([a.url, b.url]) as r:
        for garbage, shown in [("text", "b'<html>upstream oops</html>'"), ("list", "b'[1, 2]'")]:
            reply = score(r.url, {"garbage": garbage})
            assert reply.status_code == 502
            error = reply.json()["error"]
            assert error.startswith("every backend failed /score: ")
            for backend in (a, b):  # tried on both, each named with what it answered
                assert (
                    f"{backend.url}: HTTP 200 with a body that is not a JSON object ({shown})"
                    in error
                )
        assert score(r.url).json()["backend"] in ("a", "b")  # a real answer still passes


def test_a_failing_health_check_takes_a_backend_out_until_it_passes(backends) -> None:
    a, b = backends["a"], backends["b"]
    with router([a.url, b.url]) as r:
        a.set_health(False)
        try:
            time.sleep(1.0)
            assert not status(r.url)[a.url]["healthy"]
            assert {score(r.url).json()["backend"] for _ in range(4)} == {"b"}
        finally:
            a.set_health(True)
        time.sleep(1.0)
        assert {score(r.url).json()["backend"] for _ in range(4)} == {"a", "b"}


def test_requests_naming_a_model_go_to_a_backend_serving_it(backends) -> None:
    a, c = backends["a"], backends["c"]
    with router([a.url, c.url]) as r:
        models = httpx.get(f"{r.url}/v1/models", headers=HEADERS).json()["data"]
        assert sorted(m["id"] for m in models) == ["judge", "m"]
        for model, name in [("judge", "c"), ("m", "a"), ("judge", "c")]:
            reply = httpx.post(
                f"{r.url}/v1/chat/completions", json={"model": model}, headers=HEADERS
            )
            assert reply.json() == {"backend": name, "model": model}
        unknown = httpx.post(f"{r.url}/v1/chat/completions", json={"model": "x"}, headers=HEADERS)
        assert unknown.status_code == 404 and "served models: ['judge', 'm']" in unknown.text


def test_no_healthy_backend_is_a_503_not_a_hang() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with router([dead], wait=False) as r:
        deadline = time.monotonic() + 20
        while True:
            try:
                health = httpx.get(f"{r.url}/health", timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert health.status_code == 503 and health.json()["healthy"] == 0
        reply = score(r.url, timeout=10)
        assert reply.status_code == 503 and dead in reply.json()["error"]


def test_a_backend_that_is_not_a_url_is_a_usage_error(capsys) -> None:
    from ludic.cli import main

    assert main(["serve", "router", "--backend", "notaurl"]) == 2
    err = capsys.readouterr().err
    assert "error: argument --backend: backend url 'notaurl': expected http(s)://host:port" in err
    assert main(["serve", "router", "--backend", "http://h:1", "--backend", "http://h:1/"]) == 2
    assert "a backend is listed twice" in capsys.readouterr().err


def test_serving_beyond_loopback_without_a_key_is_refused() -> None:
    env = {k: v for k, v in os.environ.items() if k != "LUDIC_API_KEY"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ludic",
            "serve",
            "router",
            "--backend",
            "http://127.0.0.1:1",
            "--host",
            "0.0.0.0",
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 2 and "--allow-insecure" in done.stderr
