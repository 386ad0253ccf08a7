"""The ``reward_loop`` section as running parts (:func:`reward_loop_from_config`).

Reward servers (DisRM, GenRM, a group judge) behind one router; the reward function (rule,
or weighted rule + DisRM + GenRM) and its manager, or the group judge, in a
:class:`~ludic.rewards.RewardLoop`; the algorithm that trains on its scores. Servers and
router share one API key (``disrm.server.api_key``, else ``genrm``'s, else
``$LUDIC_API_KEY``, else a fresh one). Servers start in the training process, or in
pipeline mode once in ``ludic train``'s launcher (:func:`reward_router`), whose actors get
the router's address and start none; ``sleep`` servers: :mod:`ludic.run.reward_sleep`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ludic._imports import import_module, is_code_spec
from ludic.rewards import (
    DisRMScore,
    GenRMJudge,
    RewardLoop,
    WeightedReward,
    default_compute_score,
    make_reward_manager,
    rollout_reward_sample,
)
from ludic.rewards.genrm import DEFAULT_TEMPLATE
from ludic.rewards.group_judge import GROUP_TEMPLATE, GroupJudge
from ludic.rewards.sample import RewardSample
from ludic.run.builders import build_env
from ludic.run.config import RunConfig
from ludic.run.config_reward import RewardLoopSection
from ludic.run.errors import RunError
from ludic.run.registries import REWARD_FUNCTION, REWARD_MANAGER, load_part
from ludic.run.reward_sleep import SLEEP_LEVELS, RewardServerSleep, sleep_server_args
from ludic.run.servers import server_api_key, server_args
from ludic.training import RewardLoopCreditAssigner
from ludic.training.algorithm import RLAlgorithm

_NEEDS_VLLM = (
    "{field} starts vLLM servers, which needs vLLM ({error}); pip install 'ludic-rl[vllm]'"
)


RouterAddress = tuple[str | None, str | None]
"""A reward router's (URL, API key); (None, None) where the reward loop uses no server."""


@contextlib.contextmanager
def reward_loop_from_config(
    config: RunConfig, *, log_dir: Path, router: RouterAddress | None = None
) -> Iterator[RewardLoop | None]:
    """The configured :class:`RewardLoop` (``None`` without a ``reward_loop`` section),
    with its servers and router running (:func:`reward_router`); all stopped on exit.
    ``router``: a router running already (a pipeline actor's, started by ``ludic train``),
    used instead, so that nothing starts here."""
    section = config.reward_loop
    if section is None:
        yield None
        return
    with contextlib.ExitStack() as stack:
        servers = None  # reward servers that sleep between batches
        if router is None:
            router, servers = _start_servers(config, log_dir, stack)
        address, key = router
        make_loop = functools.partial(
            RewardLoop,
            mode=section.mode,
            num_workers=section.num_workers,
            max_failure_fraction=section.max_failure_fraction,
            to_sample=functools.partial(
                rollout_reward_sample, data_source=section.data_source or config.env.kind
            ),
        )
        if section.group_judge is not None:
            judge = group_judge(section, address, key)
            probe_group_judge(judge, config)
            group_size = config.algorithm.group_size
            yield make_loop(group_scorer=judge, group_size=group_size, servers=_asleep(servers))
            return
        function: Any = rule_function(section)
        if section.disrm is not None or section.genrm is not None:
            function = _hybrid(section, function, address, key)
        manager = make_manager(
            section,
            config,
            function,
            {"reward_router_address": address, "reward_router_api_key": key} if address else {},
        )
        if address:  # the servers are up now: the whole path (a rule alone: preflight did)
            probe_reward(manager, config)
        yield make_loop(manager, servers=_asleep(servers))


def probe_reward(manager: Any, config: RunConfig) -> None:
    """Score one sample through ``manager`` before the run: the env's problem for seed
    ``config.seed``, answered with its own target (``response_length`` 1). A failure is a
    :class:`RunError` naming the section and the error, so that a reward path that fails
    every sample (a function that raises, a data_source no rule knows) stops the run
    before it trains on nothing."""
    section = config.reward_loop
    assert section is not None
    observations = build_env(config).reset(seed=config.seed)
    question, info = next(iter(observations.values()))
    target = info.get("target")
    data_source = section.data_source or config.env.kind
    sample = RewardSample(
        data_source=data_source,
        solution_str="" if target is None else str(target),
        ground_truth=target,
        extra_info={"question": question},
        response_length=1,
        sample_id="probe",
    )
    result = asyncio.run(manager.run_single(sample))
    if result.error is not None:
        raise RunError(
            f"reward_loop: a probe sample (env {config.env.kind!r}, seed {config.seed}, "
            f"data_source {data_source!r}, answered with its target {target!r}) failed to "
            f"score before the run: {result.error}"
        )


