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

import contextlib
import inspect
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ludic.run.config import RunConfig
from ludic.run.errors import RunError
from ludic.run.registries import ENVS, PARSERS, load_function, resolve


def check_config(config: RunConfig) -> None:
    """Raise :class:`RunError` naming the field if any part of ``config`` cannot be built."""
    if config.task == "reward_model":
        _check_reward_model(config)
        return
    check_device("model.device", config.model.device)
    check_model_path("model.path", config.model.path)
    if config.reward is not None:
        reward_model_folder(config.reward.path)
    resolve("parser", config.agent.parser, PARSERS)
    env = build_env(config)
    build_env(config, config.env.eval_kwargs, field="env.eval_kwargs")
    _check_holdout(config)
    _check_agent(config, env)
    _check_algorithm(config)
    _check_trainer_configs(config)
    from ludic.run.reward_loop import check_reward_loop  # (it imports the builders)

    check_reward_loop(config)


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


def local_path(path: str) -> Path | None:
    """The local path ``path`` names (``~`` expanded), or ``None`` for a hub id such as
    ``Qwen/Qwen2.5-0.5B-Instruct``: a path that exists, starts with ``.``, ``/`` or ``~``,
    or has more than one ``/`` is local."""
    local = Path(path).expanduser()
    looks_local = local.exists() or path.startswith((".", "/", "~")) or path.count("/") > 1
    return local if looks_local else None


def check_model_path(field: str, path: str | None) -> None:
    """A ``path`` that names a local folder must exist (hub ids pass through)."""
    if path is None:
        return
    local = local_path(path)
    if local is not None and not local.is_dir():
        raise RunError(f"{field}: folder {path!r} does not exist")


def reward_model_folder(path: str) -> Path:
    """``reward.path`` as a folder holding a saved reward model (a ``config.json``)."""
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise RunError(
            f"reward.path: {path!r} is not a model folder (no config.json); train one with a "
            "task: reward_model run and point at its RUN_DIR/reward_model"
        )
    return folder


@contextlib.contextmanager
def naming_load_errors(field: str, path: str) -> Iterator[None]:
    """Any failure loading a model from ``path`` becomes a :class:`RunError` naming
    ``field``, the path and the error type (a corrupt weights file raises safetensors'
    ``SafetensorError``, which names no file)."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 (OSError, ValueError, SafetensorError, ...)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise RunError(
            f"{field}: cannot load {path!r} ({type(e).__name__}: {first}); check the folder "
            "holds a complete save_pretrained checkpoint"
        ) from None


def build_env(
    config: RunConfig, overrides: Mapping[str, Any] | None = None, *, field: str = "env.kwargs"
) -> Any:
    """The configured env built with ``env.kwargs`` updated by ``overrides``; a constructor
    that refuses its arguments raises :class:`RunError` naming ``field``, the env kind and
    the parameters the constructor takes."""
    kind = config.env.kind
    factory = resolve("env", kind, ENVS)
    try:
        return factory(**{**config.env.kwargs, **(overrides or {})})
    except TypeError as e:
        if not _is_signature_error(e, factory):
            raise RunError(f"{field}: env {kind!r}: {e}") from None
        raise RunError(
            f"{field}: env {kind!r} ({_name(factory)}) {_short(e)}; it takes {_parameters(factory)}"
        ) from None
    except (ValueError, FileNotFoundError) as e:
        raise RunError(f"{field}: env {kind!r}: {e}") from None


def _check_agent(config: RunConfig, env: Any) -> None:
    """The tools load, and the protocol fits the env's number of agents."""
    for spec in config.agent.tools:
        try:
            load_function(spec, field="agent.tools")
        except (ValueError, FileNotFoundError, ImportError, SyntaxError) as e:
            raise RunError(str(e) if "agent.tools" in str(e) else f"agent.tools: {e}") from None
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
    from ludic.run.builders import make_algorithm

    # reward_rl needs a reward client; the real one starts with the run, so a stand-in
    # object checks the preset's other arguments now.
    make_algorithm(config, reward_client=_RewardClientStandIn())


def _check_trainer_configs(config: RunConfig) -> None:
    from ludic.run.builders import rl_trainer_config, warm_start_trainer_config

    _trainer_config("trainer", lambda: rl_trainer_config(config, 0))
    if config.warm_start.steps > 0:
        _trainer_config("warm_start", lambda: warm_start_trainer_config(config, 0))


def _check_reward_model(config: RunConfig) -> None:
    rm = config.reward_model
    check_device("reward_model.device", rm.device)
    check_model_path("reward_model.path", rm.path)
    from ludic.run.reward_job import reward_trainer_config

    _trainer_config("reward_model", lambda: reward_trainer_config(config))


def _trainer_config(section: str, build: Callable[[], Any]) -> None:
    """Build a trainer config; its ``TrainerConfig.x=...`` errors become ``section.x``."""
    try:
        build()
    except ValueError as e:
        text = re.sub(r"\b\w*TrainerConfig\.", f"{section}.", str(e))
        raise RunError(text if text.startswith(section) else f"{section}: {text}") from None


class _RewardClientStandIn:
    """Takes the place of the reward client while the preset's arguments are checked."""

    async def score_batch(self, inputs: Any, *, normalize: bool = True) -> list[float]:
        raise RuntimeError("the preflight stand-in reward client scores nothing")


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
