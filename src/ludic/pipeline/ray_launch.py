"""``ludic launch CONFIG``: a pipeline run (``trainer.mode: pipeline``) placed on a Ray cluster.

Makes the run directory on this node, joins Ray (``--address`` / ``launch.address`` /
``$RAY_ADDRESS``, else a local Ray on loopback: ``ray_local``), starts Redis here behind a fresh
password (its URL in ``$LUDIC_REDIS_URL``), then places three groups, each within
``launch.placement_timeout_s``: the servers (waited for on ``/health``), the learner's ranks
(rank 0 on this node, which owns the run directory) and the rollout actors. Each process runs
in a Ray actor (``ray_processes.PlacedProcess``), its output coming back here and to
RUN_DIR/logs. Restarts, failures and the shared filesystem a sharded learner needs: docs/async.md.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from ludic.distributed.weight_transfer.groups import free_port
from ludic.inference.vllm.security import API_KEY_ENV
from ludic.pipeline.launch import (
    PipelineProcessError,
    child_env,
    error_line,
    open_run_with_logs,
    process_failure,
)
from ludic.pipeline.ray_local import LOCAL_ONLY_ENV, is_loopback_address, start_local_ray
from ludic.pipeline.ray_processes import PlacedProcess, ProcessSpec
from ludic.pipeline.run_info import (
    REDIS_URL_ENV,
    configured_redis_url,
    make_queue,
    pipeline_prefix,
    require_pipeline_mode,
    require_reward_router,
)
from ludic.run.config import PlacementConfig, RunConfig
from ludic.run.errors import RunError
from ludic.run.loading import dump_config
from ludic.run.preflight import check_config, check_tensor_parallel_cores
from ludic.run.signals import terminate_as_interrupt

__all__ = ["launch_on_ray"]

POLL_S = 0.2


def launch_on_ray(
    config: RunConfig, *, address: str | None = None, resume: str | Path | None = None
) -> Path:
    """Run a pipeline run's learner, servers and rollout actors on Ray until the learner is
    done; returns the run directory."""
    with terminate_as_interrupt():
        require_pipeline_mode(config, "ludic launch")
        check_config(config)
        require_reward_router(config, "ludic launch")
        check_placement(config, address)
        address = address or config.launch.address
        joined = address or os.environ.get("RAY_ADDRESS")
        # a local Ray, or one at a loopback address, runs local-only (set before the import)
        ray = _import_ray(local_only=joined is None or is_loopback_address(joined))
        return _launch(ray, config, address, resume)


def check_placement(config: RunConfig, address: str | None = None) -> None:
    """A CUDA run's servers and learner must ask Ray for a GPU; Ray Client and CUDA IPC
    (the servers are placed apart from the learner) are refused."""
    lc = config.launch
    check_tensor_parallel_cores(config)
    address = address or lc.address or os.environ.get("RAY_ADDRESS")
    if address is not None and address.startswith("ray://"):
        raise RunError(
            f"Ray address {address!r}: Ray Client is not supported (the learner runs on the "
            "launching node, which owns the run directory); run `ludic launch` on a node of "
            "the cluster with address auto or HEAD_IP:6379"
        )
    v = config.inference.vllm
    if config.inference.backend == "vllm" and v.sync_strategy != "broadcast":
        raise RunError(
            f"inference.vllm.sync_strategy={v.sync_strategy}: `ludic launch` places the servers "
            "apart from the learner (own GPUs, maybe other nodes); use broadcast (nccl)"
        )
    if config.model.device.startswith("cuda"):
        needs = ["learner"]
        if _starts_policy_servers(config):
            needs.append("policy_server")
        if _starts_reward_server(config):
            needs.append("reward_server")
        for role in needs:
            if getattr(lc, role).gpus <= 0:
                raise RunError(
                    f"launch.{role}.gpus=0 with model.device={config.model.device}: Ray hides "
                    f"the GPUs from a process that reserves none; set launch.{role}.gpus: 1"
                )
        tp = v.tensor_parallel_size
        if _starts_policy_servers(config) and lc.policy_server.gpus < tp:
            raise RunError(
                f"launch.policy_server.gpus={lc.policy_server.gpus:g} with "
                f"inference.vllm.tensor_parallel_size={tp}: each policy server shards the model "
                f"over {tp} GPUs; set launch.policy_server.gpus: {tp}"
            )


def _import_ray(*, local_only: bool) -> Any:
    if local_only:
        os.environ.update(LOCAL_ONLY_ENV)
    try:
        import ray
    except ImportError as err:
        raise RunError(f"`ludic launch` needs Ray ({err}); pip install 'ludic-rl[ray]'") from None
    return ray


def _starts_policy_servers(config: RunConfig) -> bool:
    return config.inference.backend == "vllm" and config.inference.vllm.start_server


def _starts_reward_server(config: RunConfig) -> bool:
    r = config.reward
    return r is not None and r.backend == "vllm" and r.server.start_server


def _launch(ray: Any, config: RunConfig, address: str | None, resume: str | Path | None) -> Path:
    console = Console()
    run, config, logs = open_run_with_logs(config, resume, console)
    lc = config.launch
    with contextlib.ExitStack() as stack:
        _connect(ray, address, config, stack, console)
        node_ip = ray.util.get_node_ip_address()
        # only what the processes need travels (not this shell's environment): the API key
        # (servers listen beyond loopback) and, below, the Redis URL
        key = child_env(config).get(API_KEY_ENV) or secrets.token_urlsafe(32)
        env = {API_KEY_ENV: key}
        url = configured_redis_url(config)
        if url is None:
            url = _start_redis(run.path / "redis", node_ip, stack, console)
            env[REDIS_URL_ENV] = url
        queue = make_queue(config, url, pipeline_prefix(config, run.path))
        stack.callback(queue.close)
        queue.start_run()  # no actor may see the end of an earlier run of this directory
        # the learner saves its config, with this launch's server addresses; put the run's
        # own back at the end, so `ludic launch RUN_DIR/config.yaml --resume RUN_DIR` works
        stack.callback(run.save_config, config)
        placed = stack.enter_context(_Placement(ray, logs, lc.placement_timeout_s, config))
        common = dict(
            config_yaml=dump_config(config), run_name=run.path.name, env=env, cwd=os.getcwd()
        )

        urls = _place_servers(placed, config, node_ip, common)
        overrides = _server_overrides(config, urls, node_ip)

        # the learner's ranks, rank 0 on this machine; then the rollout actors
        learner, *other_ranks = placed.group(
            "learner",
            _learner_ranks(config, run.path, node_ip, tuple(overrides["learner"]), common),
            lc.learner_strategy,
        )
        actors = placed.group(
            "rollout actors",
            [
                (
                    ProcessSpec(
                        f"actor-{i}", "rollout", overrides=tuple(overrides["actor"]), **common
                    ),
                    lc.rollout_actor,
                )
                for i in range(config.pipeline.num_actors)
            ],
            lc.strategy,
            max_restarts=lc.max_restarts,
        )
        placed.wait_for_exit([learner], math.inf)
        if learner.returncode != 0:
            raise learner.failure()
        placed.wait_for_exit([*other_ranks, *actors], config.pipeline.stop_timeout_s)
    return run.path


def _place_servers(
    placed: _Placement, config: RunConfig, node_ip: str, common: dict[str, Any]
) -> dict[str, str]:
    """The policy servers, then the reward server, in one placement group; their URLs once
    healthy. The learner, on this node, hosts the weight-sync rendezvous."""
    lc = config.launch
    sync_from = ("--weight-sync-hosts", node_ip)
    num_policy = config.inference.vllm.num_servers if _starts_policy_servers(config) else 0
    servers = [
        (
            ProcessSpec(f"policy-server-{i}", "policy_server", overrides=sync_from, **common),
            lc.policy_server,
        )
        for i in range(num_policy)
    ]
    if _starts_reward_server(config):
        servers.append((ProcessSpec("reward-server", "reward_server", **common), lc.reward_server))
    return placed.wait_for_servers(placed.group("servers", servers, lc.strategy))


LEARNER = "learner"
"""The learner's (rank 0's) process name; rank I > 0 is ``learner-rank-I``."""


def _learner_ranks(
    config: RunConfig,
    run_dir: Path,
    node_ip: str,
    overrides: tuple[str, ...],
    common: dict[str, Any],
) -> list[tuple[ProcessSpec, PlacementConfig]]:
    """The learner's ``trainer.world_size`` processes and their reservations: rank 0
    pinned to this machine (the run directory is here), every rank ``launch.learner``.
    Several ranks meet at a free port of this machine, where rank 0 hosts their group's
    store (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``)."""
    lc = config.launch
    world_size = config.trainer.world_size
    master_port = free_port(node_ip) if world_size > 1 else 0
    pin = {f"node:{node_ip}": 0.001}  # this machine: the run directory is here
    members = []
    for rank in range(world_size):
        env = dict(common["env"])
        if world_size > 1:
            env.update(rank_env(rank, world_size, node_ip, master_port))
        spec = ProcessSpec(
            LEARNER if rank == 0 else f"{LEARNER}-rank-{rank}",
            "learner",
            run_dir=str(run_dir.resolve()),
            overrides=overrides,
            **{**common, "env": env},
        )
        place = lc.learner
        if rank == 0:
            place = place.model_copy(update={"resources": {**place.resources, **pin}})
        members.append((spec, place))
    return members


def rank_env(rank: int, world_size: int, master_addr: str, master_port: int) -> dict[str, str]:
    """The environment of one learner rank placed on Ray, as torchrun would set it (each
    rank sees only the GPU Ray gave it: local rank 0); rank 0 hosts the group's store at
    ``master_addr:master_port`` (:func:`ludic.run.trainer_ranks.join_trainer_group`)."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def _connect(
    ray: Any, address: str | None, config: RunConfig, stack: contextlib.ExitStack, console: Console
) -> None:
    """Join the cluster at ``address`` (or ``$RAY_ADDRESS``), else start a local Ray with
    enough logical CPUs for every placed process."""
    options: dict[str, Any] = dict(log_to_driver=False, configure_logging=False)
    # ray.init installs its own SIGTERM handler (a crash report, then abort): put back
    # the run's (terminate_as_interrupt: SIGTERM stops the run as Ctrl-C does).
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    if address or os.environ.get("RAY_ADDRESS"):
        stack.callback(ray.shutdown)
        ray.init(address=address, **options)
    else:
        lc = config.launch
        roles = [lc.learner] * config.trainer.world_size
        if _starts_policy_servers(config):
            roles += [lc.policy_server] * config.inference.vllm.num_servers
        if _starts_reward_server(config):
            roles.append(lc.reward_server)
        roles += [lc.rollout_actor] * config.pipeline.num_actors
        cpus = max(os.cpu_count() or 1, int(sum(r.cpus for r in roles) + 0.999))
        gpus = _local_gpus() if any(r.gpus for r in roles) else 0
        start_local_ray(
            ray,
            stack,
            grace_s=config.pipeline.stop_timeout_s,
            num_cpus=cpus,
            num_gpus=gpus,
            include_dashboard=False,
            **options,
        )
    for sig, handler in handlers.items():
        if handler is not None:
            signal.signal(sig, handler)
    resources = ray.cluster_resources()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    console.print(
        f"ray: {len(nodes)} node(s), {resources.get('CPU', 0):g} CPU, "
        f"{resources.get('GPU', 0):g} GPU",
        highlight=False,
    )


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _start_redis(data_dir: Path, host: str, stack: contextlib.ExitStack, console: Console) -> str:
    from ludic.pipeline.redis_server import start_run_redis

    server = start_run_redis(data_dir, stack, host=host)
    console.print(
        f"redis-server: {host}:{server.port} (password-protected), AOF in {server.data_dir}",
        highlight=False,
        soft_wrap=True,
    )
    return server.url


