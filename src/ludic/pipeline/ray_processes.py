"""What ``ludic launch`` runs on a Ray node: one ludic process per Ray actor.

:class:`PlacedProcess` (made a Ray actor by ``ray_launch``) resolves its command on its node
(the node's address, a free port, a node-local copy of the config) and starts it: ``ludic
learner`` (one per rank, torchrun's variables set), ``ludic actor``, ``ludic serve policy`` or
``ludic serve reward``. The process leads its own session and ends with the Ray actor, even a
killed one (``PR_SET_PDEATHSIG``); its output waits for the launcher's :meth:`PlacedProcess.poll`.
A rollout actor's copy of the run directory (``$TMPDIR/ludic-launch/NAME-PID/RUN_NAME``) keeps
the run's name, hence its default Redis prefix; the run directory stays with the learner.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

import yaml

Role = Literal["learner", "rollout", "policy_server", "reward_server"]

MAX_KEPT_LINES = 20_000
"""Output lines kept between two polls (older ones are dropped, and counted)."""

__all__ = ["MAX_KEPT_LINES", "PlacedProcess", "ProcessSpec", "Role"]


@dataclass(frozen=True)
class ProcessSpec:
    """One process ``ludic launch`` places: pure data, sent to the Ray actor."""

    name: str
    """``learner``, ``policy-server-I``, ``reward-server``, ``actor-I``: its log's name,
    and a rollout actor's ``--actor-id`` (stable across restarts)."""
    role: Role
    config_yaml: str
    """The run's config (``RUN_DIR/config.yaml``)."""
    run_name: str
    """The run directory's name (NAME-TIMESTAMP)."""
    run_dir: str | None = None
    """The learner's run directory (on the launching node)."""
    overrides: tuple[str, ...] = ()
    """Config overrides (learner, rollout), or more server arguments (servers)."""
    env: dict[str, str] = field(default_factory=dict, repr=False)
    """Extra environment: the API key, the Redis URL (never on a command line)."""
    cwd: str | None = None
    """The launcher's working directory: relative paths of the config (``model.path``,
    data files) mean the same on a node that has it (a shared filesystem)."""


