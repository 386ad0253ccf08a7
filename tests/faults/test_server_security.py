"""Issue 9, part 2 ("Security of the servers"), against a real ``ludic serve policy``
subprocess on the CPU vLLM engine (one server for the module):

* with a key set, generation (``/invocations``, ``/v1/*``), ``/tokenize``, ``/metrics``,
  ``/docs`` and every other route were open: now every route the running app serves but
  ``/health`` answers 401 without the key (swept from its own route list);
* ``ludic serve policy --model DIR`` failed at start on CPU (vLLM reserved 0.92 of the
  memory): it now starts with ``ludic train``'s CPU defaults (the fixture runs it bare,
  with ``VLLM_CPU_KVCACHE_SPACE`` removed from the environment);
* ``/init_communicator`` connected the workers anywhere, with any timeout, froze
  generation and left ``/close_communicator`` hanging on the lock: now a non-loopback
  ``master_addr`` is a 400 naming the field, the timeout is capped, generation goes on
  while a join to a closed port is pending, and ``/close_communicator`` returns at once;
* ``--host 0.0.0.0`` without a key was accepted silently: now refused unless
  ``--allow-insecure`` (then a loud warning).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

import httpx  # noqa: E402
import psutil  # noqa: E402
from tests.vllm.helpers import assert_all_gone  # noqa: E402

from ludic.distributed.weight_transfer.groups import free_port
from ludic.inference.vllm.control import ControlState, bounded  # noqa: E402
from ludic.inference.vllm.process import wait_for_vllm_health  # noqa: E402

pytestmark = pytest.mark.vllm

KEY = "faults-security-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TIMEOUT_CAP_S = 30.0
NOT_IN_OPENAPI = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json", "/metrics")


class KeyedServer:
    def __init__(self, url: str, process: subprocess.Popen[bytes], log: str) -> None:
        self.url, self.process, self.log = url, process, log


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory):
    """``python -m ludic serve policy --model DIR --port P`` as a user types it (the key in
    ``LUDIC_API_KEY``, no CPU flags, no KV-cache variable), plus a low timeout cap."""
    from ludic.models.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("faults_security")
    model_dir = save_tiny_model(root / "model")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env["LUDIC_API_KEY"] = KEY
    log_path = root / "server.log"
    argv = [sys.executable, "-m", "ludic", "serve", "policy", "--model", str(model_dir)]
    argv += ["--port", str(port), "--weight-sync-timeout-cap", str(TIMEOUT_CAP_S)]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_vllm_health(url, 300, process=process, log_path=log_path, server_type="policy")
        yield KeyedServer(url, process, str(log_path))
    finally:
        pids = [process.pid]
        if process.poll() is None:
            pids += [p.pid for p in psutil.Process(process.pid).children(recursive=True)]
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
        assert_all_gone(pids)


def _routes(server: KeyedServer) -> list[tuple[str, str]]:
    """(method, path) of every route the running app documents, plus its undocumented
    ones (docs, schema, metrics); path parameters filled with ``x``."""
    schema = httpx.get(f"{server.url}/openapi.json", headers=AUTH, timeout=30).json()
    routes = [
        (method.upper(), path.replace("{", "").replace("}", ""))
        for path, ops in schema["paths"].items()
        for method in ops
    ]
    return routes + [("GET", p) for p in NOT_IN_OPENAPI]


def test_ludic_serve_policy_starts_on_cpu_with_the_train_defaults(keyed_server):
    """The fixture's bare ``ludic serve policy`` came up; the defaults are what it ran."""
    with open(keyed_server.log, encoding="utf-8", errors="replace") as f:
        log = f.read()
    assert "enforce_eager" in log  # vLLM's non-default args line
    assert KEY not in log  # the key is never logged
    assert httpx.get(f"{keyed_server.url}/health").json()["status"] == "ok"


def test_every_route_but_health_needs_the_key(keyed_server):
    routes = _routes(keyed_server)
    paths = {p for _, p in routes}
    for must in (
        "/invocations",
        "/tokenize",
        "/detokenize",
        "/v1/models",
        "/v1/completions",
        "/load_weights_from_disk",
    ):
        assert must in paths, f"{must} missing from the app's routes: the sweep is stale"
    assert len(routes) > 20
    with httpx.Client(base_url=keyed_server.url, timeout=30) as http:
        open_routes, refused_with_key = [], []
        for method, path in routes:
            if path == "/health":
                continue
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
                if http.request(method, path, headers=headers).status_code != 401:
                    open_routes.append((method, path, headers))
            # With the key: a body the route cannot use, so nothing changes server state
            # beyond what an empty request does (pause/resume are put back below).
            keyed = http.request(method, path, headers=AUTH, content=b"{")
            if keyed.status_code == 401:
                refused_with_key.append((method, path))
        http.post("/resume", headers=AUTH)
        assert http.get("/health").status_code == 200
        assert http.get("/invocations", headers={"x-api-key": KEY}).status_code != 401
    assert not open_routes, f"answered without the key: {open_routes}"
    assert not refused_with_key, f"refused with the key: {refused_with_key}"


