"""Config -> parts: the policy model, the inference backend, the rollout engine, the
algorithm and the trainer settings. Each builder raises :class:`RunError` naming the
config field when the config asks for something that cannot be built."""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ludic.agents import Agent, ReActAgent, ToolAgent
from ludic.context import ContextStrategy, FullDialog, LatestObservation
from ludic.inference import (
    ChatClient,
    HFChatTemplate,
    InferenceSpec,
    ReturnSpec,
    SamplingSpec,
)
from ludic.inference.agent_endpoint import AgentEndpoint
from ludic.interaction import MultiAgentProtocol, SingleAgentProtocol
from ludic.interaction.program import ProgramProtocol
from ludic.run.config import PRESET_FIELDS, RunConfig
from ludic.run.errors import RunError
from ludic.run.registries import (
    ALGORITHM,
    ALGORITHMS,
    CREDIT_ASSIGNER,
    ENV,
    PARSER,
    PROGRAM,
    TOOL,
    load_part,
    resolve,
)
from ludic.run.threads import update_threads
from ludic.training import (
    EnvSpec,
    ProtocolSpec,
    RLAlgorithm,
    RolloutEngine,
    RolloutRequest,
    TrainerConfig,
)
from ludic.training.batching import SampleFilter
from ludic.training.credit_assignment import GroupNormalizedReturn
from ludic.training.filters import drop_version_span
from ludic.training.losses import CompositeLoss, EntropyBonus, KLPenalty, Loss
from ludic.training.losses.composite import CompositeTerm
from ludic.training.reward_credit import RewardModelCreditAssigner
from ludic.training.reward_model.config import PreferenceTrainerConfig
from ludic.training.types import CreditAssigner

ENV_NAME = "env"
PROTOCOL_NAME = "single_agent"


def make_engine(
    config: RunConfig,
    client: ChatClient,
    template: HFChatTemplate,
    *,
    env_overrides: Mapping[str, Any] | None = None,
    on_episode: Sequence[Callable[[list[Any]], None]] = (),
) -> RolloutEngine:
    """One env kind and one single-agent protocol, built fresh for every episode;
    ``on_episode`` callbacks see each episode's rollouts as it ends (the reward loop)."""
    parser = load_part(PARSER, config.agent.parser, field="agent.parser")
    field = "env.kwargs" if env_overrides is None else "env.eval_kwargs"

    def make_env():
        return build_env(config, env_overrides, field=field)

    if config.agent.kind == "program":
        make_protocol = program_protocol(config, client, template)
    elif config.agent.protocol == "multi_agent":
        make_agent = agent_factory(config, client, template, parser)
        agent_ids = list(make_env().agent_ids)

        def make_protocol() -> Any:
            # one agent object per player (agents hold per-episode state), one policy
            return MultiAgentProtocol({aid: make_agent() for aid in agent_ids})
    else:
        make_agent = agent_factory(config, client, template, parser)

        def make_protocol() -> Any:
            return SingleAgentProtocol(make_agent())

    make_env()  # fail now, with the field named, rather than inside the first episode
    return RolloutEngine(
        {ENV_NAME: make_env},
        {PROTOCOL_NAME: make_protocol},
        timeout_s=config.env.episode_timeout_s,
        env_calls="thread" if config.env.run_in_thread else "inline",
        on_episode=on_episode,
    )


def program_protocol(
    config: RunConfig, client: ChatClient, template: HFChatTemplate
) -> Callable[[], Any]:
    """``agent.program`` behind the :class:`AgentEndpoint` of ``client`` (one per client,
    started on the first episode: a daemon thread that ends with the process)."""
    assert config.agent.program is not None
    program = load_part(PROGRAM, config.agent.program, field="agent.program")
    try:
        import openai  # noqa: F401  (the programs' client)
        import uvicorn  # noqa: F401  (the endpoint's server)
    except ImportError as e:
        raise RunError(
            f"agent.kind=program needs the openai SDK and uvicorn ({e}): pip install "
            "'ludic-rl[agents]'"
        ) from None
    key = (id(client), config.agent.program_host)
    endpoint = _ENDPOINTS.get(key)
    if endpoint is None or endpoint.client is not client:
        endpoint = _ENDPOINTS[key] = AgentEndpoint(
            client,
            template,
            host=config.agent.program_host,
            structured_outputs=config.inference.backend == "vllm",
        )
    return lambda: ProgramProtocol(program, endpoint)


_ENDPOINTS: dict[tuple[int, str], AgentEndpoint] = {}
"""One endpoint per inference client (the training and the evaluation engines share it)."""


