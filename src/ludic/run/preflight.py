"""Check that every part a run config names can be built, before anything trains.

The schema (:mod:`ludic.run.config`) checks what needs no imports: types, ranges, finite
numbers, consistent fields. :func:`check_config` goes further and builds (then drops) each
part the run will build later -- the device, the env with ``env.kwargs`` and with
``env.eval_kwargs``, the parser, the algorithm preset with ``algorithm.kwargs``, both
phases' optimizer settings -- so a config that cannot run fails in seconds with a
:class:`RunError` naming the field, instead of after a warm start whose run directory a
fixed config could then no longer resume.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ludic.envs.verifiers_env import VerifiersEnv
from ludic.run.builders import (
    build_env,
    make_algorithm,
    reward_trainer_config,
    rl_trainer_config,
    warm_start_trainer_config,
)
from ludic.run.config import RunConfig
from ludic.run.demos import check_demonstrable
from ludic.run.errors import RunError
from ludic.run.models import check_model_path, reward_model_folder
from ludic.run.registries import PARSER, PROGRAM, TOOL, load_part
from ludic.run.reward_loop import make_manager, probe_reward, rule_function


def check_config(config: RunConfig) -> None:
    """Raise :class:`RunError` naming the field if any part of ``config`` cannot be built."""
    if config.task == "reward_model":
        _check_reward_model(config)
        return
    check_device("model.device", config.model.device)
    check_model_path("model.path", config.model.path)
    if config.reward is not None:
        reward_model_folder(config.reward.path)
    load_part(PARSER, config.agent.parser, field="agent.parser")
    env = build_env(config)
    build_env(config, config.env.eval_kwargs, field="env.eval_kwargs")
    _check_holdout(config)
    _check_agent(config, env)
    _check_warm_start(config, env)
    _check_algorithm(config)
    _check_trainer_configs(config)
    check_reward_loop(config)


def check_local_servers(config: RunConfig) -> None:
    """The vLLM servers ludic starts on this machine (``ludic train``, ``ludic learner``;
    ``ludic launch`` places them on GPUs of their own): one runs on the first visible GPU,
    so a trainer there cannot join it in an NCCL group (NCCL refuses two ranks on one
    GPU). A tensor-parallel CPU server needs its workers' cores. Raise :class:`RunError`
    naming the fix."""
    v = config.inference.vllm
    check_tensor_parallel_cores(config)
    if (
        config.inference.backend == "vllm"
        and v.start_server
        and v.sync_strategy == "broadcast"
        and config.sync_backend == "nccl"
        and config.model.device in ("cuda", "cuda:0")
    ):
        raise RunError(
            f"inference.vllm.sync_strategy=broadcast over NCCL with model.device="
            f"{config.model.device}: the server ludic starts runs on the same GPU (the first "
            "visible one), and NCCL refuses two ranks on one GPU. Use "
            "inference.vllm.sync_strategy=packed_cuda_ipc (trainer and server share the "
            "GPU), or model.device=cuda:1, or start the server yourself on another GPU "
            "(inference.vllm.start_server=false)"
        )


def check_tensor_parallel_cores(config: RunConfig) -> None:
    """A policy server ludic starts on CPU with ``tensor_parallel_size`` > 1 needs
    ``cpu_cores`` (a core set per worker): vLLM's own CPU binding asks for a NUMA node
    per worker and fails on a machine with fewer."""
    v = config.inference.vllm
    tp = v.tensor_parallel_size
    cpu = not config.model.device.startswith("cuda")
    if config.inference.backend == "vllm" and v.start_server and tp > 1 and cpu and not v.cpu_cores:
        example = "|".join(str(i) for i in range(tp))
        raise RunError(
            f"inference.vllm.tensor_parallel_size={tp} on CPU needs inference.vllm.cpu_cores: "
            f"one core set per worker, joined by '|', for each server (e.g. ['{example}']); "
            "vLLM's own CPU binding wants a NUMA node per worker"
        )


def check_device(field: str, device: str) -> None:
    """``device`` must be a torch device this machine has."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise RunError(
            f"{field}: {device!r} is not a torch device; use cpu, cuda or cuda:N"
        ) from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise RunError(
                f"{field}={device!r} but no CUDA GPU is available here (torch "
                f"{torch.__version__}); use {field}=cpu"
            )
        if parsed.index is not None and parsed.index >= count:
            raise RunError(
                f"{field}={device!r} but this machine has {count} CUDA GPU(s): use "
                f"cuda:0..cuda:{count - 1}"
            )
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        raise RunError(f"{field}={device!r} but MPS is not available here; use {field}=cpu")


