"""Start, health-check and stop a ludic vLLM server (policy, or ``kind="reward"``) as a
subprocess.

    with start_vllm_server("path/to/model") as server:   # waits until /health is 200
        client = VLLMChatClient(server.url)

The server runs in its own process group, so :meth:`VLLMServerProcess.stop` ends it with all
vLLM spawned; it ends itself when the starting process dies, even by ``kill -9``
(``PR_SET_PDEATHSIG``, a ``LUDIC_PARENT_PID`` watchdog). The key travels in ``LUDIC_API_KEY``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import httpx

from ludic.distributed.weight_transfer.groups import free_port
from ludic.inference.vllm.security import API_KEY_ENV, PARENT_PID_ENV

ServerKind = Literal["policy", "reward", "router"]

SERVER_TYPES: dict[str, str] = {"policy": "policy", "reward": "reward_model", "router": "router"}
"""Server kind (``ludic serve KIND``) -> the ``type`` its ``GET /health`` reports."""

CPU_DEFAULT_ARGS: tuple[str, ...] = (
    "--enforce-eager",
    "--compilation-config",
    '{"mode": 0}',
    "--dtype",
    "float32",
    "--no-enable-chunked-prefill",
)
"""Added on a machine without CUDA (unless the flag is already in ``extra_args``; ``--X``
and ``--no-X`` count as the same flag): eager mode and no compilation bring start-up on 2
cores to ~30 s; float32 matches a transformers forward to ~1e-5. No chunked prefill: a
prompt split over two engine steps makes vLLM rewind the request's seeded generator
(``set_offset``), which torch's CPU generator does not support, and the engine dies
("CPU Generator does not use offset") as soon as a seeded request's prefill is split,
i.e. whenever more prompt tokens wait than one step's budget."""

CPU_DEFAULT_ENV: dict[str, str] = {"VLLM_CPU_KVCACHE_SPACE": "1"}
"""KV-cache size in GiB on CPU; without it vLLM sizes the cache from RAM and may fail."""


CPU_CORES_ENV = "LUDIC_CPU_CORES"
"""Cores (``"0-3,6"``) ``ludic serve`` pins itself to before vLLM starts; the engine and
worker processes it spawns inherit them."""


def parse_cpu_cores(cores: str) -> set[int]:
    """``"0-3,6"`` -> ``{0, 1, 2, 3, 6}`` (``"0|1"``, a tensor-parallel server's set per
    worker: all of them); raises ``ValueError`` on anything else."""
    out: set[int] = set()
    for part in cores.replace("|", ",").split(","):
        match = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", part)
        low, high = (int(match[1]), int(match[2] or match[1])) if match else (0, -1)
        if high < low:
            raise ValueError(f"cpu cores {cores!r}: expected a list like '0-3' or '0,2,5-7'")
        out.update(range(low, high + 1))
    return out


def pin_to_env_cores() -> None:
    """Pin every thread of this process to :data:`CPU_CORES_ENV`'s cores when it is set
    (threads and processes started later inherit them). Cores this machine lacks raise."""
    cores = os.environ.get(CPU_CORES_ENV)
    if not cores:
        return
    wanted = parse_cpu_cores(cores)
    if not wanted <= set(range(os.cpu_count() or 1)):
        raise ValueError(f"{CPU_CORES_ENV}={cores!r}: this machine has {os.cpu_count()} cores")
    for tid in os.listdir("/proc/self/task"):  # every thread already running, this one too
        with contextlib.suppress(ProcessLookupError):  # a thread that has just ended
            os.sched_setaffinity(int(tid), wanted)


class VLLMServerProcess:
    """A running ludic vLLM server subprocess (leader of its own session).

    ``url`` is the server's base URL; ``group_port`` is a free port reserved for the
    weight-sync rendezvous (pass it to ``init_weight_sync``); ``kind`` is ``"policy"``
    or ``"reward"``.
    """

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        *,
        host: str,
        port: int,
        group_port: int,
        log_path: Path,
        api_key: str | None,
        kind: ServerKind = "policy",
    ) -> None:
        self.process = process
        self.kind = kind
        self.host = host
        self.port = port
        self.group_port = group_port
        self.log_path = log_path
        self.api_key = api_key

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def is_running(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, num_lines: int = 40) -> str:
        return _tail(self.log_path, num_lines)

    def wait_until_healthy(self, timeout_s: float = 300.0) -> None:
        wait_for_vllm_health(
            self.url,
            timeout_s,
            process=self.process,
            log_path=self.log_path,
            server_type=SERVER_TYPES[self.kind],
        )

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the whole process group, then SIGKILL whatever is left after
        ``timeout_s``. Processes that left the group are killed by pid. Idempotent."""
        descendants = _descendant_pids(self.process.pid)
        _signal_group(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=timeout_s)
        _signal_group(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5.0)
        deadline = time.monotonic() + 5.0
        for pid in descendants:  # e.g. a worker that called setsid()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        while any(_pid_alive(pid) for pid in descendants) and time.monotonic() < deadline:
            time.sleep(0.05)

    def __enter__(self) -> VLLMServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.is_running() else f"exited({self.process.returncode})"
        return f"VLLMServerProcess({self.kind}, url={self.url!r}, pid={self.pid}, {state})"


def start_vllm_server(
    model_dir: str | os.PathLike[str],
    *,
    kind: ServerKind = "policy",
    host: str = "127.0.0.1",
    port: int | None = None,
    group_port: int | None = None,
    api_key: str | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    cpu: bool | None = None,
    log_path: str | os.PathLike[str] | None = None,
    wait: bool = True,
    health_timeout_s: float = 300.0,
    cpu_cores: str | None = None,
) -> VLLMServerProcess:
    """Start ``python -m ludic serve KIND --model model_dir`` in a new session.

    Args:
        kind: ``"policy"`` (``ludic.inference.vllm.server``) or ``"reward"``
            (``ludic.inference.vllm.reward_server``, a one-label sequence classifier).
        port: HTTP port (default: a free one). ``group_port``: reserved for the weight-sync
            rendezvous (default: a free one).
        api_key: guards every route but ``/health`` (passed as ``LUDIC_API_KEY`` in the
            server's environment, so it shows in neither ``ps`` nor the log).
        extra_args: more server / vLLM engine arguments.
        env: extra environment variables (on CPU, ``VLLM_CPU_KVCACHE_SPACE=1`` is the default).
        cpu: add :data:`CPU_DEFAULT_ARGS` / :data:`CPU_DEFAULT_ENV` (default: when CUDA is
            not available).
        log_path: file for the server's stdout+stderr (default: a temp file).
        wait: block until ``/health`` answers 200 with the ``type`` of ``kind`` (raises
            with the log tail otherwise; the process is stopped first).
        cpu_cores: CPU only, e.g. ``"0-3"`` or ``"0,2"``: every process and thread of the
            server runs on these cores (``ludic serve`` pins itself before vLLM starts, see
            :data:`CPU_CORES_ENV`) and vLLM's OpenMP threads bind to them
            (``VLLM_CPU_OMP_THREADS_BIND``). Default: vLLM's own binding.
    """
    port = port or free_port(host)
    args, env = server_command(
        model_dir,
        kind=kind,
        host=host,
        port=port,
        extra_args=extra_args,
        env=env,
        cpu=cpu,
        cpu_cores=cpu_cores,
    )
    return launch_server(
        args,
        kind=kind,
        host=host,
        port=port,
        group_port=group_port or free_port(host),
        api_key=api_key,
        env=env,
        log_path=log_path,
        wait=wait,
        health_timeout_s=health_timeout_s,
    )


def server_command(
    model_dir: str | os.PathLike[str],
    *,
    kind: ServerKind,
    host: str,
    port: int,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    cpu: bool | None = None,
    cpu_cores: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The command line and the extra environment of ``ludic serve KIND`` on
    ``model_dir`` at ``host:port`` (see :func:`start_vllm_server` for the arguments)."""
    env = dict(env or {})
    if cpu_cores is not None:
        parse_cpu_cores(cpu_cores)  # a bad list fails here, not in the child
        env.update({CPU_CORES_ENV: cpu_cores, "VLLM_CPU_OMP_THREADS_BIND": cpu_cores})
    if kind not in ("policy", "reward"):
        raise ValueError(f"kind={kind!r}; expected 'policy' or 'reward'")
    if cpu is None:
        cpu = not _cuda_available()
    args = [sys.executable, "-m", "ludic", "serve", kind, "--model", str(model_dir)]
    args += ["--host", host, "--port", str(port)]
    if cpu:
        args += cpu_default_args(extra_args)
    args += list(extra_args)
    return args, ({**CPU_DEFAULT_ENV, **env} if cpu else env)


def launch_server(
    args: Sequence[str],
    *,
    kind: ServerKind,
    host: str,
    port: int,
    group_port: int = 0,
    api_key: str | None = None,
    env: Mapping[str, str] | None = None,
    log_path: str | os.PathLike[str] | None = None,
    wait: bool = True,
    health_timeout_s: float = 300.0,
) -> VLLMServerProcess:
    """Run the command ``args`` (a ludic server listening on ``host:port``) in a new
    session that ends with this process; the API key travels as ``LUDIC_API_KEY``. With
    ``wait``, block until ``/health`` answers 200 with the ``type`` of ``kind``."""
    proc_env = dict(os.environ)
    proc_env.update(env or {})
    if api_key is not None:
        proc_env[API_KEY_ENV] = api_key
    api_key = proc_env.get(API_KEY_ENV) or None  # the server also reads an inherited key
    parent = os.getpid()
    proc_env[PARENT_PID_ENV] = str(parent)
    on_main_thread = threading.current_thread() is threading.main_thread()

    if log_path is None:
        fd, name = tempfile.mkstemp(prefix=f"ludic_{kind}_", suffix=".log")
        os.close(fd)
        log_path = name
    log_path = Path(log_path)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            list(args),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=proc_env,
            start_new_session=True,
            # PDEATHSIG fires when the starting *thread* ends: only from the main thread
            preexec_fn=_die_with_parent(parent) if on_main_thread else None,
        )
    server = VLLMServerProcess(
        process,
        host=host,
        port=port,
        group_port=group_port,
        log_path=log_path,
        api_key=api_key,
        kind=kind,
    )
    if wait:
        try:
            server.wait_until_healthy(health_timeout_s)
        except BaseException:
            server.stop()
            raise
    return server


class ServerExitedError(RuntimeError):
    """The server process exited before it became healthy; ``returncode`` is its exit
    code (2: argparse refused its command line), ``reason`` the log's telling line."""

    def __init__(self, message: str, *, returncode: int, reason: str) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.reason = reason


def wait_for_vllm_health(
    url: str,
    timeout_s: float = 300.0,
    *,
    process: subprocess.Popen[bytes] | None = None,
    log_path: str | os.PathLike[str] | None = None,
    poll_s: float = 0.5,
    server_type: str | None = None,
) -> None:
    """Poll ``GET {url}/health`` until it answers 200.

    Raises ``TimeoutError`` after ``timeout_s`` and :class:`ServerExitedError` (a
    ``RuntimeError``) as soon as ``process`` exits (a bad argument stops it at argparse, seconds in); both messages
    are one line ending with the log's telling line (:func:`log_error_line`) and the
    path of ``log_path``. With
    ``server_type`` (``"policy"`` or ``"reward_model"``), a healthy server reporting
    another ``type`` raises ``RuntimeError`` (e.g. another server on that port).
    """
    deadline = time.monotonic() + timeout_s
    last: str = "no answer yet"
    with httpx.Client(timeout=5.0) as http:
        while True:
            if process is not None and process.poll() is not None:
                raise ServerExitedError(
                    f"vLLM server for {url} exited with code {process.returncode} before "
                    f"becoming healthy{_log_summary(log_path)}",
                    returncode=process.returncode,
                    reason=log_error_line(log_path),
                )
            try:
                r = http.get(f"{url.rstrip('/')}/health")
                if r.status_code == 200:
                    _check_server_type(url, r, server_type)
                    return
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"vLLM server at {url} not healthy after {timeout_s:.0f}s (last: {last})"
                    f"{_log_summary(log_path)}"
                )
            time.sleep(poll_s)