def group_judge(section: RewardLoopSection, address: str | None, key: str | None) -> GroupJudge:
    """The configured :class:`GroupJudge` on the reward router."""
    g = section.group_judge
    assert g is not None
    try:
        return GroupJudge(
            address,
            mode=g.mode,
            template=g.template or GROUP_TEMPLATE,
            sampling=g.sampling,
            api_key=key,
            timeout_s=section.router.request_timeout_s,
            on_error=section.on_error,
        )
    except ValueError as e:
        raise RunError(f"reward_loop.group_judge: {e}") from None


def probe_group_judge(judge: GroupJudge, config: RunConfig) -> None:
    """Judge one group before the run (the env's problem for seed ``config.seed``,
    answered with its target and with nothing): a judge that cannot reply in the schema
    stops the run here, naming the error."""
    observations = build_env(config).reset(seed=config.seed)
    question, info = next(iter(observations.values()))
    target = info.get("target")
    samples = [
        RewardSample("probe", answer, target, extra_info={"question": question})
        for answer in ("" if target is None else str(target), "")
    ]
    results = asyncio.run(judge.score_group(samples))
    if results[0].error is not None:
        raise RunError(
            f"reward_loop.group_judge: a probe group (env {config.env.kind!r}, seed "
            f"{config.seed}) failed to score before the run: {results[0].error}"
        )


def with_reward_loop(algorithm: RLAlgorithm, loop: RewardLoop, config: RunConfig) -> RLAlgorithm:
    """``algorithm`` training on the reward loop's scores: ``loop`` joins its rollout hooks
    and its credit assigner sees each rollout's combined return (``reward_loop.combine``)."""
    section = config.reward_loop
    assert section is not None
    credit = RewardLoopCreditAssigner(
        mode=section.combine, weight=section.env_weight, inner=algorithm.credit_assigner
    )
    return dataclasses.replace(
        algorithm, credit_assigner=credit, rollout_hooks=(*algorithm.rollout_hooks, loop)
    )


def make_manager(
    section: RewardLoopSection,
    config: RunConfig,
    function: Any,
    function_kwargs: dict[str, Any] | None = None,
) -> Any:
    """The configured reward manager over ``function`` (errors name the field)."""
    if section.manager_module is not None:
        try:
            import_module(section.manager_module, field="reward_loop.manager_module")
        except (ValueError, FileNotFoundError) as e:
            raise RunError(str(e)) from None
    kwargs = dict(section.manager_kwargs)
    if section.manager == "dapo":
        kwargs.setdefault("max_response_length", config.sampling.max_tokens)
    build: Any = functools.partial(make_reward_manager, section.manager)
    if is_code_spec(section.manager):
        build = load_part(REWARD_MANAGER, section.manager, field="reward_loop.manager")
    try:
        return build(
            compute_score=function,
            timeout_s=section.timeout_s,
            on_error=section.on_error,
            function_kwargs={**section.function_kwargs, **(function_kwargs or {})},
            **kwargs,
        )
    except (TypeError, ValueError) as e:
        raise RunError(f"reward_loop.manager / reward_loop.manager_kwargs: {e}") from None


# ------------------------------------------------------------------------------ parts
def rule_function(section: RewardLoopSection) -> Any:
    if section.function is None:
        return default_compute_score
    return load_part(REWARD_FUNCTION, section.function, field="reward_loop.function")


def _hybrid(section: RewardLoopSection, rule: Any, address: str, key: str | None) -> Any:
    from ludic.inference.vllm.reward_client import VLLMRewardClient

    components: dict[str, tuple[Any, float]] = {}
    if section.rule_weight:
        components["rule"] = (rule, section.rule_weight)
    if section.disrm is not None:
        client = VLLMRewardClient(
            address, api_key=key, timeout_s=section.router.request_timeout_s, check_server=False
        )
        score = DisRMScore(client, normalize=section.disrm.normalize)
        components["disrm"] = (score, section.disrm.weight)
    if section.genrm is not None:
        g = section.genrm
        judge = GenRMJudge(
            address,
            template=g.template or DEFAULT_TEMPLATE,
            pattern=g.pattern,
            scale=g.scale,
            sampling=g.sampling,
            api_key=key,
            timeout_s=section.router.request_timeout_s,
        )
        components["genrm"] = (judge, g.weight)
    return WeightedReward(components)


def starts_reward_servers(config: RunConfig) -> bool:
    """Whether the reward loop starts servers: ``disrm``, ``genrm`` or ``group_judge`` set,
    and no running
    router (``reward_loop.router.address``) to use instead. A router is started then even
    over servers that run already (``server.start_server: false``)."""
    section = config.reward_loop
    return (
        section is not None
        and any(s is not None for s in (section.disrm, section.genrm, section.group_judge))
        and section.router.address is None
    )


@contextlib.contextmanager
def reward_router(config: RunConfig, *, log_dir: Path) -> Iterator[RouterAddress]:
    """The reward loop's router as (URL, API key): ``reward_loop.router.address``, or a
    router started over the ``disrm``/``genrm`` servers started here (their logs and tiny
    models in ``log_dir``), all stopped on exit; (None, None) when the loop uses no
    server."""
    with contextlib.ExitStack() as stack:
        yield _start_servers(config, log_dir, stack)[0]


def _asleep(servers: RewardServerSleep | None) -> RewardServerSleep | None:
    """``servers`` put to sleep (after the probe scored through them awake)."""
    if servers is not None:
        servers.sleep_now()
    return servers


def _start_servers(
    config: RunConfig, log_dir: Path, stack: contextlib.ExitStack
) -> tuple[RouterAddress, RewardServerSleep | None]:
    """Start the reward servers and a router over them (stopped by ``stack``); the
    servers set to sleep between batches, if any (awake now)."""
    section = config.reward_loop
    if section is None:
        return (None, None), None
    r = section.router
    if r.address is not None:
        from ludic.inference.vllm.security import API_KEY_ENV

        return (r.address.rstrip("/"), r.api_key or os.environ.get(API_KEY_ENV) or None), None
    servers = (
        ("disrm", section.disrm),
        ("genrm", section.genrm),
        ("group_judge", section.group_judge),
    )
    groups = [(n, g) for n, g in servers if g]
    if not groups:
        return (None, None), None
    try:
        from ludic.inference.router import start_router
        from ludic.inference.vllm.process import start_vllm_server
    except ImportError as e:
        raise RunError(_NEEDS_VLLM.format(field="reward_loop", error=e)) from None
    key = server_api_key(groups[0][1].server)
    urls, sleeping = _start_group_servers(groups, key, config, log_dir, stack, start_vllm_server)
    router = start_router(
        urls,
        host="127.0.0.1",
        port=r.port,
        api_key=key,
        backend_api_key=key,
        health_interval_s=r.health_interval_s,
        request_timeout_s=r.request_timeout_s,
        log_path=log_dir / "reward_router.log",
    )
    stack.callback(router.stop)
    if not sleeping:
        return (router.url, key), None
    timeout_s = max(g.server.timeout_s for _, g in groups)
    sleep = RewardServerSleep.start(sleeping, api_key=key, timeout_s=timeout_s)
    stack.callback(sleep.close)
    return (router.url, key), sleep


def _start_group_servers(
    groups: list[tuple[str, Any]],
    key: str | None,
    config: RunConfig,
    log_dir: Path,
    stack: contextlib.ExitStack,
    start_vllm_server: Any,
) -> tuple[list[str], list[tuple[str, int, Path]]]:
    """Each group's servers started together (stopped by ``stack``), waited for in turn;
    a group not started here is the running server at its port. Returns every server's
    URL and those set to sleep between batches (URL, level, model)."""
    cuda = config.model.device.startswith("cuda")
    urls: list[str] = []
    starting = []
    sleeping: list[tuple[str, int, Path]] = []
    for name, group in groups:
        if not group.server.start_server:
            if group.server.port is None:
                raise RunError(f"reward_loop.{name}.server.port: set the running server's port")
            urls.append(f"http://{group.server.host}:{group.server.port}")
            continue
        model = group.path or _tiny_model(name, log_dir)
        if group.sleep == "reload_weights" and not Path(model).is_dir():
            raise RunError(
                f"reward_loop.{name}.sleep=reload_weights reads the weights again from "
                f"{name}.path at every wake; {model!r} is not a local model folder (download "
                "it first, or use sleep: keep_weights)"
            )
        for i in range(group.num_servers):
            server = start_vllm_server(
                model,
                kind="reward" if name == "disrm" else "policy",
                host=group.server.host,
                port=group.server.port,
                api_key=key,
                extra_args=[
                    *server_args(group.server, cuda),
                    *sleep_server_args(group.sleep, model),
                ],
                cpu=not cuda,
                log_path=log_dir / f"vllm_{name}_{i}.log",
                wait=False,
            )
            stack.callback(server.stop)
            starting.append((server, group.server.timeout_s))
            urls.append(server.url)
            if group.sleep != "off":
                sleeping.append((server.url, SLEEP_LEVELS[group.sleep], Path(model)))
    for server, timeout_s in starting:  # started together, waited for in turn
        server.wait_until_healthy(max(timeout_s, 300.0))
    return urls, sleeping


def _tiny_model(name: str, run_dir: Path) -> Path:
    from ludic.models.tiny import save_tiny_model, save_tiny_reward_model

    folder = run_dir / f"{name}_model"
    if not (folder / "config.json").is_file():
        (save_tiny_reward_model if name == "disrm" else save_tiny_model)(folder)
    return folder