class PlacedProcess:
    """A ludic process started for ``spec`` on this node; its output kept for polling."""

    def __init__(self, spec: ProcessSpec) -> None:
        import ray

        from ludic.distributed.weight_transfer.groups import free_port
        from ludic.inference.vllm.process import die_with_parent_preexec
        from ludic.inference.vllm.security import PARENT_PID_ENV

        self.spec = spec
        context = ray.get_runtime_context()
        self.node_id = context.get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        self.restarted = bool(context.was_current_actor_reconstructed)
        self.url: str | None = None
        self.scratch: Path | None = None
        # (number, line): a line stays until a poll acknowledges it, so a poll whose
        # answer never reached the launcher (a timeout, a restart in between) loses nothing
        self._lines: collections.deque[tuple[int, str]] = collections.deque(maxlen=MAX_KEPT_LINES)
        self._next_line = 0
        self._dropped = 0
        self._lock = threading.Lock()
        self._port = free_port(self.node_ip) if spec.role.endswith("server") else 0
        argv, env = self._command()
        env = {**os.environ, **env, **spec.env, "PYTHONUNBUFFERED": "1"}
        env[PARENT_PID_ENV] = str(os.getpid())  # a server's watchdog ends vLLM's processes too
        cwd = spec.cwd if spec.cwd and Path(spec.cwd).is_dir() else None
        self.process = subprocess.Popen(
            argv,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent_preexec(os.getpid()),
        )
        assert self.process.stdout is not None
        threading.Thread(target=self._keep_output, args=(self.process.stdout,), daemon=True).start()

    # ---------------------------------------------------------------- the command
    def _command(self) -> tuple[list[str], dict[str, str]]:
        from ludic.run.loading import validate_config

        spec = self.spec
        config = validate_config(yaml.safe_load(spec.config_yaml))
        ludic = [sys.executable, "-m", "ludic"]
        if spec.role == "learner":
            if spec.run_dir is None:
                raise ValueError("the learner's ProcessSpec needs run_dir")
            if not Path(spec.run_dir).is_dir():  # a rank > 0 on another node
                raise FileNotFoundError(
                    f"{spec.name} on node {self.node_ip}: no run directory {spec.run_dir} "
                    "here; learner ranks on other nodes need it on a shared filesystem at "
                    "the same path (or keep them on the launching node: "
                    "launch.learner_strategy: STRICT_PACK)"
                )
            config_path = str(Path(spec.run_dir) / "config.yaml")
            argv = [*ludic, "learner", config_path, "--run-dir", spec.run_dir]
            return [*argv, *spec.overrides], {}
        copy = self._run_copy(config)
        if spec.role == "rollout":
            argv = [*ludic, "actor", str(copy / "config.yaml"), "--run-dir", str(copy)]
            return [*argv, "--actor-id", spec.name, *spec.overrides], {}
        return self._server_command(config, copy)

    def _run_copy(self, config: Any) -> Path:
        """This process's node-local copy of the run directory: config and model folder."""
        from ludic.run.models import policy_folder

        scratch = Path(tempfile.gettempdir()) / "ludic-launch"
        for stale in scratch.glob(f"{self.spec.name}-*"):  # of incarnations killed before
            with contextlib.suppress(ValueError):
                if not _alive(int(stale.name.rsplit("-", 1)[1])):
                    shutil.rmtree(stale, ignore_errors=True)
        root = scratch / f"{self.spec.name}-{os.getpid()}"
        copy = root / self.spec.run_name
        copy.mkdir(parents=True, exist_ok=True)
        self.scratch = root
        (copy / "config.yaml").write_text(self.spec.config_yaml)
        policy_folder(config, copy / "model")
        return copy

    def _server_command(self, config: Any, copy: Path) -> tuple[list[str], dict[str, str]]:
        from ludic.inference.vllm.process import server_command
        from ludic.run.models import policy_folder
        from ludic.run.servers import policy_lora_rank, server_args

        cuda = config.model.device.startswith("cuda")
        cores, lora_rank = None, 0
        if self.spec.role == "policy_server":
            kind, model, v = "policy", policy_folder(config, copy / "model"), config.inference.vllm
            index = int(self.spec.name.rsplit("-", 1)[1])
            cores = v.cpu_cores[index] if v.cpu_cores and not cuda else None
            lora_rank = policy_lora_rank(config)
        else:
            kind, model, v = "reward", config.reward.path, config.reward.server
        self.url = f"http://{_url_host(self.node_ip)}:{self._port}"
        return server_command(
            model,
            kind=kind,
            host=self.node_ip,
            port=self._port,
            extra_args=[*server_args(v, cuda, lora_rank), *self.spec.overrides],
            cpu=not cuda,
            cpu_cores=cores,
        )

    # ---------------------------------------------------------------- output and state
    def _keep_output(self, stream: IO[bytes]) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            with self._lock:
                if len(self._lines) == MAX_KEPT_LINES:
                    self._dropped += 1
                self._lines.append((self._next_line, line))
                self._next_line += 1

    def poll(self, seen: int = -1, incarnation: int | None = None) -> dict[str, Any]:
        """The output after line ``seen`` and the process's state. ``seen`` (with the
        ``incarnation`` it was counted in: the ``actor_pid`` of the answer that brought it)
        acknowledges the lines up to it, which are then forgotten; lines of an answer that
        never reached the launcher are sent again. ``last_line``: the number to pass as
        ``seen`` next time."""
        if incarnation != os.getpid():  # counted in an earlier incarnation: all lines
            seen = -1
        with self._lock:
            while self._lines and self._lines[0][0] <= seen:
                self._lines.popleft()
            lines = [line for _, line in self._lines]
            last = self._lines[-1][0] if self._lines else max(seen, self._next_line - 1)
            dropped, self._dropped = self._dropped, 0
        if dropped:
            lines.insert(0, f"[... {dropped} lines dropped: the launcher polled too slowly]")
        return {
            "lines": lines,
            "last_line": last,
            "returncode": self.process.poll(),
            "pid": self.process.pid,
            "actor_pid": os.getpid(),
            "node_id": self.node_id,
            "node_ip": self.node_ip,
            "url": self.url,
            "restarted": self.restarted,
        }

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM to the process's group (a learner checkpoints), SIGKILL after
        ``timeout_s``; returns the exit code."""
        if self.process.poll() is None:  # an exited one's pid may be reused: not signalled
            for sig in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.process.pid, sig)
                try:
                    self.process.wait(timeout=timeout_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)  # what it left behind
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
        return self.process.returncode


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _url_host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip
