"""Data-parallel inference: one ``ChatClient`` over several ludic vLLM policy servers.

:class:`VLLMClientPool` sends a request to the live server with the fewest of its requests in
flight (ties rotate), one with a ``session_id`` to its session's server; a server that fails
with ``ConnectionError`` / ``TimeoutError`` is taken out (probed every ``probe_interval_s``) and
the request retried on another. Once weights were published, a server comes back (or joins:
``add_server``, ``accept_joins``) only through a publish that syncs and verifies it, so none
serves a version older than the pool's. ``publish``: ``"per_server"`` or ``"one_group"``.
The rules for users: docs/real-model.md, "Several servers".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, get_args

import torch

from ludic.distributed.weight_transfer.verify import SyncVerificationError
from ludic.inference.request import CompletionRequest
from ludic.inference.vllm.client import VLLMChatClient
from ludic.inference.vllm.http import VLLMServerError
from ludic.inference.vllm.joins import read_join_files
from ludic.inference.vllm.weight_sync import WeightSyncSession
from ludic.types import ChatResponse

logger = logging.getLogger("ludic.inference.vllm.pool")

PublishMode = Literal["per_server", "one_group"]
StateDict = Mapping[str, torch.Tensor]
PUBLISH_MODES: tuple[str, ...] = get_args(PublishMode)
DEAD_ERRORS = (ConnectionError, TimeoutError)
"""What a request failing on a server means it is dead or stuck: the request goes
elsewhere and the server is taken out."""


class NoServerAvailableError(ConnectionError):
    """Every server of the pool is taken out (or was tried) for this request."""


@dataclass(eq=False)
class PoolServer:
    """One server of a pool and its live state (as this pool sees it)."""

    client: VLLMChatClient
    index: int
    in_flight: int = 0
    served: int = 0
    failures: int = 0
    """Requests that failed here and went to another server."""
    live: bool = True
    """Taking requests: cleared when taken out, set again by a probe or a publish."""
    stale: bool = False
    """May hold weights older than the pool's: takes no request until a publish reaches it."""
    version: int | None = None
    """The last version published to it through the pool."""
    last_error: str | None = None
    next_probe_at: float = 0.0

    @property
    def url(self) -> str:
        return self.client.base_url

    @property
    def serving(self) -> bool:
        return self.live and not self.stale

    def status(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "live": self.live,
            "stale": self.stale,
            "in_flight": self.in_flight,
            "served": self.served,
            "failures": self.failures,
            "version": self.version,
            "last_error": self.last_error,
        }


@dataclass
class _SyncSettings:
    backend: str | None = None
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    extractor: Any = None

    def for_server(self, index: int) -> dict[str, Any]:
        """``init_weight_sync`` arguments of server ``index``'s own group (per_server): a
        given ``master_port`` is the first server's; the others count up from it."""
        port = None if self.master_port is None else self.master_port + index
        return {
            "backend": self.backend,
            "master_addr": self.master_addr,
            "master_port": port,
            "extractor": self.extractor,
        }


