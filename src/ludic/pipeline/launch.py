"""``ludic train CONFIG`` with ``trainer.mode: pipeline``: the whole pipeline from one command.

Makes (or resumes) the run directory; starts Redis (``pipeline.redis_url``, or a local
redis-server with an fsync-always AOF in RUN_DIR/redis), the reward loop's servers and router
once for every actor, then the learner and ``pipeline.num_actors`` actors as children, each
leading its own process group and dying with this process (``PR_SET_PDEATHSIG``), their output
in RUN_DIR/logs/NAME.log and here, prefixed ``[NAME]``. Waits for the learner; a failing child,
Ctrl-C or SIGTERM stops the rest (SIGTERM, then SIGKILL after ``pipeline.stop_timeout_s``) and
fails naming the child's error line and log. Placement on a Ray cluster: ``ray_launch``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from rich.console import Console

from ludic.inference.vllm.process import die_with_parent_preexec
from ludic.pipeline.redis_urls import redacted
from ludic.pipeline.run_info import (
    PIPELINE_RESUMABLE,
    REDIS_URL_ENV,
    REWARD_ROUTER_KEY_ENV,
    REWARD_ROUTER_URL_ENV,
    make_queue,
    pipeline_prefix,
)
from ludic.run.config import RunConfig
from ludic.run.errors import RunError
from ludic.run.reward_loop import reward_router, starts_reward_servers
from ludic.run.run_dir import RunDirectory, open_run
from ludic.run.servers import server_api_key

__all__ = ["PipelineProcessError", "launch_pipeline"]


class PipelineProcessError(RuntimeError):
    """A learner or actor process of ``ludic train`` (pipeline mode) failed."""


def launch_pipeline(config: RunConfig, *, resume: str | Path | None = None) -> Path:
    """Run a pipeline run's Redis, learner and ``pipeline.num_actors`` actors until the
    learner is done; returns the run directory. Call inside ``terminate_as_interrupt``
    (``ludic.jobs.train`` does), so SIGTERM stops every child as Ctrl-C does."""
    console = Console()
    run, config, logs = open_run_with_logs(config, resume, console)
    p = config.pipeline
    with contextlib.ExitStack() as stack:
        url = p.redis_url
        if url is None:
            from ludic.pipeline.redis_server import start_run_redis

            server = start_run_redis(run.path / "redis", stack)  # see the learner's own Redis
            url = server.url
            console.print(
                f"redis-server: {redacted(url)}, pid {server.process.pid}, AOF in "
                f"{server.data_dir}, "
                f"log {server.log_path}",
                highlight=False,
                soft_wrap=True,
            )
        queue = make_queue(config, url, pipeline_prefix(config, run.path))
        stack.callback(queue.close)
        queue.start_run()  # no actor may see the end of an earlier run of this directory
        env = child_env(config)
        if p.redis_url is None:  # in the environment: a command line is world-readable
            env[REDIS_URL_ENV] = url
        if starts_reward_servers(config):  # once for all actors, stopped after them
            router_url, router_key = stack.enter_context(reward_router(config, log_dir=run.path))
            assert router_url is not None  # disrm or genrm: a router was started
            console.print(f"reward router: {router_url}", highlight=False, soft_wrap=True)
            env[REWARD_ROUTER_URL_ENV] = router_url
            if router_key:
                env[REWARD_ROUTER_KEY_ENV] = router_key
        children = stack.enter_context(_Children(p.stop_timeout_s))
        common = [str(run.config_path), "--run-dir", str(run.path)]
        learner = children.start("learner", ["learner", *common], logs, env)
        actors = [
            children.start(f"actor-{i}", ["actor", *common, "--actor-id", f"actor-{i}"], logs, env)
            for i in range(p.num_actors)
        ]
        while learner.process.poll() is None:
            for actor in actors:
                if actor.process.poll() not in (None, 0):
                    raise actor.failure()
            time.sleep(0.2)
        if learner.process.returncode != 0:
            raise learner.failure()
        children.wait_for_exit(actors, p.stop_timeout_s)
        for actor in actors:
            if actor.process.returncode not in (0, None, -signal.SIGTERM, 128 + signal.SIGTERM):
                console.print(
                    f"[yellow]{actor.name} exited with code {actor.process.returncode} after "
                    f"the learner finished: {actor.error_line()} (log {actor.log_path})[/yellow]"
                )
    return run.path


def open_run_with_logs(
    config: RunConfig, resume: str | Path | None, console: Console
) -> tuple[RunDirectory, RunConfig, Path]:
    """The run directory (new, or ``resume``; :data:`PIPELINE_RESUMABLE` fields may
    change), printed, and its ``logs`` folder for the children's output."""
    run, config = open_run(config, resume=resume, resumable=PIPELINE_RESUMABLE)
    console.print(f"run directory: [bold]{run.path}[/bold]", highlight=False, soft_wrap=True)
    logs = run.path / "logs"
    logs.mkdir(exist_ok=True)
    return run, config, logs