def _server_overrides(
    config: RunConfig, urls: dict[str, str], node_ip: str
) -> dict[str, list[str]]:
    """Where the placed servers are, as overrides of the learner's and the actors'
    configs."""
    learner: list[str] = []
    actor: list[str] = []
    policy = [url for name, url in sorted(urls.items()) if name.startswith("policy-server-")]
    if policy:
        learner += [
            "inference.vllm.start_server=false",
            "inference.vllm.num_servers=1",
            "inference.vllm.cpu_cores=[]",  # each placed server got its own set
            f"inference.vllm.urls={json.dumps(policy)}",
            f"inference.vllm.group_host={node_ip}",
        ]
    if "reward-server" in urls:
        host, port = urls["reward-server"].removeprefix("http://").rsplit(":", 1)
        actor += [
            "reward.server.start_server=false",
            f"reward.server.host={host}",
            f"reward.server.port={port}",
        ]
    return {"learner": learner, "actor": actor}


@dataclass
class _Placed:
    """One placed process: its Ray actor, what the launcher saw of it, its log."""

    spec: ProcessSpec
    handle: Any
    log_path: Path
    restartable: bool
    returncode: int | None = None
    info: dict[str, Any] = field(default_factory=dict)
    last_lines: list[str] = field(default_factory=list)
    incarnation: int | None = None  # the Ray actor's pid, to notice restarts
    restarts: int = 0
    killed: int | None = None  # the incarnation killed for a restart (its polls ignored)
    seen: tuple[int, int | None] = (-1, None)  # (last line taken, the incarnation it was in)
    unavailable_since: float | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    def failure(self, what: str | None = None) -> Exception:
        code = self.returncode
        if what is None:
            line = error_line(self.last_lines)
            what = f"exited with code {code}: " + line.removesuffix(
                " (run with --debug for the traceback)"
            )
        return process_failure(f"{self.name} {what} (log: {self.log_path})", code)


