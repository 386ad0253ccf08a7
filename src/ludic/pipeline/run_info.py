"""What the pipeline's processes share: the mode check, the Redis key prefix, the queue
settings, the run directory's ``pipeline.json`` and the config check between processes.

A run is one learner and any number of actors on one key prefix (``ludic learner``, ``ludic
actor``, or ``ludic train`` starting all of them). ``RUN_DIR/pipeline.json``, written by the
learner, names the Redis URL and the prefix, so an actor given the run directory finds the queue.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from ludic.jsonl import write_atomic
from ludic.pipeline.redis_urls import redacted
from ludic.run.config import RunConfig
from ludic.run.errors import RunError
from ludic.run.reward_loop import RouterAddress, starts_reward_servers
from ludic.run.rl_job import RESUMABLE_CHANGES
from ludic.run.run_dir import RunDirectory, changed_keys

PIPELINE_INFO = "pipeline.json"
REDIS_PASSWORD_FILE = "redis_password"
"""The password of the Redis a learner started, beside ``pipeline.json`` (mode 0600)."""
REDIS_URL_ENV = "LUDIC_REDIS_URL"
"""Where ``pipeline.redis_url`` is null, the Redis URL (password included) that ``ludic
launch`` hands the learner and the actors it places, kept off their command lines."""
REWARD_ROUTER_URL_ENV = "LUDIC_REWARD_ROUTER_URL"
"""The URL of the reward router ``ludic train`` started for its actors (``reward_loop.
disrm`` / ``genrm`` without ``reward_loop.router.address``)."""
REWARD_ROUTER_KEY_ENV = "LUDIC_REWARD_ROUTER_KEY"
"""That router's API key: in the environment, never on a command line."""
LEARNER_ID = "learner"
PIPELINE_RESUMABLE = frozenset(
    {
        *RESUMABLE_CHANGES,
        "pipeline.redis_url",
        "pipeline.num_actors",
        "pipeline.max_queued",
        "pipeline.batch_timeout_s",
        "pipeline.actor_timeout_s",
        "pipeline.reconnect_timeout_s",
        "pipeline.stop_timeout_s",
        "launch",
        # where the servers are: `ludic launch` places them anew on every (re)start
        "inference.vllm.start_server",
        "inference.vllm.num_servers",
        "inference.vllm.urls",
        "inference.vllm.host",
        "inference.vllm.port",
        "inference.vllm.group_host",
        "inference.vllm.group_port",
        "inference.vllm.cpu_cores",
        "reward.server.start_server",
        "reward.server.host",
        "reward.server.port",
    }
)
"""Config fields a pipeline run may change on resume (and in which an actor's config may
differ from the run's): ``rl_job.RESUMABLE_CHANGES`` plus the pipeline's plumbing and where
its servers run. Not
``pipeline.prefix``: the queue lives under it."""


def require_pipeline_mode(config: RunConfig, command: str) -> None:
    """``ludic learner`` / ``ludic actor`` need ``trainer.mode: pipeline``."""
    if config.trainer.mode != "pipeline":
        raise RunError(
            f"trainer.mode={config.trainer.mode!r}: `{command}` is one side of the actor/"
            "learner pipeline; set trainer.mode=pipeline (or run `ludic train` for mode "
            f"{config.trainer.mode})"
        )


def handed_reward_router() -> RouterAddress | None:
    """The reward router ``ludic train`` started and handed its learner and actors in
    :data:`REWARD_ROUTER_URL_ENV` / :data:`REWARD_ROUTER_KEY_ENV`; None without one."""
    url = os.environ.get(REWARD_ROUTER_URL_ENV)
    return (url, os.environ.get(REWARD_ROUTER_KEY_ENV) or None) if url else None


def require_reward_router(config: RunConfig, command: str) -> None:
    """A pipeline's actors score the reward loop, so its servers must run once for all of
    them: started by ``ludic train`` (which hands them over, :func:`handed_reward_router`)
    or named by ``reward_loop.router.address``; ``command`` (a learner or actor started
    by hand, ``ludic launch``) would otherwise leave every actor to start its own."""
    if starts_reward_servers(config) and handed_reward_router() is None:
        raise RunError(
            "reward_loop.disrm / genrm / group_judge with trainer.mode=pipeline: every actor "
            "would start its own reward servers; start them once (ludic serve reward / "
            "policy, ludic serve router) and set reward_loop.router.address, which every "
            f"actor shares (`ludic train` starts them for its actors; `{command}` does not)"
        )


def pipeline_prefix(config: RunConfig, run_path: Path) -> str:
    """``pipeline.prefix``, else the run directory's name (NAME-TIMESTAMP)."""
    prefix = config.pipeline.prefix or Path(run_path).resolve().name
    if any(c.isspace() for c in prefix):
        raise RunError(
            f"the run directory name {prefix!r} has a space, so it cannot be the Redis key "
            "prefix; set pipeline.prefix"
        )
    return prefix


def configured_redis_url(config: RunConfig) -> str | None:
    """``pipeline.redis_url``, else ``$LUDIC_REDIS_URL``, else None (the learner starts a
    local redis-server; an actor reads RUN_DIR/pipeline.json)."""
    return config.pipeline.redis_url or os.environ.get(REDIS_URL_ENV) or None