def child_env(config: RunConfig) -> dict[str, str]:
    """The children's environment: unbuffered output and, with the vLLM backend, the
    server's API key for the learner and the actors: ``inference.vllm.api_key`` (never
    saved in config.yaml, which the children read), else ``$LUDIC_API_KEY``, else a fresh
    key for a server the learner starts. The environment keeps it off command lines."""
    from ludic.inference.vllm.security import API_KEY_ENV

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    key = server_api_key(config.inference.vllm) if config.inference.backend == "vllm" else None
    if key:
        env[API_KEY_ENV] = key
    return env


def error_line(lines: list[str]) -> str:
    """A process's ``error: ...`` line (the CLI prints one), else its last line."""
    errors = [line for line in lines if line.startswith("error:")]
    lines = errors or [line for line in lines if line.strip()]
    return lines[-1].strip() if lines else "(no output)"


def process_failure(text: str, code: int | None) -> Exception:
    """A failed process's error: ``RunError`` for exit code 2 (a mistake the user can fix),
    else ``PipelineProcessError``."""
    return RunError(text) if code == 2 else PipelineProcessError(text)


class _Child:
    """One ``python -m ludic ...`` child: its process, log and output-copying thread."""

    def __init__(self, name: str, argv: list[str], logs: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log_path = logs / f"{name}.log"
        self.lines: list[str] = []  # the last lines, for the error message
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ludic", *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own group: stopped as a whole, no terminal signals
            preexec_fn=die_with_parent_preexec(os.getpid()),
        )
        assert self.process.stdout is not None
        self.thread = threading.Thread(
            target=self._copy, args=(self.process.stdout,), name=f"ludic-{name}-output", daemon=True
        )
        self.thread.start()

    def _copy(self, stream: IO[bytes]) -> None:
        with self.log_path.open("ab") as log:
            for raw in iter(stream.readline, b""):
                log.write(raw)
                log.flush()
                line = raw.decode("utf-8", errors="replace").rstrip()
                self.lines = [*self.lines[-19:], line]
                print(f"[{self.name}] {line}", flush=True)

    def error_line(self) -> str:
        self.thread.join(timeout=5.0)  # the output after the exit
        return error_line(self.lines)

    def failure(self) -> Exception:
        code = self.process.returncode
        text = f"{self.name} exited with code {code}: {self.error_line()} (log: {self.log_path})"
        return process_failure(text, code)

    def signal(self, sig: signal.Signals, *, group_even_if_exited: bool = False) -> None:
        """Signal the child's process group (it leads it)."""
        if self.process.poll() is None or group_even_if_exited:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, sig)


class _Children:
    """The started children; on exit (normal, failure, Ctrl-C, SIGTERM) every one still
    running gets SIGTERM, then SIGKILL after ``stop_timeout_s`` (a second Ctrl-C kills at
    once)."""

    def __init__(self, stop_timeout_s: float) -> None:
        self.stop_timeout_s = stop_timeout_s
        self.children: list[_Child] = []

    def __enter__(self) -> _Children:
        return self

    def start(self, name: str, argv: list[str], logs: Path, env: dict[str, str]) -> _Child:
        child = _Child(name, argv, logs, env)
        self.children.append(child)
        print(f"{name}: pid {child.process.pid}, log {child.log_path}", flush=True)
        return child

    def wait_for_exit(self, children: list[_Child], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while any(c.process.poll() is None for c in children) and time.monotonic() < deadline:
            time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        running = [c for c in self.children if c.process.poll() is None]
        for child in running:
            child.signal(signal.SIGTERM)
        with _second_interrupt_kills(running):
            self.wait_for_exit(running, self.stop_timeout_s)
        for child in self.children:
            child.signal(signal.SIGKILL, group_even_if_exited=True)  # what it left behind
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(timeout=10.0)
            child.thread.join(timeout=5.0)


@contextlib.contextmanager
def _second_interrupt_kills(children: list[_Child]) -> Iterator[None]:
    try:
        yield
    except KeyboardInterrupt:
        for child in children:
            child.signal(signal.SIGKILL)