def _check_agent(config: RunConfig, env: Any) -> None:
    """The tools load, and the protocol fits the env's number of agents."""
    for spec in config.agent.tools:
        load_part(TOOL, spec, field="agent.tools")
    if config.agent.program is not None:
        load_part(PROGRAM, config.agent.program, field="agent.program")
    plays_verifiers = config.agent.program == "verifiers"
    if isinstance(env, VerifiersEnv) != plays_verifiers:
        raise RunError(
            "agent.program: a verifiers taskset is played by its agent program; set "
            "agent.kind: program and agent.program: verifiers"
            if not plays_verifiers
            else f"agent.program: verifiers plays env.kind verifiers, not {config.env.kind!r}"
        )
    agent_ids = list(getattr(env, "agent_ids", []))
    if len(agent_ids) > 1 and config.agent.protocol != "multi_agent":
        raise RunError(
            f"agent.protocol: env {config.env.kind!r} has agents {agent_ids}; set "
            "agent.protocol: multi_agent (one agent per player, all from the policy)"
        )
    if len(agent_ids) == 1 and config.agent.protocol == "multi_agent":
        raise RunError(
            f"agent.protocol: multi_agent needs an env with several agents; "
            f"{config.env.kind!r} has one ({agent_ids[0]!r})"
        )


def _check_warm_start(config: RunConfig, env: Any) -> None:
    """The warm start's demonstrations exist: a file, or an env with reference answers."""
    w = config.warm_start
    if w.steps == 0:
        return
    if w.demos != "dataset_answers":
        if not Path(w.demos).expanduser().is_file():
            raise RunError(
                f"warm_start.demos: {w.demos!r} is neither 'dataset_answers' nor an existing "
                "JSONL file of rollouts"
            )
        return
    check_demonstrable(config, env)


def _check_holdout(config: RunConfig) -> None:
    """Samples held out of training (``env.kwargs.holdout``) are there to be evaluated on."""
    holdout = config.env.kwargs.get("holdout")
    evaluated = {**config.env.kwargs, **config.env.eval_kwargs}
    if holdout and evaluated.get("part") != "heldout":
        raise RunError(
            f"env.eval_kwargs.part: env.kwargs.holdout={holdout!r} keeps samples out of "
            "training, but evaluation runs on the training part; set "
            "env.eval_kwargs.part=heldout (or drop env.kwargs.holdout)"
        )


def _check_algorithm(config: RunConfig) -> None:
    # reward_rl's reward client starts with the run: the preset's other arguments now
    make_algorithm(config)


def _check_trainer_configs(config: RunConfig) -> None:
    _trainer_config("trainer", lambda: rl_trainer_config(config, 0))
    if config.warm_start.steps > 0:
        _trainer_config("warm_start", lambda: warm_start_trainer_config(config, 0))


def _check_reward_model(config: RunConfig) -> None:
    rm = config.reward_model
    check_device("reward_model.device", rm.device)
    check_model_path("reward_model.path", rm.path)
    _trainer_config("reward_model", lambda: reward_trainer_config(config))


def _trainer_config(section: str, build: Callable[[], Any]) -> None:
    """Build a trainer config; its ``TrainerConfig.x=...`` errors become ``section.x``."""
    try:
        build()
    except ValueError as e:
        text = re.sub(r"\b\w*TrainerConfig\.", f"{section}.", str(e))
        raise RunError(text if text.startswith(section) else f"{section}: {text}") from None


def check_reward_loop(config: RunConfig) -> None:
    """Preflight: the function loads, the manager is registered and takes its arguments.
    (Where a pipeline's reward servers run is the pipeline's check:
    ``ludic.pipeline.run_info.require_reward_router``.)"""
    section = config.reward_loop
    if section is None:
        return
    if section.group_judge is not None:  # the judge answers once its server is up
        if make_algorithm(config).request_strategy is None:
            raise RunError(
                f"reward_loop.group_judge judges each prompt's group of completions; "
                f"algorithm.name={config.algorithm.name!r} samples no groups: use a group "
                "preset (grpo, dr_grpo, gspo, cispo, gmpo, decoupled_grpo)"
            )
        return
    manager = make_manager(section, config, rule_function(section))
    if section.disrm is None and section.genrm is None:  # with servers: once they are up
        probe_reward(manager, config)