def test_generation_needs_the_key_and_works_with_it(keyed_server):
    body = {"model": _model(keyed_server), "prompt": [72, 101, 108], "max_tokens": 2}
    assert httpx.post(f"{keyed_server.url}/invocations", json=body).status_code == 401
    assert httpx.post(f"{keyed_server.url}/v1/completions", json=body).status_code == 401
    ok = httpx.post(f"{keyed_server.url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert ok.status_code == 200, ok.text


def test_init_communicator_refuses_a_non_loopback_master_addr(keyed_server):
    info = _sync_info(master_addr="10.1.2.3", master_port=free_port())
    r = httpx.post(f"{keyed_server.url}/init_communicator", json=info, headers=AUTH)
    assert r.status_code == 400
    assert "master_addr='10.1.2.3'" in r.text and "--weight-sync-hosts" in r.text


def test_a_pending_join_to_a_closed_port_neither_freezes_generation_nor_the_lock(
    keyed_server,
):
    """The finding: a huge timeout and a closed port froze generation for minutes and
    ``/close_communicator`` hung on the control lock."""
    url = keyed_server.url
    info = _sync_info(master_addr="127.0.0.1", master_port=free_port(), timeout_s=1e6)
    r = httpx.post(f"{url}/init_communicator", json=info, headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["timeout_s"] == TIMEOUT_CAP_S  # capped
    body = {"model": _model(keyed_server), "prompt": [72, 101, 108], "max_tokens": 4}
    started = time.monotonic()
    gen = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=20)
    assert gen.status_code == 200, gen.text
    assert time.monotonic() - started < 10  # the join waits in a worker thread
    pending = httpx.post(f"{url}/get_num_background_tasks", headers=AUTH).json()
    assert pending["num_background_tasks"] == 1  # the join is still waiting
    assert httpx.get(f"{url}/health").status_code == 200  # busy, not past its cap
    started = time.monotonic()
    closed = httpx.post(f"{url}/close_communicator", headers=AUTH, timeout=20)
    assert closed.status_code == 200, closed.text
    assert time.monotonic() - started < 5
    done = httpx.post(f"{url}/get_num_background_tasks", headers=AUTH).json()
    assert done["num_background_tasks"] == 0


def test_health_reports_an_operation_past_its_cap():
    """``bounded`` lists what runs; ``stuck`` names one past its cap (what ``/health``
    turns into 503 ``control_plane_stuck``)."""

    async def scenario() -> tuple[object, object]:
        state = ControlState()
        task = asyncio.ensure_future(bounded(state, "init_communicator", asyncio.sleep(5), 0.1))
        await asyncio.sleep(0.02)
        before = state.stuck()
        await asyncio.sleep(0.2)
        after = state.stuck()
        task.cancel()
        return before, after

    before, after = asyncio.run(scenario())
    assert before is None
    assert after is not None and after[0] == "init_communicator" and after[1] > 0.1


def test_a_non_loopback_host_without_a_key_is_refused_unless_allowed(tmp_path):
    # both cases in one process (importing vLLM's argument parser takes seconds)
    env = {k: v for k, v in os.environ.items() if k not in ("LUDIC_API_KEY", "VLLM_API_KEY")}
    code = f"""
from ludic.inference.vllm.server import parse_args
args = ['--model', {str(tmp_path)!r}, '--host', '0.0.0.0']
try:
    parse_args(args, 'x')
    print('REFUSED: no')
except SystemExit as e:  # its message is what the command prints as it exits
    print('REFUSED:', e.code)
parse_args([*args, '--allow-insecure'], 'x')
print('PARSED')
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    refused = next(line for line in result.stdout.splitlines() if line.startswith("REFUSED:"))
    assert "--host 0.0.0.0" in refused and "--allow-insecure" in refused
    assert "PARSED" in result.stdout and "INSECURE" in result.stderr


def _model(server: KeyedServer) -> str:
    return httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"][0]["id"]


def _sync_info(**fields: object) -> dict[str, object]:
    return {"world_size": 2, "backend": "gloo", **fields}
