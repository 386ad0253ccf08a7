"""``ludic learner CONFIG``: the pipeline's learner (Redis -> Trainer -> publish).

``ludic train``'s job with a Redis queue where the rollouts were: the run directory (new, or
``--run-dir``), Redis (``pipeline.redis_url``, or a local server living as long as this
learner; ``RUN_DIR/pipeline.json`` says where), the warm start, then a ``Trainer`` on a
``PipelineBatchSource``, publishing to the actors' vLLM server or into Redis. It announces
itself in ``P:learner`` once the starting weights are published and ends the run (``P:done``)
after ``trainer.steps``. ``trainer.world_size: N``: N FSDP2 ranks, the others following rank 0
(``ludic.run.trainer_ranks``). Failures, restarts and what it does not write: docs/async.md.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from ludic.distributed import ClientPolicyPublisher
from ludic.inference import HFChatTemplate
from ludic.pipeline.run_info import (
    configured_redis_url,
    make_queue,
    open_learner_run,
    pipeline_prefix,
    redacted,
    require_pipeline_mode,
    require_reward_router,
    write_pipeline_info,
)
from ludic.run.builders import make_algorithm, make_engine
from ludic.run.config import RunConfig
from ludic.run.errors import RunError
from ludic.run.export import POLICY_DIR
from ludic.run.models import load_policy
from ludic.run.phases import (
    make_trainer,
    phase_loggers,
    report_run,
    run_rl,
    warm_start,
)
from ludic.run.preflight import check_config, check_local_servers
from ludic.run.run_dir import RunDirectory
from ludic.run.run_loggers import run_loggers
from ludic.run.servers import inference_backend
from ludic.run.signals import terminate_as_interrupt
from ludic.run.threads import use_torch_threads
from ludic.run.trainer_ranks import run_as_ranks, save_policy, share_run_dir
from ludic.training.data_parallel import TrainerRanks

__all__ = ["run_learner"]


def run_learner(config: RunConfig, *, run_dir: str | Path | None = None) -> Path:
    """Run (or continue, with ``run_dir``) the learner of a pipeline run; returns the run
    directory once ``trainer.steps`` RL steps are done."""
    with terminate_as_interrupt():
        require_pipeline_mode(config, "ludic learner")
        check_config(config)
        check_local_servers(config)
        require_reward_router(config, "ludic learner")  # the actors score: refused early
        _check_vllm_key(config)
        if config.trainer.world_size > 1:  # else torch's default, as before
            use_torch_threads(config, processes=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        return run_as_ranks(config, lambda ranks: _learn(config, run_dir, ranks), resume=True)


def _learn(config: RunConfig, run_dir: str | Path | None, ranks: TrainerRanks | None) -> Path:
    """The learner's run as one process or as rank 0 of ``trainer.world_size`` (the
    others follow it: :mod:`ludic.run.trainer_ranks`). Rank 0 alone talks to Redis and
    the servers, reads the queue and acknowledges what the group trained."""
    console = Console()
    run, config = open_learner_run(config, run_dir)
    console.print(f"run directory: [bold]{run.path}[/bold]", highlight=False, soft_wrap=True)
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(run_loggers(config, run))
        url = own_redis = configured_redis_url(config)
        password = None
        if url is None:  # with a password: any local process could otherwise edit the queue
            from ludic.pipeline.redis_server import start_run_redis

            server = start_run_redis(run.path / "redis", stack)
            url, password = server.url, server.password
            console.print(
                f"redis-server: {redacted(url)} (AOF in {server.data_dir}, log {server.log_path})",
                highlight=False,
                soft_wrap=True,
            )
        prefix = pipeline_prefix(config, run.path)
        queue = make_queue(config, url, prefix)
        stack.callback(queue.close)
        queue.start_run()  # clears an earlier end of this run (trainer.steps raised on resume)
        write_pipeline_info(run, url, prefix, own_password=password)
        console.print(
            f"pipeline: Redis {redacted(url)}, prefix {prefix!r}; start actors with: "
            f"ludic actor {run.config_path} --run-dir {run.path}",
            highlight=False,
            soft_wrap=True,
        )
        policy, tokenizer = load_policy(config, run.model_dir)
        if ranks is not None:  # the other ranks load the policy and checkpoints from here
            share_run_dir(run.path, ranks)
        warm_start(config, run, policy, tokenizer, resuming=True, console=console, ranks=ranks)
        client = stack.enter_context(
            inference_backend(config, policy, tokenizer, model_dir=run.model_dir, log_dir=run.path)
        )
        _reinforce_from_queue(config, run, policy, tokenizer, client, queue, console, ranks)
        save_policy(policy, tokenizer, run.path / POLICY_DIR, ranks)
        if own_redis is None:  # our Redis stops with us: let actors leave
            _wait_for_actors_to_leave(queue, config.pipeline.stop_timeout_s)
    report_run(config, run, console, started=started, title="ludic pipeline learner summary")
    return run.path


def _reinforce_from_queue(
    config: RunConfig,
    run: RunDirectory,
    policy: torch.nn.Module,
    tokenizer: Any,
    client: Any,
    queue: Any,
    console: Console,
    ranks: TrainerRanks | None,
) -> None:
    from ludic.pipeline.batch_source import PipelineBatchSource

    # reward_rl scores completions in a rollout hook, on the actors: no reward model here
    algorithm = make_algorithm(config)
    source = PipelineBatchSource(
        queue,
        max_staleness=config.trainer.staleness,
        batch_timeout_s=config.pipeline.batch_timeout_s,
    )
    title = f"RL ({algorithm.name}, pipeline)"
    loggers = phase_loggers(config, run, "rl", title, config.trainer.steps, console)
    trainer = make_trainer(
        config, run, "rl", policy, tokenizer, source, algorithm,
        publisher=_publisher(config, client, queue), loggers=loggers, ranks=ranks,
    )  # fmt: skip
    eval_engine = make_engine(
        config, client, HFChatTemplate(tokenizer), env_overrides=config.env.eval_kwargs
    )
    unused: list[int] = []
    run_rl(
        config, run, trainer, source, eval_engine, loggers[0], resuming=True, console=console,
        on_published=lambda: _announce(config, run, trainer, source, client, queue, console),
        # the actors stop before the ledger is settled: nothing is pushed after it
        on_steps_done=lambda: unused.append(queue.finish_run()),
    )  # fmt: skip
    queue.withdraw_learner()
    console.print(
        f"learner: {trainer.step} steps done; the run is over for the actors"
        + (
            f" ({unused[0]} queued batches left untrained, recorded in P:unused)"
            if unused[0]
            else ""
        ),
        soft_wrap=True,
    )


def _announce(config, run, trainer, source, client, queue, console) -> None:
    """The weights of version ``trainer.step`` are published: continue the pipeline's
    version from here (this also requeues batches a crashed learner had taken and
    announces max_staleness), then tell the actors."""
    source.set_version(trainer.step)
    vllm = config.inference.backend == "vllm"
    queue.announce_learner(
        {
            "version": trainer.step,
            "steps": config.trainer.steps,
            "weights": "vllm" if vllm else "redis",
            "inference_urls": _server_urls(client) if vllm else [],
            "max_staleness": config.trainer.staleness,
            "run_dir": str(run.path),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started_at": time.time(),
        }
    )
    console.print(f"learner: serving version {trainer.step}; waiting for actors' batches")


def _publisher(config: RunConfig, client: Any, queue: Any) -> Any:
    """vLLM: the server(s) the actors sample from, through the client's weight-sync
    group. transformers: Redis (for the actors) and the learner's own in-process copy
    (for its evaluations)."""
    if config.inference.backend == "vllm":
        return ClientPolicyPublisher(client)
    from ludic.pipeline.redis_weights import RedisWeightPublisher

    return _FanOutPublisher([RedisWeightPublisher(queue), ClientPolicyPublisher(client)])


class _FanOutPublisher:
    """A ``PolicyPublisher`` that publishes to each of ``publishers`` in turn."""

    def __init__(self, publishers: Sequence[Any]) -> None:
        self.publishers = list(publishers)

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        for publisher in self.publishers:
            publisher.publish(state_dict, version)


def _wait_for_actors_to_leave(queue: Any, timeout_s: float) -> None:
    """Before a learner-owned Redis stops: wait (at most ``timeout_s``) until no actor
    holds a batch claim, i.e. every actor saw the end of the run."""
    deadline = time.monotonic() + timeout_s
    claims = queue.keys.claims
    while queue.call("count claims", lambda c: c.hlen(claims)) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)  # an actor between two batches checks the done flag before claiming


def _check_vllm_key(config: RunConfig) -> None:
    """Actors must authenticate to the vLLM server the learner starts."""
    from ludic.inference.vllm.security import API_KEY_ENV

    v = config.inference.vllm
    if config.inference.backend != "vllm" or not v.start_server:
        return
    if not (v.api_key or os.environ.get(API_KEY_ENV)):
        raise RunError(
            "inference.vllm.api_key: the learner starts the vLLM server and the actors must "
            f"know its key; set ${API_KEY_ENV} (or inference.vllm.api_key) for the learner "
            "and every actor (`ludic train` does this for you)"
        )


def _server_urls(client: Any) -> list[str]:
    """The base URLs of the policy server(s) behind ``client`` (a pool or one client)."""
    from ludic.inference.vllm.pool import VLLMClientPool

    return client.base_urls if isinstance(client, VLLMClientPool) else [client.base_url]