class _Placement:
    """The placement groups and placed processes of one launch; on exit every process is
    stopped (SIGTERM, then SIGKILL after ``pipeline.stop_timeout_s``), its actor killed and
    the groups removed."""

    def __init__(self, ray: Any, logs: Path, timeout_s: float, config: RunConfig) -> None:
        self.ray = ray
        self.logs = logs
        self.timeout_s = timeout_s
        self.stop_timeout_s = config.pipeline.stop_timeout_s
        self.max_restarts = config.launch.max_restarts
        self.placed: list[_Placed] = []
        self.groups: list[Any] = []

    def __enter__(self) -> _Placement:
        return self

    # ------------------------------------------------------------------ placing
    def group(
        self,
        what: str,
        members: list[tuple[ProcessSpec, PlacementConfig]],
        strategy: str,
        *,
        max_restarts: int = 0,
    ) -> list[_Placed]:
        """A placement group with one bundle per member, and each member's process started
        in its bundle."""
        if not members:
            return []
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundles = [_bundle(place) for _, place in members]
        pg = placement_group(bundles, strategy=strategy, name=f"ludic-{what.replace(' ', '-')}")
        self.groups.append(pg)
        try:
            self.ray.get(pg.ready(), timeout=self.timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            raise RunError(
                f"launch: Ray could not place the {what} ({strategy} of {bundles}) within "
                f"{self.timeout_s:g}s (launch.placement_timeout_s); the cluster has "
                f"{_resources(self.ray.cluster_resources())}, "
                f"{_resources(self.ray.available_resources())} free; lower launch.*.cpus/gpus, "
                "change launch.strategy, or add nodes"
            ) from None
        remote = self.ray.remote(PlacedProcess)
        started = []
        for index, (spec, place) in enumerate(members):
            handle = remote.options(
                num_cpus=place.cpus,
                num_gpus=place.gpus,
                resources=place.resources or None,
                max_restarts=max_restarts,
                max_task_retries=0,
                name=None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=index
                ),
            ).remote(spec)
            placed = _Placed(spec, handle, self.logs / f"{spec.name}.log", max_restarts > 0)
            self.placed.append(placed)
            started.append(placed)
        for placed in started:  # started (or failed) within the timeout
            self._first_poll(placed)
        return started

    def _first_poll(self, placed: _Placed) -> None:
        try:
            info = self.ray.get(placed.handle.poll.remote(*placed.seen), timeout=self.timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            raise RunError(
                f"launch: {placed.name} did not start within {self.timeout_s:g}s "
                "(launch.placement_timeout_s)"
            ) from None
        except self.ray.exceptions.RayActorError as err:
            raise PipelineProcessError(
                f"{placed.name} could not start on Ray: {_first_line(err)}"
            ) from None
        self._take(placed, info)
        print(
            f"{placed.name}: pid {info['pid']} on node {info['node_ip']} "
            f"({info['node_id'][:12]}), Ray actor pid {info['actor_pid']}, log {placed.log_path}",
            flush=True,
        )

    def wait_for_servers(self, servers: list[_Placed]) -> dict[str, str]:
        """Each server's URL once its ``/health`` answers (output pumped meanwhile)."""
        import httpx

        deadline = time.monotonic() + self.timeout_s
        pending = {s.name: s for s in servers}
        urls: dict[str, str] = {}
        with httpx.Client(timeout=5.0) as http:
            while pending:
                self.pump()
                for name, server in list(pending.items()):
                    if server.returncode is not None:
                        raise server.failure("exited before answering /health")
                    with contextlib.suppress(httpx.HTTPError):
                        if http.get(f"{server.info['url']}/health").status_code == 200:
                            urls[name] = server.info["url"]
                            del pending[name]
                            print(f"{name}: healthy at {urls[name]}", flush=True)
                if pending and time.monotonic() >= deadline:
                    names = ", ".join(pending)
                    raise RunError(
                        f"launch: {names} not healthy within {self.timeout_s:g}s "
                        "(launch.placement_timeout_s); see their logs in the run directory"
                    )
                time.sleep(POLL_S)
        return urls

    # ------------------------------------------------------------------ watching
    def pump(self) -> None:
        """Poll every running process: print and log its output; restart a killed rollout
        actor; raise on any other failure."""
        for placed in self.placed:
            if placed.returncode is None:
                self._pump_one(placed)

    def _pump_one(self, placed: _Placed) -> None:
        exceptions = self.ray.exceptions
        try:
            info = self.ray.get(placed.handle.poll.remote(*placed.seen), timeout=30.0)
        except (exceptions.ActorUnavailableError, exceptions.GetTimeoutError):
            self._unavailable(placed)  # being restarted, or busy
            return
        except exceptions.RayActorError as err:
            raise placed.failure(f"lost its Ray actor for good: {_first_line(err)}") from None
        placed.unavailable_since = None
        if info["actor_pid"] == placed.killed:
            return  # the incarnation we killed, still answering: Ray replaces it
        self._take(placed, info)
        code = info["returncode"]
        if code is None or code == 0:
            placed.returncode = code
            return
        killed = code < 0 or code > 128
        if placed.restartable and killed and placed.restarts < self.max_restarts:
            print(f"[{placed.name}] killed (exit code {code}); Ray restarts it", flush=True)
            placed.killed = info["actor_pid"]
            self.ray.kill(placed.handle, no_restart=False)
            return
        placed.returncode = code
        if placed.spec.name != LEARNER:  # the learner's exit is the caller's to judge
            raise placed.failure()

    def _unavailable(self, placed: _Placed) -> None:
        """An actor that does not answer (Ray restarting it, or its node lost) fails the
        launch after ``launch.placement_timeout_s``: a run never waits on it forever."""
        now = time.monotonic()
        if placed.unavailable_since is None:
            placed.unavailable_since = now
            print(f"[{placed.name}] Ray actor unavailable (being restarted?)", flush=True)
        elif now - placed.unavailable_since > self.timeout_s:
            raise placed.failure(
                f"has not answered for {self.timeout_s:g}s (launch.placement_timeout_s): its "
                "Ray actor could not be restarted or placed again"
            )

    def _take(self, placed: _Placed, info: dict[str, Any]) -> None:
        if placed.incarnation is not None and info["actor_pid"] != placed.incarnation:
            placed.restarts += 1
            print(
                f"[{placed.name}] restarted by Ray ({placed.restarts} of "
                f"{self.max_restarts}) on node {info['node_ip']} ({info['node_id'][:12]}), "
                f"pid {info['pid']}",
                flush=True,
            )
        placed.incarnation = info["actor_pid"]
        placed.info = info
        placed.seen = (info["last_line"], info["actor_pid"])
        lines = info["lines"]
        if lines:
            with placed.log_path.open("a", encoding="utf-8") as log:
                log.writelines(line + "\n" for line in lines)
            for line in lines:
                print(f"[{placed.name}] {line}", flush=True)
            placed.last_lines = [*placed.last_lines, *lines][-20:]

    def wait_for_exit(self, placed: list[_Placed], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while any(p.returncode is None for p in placed) and time.monotonic() < deadline:
            self.pump()
            time.sleep(POLL_S)

    # ------------------------------------------------------------------ stopping
    def __exit__(self, *exc: object) -> None:
        running = self.placed  # stop() only signals a process still running; it cleans up
        refs = {}
        for placed in running:
            with contextlib.suppress(Exception):
                refs[placed.name] = placed.handle.stop.remote(self.stop_timeout_s)
        for placed in running:
            with contextlib.suppress(Exception):
                if placed.name in refs:
                    self.ray.get(refs[placed.name], timeout=self.stop_timeout_s + 15.0)
                self._take(
                    placed, self.ray.get(placed.handle.poll.remote(*placed.seen), timeout=5.0)
                )
        for placed in self.placed:
            with contextlib.suppress(Exception):
                self.ray.kill(placed.handle, no_restart=True)
        from ray.util.placement_group import remove_placement_group

        for pg in self.groups:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)


def _bundle(place: PlacementConfig) -> dict[str, float]:
    bundle = {"CPU": place.cpus, **place.resources}
    if place.gpus:
        bundle["GPU"] = place.gpus
    return {k: v for k, v in bundle.items() if v > 0}  # cpus > 0: never empty


def _resources(resources: dict[str, float]) -> str:
    shown = {
        k: v for k, v in resources.items() if not k.startswith(("node:", "memory", "object_store"))
    }
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(shown.items())) + "}"


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