class VLLMClientPool:
    """A ``ChatClient`` over several :class:`VLLMChatClient` s (see the module docstring).

    Args:
        clients: one client per server (each with its own ``timeout_s``, retries and
            ``partial_rollouts``).
        publish: ``"per_server"`` or ``"one_group"``.
        probe_interval_s: how often a server taken out is asked ``GET /health``.
        max_sessions: sessions remembered for stickiness (least recently used forgotten).
    """

    def __init__(
        self,
        clients: Sequence[VLLMChatClient],
        *,
        publish: PublishMode = "per_server",
        probe_interval_s: float = 5.0,
        max_sessions: int = 100_000,
    ) -> None:
        if not clients:
            raise ValueError("VLLMClientPool: give at least one client")
        urls = [c.base_url for c in clients]
        if len(set(urls)) != len(urls):
            raise ValueError(f"VLLMClientPool: a server is listed twice: {urls}")
        if publish not in PUBLISH_MODES:
            raise ValueError(f"VLLMClientPool.publish={publish!r}; expected one of {PUBLISH_MODES}")
        if probe_interval_s <= 0 or max_sessions < 1:
            raise ValueError("VLLMClientPool: probe_interval_s must be > 0, max_sessions >= 1")
        self.servers = [PoolServer(c, i) for i, c in enumerate(clients)]
        self.publish = publish
        self.probe_interval_s = probe_interval_s
        self.max_sessions = max_sessions
        self.version: int | None = None
        """The last version published through the pool."""
        self._lock = threading.Lock()  # server state; never held across an await
        self._sessions: OrderedDict[str, PoolServer] = OrderedDict()
        self._next = 0
        self._probes: set[asyncio.Task[None]] = set()
        self._sync: _SyncSettings | None = None
        self._group: WeightSyncSession | None = None  # one_group: spans self._grouped
        self._canary: tuple[Any, int] = (None, 10)  # set_canary: (ModelCanary, every)
        self._lora_adapter: dict[str, Any] | None = None  # set_lora_adapter
        self._grouped: list[PoolServer] = []
        self._joins: tuple[Path, Callable[[str], VLLMChatClient]] | None = None
        self._refused: set[str] = set()  # joining servers that refused this pool's key

    @classmethod
    def connect(
        cls,
        urls: Sequence[str],
        *,
        publish: PublishMode = "per_server",
        probe_interval_s: float = 5.0,
        **client_kwargs: Any,
    ) -> VLLMClientPool:
        """A pool of ``VLLMChatClient(url, **client_kwargs)`` for each of ``urls``."""
        clients = [VLLMChatClient(url, **client_kwargs) for url in urls]
        return cls(clients, publish=publish, probe_interval_s=probe_interval_s)

    @property
    def base_urls(self) -> list[str]:
        """Every server's base URL, in pool order."""
        return [server.url for server in self.servers]

    @property
    def partial_rollouts(self) -> str:
        return self.servers[0].client.partial_rollouts

    # ---- ChatClient: generation ----------------------------------------------------
    async def complete(self, request: CompletionRequest) -> ChatResponse:
        """One completion on the chosen server; on another one if that server is dead."""
        tried: list[PoolServer] = []
        while True:
            server = self._pick(request.session_id, tried)
            try:
                response = await server.client.complete(request)
            except DEAD_ERRORS as e:
                self._take_out(server, e)
                tried.append(server)
                continue
            finally:
                with self._lock:
                    server.in_flight -= 1
            with self._lock:
                server.served += 1
            return replace(response, meta={**response.meta, "server": server.url})

    def _pick(self, session_id: str | None, tried: Sequence[PoolServer]) -> PoolServer:
        self._start_probes()
        with self._lock:
            ready = [s for s in self.servers if s.serving and s not in tried]
            if not ready:
                states = "; ".join(
                    f"{s.url}: {'tried' if s in tried else 'stale' if s.live else 'down'}"
                    f"{'' if s.last_error is None else ' (' + s.last_error + ')'}"
                    for s in self.servers
                )
                raise NoServerAvailableError(f"no vLLM server can take the request: {states}")
            chosen = self._sessions.get(session_id) if session_id is not None else None
            if chosen is None or chosen not in ready:
                n = len(self.servers)
                chosen = min(ready, key=lambda s: (s.in_flight, (s.index - self._next) % n))
                self._next = (chosen.index + 1) % n
            if session_id is not None:
                self._sessions[session_id] = chosen
                self._sessions.move_to_end(session_id)
                if len(self._sessions) > self.max_sessions:
                    self._sessions.popitem(last=False)
            chosen.in_flight += 1
            return chosen

    def _take_out(self, server: PoolServer, error: BaseException) -> None:
        with self._lock:
            was_live = server.live
            server.live = False
            # it may miss publishes while out (and its group is likely broken)
            server.stale = server.stale or self._sync is not None
            server.failures += 1
            server.last_error = f"{type(error).__name__}: {error}"
            server.next_probe_at = time.monotonic() + self.probe_interval_s
        if was_live:
            logger.warning("vLLM server %s taken out of the pool: %s", server.url, error)

    def _start_probes(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [s for s in self.servers if not s.live and now >= s.next_probe_at]
            for server in due:
                server.next_probe_at = now + self.probe_interval_s
        for server in due:
            task = asyncio.get_running_loop().create_task(self._probe(server))
            self._probes.add(task)
            task.add_done_callback(self._probes.discard)

    async def _probe(self, server: PoolServer) -> None:
        try:
            await server.client.http.get("/health")
        except (*DEAD_ERRORS, VLLMServerError):
            return
        with self._lock:
            if not server.live:
                server.live = True
                logger.info(
                    "vLLM server %s answers again%s", server.url,
                    " (stale: back after the next publish)" if server.stale else "",
                )  # fmt: skip

    # ---- ChatClient: weights -------------------------------------------------------
    def set_canary(self, canary: Any, *, every: int = 10) -> None:
        """Every server's canary (``VLLMChatClient.set_canary``), for either publish mode."""
        self._canary = (canary, every)
        for server in self.servers:
            server.client.set_canary(canary, every=every)
        if self._group is not None:
            self._group.canary, self._group.canary_every = canary, every

    def set_lora_adapter(self, config: Any) -> None:
        """Every server's adapter config (``VLLMChatClient.set_lora_adapter``)."""
        self._lora_adapter = dict(config) if config is not None else None
        for server in self.servers:
            server.client.set_lora_adapter(config)
        if self._group is not None:
            self._group.lora_adapter = self._lora_adapter

    def accept_joins(self, folder: Path, make_client: Callable[[str], VLLMChatClient]) -> None:
        """Admit the servers that announce themselves in ``folder``
        (``ludic.inference.vllm.joins``; ``ludic serve policy --join RUN_DIR``): before
        each publish, a server new to the pool is added (``make_client(url)``) as stale,
        so it takes requests once that publish has synced and verified it."""
        self._joins = (Path(folder), make_client)

    def _admit_joins(self) -> None:
        if self._joins is None:
            return
        folder, make_client = self._joins
        known = {server.url for server in self.servers}
        for url, name in read_join_files(folder).items():
            if url in known or url in self._refused:
                continue
            client = make_client(url)
            try:
                self.add_server(client)
            except VLLMServerError as e:
                self._refused.add(url)
                client.close()
                logger.warning(
                    "vLLM server %s (%s) cannot join the pool: %s; start it with the run's "
                    "API key ($LUDIC_API_KEY)", url, folder / name, e,
                )  # fmt: skip
            except DEAD_ERRORS:  # announced, not answering (yet, or any more)
                client.close()

    def add_server(self, client: VLLMChatClient) -> PoolServer:
        """Add the server of ``client`` to the pool, as stale: the next publish forms its
        group, sends and verifies the update, and only then does it take requests.
        Raises ``VLLMServerError`` if it refuses the client's key, ``ConnectionError`` /
        ``TimeoutError`` if it does not answer, ``ValueError`` if it is in the pool."""
        if client.base_url in {server.url for server in self.servers}:
            raise ValueError(f"VLLMClientPool: {client.base_url} is in the pool already")
        client.control.world_size()  # a route behind the key
        canary, every = self._canary
        client.set_canary(canary, every=every)
        client.set_lora_adapter(self._lora_adapter)
        with self._lock:
            server = PoolServer(client, len(self.servers), stale=True)
            self.servers.append(server)
        logger.info("vLLM server %s joined the pool; it serves once synced", client.base_url)
        return server

    def init_weight_sync(
        self,
        *,
        backend: str | None = None,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        extractor: Any = None,
    ) -> None:
        """Form the weight-sync group(s) with every server (all must answer). With
        ``publish="per_server"`` a given ``master_port`` is the first server's group's and
        server ``i``'s is ``master_port + i``; with ``"one_group"`` it is the one group's."""
        if self._sync is not None:
            raise RuntimeError("init_weight_sync was already called; call close() first")
        settings = _SyncSettings(backend, master_addr, master_port, extractor)
        if self.publish == "one_group":
            self._form_group(self.servers, settings)
        else:
            for server in self.servers:
                server.client.init_weight_sync(**settings.for_server(server.index))
        self._sync = settings

    def sync_weights(self, params: StateDict, *, version: int, pause: bool | None = None) -> str:
        """Push ``params`` as ``version`` to every live server (and to servers back from
        being taken out); returns once each has loaded them. Raises if a server that still
        answers fails the update, or if no server took it."""
        if self._sync is None:
            raise RuntimeError("VLLMClientPool.sync_weights needs init_weight_sync() first")
        if pause is None:
            pause = self.partial_rollouts != "off"
        self._admit_joins()
        with self._lock:
            targets = [s for s in self.servers if s.live]
            missed = [s for s in self.servers if not s.live]
        for server in missed:  # taken out: catches up once back
            server.stale = True
        if not targets:
            raise NoServerAvailableError(
                f"weight sync (version {version}): every server is taken out: "
                + "; ".join(f"{s.url}: {s.last_error}" for s in self.servers)
            )
        if self.publish == "one_group":
            reached = self._publish_one_group(targets, params, version, pause)
        else:
            reached = self._publish_per_server(targets, params, version, pause)
        with self._lock:
            for server in reached:
                server.version = version
                server.stale = not server.live  # taken out meanwhile: may restart stale
            self.version = version
        skipped = [s.url for s in self.servers if s not in reached]
        note = f"; not reached (taken out): {skipped}" if skipped else ""
        return (
            f"synced {len(params)} tensors to {len(reached)}/{len(self.servers)} server(s) "
            f"as version {version} ({self.publish}{', paused' if pause else ''}){note}"
        )

    def _publish_per_server(
        self, targets: list[PoolServer], params: StateDict, version: int, pause: bool
    ) -> list[PoolServer]:
        assert self._sync is not None
        settings = self._sync

        def push(server: PoolServer) -> None:
            session = server.client.weight_sync
            if server.stale or session.publisher is None:  # back from being taken out
                session.close()
                server.client.init_weight_sync(**settings.for_server(server.index))
            with _paused([server] if pause else []):
                session.publish(params, version=version)
            session.run_canary()

        return self._settle(targets, run_each(push, targets))

    def _publish_one_group(
        self, targets: list[PoolServer], params: StateDict, version: int, pause: bool
    ) -> list[PoolServer]:
        assert self._sync is not None
        for attempt in range(2):
            if self._group is None or self._grouped != targets or any(s.stale for s in targets):
                self._form_group(targets, self._sync)
            group = self._group
            assert group is not None
            try:
                with _paused(targets if pause else []):
                    group.publish(params, version=version)
                group.run_canary()
                return targets
            except SyncVerificationError as e:
                failed = [s for s in targets if s.url in e.servers]
                if not failed or len(failed) == len(targets):
                    raise
                for server in failed:  # out until a later publish syncs and verifies it
                    self._take_out(server, e)
                logger.warning(
                    "weight sync (version %d): %s failed verification and is taken out; "
                    "%s hold the update", version, [s.url for s in failed],
                    [s.url for s in targets if s not in failed],
                )  # fmt: skip
                return [s for s in targets if s not in failed]
            except Exception as e:
                dead = [s for s in targets if not answers(s.client)]
                if not dead or attempt == 1:
                    raise
                for server in dead:
                    self._take_out(server, e)
                targets = [s for s in targets if s not in dead]
                if not targets:
                    raise
                logger.warning(
                    "weight sync (version %d): %s died; pushing again to %s",
                    version, [s.url for s in dead], [s.url for s in targets],
                )  # fmt: skip
        raise AssertionError("unreachable")

    def _form_group(self, servers: list[PoolServer], settings: _SyncSettings) -> None:
        if self._group is not None:
            self._group.close()
            self._group, self._grouped = None, []
        timeout_s = min(s.client.timeout_s for s in servers)
        group = WeightSyncSession(
            [s.client.control for s in servers],
            timeout_s=timeout_s,
            verify_sync=servers[0].client.weight_sync.verify_sync,
        )
        group.init(
            backend=settings.backend,
            master_addr=settings.master_addr,
            master_port=settings.master_port,
            extractor=settings.extractor,
        )
        group.canary, group.canary_every = self._canary
        group.lora_adapter = self._lora_adapter
        self._group, self._grouped = group, list(servers)

    def _settle(
        self, targets: list[PoolServer], errors: list[BaseException | None]
    ) -> list[PoolServer]:
        """The servers reached; a failed server that no longer answers, or whose sync
        failed verification, is taken out; one that answers fails the publish (raised,
        after every push has ended)."""
        reached, raised = [], []
        for server, error in zip(targets, errors):
            if error is None:
                reached.append(server)
            elif isinstance(error, SyncVerificationError) or (
                isinstance(error, Exception) and not answers(server.client)
            ):
                # dead, or holding weights other than the trainer's: out until a later
                # publish forms its group again, syncs it and verifies it
                self._take_out(server, error)
                close_weight_sync(server.client)
            else:
                error.add_note(f"(on the vLLM server at {server.url})")
                raised.append(error)
        if raised:
            for other in raised[1:]:
                raised[0].add_note(f"also: {type(other).__name__}: {other}")
            raise raised[0]
        if not reached:
            raise NoServerAvailableError(
                "weight sync reached no server: "
                + "; ".join(f"{s.url}: {s.last_error}" for s in targets)
            )
        return reached

    def get_policy_version(self) -> int:
        """The version last published through the pool, else the first serving server's."""
        if self.version is not None:
            return self.version
        for server in self.servers:
            if server.serving:
                return server.client.get_policy_version()
        raise NoServerAvailableError("no vLLM server of the pool is live")

    def status(self) -> list[dict[str, Any]]:
        with self._lock:
            return [s.status() for s in self.servers]

    # ---- lifecycle -----------------------------------------------------------------
    def close(self) -> None:
        """Leave every weight-sync group and close every client."""
        if self._group is not None:
            self._group.close()
            self._group, self._grouped = None, []
        self._sync = None
        for server in self.servers:
            server.client.close()

    async def aclose(self) -> None:
        for server in self.servers:
            await server.client.http.aclose()
        self.close()

    def __enter__(self) -> VLLMClientPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def answers(client: VLLMChatClient) -> bool:
    """Whether the server answers ``GET /health`` with 200 now."""
    try:
        client.control.health()
    except (*DEAD_ERRORS, VLLMServerError):
        return False
    return True


def close_weight_sync(client: VLLMChatClient) -> None:
    with contextlib.suppress(Exception):  # the server is gone; release our side
        client.weight_sync.close()


def run_each(
    fn: Callable[[PoolServer], None], servers: list[PoolServer]
) -> list[BaseException | None]:
    """``fn(server)`` for every server at once (a thread each); each one's exception or
    ``None``, in order."""

    def run(server: PoolServer) -> BaseException | None:
        try:
            fn(server)
        except BaseException as e:  # returned, raised by the caller
            return e
        return None

    if len(servers) == 1:
        return [run(servers[0])]
    with ThreadPoolExecutor(len(servers), thread_name_prefix="ludic-publish") as executor:
        return list(executor.map(run, servers))


@contextlib.contextmanager
def _paused(servers: Sequence[PoolServer]) -> Any:
    """Pause (``mode=abort``) every server, and resume each one paused, whatever happens."""
    paused: list[PoolServer] = []
    try:
        for server in servers:
            server.client.control.pause("abort")
            paused.append(server)
        yield
    finally:
        for server in paused:
            with contextlib.suppress(*DEAD_ERRORS):  # a dead server needs no resume
                server.client.control.resume()
