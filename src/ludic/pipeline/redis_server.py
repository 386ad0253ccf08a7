"""Start a local ``redis-server`` for the pipeline (tests, examples, single-machine runs).

Durable: ``--appendonly yes --appendfsync always`` in ``data_dir``, so every acknowledged push
and ack survives a restart on the same folder, even after ``kill -9``. Listens on 127.0.0.1
unless given another ``host`` (``ludic launch``: the node's address), which needs a
``password`` (passed on stdin, so it shows in no process list). ``start_redis_server(dir)``
waits until PING answers; ``server.stop()`` ends it. Needs the ``redis-server`` binary
(``apt-get install redis-server``; ``make test`` installs it).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from ludic.distributed.weight_transfer.groups import free_port
from ludic.inference.vllm.process import die_with_parent_preexec
from ludic.pipeline.redis_keys import redis  # the guarded import of the client

__all__ = ["RedisServer", "start_redis_server", "start_run_redis"]


@dataclass
class RedisServer:
    """A ``redis-server`` subprocess (leader of its own session)."""

    process: subprocess.Popen[bytes]
    port: int
    data_dir: Path
    host: str = "127.0.0.1"
    password: str | None = None

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "redis.log"

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (Redis flushes the AOF and exits), SIGKILL if it lingers."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        """SIGKILL, as a crash would (for fault tests)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def start_redis_server(
    data_dir: str | Path,
    *,
    port: int | None = None,
    timeout_s: float = 20.0,
    executable: str = "redis-server",
    die_with_parent: bool = False,
    host: str = "127.0.0.1",
    password: str | None = None,
) -> RedisServer:
    """Start ``redis-server`` with an fsync-always AOF in ``data_dir`` on ``port`` (a free
    one by default) and wait until it answers PING (it may be loading its AOF).

    ``die_with_parent``: the server gets SIGTERM (flushes its AOF and exits) when this
    process dies, even by ``kill -9`` (Linux ``PR_SET_PDEATHSIG``; call from the main
    thread, as ``start_vllm_server`` does). ``host``: the address to listen on; one that
    is not loopback needs ``password`` (Redis' ``requirepass``; ``server.url`` carries it)."""
    if password is None and host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"host={host!r} exposes Redis beyond this machine: give a password")
    binary = shutil.which(executable)
    if binary is None:
        raise FileNotFoundError(
            f"{executable!r} is not on PATH; install Redis (Debian/Ubuntu: "
            "`apt-get install redis-server`; `make test` does this)"
        )
    data_dir = Path(data_dir).resolve()  # redis-server opens its files after chdir --dir
    data_dir.mkdir(parents=True, exist_ok=True)
    port = free_port() if port is None else port
    on_main_thread = threading.current_thread() is threading.main_thread()
    process = subprocess.Popen(
        [binary, *_redis_args(port, host, data_dir, password)],
        stdin=subprocess.PIPE if password else subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
        # PDEATHSIG fires when the starting *thread* ends: only from the main thread
        preexec_fn=die_with_parent_preexec(os.getpid())
        if die_with_parent and on_main_thread
        else None,
    )
    if password:
        assert process.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # it exited: _wait_for_ping reports it
            process.stdin.write(f'requirepass "{_config_escaped(password)}"\n'.encode())
            process.stdin.close()
    server = RedisServer(process, port, data_dir, host=host, password=password)
    try:
        _wait_for_ping(server, timeout_s)
    except BaseException:
        server.kill()
        raise
    return server


def start_run_redis(
    data_dir: Path, stack: contextlib.ExitStack, *, host: str = "127.0.0.1"
) -> RedisServer:
    """A run's own Redis in ``data_dir``: behind a fresh password, dying with this process
    (``die_with_parent``), stopped by ``stack``."""
    server = start_redis_server(
        data_dir, host=host, password=secrets.token_urlsafe(24), die_with_parent=True
    )
    stack.callback(server.stop)
    return server


def _redis_args(port: int, host: str, data_dir: Path, password: str | None) -> list[str]:
    """The arguments: durable (fsync-always AOF, no RDB snapshots), in the foreground."""
    return [
        *(["-"] if password else []),  # the rest of the config on stdin: requirepass
        "--port", str(port),
        "--bind", host,
        "--dir", str(data_dir),
        "--appendonly", "yes",
        "--appendfsync", "always",
        "--save", "",
        "--daemonize", "no",
        "--logfile", str(data_dir / "redis.log"),
    ]  # fmt: skip


def _wait_for_ping(server: RedisServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    client = redis.Redis(
        host=server.host, port=server.port, password=server.password, socket_connect_timeout=1.0
    )
    last = "no answer yet"
    try:
        while True:
            if server.process.poll() is not None:
                raise RuntimeError(
                    f"redis-server on port {server.port} exited with code "
                    f"{server.process.returncode}; see {server.log_path}"
                )
            try:
                if client.ping():
                    return
            except redis.RedisError as err:  # connection refused, or LOADING the AOF
                last = f"{type(err).__name__}: {err}"
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"redis-server on port {server.port} did not answer PING within "
                    f"{timeout_s:.0f}s (last: {last}); see {server.log_path}"
                )
            time.sleep(0.02)
    finally:
        client.close()


def _config_escaped(text: str) -> str:
    """``text`` inside a double-quoted redis.conf string."""
    return text.replace("\\", "\\\\").replace('"', '\\"')
