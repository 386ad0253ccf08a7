"""``ludic actor CONFIG --run-dir DIR``: one pipeline actor (rollouts -> SAW batches -> Redis).

Finds Redis (``pipeline.redis_url``, else ``RUN_DIR/pipeline.json``), waits at most
``pipeline.actor_timeout_s`` for the learner's announcement (``P:learner``), checks this config
against the run's, then makes batches with the run's env, agent and algorithm (problems a
function of the claimed batch index) through ``run_pipeline_actor`` (admission, backpressure).
Inference: an in-process copy reloaded from ``P:weights`` (``transformers``) or the learner's
vLLM server; a ``reward_loop`` scores here, through the run's shared router. Exits 0 when the
learner ends the run (``P:done``); timeouts and restarts (same ``--actor-id``): docs/async.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from ludic.inference import HFChatTemplate, TransformersChatClient
from ludic.pipeline.run_info import (
    check_same_run,
    configured_redis_url,
    handed_reward_router,
    make_queue,
    pipeline_prefix,
    redacted,
    require_pipeline_mode,
    require_reward_router,
    wait_for_redis_url,
)
from ludic.run.builders import batch_requests, make_algorithm, make_engine
from ludic.run.config import RunConfig
from ludic.run.errors import RunError
from ludic.run.models import load_policy, local_path, naming_load_errors, serving_copy
from ludic.run.preflight import check_config
from ludic.run.reward_loop import reward_loop_from_config, with_reward_loop
from ludic.run.run_dir import RunDirectory
from ludic.run.servers import reward_backend
from ludic.run.signals import terminate_as_interrupt
from ludic.training import RolloutBatchSource

__all__ = ["default_actor_id", "run_actor"]


def default_actor_id() -> str:
    """``HOST-PID``: unique among running actors (pass a stable ``--actor-id`` so that a
    restarted actor regenerates the batch it had claimed)."""
    return f"{socket.gethostname()}-{os.getpid()}"


def run_actor(config: RunConfig, *, run_dir: str | Path, actor_id: str | None = None) -> int:
    """Generate batches for the learner of ``run_dir`` until it ends the run; returns how
    many batches this actor pushed."""
    with terminate_as_interrupt():
        require_pipeline_mode(config, "ludic actor")
        check_config(config)
        require_reward_router(config, "ludic actor")
        return _act(config, Path(run_dir), actor_id or default_actor_id())


def _act(config: RunConfig, run_path: Path, actor_id: str) -> int:
    console = Console()
    p = config.pipeline
    url = configured_redis_url(config) or wait_for_redis_url(run_path, p.actor_timeout_s)
    queue = make_queue(config, url, pipeline_prefix(config, run_path))
    try:
        learner = _wait_for_learner(queue, p.actor_timeout_s)
        run = RunDirectory(run_path)
        check_same_run(config, run)
        console.print(
            f"actor {actor_id}: Redis {redacted(url)}, prefix {queue.keys.prefix!r}; the learner serves "
            f"version {learner['version']} (weights through {learner['weights']})",
            highlight=False,
            soft_wrap=True,
        )
        with contextlib.ExitStack() as stack:
            client, tokenizer, policy_version = _inference(config, run, learner, queue, stack)
            log_dir = run.path / "logs" / actor_id  # a reward server's log, if one starts
            if config.reward is not None or config.reward_loop is not None:
                log_dir.mkdir(parents=True, exist_ok=True)
            reward_client = stack.enter_context(reward_backend(config, log_dir=log_dir))
            algorithm = make_algorithm(config, reward_client=reward_client)
            # the reward loop scores here, in the actor: the learner trains on the scores.
            # Its servers and router run once for all actors (`ludic train` started them).
            reward_loop = stack.enter_context(
                reward_loop_from_config(config, log_dir=log_dir, router=handed_reward_router())
            )
            on_episode = [reward_loop.on_episode] if reward_loop is not None else []
            if reward_loop is not None:
                algorithm = with_reward_loop(algorithm, reward_loop, config)
            engine = make_engine(config, client, HFChatTemplate(tokenizer), on_episode=on_episode)
            source = RolloutBatchSource.from_algorithm(
                engine,
                # run_pipeline_actor claimed the index just before asking for the batch;
                # claim_index returns the claim this actor holds.
                lambda: batch_requests(config, queue.claim_index(actor_id)),
                algorithm,
            )
            pushed = asyncio.run(_produce(config, source, queue, actor_id, policy_version))
        console.print(f"actor {actor_id}: pushed {len(pushed)} batches; the learner ended the run")
        return len(pushed)
    finally:
        queue.close()


def _wait_for_learner(queue: Any, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while (info := queue.learner_info()) is None:
        if time.monotonic() >= deadline:
            raise RunError(
                f"no learner announced itself on Redis {queue.url} (prefix "
                f"{queue.keys.prefix!r}) within {timeout_s:g}s (pipeline.actor_timeout_s); "
                "start `ludic learner CONFIG --run-dir RUN_DIR` first (it announces itself "
                "after its warm start), or use `ludic train` with trainer.mode=pipeline"
            )
        time.sleep(0.2)
    return info


def _inference(
    config: RunConfig, run: RunDirectory, learner: dict[str, Any], queue: Any, stack: Any
) -> tuple[Any, Any, Callable[[], int | None]]:
    """The chat client, the tokenizer, and the ``policy_version`` callable read before
    each batch (transformers: it first reloads newer weights from Redis)."""
    if config.inference.backend == "transformers":
        from ludic.pipeline.redis_weights import RedisWeightSubscriber

        policy, tokenizer = load_policy(config, run.model_dir)
        client = TransformersChatClient(
            serving_copy(policy),
            tokenizer,
            max_batch_size=config.inference.max_batch_size,
            verify_sync=config.inference.vllm.verify_sync,
        )
        del policy  # the serving copy is all this actor samples from
        subscriber = RedisWeightSubscriber(queue, client)
        if subscriber.refresh() is None:
            raise RunError(
                f"the learner announced itself on {queue.keys.prefix!r} but published no "
                "weights to Redis; are learner and actor both on inference.backend=transformers?"
            )
        return client, tokenizer, subscriber.refresh
    from ludic.inference.vllm.client import VLLMChatClient
    from ludic.inference.vllm.pool import VLLMClientPool
    from ludic.inference.vllm.security import API_KEY_ENV

    urls = learner.get("inference_urls")
    if not urls:
        raise RunError(
            "inference.backend=vllm but the learner serves no vLLM server (it runs "
            f"{learner.get('weights')!r} weights); use the learner's inference.backend"
        )
    v = config.inference.vllm
    clients = [  # the learner's publishes pause these servers: continue what they abort
        VLLMChatClient(
            url,
            api_key=v.api_key or os.environ.get(API_KEY_ENV),
            timeout_s=v.timeout_s,
            partial_rollouts=v.partial_rollouts,
            verify_sync=v.verify_sync,
        )
        for url in urls
    ]
    client: Any = clients[0] if len(clients) == 1 else VLLMClientPool(clients)
    stack.callback(client.close)
    return client, _load_tokenizer(config, run), client.get_policy_version


def _load_tokenizer(config: RunConfig, run: RunDirectory) -> Any:
    from transformers import AutoTokenizer

    path = config.model.path or str(run.model_dir)
    with naming_load_errors("model.path", path):
        return AutoTokenizer.from_pretrained(str(local_path(path) or path))


async def _produce(
    config: RunConfig,
    source: RolloutBatchSource,
    queue: Any,
    actor_id: str,
    policy_version: Callable[[], int | None],
) -> list[str]:
    from ludic.pipeline.batch_source import run_pipeline_actor

    stop = threading.Event()
    try:
        return await run_pipeline_actor(
            source,
            queue,
            actor_id=actor_id,
            max_staleness=config.trainer.staleness,
            stop=stop,
            policy_version=policy_version,
            admission_timeout_s=config.pipeline.actor_timeout_s,
        )
    finally:
        stop.set()  # cancelled (Ctrl-C, SIGTERM): a push waiting on a full queue gives up