def make_queue(config: RunConfig, url: str, prefix: str) -> Any:
    """A ``RedisBatchQueue`` with the run's settings (imported here: it needs ``redis``)."""
    try:
        from ludic.pipeline.redis_queue import RedisBatchQueue
    except ImportError as err:
        raise RunError(f"trainer.mode=pipeline: {err}") from None
    p = config.pipeline
    return RedisBatchQueue(
        url,
        prefix=prefix,
        max_queued=p.max_queued,
        learner_id=LEARNER_ID,
        push_timeout_s=p.actor_timeout_s,
        block_s=1.0,
        reconnect_timeout_s=p.reconnect_timeout_s,
    )


def write_pipeline_info(
    run: RunDirectory, redis_url: str, prefix: str, *, own_password: str | None = None
) -> None:
    """``RUN_DIR/pipeline.json``: where the run's queue is (written atomically; a password
    is left out). ``own_password``: that of the Redis the learner started, written to
    ``RUN_DIR/``:data:`REDIS_PASSWORD_FILE` (mode 0600) for actors started with
    ``--run-dir``; actors of a Redis given by URL get it in ``$LUDIC_REDIS_URL``."""
    if own_password is not None:
        write_atomic(run.path / REDIS_PASSWORD_FILE, own_password)  # mkstemp: mode 0600
    info = {"redis_url": redacted(redis_url), "prefix": prefix}
    write_atomic(run.path / PIPELINE_INFO, json.dumps(info, indent=2) + "\n")


def with_run_password(url: str, run_path: Path) -> str:
    """``url`` from ``pipeline.json``; when its password was left out (``***``), the one
    in ``RUN_DIR/``:data:`REDIS_PASSWORD_FILE` put back."""
    parts = urlsplit(url)
    if parts.password != "***":
        return url
    path = Path(run_path) / REDIS_PASSWORD_FILE
    try:
        password = path.read_text()
    except OSError as e:
        raise RunError(
            f"{path}: cannot read the run's Redis password ({type(e).__name__}); run the "
            "actor as the learner's user, or give the URL in $LUDIC_REDIS_URL"
        ) from None
    port = f":{parts.port}" if parts.port else ""
    netloc = f"{parts.username or ''}:{quote(password, safe='')}@{parts.hostname or ''}{port}"
    return urlunsplit(parts._replace(netloc=netloc))


def wait_for_redis_url(run_path: Path, timeout_s: float) -> str:
    """The Redis URL in ``RUN_DIR/pipeline.json``, waiting up to ``timeout_s`` for a
    learner to write it."""
    path = Path(run_path) / PIPELINE_INFO
    deadline = time.monotonic() + timeout_s
    while not path.is_file():
        if time.monotonic() >= deadline:
            raise RunError(
                f"--run-dir {str(run_path)!r}: no {PIPELINE_INFO} after {timeout_s:g}s, so "
                "the Redis URL is unknown; start `ludic learner CONFIG` first and pass the "
                "run directory it prints, or set pipeline.redis_url"
            )
        time.sleep(0.2)
    try:
        url = json.loads(path.read_text())["redis_url"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise RunError(
            f"{path}: not a pipeline info file ({type(e).__name__}: {e}); it holds "
            '{"redis_url": ..., "prefix": ...} written by `ludic learner`; delete it and '
            "restart the learner, or set pipeline.redis_url"
        ) from None
    return with_run_password(str(url), run_path)


def open_learner_run(
    config: RunConfig, run_dir: str | Path | None
) -> tuple[RunDirectory, RunConfig]:
    """The learner's run directory: a new OUTPUT_DIR/NAME-TIMESTAMP (``run_dir`` None),
    ``run_dir`` created afresh when it does not exist (or is empty), or the run in
    ``run_dir`` continued, its saved config checked against ``config`` (only
    :data:`PIPELINE_RESUMABLE` fields may differ). Saves the config."""
    from ludic.run.run_dir import open_run

    if run_dir is None:
        return open_run(config, resume=None, resumable=PIPELINE_RESUMABLE)
    path = Path(run_dir).resolve()  # absolute: redis-server, actors and hints use it
    if (path / "config.yaml").is_file():
        return open_run(config, resume=path, resumable=PIPELINE_RESUMABLE)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise RunError(
            f"--run-dir {str(run_dir)!r} exists but is not a run directory (no config.yaml); "
            "pass a run directory, a new path, or an empty folder"
        )
    path.mkdir(parents=True, exist_ok=True)
    run = RunDirectory(path)
    run.save_config(config)
    return run, config


def check_same_run(config: RunConfig, run: RunDirectory) -> None:
    """An actor must generate for the run's config: only :data:`PIPELINE_RESUMABLE`
    fields may differ from ``RUN_DIR/config.yaml``."""
    changed = changed_keys(run.load_config(), config, PIPELINE_RESUMABLE)
    if changed:
        raise RunError(
            f"the actor's config differs from the learner's ({run.config_path}) at {changed}; "
            f"start actors with the run's own config: ludic actor {run.config_path} "
            f"--run-dir {run.path}"
        )