# ------------------------------------------------------------------------------ helpers
def _check_server_type(url: str, response: httpx.Response, expected: str | None) -> None:
    if expected is None:
        return
    try:
        found = response.json().get("type")
    except (ValueError, AttributeError):
        found = None
    if found != expected:
        raise RuntimeError(
            f"the server at {url} reports type {found!r} on /health, expected {expected!r}: "
            "another server may be using that port, or the wrong `ludic serve KIND` started"
        )


def cpu_default_args(given: Sequence[str]) -> list[str]:
    """:data:`CPU_DEFAULT_ARGS` minus the flags already in ``given``."""
    return _missing_defaults(CPU_DEFAULT_ARGS, given)


def _die_with_parent(parent_pid: int) -> Any:
    """A ``preexec_fn``: the child gets SIGTERM when its parent dies (Linux
    ``prctl(PR_SET_PDEATHSIG)``; a no-op elsewhere), or at once if it already has."""

    def preexec() -> None:
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError, AttributeError):
                ctypes.CDLL("libc.so.6", use_errno=True).prctl(
                    1, signal.SIGTERM
                )  # PR_SET_PDEATHSIG
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


die_with_parent_preexec = _die_with_parent
"""Public name of the ``preexec_fn`` factory above, for ludic's other child processes
(redis-server, the pipeline's learner and actors)."""


def _flag_name(arg: str) -> str:
    """``--no-x=1`` -> ``--x``: a flag's name, its negation counted as the same flag."""
    name = arg.split("=", 1)[0]
    return "--" + name[len("--no-") :] if name.startswith("--no-") else name


def _missing_defaults(defaults: Sequence[str], extra_args: Sequence[str]) -> list[str]:
    """``defaults`` as (flag, value?) pairs, minus flags already in ``extra_args``."""
    given = {_flag_name(a) for a in extra_args if a.startswith("--")}
    out: list[str] = []
    i = 0
    while i < len(defaults):
        flag = defaults[i]
        has_value = i + 1 < len(defaults) and not defaults[i + 1].startswith("--")
        group = list(defaults[i : i + (2 if has_value else 1)])
        if _flag_name(flag) not in given:
            out += group
        i += len(group)
    return out


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)  # the server is its session's (and group's) leader


def _descendant_pids(pid: int) -> list[int]:
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil ships with vllm
        return []
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _pid_alive(pid: int) -> bool:
    try:
        import psutil

        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE
    except ImportError:  # pragma: no cover
        return Path(f"/proc/{pid}").exists()
    except Exception:
        return False


def _tail(path: str | os.PathLike[str] | None, num_lines: int) -> str:
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-num_lines:])


_ERROR_LINES = (
    re.compile(r"(^|: )error: "),  # argparse (vLLM's, ludic's) and `ludic serve`'s own
    re.compile(r"^(\([^)]*\)\s*)?[\w.]*(Error|Exception)\b"),  # a traceback's last line
)


def log_error_line(log_path: str | os.PathLike[str] | None, limit: int = 300) -> str:
    """The line of a server log that says why the server stopped: the last ``error:``
    line (argparse: ``unrecognized arguments: --bogus-flag``), else the last exception
    line (``ValueError: ...``, also behind vLLM's ``(EngineCore pid=N)`` prefix), else
    the last line; cut to ``limit`` characters. ``""`` for an empty or missing log."""
    lines = [line.strip() for line in _tail(log_path, 400).splitlines() if line.strip()]
    for pattern in _ERROR_LINES:
        found = next((line for line in reversed(lines) if pattern.search(line)), None)
        if found is not None:
            return found if len(found) <= limit else found[: limit - 3] + "..."
    if not lines:
        return ""
    return lines[-1] if len(lines[-1]) <= limit else lines[-1][: limit - 3] + "..."


def _log_summary(log_path: str | os.PathLike[str] | None) -> str:
    """``": LINE (log: PATH)"`` for an error message (see :func:`log_error_line`)."""
    if log_path is None:
        return ""
    line = log_error_line(log_path)
    return f": {line} (log: {log_path})" if line else f"; its log {log_path} is empty"