def agent_factory(
    config: RunConfig, client: ChatClient, template: HFChatTemplate, parser: Any
) -> Callable[[], Any]:
    """A function building a fresh agent of ``agent.kind`` (the tools are loaded now, so a
    bad ``agent.tools`` entry is reported before the run)."""
    a = config.agent
    common = dict(
        client=client,
        parser=parser,
        chat_template=template,
        incomplete_completion_penalty=a.incomplete_completion_penalty,
    )
    if a.kind == "plain":
        return lambda: Agent(context=make_context(config), **common)
    tools = [load_part(TOOL, spec, field="agent.tools") for spec in a.tools]
    tool_kwargs = dict(
        common,
        tools=tools,
        max_tool_calls=a.max_tool_calls,
        tool_error_penalty=a.tool_error_penalty,
    )
    if a.kind == "react":
        tool_kwargs["max_react_steps"] = a.max_react_steps
    cls = ReActAgent if a.kind == "react" else ToolAgent
    try:
        cls(context=make_context(config), **tool_kwargs)
    except (TypeError, ValueError) as e:  # e.g. a tool without usable type hints
        raise RunError(f"agent.tools: {e}") from None
    return lambda: cls(context=make_context(config), **tool_kwargs)


def make_context(config: RunConfig) -> ContextStrategy:
    """A fresh context strategy of ``agent.context`` with ``agent.system_prompt``."""
    kind = FullDialog if config.agent.context == "full_dialog" else LatestObservation
    return kind(system_prompt=config.agent.system_prompt)


def sampling_spec(config: RunConfig, *, greedy: bool = False) -> InferenceSpec:
    s = config.sampling
    extra = {} if s.structured_outputs is None else {"structured_outputs": s.structured_outputs}
    if greedy:
        return InferenceSpec(
            SamplingSpec(temperature=0.0, max_tokens=s.max_tokens),
            ReturnSpec.for_eval(),
            extra=extra,
        )
    return InferenceSpec(
        SamplingSpec(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens
        ),
        extra=extra,
    )


def make_requests(
    config: RunConfig, seeds: range | list[int], inference: InferenceSpec
) -> list[RolloutRequest]:
    return [
        RolloutRequest(
            EnvSpec(ENV_NAME),
            ProtocolSpec(PROTOCOL_NAME),
            env_seed=seed,
            inference=inference,
            max_steps=config.agent.max_steps,
        )
        for seed in seeds
    ]


def batch_requests(config: RunConfig, index: int) -> list[RolloutRequest]:
    """The requests of batch ``index`` (the step that will train on it): problems
    ``index * prompts_per_step`` onwards, each with a sampling seed derived from the run's
    seed and its env seed. A function of the index alone, so a resumed run, an async run
    and every pipeline actor see exactly the problems an uninterrupted sync run would."""
    per_step = config.trainer.prompts_per_step
    first = index * per_step
    base = sampling_spec(config)
    return [
        replace(req, inference=base.with_seed(config.seed * 1_000_003 + req.env_seed))
        for req in make_requests(config, range(first, first + per_step), base)
    ]


