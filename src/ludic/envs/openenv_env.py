"""OpenEnv environments: ``env.kind: openenv`` (docs/envs/openenv.md).

:class:`OpenEnvEnv` plays one episode per WebSocket session through the environment's
client (``GenericEnvClient``, or your ``EnvClient`` subclass): the policy's text fills the
action's ``action_field``, the observation is shown as text, the reward is the
environment's own, ``done`` ends the episode. The server is one already running
(``base_url``) or the ``environment`` class (with its ``action`` and ``observation``
classes), which ludic serves on a free loopback port, once per process. Needs the
``openenv`` extra.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections.abc import Mapping
from typing import Any

import httpx
from pydantic import ValidationError

from ludic._imports import absolute_spec, load_object
from ludic.envs.single_agent_env import DEFAULT_AGENT_ID, SingleAgentEnv
from ludic.envs.templates import fill_template
from ludic.inference.asgi import serve_in_thread
from ludic.types import AgentId, Info, Observation, StepOutcome

RESERVED_FIELDS = ("done", "reward", "metadata")
"""Fields every OpenEnv observation has; the rest is what the policy is shown."""


def _openenv_core() -> Any:
    try:
        import openenv.core as core
    except ImportError as e:
        raise ImportError("env.kind openenv needs OpenEnv: pip install 'ludic-rl[openenv]'") from e
    return core


class OpenEnvEnv(SingleAgentEnv):
    """One OpenEnv episode per ludic episode, over one WebSocket session.

    Args:
        base_url: a running OpenEnv server (``http://host:port``); or
        environment: the ``Environment`` class (or a factory), as ``module:attr`` or
            ``file.py:attr``, served by ludic on loopback with ``action`` and
            ``observation`` (its model classes) and ``environment_kwargs``.
        client: the ``EnvClient`` subclass that speaks to it (default OpenEnv's
            ``GenericEnvClient``, which sends the action as a plain dict).
        action_field: the action's field the policy's text fills (default: the action's
            one field, read from the server's ``/schema``).
        observation_template: a ``str.format`` template over the observation's fields
            (default: the one field's text, or the fields as JSON).
        action: the ``Action`` class; with ``base_url`` optional, but then text is checked
            only against the type in the server's schema before it is sent.
        invalid_action_reward: the reward of text that is not a valid action (checked
            before anything is sent: by the action class, the typed client's, or the
            field's type in the schema); the episode goes on with why as the observation.
        max_sessions: the served environment's concurrent sessions (episodes at once).
        message_timeout_s: the client's wait for each reply (a dead server is an error).

    ``reset(seed)`` calls the environment's ``reset(seed=seed)``.
    """

    def __init__(
        self,
        *,
        base_url: str | None = None,
        environment: str | None = None,
        action: str | None = None,
        observation: str | None = None,
        environment_kwargs: Mapping[str, Any] | None = None,
        client: str | None = None,
        action_field: str | None = None,
        observation_template: str | None = None,
        invalid_action_reward: float = 0.0,
        max_sessions: int = 64,
        message_timeout_s: float = 60.0,
        max_episode_steps: int | None = None,
        system_prompt: str | None = None,
        agent_id: AgentId = DEFAULT_AGENT_ID,
    ) -> None:
        super().__init__(
            agent_id=agent_id, max_episode_steps=max_episode_steps, system_prompt=system_prompt
        )
        if (base_url is None) == (environment is None):
            raise ValueError(
                "name the server: base_url (one already running) or environment (with its "
                "action and observation classes, served by ludic), not both"
            )
        environment, action, observation, client = (
            None if spec is None else absolute_spec(spec)
            for spec in (environment, action, observation, client)
        )
        if environment is not None:
            if action is None or observation is None:
                raise ValueError(
                    "environment needs action and observation: its Action and Observation "
                    "classes (module:Class or file.py:Class)"
                )
            settings = json.dumps(dict(environment_kwargs or {}), sort_keys=True)
            base_url = _served(environment, action, observation, settings, max_sessions)
        elif environment_kwargs:
            raise ValueError("environment_kwargs configure a served environment; base_url is not")
        assert base_url is not None
        self.base_url = base_url.rstrip("/")
        self.client_class = (
            _openenv_core().GenericEnvClient
            if client is None
            else load_object(client, field="env.kwargs.client")
        )
        self.action_class = _action_type(self.client_class) or (
            None if action is None else load_object(action, field="env.kwargs.action")
        )
        self.action_field = action_field or _only_action_field(self.base_url)
        self.observation_template = observation_template
        self.invalid_action_reward = invalid_action_reward
        self.message_timeout_s = message_timeout_s
        self._client: Any = None

    # -- the session -------------------------------------------------------------------
    def _session(self) -> Any:
        if self._client is None:
            client = self.client_class(
                base_url=self.base_url, message_timeout_s=self.message_timeout_s
            )
            self._client = client.sync()
            self._client.connect()
        return self._client

    def close(self) -> None:
        """Ends the session (the server drops the episode's environment)."""
        client, self._client = self._client, None
        if client is not None:
            client.close()

    # -- SingleAgentEnv ----------------------------------------------------------------
    def env_reset(self, seed: int | None = None) -> tuple[Observation, Info]:
        try:
            session = self._session()
            result = session.reset() if seed is None else session.reset(seed=seed)
        except Exception as e:
            raise self._failed("reset", e) from e
        return self._render(result.observation), self._info(result)

    def env_step(self, action: str) -> StepOutcome:
        try:
            checked = self._action(action)
        except InvalidAction as e:
            return StepOutcome(
                obs=f"Invalid action: {e}",
                reward=self.invalid_action_reward,
                terminated=False,
                info={"invalid_action": True},
            )
        try:
            result = self._session().step(checked)
        except Exception as e:
            raise self._failed("step", e) from e
        return StepOutcome(
            obs=self._render(result.observation),
            reward=float(result.reward or 0.0),
            terminated=bool(result.done),
            info=self._info(result),
        )

    def _action(self, text: str) -> Any:
        """The action ``text`` makes, checked before it is sent; :class:`InvalidAction`
        says why it is none. The server's own refusal fails the episode (it cannot be told
        apart from an environment whose code raised a validation error)."""
        if self.action_class is not None:
            try:
                return self.action_class.model_validate({self.action_field: text})
            except ValidationError as e:
                reasons = (
                    f"{'.'.join(map(str, d['loc'])) or 'action'}: {d['msg']}" for d in e.errors()
                )
                raise InvalidAction("; ".join(reasons)) from None
        return {self.action_field: _typed(self.base_url, self.action_field, text)}

    def _failed(self, call: str, error: Exception) -> RuntimeError:
        """An environment that raised, a server that died: the episode fails, naming it."""
        hint = ""
        if "VALIDATION_ERROR" in str(error) and self.action_class is None:
            hint = (
                " (the server refused the action, or the environment raised a validation "
                "error; set env.kwargs.action to the Action class so that ludic checks "
                "actions before sending them)"
            )
        return RuntimeError(
            f"OpenEnv {call} on {self.base_url}: {type(error).__name__}: {error}{hint}"
        )

    # -- text --------------------------------------------------------------------------
    def _fields(self, observation: Any) -> dict[str, Any]:
        data = observation.model_dump() if hasattr(observation, "model_dump") else observation
        return {k: v for k, v in dict(data or {}).items() if k not in RESERVED_FIELDS}

    def _render(self, observation: Any) -> str:
        fields = self._fields(observation)
        if self.observation_template is not None:
            return fill_template(
                "observation_template", self.observation_template, fields, "the observation"
            )
        if len(fields) == 1:
            return str(next(iter(fields.values())))
        return json.dumps(fields, sort_keys=True, default=str)

    def _info(self, result: Any) -> Info:
        observation = result.observation
        metadata = getattr(observation, "metadata", None)
        if metadata is None and isinstance(observation, Mapping):
            metadata = observation.get("metadata")
        info: dict[str, Any] = {}
        for source in (metadata, result.metadata):
            for key, value in dict(source or {}).items():
                try:
                    json.dumps(value)
                except (TypeError, ValueError):
                    continue
                info[str(key)] = value
        return info


class InvalidAction(ValueError):
    """Text that is not a valid action; the message says why."""


def _action_type(client_class: type) -> Any:
    """The client's Action model (an ``EnvClient[Action, ...]`` subclass), or None for
    a client of plain dicts."""
    for base in getattr(client_class, "__orig_bases__", ()):
        args = getattr(base, "__args__", ())
        if args and isinstance(args[0], type) and hasattr(args[0], "model_validate"):
            return args[0]
    return None


@functools.lru_cache(maxsize=32)
def _action_schema(base_url: str) -> dict[str, Any]:
    """The action's JSON schema, from the server's ``/schema``."""
    try:
        schema = httpx.get(f"{base_url}/schema", timeout=30.0).raise_for_status().json()
    except httpx.HTTPError as e:
        raise ValueError(
            f"could not read the action's schema from {base_url}/schema ({e}); is the "
            "OpenEnv server up?"
        ) from None
    return dict(schema.get("action") or {})


def _only_action_field(base_url: str) -> str:
    """The action's one field besides ``metadata``."""
    fields = [f for f in _action_schema(base_url).get("properties", {}) if f != "metadata"]
    if len(fields) != 1:
        raise ValueError(
            f"the action has fields {fields}; set action_field to the one the policy's text fills"
        )
    return fields[0]


def _typed(base_url: str, field: str, text: str) -> Any:
    """``text`` as the JSON type the action's schema gives ``field`` (integer, number,
    boolean, string); :class:`InvalidAction` when it is not one."""
    kind = _action_schema(base_url).get("properties", {}).get(field, {}).get("type")
    value = text.strip()
    if kind == "integer" and re.fullmatch(r"[+-]?\d+", value):
        return int(value)
    if kind == "number" and re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", value):
        return float(value)
    if kind == "boolean" and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if kind in ("integer", "number", "boolean"):
        raise InvalidAction(f"{field} must be {'an' if kind == 'integer' else 'a'} {kind}")
    return text


_servers: dict[tuple[str, ...], str] = {}
_servers_lock = threading.Lock()


def _served(environment: str, action: str, observation: str, settings: str, sessions: int) -> str:
    """The base URL of ``environment`` served on loopback (started once per process)."""
    key = (environment, action, observation, settings, str(sessions))
    with _servers_lock:
        if key in _servers:
            return _servers[key]
        _openenv_core()
        from openenv.core.env_server import create_fastapi_app

        env_class = load_object(environment, field="env.kwargs.environment")
        kwargs = json.loads(settings)
        factory = functools.partial(env_class, **kwargs) if kwargs else env_class
        action_class = load_object(action, field="env.kwargs.action")
        observation_class = load_object(observation, field="env.kwargs.observation")
        try:
            app = create_fastapi_app(
                factory, action_class, observation_class, max_concurrent_envs=sessions
            )
        except Exception as e:
            if type(e).__name__ != "ConcurrencyConfigurationError":
                raise
            raise ValueError(
                f"{e}; ludic plays many episodes at once: mark {environment} "
                "SUPPORTS_CONCURRENT_SESSIONS = True"
            ) from None
        _, _, port = serve_in_thread(
            _quiet_disconnects(app), host="127.0.0.1", port=0, name="ludic-openenv"
        )
        _servers[key] = url = f"http://127.0.0.1:{port}"
        return url


def _quiet_disconnects(app: Any) -> Any:
    """``app`` without the traceback OpenEnv's server logs when a client ends its session
    (it closes a WebSocket the client already closed)."""

    async def quiet(scope: Any, receive: Any, send: Any) -> None:
        try:
            await app(scope, receive, send)
        except Exception as e:
            if scope.get("type") != "websocket" or type(e).__name__ != "WebSocketDisconnect":
                raise

    return quiet