def make_algorithm(config: RunConfig, *, reward_client: Any = None) -> RLAlgorithm:
    """The configured ``make_*`` preset. ``group_size`` goes to presets that take it,
    Dr. GRPO's constant normalizer defaults to ``sampling.max_tokens``, and ``reward_rl``
    gets ``reward_client`` (``None``: no scoring hook, for a trainer whose rollouts are
    scored elsewhere) and the ``reward`` section's mode, weight and normalize. The
    clip and off-policy fields of ``algorithm`` (``PRESET_FIELDS``) written in the config
    are passed by name; one the preset does not take is an error naming the field."""
    name = config.algorithm.name
    preset: Callable[..., RLAlgorithm] = load_part(ALGORITHM, name, field="algorithm.name")
    params = _parameters_of(preset)
    kwargs = dict(config.algorithm.kwargs)
    for field in PRESET_FIELDS:
        if field not in config.algorithm.model_fields_set:
            continue
        if field not in params:
            takers = [n for n in sorted(ALGORITHMS) if field in _preset_params(n)]
            raise RunError(
                f"algorithm.{field} is set but algorithm.name={name!r} does not take it; "
                f"presets that do: {takers}. Remove algorithm.{field} or pick one of those"
            )
        kwargs[field] = getattr(config.algorithm, field)
    if "group_size" in params:
        kwargs.setdefault("group_size", config.algorithm.group_size)
    if "max_tokens" in params:
        kwargs.setdefault("max_tokens", config.sampling.max_tokens)
    if "reward_client" in params:  # None: scored elsewhere (a pipeline learner; preflight)
        if config.reward is None:
            raise RunError(
                f"algorithm.name={config.algorithm.name!r} needs a reward model: set reward.path"
            )
        kwargs["reward_client"] = reward_client
        kwargs.setdefault("mode", config.reward.mode)
        kwargs.setdefault("weight", config.reward.weight)
        kwargs.setdefault("normalize", config.reward.normalize)
    try:
        algorithm = preset(**kwargs)
    except (TypeError, ValueError) as e:
        raise RunError(
            f"algorithm settings for {name!r} (algorithm.*, algorithm.kwargs): {e}"
        ) from None
    if not isinstance(algorithm, RLAlgorithm):
        raise RunError(
            f"algorithm.name: {name!r} returned {type(algorithm).__name__}, not an "
            "RLAlgorithm (ludic.training.RLAlgorithm(name, credit_assigner, loss))"
        )
    if config.algorithm.credit_assigner is not None:
        algorithm = replace(algorithm, credit_assigner=make_credit_assigner(config))
    if config.algorithm.negative_group_coef > 0:
        algorithm = replace(algorithm, credit_assigner=with_negative_groups(algorithm, config))
    if config.algorithm.kl_coef > 0 or config.algorithm.entropy_coef > 0:
        algorithm = replace(algorithm, loss=with_regularizers(algorithm.loss, config))
    return algorithm


def with_negative_groups(algorithm: RLAlgorithm, config: RunConfig) -> CreditAssigner:
    """The algorithm's group-relative credit (``GroupNormalizedReturn``, or reward_rl's
    grouped ``RewardModelCreditAssigner``) with ``algorithm.negative_group_coef``; a preset
    with other credit is an error naming the field."""
    credit = algorithm.credit_assigner
    coef = config.algorithm.negative_group_coef
    grouped = isinstance(credit, GroupNormalizedReturn) or (
        isinstance(credit, RewardModelCreditAssigner) and credit.group_normalize
    )
    if not grouped:
        raise RunError(
            f"algorithm.negative_group_coef={coef} needs group-relative credit, but "
            f"algorithm.name={config.algorithm.name!r} assigns it with "
            f"{type(credit).__name__}; set algorithm.negative_group_coef=0 or use grpo, "
            "dr_grpo, gspo, cispo, gmpo, decoupled_grpo or reward_rl"
        )
    return replace(credit, negative_group_coef=coef)


def with_regularizers(loss: Loss, config: RunConfig) -> Loss:
    """``loss`` plus, when set, ``algorithm.kl_coef`` times the ``algorithm.kl_estimator``
    KL to the reference model and ``algorithm.entropy_coef`` times the entropy bonus (stats
    as ``policy/...``, ``kl/...`` and ``entropy/...``)."""
    a = config.algorithm
    terms: list[CompositeTerm] = [("policy", 1.0, loss)]
    if a.kl_coef > 0:
        terms.append(("kl", 1.0, KLPenalty(beta=a.kl_coef, estimator=a.kl_estimator)))
    if a.entropy_coef > 0:
        terms.append(("entropy", 1.0, EntropyBonus(coef=a.entropy_coef)))
    return CompositeLoss(terms)


def make_credit_assigner(config: RunConfig) -> CreditAssigner:
    """``algorithm.credit_assigner`` built with ``algorithm.credit_assigner_kwargs`` (and
    ``group_size`` when it takes one), checked to have ``compute(rollouts)``."""
    value = config.algorithm.credit_assigner
    assert value is not None
    factory = load_part(CREDIT_ASSIGNER, value, field="algorithm.credit_assigner")
    kwargs = dict(config.algorithm.credit_assigner_kwargs)
    if "group_size" in _parameters_of(factory):
        kwargs.setdefault("group_size", config.algorithm.group_size)
    try:
        assigner = factory(**kwargs)
    except (TypeError, ValueError) as e:
        raise RunError(
            f"algorithm.credit_assigner_kwargs: {value!r} refused {kwargs}: {e}"
        ) from None
    if not isinstance(assigner, CreditAssigner):
        raise RunError(
            f"algorithm.credit_assigner: {value!r} returned {type(assigner).__name__}, which "
            "has no compute(rollouts) -> list[list[float]]"
        )
    return assigner


def _parameters_of(factory: Callable[..., Any]) -> Mapping[str, inspect.Parameter]:
    try:
        return inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no signature (a builtin): pass only what is written
        return {}


def _preset_params(name: str) -> Mapping[str, inspect.Parameter]:
    return _parameters_of(resolve("algorithm", name, ALGORITHMS))


def rl_sample_filter(config: RunConfig) -> SampleFilter | None:
    """The staleness validator of ``trainer.max_version_span``: drop items whose tokens
    straddle more weight updates (None: keep every item)."""
    span = config.trainer.max_version_span
    return None if span is None else drop_version_span(span)


def _run_level(config: RunConfig, pad_token_id: int) -> dict[str, Any]:
    """The ``TrainerConfig`` fields set outside the trainer section."""
    return dict(
        pad_token_id=pad_token_id,
        update_threads=update_threads(
            config, processes=int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        ),
        gradient_checkpointing=config.model.gradient_checkpointing,
        seed=config.seed,
        device=config.model.device,
        dtype=None if config.model.dtype == "float32" else config.model.dtype,
    )


def rl_trainer_config(config: RunConfig, pad_token_id: int) -> TrainerConfig:
    """The RL phase's settings: ``trainer.*`` (:data:`~ludic.run.config.TRAINER_SETTINGS`)
    and the run-level fields."""
    return config.trainer.trainer_config(**_run_level(config, pad_token_id))


WARM_START_SHARED = (
    "max_grad_norm",
    "max_tokens_per_microbatch",
    "shared_prefix",
    "packing",
    "logprobs",
    "logprob_chunk_tokens",
)
"""Trainer settings the warm start takes from ``trainer.*``; the rest are its own
(``warm_start.lr``, ``warm_start.steps``) or ``TrainerConfig``'s defaults."""


def warm_start_trainer_config(config: RunConfig, pad_token_id: int) -> TrainerConfig:
    """The SFT warm start's settings: ``warm_start.lr`` over ``warm_start.steps``, and the
    micro-batching and logprob settings of ``trainer.*`` (:data:`WARM_START_SHARED`)."""
    w = config.warm_start
    shared = {name: getattr(config.trainer, name) for name in WARM_START_SHARED}
    return TrainerConfig(
        lr=w.lr, total_steps=max(w.steps, 1), **shared, **_run_level(config, pad_token_id)
    )


def build_env(
    config: RunConfig, overrides: Mapping[str, Any] | None = None, *, field: str = "env.kwargs"
) -> Any:
    """The configured env built with ``env.kwargs`` updated by ``overrides``; a constructor
    that refuses its arguments raises :class:`RunError` naming ``field``, the env kind and
    the parameters the constructor takes."""
    kind = config.env.kind
    factory = load_part(ENV, kind, field="env.kind")
    try:
        env = factory(**{**config.env.kwargs, **(overrides or {})})
    except TypeError as e:
        if not _is_signature_error(e, factory):
            raise RunError(f"{field}: env {kind!r}: {e}") from None
        raise RunError(
            f"{field}: env {kind!r} ({_name(factory)}) {_short(e)}; it takes {_parameters(factory)}"
        ) from None
    except (ValueError, FileNotFoundError) as e:
        raise RunError(f"{field}: env {kind!r}: {e}") from None
    missing = [name for name in ("agent_ids", "reset", "step") if not hasattr(env, name)]
    if missing:
        raise RunError(
            f"env.kind: {kind!r} built a {type(env).__name__} without {missing}, not an "
            "environment; it must be a LudicEnv (subclass ludic.envs.SingleAgentEnv or "
            "ludic.envs.LudicEnv)"
        )
    return env


def _is_signature_error(error: TypeError, factory: Callable[..., Any]) -> bool:
    text = str(error)
    return "argument" in text and (_name(factory) in text or "__init__" in text)


def _short(error: TypeError) -> str:
    """``X.__init__() got an unexpected keyword argument 'foo'`` -> ``got an unexpected
    keyword argument 'foo'``."""
    return re.sub(r"^[\w.<>]+\(\)\s*", "", str(error))


def _name(factory: Callable[..., Any]) -> str:
    return getattr(factory, "__qualname__", type(factory).__name__)


def _parameters(factory: Callable[..., Any]) -> str:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return "arguments its documentation lists"
    named = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    extra = " (and more keyword arguments)" if any(p.kind == p.VAR_KEYWORD for p in params) else ""
    return f"{named}{extra}"


def reward_trainer_config(config: RunConfig) -> PreferenceTrainerConfig:
    """The reward-model job's settings: ``reward_model.*``
    (:data:`~ludic.run.config_reward.REWARD_TRAINER_SETTINGS`) and the run's seed."""
    return config.reward_model.trainer_config(seed=config.seed)
